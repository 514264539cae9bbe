"""EAGLE-3 draft model (Li et al. 2025): fused target features, one decoder layer, own vocab.

The draft reads three residual streams of the target (low, middle, high), fuses them with
one linear layer `fc [3E, E]`, and runs one decoder layer (the "midlayer") whose attention
input is `[RMSNorm(token embedding); RMSNorm(hidden)]` (width 2E) and whose residual is the
hidden state. Its output stream is fed back as the next step's hidden state; its logits come
from a final norm and its own head over a draft vocabulary of W <= V target ids.

Conventions (as in EAGLE, vLLM and SGLang):
  * Aux layer ids follow vLLM: id `i` is the *input* residual stream of target layer `i`,
    i.e. the output of layer `i - 1`, which is specjax's `forward(..., hidden_layers=(i - 1,))`
    intermediate. `Eagle3Config.hidden_layers` does that conversion.
  * The layer at position p reads (hidden at p, token t_{p+1}) and predicts t_{p+2}. With the
    root token at position r, positions <= r - 1 are committed with target features
    `fuse(aux)_p`; the depth-1 draft comes from the output at r - 1; the depth-(j+1) draft
    runs the layer at position r + j - 1 with its own output at r + j - 2 as hidden and the
    depth-j token, attending to the committed keys and to its own chain's keys.
  * The draft->target vocabulary map `d2t` is an int32 array `[W]` of distinct target ids
    (ascending when built by `build_draft_vocab`); it is not a parameter.

Training-time test (`eagle3_ttt_logits` / `eagle3_ttt_loss`) unrolls exactly that chain for
every root at once: step j at position p (root p - j + 1) reads step j - 1's output at p - 1
and the teacher token t_{p+1}, and attends to step-0 keys at positions <= p - j and to the
step-m key at position p - j + m for m = 1..j (the keys its inference chain would see).

Shape letters: see `specjax` (B batch, T tokens, S cache slots (or keys), E d_model, F MLP
width, V target vocab, W draft vocab, Q query heads, K kv heads, R = Q / K, H head_dim,
U = R x T query rows per kv head, J training-time-test steps).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from specjax.checks import is_int
from specjax.errors import ConfigError
from specjax.models.cache import KVCache
from specjax.models.config import DTYPES, Llama3RopeScaling, ModelConfig, _require
from specjax.models.params import Params
from specjax.models.transformer import _write, apply_rope, rms_norm, rope_frequencies

_INIT_STD = 0.02
# Logit of target ids outside the draft vocabulary: finite (no inf - inf = nan downstream)
# yet small enough that exp underflows to exactly 0 after any log_softmax.
_NEG = -1e30


def default_aux_layers(n_target_layers: int) -> tuple[int, int, int]:
  """Default aux layer ids for an n-layer target.

  vLLM's `(2, n // 2, n - 3)` when those are strictly increasing (n >= 7); otherwise
  `(1, n // 2, n - 1)`, which is distinct for n = 4..6 and repeats ids for n = 2, 3 (a
  2- or 3-layer target has fewer than three distinct inner streams; vLLM captures a repeated
  id only once, so such drafts are for tests, not for serving).
  """
  n = n_target_layers
  if not isinstance(n, int) or n < 2:
    raise ConfigError(f"n_target_layers={n!r} is invalid: EAGLE-3 needs a target with >= 2 "
                      "layers (aux ids are in 1..L-1)")
  vllm = (2, n // 2, n - 3)
  if vllm[0] < vllm[1] < vllm[2]:
    return vllm
  return (1, n // 2, n - 1)


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
  """Architecture of an EAGLE-3 draft model (hashable: the static argument of its functions).

  Attributes:
    d_model: E, width of the draft (and of the target's residual stream and embedding).
    n_heads: Q, query heads.
    n_kv_heads: K, key/value heads (Q % K == 0).
    head_dim: H, per-head width (even, for RoPE).
    mlp_dim: F, hidden width of the SwiGLU MLP.
    vocab_size: V, the target's vocabulary size.
    draft_vocab_size: W, size of the draft head's vocabulary, 1..V.
    aux_layers: (low, mid, high) target layer ids in vLLM's convention: id i is the input
      residual stream of target layer i (the output of layer i - 1); non-decreasing, >= 1.
    rms_norm_eps: epsilon of every RMSNorm.
    rope_theta: RoPE base.
    rope_scaling: None, or Llama 3 style frequency scaling.
    max_position: largest position the draft is meant to see; caches may not exceed it.
    dtype: activation / compute dtype.
    param_dtype: dtype parameters are created and stored in.
  """

  d_model: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  mlp_dim: int
  vocab_size: int
  draft_vocab_size: int
  aux_layers: tuple[int, int, int]
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10_000.0
  rope_scaling: Llama3RopeScaling | None = None
  max_position: int = 2048
  dtype: Literal["float32", "bfloat16", "float16"] = "float32"
  param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"

  def __post_init__(self):
    for name in ("d_model", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "vocab_size",
                 "draft_vocab_size", "max_position"):
      value = getattr(self, name)
      _require(isinstance(value, int) and not isinstance(value, bool) and value > 0, name,
               value, "must be a positive int")
    _require(self.draft_vocab_size <= self.vocab_size, "draft_vocab_size",
             self.draft_vocab_size, f"must be in 1..vocab_size={self.vocab_size}")
    _require(self.n_heads % self.n_kv_heads == 0, "n_kv_heads", self.n_kv_heads,
             f"must divide n_heads={self.n_heads} (grouped-query attention)")
    _require(self.head_dim % 2 == 0, "head_dim", self.head_dim, "must be even (RoPE pairs)")
    _require(self.rope_theta > 0, "rope_theta", self.rope_theta, "must be > 0")
    _require(self.rms_norm_eps > 0, "rms_norm_eps", self.rms_norm_eps, "must be > 0")
    _require(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
    _require(self.param_dtype in DTYPES, "param_dtype", self.param_dtype, f"one of {DTYPES}")
    _require(self.rope_scaling is None or isinstance(self.rope_scaling, Llama3RopeScaling),
             "rope_scaling", self.rope_scaling, "None or a Llama3RopeScaling")
    aux = self.aux_layers
    if isinstance(aux, list):  # a list from JSON would make the config unhashable
      aux = tuple(aux)
      object.__setattr__(self, "aux_layers", aux)
    _require(isinstance(aux, tuple) and len(aux) == 3
             and all(isinstance(i, int) and not isinstance(i, bool) for i in aux),
             "aux_layers", aux, "must be a tuple of 3 ints (low, mid, high)")
    _require(all(i >= 1 for i in aux) and aux[0] <= aux[1] <= aux[2], "aux_layers", aux,
             "must be non-decreasing target layer ids >= 1 (id i = input of target layer i)")

  @classmethod
  def for_target(cls, target: ModelConfig, *, draft_vocab_size: int | None = None,
                 aux_layers: tuple[int, int, int] | None = None,
                 mlp_dim: int | None = None) -> Eagle3Config:
    """A draft matching `target`'s width, heads, RoPE and dtypes.

    Args:
      target: the target model's config.
      draft_vocab_size: W; default the whole target vocabulary.
      aux_layers: default `default_aux_layers(target.n_layers)`.
      mlp_dim: default the target's.
    """
    config = cls(
        d_model=target.d_model,
        n_heads=target.n_heads,
        n_kv_heads=target.n_kv_heads,
        head_dim=target.head_dim,
        mlp_dim=target.mlp_dim if mlp_dim is None else mlp_dim,
        vocab_size=target.vocab_size,
        draft_vocab_size=target.vocab_size if draft_vocab_size is None else draft_vocab_size,
        aux_layers=default_aux_layers(target.n_layers) if aux_layers is None else aux_layers,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=target.rope_theta,
        rope_scaling=target.rope_scaling,
        max_position=target.max_position,
        dtype=target.dtype,
        param_dtype=target.param_dtype,
    )
    config.check_target(target)
    return config

  def check_target(self, target: ModelConfig) -> None:
    """Raise ConfigError unless this draft can run on `target`'s features and embedding."""
    if self.d_model != target.d_model:
      raise ConfigError(f"d_model={self.d_model} is invalid for a target with d_model="
                        f"{target.d_model}: the draft reads the target's residual streams and "
                        "embedding, so the widths must be equal")
    if self.vocab_size != target.vocab_size:
      raise ConfigError(f"vocab_size={self.vocab_size} is invalid for a target with "
                        f"vocab_size={target.vocab_size}: they must be equal")
    n = target.n_layers
    if not all(1 <= i <= n - 1 for i in self.aux_layers):
      allowed = f"each must be in 1..{n - 1}" if n >= 2 else "a target needs >= 2 layers"
      raise ConfigError(f"aux_layers={self.aux_layers} is invalid for a {n}-layer target: "
                        f"{allowed} (id i = input of target layer i)")

  @property
  def hidden_layers(self) -> tuple[int, int, int]:
    """The aux layers as specjax `forward(..., hidden_layers=...)` indices (id - 1)."""
    return tuple(i - 1 for i in self.aux_layers)

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def weight_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.param_dtype)

  @property
  def group_size(self) -> int:
    """R, query heads per key/value head (Q / K)."""
    return self.n_heads // self.n_kv_heads

  def as_model_config(self) -> ModelConfig:
    """A one-layer `ModelConfig` with the draft's attention and RoPE geometry (for
    `rope_frequencies` and `KVCache.create`); its vocabulary is the target's."""
    return ModelConfig(
        vocab_size=self.vocab_size, d_model=self.d_model, n_layers=1, n_heads=self.n_heads,
        n_kv_heads=self.n_kv_heads, head_dim=self.head_dim, mlp_dim=self.mlp_dim,
        rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
        rms_norm_eps=self.rms_norm_eps, max_position=self.max_position, dtype=self.dtype,
        param_dtype=self.param_dtype)

  def replace(self, **changes) -> Eagle3Config:
    return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------------------------
