"""The GRPO train step: rollout -> reward -> advantages -> update -> drafter update, fused.

`make_train_step` returns one `jax.jit`-compiled function
`(train_state, prompt_batch) -> (train_state, metrics)`. Inside it the policy generates G
responses per prompt with the speculative engine, the task's JAX reward scores them, group
advantages are formed, and `num_epochs x num_minibatches` optax updates run under `lax.scan`.
The same minibatch forward also trains the drafter on the rollouts from detached target
activations, so it follows the policy without its loss reaching the policy gradient: the
MTP / Medusa heads through a detached trunk, or an EAGLE-3 head (its own parameters and
optimizer, `TrainState.drafter`) on the forward's three residual streams and distributions
with the training-time test it was trained with offline.

Modes:
- sync: the update uses the batch generated in the same step by the current parameters.
- async (one-step off-policy): the step generates batch t + 1 with the current parameters and
  updates on batch t, generated one step earlier (`TrainState.pending`). The truncated
  importance weight `min(pi_old / pi_behaviour, tis_cap)` corrects for the lag.
- split: for Python rewards, `make_rollout_fn` and `make_update_fn` are two programs with the
  reward computed on the host in between.

Rows are prompt-major: the G samples of prompt i are rows i * G .. i * G + G - 1.
Shape letters: see `specjax` (B rows, B / G prompts, G group size, P prompt buffer,
T max new tokens, L = P + T sequence buffer, D tree depth, V vocab).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from specjax.checks import is_int, is_number, require_ints, require_reals
from specjax.decoding import Adaptive, generate
from specjax.decoding.drafters.base import Drafter
from specjax.decoding.drafters.eagle3 import Eagle3Drafter, Eagle3Weights
from specjax.decoding.policy import AcceptanceCounts
from specjax.decoding.sampling import SamplingConfig
from specjax.decoding.tree import DraftTree
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.eagle3 import eagle3_ttt_loss, select_aux
from specjax.models.heads import DRAFT_HEAD_KEYS
from specjax.models.layout import constrain_rows
from specjax.models.params import Params
from specjax.models.transformer import ForwardOutput, forward
from specjax.rl.losses import GRPOConfig, group_advantages, objective_loss
from specjax.supervised import draft_head_loss

RewardFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


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
  """

  max_new_tokens: int
  eos_id: int | tuple[int, ...] | None
  sampling: SamplingConfig = SamplingConfig(1.0)
  drafter: Drafter | None = None
  tree: DraftTree | None = None
  speculation: Adaptive | None = None
  acceptance_carry: float = 0.0

  def __post_init__(self):
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
  """

  loss_weight: float = 1.0
  learning_rate: float = 1e-3
  ttt_steps: int = 3

  def __post_init__(self):
    require_reals(self, ("loss_weight",), positive=False, prefix="drafter_training.")
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
  """

  model: ModelConfig
  grpo: GRPOConfig
  rollout: RolloutConfig
  drafter_training: DrafterTraining = DrafterTraining()
  async_mode: bool = False

  def __post_init__(self):
    if not isinstance(self.drafter_training, DrafterTraining):
      raise ConfigError(f"drafter_training={self.drafter_training!r} is invalid: must be a "
                        "DrafterTraining(loss_weight=, learning_rate=, ttt_steps=)")
    if self.eagle3 is not None:
      self.eagle3.config.check_target(self.model)
    if self.async_mode and self.grpo.tis_cap is None:
      raise ConfigError("async_mode=True needs grpo.tis_cap (the importance correction "
                        "against the one-step-old behaviour policy); set e.g. tis_cap=2.0")

  @property
  def eagle3(self) -> Eagle3Drafter | None:
    """The rollout's EAGLE-3 drafter, whose head lives in `TrainState.drafter`."""
    drafter = self.rollout.drafter
    return drafter if isinstance(drafter, Eagle3Drafter) else None

  def drafter_optimizer(self) -> optax.GradientTransformation:
    return optax.adam(self.drafter_training.learning_rate)


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


