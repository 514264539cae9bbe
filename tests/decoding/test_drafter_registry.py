"""Drafters by name: a new drafter is one file and one registry line, and the command line
and GRPO configs take it by its name.

The drafter used here is the README's example, run from the README's own text, so the
example stays true.
"""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import MODEL, PROMPTS, TASK, TOK, optimizer, reader, reward, write_tiny_checkpoint

from specjax.cli import generate_command
from specjax.decoding import (DraftSource, DraftTree, MTPDrafter, SamplingConfig, build_drafter,
                              drafter_names, generate, register_drafter)
from specjax.decoding.drafters import registry
from specjax.errors import ConfigError
from specjax.experiments import Drafting, ExperimentConfig, RolloutSettings
from specjax.models import init_params
from specjax.rl.state import init_train_state
from specjax.rl.trainer import make_train_step

README = Path(__file__).resolve().parents[2] / "README.md"
MARK = "<!-- drafter-example: tests/decoding/test_drafter_registry.py runs this block -->"


@pytest.fixture
def readme_drafter(monkeypatch):
  """The README's example drafter, registered as "repeat" for this test only."""
  monkeypatch.setattr(registry, "_BUILDERS", dict(registry._BUILDERS))
  monkeypatch.setattr(registry, "_CHECKPOINTS", dict(registry._CHECKPOINTS))
  text = README.read_text()
  assert MARK in text, "the README lost its drafter example"
  block = re.search(r"```python\n(.*?)```", text[text.index(MARK):], re.S).group(1)
  assert len(block.splitlines()) <= 30
  namespace = {}
  exec(compile(block, str(README), "exec"), namespace)
  return namespace["RepeatDrafter"]


def test_a_registered_drafter_decodes_losslessly_through_generate(readme_drafter):
  """Greedy speculative output with the new drafter equals plain decoding token for token,
  and on runs of one token its drafts are accepted."""
  assert "repeat" in drafter_names()
  drafter, params = build_drafter("repeat", DraftSource(MODEL))
  assert isinstance(drafter, readme_drafter) and params is None
  policy = init_params(MODEL, jax.random.key(0))
  prompts = jnp.array([[3, 3, 3, 3], [5, 6, 7, 0]], jnp.int32)
  lengths = jnp.array([4, 3], jnp.int32)
  run = lambda **kw: generate(policy, MODEL, prompts, lengths, jax.random.key(0),
                              max_new_tokens=8, sampling=SamplingConfig(0.0), **kw)
  plain = run()
  spec = run(drafter=drafter, tree=DraftTree.chain(2))
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  np.testing.assert_array_equal(spec.lengths, plain.lengths)


def test_the_command_line_takes_a_registered_drafter_by_name(readme_drafter, tmp_path, capsys):
  write_tiny_checkpoint(tmp_path)
  generate_command(checkpoint=str(tmp_path), prompt=("a a a",), drafter="repeat",
                   widths=(1, 1), temperature=0.0, max_new_tokens=6, compare=False)
  assert "drafter repeat" in capsys.readouterr().out


def test_a_grpo_config_takes_a_registered_drafter_and_its_step_runs(readme_drafter):
  config = ExperimentConfig(task=TASK, model=MODEL, drafter=Drafting(name="repeat"),
                            rollout=RolloutSettings(tree_widths=(1,), prompts_per_step=PROMPTS,
                                                    max_new_tokens=TASK.max_answer_tokens))
  train = config.train_config()
  assert isinstance(train.rollout.drafter, readme_drafter)
  state = init_train_state(train, init_params(MODEL, jax.random.key(0)), optimizer(), seed=1)
  step = make_train_step(train, reward, optimizer(), pad_id=TOK.pad_id)
  state, metrics = step(state, reader().batch_at(0))
  assert np.isfinite(float(metrics["loss"])) and float(metrics["acceptance_length"]) >= 1
  # What the drafter cannot draft fails when the config is built, naming it.
  with pytest.raises(ConfigError, match="RepeatDrafter drafts one continuation"):
    ExperimentConfig(task=TASK, model=MODEL, drafter=Drafting(name="repeat"),
                     rollout=RolloutSettings(tree_widths=(2,)))


def test_registering_refuses_a_taken_or_reserved_name_and_a_builder_that_builds_no_drafter(
    monkeypatch):
  monkeypatch.setattr(registry, "_BUILDERS", dict(registry._BUILDERS))
  with pytest.raises(ConfigError, match="'mtp' is registered already"):
    register_drafter("mtp", lambda source: (MTPDrafter(), None))
  with pytest.raises(ConfigError, match="other than 'none'"):
    register_drafter("none", lambda source: (MTPDrafter(), None))
  register_drafter("broken", lambda source: "not a drafter")
  with pytest.raises(ConfigError, match="must return \\(a specjax.decoding.Drafter"):
    build_drafter("broken", DraftSource(MODEL))
  with pytest.raises(ConfigError, match="drafter='nope' is invalid: allowed one of none, "):
    build_drafter("nope", DraftSource(MODEL))
  with pytest.raises(ConfigError, match="'draft-model' needs its weights"):
    build_drafter("draft-model", DraftSource(MODEL))