# Parameters


def eagle3_param_axes(config: Eagle3Config) -> Params:
  """Logical axis names with the same tree structure as `init_eagle3(config, key)`."""
  del config  # every config has the same tree
  return {
      "fc": P(None, "embed"),
      "layer": {
          "hidden_norm": P("embed"),
          "input_norm": P("embed"),
          "wq": P(None, "heads", "head_dim"),
          "wk": P(None, "kv_heads", "head_dim"),
          "wv": P(None, "kv_heads", "head_dim"),
          "wo": P("heads", "head_dim", "embed"),
          "mlp_norm": P("embed"),
          "w_gate": P("embed", "mlp"),
          "w_up": P("embed", "mlp"),
          "w_down": P("mlp", "embed"),
      },
      "norm": P("embed"),
      "lm_head": P("embed", "vocab"),
  }


def init_eagle3(config: Eagle3Config, key: jax.Array) -> Params:
  """Random parameters: matrices normal with std 0.02, norms one."""
  e, q, k, h, f, w = (config.d_model, config.n_heads, config.n_kv_heads, config.head_dim,
                      config.mlp_dim, config.draft_vocab_size)
  dt = config.weight_dtype
  keys = jax.random.split(key, 9)
  normal = lambda kk, shape: (_INIT_STD * jax.random.normal(kk, shape)).astype(dt)
  ones = lambda: jnp.ones((e,), dt)
  return {
      "fc": normal(keys[0], (3 * e, e)),
      "layer": {
          "hidden_norm": ones(),
          "input_norm": ones(),
          "wq": normal(keys[1], (2 * e, q, h)),
          "wk": normal(keys[2], (2 * e, k, h)),
          "wv": normal(keys[3], (2 * e, k, h)),
          "wo": normal(keys[4], (q, h, e)),
          "mlp_norm": ones(),
          "w_gate": normal(keys[5], (e, f)),
          "w_up": normal(keys[6], (e, f)),
          "w_down": normal(keys[7], (f, e)),
      },
      "norm": ones(),
      "lm_head": normal(keys[8], (e, w)),
  }