@struct.dataclass
class DrafterTrainState:
  """A draft head with parameters of its own (EAGLE-3), trained online beside the policy.

  Attributes:
    weights: the head (`Eagle3Weights`: float parameters and the draft vocabulary map).
    opt_state: optax state of `weights.params` (`TrainConfig.drafter_optimizer`).
  """

  weights: Eagle3Weights
  opt_state: optax.OptState


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
    drafter: the EAGLE-3 head of the rollouts and its optimizer state (None otherwise).
    acceptance: the speculation policy's counts after the last rollout, which the next one
      starts from, scaled by `RolloutConfig.acceptance_carry` (None when that is 0).
  """

  params: Params
  opt_state: optax.OptState
  ref_params: Params | None
  step: jax.Array
  key: jax.Array
  pending: Rollout | None = None
  drafter: DrafterTrainState | None = None
  acceptance: AcceptanceCounts | None = None

  @property
  def drafter_weights(self) -> Eagle3Weights | None:
    """The rollout drafter's own parameters (the EAGLE-3 head; None for drafters without)."""
    return None if self.drafter is None else self.drafter.weights


def init_train_state(config: TrainConfig, params: Params, optimizer: optax.GradientTransformation,
                     seed: int, *, drafter_params: Eagle3Weights | None = None) -> TrainState:
  """A fresh state; the reference is a copy of `params` when the KL penalty is on.

  With an EAGLE-3 rollout drafter, `drafter_params` is its head (trained offline, e.g.
  `specjax.supervised.eagle3.train_eagle3`, or loaded with `load_eagle3`).
  """
  ref = jax.tree.map(jnp.copy, params) if config.grpo.beta > 0 else None
  drafter = None
  if config.eagle3 is not None:
    if not isinstance(drafter_params, Eagle3Weights):
      raise ConfigError("an Eagle3Drafter rollout needs init_train_state(..., drafter_params="
                        "Eagle3Weights(params, d2t)): the head to draft with and train online")
    drafter = DrafterTrainState(weights=drafter_params,
                                opt_state=config.drafter_optimizer().init(drafter_params.params))
  elif drafter_params is not None:
    raise ConfigError("drafter_params is only used with an Eagle3Drafter rollout; the "
                      f"rollout drafter is {config.rollout.drafter!r}")
  acceptance = None
  rc = config.rollout
  if rc.acceptance_carry:
    menu = rc.speculation.menu
    acceptance = AcceptanceCounts.zeros(len(menu), max(rc.speculation.depth, 1))
  return TrainState(params=params, opt_state=optimizer.init(params), ref_params=ref,
                    step=jnp.zeros((), jnp.int32),
                    key=jax.random.key_data(jax.random.key(seed)), drafter=drafter,
                    acceptance=acceptance)


def _assemble(prompts, prompt_lengths, response, response_lengths, logprobs, pad_id):
  """Right-padded prompts `[B, P]` + responses `[B, T]` -> sequences `[B, L]` and masks."""
  b, p = prompts.shape
  l = p + response.shape[1]
  j = jnp.arange(l)[None, :]
  rel = j - prompt_lengths[:, None]
  in_prompt = j < prompt_lengths[:, None]
  in_response = (rel >= 0) & (rel < response_lengths[:, None])
  rel_idx = jnp.clip(rel, 0, response.shape[1] - 1)
  prompt_tok = jnp.take_along_axis(jnp.pad(prompts, ((0, 0), (0, l - p))),
                                   jnp.broadcast_to(j, (b, l)), axis=1)
  tokens = jnp.where(in_prompt, prompt_tok,
                     jnp.where(in_response, jnp.take_along_axis(response, rel_idx, 1), pad_id))
  behaviour = jnp.where(in_response, jnp.take_along_axis(logprobs, rel_idx, 1), 0.0)
  return tokens, in_response.astype(jnp.float32), (in_prompt | in_response).astype(
      jnp.float32), behaviour


