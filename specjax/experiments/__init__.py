"""Runs: each is a config plus what it runs, measures and plans, built on the libraries below
(`models`, `decoding`, `supervised`, `rl`).

- `grpo`: a whole GRPO run (`ExperimentConfig` in `grpo_config`, what it measures in
  `measure`, and what one of its steps needs per device in `plan`).
- `drafter`: a whole offline EAGLE-3 run (`DrafterTrainConfig` in `drafter_config`, where its
  target and data come from in `drafter_data`).
- `demo`: the built-in counting model `specjax generate --demo` trains in a minute.
"""

from specjax.experiments.drafter import run_drafter_training
from specjax.experiments.drafter_config import DrafterTrainConfig
from specjax.experiments.grpo import run
from specjax.experiments.grpo_config import ExperimentConfig
from specjax.experiments.plan import Plan, estimate, plan

__all__ = ["DrafterTrainConfig", "ExperimentConfig", "Plan", "estimate", "plan", "run",
           "run_drafter_training"]
