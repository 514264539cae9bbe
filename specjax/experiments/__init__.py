"""Runs: each is a config plus what it runs, measures and plans, built on the libraries below
(`models`, `decoding`, `supervised`, `rl`).

- `grpo`: a whole GRPO run (`ExperimentConfig` in `grpo_config`, what it measures in
  `measure`, and what one of its steps needs per device in `plan`).
- `drafter`: a whole offline EAGLE-3 run (`DrafterTrainConfig` in `drafter_config`, where its
  target and data come from in `drafter_data`).
- `groups`: the config groups both runs share (`WarmStart`, `Optimization`, `Checkpointing`,
  `Evaluation`) and `override`, which replaces fields by dotted name.
- `export`: a run directory read back (`load_policy`) and written as an HF checkpoint
  (`export_run`, `specjax export`).
- `demo`: the built-in counting model `specjax generate --demo` trains in a minute.
"""

from specjax.experiments.drafter import run_drafter_training
from specjax.experiments.drafter_config import (DistillData, DrafterTrainConfig, Eagle3Head,
                                                HeadEvaluation)
from specjax.experiments.export import export_run, load_policy
from specjax.experiments.groups import Checkpointing, Evaluation, Optimization, WarmStart, override
from specjax.experiments.grpo import run
from specjax.experiments.grpo_config import (Drafting, ExperimentConfig, Pipeline,
                                             RolloutEvaluation, RolloutSettings)
from specjax.experiments.metrics_log import Logging
from specjax.experiments.plan import Plan, estimate, plan

__all__ = ["Checkpointing", "DistillData", "Drafting", "DrafterTrainConfig", "Eagle3Head",
           "Evaluation", "ExperimentConfig", "export_run", "HeadEvaluation", "Logging", "load_policy",
           "Optimization", "Pipeline", "Plan", "RolloutEvaluation", "RolloutSettings",
           "WarmStart", "estimate", "override", "plan", "run", "run_drafter_training"]
