"""The update half of the GRPO step: `num_epochs x num_minibatches` optimizer steps on a
scored rollout under `lax.scan`, each minibatch's forward also training the drafter on the
rollout from detached target activations (the MTP / Medusa heads through a detached trunk,
or an EAGLE-3 head with its own optimizer, on the forward's residual streams and
distributions with the training-time test it was trained with offline, or an external draft
model distilled towards the forward's distributions), so the drafter follows the policy
without its loss reaching the policy gradient. With LoRA
(`TrainConfig.lora`) the optimizer steps the adapters, attached to the frozen trunk, which is
also the KL reference.

Shape letters: see `specjax` (B rows, L sequence buffer, V vocab).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.eagle3 import eagle3_ttt_loss, select_aux
from specjax.models.heads import DRAFT_HEAD_KEYS
from specjax.models.layout import constrain_rows
from specjax.models.moe import load_balancing_loss
from specjax.models.params import Params
from specjax.models.transformer import ForwardOutput, forward
from specjax.rl.losses import objective_loss
from specjax.rl.state import DrafterTrainState, Rollout, TrainConfig, TrainState
from specjax.supervised import draft_head_loss


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
  metrics |= logprob_gap(old[:, 1:], mb["behaviour_logprobs"][:, 1:], mb["response_mask"][:, 1:])
  if config.model.is_moe:  # the routing's balance; with a weight, also a loss
    balance = load_balancing_loss(out.router_logits, config.model, mb["valid_mask"])
    metrics["router_balance"] = jax.lax.stop_gradient(balance)
    if config.grpo.router_aux_weight:
      loss = loss + config.grpo.router_aux_weight * balance
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



def _draft_model_update(drafter: DrafterTrainState, config: TrainConfig, tokens: jax.Array,
                        mask: jax.Array, out: ForwardOutput
                        ) -> tuple[DrafterTrainState, dict[str, jax.Array]]:
  """One optimizer step of the external draft model towards the policy: the KL divergence
  from the policy's next-token distribution (its forward's detached logits, at the rollout
  temperature) to the draft model's, at every position whose next token is in the rollout
  (`mask [B, L]`), and the share of them where their most likely tokens agree."""
  draft = config.draft_model.config
  temperature = config.rollout.sampling.logprob_temperature
  target = jax.nn.log_softmax(out.logits[:, :-1] / temperature, -1)  # [B, L - 1, V]
  weight = mask[:, 1:].astype(jnp.float32)
  count = jnp.maximum(weight.sum(), 1.0)
  b, l = tokens.shape

  def loss_fn(params):
    logits = forward(params, draft, tokens, jnp.broadcast_to(jnp.arange(l), (b, l))).logits
    logq = jax.nn.log_softmax(logits[:, :-1] / temperature, -1)
    kl = (jnp.exp(target) * (target - logq)).sum(-1)
    agree = jnp.argmax(logq, -1) == jnp.argmax(target, -1)
    metrics = {"draft_model_kl": (kl * weight).sum() / count,
               "draft_model_accuracy": (agree * weight).sum() / count}
    return config.drafter_training.loss_weight * metrics["draft_model_kl"], metrics

  (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(drafter.weights)
  updates, opt_state = config.draft_model_optimizer().update(grads, drafter.opt_state,
                                                             drafter.weights)
  return (DrafterTrainState(weights=optax.apply_updates(drafter.weights, updates),
                            opt_state=opt_state), metrics)



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

  # With LoRA the optimizer trains the adapters, attached to the frozen trunk for the
  # factored forward; the trunk is the KL reference.
  adapted = state.adapters is not None
  frozen = jax.lax.stop_gradient(state.params)
  model_params = (lambda trained: trained.attach(frozen)) if adapted else (lambda p: p)

  if gc.num_epochs > 1 or gc.num_minibatches > 1:
    # pi_old is the policy at the start of the update, fixed across epochs and minibatches.
    data["old_logprobs"] = logprobs_by_minibatch(model_params(state.trainable))
  if gc.beta > 0:
    data["ref_logprobs"] = logprobs_by_minibatch(frozen if adapted else state.ref_params)

  def epoch_batches(k):
    perm = jax.random.permutation(k, rows) if gc.num_minibatches > 1 else jnp.arange(rows)
    return jax.tree.map(lambda x: x[perm].reshape((gc.num_minibatches, mb_rows) + x.shape[1:]),
                        data)

  batches = jax.vmap(epoch_batches)(jax.random.split(key, gc.num_epochs))
  batches = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), batches)

  train_eagle = config.eagle3 is not None and config.drafter_training.loss_weight > 0
  train_draft_model = config.trains_draft_model

  def loss_fn(trained, mb):
    return _minibatch_loss(model_params(trained), config, mb)

  def one(carry, mb):
    trained, opt_state, drafter = carry
    mb = jax.tree.map(constrain_rows, mb)  # the gather by `perm` drops the rows' split
    grads, (metrics, out) = jax.grad(loss_fn, has_aux=True)(trained, mb)
    ok = all_finite((mb["advantages"], metrics["loss"], grads))
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    # A branch, not a select over both results: the skipped branch allocates nothing. Its
    # zero updates have the optimizer's dtypes (float32 for float32 master weights).
    shapes = jax.eval_shape(optimizer.update, grads, opt_state, trained)[0]
    updates, opt_state = jax.lax.cond(
        ok, lambda: optimizer.update(grads, opt_state, trained),
        lambda: (jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes), opt_state))
    metrics |= _grad_norms(grads.factors if adapted else grads)
    if train_eagle:
      new_drafter, drafter_metrics = _eagle3_update(
          drafter, config, frozen["embed"] if adapted else jax.lax.stop_gradient(
              trained["embed"]), mb["tokens"], mb["valid_mask"], out)
      drafter = keep(new_drafter, drafter)
      metrics |= drafter_metrics
    if train_draft_model:
      new_drafter, drafter_metrics = _draft_model_update(drafter, config, mb["tokens"],
                                                         mb["valid_mask"], out)
      drafter = keep(new_drafter, drafter)
      metrics |= drafter_metrics
    metrics["update_skipped"] = 1.0 - ok.astype(jnp.float32)
    return (optax.apply_updates(trained, updates), opt_state, drafter), metrics

  (trained, opt_state, drafter), metrics = jax.lax.scan(
      one, (state.trainable, state.opt_state, state.drafter), batches)
  metrics = {k: v.max(0) if k.endswith("_max") else v.mean(0) for k, v in metrics.items()}
  moved = {"adapters": trained} if adapted else {"params": trained}
  return state.replace(**moved, opt_state=opt_state, drafter=drafter,
                       step=state.step + 1), metrics



def logprob_gap(trainer: jax.Array, rollout: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
  """How far the rollout's recorded log-probs are from the trainer's on the same tokens
  (`[B, T]` each, `mask` the response tokens): `logprob_gap_mean` and `logprob_gap_max` of
  |trainer - rollout| in nats. The trainer's are those of the update's start (pi_old).

  Two programs compute the same log-probs (a cached decode and a teacher-forced forward) and
  round differently: ~0 in float32, up to ~1e-2 nats in bfloat16 on a tiny model, growing
  with the model and the sequence. The truncated importance weight (`GRPOConfig.tis_cap`)
  corrects for it; this says how large it is. In async mode the rollout's policy is one step
  older, so the gap also holds that step's change.
  """
  live = mask > 0
  gap = jnp.where(live, jnp.abs(trainer.astype(jnp.float32) - rollout.astype(jnp.float32)), 0.0)
  gap = jax.lax.stop_gradient(gap)
  return {"logprob_gap_mean": gap.sum() / jnp.maximum(live.sum(), 1),
          "logprob_gap_max": gap.max()}


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
