"""Mixture-of-experts MLP (Qwen3-MoE): a top-k router over Z SwiGLU experts, dropless.

Routing is as transformers' `Qwen3MoeTopKRouter` computes it: router logits in the compute
dtype, a float32 softmax over the Z experts, the top k probabilities (renormalised to sum to
one when `normalize_top_k`), cast back to the compute dtype. The layer's output for a token is
the weighted sum of its k experts' SwiGLU outputs. No capacity, no dropped tokens, no shared
expert.

Two ways to run the experts, one function up to rounding (`ModelConfig.moe_impl`):
- "loop" (decode steps): a loop over the distinct experts the forward's tokens were routed
  to, each one expert's three matmuls over every token (weighted by that token's routing
  weight, zero where it did not pick the expert). It reads only the activated experts'
  weights, which is what a memory-bound decode step pays for. Static trip count of
  min(Z, pairs), so it is differentiable; iterations past the distinct experts skip their
  work (`lax.cond`) and read nothing.
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
Measured costs: `benchmarks/README.md` (`moe_decode.py`). How XLA:GPU runs `ragged_dot` is not
measured here.

Under a mesh whose "expert" (then "fsdp") axes split the experts (`layout.EXPERT_AXES`, the
"expert" rule of `specjax.sharding`), either implementation runs inside `jax.shard_map` over
those axes (`experts_parallel`): each device runs its own experts on its group's tokens, and
no expert's weights are ever gathered.

Shape letters: see `specjax` (E d_model, F one expert's width, Z experts); A is the number of
tokens in the forward (B x T, flattened), k the experts per token.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.layout import EXPERT_AXES
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
  routed = jnp.sum(hit, dtype=jnp.int32)
  steps = min(z, experts.size)

  # Rematerialised: a backward pass recomputes each expert's activations instead of keeping
  # min(Z, pairs) of them ([A, E] and [A, F] each) for the whole loop.
  @jax.checkpoint
  def contribution(e):
    scale = jax.lax.dynamic_index_in_dim(combine, e, 1, keepdims=True)  # [A, 1]
    return scale * _expert(layer, e, x, x.dtype)

  def body(i, out):  # past the routed experts: no work, no weights read
    return jax.lax.cond(i < routed, lambda: out + contribution(order[i]), lambda: out)

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
  # Rows past every group (ids not held here) are left undefined by ragged_dot: masked, not
  # multiplied by their zero weight (NaN x 0 is NaN).
  grouped = jnp.arange(a * k) < jnp.sum(sizes)
  out = jnp.where(grouped[:, None], out * weights.reshape(-1)[order][:, None], 0)
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


def moe_mlp(layer: Params, config: ModelConfig, h: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The mixture-of-experts MLP over the normalised residual stream `h [B, T, E]`: its output
  `[B, T, E]` and the router's logits `[B, T, Z]` float32 (`load_balancing_loss`)."""
  b, t, e = h.shape
  x = h.reshape(b * t, e)
  logits, experts, weights = route(layer["router"], config, x)
  axes = _expert_axes(config)

  def on(platform: str) -> jax.Array:
    run = experts_loop if uses_loop(config, b * t, platform) else experts_ragged
    if axes:
      return experts_parallel(run, layer, config, x, experts, weights, axes, platform)
    return run(layer, config, x, experts, weights)

  if not axes and all(uses_loop(config, b * t, p) == uses_loop(config, b * t)
                                      for p in RAGGED_PLATFORMS):
    out = on("cpu")
  else:  # a program lowered for one platform holds only that platform's branch
    out = jax.lax.platform_dependent(
        default=lambda: on("cpu"), **{p: functools.partial(on, p) for p in RAGGED_PLATFORMS})
  return out.reshape(b, t, e), logits.reshape(b, t, config.n_experts)


def load_balancing_loss(router_logits: Sequence[jax.Array], config: ModelConfig,
                        mask: jax.Array | None = None) -> jax.Array:
  """The Switch Transformer load-balancing loss of a forward's routing, as transformers'
  Qwen3-MoE computes it (`load_balancing_loss_func`): Z x sum over experts of (the share of
  top-k assignments it received) x (its mean router probability), pooled over every layer and
  every token where `mask [B, T]` (None: all) holds. k when the routing is balanced, up to Z
  when every token picks the same experts with all its probability.

  Args:
    router_logits: one `[B, T, Z]` per MoE layer (`ForwardOutput.router_logits`).
  """
  if not router_logits:
    raise ConfigError("load_balancing_loss needs the router logits of a mixture-of-experts "
                      "model's forward; this forward has none (a dense model)")
  z, k = config.n_experts, config.experts_per_token
  b, t, _ = router_logits[0].shape
  weight = jnp.ones((b * t,), jnp.float32) if mask is None else mask.reshape(-1).astype(
      jnp.float32)
  counts = jnp.zeros((z,), jnp.float32)
  probs = jnp.zeros((z,), jnp.float32)
  for logits in router_logits:
    p = jax.nn.softmax(logits.reshape(b * t, z).astype(jnp.float32), axis=-1)
    top = jax.lax.top_k(p, k)[1]
    counts = counts.at[top.reshape(-1)].add(jnp.repeat(weight, k))
    probs = probs + jnp.sum(p * weight[:, None], axis=0)
  rows = len(router_logits) * jnp.maximum(jnp.sum(weight), 1.0)
  return z * jnp.sum((counts / rows) * (probs / rows))


