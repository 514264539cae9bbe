"""Supervised next-token training of the trunk and its draft heads.

Loss = CE(next token) + mtp_weight * mean_k CE(MTP module k) + medusa_weight * mean_k
CE(Medusa head k). With `detach_heads`, the heads see `stop_gradient` of the trunk's hidden
states, so their loss trains only the heads (how drafters are trained next to a policy).

Shape letters: see `specjax` (B batch, T tokens, E d_model, V vocab).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from specjax.models.config import ModelConfig
from specjax.models.heads import medusa_logits, mtp_logits_all
from specjax.models.params import Params
from specjax.models.transformer import forward


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


def draft_head_loss(params: Params, config: ModelConfig, hidden: jax.Array, tokens: jax.Array,
                    loss_mask: jax.Array, mtp_weight: float = 0.3, medusa_weight: float = 0.3,
                    detach: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Weighted CE of the MTP modules and Medusa heads on a sequence.

  Args:
    hidden: `[B, T, E]` the trunk's normalised hidden states over `tokens`.
    tokens, loss_mask: `[B, T]`.
    detach: stop gradients into the trunk (hidden) and into the shared embedding and output
      head, so the loss moves only head-owned weights (online drafter training).

  Returns:
    `(loss, metrics)`: loss `mtp_weight * mean_k CE_k + medusa_weight * mean_k CE_k`;
    metrics "mtp_ce" / "medusa_ce" hold one CE per MTP module / Medusa head.
  """
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  if detach:
    hidden = jax.lax.stop_gradient(hidden)
    params = {**params, "embed": jax.lax.stop_gradient(params["embed"])}
    if "unembed" in params:
      params["unembed"] = jax.lax.stop_gradient(params["unembed"])
  loss = jnp.zeros((), jnp.float32)
  metrics = {}
  if config.num_mtp_modules:
    logits = mtp_logits_all(params, config, hidden, tokens, positions)
    metrics["mtp_ce"] = jnp.stack([shifted_cross_entropy(lg, tokens, loss_mask, k + 2)[0]
                                   for k, lg in enumerate(logits)])
    loss = loss + mtp_weight * jnp.mean(metrics["mtp_ce"])
  if config.num_medusa_heads:
    logits = medusa_logits(params, config, hidden)
    metrics["medusa_ce"] = jnp.stack([shifted_cross_entropy(logits[k], tokens, loss_mask,
                                                            k + 2)[0]
                                      for k in range(config.num_medusa_heads)])
    loss = loss + medusa_weight * jnp.mean(metrics["medusa_ce"])
  return loss, metrics


def lm_loss(params: Params, config: ModelConfig, tokens: jax.Array, loss_mask: jax.Array,
            mtp_weight: float = 0.3, medusa_weight: float = 0.3,
            detach_heads: bool = False,
            head_mask: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Total supervised loss and its parts (see module docstring). tokens, loss_mask: `[B, T]`.

  `head_mask` (default `loss_mask`) selects the targets of the draft heads, which may differ
  (e.g. heads trained on prompts too while the trunk learns only answers).
  """
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  out = forward(params, config, tokens, positions)
  ce, acc = shifted_cross_entropy(out.logits, tokens, loss_mask, 1)
  head_loss, metrics = draft_head_loss(
      params, config, out.hidden, tokens, loss_mask if head_mask is None else head_mask,
      mtp_weight, medusa_weight, detach_heads)
  metrics |= {"ce": ce, "accuracy": acc, "loss": ce + head_loss}
  return ce + head_loss, metrics


def init_supervised_state(params: Params, optimizer: optax.GradientTransformation
                          ) -> SupervisedState:
  return SupervisedState(params=params, opt_state=optimizer.init(params),
                         step=jnp.zeros((), jnp.int32))


def make_supervised_step(config: ModelConfig, optimizer: optax.GradientTransformation, *,
                         mtp_weight: float = 0.3, medusa_weight: float = 0.3,
                         detach_heads: bool = False, jit: bool = True
                         ) -> Callable[[SupervisedState, jax.Array, jax.Array],
                                       tuple[SupervisedState, dict[str, jax.Array]]]:
  """A training step `(state, tokens [B, T], loss_mask [B, T][, head_mask]) -> (state, metrics)`.

  The state is donated: parameters and optimizer moments are updated in place.
  """

  def step(state: SupervisedState, tokens: jax.Array, loss_mask: jax.Array,
           head_mask: jax.Array | None = None):
    grads, metrics = jax.grad(lm_loss, has_aux=True)(
        state.params, config, tokens, loss_mask, mtp_weight, medusa_weight, detach_heads,
        head_mask)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics["grad_norm"] = optax.global_norm(grads)
    return SupervisedState(params=params, opt_state=opt_state, step=state.step + 1), metrics

  # Donate the state: the old parameters and moments are dead after the update.
  return jax.jit(step, donate_argnums=0) if jit else step
