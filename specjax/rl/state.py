"""What the GRPO train step is configured with and carries from step to step.

`TrainConfig` (the policy, GRPO's settings, how rollouts are generated: `RolloutConfig`, and
how the drafter trains online: `DrafterTraining`) is static: a jit static argument of every
step program. `TrainState` is the step's carry and a run's checkpoint: parameters, optimizer
state, the reference policy, the PRNG key, async mode's pending `Rollout`, an EAGLE-3 head
with its own optimizer (`DrafterTrainState`) and the speculation policy's acceptance counts.

Shape letters: see `specjax` (B rows, P prompt buffer, T max new tokens, L = P + T, D tree
depth).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from specjax.checks import is_int, is_number, require_ints, require_reals
from specjax.decoding import Adaptive
from specjax.decoding.drafters.base import Drafter
from specjax.decoding.drafters.draft_model import DraftModelDrafter
from specjax.decoding.drafters.eagle3 import Eagle3Drafter, Eagle3Weights
from specjax.decoding.drafters.fallback import FallbackDrafter, FallbackParams
from specjax.decoding.drafters.group import group_sizes
from specjax.decoding.drafters.history import HistoryBank, history_drafter
from specjax.decoding.policy import AcceptanceCounts
from specjax.decoding.sampling import SamplingConfig
from specjax.decoding.tree import DraftTree
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.lora import LoraAdapters, LoraConfig, init_lora, merged_policy
from specjax.models.params import Params, check_params
from specjax.optimizers import float32_master
from specjax.rl.losses import GRPOConfig

# `reward_fn(responses [B, T], lengths [B], answers [B])`: `[B]` rewards, or `([B] total,
# {name: [B]} per function)`.
RewardFn = Callable[[jax.Array, jax.Array, jax.Array], Any]



def _parts(drafter: Drafter | None) -> list[Drafter]:
  """`drafter` itself, or the drafters a `FallbackDrafter` combines, all the way down."""
  if isinstance(drafter, FallbackDrafter):
    return _parts(drafter.primary) + _parts(drafter.fallback)
  return [] if drafter is None else [drafter]


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """How rollouts are generated.

  Attributes:
    max_new_tokens: T, response tokens per row at most.
    sampling: the policy's sampling distribution (temperature 1 for on-policy RL).
    drafter: a drafter, or None for plain autoregressive rollouts.
    tree: the draft tree of every round (None with no drafter, or with `speculation`).
    speculation: an `Adaptive` policy choosing each round's tree (with the drafter), with
      its measured costs (`specjax.decoding.calibrate` at the rollout's shapes).
    eos_id: end-of-response token, or a tuple of them (a row ends on any; chat checkpoints
      end a turn on one and a document on another; a list is stored as a tuple, so the
      config stays hashable). None: every response runs to max_new_tokens.
    acceptance_carry: with `speculation`, the weight in [0, 1] of the acceptance counts of
      the last rollout in the next one (`TrainState.acceptance`). 0: every rollout starts
      from the policy's prior and spends its first rounds finding out what the drafter
      accepts. Below 1 the carried evidence fades step by step, so a drafter that stopped
      paying (or was switched off) is tried again once the policy moves on.
    compaction: halvings of the rollout batch as its rows finish (`DecodeLoop.compaction`):
      with 2 the rollout runs at B rows until at most B / 2 are still generating, then at
      B / 2, then B / 4, so the long tail of a few long responses stops paying for the
      finished rows. 0: every round runs all B rows.
    success_reward: a response counts as solved (the `accuracy` metric) when its reward is at
      least this (a `DatasetTask`'s `success_reward`; 1 for the built-in tasks).
  """

  max_new_tokens: int
  eos_id: int | tuple[int, ...] | None
  sampling: SamplingConfig = SamplingConfig(1.0)
  drafter: Drafter | None = None
  tree: DraftTree | None = None
  speculation: Adaptive | None = None
  acceptance_carry: float = 0.0
  compaction: int = 0
  success_reward: float = 1.0

  def __post_init__(self):
    if not (is_number(self.success_reward) and np.isfinite(self.success_reward)):
      raise ConfigError(f"success_reward={self.success_reward!r} is invalid: must be a finite "
                        "number")
    if not (is_int(self.compaction) and self.compaction >= 0):
      raise ConfigError(f"compaction={self.compaction!r} is invalid: must be an int >= 0 "
                        "(halvings of the rollout batch as rows finish)")
    if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
      raise ConfigError(f"max_new_tokens={self.max_new_tokens!r} is invalid: must be an "
                        "int >= 1")
    object.__setattr__(self, "eos_id", _eos_ids(self.eos_id))
    carry = self.acceptance_carry
    if not is_number(carry) or not 0 <= carry <= 1:
      raise ConfigError(f"acceptance_carry={carry!r} is invalid: must be a number in [0, 1]")
    if carry and self.speculation is None:
      raise ConfigError(f"acceptance_carry={carry!r} needs speculation=Adaptive(...): only "
                        "the adaptive policy keeps acceptance counts")
    fixed = self.tree is not None and self.tree.num_nodes > 0
    if self.speculation is not None:
      if fixed or self.drafter is None:
        raise ConfigError("speculation=Adaptive(...) takes a drafter and no tree (the policy "
                          "chooses the tree)")
      if self.speculation.costs is None:
        raise ConfigError("speculation=Adaptive(...) in a rollout needs its costs: the train "
                          "step is compiled, so measure them first, Adaptive(menu, "
                          "costs=calibrate(...)) at the rollout's batch and lengths")
    elif (self.drafter is None) != (not fixed):
      raise ConfigError("drafter and tree go together: pass both, or neither for plain "
                        "rollouts")

  def carried(self, acceptance: AcceptanceCounts | None) -> AcceptanceCounts | None:
    """The counts a rollout starts from: the last rollout's `acceptance` (None: none) scaled
    by `acceptance_carry` (0: the policy's prior, zeroed counts)."""
    return None if acceptance is None else acceptance.scaled(self.acceptance_carry)


def _eos_ids(eos_id: Any) -> int | tuple[int, ...] | None:
  """`RolloutConfig.eos_id` checked: None, an id, or a non-empty tuple of ids (from a list or
  tuple, NumPy ints included), ints all. Whether they fit the vocabulary is `generate`'s
  check, which knows the model."""
  if eos_id is None:
    return None
  many = isinstance(eos_id, (list, tuple))
  ids = tuple(eos_id) if many else (eos_id,)
  bad = [i for i in ids if not is_int(i) or i < 0]
  if bad or not ids:
    raise ConfigError(f"eos_id={eos_id!r} is invalid"
                      + (f" ({', '.join(map(repr, bad))} not a token id)" if bad else "")
                      + ": must be None, a token id >= 0, or a non-empty list or tuple of them")
  return tuple(int(i) for i in ids) if many else int(eos_id)



@dataclasses.dataclass(frozen=True)
class DrafterTraining:
  """How the train step trains its drafter on the rollouts.

  Attributes:
    loss_weight: weight of the detached drafter loss (0: the drafter is not trained
      online). MTP / Medusa heads share the policy's optimizer, so this weighs their loss
      against the policy's; an EAGLE-3 head has its own optimizer and this scales its loss.
    learning_rate: Adam learning rate of an EAGLE-3 head trained online.
    ttt_steps: training-time-test steps of the EAGLE-3 loss (its draft depth).
    draft_model_learning_rate: Adam learning rate of an external draft model distilled online
      from the policy (its loss: the KL divergence from the policy's next-token
      distributions on each minibatch, times `loss_weight`); 0, the default, keeps it frozen.
      A pretrained small model wants a fine-tuning rate (1e-5 .. 1e-6), not a head's.
  """

  loss_weight: float = 1.0
  learning_rate: float = 1e-3
  ttt_steps: int = 3
  draft_model_learning_rate: float = 0.0

  def __post_init__(self):
    require_reals(self, ("loss_weight", "draft_model_learning_rate"), positive=False,
                  prefix="drafter_training.")
    require_reals(self, ("learning_rate",), positive=True, prefix="drafter_training.")
    require_ints(self, ("ttt_steps",), 1, "drafter_training.")



@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Static configuration of the train step.

  Attributes:
    model: the policy's architecture.
    grpo: GRPO hyper-parameters.
    rollout: rollout generation.
    drafter_training: the drafter's online training (`DrafterTraining`).
    async_mode: one-step off-policy (see module docstring).
    lora: train low-rank adapters on the policy's projections (`specjax.models.lora`) with
      the trunk frozen, or None (rank 0 too) to train every parameter. The frozen trunk is
      the KL reference (no copy is kept); rollouts decode with the merged policy.
  """

  model: ModelConfig
  grpo: GRPOConfig
  rollout: RolloutConfig
  drafter_training: DrafterTraining = DrafterTraining()
  async_mode: bool = False
  lora: LoraConfig | None = None

  def __post_init__(self):
    for g in group_sizes(self.rollout.drafter):
      if g not in (1, self.grpo.group_size):
        raise ConfigError(f"GroupDrafter(group_size={g}) does not match grpo.group_size="
                          f"{self.grpo.group_size}: a rollout's rows are the G answers to each "
                          "prompt, consecutive (1: each row drafts from itself)")
    weighted = (Eagle3Drafter, DraftModelDrafter)
    drafter = self.rollout.drafter
    if history_drafter(drafter) is not None and any(
        isinstance(part, weighted) for part in _parts(drafter)) and not (
            isinstance(drafter, FallbackDrafter) and history_drafter(drafter.primary)
            and not any(isinstance(part, weighted) for part in _parts(drafter.primary))):
      raise ConfigError("a HistoryDrafter beside a draft model or an EAGLE-3 head drafts as "
                        "FallbackDrafter(HistoryDrafter(...), <the model drafter>): the history "
                        "bank goes to the primary, the weights to the fallback "
                        f"(FallbackParams); got {drafter!r}")
    if self.lora is not None and not isinstance(self.lora, LoraConfig):
      raise ConfigError(f"lora={self.lora!r} is invalid: must be a LoraConfig(rank=, alpha=, "
                        "targets=) or None")
    if self.lora is not None and not self.lora.enabled:
      object.__setattr__(self, "lora", None)
    heads = self.model.num_mtp_modules or self.model.num_medusa_heads
    if self.lora is not None and heads and self.drafter_training.loss_weight:
      raise ConfigError(
          "lora with MTP / Medusa heads trained online cannot work: with adapters the "
          "policy's parameters, heads included, are frozen. Draft with a draft model or an "
          "EAGLE-3 head (trained online with its own optimizer), or set "
          "drafter_training.loss_weight=0 to keep the heads as they are")
    if not isinstance(self.drafter_training, DrafterTraining):
      raise ConfigError(f"drafter_training={self.drafter_training!r} is invalid: must be a "
                        "DrafterTraining(loss_weight=, learning_rate=, ttt_steps=)")
    if self.eagle3 is not None:
      self.eagle3.config.check_target(self.model)
    if self.grpo.router_aux_weight and not self.model.is_moe:
      raise ConfigError(f"grpo.router_aux_weight={self.grpo.router_aux_weight!r} is invalid: "
                        "it weighs a mixture-of-experts model's load-balancing loss, and this "
                        "model is dense (n_experts=0); allowed 0")
    if self.async_mode and self.grpo.tis_cap is None:
      raise ConfigError("async_mode=True needs grpo.tis_cap (the importance correction "
                        "against the one-step-old behaviour policy); set e.g. tis_cap=2.0")

  @property
  def eagle3(self) -> Eagle3Drafter | None:
    """The rollout's EAGLE-3 drafter (itself, or a `FallbackDrafter`'s part: group drafting
    in front of it), whose head lives in `TrainState.drafter`."""
    return next((p for p in _parts(self.rollout.drafter) if isinstance(p, Eagle3Drafter)), None)

  @property
  def draft_model(self) -> DraftModelDrafter | None:
    """The rollout's external draft model (itself, or a `FallbackDrafter`'s part), whose
    parameters (frozen, or distilled online: `trains_draft_model`) live in
    `TrainState.drafter`."""
    return next((p for p in _parts(self.rollout.drafter) if isinstance(p, DraftModelDrafter)),
                None)

  def drafter_optimizer(self) -> optax.GradientTransformation:
    return optax.adam(self.drafter_training.learning_rate)

  @property
  def trains_draft_model(self) -> bool:
    """Whether the external draft model is distilled from the policy online."""
    dt = self.drafter_training
    return self.draft_model is not None and dt.loss_weight > 0 and dt.draft_model_learning_rate > 0

  def draft_model_optimizer(self) -> optax.GradientTransformation:
    """Adam at `draft_model_learning_rate`, on float32 master weights when the draft model's
    parameters are of a lower precision (a bfloat16 step of 1e-5 would not move them)."""
    adam = optax.adam(self.drafter_training.draft_model_learning_rate)
    if self.draft_model.config.param_dtype != "float32":
      return float32_master(adam)
    return adam



@struct.dataclass
class Rollout:
  """A scored batch of responses, laid out as full sequences.

  Attributes:
    tokens: `[B, L]` prompt then response then padding.
    response_mask: `[B, L]` 1 on response tokens (EOS included).
    valid_mask: `[B, L]` 1 on prompt and response tokens.
    behaviour_logprobs: `[B, L]` engine log-probabilities of the response tokens (0 elsewhere).
    rewards: `[B]`.
    advantages: `[B]`.
    lengths: `[B]` response lengths.
    tokens_per_round: scalar mean acceptance length of the rollout.
    accepted_per_depth: `[D]` acceptance rate per draft depth.
    reward_parts: `{name: [B]}` each reward function's values, when the reward returns
      them (a `DatasetTask` rewarded in JAX); logged as `reward_<name>`.
    plain_share: scalar share of the rollout's decoding rounds that drafted nothing (plain
      decoding): 1 without a drafter, 0 with a fixed tree, what the adaptive policy chose
      otherwise. None in a rollout made before it was recorded (a resumed async run's).
    drafter_stats: the drafter's own counts over the rollout (`GenerationStats.drafter`):
      with group drafting in front of a model drafter, the row-rounds each drafted and the
      tokens they emitted (logged as `acceptance_<name>`, `drafted_by_<name>`). None as
      `plain_share`.
  """

  tokens: jax.Array
  response_mask: jax.Array
  valid_mask: jax.Array
  behaviour_logprobs: jax.Array
  rewards: jax.Array
  advantages: jax.Array
  lengths: jax.Array
  tokens_per_round: jax.Array
  accepted_per_depth: jax.Array
  reward_parts: dict[str, jax.Array] | None = None
  plain_share: jax.Array | None = None
  drafter_stats: dict[str, jax.Array] | None = None



@struct.dataclass
class DrafterTrainState:
  """A drafter with parameters of its own, carried beside the policy.

  Attributes:
    weights: an EAGLE-3 head (`Eagle3Weights`: float parameters and the draft vocabulary
      map), trained online; or an external draft model's parameters (frozen, or distilled
      from the policy online).
    opt_state: optax state of an EAGLE-3 head's `weights.params`
      (`TrainConfig.drafter_optimizer`), or of a draft model distilled online
      (`TrainConfig.draft_model_optimizer`); None for a frozen draft model.
  """

  weights: Any
  opt_state: optax.OptState | None



@struct.dataclass
class TrainState:
  """Everything a run needs to continue exactly where it stopped.

  Attributes:
    params: policy parameters (trunk and draft heads).
    opt_state: optax state.
    ref_params: frozen reference parameters (None when beta = 0).
    step: scalar int32.
    key: raw PRNG key data (uint32 `[2]`), checkpointable.
    pending: async mode's rollout awaiting its update (None in sync mode).
    drafter: the EAGLE-3 head of the rollouts and its optimizer state, or the external
      draft model's parameters (None for drafters without parameters of their own).
    acceptance: the speculation policy's counts after the last rollout, which the next one
      starts from, scaled by `RolloutConfig.acceptance_carry` (None when that is 0).
    adapters: with `TrainConfig.lora`, the trained LoRA adapters of the frozen `params`
      (`policy` is the two merged); None otherwise.
    history: with a `HistoryDrafter` rollout, the bank of earlier responses it drafts from,
      recorded after every rollout (None otherwise).
  """

  params: Params
  opt_state: optax.OptState
  ref_params: Params | None
  step: jax.Array
  key: jax.Array
  pending: Rollout | None = None
  drafter: DrafterTrainState | None = None
  acceptance: AcceptanceCounts | None = None
  adapters: LoraAdapters | None = None
  history: HistoryBank | None = None

  @property
  def trainable(self) -> Params | LoraAdapters:
    """What the optimizer trains (and `opt_state` mirrors): the adapters with LoRA, else the
    parameters."""
    return self.params if self.adapters is None else self.adapters

  @property
  def policy(self) -> Params:
    """The policy's parameters: `params`, with the adapters merged in under LoRA."""
    return merged_policy(self.params, self.adapters)

  @property
  def rollout_drafter_params(self) -> Any:
    """What the rollout's drafter reads as its `drafter_params`: `rollout_drafter_params` of
    the history bank and the drafter's own weights."""
    return rollout_drafter_params(self.history, self.drafter_weights)

  @property
  def drafter_weights(self) -> Eagle3Weights | None:
    """The rollout drafter's own parameters (the EAGLE-3 head, the draft model; None for
    drafters without)."""
    return None if self.drafter is None else self.drafter.weights



