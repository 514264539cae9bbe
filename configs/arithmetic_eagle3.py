"""GRPO with EAGLE-3 rollouts whose head starts on the wrong text and adapts online.

  specjax train --config configs/arithmetic_eagle3.py

The policy is the CPU demo's (configs/arithmetic_tiny.py). Its EAGLE-3 head is distilled
before RL from the warm-started policy's answers to a *different* problem set (two-digit
additions and subtractions with two operands) and then trained online on every GRPO step's
rollouts, detached from the policy. The summary compares, on the final policy and the same
held-out prompts, the online head's acceptance with that of its frozen starting copy
(`probe_acceptance_after` vs `probe_acceptance_after_frozen`).
"""

import runpy
from pathlib import Path

from specjax.experiments import override
from specjax.rl import ArithmeticTask


def get_config():
  base = runpy.run_path(str(Path(__file__).with_name("arithmetic_tiny.py")))["get_config"]()
  return override(base, {
      "run_dir": "runs/arithmetic_eagle3",
      "steps": 150,
      "rollout.tree_widths": (1, 1, 1),
      "drafter.name": "eagle3",
      "drafter.learning_rate": 1e-2,
      "drafter.distill_steps": 200,
      "drafter.distill_task": ArithmeticTask(max_digits=2, num_operands=2, operators="+-",
                                             test_fraction=0.3, num_test=200),
  })
