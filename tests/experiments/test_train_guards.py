"""Guards of `specjax train`: numbers that cannot work are rejected before any compilation, a
diverging run stops before it checkpoints non-finite weights, a metrics line truncated by a
kill does not block resume, and an unwritable checkpoint directory ends the process with a
clear error instead of hanging it."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from support import Killed, child_env, kill_after_first_checkpoint, tiny_experiment

from specjax.errors import CheckpointError, ConfigError
from specjax.experiments import override
from specjax.experiments.grpo import run
from specjax.rl import ArithmeticTask

ROOT = Path(__file__).resolve().parents[2]


def _saved_float_leaves(run_dir) -> dict[int, list[np.ndarray]]:
  """Every float array of every checkpointed state, read back from disk as saved."""
  directory = Path(run_dir) / "checkpoints"
  steps = sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
  reader = ocp.PyTreeCheckpointer()
  return {step: [x for x in jax.tree.leaves(reader.restore(directory / str(step) / "state"))
                 if np.issubdtype(np.asarray(x).dtype, np.floating)] for step in steps}


@pytest.mark.parametrize("field, value, allowed", [
    ("optim.learning_rate", float("nan"), "finite number > 0"),
    ("optim.learning_rate", float("inf"), "finite number > 0"),
    ("optim.learning_rate", 0.0, "finite number > 0"),
    ("optim.max_grad_norm", float("nan"), "finite number > 0"),
    ("checkpoint.keep", 0, "int >= 1"),
    ("steps", 2.5, "int >= 1"),
    ("rollout.prompts_per_step", 0, "int >= 1"),
    ("optim.warmup_steps", -1, "int >= 0"),
    ("eval.speedup_seconds", -1.0, "finite number >= 0"),
    ("eval.speedup_seconds", float("inf"), "finite number >= 0"),
    ("eval.arms_every", -1, "int >= 0"),
])
def test_invalid_numbers_are_rejected_at_config_time_naming_field_value_and_rule(
    tmp_path, field, value, allowed):
  with pytest.raises(ConfigError, match=rf"^{re.escape(field)}={value!r} is invalid: must be "
                                        rf"an? {allowed}"):
    tiny_experiment(tmp_path, {field: value})


@dataclasses.dataclass(frozen=True)
class _NaNRewardTask(ArithmeticTask):
  """A task whose reward is broken: NaN for every response."""

  def reward(self, tokens, lengths, answers):
    return jnp.full(tokens.shape[:1], jnp.nan, jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize("case, kwargs, first_bad", [
    ("nan_reward", {"task": _NaNRewardTask(max_digits=1, num_train=64, num_test=16)}, 1),
    # The first update has learning rate 0 (warmup); the second moves every weight by
    # ~1e30, and the next forward overflows.
    ("huge_learning_rate", {"optim.learning_rate": 1e30}, 2),
])
def test_diverging_run_stops_naming_the_step_and_checkpoints_only_finite_weights(
    tmp_path, case, kwargs, first_bad):
  with pytest.raises(FloatingPointError, match=r"diverged at GRPO step (\d+): non-finite") as err:
    run(tiny_experiment(tmp_path, kwargs, steps=6), log=lambda _: None)
  step = int(err.value.args[0].split("GRPO step ")[1].split(":")[0])
  assert first_bad <= step <= 4, err.value
  saved = _saved_float_leaves(tmp_path)
  assert max(saved) == step - 1, (sorted(saved), step)  # every finite step, none after
  for leaves in saved.values():
    assert all(np.isfinite(x).all() for x in leaves)
  logged = [json.loads(line)["step"] for line in
            (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert logged == list(range(1, step)), logged


@pytest.mark.slow
def test_the_rollout_arms_are_timed_along_training_every_arms_every_steps(tmp_path):
  run(tiny_experiment(tmp_path, {"eval.arms_every": 2, "rollout.compaction": 1}, steps=4),
      log=lambda _: None)
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  arms = ("rollout_s_plain", "rollout_s_spec", "rollout_s_uncompacted")
  assert [r["step"] for r in records if all(k in r for k in arms)] == [2, 4]
  assert not any(k in records[0] for k in arms)
  assert all(r[k] > 0 for r in records[1::2] for k in arms)
  assert (tmp_path / "curves.png").stat().st_size > 0


@pytest.mark.slow
def test_truncated_last_metrics_line_is_dropped_on_resume_and_a_malformed_middle_line_is_named(
    tmp_path):
  config = tiny_experiment(tmp_path, steps=1)
  with pytest.raises(Killed):
    run(config, log=kill_after_first_checkpoint)
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
    from support import tiny_experiment
    from specjax.experiments.grpo import run
    run(tiny_experiment(sys.argv[1]))
    """)


