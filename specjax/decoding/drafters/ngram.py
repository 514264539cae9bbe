"""N-gram prompt-lookup drafter, on device.

Finds the most recent earlier occurrence of the sequence's last n tokens (trying n =
`max_ngram` down to `min_ngram`, longest match wins) and proposes the tokens that followed
it. Deterministic drafts, so verification is by matching. Works on a chain.

Shape letters: see `specjax` (B batch, L sequence buffer); k is the number of draft tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.checks import is_int
from specjax.decoding.drafters.base import Drafter, NoState, Proposal
from specjax.decoding.sampling import SamplingConfig
from specjax.decoding.tree import DraftTree
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig


def lookup(seq: jax.Array, seq_len: jax.Array, n: int, k: int) -> tuple[jax.Array, jax.Array]:
  """Continuation of the latest earlier match of the last n tokens.

  Args:
    seq: `[B, L]` tokens; `seq_len`: `[B]` valid lengths.
    n: n-gram size; k: tokens to propose.

  Returns:
    `(found [B] bool, tokens [B, k])`; tokens past the end of the sequence repeat its last.
  """
  b, l = seq.shape
  suffix_start = seq_len - n
  match = jnp.ones((b, l), bool)
  for j in range(n):
    want = jnp.take_along_axis(seq, jnp.maximum(suffix_start + j, 0)[:, None], axis=1)
    match &= jnp.roll(seq, -j, axis=1) == want
  start = jnp.arange(l)[None, :]
  # The match must end before the suffix itself starts and have a continuation token.
  match &= (start + n < seq_len[:, None]) & (start < suffix_start[:, None])
  match &= (suffix_start >= 0)[:, None]
  found = jnp.any(match, axis=1)
  best = l - 1 - jnp.argmax(match[:, ::-1], axis=1)  # latest match
  idx = jnp.minimum(best[:, None] + n + jnp.arange(k)[None, :], seq_len[:, None] - 1)
  return found, jnp.take_along_axis(seq, idx, axis=1)


@dataclasses.dataclass(frozen=True)
class NGramDrafter(Drafter):
  """Prompt lookup with n-grams of `min_ngram..max_ngram` tokens (deterministic drafts)."""

  max_ngram: int = 3
  min_ngram: int = 1

  def __post_init__(self):
    if not (is_int(self.min_ngram) and is_int(self.max_ngram)
            and 1 <= self.min_ngram <= self.max_ngram):
      raise ConfigError(f"NGramDrafter(min_ngram={self.min_ngram!r}, max_ngram="
                        f"{self.max_ngram!r}) is invalid: need ints 1 <= min_ngram <= max_ngram")
    object.__setattr__(self, "min_ngram", int(self.min_ngram))  # hashed as a static argument
    object.__setattr__(self, "max_ngram", int(self.max_ngram))

  def validate(self, config: ModelConfig, tree: DraftTree) -> None:
    if not tree.is_chain():
      raise ConfigError("NGramDrafter proposes one continuation: use DraftTree.chain(k)")

  def propose(self, params, config, state: NoState, ctx, tree: DraftTree,
              sampling: SamplingConfig, key: jax.Array) -> tuple[Proposal, NoState]:
    k = tree.num_nodes
    b = ctx.seq.shape[0]
    found = jnp.zeros((b,), bool)
    tokens = jnp.broadcast_to(ctx.root[:, None], (b, k))
    for n in range(self.max_ngram, self.min_ngram - 1, -1):
      hit, cont = lookup(ctx.seq, ctx.seq_len, n, k)
      tokens = jnp.where((hit & ~found)[:, None], cont, tokens)
      found |= hit
    return Proposal(tokens=tokens), state
