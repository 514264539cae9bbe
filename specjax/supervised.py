"""Supervised next-token training of the trunk and its draft heads.

Loss = CE(next token) + mtp_weight * mean_k CE(MTP module k) + medusa_weight * mean_k
CE(Medusa head k). With `detach_heads`, the heads see `stop_gradient` of the trunk's hidden
states, so their loss trains only the heads (how drafters are trained next to a policy).

Glossary: B batch, T tokens, V vocab, K heads.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from specjax.models.config import ModelConfig
from specjax.models.heads import medusa_logits, mtp_logits_all
from specjax.models.transformer import forward

Params = dict[str, Any]


@struct.dataclass
class SupervisedState:
  params: Params
  opt_state: optax.OptState
  step: jax.Array


def shifted_cross_entropy(logits: jax.Array, tokens: jax.Array, loss_mask: jax.Array,
                          shift: int) -> tuple[jax.Array, jax.Array]:
  """Masked mean CE of `logits[:, i]` against `tokens[:, i + shift]`.

  Args:
    logits: `[B, T, V]`.
    tokens: `[B, T]`.
    loss_mask: `[B, T]`, 1 where a token counts as a target.
    shift: how far ahead the target is (1 for the next token).

  Returns:
    (mean CE over counted targets, top-1 accuracy over counted targets).
  """
  logits = logits[:, : tokens.shape[1] - shift].astype(jnp.float32)
  targets = tokens[:, shift:]
  mask = loss_mask[:, shift:].astype(jnp.float32)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  denom = jnp.maximum(mask.sum(), 1.0)
  accuracy = ((jnp.argmax(logits, -1) == targets) * mask).sum() / denom
  return (ce * mask).sum() / denom, accuracy


def lm_loss(params: Params, config: ModelConfig, tokens: jax.Array, loss_mask: jax.Array,
            mtp_weight: float = 0.3, medusa_weight: float = 0.3,
            detach_heads: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Total supervised loss and its parts (see module docstring). tokens, loss_mask: `[B, T]`."""
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  out = forward(params, config, tokens, positions)
  ce, acc = shifted_cross_entropy(out.logits, tokens, loss_mask, 1)
  metrics = {"ce": ce, "accuracy": acc}
  loss = ce
  hidden = jax.lax.stop_gradient(out.hidden) if detach_heads else out.hidden
  head_params = params
  if detach_heads:
    # The heads share the embedding and output head with the trunk; detach those too so the
    # head loss moves only head-owned weights.
    head_params = {**params, "embed": jax.lax.stop_gradient(params["embed"])}
    if "unembed" in params:
      head_params["unembed"] = jax.lax.stop_gradient(params["unembed"])
  if config.num_mtp_modules:
    mtp_ces = [shifted_cross_entropy(lg, tokens, loss_mask, k + 2)[0]
               for k, lg in enumerate(mtp_logits_all(head_params, config, hidden, tokens,
                                                     positions))]
    metrics["mtp_ce"] = jnp.stack(mtp_ces)
    loss = loss + mtp_weight * jnp.mean(metrics["mtp_ce"])
  if config.num_medusa_heads:
    all_logits = medusa_logits(head_params, config, hidden)
    medusa_ces = [shifted_cross_entropy(all_logits[k], tokens, loss_mask, k + 2)[0]
                  for k in range(config.num_medusa_heads)]
    metrics["medusa_ce"] = jnp.stack(medusa_ces)
    loss = loss + medusa_weight * jnp.mean(metrics["medusa_ce"])
  metrics["loss"] = loss
  return loss, metrics


def init_supervised_state(params: Params, optimizer: optax.GradientTransformation
                          ) -> SupervisedState:
  return SupervisedState(params=params, opt_state=optimizer.init(params),
                         step=jnp.zeros((), jnp.int32))


def make_supervised_step(config: ModelConfig, optimizer: optax.GradientTransformation, *,
                         mtp_weight: float = 0.3, medusa_weight: float = 0.3,
                         detach_heads: bool = False, jit: bool = True
                         ) -> Callable[[SupervisedState, jax.Array, jax.Array],
                                       tuple[SupervisedState, dict[str, jax.Array]]]:
  """A training step `(state, tokens [B, T], loss_mask [B, T]) -> (state, metrics)`.

  The state is donated: parameters and optimizer moments are updated in place.
  """

  def step(state: SupervisedState, tokens: jax.Array, loss_mask: jax.Array):
    grads, metrics = jax.grad(lm_loss, has_aux=True)(
        state.params, config, tokens, loss_mask, mtp_weight, medusa_weight, detach_heads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics["grad_norm"] = optax.global_norm(grads)
    return SupervisedState(params=params, opt_state=opt_state, step=state.step + 1), metrics

  # Donate the state: the old parameters and moments are dead after the update.
  return jax.jit(step, donate_argnums=0) if jit else step