@pytest.mark.slow
def test_unwritable_checkpoint_directory_exits_nonzero_with_the_directory_named(tmp_path):
  read_only = tmp_path / "run" / "checkpoints"
  read_only.mkdir(parents=True)
  read_only.chmod(0o555)
  try:
    simulate = os.access(read_only, os.W_OK)  # root ignores the mode
    env = child_env()
    proc = subprocess.run(
        [sys.executable, "-c", _READ_ONLY_RUN, str(tmp_path / "run"), str(read_only),
         "simulate" if simulate else "chmod", str(Path(__file__).resolve().parents[1])],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
  finally:
    read_only.chmod(0o755)
  assert proc.returncode != 0, proc.stdout + proc.stderr
  assert f"CheckpointError: checkpoint step 0 cannot be written to {read_only}" in proc.stderr, (
      proc.stderr[-3000:])
  assert not any(read_only.iterdir())


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_library_step_does_not_apply_an_update_from_non_finite_rewards(poison):
  """`make_train_step` (the library path, without the CLI's checks) keeps the weights and
  optimizer moments when a reward is not finite and flags the step; with finite rewards
  (the negative control) the same step applies its update."""
  from support import TOK as SHARED_TOK
  from support import config, initial_state, optimizer, reader, reward

  from specjax.rl.trainer import make_train_step

  cfg = config(async_mode=False)
  poisoned = lambda tokens, lengths, answers: reward(tokens, lengths, answers).at[0].set(poison)
  batch = reader().batch_at(0)
  for fn, skipped in ((poisoned, 1.0), (reward, 0.0)):
    state = initial_state(cfg)
    before = jax.device_get((state.params, state.opt_state))
    step = make_train_step(cfg, fn, optimizer(), pad_id=SHARED_TOK.pad_id)
    state, metrics = step(state, batch)
    assert float(metrics["update_skipped"]) == skipped
    after = jax.device_get((state.params, state.opt_state))
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                    jax.tree.leaves(after)))
    assert same == bool(skipped)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(after)
               if np.issubdtype(np.asarray(x).dtype, np.floating))


def test_a_kept_cost_table_is_reused_only_when_intact_and_measured_at_this_runs_shapes(
    tmp_path):
  """Resuming reads `speculation_costs.json`; a damaged one, or one measured for another menu
  or batch, is named and measured again rather than rescaled or crashing the resume."""
  import dataclasses as dc

  from specjax.decoding import CostTable
  from specjax.experiments.measure import _kept_costs
  path = tmp_path / "speculation_costs.json"
  table = CostTable(batches=(16,), seconds=((1e-3,), (2e-3,)), alone=(9e-4,), setup=(0.0,),
                    switch=(0.0,))
  path.write_text(json.dumps(dc.asdict(table)))
  assert _kept_costs(path, entries=2, rows=(16,)) == (table, "")
  costs, why = _kept_costs(path, entries=2, rows=(32,))
  assert costs is None and "at batch (16,), this run has 2 at (32,)" in why
  costs, why = _kept_costs(path, entries=3, rows=(16,))
  assert costs is None and "for 2 menu entries" in why
  costs, why = _kept_costs(path, entries=2, rows=(16, 8))  # a compacting rollout's batches
  assert costs is None and "this run has 2 at (16, 8)" in why
  path.write_text('{"batches": [16], "seconds": [[0.001]')  # cut short by a kill
  costs, why = _kept_costs(path, entries=2, rows=(16,))
  assert costs is None and "damaged (JSONDecodeError" in why