def rollout(params: Params, config: TrainConfig, prompts: jax.Array, prompt_lengths: jax.Array,
            key: jax.Array, pad_id: int = 0, drafter_params: Any = None,
            acceptance: AcceptanceCounts | None = None, check_values: bool = True
            ) -> tuple[Rollout, jax.Array, jax.Array, AcceptanceCounts]:
  """Generate G responses per prompt (`prompts [B / G, P]`). Returns the (unscored) rollout,
  the responses `[B, T]`, their lengths `[B]` and the speculation policy's counts at the end.

  Rewards and advantages are left at zero; `score` fills them in. `drafter_params` are the
  drafter's own parameters (an EAGLE-3 head), if it has any; `acceptance`, counts the
  policy starts from (`TrainState.acceptance`), scaled here by
  `RolloutConfig.acceptance_carry`. `check_values`: as in `generate` (the train step's
  batches skip it: no host callback inside the step).
  """
  g = config.grpo.group_size
  rc = config.rollout
  prompts = jnp.repeat(prompts, g, axis=0)
  prompt_lengths = jnp.repeat(prompt_lengths, g, axis=0)
  out = generate(params, config.model, prompts, prompt_lengths, key,
                 max_new_tokens=rc.max_new_tokens, sampling=rc.sampling, drafter=rc.drafter,
                 tree=rc.tree, speculation=rc.speculation, eos_id=rc.eos_id, pad_id=pad_id,
                 drafter_params=drafter_params,
                 acceptance=None if acceptance is None else acceptance.scaled(
                     rc.acceptance_carry), check_values=check_values)
  tokens, response_mask, valid_mask, behaviour = _assemble(
      prompts, prompt_lengths, out.tokens, out.lengths, out.logprobs, pad_id)
  zeros = jnp.zeros(prompts.shape[:1], jnp.float32)
  roll = Rollout(tokens=tokens, response_mask=response_mask, valid_mask=valid_mask,
                 behaviour_logprobs=behaviour, rewards=zeros, advantages=zeros,
                 lengths=out.lengths, tokens_per_round=out.stats.tokens_per_round,
                 accepted_per_depth=out.stats.accepted_per_depth)
  return roll, out.tokens, out.lengths, out.stats.acceptance


def score(config: TrainConfig, roll: Rollout, rewards: jax.Array) -> Rollout:
  """Attach rewards `[B]` and their group advantages."""
  rewards = jnp.asarray(rewards, jnp.float32)
  adv = group_advantages(rewards, config.grpo.group_size,
                         normalize_std=config.grpo.normalize_std, eps=config.grpo.adv_eps)
  return roll.replace(rewards=rewards, advantages=adv)


def sequence_logprobs(params: Params, model: ModelConfig, tokens: jax.Array,
                      temperature: float, hidden_layers: tuple[int, ...] = ()
                      ) -> tuple[jax.Array, ForwardOutput]:
  """Log-probabilities `[B, L]` of each token `tokens [B, L]` given its prefix (0 at position
  0), under softmax(logits / temperature); also returns the forward output (with the residual
  streams after `hidden_layers`)."""
  b, l = tokens.shape
  out = forward(params, model, tokens, jnp.broadcast_to(jnp.arange(l), (b, l)),
                hidden_layers=hidden_layers)
  logp = jax.nn.log_softmax(out.logits[:, :-1] / temperature, axis=-1)
  picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  return jnp.pad(picked, ((0, 0), (1, 0))), out


def _minibatch_loss(params, config: TrainConfig, mb: dict[str, jax.Array]):
  """The policy objective's loss (`GRPOConfig.objective`; + the detached MTP / Medusa loss);
  aux: metrics and the forward output."""
  temperature = config.rollout.sampling.logprob_temperature
  eagle = config.eagle3
  logp, out = sequence_logprobs(params, config.model, mb["tokens"], temperature,
                                eagle.config.hidden_layers if eagle is not None else ())
  old = mb["old_logprobs"] if "old_logprobs" in mb else jax.lax.stop_gradient(logp)
  loss, gm = objective_loss(config.grpo.objective)(
      config.grpo, logp[:, 1:], old[:, 1:], mb["advantages"], mb["response_mask"][:, 1:],
      ref_logprobs=mb["ref_logprobs"][:, 1:] if "ref_logprobs" in mb else None,
      rollout_logprobs=mb["behaviour_logprobs"][:, 1:],
      logits=jax.lax.stop_gradient(out.logits[:, :-1]) / temperature)
  metrics = {k: v for k, v in dataclasses.asdict(gm).items() if v is not None}
  if config.drafter_training.loss_weight and (config.model.num_mtp_modules
                                     or config.model.num_medusa_heads):
    head_loss, hm = draft_head_loss(params, config.model, out.hidden, mb["tokens"],
                                    mb["valid_mask"], 1.0, 1.0, detach=True)
    loss = loss + config.drafter_training.loss_weight * head_loss
    metrics |= hm
  return loss, (metrics, jax.lax.stop_gradient(out))


