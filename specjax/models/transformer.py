"""The trunk: a pure-functional Llama 3 / Qwen2 / Qwen3 / Qwen3-MoE decoder.

`forward(params, config, tokens, positions, cache)` runs the model over T new tokens. With
a cache it writes their keys/values in place after the committed slots; an optional
`new_mask` restricts which new tokens see each other, which is how a whole draft tree is
verified in one pass (each node sees only its ancestors).

Shape letters: see `specjax` (B batch, T new tokens, S cache slots, E d_model, F MLP width,
V vocab, Q query heads, K kv heads, R = Q / K, H head_dim, U = R x T query rows per kv head).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from specjax.models.attention import Visibility, attend
from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig
from specjax.models.layout import constrain_rows
from specjax.models.lora import ATTACHED, low_rank
from specjax.models.moe import moe_mlp
from specjax.models.params import Params


@struct.dataclass
class ForwardOutput:
  """Result of `forward`.

  Attributes:
    logits: `[B, T, V]` float32, or None when `compute_logits=False`.
    hidden: `[B, T, E]` final hidden state after the final norm (input of the output head).
    intermediates: residual stream after each layer listed in `hidden_layers`, `[B, T, E]`.
    cache: the cache with the new keys/values written, or None.
    router_logits: of a mixture-of-experts model, each layer's router logits `[B, T, Z]`
      float32 (`specjax.models.moe.load_balancing_loss`); () for a dense one.
  """

  logits: jax.Array | None
  hidden: jax.Array
  intermediates: tuple[jax.Array, ...]
  cache: KVCache | None
  router_logits: tuple[jax.Array, ...] = ()


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm computed in float32 and cast back, as HF Llama/Qwen do."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight.astype(x.dtype) * normed.astype(x.dtype)


def rope_frequencies(config: ModelConfig) -> jax.Array:
  """Inverse frequencies `[H/2]`, with Llama 3 scaling when configured."""
  h = config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
  scaling = config.rope_scaling
  if scaling is None:
    return inv_freq
  low_wavelen = scaling.original_max_position / scaling.low_freq_factor
  high_wavelen = scaling.original_max_position / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  smooth = ((scaling.original_max_position / wavelen - scaling.low_freq_factor)
            / (scaling.high_freq_factor - scaling.low_freq_factor))
  smoothed = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
  scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
  mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
  return jnp.where(mid, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotary embedding, half-split convention (HF `rotate_half`). x: `[B, T, *, H]`."""
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def _write(buf: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
  """Scatter `new [B, T, K, H]` into `buf [B, K, S, H]` at `slots [B, T]` (in place if donated)."""
  b, t = slots.shape
  new = new.astype(buf.dtype)
  if b * t == 1:
    # A one-element scatter is rewritten by XLA into a dynamic-update-slice, which XLA:CPU
    # then duplicates into the attention's operand, copying the whole buffer several times.
    # A second, out-of-range (dropped) index keeps it a scatter that updates in place.
    slots = jnp.concatenate([slots, jnp.full_like(slots, buf.shape[2])], axis=1)
    new = jnp.concatenate([new, new], axis=1)
  rows = jnp.arange(buf.shape[0])[:, None]
  return buf.at[rows, :, slots].set(new, mode="drop")


def block(layer: Params, config: ModelConfig, x: jax.Array, positions: jax.Array,
          vis: Visibility, kv: tuple[jax.Array, jax.Array] | None, slots: jax.Array | None,
          inv_freq: jax.Array
          ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None, jax.Array | None]:
  """One pre-norm transformer block (attention + SwiGLU MLP, or a mixture of SwiGLU experts:
  `specjax.models.moe`).

  Args:
    layer: the block's parameters (with LoRA factors under "lora" when attached:
      `specjax.models.lora`).
    x: `[B, T, E]` residual stream.
    positions: `[B, T]` absolute positions (for RoPE).
    vis: which slots (cache slots, or the T new tokens without a cache) each query sees.
    kv: this layer's `(keys, values)` buffers `[B, K, S, H]`, or None.
    slots: `[B, T]` slots the new keys/values are written to (with `kv`).
    inv_freq: `[H/2]` RoPE inverse frequencies.

  Returns:
    The new residual stream `[B, T, E]`, the updated `(keys, values)` (or None) and, of an
    MoE block, its router logits `[B, T, Z]` (None for a dense one).
  """
  dt = config.compute_dtype
  w = lambda name: layer[name].astype(dt)
  lora = layer.get(ATTACHED, {})  # LoRA factors `LoraAdapters.attach` put there, if any

  def project(spec: str, inputs: jax.Array, name: str, weight: jax.Array) -> jax.Array:
    out = jnp.einsum(spec, inputs, weight)
    if name not in lora:
      return out
    return out + low_rank(inputs, lora[name], dt).reshape(out.shape)

  b, t, _ = x.shape

  h = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
  q = project("BTE,EQH->BTQH", h, "wq", w("wq"))
  k = project("BTE,EKH->BTKH", h, "wk", w("wk"))
  v = project("BTE,EKH->BTKH", h, "wv", w("wv"))
  if config.qkv_bias:
    q, k, v = q + w("bq"), k + w("bk"), v + w("bv")
  if config.qk_norm:
    q = rms_norm(q, layer["q_norm"], config.rms_norm_eps)
    k = rms_norm(k, layer["k_norm"], config.rms_norm_eps)
  q = apply_rope(q, positions, inv_freq)
  k = apply_rope(k, positions, inv_freq)

  if kv is None:
    keys, values, new_kv = k, v, None
  else:
    keys, values = _write(kv[0], k, slots), _write(kv[1], v, slots)
    new_kv = (keys, values)

  # Batched matmuls in their natural operand order (batch B, K leading; the cache read in
  # its stored [B, K, S, H] layout): only the small q and attention output are transposed.
  # q [B, T, Q, H] -> [B, K, U, H]: the R x T query rows of each kv head, flattened.
  q = q.reshape(b, t, config.n_kv_heads, config.group_size, config.head_dim)
  q = q.transpose(0, 2, 3, 1, 4).reshape(b, config.n_kv_heads, config.group_size * t,
                                         config.head_dim)
  if kv is None:
    keys, values = keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)
  attn = attend(q, keys, values, vis, config, cached=kv is not None)
  attn = attn.reshape(b, config.n_kv_heads, config.group_size, t, config.head_dim)
  attn = attn.transpose(0, 3, 1, 2, 4)  # [B, T, K, R, H]
  # Contract over the flattened Q*H axis (X below): with two contracting dims XLA:CPU
  # transposes the whole wo weight every step to match the attention output's layout.
  attn = attn.reshape(b, t, config.n_heads * config.head_dim)
  wo = w("wo").reshape(config.n_heads * config.head_dim, config.d_model)
  x = x + project("BTX,XE->BTE", attn, "wo", wo)

  h = rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
  if config.is_moe:
    out, router_logits = moe_mlp(layer, config, h)
    return x + out, new_kv, router_logits
  gate = project("BTE,EF->BTF", h, "w_gate", w("w_gate"))
  up = project("BTE,EF->BTF", h, "w_up", w("w_up"))
  x = x + project("BTF,FE->BTE", jax.nn.silu(gate) * up, "w_down", w("w_down"))
  return x, new_kv, None