def _expert_axes(config: ModelConfig) -> tuple[str, ...]:
  """The current mesh's axes the experts are split over (`layout.EXPERT_AXES`, the longest
  prefix whose size divides n_experts, as `specjax.sharding`'s rules place the weights); ()
  without a mesh or when they hold one device."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  n = mesh.shape.get("expert", 1)
  if n > 1 and config.n_experts % n:
    raise ConfigError(f"the mesh's expert axis has {n} devices, which do not divide the "
                      f"model's n_experts={config.n_experts}: allowed an expert axis that "
                      "divides it (mesh.expert)")
  axes, size = [], 1
  for axis in EXPERT_AXES:
    if axis not in mesh.axis_names or config.n_experts % (size * mesh.shape[axis]):
      break
    axes.append(axis)
    size *= mesh.shape[axis]
  return tuple(axes) if size > 1 else ()


def experts_parallel(run, layer: Params, config: ModelConfig, x: jax.Array,
                     experts: jax.Array, weights: jax.Array, axes: tuple[str, ...],
                     platform: str = "cpu") -> jax.Array:
  """`run` (`experts_loop` or `experts_ragged`) with the experts split over the mesh axes
  `axes` (n devices; expert parallelism, `jax.shard_map` manual over those axes only).

  Each device holds Z / n experts and A / n of the tokens (A padded to a multiple of n with
  tokens routed nowhere). It gathers the tokens of its group (and their routing) from the
  other n - 1, runs its own experts on every token routed to them (the others weigh 0 there),
  and the partial outputs are summed back onto the devices that own the tokens
  (`psum_scatter`): an all-gather and a reduce-scatter of `[A, E]` per layer, dropless, each
  expert's weights read on one device only, never gathered. The other mesh axes stay with
  the compiler (tensor splits of the experts' width). Lowered for a CPU (`platform`), floats
  cross devices as float32: XLA:CPU aborts compiling a bfloat16 reduce-scatter (its
  all-reduce promotion pass, jaxlib 0.10), which the gathers' gradients are too.
  """
  mesh = jax.sharding.get_abstract_mesh()
  n = 1
  for axis in axes:
    n *= mesh.shape[axis]
  local = config.n_experts // n
  a = x.shape[0]
  pad = -a % n
  if pad:  # rows routed to no expert: weight 0, an id held nowhere
    x = jnp.pad(x, ((0, pad), (0, 0)))
    experts = jnp.pad(experts, ((0, pad), (0, 0)), constant_values=config.n_experts)
    weights = jnp.pad(weights, ((0, pad), (0, 0)))

  # XLA:CPU cannot compile bfloat16 reduce-scatters (nor so the gathers' transposes): there
  # floats travel as float32.
  wide = lambda v: (v.astype(jnp.promote_types(v.dtype, jnp.float32))
                    if platform == "cpu" and jnp.issubdtype(v.dtype, jnp.floating) else v)

  def on_device(x, experts, weights, gate, up, down):
    gather = lambda v: jax.lax.all_gather(wide(v), axes, axis=0, tiled=True).astype(v.dtype)
    x, experts, weights = gather(x), gather(experts), gather(weights)
    first = jax.lax.axis_index(axes) * local
    mine = (experts >= first) & (experts < first + local)
    ids = jnp.where(mine, experts - first, local)  # `local`: held elsewhere, skipped
    own = {"experts_gate": gate, "experts_up": up, "experts_down": down}
    out = run(own, config, x, ids, jnp.where(mine, weights, 0))
    return jax.lax.psum_scatter(wide(out), axes, scatter_dimension=0,
                                tiled=True).astype(x.dtype)

  spec = jax.sharding.PartitionSpec(axes)
  out = jax.shard_map(on_device, in_specs=(spec,) * 6, out_specs=spec,
                      axis_names=frozenset(axes))(
      x, experts, weights, layer["experts_gate"], layer["experts_up"], layer["experts_down"])
  return out[:a]


def routed_experts(router_logits: jax.Array, config: ModelConfig,
                   rows: jax.Array | None = None) -> jax.Array:
  """How many distinct experts one MoE layer routed the tokens of the rows `rows [B]` (bool;
  None: all) to, from its router logits `[B, T, Z]` (`ForwardOutput.router_logits`): `[]`
  int32, the experts whose weights that layer of the forward read."""
  b, t, z = router_logits.shape
  experts = jax.lax.top_k(router_logits.reshape(b * t, z), config.experts_per_token)[1]
  live = jnp.ones((b * t,), bool) if rows is None else jnp.repeat(rows, t)
  hit = jnp.zeros((z,), bool).at[experts].max(live[:, None])
  return jnp.sum(hit, dtype=jnp.int32)