def test_a_run_directory_has_one_owner_and_a_dead_owners_lock_is_taken_over(tmp_path):
  """A second run on a run directory in use is refused naming the owner, before it writes
  anything; a lock left by a process that died is taken over, naming it; the negative
  control: once the owner releases it, the directory is free again."""
  from specjax.errors import RunDirectoryInUse
  from specjax.experiments.drafter import run_drafter_training
  from specjax.experiments.drafter_config import DrafterTrainConfig
  from specjax.files import LOCK_FILE, DirectoryLock
  run_dir = tmp_path / "run"
  with DirectoryLock(run_dir):
    holder = (run_dir / LOCK_FILE).read_text()
    assert f"pid {os.getpid()}" in holder
    with pytest.raises(RunDirectoryInUse, match=rf"{run_dir} is in use by a run of host "):
      run(tiny_experiment(run_dir))
    with pytest.raises(RunDirectoryInUse, match="give this drafter training run another"):
      run_drafter_training(DrafterTrainConfig(run_dir=str(run_dir)))
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # nothing written
  with DirectoryLock(run_dir) as lock:  # released: free again
    assert lock.previous is None
  (run_dir / LOCK_FILE).write_text("host gone pid 999999999 since 2026-01-01 00:00:00")
  with DirectoryLock(run_dir) as lock:  # unlocked file of a dead process: taken over
    assert lock.previous == "host gone pid 999999999 since 2026-01-01 00:00:00"


def test_a_second_process_is_refused_while_the_first_holds_the_run_directory(tmp_path):
  """The lock holds across processes (the case that lost data: two `specjax train` on one
  --run-dir), and is free again once the holder exits."""
  from specjax.files import DirectoryLock
  hold = ("import sys, time; from specjax.files import DirectoryLock\n"
          "with DirectoryLock(sys.argv[1]):\n  print('held', flush=True); time.sleep(60)\n")
  holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, env=child_env())
  try:
    assert holder.stdout.readline().strip() == "held"
    from specjax.errors import RunDirectoryInUse
    with pytest.raises(RunDirectoryInUse, match=rf"pid {holder.pid}"):
      DirectoryLock(tmp_path).__enter__()
  finally:
    holder.kill()
    holder.wait()
  with DirectoryLock(tmp_path) as lock:  # the OS released the killed holder's lock
    assert f"pid {holder.pid}" in lock.previous


def test_a_resume_that_would_silently_change_the_run_is_refused_naming_the_fields(tmp_path):
  """A resumed `specjax train` compares its config with the run's `config.json`: a changed
  model field that keeps every shape (rope_theta: the old weights would go on under the new
  setting) is refused, naming it and the fields that may change; those (steps) are taken;
  and a directory with no checkpoint yet takes any config (the negative control)."""
  from specjax.experiments.run_record import record_config
  started = tiny_experiment(tmp_path)
  record_config(tmp_path, started)
  (tmp_path / "checkpoints" / "0").mkdir(parents=True)  # what a started run leaves
  changed = dataclasses.replace(started, model=started.model.replace(rope_theta=5e5))
  with pytest.raises(ConfigError, match=r"model.rope_theta changed since .* \(model.rope_theta: "
                                        r"10000.0 -> 500000.0\).* may change: .*steps"):
    run(changed, log=lambda _: None)
  from specjax.experiments.grpo_config import RESUMABLE_FIELDS
  from specjax.experiments.run_record import check_resume
  logs = []
  check_resume(tmp_path, dataclasses.replace(started, steps=9), RESUMABLE_FIELDS, started=True,
               defines="", log=logs.append)
  assert logs == ["resuming with changed steps"]
  check_resume(tmp_path, changed, RESUMABLE_FIELDS, started=False, defines="", log=logs.append)
  (tmp_path / "config.json").write_text("[1, 2")
  with pytest.raises(CheckpointError, match="config.json: the config this run started with "
                                            "cannot be read"):
    check_resume(tmp_path, started, RESUMABLE_FIELDS, started=True, defines="", log=print)


def test_minibatches_that_do_not_divide_the_rollout_rows_are_refused_at_config_time(
    tmp_path):
  """Caught by the update only after the warm start and the step-0 checkpoint, whose run
  directory then refused the corrected value."""
  with pytest.raises(ConfigError, match=r"^grpo\.num_minibatches=3 is invalid: must divide a "
                                        r"step's rollout rows, .* = 4 x 4 = 16"):
    tiny_experiment(tmp_path, {"grpo.num_minibatches": 3})
  tiny_experiment(tmp_path, {"grpo.num_minibatches": 8})  # the negative control