def embed(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
  """Token embeddings `[B, T, E]` in the compute dtype."""
  return jnp.take(params["embed"], tokens, axis=0).astype(config.compute_dtype)


def unembed(params: Params, config: ModelConfig, hidden: jax.Array) -> jax.Array:
  """Output head: normalised hidden `[..., E]` -> float32 logits `[..., V]`."""
  dt = config.compute_dtype
  if config.tie_embeddings:
    return jnp.einsum("...E,VE->...V", hidden, params["embed"].astype(dt),
                      preferred_element_type=jnp.float32)
  return jnp.einsum("...E,EV->...V", hidden, params["unembed"].astype(dt),
                    preferred_element_type=jnp.float32)


def causal_mask(batch: int, num_new: int) -> jax.Array:
  """`[B, T, T]` lower-triangular visibility among new tokens."""
  tri = jnp.tril(jnp.ones((num_new, num_new), bool))
  return jnp.broadcast_to(tri, (batch, num_new, num_new))


# `ModelConfig.remat`: what `jax.checkpoint` saves of a layer for its backward pass ("dots":
# the projections' outputs; the attention's batched dots are recomputed; "full": nothing).
_REMAT_POLICY = {"dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                 "full": jax.checkpoint_policies.nothing_saveable}


def run_blocks(layers: list[Params], config: ModelConfig, x: jax.Array, positions: jax.Array,
               cache: KVCache | None, new_mask: jax.Array | None,
               hidden_layers: tuple[int, ...] = ()
               ) -> tuple[jax.Array, tuple[jax.Array, ...], KVCache | None,
                          tuple[jax.Array, ...]]:
  """Apply `layers` to the residual stream `x [B, T, E]`, writing into `cache` if given.

  The cache must hold exactly `len(layers)` layers. Returns the final residual stream, the
  streams after the layers named in `hidden_layers`, the cache with new entries written
  (lengths unchanged), and the router logits of each MoE layer (() for dense layers).
  """
  b, t, _ = x.shape
  if new_mask is None:
    new_mask = causal_mask(b, t)
  new_mask = jnp.broadcast_to(new_mask, (b, t, t))
  inv_freq = rope_frequencies(config)
  if cache is None:
    vis, slots = Visibility(lengths=jnp.zeros((b,), jnp.int32), new_mask=new_mask), None
  else:
    if len(cache.keys) != len(layers):
      raise ValueError(f"cache has {len(cache.keys)} layers, the model {len(layers)}")
    vis = Visibility(lengths=cache.lengths, new_mask=new_mask)
    slots = cache.lengths[:, None] + jnp.arange(t)[None, :]
  keys, values, intermediates, routers = [], [], [], []
  layer_fn = block
  if cache is None and config.remat != "none":
    layer_fn = jax.checkpoint(block, static_argnums=(1,), policy=_REMAT_POLICY[config.remat])
  for i, layer in enumerate(layers):
    kv = None if cache is None else (cache.keys[i], cache.values[i])
    x, new_kv, router_logits = layer_fn(layer, config, x, positions, vis, kv, slots, inv_freq)
    if router_logits is not None:
      routers.append(router_logits)
    if new_kv is not None:
      keys.append(new_kv[0])
      values.append(new_kv[1])
    if i in hidden_layers:
      intermediates.append(x)
  if cache is not None:
    cache = cache.replace(keys=tuple(keys), values=tuple(values))
  return x, tuple(intermediates), cache, tuple(routers)


def forward(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
            cache: KVCache | None = None, *, new_mask: jax.Array | None = None,
            advance: jax.Array | int | None = None, hidden_layers: tuple[int, ...] = (),
            compute_logits: bool = True) -> ForwardOutput:
  """Run the trunk over T new tokens.

  Args:
    params: trunk parameters (`init_params` / `load_hf`).
    config: the model configuration (static).
    tokens: `[B, T]` int token ids.
    positions: `[B, T]` int absolute positions (RoPE); for a tree, committed length + depth.
    cache: optional `KVCache`; the new keys/values go to slots `lengths[b] + t`.
    new_mask: optional `[B, T, T]` (or broadcastable) bool visibility among the new tokens;
      default causal. For tree verification pass the tree's ancestor-or-self mask.
    advance: how many of the new slots to commit per row (`[B]` or scalar); default T.
      Tree verification passes 0 and commits the accepted path afterwards.
    hidden_layers: indices of layers whose output residual stream to return.
    compute_logits: skip the output head when only hidden states are needed.

  Returns:
    A `ForwardOutput`.
  """
  for idx in hidden_layers:
    if not 0 <= idx < config.n_layers:
      raise ValueError(f"hidden_layers contains {idx}; allowed: 0..{config.n_layers - 1}")
  x = constrain_rows(embed(params, config, tokens))  # rows split under a mesh (layout.py)
  x, intermediates, cache, routers = run_blocks(params["layers"], config, x, positions, cache,
                                                new_mask, hidden_layers)
  hidden = rms_norm(x, params["final_norm"], config.rms_norm_eps)
  logits = unembed(params, config, hidden) if compute_logits else None
  if cache is not None:
    cache = cache.advance(tokens.shape[1] if advance is None else advance)
  return ForwardOutput(logits=logits, hidden=hidden, intermediates=intermediates, cache=cache,
                       router_logits=routers)
