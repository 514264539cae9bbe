"""Attention of T new queries over a key/value cache, dense or block by block.

Both implementations compute the same thing: query t of row b attends to the committed slots
`s < lengths[b]` and to the new slots `lengths[b] + j` that `new_mask[b, t, j]` allows
(causal for a chain, ancestor-or-self for a draft tree).

- `dense` scores every slot of the buffer: its cost follows `max_len`, not the text. It is the
  reference, and the right choice when the buffer holds little more than the live entries
  (training, prefill, short caches).
- `blocked` visits the buffer in blocks of `block` slots with an online softmax (running max,
  normaliser and weighted sum in float32), in a loop bounded by the longest live row: blocks
  above `max(lengths) + T` are never read. An RL rollout with an 8k-32k token budget spends
  most of its steps with a mostly empty cache, and pays for what it holds.
- `pallas` runs JAX's shipped Pallas GPU decode kernel
  (`jax.experimental.pallas.ops.gpu.decode_attention`, split-K flash decoding that also stops
  at each row's live length) for decode steps (T = 1) on a GPU; `pallas_interpret` runs the
  same kernel in Pallas interpret mode on any backend (tests, debugging). Where the kernel
  does not apply (a verify pass or tree, T > 1; a TPU, whose shipped kernels need a paged
  cache; a shape it cannot tile) the forward attends as `auto` would and says why, once.
- `auto` is `blocked` from `AUTO_BLOCKED_MIN_SLOTS` slots and `dense` below, except on a GPU,
  where it stays `dense`: XLA:GPU syncs a data-dependent loop's predicate with the host every
  iteration, which made blocked decode 2.5-3.5x slower than dense on an H200 at 2048 slots.

Shape letters: see `specjax` (B batch, T new tokens, S cache slots, K kv heads, R = Q / K,
U = R x T query rows per kv head, H head_dim, C slots in one block).
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from flax import struct

from specjax.models.config import AUTO_DENSE_PLATFORMS

_NEG = float(jnp.finfo(jnp.float32).min)
# Smallest split of the buffer the Pallas decode kernel accepts, and its largest KV tile.
_KERNEL_MIN_SPLIT, _KERNEL_MAX_BLOCK, _KERNEL_MAX_SPLITS = 16, 128, 16


@struct.dataclass
class Visibility:
  """Which key slots each new query may attend to.

  Attributes:
    lengths: `[B]` committed entries per row before this forward (0 without a cache).
    new_mask: `[B, T, n]` bool: may query t see new slot `lengths + j`? (n = T when each
      query writes one slot; a drafter's tree level may see more slots than it has queries.)
  """

  lengths: jax.Array
  new_mask: jax.Array

  @property
  def num_new(self) -> int:
    """n, the new slots `lengths + j` a query may see."""
    return self.new_mask.shape[-1]

  def slots(self, start: jax.Array | int, size: int) -> jax.Array:
    """`[B, T, size]` bool: may query t see slot `start + c`? (`start` may be traced.)"""
    n = self.num_new
    rel = start + jnp.arange(size)[None, :] - self.lengths[:, None]  # [B, C]
    in_new = (rel >= 0) & (rel < n)
    among_new = jnp.take_along_axis(
        self.new_mask, jnp.clip(rel, 0, n - 1)[:, None, :], axis=2)  # [B, T, C]
    return (rel < 0)[:, None, :] | (in_new[:, None, :] & among_new)

  def extent(self) -> jax.Array:
    """Slots below which every visible slot of every row lies: `max(lengths) + n`."""
    return jnp.max(self.lengths) + self.num_new


def dense_attention(q: jax.Array, keys: jax.Array, values: jax.Array, vis: Visibility,
                    group_size: int) -> jax.Array:
  """Softmax attention over every slot of `keys` / `values`.

  Args:
    q: `[B, K, U, H]` queries, the R x T rows of each kv head flattened (r major).
    keys: `[B, K, S, H]`.
    values: `[B, K, S, H]`.
    vis: which slots each query sees.
    group_size: R.

  Returns:
    `[B, K, U, H]` in the dtype of `q`.
  """
  b, k, u, h = q.shape
  t, s, dt = u // group_size, keys.shape[2], q.dtype
  scores = jnp.einsum("BKUH,BKSH->BKUS", q, keys.astype(dt),
                      preferred_element_type=jnp.float32)
  scores = scores.reshape(b, k, group_size, t, s) / math.sqrt(h)
  scores = jnp.where(vis.slots(0, s)[:, None, None], scores, _NEG)
  probs = jax.nn.softmax(scores, axis=-1).astype(dt).reshape(b, k, u, s)
  return jnp.einsum("BKUS,BKSH->BKUH", probs, values.astype(dt))


def blocked_attention(q: jax.Array, keys: jax.Array, values: jax.Array, vis: Visibility,
                      group_size: int, block: int) -> jax.Array:
  """`dense_attention`, reading only the blocks of `block` slots below `vis.extent()`.

  A loop over blocks carries the running max `m`, normaliser `l` and weighted sum `acc`
  (float32); block i covers slots `[i C, (i + 1) C)`. When S is not a multiple of C the last
  block is read from `S - C` and its slots already counted are masked out.
  """
  b, k, u, h = q.shape
  t, s, dt = u // group_size, keys.shape[2], q.dtype
  size = min(block, s)
  scale = 1.0 / math.sqrt(h)

  def visit(i, carry):
    m, l, acc = carry
    first = i * size
    start = jnp.minimum(first, s - size)
    kb = jax.lax.dynamic_slice_in_dim(keys, start, size, axis=2).astype(dt)
    vb = jax.lax.dynamic_slice_in_dim(values, start, size, axis=2).astype(dt)
    scores = jnp.einsum("BKUH,BKCH->BKUC", q, kb, preferred_element_type=jnp.float32)
    scores = scores.reshape(b, k, group_size, t, size) * scale
    fresh = start + jnp.arange(size) >= first  # not counted by an earlier block
    visible = (vis.slots(start, size) & fresh)[:, None, None]  # [B, 1, 1, T, C]
    scores = jnp.where(visible, scores, _NEG)
    m_new = jnp.maximum(m, scores.max(axis=-1))
    p = jnp.where(visible, jnp.exp(scores - m_new[..., None]), 0.0)
    rescale = jnp.exp(m - m_new)
    l = l * rescale + p.sum(axis=-1)
    pv = jnp.einsum("BKUC,BKCH->BKUH", p.astype(dt).reshape(b, k, u, size), vb,
                    preferred_element_type=jnp.float32)
    acc = acc * rescale.reshape(b, k, u, 1) + pv
    return m_new, l, acc

  m = jnp.full((b, k, group_size, t), _NEG, jnp.float32)
  l = jnp.zeros((b, k, group_size, t), jnp.float32)
  acc = jnp.zeros((b, k, u, h), jnp.float32)
  num_blocks = (vis.extent() + size - 1) // size
  m, l, acc = jax.lax.fori_loop(0, jnp.minimum(num_blocks, -(-s // size)), visit, (m, l, acc))
  return (acc / l.reshape(b, k, u, 1)).astype(dt)


def _kernel_tiling(max_len: int) -> tuple[int, int] | None:
  """`(k_splits, block_k)` for the Pallas decode kernel over `max_len` slots, or None.

  The kernel cuts the buffer into `k_splits` equal parts of at least 16 slots, each read in
  tiles of `block_k` (a power of two >= 16) that divide it.
  """
  for k_splits in (16, 8, 4, 2, 1):
    split = max_len // k_splits
    if max_len % k_splits or split < _KERNEL_MIN_SPLIT:
      continue
    block_k = _KERNEL_MAX_BLOCK
    while block_k >= _KERNEL_MIN_SPLIT and split % block_k:
      block_k //= 2
    if block_k >= _KERNEL_MIN_SPLIT:
      return k_splits, block_k
  return None


def pallas_unsupported(num_new: int, max_len: int, head_dim: int, interpret: bool) -> str | None:
  """Why the Pallas decode kernel cannot run this forward (None when it can)."""
  if num_new != 1:
    return ("the kernel decodes one new token per row; forwards over several (a prefill into "
            "the cache, a verify pass, a draft tree)")
  backend = jax.default_backend()
  if not interpret and backend != "gpu":
    return (f"it is a GPU kernel and the backend is {backend!r} (the TPU kernels JAX ships "
            "need a paged cache; use attention_impl='pallas_interpret' to run it interpreted)")
  if _kernel_tiling(max_len) is None:
    return f"the kernel cannot tile a cache of {max_len} slots (needs a multiple of 16, >= 16)"
  if not interpret and (head_dim < 16 or head_dim & (head_dim - 1)):
    return f"the GPU kernel needs a power-of-two head_dim >= 16, not {head_dim}"
  return None


@functools.lru_cache(maxsize=None)
def _say_fallback(reason: str) -> None:
  warnings.warn(f"attention_impl='pallas': {reason}; attending as 'auto' would", stacklevel=2)


def pallas_decode_attention(q: jax.Array, keys: jax.Array, values: jax.Array, vis: Visibility,
                            group_size: int, interpret: bool) -> jax.Array:
  """Decode attention (T = 1) with the Pallas GPU kernel; the query sees `lengths + 1` slots.

  Args:
    q: `[B, K, R, H]` (U = R for one new token).
    keys, values: `[B, K, S, H]` cache buffers (the new entry already written).
    vis: visibility with T = 1.
    group_size: R.
    interpret: run the kernel in Pallas interpret mode (any backend).
  """
  from jax.experimental.pallas.ops.gpu import decode_attention  # noqa: PLC0415 (GPU-only)
  b, k, r, h = q.shape
  k_splits, block_k = _kernel_tiling(keys.shape[2])
  # The kernel takes [B, S, K, H] and swaps to [B, K, S, H] itself: the two swaps cancel.
  out = decode_attention.gqa(
      q.reshape(b, k * r, h), keys.swapaxes(1, 2).astype(q.dtype),
      values.swapaxes(1, 2).astype(q.dtype), kv_seq_len=vis.lengths + 1,
      k_splits=k_splits, block_k=block_k, interpret=interpret)
  return out.reshape(b, k, r, h)


def attend(q: jax.Array, keys: jax.Array, values: jax.Array, vis: Visibility, config,
           cached: bool) -> jax.Array:
  """Attention as `config.attention_impl` asks; forwards without a cache are dense.

  Args:
    q: `[B, K, U, H]`.
    keys, values: `[B, K, S, H]`.
    vis: which slots each query sees.
    config: the `ModelConfig` (`attention_impl`, `attention_block`, `group_size`).
    cached: whether `keys` / `values` are a cache (S slots) rather than the T new tokens.
  """
  r = config.group_size
  if not cached:
    return dense_attention(q, keys, values, vis, r)
  impl, s = config.attention_impl, keys.shape[2]
  if impl.startswith("pallas"):
    interpret = impl == "pallas_interpret"
    reason = pallas_unsupported(q.shape[2] // r, s, q.shape[-1], interpret)
    if reason is None:
      return pallas_decode_attention(q, keys, values, vis, r, interpret)
    _say_fallback(reason)

  def on(platform: str) -> jax.Array:
    if config.blocked_attention(s, platform):
      return blocked_attention(q, keys, values, vis, r, config.attention_block)
    return dense_attention(q, keys, values, vis, r)

  if all(config.blocked_attention(s, p) == config.blocked_attention(s, "cpu")
         for p in AUTO_DENSE_PLATFORMS):
    return on("cpu")
  # A program lowered for one platform holds only that platform's branch.
  return jax.lax.platform_dependent(
      default=lambda: on("cpu"), **{p: functools.partial(on, p) for p in AUTO_DENSE_PLATFORMS})