def test_responses_past_max_position_are_refused_before_the_warm_start(tmp_path):
  """The longest train prompt + max_new_tokens + tree nodes + 1 must fit the model's
  positions; the run fails naming the field before it trains or checkpoints anything."""
  config = tiny_experiment(tmp_path, {"rollout.max_new_tokens": 30})
  with pytest.raises(ConfigError, match=r"^rollout\.max_new_tokens=30 is invalid: rollouts: "
                                        r"the longest train prompt \(\d+ tokens\) \+ 30 new "
                                        r"tokens \+ 1 draft tree nodes \+ 1 = \d+ > "
                                        r"model\.max_position=32; allowed rollout\."
                                        r"max_new_tokens <= \d+"):
    run(config, log=lambda _: None)
  assert not (tmp_path / "checkpoints").exists()


def test_resuming_past_steps_is_refused_without_touching_the_run(tmp_path):
  """A run checkpointed at step 2 resumed with steps=1 would run nothing, then record
  steps=1 over the longer run's config.json and summary.json."""
  from specjax.experiments.run_record import record_config
  started = tiny_experiment(tmp_path)
  record_config(tmp_path, started)
  (tmp_path / "checkpoints" / "2").mkdir(parents=True)  # what a 2-step run leaves
  recorded = (tmp_path / "config.json").read_bytes()
  with pytest.raises(ConfigError, match=r"^steps=1 is invalid: .* holds a checkpoint at step 2, "
                                        r"past it; allowed steps >= 2"):
    run(dataclasses.replace(started, steps=1), log=lambda _: None)
  assert (tmp_path / "config.json").read_bytes() == recorded
  assert not (tmp_path / "summary.json").exists()


def test_a_run_started_before_the_config_groups_resumes_under_the_new_names(tmp_path):
  """A `config.json` recorded with the flat fields of earlier versions is read under the
  grouped names: the same run resumes without a message, a changed group field is still
  refused under its new name, and a field the record lacks counts as its default."""
  import json

  from specjax.experiments.grpo_config import LEGACY_NAMES, RESUMABLE_FIELDS
  from specjax.experiments.run_record import check_resume, config_record
  config = tiny_experiment(tmp_path, {"pipeline.async_mode": True, "grpo.tis_cap": 2.0})
  record = config_record(config)
  flat = {k: record[k] for k in ("run_dir", "seed", "task", "model", "grpo", "steps", "mesh")}
  for old, new in LEGACY_NAMES.items():  # optim.final_lr_fraction and weight_decay: not yet
    group, field = new.split(".", 1)
    flat[old] = record[group][field]
  (tmp_path / "config.json").write_text(json.dumps(flat))
  logs = []
  check_resume(tmp_path, config, RESUMABLE_FIELDS, started=True, defines="", log=logs.append,
               renamed=LEGACY_NAMES)
  assert logs == []
  check_resume(tmp_path, override(config, {"checkpoint.every": 5}), RESUMABLE_FIELDS,
               started=True, defines="", log=logs.append, renamed=LEGACY_NAMES)
  assert logs == ["resuming with changed checkpoint.every"]
  hotter = override(config, {"rollout.temperature": 0.5})
  with pytest.raises(ConfigError, match=r"^rollout.temperature changed since .*1.0 -> 0.5"):
    check_resume(tmp_path, hotter, RESUMABLE_FIELDS, started=True, defines="",
                 log=print, renamed=LEGACY_NAMES)
  decaying = override(config, {"optim.final_lr_fraction": 0.5})  # a field added since
  with pytest.raises(ConfigError, match=r"^optim.final_lr_fraction changed .*1.0 -> 0.5"):
    check_resume(tmp_path, decaying, RESUMABLE_FIELDS, started=True, defines="", log=print,
                 renamed=LEGACY_NAMES)


def test_override_names_fields_by_dotted_path_and_refuses_unknown_ones(tmp_path):
  config = tiny_experiment(tmp_path)
  changed = override(config, {"steps": 7, "rollout.temperature": 0.5, "mesh.fsdp": 2,
                              "rollout.max_new_tokens": 3})
  assert (changed.steps, changed.rollout.temperature, changed.mesh.fsdp,
          changed.rollout.max_new_tokens) == (7, 0.5, 2, 3)
  assert changed.rollout.tree_widths == config.rollout.tree_widths
  with pytest.raises(ConfigError, match=r"'sft_steps' is not a field of ExperimentConfig: "
                                        r"allowed run_dir, seed, .*warm_start"):
    override(config, {"sft_steps": 3})
  with pytest.raises(ConfigError, match=r"'warmup' is not a field of WarmStart: allowed "
                                        r"steps, batch, learning_rate, eos_fraction"):
    override(config, {"warm_start.warmup": 3})
  with pytest.raises(ConfigError, match=r"^rollout.temperature=-1.0 is invalid"):
    override(config, {"rollout.temperature": -1.0})


