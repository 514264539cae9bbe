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

Shape letters: see `specjax` (B batch, T new tokens, S cache slots, K kv heads, R = Q / K,
U = R x T query rows per kv head, H head_dim, C slots in one block).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

_NEG = float(jnp.finfo(jnp.float32).min)


@struct.dataclass
class Visibility:
  """Which key slots each new query may attend to.

  Attributes:
    lengths: `[B]` committed entries per row before this forward (0 without a cache).
    new_mask: `[B, T, T]` bool, visibility among the new tokens.
  """

  lengths: jax.Array
  new_mask: jax.Array

  @property
  def num_new(self) -> int:
    return self.new_mask.shape[-1]

  def slots(self, start: jax.Array | int, size: int) -> jax.Array:
    """`[B, T, size]` bool: may query t see slot `start + c`? (`start` may be traced.)"""
    t = self.num_new
    rel = start + jnp.arange(size)[None, :] - self.lengths[:, None]  # [B, C]
    in_new = (rel >= 0) & (rel < t)
    among_new = jnp.take_along_axis(
        self.new_mask, jnp.clip(rel, 0, t - 1)[:, None, :], axis=2)  # [B, T, C]
    return (rel < 0)[:, None, :] | (in_new[:, None, :] & among_new)

  def extent(self) -> jax.Array:
    """Slots below which every visible slot of every row lies: `max(lengths) + T`."""
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
  t, s, dt = vis.num_new, keys.shape[2], q.dtype
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
  t, s, dt = vis.num_new, keys.shape[2], q.dtype
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
