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

from specjax.errors import ConfigError
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
  """The "loop" implementation (module docstring): `[A, E]`. `layer` holds Z experts (a
  device's share under expert parallelism); an expert id of Z or more is not among them and
  is skipped."""
  a, z = x.shape[0], layer["experts_gate"].shape[0]
  # [A, Z] each token's weight on each expert (0: not routed there).
  combine = jnp.zeros((a, z), weights.dtype).at[jnp.arange(a)[:, None], experts].add(
      weights, mode="drop")
  hit = jnp.zeros((z,), bool).at[experts.reshape(-1)].set(True, mode="drop")
  order = jnp.argsort(~hit, stable=True).astype(jnp.int32)  # the routed experts first
  steps = min(z, experts.size)

  def body(i, out):
    e = order[i]
    scale = jax.lax.dynamic_index_in_dim(combine, e, 1, keepdims=True)  # [A, 1]
    return out + scale * _expert(layer, e, x, x.dtype)

  return jax.lax.fori_loop(0, steps, body, jnp.zeros_like(x))


def experts_ragged(layer: Params, config: ModelConfig, x: jax.Array, experts: jax.Array,
                   weights: jax.Array) -> jax.Array:
  """The "ragged" implementation (module docstring): `[A, E]`. Expert ids of Z or more (not
  held here, `experts_loop`) sort last, outside every group, and carry weight 0."""
  a, k = experts.shape
  dt = x.dtype
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
  token = order // k
  z = layer["experts_gate"].shape[0]
  sizes = jnp.zeros((z,), jnp.int32).at[flat].add(1, mode="drop")
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
    parallel = _expert_parallelism(config, b * t)
    if parallel > 1:
      return experts_parallel(run, layer, config, x, experts, weights, parallel)
    return run(layer, config, x, experts, weights)

  if all(uses_loop(config, b * t, p) == uses_loop(config, b * t) for p in RAGGED_PLATFORMS):
    out = on("cpu")
  else:  # a program lowered for one platform holds only that platform's branch
    out = jax.lax.platform_dependent(
        default=lambda: on("cpu"), **{p: functools.partial(on, p) for p in RAGGED_PLATFORMS})
  return out.reshape(b, t, e)


def _expert_parallelism(config: ModelConfig, tokens: int) -> int:
  """The size of the current mesh's "expert" axis when a forward over `tokens` tokens splits
  its experts over it (1: it does not; the compiler places the experts' weights)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or "expert" not in mesh.axis_names:
    return 1
  n = mesh.shape["expert"]
  if n > 1 and config.n_experts % n:
    raise ConfigError(f"the mesh's expert axis has {n} devices, which do not divide the "
                      f"model's n_experts={config.n_experts}: allowed an expert axis that "
                      "divides it (mesh.expert)")
  return n if n > 1 and tokens % n == 0 else 1


def experts_parallel(run, layer: Params, config: ModelConfig, x: jax.Array,
                     experts: jax.Array, weights: jax.Array, n: int) -> jax.Array:
  """`run` (`experts_loop` or `experts_ragged`) with the experts split over the mesh's
  "expert" axis of size `n` (expert parallelism, `jax.shard_map` manual over that axis only).

  Each device holds Z / n experts and A / n of the tokens. It gathers the tokens of its
  expert group (and their routing) from the other n - 1, runs its own experts on every token
  routed to them (the others weigh 0 there), and the partial outputs are summed back onto the
  devices that own the tokens (`psum_scatter`): an all-gather and a reduce-scatter of `[A, E]`
  per layer, dropless, each expert's weights read on one device only. The other mesh axes
  stay with the compiler (fsdp gathers, tensor splits of the experts' width).
  """
  local = config.n_experts // n

  def on_device(x, experts, weights, gate, up, down):
    gather = lambda v: jax.lax.all_gather(v, "expert", axis=0, tiled=True)
    x, experts, weights = gather(x), gather(experts), gather(weights)
    first = jax.lax.axis_index("expert") * local
    mine = (experts >= first) & (experts < first + local)
    ids = jnp.where(mine, experts - first, local)  # `local`: held elsewhere, skipped
    own = {"experts_gate": gate, "experts_up": up, "experts_down": down}
    out = run(own, config, x, ids, jnp.where(mine, weights, 0))
    return jax.lax.psum_scatter(out, "expert", scatter_dimension=0, tiled=True)

  spec = jax.sharding.PartitionSpec("expert")
  return jax.shard_map(on_device, in_specs=(spec,) * 6, out_specs=spec,
                       axis_names=frozenset({"expert"}))(
      x, experts, weights, layer["experts_gate"], layer["experts_up"], layer["experts_down"])


def activated_experts(layer: Params, config: ModelConfig, h: jax.Array,
                      rows: jax.Array | None = None) -> jax.Array:
  """How many distinct experts the tokens `h [B, T, E]` of the rows `rows [B]` (bool; None:
  all) are routed to: `[]` int32, what one MoE layer of a forward over them reads."""
  b, t, e = h.shape
  _, experts, _ = route(layer["router"], config, h.reshape(b * t, e))
  live = jnp.ones((b * t,), bool) if rows is None else jnp.repeat(rows, t)
  hit = jnp.zeros((config.n_experts,), bool).at[experts].max(live[:, None])
  return jnp.sum(hit, dtype=jnp.int32)