# ---------------------------------------------------------------------------------------------
# Draft vocabulary


def count_tokens(tokens: np.ndarray, mask: np.ndarray | None, vocab_size: int) -> np.ndarray:
  """Occurrences `[V]` (int64) of each target id among `tokens` where `mask` is set.

  Args:
    tokens: int array of any shape, ids in [0, V).
    mask: same shape (bool or 0/1), or None to count every token.
    vocab_size: V.
  """
  tokens = np.asarray(tokens)
  if mask is not None:
    mask = np.asarray(mask)
    if mask.shape != tokens.shape:
      raise ConfigError(f"mask has shape {mask.shape}, tokens {tokens.shape}: they must match")
    tokens = tokens[mask.astype(bool)]
  tokens = tokens.reshape(-1)
  if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
    raise ConfigError(f"tokens contain ids in [{tokens.min()}, {tokens.max()}]: allowed "
                      f"0..{vocab_size - 1} (vocab_size={vocab_size})")
  return np.bincount(tokens.astype(np.int64), minlength=vocab_size).astype(np.int64)


def build_draft_vocab(token_counts: np.ndarray, draft_vocab_size: int) -> np.ndarray:
  """The draft vocabulary `d2t [W]` (int32): the W most frequent target ids, ascending.

  Ties are broken towards the lower id; `W == V` gives `arange(V)`.

  Args:
    token_counts: `[V]` non-negative counts (e.g. from `count_tokens`).
    draft_vocab_size: W, 1..V.
  """
  counts = np.asarray(token_counts)
  if counts.ndim != 1 or counts.size == 0:
    raise ConfigError(f"token_counts has shape {counts.shape}: expected a non-empty [V] array")
  if np.any(counts < 0):
    raise ConfigError("token_counts has negative entries: counts must be >= 0")
  v = counts.size
  if not is_int(draft_vocab_size) or not 1 <= draft_vocab_size <= v:
    raise ConfigError(f"draft_vocab_size={draft_vocab_size!r} is invalid: must be in 1..{v} "
                      "(the length of token_counts)")
  ids = np.arange(v)
  order = np.lexsort((ids, -counts))  # by count descending, then id ascending
  return np.sort(order[:draft_vocab_size]).astype(np.int32)


