"""Config groups that the GRPO run (`ExperimentConfig`) and the offline drafter run
(`DrafterTrainConfig`) share: one name and one check per knob.

Each group is a field of both configs under the same name (`warm_start`, `optim`,
`checkpoint`, `eval`), so a knob reads and overrides the same way in either run
(`--warm-start.steps 400`); each checks its values when it is built and names them by that
dotted path. `override` replaces fields by that path.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import optax

from specjax.checks import is_real, require_field, require_ints, require_reals
from specjax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class WarmStart:
  """The supervised warm start of the built-in arithmetic policy.

  Attributes:
    steps: warm-start steps (0: start from random weights).
    batch: examples per step.
    learning_rate: Adam learning rate.
    eos_fraction: share of examples whose answer ends with EOS; the others run on into the
      next problem, as text concatenated without separators does. Below 1 the policy often
      fails to stop (what GRPO's reward, answer then EOS, then fixes), and its responses are
      long enough to draft.
  """

  steps: int = 200
  batch: int = 64
  learning_rate: float = 3e-3
  eos_fraction: float = 1.0

  def __post_init__(self):
    require_ints(self, ("steps",), 0, "warm_start.")
    require_ints(self, ("batch",), 1, "warm_start.")
    require_reals(self, ("learning_rate",), positive=True, prefix="warm_start.")
    require_field(self, "eos_fraction", is_real(self.eos_fraction)
                  and 0 <= self.eos_fraction <= 1, "must be in [0, 1]", "warm_start.")


@dataclasses.dataclass(frozen=True)
class Optimization:
  """The optimizer's schedule and clipping: linear warmup to `learning_rate`, then cosine
  decay to `final_lr_fraction` of it (1: constant); Adam, with decoupled `weight_decay`
  (AdamW) where it is above 0.

  Attributes:
    learning_rate: peak learning rate.
    warmup_steps: steps of linear warmup from 0.
    final_lr_fraction: the learning rate at the last step, as a share of the peak.
    weight_decay: AdamW's decoupled weight decay (0: plain Adam).
    max_grad_norm: gradient clipping, the largest global norm of a step's gradient.
    master_weights: with parameters below float32 (bfloat16), keep float32 master weights
      in the optimizer state and run clipping and Adam (its moments too) in float32
      (`specjax.optimizers.float32_master`; 4 more bytes per parameter). False: update the
      parameters in their own dtype, where a step smaller than the dtype's spacing (a
      bfloat16 weight near 1 moves by 2^-7 or not at all) is lost. Float32 parameters never
      get a copy.
  """

  learning_rate: float = 1e-4
  warmup_steps: int = 10
  final_lr_fraction: float = 1.0
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  master_weights: bool = True

  def __post_init__(self):
    require_reals(self, ("learning_rate", "max_grad_norm"), positive=True, prefix="optim.")
    require_field(self, "master_weights", isinstance(self.master_weights, bool),
                  "must be True or False", "optim.")
    require_reals(self, ("weight_decay",), positive=False, prefix="optim.")
    require_ints(self, ("warmup_steps",), 0, "optim.")
    require_field(self, "final_lr_fraction", is_real(self.final_lr_fraction)
                  and 0 <= self.final_lr_fraction <= 1, "must be in [0, 1]", "optim.")

  def schedule(self, steps: int) -> optax.Schedule:
    """The learning rate at each of `steps` steps (warmup, then decay to the end)."""
    if self.final_lr_fraction == 1:  # a constant after warmup: no decay horizon needed
      return optax.linear_schedule(0.0, self.learning_rate, max(self.warmup_steps, 1))
    return optax.warmup_cosine_decay_schedule(
        0.0, self.learning_rate, self.warmup_steps, max(steps, self.warmup_steps + 1),
        end_value=self.learning_rate * self.final_lr_fraction)

  def adam(self, steps: int) -> optax.GradientTransformation:
    """Adam (AdamW with `weight_decay`) on `schedule(steps)`, without clipping."""
    if self.weight_decay:
      return optax.adamw(self.schedule(steps), weight_decay=self.weight_decay)
    return optax.adam(self.schedule(steps))


@dataclasses.dataclass(frozen=True)
class Checkpointing:
  """How often a run saves, and how many saves it keeps.

  Attributes:
    every: steps between checkpoints (the last step is always saved).
    keep: checkpoints kept, newest first (>= 1: the newest is what a resumed run starts from).
  """

  every: int = 25
  keep: int = 2

  def __post_init__(self):
    require_ints(self, ("every", "keep"), 1, "checkpoint.")


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """The held-out evaluation and the speed measurement after training.

  Attributes:
    prompts: held-out prompts evaluated.
    speedup_repeats: timed calls of each arm of a speedup measurement (median), at least.
  """

  prompts: int = 500
  speedup_repeats: int = 9

  def __post_init__(self):
    require_ints(self, ("prompts", "speedup_repeats"), 1, "eval.")


def override(config, changes: Mapping[str, Any]):
  """`config` (a config dataclass) with fields replaced by dotted name:
  `override(config, {"steps": 3, "rollout.temperature": 0.7})`. Each group with a change is
  rebuilt, and so checked, with it.

  Raises:
    ConfigError: a name that is not a field (the message lists the fields there are), or a
      value a field's check refuses.
  """
  nested: dict[str, dict[str, Any]] = {}
  direct: dict[str, Any] = {}
  names = [f.name for f in dataclasses.fields(config)]
  for name, value in changes.items():
    top, _, rest = name.partition(".")
    if top not in names:
      raise ConfigError(f"{name!r} is not a field of {type(config).__name__}: allowed "
                        f"{', '.join(names)} (a group's fields by dotted name)")
    if rest:
      nested.setdefault(top, {})[rest] = value
    else:
      direct[top] = value
  for top, inner in nested.items():
    group = direct.get(top, getattr(config, top))
    if not dataclasses.is_dataclass(group):
      raise ConfigError(f"{top}.{next(iter(inner))!r}: {top} is not a group of fields")
    direct[top] = override(group, inner)
  return dataclasses.replace(config, **direct)
