"""Guards of `specjax train`: numbers that cannot work are rejected before any compilation, a
diverging run stops before it checkpoints non-finite weights, a metrics line truncated by a
kill does not block resume, and an unwritable checkpoint directory ends the process with a
clear error instead of hanging it."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import child_env
from specjax.errors import CheckpointError, ConfigError
from specjax.models import ModelConfig
from specjax.rl import ArithmeticTask, GRPOConfig
from specjax.rl.experiment import ExperimentConfig, run

ROOT = Path(__file__).resolve().parents[1]
TASK = ArithmeticTask(max_digits=1, num_train=64, num_test=16)
MODEL = ModelConfig(vocab_size=TASK.tokenizer.vocab_size, d_model=32, n_layers=1, n_heads=2,
                    n_kv_heads=2, head_dim=16, mlp_dim=64, num_mtp_modules=1, max_position=32)


def _config(run_dir, **kwargs) -> ExperimentConfig:
  """A run of seconds: a tiny random policy (no warm start), one-draft MTP rollouts, a
  checkpoint every step."""
  fields = dict(run_dir=str(run_dir), task=TASK, model=MODEL, grpo=GRPOConfig(group_size=4),
                max_new_tokens=TASK.max_answer_tokens, drafter="mtp", tree_widths=(1,),
                steps=2, prompts_per_step=4, warmup_steps=0, sft_steps=0, checkpoint_every=1,
                eval_prompts=8, speedup_repeats=1, speedup_seconds=0)
  return ExperimentConfig(**(fields | kwargs))


def _saved_float_leaves(run_dir) -> dict[int, list[np.ndarray]]:
  """Every float array of every checkpointed state, read back from disk as saved."""
  directory = Path(run_dir) / "checkpoints"
  steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
  reader = ocp.PyTreeCheckpointer()
  return {step: [x for x in jax.tree.leaves(reader.restore(directory / str(step) / "state"))
                 if np.issubdtype(np.asarray(x).dtype, np.floating)] for step in steps}


@pytest.mark.parametrize("field, value, allowed", [
    ("learning_rate", float("nan"), "finite number > 0"),
    ("learning_rate", float("inf"), "finite number > 0"),
    ("learning_rate", 0.0, "finite number > 0"),
    ("max_grad_norm", float("nan"), "finite number > 0"),
    ("max_checkpoints", 0, "int >= 1"),
    ("steps", 2.5, "int >= 1"),
    ("prompts_per_step", 0, "int >= 1"),
    ("warmup_steps", -1, "int >= 0"),
    ("speedup_seconds", -1.0, "finite number >= 0"),
    ("speedup_seconds", float("inf"), "finite number >= 0"),
])
def test_invalid_numbers_are_rejected_at_config_time_naming_field_value_and_rule(
    tmp_path, field, value, allowed):
  with pytest.raises(ConfigError, match=rf"^{field}={value!r} is invalid: must be an? "
                                        rf"{allowed}"):
    _config(tmp_path, **{field: value})


@dataclasses.dataclass(frozen=True)
class _NaNRewardTask(ArithmeticTask):
  """A task whose reward is broken: NaN for every response."""

  def reward(self, tokens, lengths, answers):
    return jnp.full(tokens.shape[:1], jnp.nan, jnp.float32)


@pytest.mark.parametrize("case, kwargs, first_bad", [
    ("nan_reward", dict(task=_NaNRewardTask(max_digits=1, num_train=64, num_test=16)), 1),
    # The first update has learning rate 0 (warmup); the second moves every weight by
    # ~1e30, and the next forward overflows.
    ("huge_learning_rate", dict(learning_rate=1e30), 2),
])
def test_diverging_run_stops_naming_the_step_and_checkpoints_only_finite_weights(
    tmp_path, case, kwargs, first_bad):
  with pytest.raises(FloatingPointError, match=r"diverged at GRPO step (\d+): non-finite") as err:
    run(_config(tmp_path, steps=6, **kwargs), log=lambda _: None)
  step = int(err.value.args[0].split("GRPO step ")[1].split(":")[0])
  assert first_bad <= step <= 4, err.value
  saved = _saved_float_leaves(tmp_path)
  assert max(saved) == step - 1, (sorted(saved), step)  # every finite step, none after
  for leaves in saved.values():
    assert all(np.isfinite(x).all() for x in leaves)
  logged = [json.loads(line)["step"] for line in
            (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert logged == list(range(1, step)), logged


class _Killed(Exception):
  pass


def _kill_after_first_checkpoint(line):
  if line.startswith("held-out accuracy before RL"):  # step 0 is saved, metrics.jsonl exists
    raise _Killed


def test_truncated_last_metrics_line_is_dropped_on_resume_and_a_malformed_middle_line_is_named(
    tmp_path):
  config = _config(tmp_path, steps=1)
  with pytest.raises(_Killed):
    run(config, log=_kill_after_first_checkpoint)
  metrics = tmp_path / "metrics.jsonl"
  assert metrics.read_text() == ""
  metrics.write_text('{"step": 1, "position": 4, "rew')  # a kill in the middle of an append
  logs = []
  run(config, log=logs.append)
  assert any("resumed from" in line for line in logs), logs
  assert any("dropped the truncated last line 1" in line for line in logs), logs
  (line,) = metrics.read_text().splitlines()
  assert json.loads(line)["step"] == 1

  metrics.write_text(line[:20] + "\n" + line + "\n")  # not a kill's trace: a line follows
  with pytest.raises(CheckpointError, match=rf"{metrics} line 1 is not a JSON record"):
    run(dataclasses.replace(config, steps=2), log=lambda _: None)


_READ_ONLY_RUN = textwrap.dedent("""
    import errno, os, sys
    from pathlib import Path
    read_only, simulate = Path(sys.argv[2]), sys.argv[3] == "simulate"
    if simulate:  # root writes through 0o555: refuse writes below the directory as a
                  # read-only filesystem does
      mkdir = os.mkdir
      def refuse(path, *args, **kwargs):
        if Path(path).absolute().is_relative_to(read_only):
          raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return mkdir(path, *args, **kwargs)
      os.mkdir = refuse
    sys.path.insert(0, sys.argv[4])
    from test_train_guards import _config
    from specjax.rl.experiment import run
    run(_config(sys.argv[1]))
    """)


def test_unwritable_checkpoint_directory_exits_nonzero_with_the_directory_named(tmp_path):
  read_only = tmp_path / "run" / "checkpoints"
  read_only.mkdir(parents=True)
  read_only.chmod(0o555)
  try:
    simulate = os.access(read_only, os.W_OK)  # root ignores the mode
    env = child_env()
    proc = subprocess.run(
        [sys.executable, "-c", _READ_ONLY_RUN, str(tmp_path / "run"), str(read_only),
         "simulate" if simulate else "chmod", str(Path(__file__).parent)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
  finally:
    read_only.chmod(0o755)
  assert proc.returncode != 0, proc.stdout + proc.stderr
  assert f"CheckpointError: checkpoint step 0 cannot be written to {read_only}" in proc.stderr, (
      proc.stderr[-3000:])
  assert not any(read_only.iterdir())