def check_d2t(d2t: np.ndarray, config: Eagle3Config) -> None:
  """Raise ConfigError unless `d2t` is `[W]` distinct target ids in [0, V)."""
  d2t = np.asarray(d2t)
  w, v = config.draft_vocab_size, config.vocab_size
  if d2t.shape != (w,) or not np.issubdtype(d2t.dtype, np.integer):
    raise ConfigError(f"d2t has shape {d2t.shape} and dtype {d2t.dtype}: expected integer "
                      f"target ids of shape ({w},) (draft_vocab_size)")
  if d2t.min() < 0 or d2t.max() >= v:
    raise ConfigError(f"d2t maps to target ids in [{d2t.min()}, {d2t.max()}]: allowed "
                      f"0..{v - 1} (vocab_size={v})")
  if np.unique(d2t).size != w:
    raise ConfigError("d2t is not injective: two draft ids map to the same target id")


def to_target_vocab(draft_logits: jax.Array, d2t: jax.Array, vocab_size: int) -> jax.Array:
  """Scatter draft logits `[..., W]` to target ids: float32 `[..., V]`, `-1e30` elsewhere.

  A later log_softmax gives exactly zero probability outside the draft vocabulary.
  """
  out = jnp.full(draft_logits.shape[:-1] + (vocab_size,), _NEG, jnp.float32)
  return out.at[..., d2t].set(draft_logits.astype(jnp.float32))


# ---------------------------------------------------------------------------------------------
# The model