def _eagle3_update(drafter: DrafterTrainState, config: TrainConfig, embed_table: jax.Array,
                   tokens: jax.Array, mask: jax.Array, out: ForwardOutput
                   ) -> tuple[DrafterTrainState, dict[str, jax.Array]]:
  """One optimizer step of the EAGLE-3 head on the policy forward's (detached) features and
  distributions at the rollout temperature: what the head drafts against."""
  eagle = config.eagle3
  weights = drafter.weights
  logprobs = jax.nn.log_softmax(out.logits / config.rollout.sampling.logprob_temperature, -1)

  def loss_fn(head):
    loss, metrics = eagle3_ttt_loss(head, eagle.config, embed_table, tokens,
                                    select_aux(eagle.config, out.intermediates), logprobs,
                                    mask, weights.d2t, config.drafter_training.ttt_steps)
    return config.drafter_training.loss_weight * loss, metrics

  (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(weights.params)
  updates, opt_state = config.drafter_optimizer().update(grads, drafter.opt_state,
                                                         weights.params)
  params = optax.apply_updates(weights.params, updates)
  return (DrafterTrainState(weights=weights.replace(params=params), opt_state=opt_state),
          {"eagle3_ce": metrics["ce"], "eagle3_accuracy": metrics["accuracy"]})


def update(state: TrainState, config: TrainConfig, optimizer: optax.GradientTransformation,
           roll: Rollout, key: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
  """`num_epochs x num_minibatches` GRPO updates on a scored rollout.

  A minibatch whose advantages (so rewards), loss or gradient are not all finite is not
  applied: the weights and moments stay as they were (the step and key still advance) and
  `metrics["update_skipped"]` is the fraction of minibatches skipped, so that one bad reward
  cannot poison a run and a caller can stop on the flag. Decided inside the compiled step,
  with no host round trip, by a `lax.cond` around the optimizer's update (a select between
  old and new moments kept both live: +1.4 GiB per device at Qwen3-1.7B).
  """
  gc = config.grpo
  temperature = config.rollout.sampling.logprob_temperature
  data = {"tokens": roll.tokens, "response_mask": roll.response_mask,
          "valid_mask": roll.valid_mask, "behaviour_logprobs": roll.behaviour_logprobs,
          "advantages": roll.advantages}
  rows = roll.tokens.shape[0]
  if rows % gc.num_minibatches:
    raise ConfigError(f"num_minibatches={gc.num_minibatches} must divide the rollout rows "
                      f"{rows} (prompts x group_size)")
  mb_rows = rows // gc.num_minibatches

  def logprobs_by_minibatch(params):
    """`sequence_logprobs` of every row, a minibatch of rows at a time: the float32
    `[rows, L, V]` logits of all rows at once would be the step's largest buffer. Chunk j
    holds rows j, j + M, j + 2M, ... (M minibatches), so that under a mesh each chunk is
    spread over the devices as the rows are."""
    chunks = roll.tokens.reshape(mb_rows, gc.num_minibatches, -1).swapaxes(0, 1)
    logp = jax.lax.map(
        lambda t: sequence_logprobs(params, config.model, t, temperature)[0], chunks)
    return jax.lax.stop_gradient(logp.swapaxes(0, 1).reshape(roll.tokens.shape))

  if gc.num_epochs > 1 or gc.num_minibatches > 1:
    # pi_old is the policy at the start of the update, fixed across epochs and minibatches.
    data["old_logprobs"] = logprobs_by_minibatch(state.params)
  if gc.beta > 0:
    data["ref_logprobs"] = logprobs_by_minibatch(state.ref_params)

  def epoch_batches(k):
    perm = jax.random.permutation(k, rows) if gc.num_minibatches > 1 else jnp.arange(rows)
    return jax.tree.map(lambda x: x[perm].reshape((gc.num_minibatches, mb_rows) + x.shape[1:]),
                        data)

  batches = jax.vmap(epoch_batches)(jax.random.split(key, gc.num_epochs))
  batches = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batches)

  train_eagle = config.eagle3 is not None and config.drafter_training.loss_weight > 0

  def one(carry, mb):
    params, opt_state, drafter = carry
    mb = jax.tree.map(constrain_rows, mb)  # the gather by `perm` drops the rows' split
    grads, (metrics, out) = jax.grad(_minibatch_loss, has_aux=True)(params, config, mb)
    ok = all_finite((mb["advantages"], metrics["loss"], grads))
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    # A branch, not a select over both results: the skipped branch allocates nothing.
    updates, opt_state = jax.lax.cond(
        ok, lambda: optimizer.update(grads, opt_state, params),
        lambda: (jax.tree.map(jnp.zeros_like, params), opt_state))
    metrics |= _grad_norms(grads)
    if train_eagle:
      new_drafter, drafter_metrics = _eagle3_update(
          drafter, config, jax.lax.stop_gradient(params["embed"]), mb["tokens"],
          mb["valid_mask"], out)
      drafter = keep(new_drafter, drafter)
      metrics |= drafter_metrics
    metrics["update_skipped"] = 1.0 - ok.astype(jnp.float32)
    return (optax.apply_updates(params, updates), opt_state, drafter), metrics

  (params, opt_state, drafter), metrics = jax.lax.scan(
      one, (state.params, state.opt_state, state.drafter), batches)
  metrics = jax.tree.map(lambda x: x.mean(0), metrics)
  return state.replace(params=params, opt_state=opt_state, drafter=drafter,
                       step=state.step + 1), metrics


def all_finite(tree: Any) -> jax.Array:
  """Scalar bool: every float leaf of `tree` is finite (integer leaves are ignored)."""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  if not leaves:
    return jnp.asarray(True)
  return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))