def rollout_drafter_params(history: HistoryBank | None, weights: Any) -> Any:
  """What a rollout's drafter reads as its `drafter_params`: the history bank, the drafter's
  own weights (an EAGLE-3 head, a draft model), both (`FallbackParams`: the bank for the
  history drafter in front, the weights for the model behind it), or None."""
  if history is None or weights is None:
    return weights if history is None else history
  return FallbackParams(primary=history, fallback=weights)


def init_train_state(config: TrainConfig, params: Params, optimizer: optax.GradientTransformation,
                     seed: int, *, drafter_params: Eagle3Weights | None = None,
                     adapters: LoraAdapters | None = None) -> TrainState:
  """A fresh state; the reference is a copy of `params` when the KL penalty is on (with LoRA,
  `params` themselves: they stay frozen).

  With `config.lora`, the optimizer trains `adapters` (default: `init_lora` from `seed`,
  which start as the base model).

  With an EAGLE-3 rollout drafter, `drafter_params` is its head (trained offline, e.g.
  `specjax.supervised.eagle3.train_eagle3`, or loaded with `load_eagle3`); with an external
  draft model (`DraftModelDrafter`), its parameters (`load_hf`), which stay frozen.
  """
  if config.lora is None and adapters is not None:
    raise ConfigError("adapters are only used with TrainConfig(lora=LoraConfig(rank >= 1))")
  if config.lora is not None:
    if adapters is None:
      adapters = init_lora(config.model, config.lora,
                           jax.random.fold_in(jax.random.key(seed), 1))
    elif adapters.config != config.lora:
      raise ConfigError(f"adapters were made with {adapters.config}, the train config has "
                        f"{config.lora}")
  ref = (jax.tree.map(jnp.copy, params) if config.grpo.beta > 0 and adapters is None
         else None)
  drafter = None
  if config.eagle3 is not None:
    if not isinstance(drafter_params, Eagle3Weights):
      raise ConfigError("an Eagle3Drafter rollout needs init_train_state(..., drafter_params="
                        "Eagle3Weights(params, d2t)): the head to draft with and train online")
    drafter = DrafterTrainState(weights=drafter_params,
                                opt_state=config.drafter_optimizer().init(drafter_params.params))
  elif config.draft_model is not None:
    if drafter_params is None:
      raise ConfigError("a DraftModelDrafter rollout needs init_train_state(..., "
                        "drafter_params=<the draft model's params>)")
    check_params(drafter_params, config.draft_model.config, "drafter_params")
    opt_state = (config.draft_model_optimizer().init(drafter_params)
                 if config.trains_draft_model else None)
    drafter = DrafterTrainState(weights=drafter_params, opt_state=opt_state)
  elif drafter_params is not None:
    raise ConfigError("drafter_params is only used with an Eagle3Drafter or DraftModelDrafter "
                      f"rollout; the rollout drafter is {config.rollout.drafter!r}")
  acceptance = None
  rc = config.rollout
  if rc.acceptance_carry:
    menu = rc.speculation.menu
    acceptance = AcceptanceCounts.zeros(len(menu), max(rc.speculation.depth, 1))
  reads_history = history_drafter(rc.drafter)
  history = None if reads_history is None else reads_history.new_bank(rc.max_new_tokens)
  trained = params if adapters is None else adapters
  return TrainState(params=params, opt_state=optimizer.init(trained), ref_params=ref,
                    step=jnp.zeros((), jnp.int32),
                    key=jax.random.key_data(jax.random.key(seed)), drafter=drafter,
                    acceptance=acceptance, adapters=adapters, history=history)
