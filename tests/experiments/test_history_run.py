"""`specjax train` with history drafting: the bank survives a resume exactly, the acceptance
arms of several drafters are logged along training, and configs that cannot work are refused
naming the field."""

import json
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from support import tiny_experiment

from specjax.errors import ConfigError
from specjax.experiments.grpo import run
from specjax.experiments.run_metrics import tensorboard_scalars

ARMS = ("mtp", "group", "history", "history+mtp")


@pytest.mark.parametrize("changes, message", [
    ({"eval.arm_drafters": ("group",)}, r"eval.arm_drafters=\('group',\) is invalid: are "
                                        r"measured every eval.arms_every steps"),
    ({"eval.arm_drafters": ("history",), "eval.arms_every": 2},
     r"'history' drafts from the run's history bank, which only a run whose own drafter reads "
     r"it keeps: set drafter.name 'history' or 'history\+mtp'"),
    ({"eval.arm_drafters": ("eagle3",), "eval.arms_every": 2},
     r"'eagle3' cannot be measured along training: allowed drafters without weights"),
    ({"eval.arm_drafters": ("mtp", "mtp"), "eval.arms_every": 2},
     r"must be a tuple of distinct drafter names"),
    ({"eval.arm_drafters": ("nope",), "eval.arms_every": 2},
     r"eval.arm_drafters='nope' is invalid: allowed one of"),
    ({"eval.arm_drafters": ("mtp",), "eval.arms_every": 2, "rollout.tree_widths": (1, 1, 1)},
     r"eval.arm_drafters: 'mtp' cannot draft this run's tree: tree depth 3 is too deep"),
    ({"drafter.name": "history", "drafter.history_slots": 0},
     r"drafter.history_slots=0 is invalid: must be an int >= 1"),
    ({"drafter.name": "history", "drafter.history_recent": -1},
     r"drafter.history_recent=-1 is invalid: must be an int >= 0"),
])
def test_history_and_arm_configs_that_cannot_work_are_refused_naming_the_field(
    tmp_path, changes, message):
  with pytest.raises(ConfigError, match=message):
    tiny_experiment(tmp_path, changes)


def _bank_at(run_dir: Path, step: int) -> list[np.ndarray]:
  state = ocp.PyTreeCheckpointer().restore(run_dir / "checkpoints" / str(step) / "state")
  return [np.asarray(x) for x in jax.tree.leaves(state["history"])]


@pytest.mark.slow
def test_a_resumed_history_run_keeps_its_bank_and_logs_every_drafters_acceptance(tmp_path):
  """Killed after step 1 (a run of 1 step), then resumed to 3: the same bank and the same
  rollouts as a run of 3 steps that was not interrupted (the bank records every rollout, so
  a bank lost at the resume would differ from step 2 on). The arms log each drafter's
  acceptance every 2 steps, into metrics, TensorBoard's arm/ section and the summary."""
  changes = {"drafter.name": "history+mtp", "eval.arms_every": 2, "eval.arm_drafters": ARMS}
  whole = run(tiny_experiment(tmp_path / "whole", changes, steps=3), log=lambda _: None)
  run(tiny_experiment(tmp_path / "cut", changes, steps=1), log=lambda _: None)
  run(tiny_experiment(tmp_path / "cut", changes, steps=3), log=lambda _: None)
  for a, b in zip(_bank_at(tmp_path / "whole", 3), _bank_at(tmp_path / "cut", 3)):
    np.testing.assert_array_equal(a, b)
  assert int((_bank_at(tmp_path / "whole", 3)[2] > 0).sum()) > 0  # lengths: something kept
  lines = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
           for name in ("whole", "cut")}
  for a, b in zip(lines["whole"], lines["cut"]):
    assert a["acceptance_length"] == b["acceptance_length"]
    assert a["reward_mean"] == b["reward_mean"]
  measured = lines["whole"][1]  # step 2
  for name in ARMS:
    assert 1.0 <= measured[f"arm_acceptance_{name}"] <= 2.0  # a chain of 1: at most 2
    assert 1.0 <= measured[f"arm_tail_acceptance_{name}"] <= 2.0
    assert f"arm_acceptance_{name}" not in lines["whole"][0]  # step 1: not measured
    assert whole[f"arm_acceptance_{name}_last"] == measured[f"arm_acceptance_{name}"]
  # The history arms also draft for held-out prompts, which no bank slot holds.
  for name in ("history", "history+mtp"):
    assert 1.0 <= measured[f"arm_acceptance_{name}_unseen"] <= 2.0
    assert whole[f"arm_acceptance_{name}_unseen_last"] == measured[
        f"arm_acceptance_{name}_unseen"]
  assert "arm_acceptance_mtp_unseen" not in measured
  assert "arm/acceptance_history" in tensorboard_scalars(measured)
  assert "arm/tail_acceptance_history+mtp" in tensorboard_scalars(measured)


def test_a_bank_larger_than_half_the_device_is_refused_before_anything_is_allocated(tmp_path):
  from specjax.decoding import HistoryDrafter
  drafter = HistoryDrafter(slots=3, per_prompt=2, recent=5)
  assert drafter.bank_bytes(7) == drafter.new_bank(7).nbytes()  # counted without building it
  config = tiny_experiment(tmp_path, {"drafter.name": "history",
                                      "drafter.history_slots": 2**40})
  with pytest.raises(ConfigError, match=r"drafter.history_slots=1099511627776 x "
                                        r"history_per_prompt=8 answers of rollout.max_new_tokens="
                                        r"\d+ tokens make a history bank of [\d.]+ GiB on every "
                                        r"device, more than half of this device's"):
    run(config)
  assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