def _grad_norms(grads: Params) -> dict[str, jax.Array]:
  """Global norms of the gradient: of all of it (`grad_norm`), of the trunk
  (`grad_norm_trunk`) and, when the model has MTP / Medusa heads, of those
  (`grad_norm_heads`; only the detached drafter loss reaches them), so that a drafter loss
  dominating the norm the optimizer clips by shows apart from the policy's."""
  # In float32: a bf16 sum of squares over every parameter loses most of its digits.
  grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
  norms = {"grad_norm": optax.global_norm(grads),
           "grad_norm_trunk": optax.global_norm(
               {k: v for k, v in grads.items() if k not in DRAFT_HEAD_KEYS})}
  heads = {k: v for k, v in grads.items() if k in DRAFT_HEAD_KEYS}
  if jax.tree.leaves(heads):
    norms["grad_norm_heads"] = optax.global_norm(heads)
  return norms


def rollout_metrics(config: TrainConfig, roll: Rollout) -> dict[str, jax.Array]:
  n = config.rollout.max_new_tokens
  lengths = roll.lengths.astype(jnp.float32)
  eos = config.rollout.eos_id
  ended = (jnp.zeros(roll.lengths.shape, bool) if eos is None else  # on any of the EOS ids
           jnp.any(jnp.isin(roll.tokens, jnp.asarray(eos)) & (roll.response_mask > 0), axis=1))
  clipped = (roll.lengths >= n) & ~ended
  return {
      "reward_mean": roll.rewards.mean(), "reward_std": roll.rewards.std(),
      "accuracy": (roll.rewards >= 1.0).mean(),
      "response_length_mean": lengths.mean(), "response_length_max": lengths.max(),
      "response_clip_frac": clipped.mean(),
      "acceptance_length": roll.tokens_per_round,
      "accepted_per_depth": roll.accepted_per_depth,
      "rollout_tokens": roll.lengths.sum(),
  }


