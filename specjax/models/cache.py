"""Static-shape key/value cache with per-row lengths.

Layout: one `[B, K, S, H]` buffer per layer for keys and one for values (a tuple, not a
stacked array with a layer axis). Slots are the third axis so that attention's batched matmuls
(batch B and K leading) read the buffers as stored: with `[B, S, K, H]` XLA transposed every
buffer into a temporary on every step (measured: 24 whole-cache copies per step on the 180M
benchmark config). The forward pass unrolls layers, so each layer scatters its new entries
into its own buffer; when the cache is donated to the enclosing `jit`, XLA updates
those buffers in place. A `lax.scan` over layers carrying a stacked cache instead copies the
whole cache every layer (measured 3-10x slower on CPU), which is why this layout exists.

Slot semantics: row b holds `lengths[b]` committed entries in slots `[0, lengths[b])`. A
forward over T new tokens writes them to slots `[lengths[b], lengths[b] + T)`; which of those
become committed is the caller's choice (`advance` in `forward`), so tree verification can
write every node and later keep only the accepted path.

Shape letters: see `specjax` (B batch, T new tokens, S cache slots (max_len), K kv heads,
H head_dim).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from specjax.errors import ConfigError
from specjax.models.attention import Visibility
from specjax.models.config import ModelConfig


@struct.dataclass
class KVCache:
  """Per-layer key/value buffers and per-row committed lengths.

  Attributes:
    keys: one `[B, K, S, H]` array per layer.
    values: one `[B, K, S, H]` array per layer.
    lengths: `[B]` int32, committed slots per row.
  """

  keys: tuple[jax.Array, ...]
  values: tuple[jax.Array, ...]
  lengths: jax.Array

  @property
  def max_len(self) -> int:
    return self.keys[0].shape[2]

  @property
  def batch_size(self) -> int:
    return self.keys[0].shape[0]

  @classmethod
  def create(cls, config: ModelConfig, batch_size: int, max_len: int,
             n_layers: int | None = None) -> KVCache:
    """Zero cache for `n_layers` blocks (default: the trunk's `config.n_layers`)."""
    if max_len <= 0:
      raise ConfigError(f"max_len={max_len} is invalid: must be a positive int")
    if max_len > config.max_position:
      raise ConfigError(
          f"max_len={max_len} is invalid: must be <= config.max_position="
          f"{config.max_position}")
    n_layers = config.n_layers if n_layers is None else n_layers
    shape = (batch_size, config.n_kv_heads, max_len, config.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, config.compute_dtype) for _ in range(n_layers))
    return cls(keys=zeros(), values=zeros(), lengths=jnp.zeros((batch_size,), jnp.int32))

  def advance(self, n: jax.Array | int) -> KVCache:
    """Commit `n` more slots per row (`n`: scalar or `[B]`)."""
    return self.replace(lengths=self.lengths + jnp.asarray(n, jnp.int32))

  def set_lengths(self, lengths: jax.Array) -> KVCache:
    return self.replace(lengths=jnp.asarray(lengths, jnp.int32))

  def gather_slots(self, src: jax.Array, dst: jax.Array) -> KVCache:
    """Copy slots `src[b, j]` to `dst[b, j]` in every layer (e.g. an accepted tree path).

    Args:
      src: `[B, n]` source slots (any n). All sources are read before any write.
      dst: `[B, n]` destination slots; out-of-range destinations are dropped.
    """
    rows = jnp.arange(src.shape[0])[:, None]

    def move(buf):
      return buf.at[rows, :, dst].set(buf[rows, :, src], mode="drop")

    return self.replace(keys=tuple(move(k) for k in self.keys),
                        values=tuple(move(v) for v in self.values))


def attention_mask(lengths: jax.Array, num_new: int, max_len: int,
                   new_mask: jax.Array) -> jax.Array:
  """Which cache slots each of the T new queries may attend to.

  Query t of row b sees every committed slot `s < lengths[b]`, and the new slot
  `lengths[b] + j` when `new_mask[b, t, j]` (causal for a chain, ancestors for a tree).

  Args:
    lengths: `[B]` committed lengths before this forward.
    num_new: n, the new slots `lengths + j` the queries may see (T when every query writes
      one; a drafter's tree level sees all n nodes written so far).
    max_len: S.
    new_mask: `[B, T, n]` bool (or broadcastable), visibility of the new slots.

  Returns:
    `[B, T, S]` bool.
  """
  new_mask = jnp.broadcast_to(new_mask, lengths.shape[:1] + new_mask.shape[-2:])
  if new_mask.shape[-1] != num_new:
    raise ValueError(f"new_mask has {new_mask.shape[-1]} new slots, num_new={num_new}")
  return Visibility(lengths=lengths, new_mask=new_mask).slots(0, max_len)
