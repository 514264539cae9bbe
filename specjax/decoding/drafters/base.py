"""The drafter protocol: what the generation loop gives a drafter and what it gets back.

A drafter is a small frozen (hashable) dataclass — a static argument of the compiled loop —
plus a pytree state it owns (its caches, its own parameters). Each round the loop calls
`propose` for a tree of draft tokens, verifies them with one target forward, and calls
`update` with what was accepted. Everything a drafter computes stays on device.

Position convention: the sequence so far is `seq[b, :seq_len[b]]`; its last token, the
*root*, is at position `r = seq_len - 1` and is not yet in the target's KV cache.
`last_hidden` is the target's final hidden state at position r - 1, the one whose logits
produced the root. Drafts are tokens for positions r + 1, r + 2, ...

Glossary: B batch, L sequence buffer, N draft nodes, D depth, V vocab, Dm d_model.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import numpy as np
from flax import struct

from specjax.decoding.sampling import SamplingConfig, top_w
from specjax.decoding.tree import DraftTree
from specjax.models.config import ConfigError, ModelConfig

Params = dict[str, Any]


@struct.dataclass
class DraftContext:
  """What a drafter sees at the start of a round.

  Attributes:
    seq: `[B, L]` prompt + generated tokens (valid prefix of length seq_len).
    seq_len: `[B]` valid tokens; the root is `seq[b, seq_len[b] - 1]`.
    last_hidden: `[B, Dm]` target final hidden at position seq_len - 2.
    done: `[B]` rows that have finished (their proposals are ignored).
  """

  seq: jax.Array
  seq_len: jax.Array
  last_hidden: jax.Array
  done: jax.Array

  @property
  def root(self) -> jax.Array:
    return jax.numpy.take_along_axis(self.seq, (self.seq_len - 1)[:, None], axis=1)[:, 0]


@struct.dataclass
class Proposal:
  """A drafted tree.

  Attributes:
    tokens: `[B, N]` token of each draft node 1..N.
    logprobs: `[B, N + 1, V]` log q at each node of [root] + nodes — the distribution that
      node's children were sampled from (without replacement) — or None when the drafts are
      deterministic (argmax / top-w / lookup), which selects matching verification.
    drafter_state: the drafter's state after proposing, when proposing changed it (e.g. a
      cache it committed to on the way); None keeps the state it was given.
  """

  tokens: jax.Array
  logprobs: jax.Array | None = None
  drafter_state: Any = None


@struct.dataclass
class RoundResult:
  """What was accepted this round, for drafters to refresh their state.

  Attributes:
    path_tokens: `[B, D + 1]` tokens of the accepted path: the root, then accepted drafts.
    next_tokens: `[B, D + 1]` the token following each path entry: accepted drafts, then the
      new root (correction / bonus). Entry j is valid for j < count.
    path_hidden: `[B, D + 1, Dm]` target final hidden at each path entry.
    start: `[B]` position of the old root (position of path entry 0).
    count: `[B]` valid path entries, accepted + 1 (0 for rows that were already done).
  """

  path_tokens: jax.Array
  next_tokens: jax.Array
  path_hidden: jax.Array
  start: jax.Array
  count: jax.Array


class Drafter(Protocol):
  """Protocol of every drafter. Implementations are frozen dataclasses (static under jit)."""

  sampled: bool
  """Whether proposals are sampled (return `Proposal.logprobs`) or deterministic."""

  def validate(self, config: ModelConfig, tree: DraftTree) -> None:
    """Raise a clear error if this drafter cannot fill `tree` for `config`."""

  def min_prompt_length(self, tree: DraftTree) -> int:
    """Shortest prompt this drafter can start from with `tree`."""

  def init(self, params: Params, config: ModelConfig, drafter_params: Any, ctx: DraftContext,
           tree: DraftTree, max_len: int, prompt_hidden: jax.Array) -> Any:
    """Initial state after the target's prefill.

    `ctx` holds the prompt and the first generated token (the root); `prompt_hidden` is the
    target's final hidden over the prompt buffer `[B, P, Dm]` (the prompt occupies the first
    P columns of `ctx.seq`).
    """

  def propose(self, params: Params, config: ModelConfig, state: Any, ctx: DraftContext,
              tree: DraftTree, sampling: SamplingConfig, key: jax.Array) -> Proposal:
    """Draft tokens for every node of `tree`."""

  def update(self, params: Params, config: ModelConfig, state: Any,
             result: RoundResult) -> Any:
    """Refresh the state with the accepted tokens."""



def check_depth(drafter: Drafter, tree: DraftTree, limit: int) -> None:
  if tree.depth > limit:
    raise ConfigError(
        f"tree depth {tree.depth} is too deep for {type(drafter).__name__}: it can draft at "
        f"most {limit} tokens ahead with this configuration")


def draft_children(tree: DraftTree, parents: np.ndarray, logprobs: jax.Array,
                   key: jax.Array | None) -> tuple[np.ndarray, jax.Array]:
  """Tokens for the children of `parents` from their draft distributions.

  Args:
    tree: the draft tree.
    parents: `[M]` static node indices.
    logprobs: `[B, M, V]` draft log-probabilities at each parent.
    key: None for deterministic top-w drafts; otherwise siblings are sampled without
      replacement (Gumbel top-w), independently for each parent.

  Returns:
    `(children [K], tokens [B, K])`: the static child node indices and their tokens.
  """
  width = max(int((tree.children[parents] >= 0).sum(1).max()), 1)
  top = top_w(key, logprobs, width)  # [B, M, width]
  owner = {int(p): m for m, p in enumerate(parents)}
  children = np.array([c for p in parents for c in tree.children[p] if c >= 0], np.int32)
  m_idx = np.array([owner[int(tree.parent_array[c])] for c in children], np.int32)
  r_idx = tree.rank[children]
  return children, top[:, m_idx, r_idx]