def step_keys(key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A train step's keys from the state's raw key data: (the next step's key data, the
  rollout's key, the update's key). Every step program splits them this way, so that the
  fused and the disaggregated async modes draw the same samples."""
  key, k_roll, k_update = jax.random.split(jax.random.wrap_key_data(key), 3)
  return jax.random.key_data(key), k_roll, k_update


def prime_keys(key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Async mode's priming keys: (the next key data, the first rollout's key)."""
  key, k_roll = jax.random.split(jax.random.wrap_key_data(key))
  return jax.random.key_data(key), k_roll


def scored_rollout(params: Params, drafter_params: Eagle3Weights | None,
                   acceptance: AcceptanceCounts | None, config: TrainConfig, batch,
                   key: jax.Array, reward_fn: RewardFn, pad_id: int = 0
                   ) -> tuple[Rollout, AcceptanceCounts]:
  """Rollout of `batch` (tokens, lengths, answers) by a policy and its drafter, scored by a
  JAX reward; and the speculation policy's counts after it (see `rollout`)."""
  roll, responses, lengths, acceptance = rollout(
      params, config, batch.tokens, batch.lengths, key, pad_id, drafter_params, acceptance,
      check_values=False)
  answers = jnp.repeat(batch.answers, config.grpo.group_size, axis=0)
  return score(config, roll, reward_fn(responses, lengths, answers)), acceptance


def _with_acceptance(state: TrainState, acceptance: AcceptanceCounts) -> TrainState:
  """`state` carrying the rollout's counts, when it carries any."""
  return state if state.acceptance is None else state.replace(acceptance=acceptance)


def _state_rollout(state: TrainState, config: TrainConfig, batch, key: jax.Array,
                   reward_fn: RewardFn, pad_id: int) -> tuple[Rollout, TrainState]:
  """`scored_rollout` by the state's policy and drafter, and the state with its counts."""
  roll, acceptance = scored_rollout(state.params, state.drafter_weights, state.acceptance,
                                    config, batch, key, reward_fn, pad_id)
  return roll, _with_acceptance(state, acceptance)


def make_train_step(config: TrainConfig, reward_fn: RewardFn,
                    optimizer: optax.GradientTransformation, *, pad_id: int = 0,
                    jit: bool = True, state_sharding: Any = None, batch_sharding: Any = None
                    ) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
  """The fused step `(state, batch) -> (state, metrics)`; batch has tokens, lengths, answers.

  `reward_fn(responses [B, T], lengths [B], answers [B]) -> [B]` must be JAX. In async mode the
  state must hold a pending rollout first (`make_prime_fn`).
  """

  def step(state: TrainState, batch) -> tuple[TrainState, dict[str, jax.Array]]:
    key, k_roll, k_update = step_keys(state.key)
    roll, state = _state_rollout(state, config, batch, k_roll, reward_fn, pad_id)
    train_on = state.pending if config.async_mode else roll
    new_state, metrics = update(state, config, optimizer, train_on, k_update)
    metrics |= rollout_metrics(config, train_on)
    new_state = new_state.replace(key=key, pending=roll if config.async_mode else None)
    return new_state, metrics

  if not jit:
    return step
  # The state is donated: parameters, optimizer moments and the pending rollout are replaced.
  kwargs = {}
  if state_sharding is not None:
    kwargs = dict(in_shardings=(state_sharding, batch_sharding),
                  out_shardings=(state_sharding, None))
  return jax.jit(step, donate_argnums=0, **kwargs)


def make_prime_fn(config: TrainConfig, reward_fn: RewardFn, *, pad_id: int = 0):
  """Async mode: `(state, batch) -> state` with the first pending rollout generated."""

  def prime(state: TrainState, batch) -> TrainState:
    key, k_roll = prime_keys(state.key)
    roll, state = _state_rollout(state, config, batch, k_roll, reward_fn, pad_id)
    return state.replace(key=key, pending=roll)

  return jax.jit(prime)


def make_split_step(config: TrainConfig, reward_fn: Callable[..., Any],
                    optimizer: optax.GradientTransformation, *, pad_id: int = 0):
  """Split mode for host-side (Python) rewards: two compiled programs, the reward between.

  Returns `step(state, batch) -> (state, metrics)`, where `reward_fn(responses [B, T] numpy,
  lengths [B] numpy, batch) -> [B]` runs on the host (e.g. decode the responses and call a
  `PythonReward` with `reader.references(np.repeat(batch.index, G))`). Sync mode only.
  """
  if config.async_mode:
    raise ConfigError("split mode (host-side reward) supports async_mode=False only")

  @jax.jit
  def rollout_fn(params, tokens, lengths, key, drafter_params, acceptance):
    return rollout(params, config, tokens, lengths, key, pad_id, drafter_params, acceptance,
                   check_values=False)

  # The state is donated: parameters and optimizer moments are replaced by the update.
  @functools.partial(jax.jit, donate_argnums=0)
  def update_fn(state, roll, rewards, key, next_key):
    roll = score(config, roll, rewards)
    state, metrics = update(state, config, optimizer, roll, key)
    return state.replace(key=next_key), metrics | rollout_metrics(config, roll)

  def step(state: TrainState, batch):
    key, k_roll, k_update = step_keys(state.key)
    roll, responses, lengths, acceptance = rollout_fn(
        state.params, batch.tokens, batch.lengths, k_roll, state.drafter_weights,
        state.acceptance)
    rewards = np.asarray(reward_fn(np.asarray(responses), np.asarray(lengths), batch),
                         np.float32)
    return update_fn(_with_acceptance(state, acceptance), roll, rewards, k_update, key)

  return step