def test_tensorboard_scalars_are_namespaced_and_vectors_split_by_depth():
  from specjax.experiments.run_metrics import tensorboard_scalars
  record = {"step": 3, "position": 12, "reward_mean": 0.5, "accuracy": 0.25,
            "acceptance_length": 1.75, "accepted_per_depth": [0.5, 0.25], "loss": 0.1,
            "mtp_ce": [1.5, 2.0], "response_length_mean": 7.0, "rollout_tokens_per_s": 99.0,
            "step_time_s": 1.5}
  assert tensorboard_scalars(record, learning_rate=1e-4) == {
      "reward/mean": 0.5, "reward/accuracy": 0.25, "spec/acceptance_length": 1.75,
      "spec/accepted_per_depth/1": 0.5, "spec/accepted_per_depth/2": 0.25, "train/loss": 0.1,
      "train/mtp_ce/1": 1.5, "train/mtp_ce/2": 2.0, "rollout/response_length_mean": 7.0,
      "rollout/tokens_per_s": 99.0, "perf/step_time_s": 1.5, "train/learning_rate": 1e-4}


def test_a_combined_drafters_parts_are_logged_along_training_and_summarised():
  """Group drafting in front of MTP: each part's acceptance where it drafted, its share of the
  drafted row-rounds; a part that never drafted is a gap (null), never a zero."""
  from specjax.cli import summary_table
  from specjax.experiments.run_metrics import jsonable, part_acceptance, tensorboard_scalars
  from specjax.rl.rollouts import drafter_metrics
  counts = {"group_rounds": jnp.array(4), "group_tokens": jnp.array(14),
            "mtp_rounds": jnp.array(0), "mtp_tokens": jnp.array(0)}
  metrics = drafter_metrics(counts)
  assert float(metrics["acceptance_group"]) == 3.5 and np.isnan(metrics["acceptance_mtp"])
  assert (float(metrics["drafted_by_group"]), float(metrics["drafted_by_mtp"])) == (1.0, 0.0)
  assert drafter_metrics({}) == {}
  record = jsonable(metrics)
  assert record["acceptance_mtp"] is None and json.loads(json.dumps(record)) == record
  assert np.isnan(jsonable({"kl": np.float32("nan")})["kl"])  # divergence still shows
  assert tensorboard_scalars(record) == {"spec/acceptance_group": 3.5,
                                         "spec/drafted_by_group": 1.0,
                                         "spec/drafted_by_mtp": 0.0}
  history = [{"acceptance_length": 2.0, "acceptance_group": g, "acceptance_mtp": m}
             for g, m in [(None, 2.0)] * 3 + [(4.0, 2.5)] * 6 + [(5.0, 3.0)]]
  summary = part_acceptance(history)
  assert summary == {"acceptance_group_first": 4.0, "acceptance_group_last": 4.2,
                     "acceptance_mtp_first": pytest.approx(2.2),
                     "acceptance_mtp_last": pytest.approx(2.6)}
  table = summary_table({"acceptance_first": 2.0, "acceptance_last": 2.0, **summary,
                         "plain_tokens_per_s": 100.0, "spec_tokens_per_s": 150.0})
  assert "in rounds group drafted" in table and "4.200" in table
  assert "in rounds mtp drafted" in table


def test_a_task_without_held_out_prompts_is_refused_naming_it(tmp_path):
  """GSM8K from a training file alone with test_fraction 0: nothing to evaluate on."""
  from specjax.rl.gsm8k import GSM8KTask
  from specjax.tokenizer import CharTokenizer
  rows = [{"question": f"What is {i} + 1?", "answer": f"It is {i + 1}.\n#### {i + 1}"}
          for i in range(8)]
  train = tmp_path / "train.jsonl"
  train.write_text("".join(json.dumps(r) + "\n" for r in rows))
  text = "".join(r["question"] + r["answer"] for r in rows) + "Question: \nAnswer:"
  task = GSM8KTask(train, CharTokenizer("".join(sorted(set(text)))), test_fraction=0.0)
  config = tiny_experiment(tmp_path / "run", {"task": task,
                                              "model.vocab_size": task.tokenizer.vocab_size})
  with pytest.raises(ConfigError, match=r"task 'gsm8k' has no test prompts \(its test split "
                                        r"is empty\).*a test_file or test_fraction > 0"):
    run(config)
