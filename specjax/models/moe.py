"""Mixture-of-experts MLP (Qwen3-MoE): a top-k router over Z SwiGLU experts, dropless.

Routing is as transformers' `Qwen3MoeTopKRouter` computes it: router logits in the compute
dtype, a float32 softmax over the Z experts, the top k probabilities (renormalised to sum to
one when `normalize_top_k`), cast back to the compute dtype. The layer's output for a token is
the weighted sum of its k experts' SwiGLU outputs. No capacity, no dropped tokens, no shared
expert.

Two ways to run the experts, one function up to rounding (`ModelConfig.moe_impl`):
- "loop" (decode steps): a loop over the distinct experts the forward's tokens were routed
  to, at most min(Z, pairs) iterations, each one expert's three matmuls over every token
  (weighted by that token's routing weight, zero where it did not pick the expert). It reads
  only the activated experts' weights, which is what a memory-bound decode step pays for.
  Static trip count: differentiable, and iterations past the distinct experts carry weight 0.
- "ragged" (prefill, training): the k * A (token, expert) pairs sorted by expert and run as
  grouped matmuls (`jax.lax.ragged_dot`: one contiguous group of rows per expert), then added
  back to their tokens. MaxText's megablox path and sglang-jax's fused MoE do the same
  dispatch with their own grouped-matmul kernels; on TPU `ragged_dot` lowers to one. XLA:CPU
  expands it into a masked product over every expert (Z / k times the work), so on a CPU the
  loop is the sparse path.
"auto" takes the loop on a CPU always (it wastes at most min(Z, pairs) / k of the ideal
work, less than the expanded grouped matmul's Z / k), and elsewhere when the forward has at
most Z pairs (every pair can then touch a different expert and the loop still reads no
weight twice), ragged otherwise; the choice is made per platform when the program is lowered.
Measured on a 2-core CPU (`benchmarks/moe_decode.py`, 64 experts, top 8, E = 1024, two runs):
a decode step costs 1.04x / 1.20x a dense model of the same active size at batch 1 (8
experts read), 2.9-3.0x at batch 4 (23 distinct experts read, 2.9x the weights); the
expanded grouped matmul 28-37x the loop at batch 1.
How XLA:GPU runs `ragged_dot` is not measured here.

Shape letters: see `specjax` (E d_model, F one expert's width, Z experts); A is the number of
tokens in the forward (B x T, flattened), k the experts per token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specjax.models.config import ModelConfig
from specjax.models.params import Params


def route(router: jax.Array, config: ModelConfig, x: jax.Array
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The router's choice for tokens `x [A, E]`: `(logits [A, Z] float32, experts [A, k] int32,
  weights [A, k])`, the weights in the compute dtype."""
  logits = jnp.einsum("AE,EZ->AZ", x, router.astype(x.dtype))
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  top, experts = jax.lax.top_k(probs, config.experts_per_token)
  if config.normalize_top_k:
    top = top / jnp.sum(top, axis=-1, keepdims=True)
  return logits.astype(jnp.float32), experts.astype(jnp.int32), top.astype(x.dtype)


def _expert(layer: Params, e: jax.Array, x: jax.Array, dt) -> jax.Array:
  """Expert `e`'s SwiGLU over every token `x [A, E]` -> `[A, E]`."""
  pick = lambda name: jax.lax.dynamic_index_in_dim(layer[name], e, 0, keepdims=False).astype(dt)
  hidden = jax.nn.silu(x @ pick("experts_gate")) * (x @ pick("experts_up"))
  return hidden @ pick("experts_down")


def experts_loop(layer: Params, config: ModelConfig, x: jax.Array, experts: jax.Array,
                 weights: jax.Array) -> jax.Array:
  """The "loop" implementation (module docstring): `[A, E]`."""
  a, z = x.shape[0], config.n_experts
  # [A, Z] each token's weight on each expert (0: not routed there).
  combine = jnp.zeros((a, z), weights.dtype).at[jnp.arange(a)[:, None], experts].add(weights)
  hit = jnp.zeros((z,), bool).at[experts.reshape(-1)].set(True)
  order = jnp.argsort(~hit, stable=True).astype(jnp.int32)  # the routed experts first
  steps = min(z, experts.size)

  def body(i, out):
    e = order[i]
    scale = jax.lax.dynamic_index_in_dim(combine, e, 1, keepdims=True)  # [A, 1]
    return out + scale * _expert(layer, e, x, x.dtype)

  return jax.lax.fori_loop(0, steps, body, jnp.zeros_like(x))


def experts_ragged(layer: Params, config: ModelConfig, x: jax.Array, experts: jax.Array,
                   weights: jax.Array) -> jax.Array:
  """The "ragged" implementation (module docstring): `[A, E]`."""
  a, k = experts.shape
  dt = x.dtype
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
  token = order // k
  sizes = jnp.bincount(flat, length=config.n_experts).astype(jnp.int32)
  rows = x[token]  # [A*k, E]
  gate = jax.lax.ragged_dot(rows, layer["experts_gate"].astype(dt), sizes)
  up = jax.lax.ragged_dot(rows, layer["experts_up"].astype(dt), sizes)
  out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, layer["experts_down"].astype(dt), sizes)
  out = out * weights.reshape(-1)[order][:, None]
  return jnp.zeros((a, x.shape[1]), dt).at[token].add(out)


# Platforms (`jax.lax.platform_dependent` names) where "auto" runs large forwards as grouped
# matmuls; elsewhere (the CPU) always the loop.
RAGGED_PLATFORMS = ("tpu", "cuda", "rocm")


def uses_loop(config: ModelConfig, tokens: int, platform: str = "cpu") -> bool:
  """Whether a forward over `tokens` tokens lowered for `platform` runs the "loop"
  implementation (module docstring)."""
  if config.moe_impl != "auto":
    return config.moe_impl == "loop"
  return (platform not in RAGGED_PLATFORMS
          or tokens * config.experts_per_token <= config.n_experts)


def moe_mlp(layer: Params, config: ModelConfig, h: jax.Array) -> jax.Array:
  """The mixture-of-experts MLP over the normalised residual stream `h [B, T, E]` ->
  `[B, T, E]`."""
  b, t, e = h.shape
  x = h.reshape(b * t, e)
  _, experts, weights = route(layer["router"], config, x)

  def on(platform: str) -> jax.Array:
    run = experts_loop if uses_loop(config, b * t, platform) else experts_ragged
    return run(layer, config, x, experts, weights)

  if all(uses_loop(config, b * t, p) == uses_loop(config, b * t) for p in RAGGED_PLATFORMS):
    out = on("cpu")
  else:  # a program lowered for one platform holds only that platform's branch
    out = jax.lax.platform_dependent(
        default=lambda: on("cpu"), **{p: functools.partial(on, p) for p in RAGGED_PLATFORMS})
  return out.reshape(b, t, e)


def activated_experts(layer: Params, config: ModelConfig, h: jax.Array,
                      rows: jax.Array | None = None) -> jax.Array:
  """How many distinct experts the tokens `h [B, T, E]` of the rows `rows [B]` (bool; None:
  all) are routed to: `[]` int32, what one MoE layer of a forward over them reads."""
  b, t, e = h.shape
  _, experts, _ = route(layer["router"], config, h.reshape(b * t, e))
  live = jnp.ones((b * t,), bool) if rows is None else jnp.repeat(rows, t)
  hit = jnp.zeros((config.n_experts,), bool).at[experts].max(live[:, None])
  return jnp.sum(hit, dtype=jnp.int32)
