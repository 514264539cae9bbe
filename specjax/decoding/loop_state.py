"""The decode loop's per-row state and its bookkeeping: what `DecodeLoop` carries from round
to round (`DecodeState`), what one round appends to each row (`Emission`), what the result
needs of every row while the loop compacts (`RowOutputs`, `compaction_buckets`), and the
row-wise writes and gathers a round makes (`scatter_rows`, `take_path`).

Shape letters: see `specjax` (B batch, L = P + max_new sequence buffer, N draft nodes,
D depth, E d_model); I is the number of menu entries.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from specjax.decoding.drafters.base import DraftContext
from specjax.decoding.policy import AcceptanceCounts
from specjax.models.cache import KVCache


@struct.dataclass
class DecodeState:
  """Carry of the decode loop.

  Attributes:
    seq: `[B, L]` prompt + generated tokens.
    seq_len: `[B]` valid entries of `seq`; the last is the root (not yet in the cache).
    logp: `[B, L]` reported log-probability of each generated token (at its `seq` index).
    generated: `[B]` tokens generated so far.
    done: `[B]`.
    cache: target `KVCache` holding `seq_len - 1` committed entries per row.
    last_hidden: `[B, E]` target hidden at position `seq_len - 2`.
    drafter_state: the drafter's state (`Drafter.init`), None without a drafter.
    key: PRNG key for the next round.
    rounds: scalar round counter.
    row_rounds: `[B]`.
    accepted_at_depth: `[max(D, 1)]` accepted-draft counts per depth, summed over row-rounds.
    emitted: scalar tokens emitted in rounds (excluding the first token from the prefill).
    drafts: scalar draft tokens verified in rows' rounds.
    tree_rounds: `[I]` rounds per menu entry (rounds with the drafter off count as plain).
    segments: scalar runs of one tree the policy started (`segment`; 0 without a policy;
      rounds with the drafter off run outside them).
    acceptance: `AcceptanceCounts` the speculation policy reads.
    drafter_off: scalar bool, the policy switched the drafter off (`Adaptive.off`): its state
      is no longer kept in step, so every later round is plain.
  """

  seq: jax.Array
  seq_len: jax.Array
  logp: jax.Array
  generated: jax.Array
  done: jax.Array
  cache: KVCache
  last_hidden: jax.Array
  drafter_state: Any
  key: jax.Array
  rounds: jax.Array
  row_rounds: jax.Array
  accepted_at_depth: jax.Array
  emitted: jax.Array
  drafts: jax.Array
  tree_rounds: jax.Array
  segments: jax.Array
  acceptance: AcceptanceCounts
  drafter_off: jax.Array

  # Loop-wide fields, and the drafter's state (which `Drafter.take_rows` selects rows of).
  UNBATCHED: ClassVar[tuple[str, ...]] = ("drafter_state", "key", "rounds",
                                          "accepted_at_depth", "emitted", "drafts", "tree_rounds",
                                          "segments", "acceptance", "drafter_off")

  @property
  def context(self) -> DraftContext:
    return DraftContext(seq=self.seq, seq_len=self.seq_len, last_hidden=self.last_hidden,
                        done=self.done)


@struct.dataclass
class Emission:
  """The tokens one round appends to each row.

  Attributes:
    tokens: `[B, D + 1]` accepted drafts, then the next token; entry j is valid for j < count.
    logprobs: `[B, D + 1]` their reported log-probabilities.
    count: `[B]` tokens appended (0 for rows already done; cut at EOS and max_new_tokens).
    done: `[B]` rows that are done after this round.
  """

  tokens: jax.Array
  logprobs: jax.Array
  count: jax.Array
  done: jax.Array


def scatter_rows(buf: jax.Array, start: jax.Array, values: jax.Array,
                  count: jax.Array) -> jax.Array:
  """`buf[b, start[b] + j] = values[b, j]` for `j < count[b]`; other writes are dropped."""
  j = jnp.arange(values.shape[1])[None, :]
  idx = jnp.where(j < count[:, None], start[:, None] + j, buf.shape[1])
  return buf.at[jnp.arange(buf.shape[0])[:, None], idx].set(values.astype(buf.dtype),
                                                           mode="drop")


def take_path(x: jax.Array, path: jax.Array) -> jax.Array:
  """`x[b, path[b, j]]` for x `[B, N + 1, ...]` and path `[B, D + 1]`."""
  return jnp.take_along_axis(x, path.reshape(path.shape + (1,) * (x.ndim - 2)), axis=1)


@struct.dataclass
class RowOutputs:
  """What the result needs of every row, kept at the full batch while the loop compacts.

  Attributes:
    seq, logp: `[B, L]`; generated, done, row_rounds: `[B]` (as in `DecodeState`).
  """

  seq: jax.Array
  logp: jax.Array
  generated: jax.Array
  done: jax.Array
  row_rounds: jax.Array

  @classmethod
  def of(cls, s: DecodeState) -> RowOutputs:
    return cls(seq=s.seq, logp=s.logp, generated=s.generated, done=s.done,
               row_rounds=s.row_rounds)

  def put(self, rows: jax.Array, part: RowOutputs) -> RowOutputs:
    """These outputs with rows `rows` replaced by `part`'s."""
    return jax.tree.map(lambda a, b: a.at[rows].set(b), self, part)


def compaction_buckets(batch: int, halvings: int) -> tuple[int, ...]:
  """The batch sizes a compacting loop runs at: B, then each halving (rounded up) while > 1."""
  sizes = [batch]
  for _ in range(halvings):
    if sizes[-1] > 1:
      sizes.append(-(-sizes[-1] // 2))
  return tuple(sizes)