def select_aux(config: Eagle3Config, intermediates: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
  """(low, mid, high) from `forward(..., hidden_layers=config.hidden_layers).intermediates`.

  `forward` returns one stream per distinct listed layer, in layer order; this maps them back
  to the three aux slots (which may repeat a layer on tiny targets).
  """
  distinct = sorted(set(config.hidden_layers))
  if len(intermediates) != len(distinct):
    raise ValueError(f"got {len(intermediates)} intermediates, expected {len(distinct)} "
                     f"(one per distinct layer of hidden_layers={config.hidden_layers})")
  return tuple(intermediates[distinct.index(i)] for i in config.hidden_layers)


def fuse(params: Params, config: Eagle3Config, aux: Sequence[jax.Array]) -> jax.Array:
  """Target features `fc([low; mid; high])`: three `[B, T, E]` -> `[B, T, E]`."""
  if len(aux) != 3:
    raise ValueError(f"aux has {len(aux)} arrays: expected 3 (low, mid, high)")
  dt = config.compute_dtype
  x = jnp.concatenate([a.astype(dt) for a in aux], axis=-1)
  return jnp.einsum("BTX,XE->BTE", x, params["fc"].astype(dt))  # X = 3E


def _qkv(layer: Params, config: Eagle3Config, token_embeds: jax.Array, hidden: jax.Array,
         positions: jax.Array, inv_freq: jax.Array
         ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """q `[B, T, Q, H]`, k and v `[B, T, K, H]` from `[RMSNorm(emb); RMSNorm(hidden)]`, roped."""
  dt = config.compute_dtype
  w = lambda name: layer[name].astype(dt)
  e = rms_norm(token_embeds.astype(dt), layer["input_norm"], config.rms_norm_eps)
  h = rms_norm(hidden.astype(dt), layer["hidden_norm"], config.rms_norm_eps)
  x = jnp.concatenate([e, h], axis=-1)  # [B, T, 2E]: embedding first, as EAGLE-3 stores it
  # X = 2E, the concatenated input.
  q = jnp.einsum("BTX,XQH->BTQH", x, w("wq"))
  k = jnp.einsum("BTX,XKH->BTKH", x, w("wk"))
  v = jnp.einsum("BTX,XKH->BTKH", x, w("wv"))
  return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def _attend(config: Eagle3Config, q: jax.Array, keys: jax.Array, values: jax.Array,
            mask: jax.Array) -> jax.Array:
  """Grouped-query attention: q `[B, T, Q, H]` over keys/values `[B, K, S, H]` where
  `mask [B, T, S]` -> `[B, T, Q*H]`."""
  dt = config.compute_dtype
  b, t = q.shape[:2]
  k_heads, r, hd = config.n_kv_heads, config.group_size, config.head_dim
  # Same operand order as `transformer.block`: batch B, K leading, the keys read as stored;
  # q becomes [B, K, U, H], the R x T query rows of each kv head.
  q = q.reshape(b, t, k_heads, r, hd).transpose(0, 2, 3, 1, 4).reshape(b, k_heads, r * t, hd)
  scores = jnp.einsum("BKUH,BKSH->BKUS", q, keys.astype(dt),
                      preferred_element_type=jnp.float32)
  scores = scores.reshape(b, k_heads, r, t, -1) / math.sqrt(hd)
  scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(dt).reshape(b, k_heads, r * t, -1)
  attn = jnp.einsum("BKUS,BKSH->BKUH", probs, values.astype(dt))
  attn = attn.reshape(b, k_heads, r, t, hd).transpose(0, 3, 1, 2, 4)  # [B, T, K, R, H]
  return attn.reshape(b, t, config.n_heads * hd)


def _finish(layer: Params, config: Eagle3Config, residual: jax.Array,
            attn: jax.Array) -> jax.Array:
  """Output projection, residual add, post-attention norm, SwiGLU MLP, residual add."""
  dt = config.compute_dtype
  w = lambda name: layer[name].astype(dt)
  wo = w("wo").reshape(config.n_heads * config.head_dim, config.d_model)
  x = residual.astype(dt) + jnp.einsum("BTX,XE->BTE", attn, wo)  # X = Q*H
  h = rms_norm(x, layer["mlp_norm"], config.rms_norm_eps)
  gate = jnp.einsum("BTE,EF->BTF", h, w("w_gate"))
  up = jnp.einsum("BTE,EF->BTF", h, w("w_up"))
  return x + jnp.einsum("BTF,FE->BTE", jax.nn.silu(gate) * up, w("w_down"))


def eagle3_layer(params: Params, config: Eagle3Config, token_embeds: jax.Array,
                 hidden: jax.Array, positions: jax.Array, *, mask: jax.Array,
                 kv: tuple[jax.Array, jax.Array] | None = None,
                 slots: jax.Array | None = None
                 ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
  """The midlayer over T new positions.

  Args:
    params: draft parameters (`init_eagle3` / `load_eagle3`).
    config: the draft configuration (static).
    token_embeds: `[B, T, E]` target embeddings of the tokens one step ahead (t_{p+1}).
    hidden: `[B, T, E]` fused target features, or the draft's own previous output stream.
    positions: `[B, T]` absolute positions p (RoPE).
    mask: `[B, T, S]` bool, which cache slots each query sees (the caller decides, so draft
      tree levels in scratch slots see exactly their ancestors); `[B, T, T]` without a cache.
    kv: the draft's `(keys, values)` buffers `[B, K, S, H]` (one-layer `KVCache` layout), or
      None to attend among the T new positions only.
    slots: `[B, T]` slots the new keys/values are written to (required with `kv`);
      out-of-range slots are dropped.

  Returns:
    The output residual stream `[B, T, E]` (pre-norm: the next step's `hidden`; see
    `eagle3_draft_logits`) and the updated `(keys, values)`, or None without `kv`.
  """
  layer = params["layer"]
  inv_freq = rope_frequencies(config.as_model_config())
  q, k, v = _qkv(layer, config, token_embeds, hidden, positions, inv_freq)
  if kv is None:
    keys, values, new_kv = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), None
  else:
    if slots is None:
      raise ValueError("slots is required with kv: the [B, T] slots the new keys go to")
    keys, values = _write(kv[0], k, slots), _write(kv[1], v, slots)
    new_kv = (keys, values)
  b, t = positions.shape
  mask = jnp.broadcast_to(mask, (b, t, keys.shape[2]))
  out = _finish(layer, config, hidden, _attend(config, q, keys, values, mask))
  return out, new_kv


def eagle3_draft_logits(params: Params, config: Eagle3Config, hidden: jax.Array) -> jax.Array:
  """Draft logits float32 `[..., W]` of output streams `[..., E]` (final norm, then head)."""
  dt = config.compute_dtype
  h = rms_norm(hidden.astype(dt), params["norm"], config.rms_norm_eps)
  return jnp.einsum("...E,EW->...W", h, params["lm_head"].astype(dt),
                    preferred_element_type=jnp.float32)


def eagle3_cache(config: Eagle3Config, batch_size: int, max_len: int) -> KVCache:
  """Zero one-layer `KVCache` `[B, K, S, H]` for the draft's midlayer."""
  return KVCache.create(config.as_model_config(), batch_size, max_len, n_layers=1)


# ---------------------------------------------------------------------------------------------
# Training-time test


def _ttt_mask(num: int, step: int) -> jax.Array:
  """`[T, (step + 1) T]` visibility of step `step`'s queries over the keys of steps 0..step.

  Query p sees step-0 keys at positions <= p - step and the step-m key at p - step + m.
  """
  p = jnp.arange(num)[:, None]
  s = jnp.arange(num)[None, :]
  blocks = [s <= p - step] + [s == p - step + m for m in range(1, step + 1)]
  return jnp.concatenate(blocks, axis=1)


def eagle3_ttt_logits(params: Params, config: Eagle3Config, embed_table: jax.Array,
                      tokens: jax.Array, aux: Sequence[jax.Array], steps: int) -> jax.Array:
  """Draft logits of every training-time-test step at every position.

  Args:
    params: draft parameters (trainable: fc, midlayer, norm, head).
    config: the draft configuration (static).
    embed_table: `[V, E]` the target's input embedding (frozen: gradients are stopped).
    tokens: `[B, T]` right-padded sequences starting at position 0.
    aux: three `[B, T, E]` target streams (low, mid, high) of `tokens` (constants).
    steps: J >= 1 (static).

  Returns:
    `[J, B, T, W]` float32: entry (j, b, p) is what the inference chain with root p - j + 1
    drafts at depth j + 1, i.e. a prediction of `tokens[b, p + 2]` (meaningful for
    p - j >= 0 and p + 2 < T).
  """
  if not isinstance(steps, int) or steps < 1:
    raise ConfigError(f"steps={steps!r} is invalid: must be a positive int")
  layer = params["layer"]
  dt = config.compute_dtype
  b, t = tokens.shape
  inv_freq = rope_frequencies(config.as_model_config())
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  ahead = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
  embeds = jnp.take(jax.lax.stop_gradient(embed_table), ahead, axis=0).astype(dt)
  hidden = fuse(params, config, [jax.lax.stop_gradient(a) for a in aux])
  keys, values, logits = [], [], []
  for j in range(steps):
    if j:  # step j at p continues the chain of step j - 1 at p - 1
      hidden = jnp.pad(hidden[:, :-1], ((0, 0), (1, 0), (0, 0)))
    q, k, v = _qkv(layer, config, embeds, hidden, positions, inv_freq)
    keys.append(k.transpose(0, 2, 1, 3))
    values.append(v.transpose(0, 2, 1, 3))
    mask = jnp.broadcast_to(_ttt_mask(t, j), (b, t, (j + 1) * t))
    attn = _attend(config, q, jnp.concatenate(keys, axis=2), jnp.concatenate(values, axis=2),
                   mask)
    hidden = _finish(layer, config, hidden, attn)
    logits.append(eagle3_draft_logits(params, config, hidden))
  return jnp.stack(logits)


def eagle3_ttt_loss(params: Params, config: Eagle3Config, embed_table: jax.Array,
                    tokens: jax.Array, aux: Sequence[jax.Array],
                    target_logprobs: jax.Array | None, loss_mask: jax.Array,
                    d2t: jax.Array, steps: int, *, step_decay: float = 1.0
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Training-time-test loss of the draft on target features.

  Step j at position p predicts `tokens[p + 2]` and counts where p - j >= 0, p + 2 < T and
  `loss_mask[p + 2]`. With `target_logprobs` the per-position loss is the cross-entropy
  against the target's distribution for that token (`target_logprobs[p + 1]`) restricted to
  the draft vocabulary and renormalised (positions where the target puts no finite mass on
  the draft vocabulary are skipped); without it, hard cross-entropy on `tokens[p + 2]`,
  skipping positions whose token is outside the draft vocabulary.

  Weighting: each step's CE is a masked mean over its counted positions; the total is
  `sum_j w_j CE_j / sum_j w_j` with `w_j = step_decay ** j` (1.0: plain mean over steps; EAGLE's
  trainer sums with 0.8 ** j, which is `step_decay=0.8` up to a constant factor).

  Args:
    params, config, embed_table, tokens, aux, steps: as in `eagle3_ttt_logits`.
    target_logprobs: `[B, T, V]` the target's log-probabilities (constants), or None.
    loss_mask: `[B, T]` 1 where the token at that position is a target to learn.
    d2t: `[W]` int draft -> target ids.
    step_decay: weight ratio between consecutive steps.

  Returns:
    `(loss, metrics)`: metrics holds `[J]` arrays "ce" (per-step CE), "accuracy" (top-1 draft
    token, mapped by d2t, equal to the target's argmax, or to `tokens[p + 2]` without
    `target_logprobs`, over the counted positions before the vocabulary skip) and "count"
    (positions in each step's CE).
  """
  logits = eagle3_ttt_logits(params, config, embed_table, tokens, aux, steps)
  logp = jax.nn.log_softmax(logits, axis=-1)  # [J, B, T, W]
  b, t = tokens.shape
  pos = jnp.arange(t)
  shift = lambda x, n: jnp.pad(x[:, n:], ((0, 0), (0, n)) + ((0, 0),) * (x.ndim - 2))
  label = shift(tokens, 2)  # [B, T]: tokens[p + 2]
  base = (pos + 2 < t)[None, :] & (shift(loss_mask, 2) > 0)  # [B, T]
  per_step = base[None] & (pos[None, None, :] >= jnp.arange(steps)[:, None, None])  # [J,B,T]
  d2t = jnp.asarray(d2t)
  if target_logprobs is None:
    t2d = jnp.full((config.vocab_size,), -1, jnp.int32).at[d2t].set(
        jnp.arange(config.draft_vocab_size, dtype=jnp.int32))
    draft_label = t2d[label]
    ok = draft_label >= 0
    ce = -jnp.take_along_axis(logp, jnp.maximum(draft_label, 0)[None, ..., None], axis=-1)[..., 0]
    acc_label = label
  else:
    target = jax.lax.stop_gradient(shift(target_logprobs, 1).astype(jnp.float32))  # [B, T, V]
    restricted = target[..., d2t]  # [B, T, W]
    ok = jnp.any(restricted > -jnp.inf, axis=-1)
    probs = jax.nn.softmax(jnp.where(ok[..., None], restricted, 0.0), axis=-1)
    ce = -jnp.sum(probs[None] * logp, axis=-1)
    acc_label = jnp.argmax(target, axis=-1)
  valid = per_step & ok[None]
  count = valid.sum(axis=(1, 2)).astype(jnp.float32)
  ce_steps = jnp.where(valid, ce, 0.0).sum(axis=(1, 2)) / jnp.maximum(count, 1.0)
  hits = (d2t[jnp.argmax(logits, axis=-1)] == acc_label[None]) & per_step
  accuracy = hits.sum(axis=(1, 2)) / jnp.maximum(per_step.sum(axis=(1, 2)), 1)
  weights = jnp.asarray(step_decay, jnp.float32) ** jnp.arange(steps, dtype=jnp.float32)
  loss = jnp.sum(weights * ce_steps) / jnp.sum(weights)
  return loss, {"ce": ce_steps, "accuracy": accuracy.astype(jnp.float32), "count": count}
