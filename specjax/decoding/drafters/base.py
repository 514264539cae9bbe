"""The drafter protocol: what the generation loop gives a drafter and what it gets back.

A drafter is a small frozen (hashable) dataclass — a static argument of the compiled loop —
plus a state it owns (its caches, its own parameters), a `flax.struct` dataclass. The loop
talks to it through four calls, and state changes flow through their return values only:

    state = drafter.init(params, config, drafter_params, ctx, tree, max_len, prompt)
    loop:  proposal, state = drafter.propose(params, config, state, ctx, tree, sampling, key)
           (one target forward verifies the proposal)
           state = drafter.update(params, config, state, result)

A drafter that reads the target's intermediate activations (EAGLE-3) names the layers in
`hidden_layers(config)`; the loop requests them from the prefill and from every verify
forward and hands them over as `TargetFeatures`, so no drafter needs a target pass of its own.

Position convention: the sequence so far is `seq[b, :seq_len[b]]`; its last token, the
*root*, is at position `r = seq_len - 1` and is not yet in the target's KV cache.
`last_hidden` is the target's final hidden state at position r - 1, the one whose logits
produced the root. Drafts are tokens for positions r + 1, r + 2, ...

Shape letters: see `specjax` (B batch, T positions, P prompt buffer, L sequence buffer,
N draft nodes, D tree depth, M nodes at one depth, E d_model, V vocab).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.checks import is_number
from specjax.decoding.sampling import SamplingConfig, processed_logprobs, top_w
from specjax.decoding.tree import DraftTree
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.params import Params

State = TypeVar("State")
Carry = TypeVar("Carry")


@struct.dataclass
class NoState:
  """The state of a drafter that keeps none (Medusa, n-gram lookup)."""


@struct.dataclass
class TargetFeatures:
  """Target activations over some positions, as a drafter sees them.

  Attributes:
    hidden: `[B, T, E]` final normalised hidden state (the output head's input).
    layers: residual streams after the layers the drafter asked for
      (`Drafter.hidden_layers`), in that order, each `[B, T, E]`.
  """

  hidden: jax.Array
  layers: tuple[jax.Array, ...] = ()


@struct.dataclass
class DraftContext:
  """What a drafter sees at the start of a round.

  Attributes:
    seq: `[B, L]` prompt + generated tokens (valid prefix of length seq_len).
    seq_len: `[B]` valid tokens; the root is `seq[b, seq_len[b] - 1]`.
    last_hidden: `[B, E]` target final hidden at position seq_len - 2.
    done: `[B]` rows that have finished (their proposals are ignored).
  """

  seq: jax.Array
  seq_len: jax.Array
  last_hidden: jax.Array
  done: jax.Array

  @property
  def root(self) -> jax.Array:
    """`[B]` the root token of each row."""
    return jnp.take_along_axis(self.seq, (self.seq_len - 1)[:, None], axis=1)[:, 0]


@struct.dataclass
class Proposal:
  """A drafted tree.

  Attributes:
    tokens: `[B, N]` token of each draft node 1..N.
    logprobs: `[B, N + 1, V]` log q at each node of [root] + nodes — the distribution that
      node's children were sampled from (without replacement). Present exactly when the
      drafter samples (`Drafter.draws`); None for deterministic drafts (argmax / top-w /
      lookup), which are verified by matching.
    drafted: `[B, N]` whether each node was drafted (None: all were). A drafter that stops
      early for some rows leaves the rest of their tree out: such a node (and so every
      descendant) is never accepted, and its parent's next token is drawn from the target.
  """

  tokens: jax.Array
  logprobs: jax.Array | None = None
  drafted: jax.Array | None = None


@struct.dataclass
class RoundResult:
  """What was accepted this round, for drafters to refresh their state.

  Attributes:
    path_tokens: `[B, D + 1]` tokens of the accepted path: the root, then accepted drafts.
    next_tokens: `[B, D + 1]` the token following each path entry: accepted drafts, then the
      new root (correction / bonus). Entry j is valid for j < count.
    features: the target's activations at each path entry, `[B, D + 1, E]` per array.
    start: `[B]` position of the old root (position of path entry 0).
    count: `[B]` valid path entries, accepted + 1 (0 for rows that were already done).
  """

  path_tokens: jax.Array
  next_tokens: jax.Array
  features: TargetFeatures
  start: jax.Array
  count: jax.Array


PLAIN_WINDOW = 8  # plain rounds whose entries wait for one commit pass (EAGLE-3, draft model)


@struct.dataclass
class AcceptedWindow:
  """The last round's accepted path, not yet committed to a drafter's cache.

  MTP records the accepted path here in `update` and commits it in the same module passes
  that draft. Rounds that draft nothing (plain rounds of an adaptive policy) append their
  one entry, and the window is committed when the next one would not fit (MTP, EAGLE-3 and
  the draft model; the last two commit a speculative round's path in `update` directly and
  keep only plain rounds here, `PLAIN_WINDOW` of them).

  Attributes:
    tokens: `[B, D + 1]` the token following each path entry (accepted drafts, then the root).
    hidden: `[B, D + 1, E]` the target feature the drafter reads at each path entry.
    start: `[B]` position of path entry 0.
    count: `[B]` valid entries (0: nothing to commit).
  """

  tokens: jax.Array
  hidden: jax.Array
  start: jax.Array
  count: jax.Array

  @classmethod
  def empty(cls, batch: int, width: int, features: int, dtype: Any,
            start: jax.Array) -> AcceptedWindow:
    """A window of `width` entries with nothing pending; the first entry will be `start`."""
    return cls(tokens=jnp.zeros((batch, width), jnp.int32),
               hidden=jnp.zeros((batch, width, features), dtype), start=start,
               count=jnp.zeros((batch,), jnp.int32))

  def cleared(self) -> AcceptedWindow:
    """The window after its entries were committed."""
    return self.replace(count=jnp.zeros_like(self.count))

  def overflows(self, count: jax.Array) -> jax.Array:
    """Scalar: some row cannot append `count [B]` more entries without a commit first."""
    return jnp.any(self.count + count > self.tokens.shape[1])

  def append(self, tokens: jax.Array, hidden: jax.Array, start: jax.Array,
             count: jax.Array) -> AcceptedWindow:
    """Add the first `count [B]` of `tokens [B, T]`, `hidden [B, T, E]` (positions start ..).

    Rounds are contiguous, so a round's entries follow the pending ones; an empty window
    starts at the round's `start`. The caller commits first when `overflows(count)`; a
    round of plain decoding (one entry) can so wait in the window for a speculative round.
    """
    width = self.tokens.shape[1]
    j = jnp.arange(tokens.shape[1])[None, :]
    slot = jnp.where(j < count[:, None], self.count[:, None] + j, width)  # width: dropped
    rows = jnp.arange(tokens.shape[0])[:, None]
    return AcceptedWindow(
        tokens=self.tokens.at[rows, slot].set(tokens.astype(jnp.int32), mode="drop"),
        hidden=self.hidden.at[rows, slot].set(hidden.astype(self.hidden.dtype), mode="drop"),
        start=jnp.where(self.count > 0, self.start, start), count=self.count + count)


class Drafter(abc.ABC):
  """Base of every drafter. Subclasses are frozen dataclasses (static arguments under jit).

  Only `propose` is required; the defaults describe a stateless drafter that reads nothing
  but the sequence and the target's last hidden state.

  Attributes:
    sampled: whether siblings are *sampled* without replacement from the draft distribution
      (verified by recursive rejection, `Proposal.logprobs` required) rather than taken
      deterministically (top-w, verified by matching). Greedy decoding never samples.
  """

  sampled: bool = False

  def draws(self, sampling: SamplingConfig) -> bool:
    """Whether this call samples its drafts (and so must return `Proposal.logprobs`)."""
    return self.sampled and not sampling.greedy

  def hidden_layers(self, config: ModelConfig) -> tuple[int, ...]:
    """Target layers whose output residual streams this drafter reads (`TargetFeatures`)."""
    del config
    return ()

  def validate(self, config: ModelConfig, tree: DraftTree) -> None:
    """Raise a `ConfigError` if this drafter cannot fill `tree` for `config`."""

  def check_params(self, drafter_params: Any) -> None:
    """Raise a `ConfigError` if `drafter_params` cannot be this drafter's. `generate` calls it
    before tracing, so concrete values can be checked here (under a caller's `jit` they are
    tracers: check what their shapes tell); `init` sees only tracers."""
    del drafter_params

  def min_prompt_length(self, tree: DraftTree) -> int:
    """Shortest prompt this drafter can start from with `tree`."""
    del tree
    return 1

  def init(self, params: Params, config: ModelConfig, drafter_params: Any, ctx: DraftContext,
           tree: DraftTree, max_len: int, prompt: TargetFeatures, *,
           plain_rounds: bool = False) -> Any:
    """Initial state after the target's prefill.

    `ctx` holds the prompt and the first generated token (the root); `prompt` holds the
    target's activations over the prompt buffer `[B, P, E]` (the prompt occupies the first
    P columns of `ctx.seq`). `tree` is the deepest tree `propose` will be asked for; with
    `plain_rounds`, some rounds draft nothing (an adaptive policy's) and `update` then sees
    a one-entry path.
    """
    del params, config, drafter_params, ctx, tree, max_len, prompt, plain_rounds
    return NoState()

  @abc.abstractmethod
  def propose(self, params: Params, config: ModelConfig, state: State, ctx: DraftContext,
              tree: DraftTree, sampling: SamplingConfig,
              key: jax.Array) -> tuple[Proposal, State]:
    """Draft a token for every node of `tree`; return the proposal and the new state."""

  def update(self, params: Params, config: ModelConfig, state: State,
             result: RoundResult) -> State:
    """The state after this round's verification accepted `result`."""
    del params, config, result
    return state

  def stats(self, state: State | None) -> dict[str, jax.Array]:
    """Counts of this drafter's own over a call, summed over its rounds and reported beside
    the loop's (`GenerationStats.drafter`): scalars, the same keys, shapes and dtypes
    whatever the state (a call may choose on device between drafting and not); all zero for
    `state` None (a call that never drafted). A pair `<name>_rounds`,
    `<name>_tokens` is the row-rounds that part `<name>` drafted and the tokens they emitted
    (`FallbackDrafter`'s two drafters); a GRPO run logs `acceptance_<name>` from them."""
    del state
    return {}

  def take_rows(self, state: State, rows: jax.Array) -> State:
    """The state of rows `rows [B']` only (the loop compacts its batch as rows finish).

    The default takes every array of the state along its first axis, except the fields a
    state class names in `UNBATCHED` (parameters the drafter carries, shared by all rows).
    """
    return take_rows(state, rows)


def take_rows(tree: Any, rows: jax.Array) -> Any:
  """`x[rows]` for every array of `tree`, skipping the fields of any dataclass in it whose
  class lists them in `UNBATCHED`."""
  if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
    unbatched = getattr(type(tree), "UNBATCHED", ())
    return tree.replace(**{f.name: take_rows(getattr(tree, f.name), rows)
                           for f in dataclasses.fields(tree) if f.name not in unbatched})
  if isinstance(tree, (tuple, list)):
    return type(tree)(take_rows(x, rows) for x in tree)
  if tree is None:
    return None
  return jnp.take(tree, rows, axis=0)


def commit_if_full(state: State, count: jax.Array, commit: Callable[[State], State]) -> State:
  """`commit(state)` when `state.window` cannot take `count [B]` more entries, else `state`."""
  return jax.lax.cond(state.window.overflows(count), commit, lambda s: s, state)


def commit_if_pending(state: State, commit: Callable[[State], State]) -> State:
  """`commit(state)` when some row has entries waiting in `state.window`, else `state`.

  A window of width 0 (no plain rounds) has nothing to commit and costs nothing: no
  `lax.cond`, whose pass-through branch makes XLA copy the caches it carries.
  """
  if not state.window.tokens.shape[1]:
    return state
  return jax.lax.cond(jnp.any(state.window.count > 0), commit, lambda s: s, state)


def check_depth(drafter: Drafter, tree: DraftTree, limit: int) -> None:
  if tree.depth > limit:
    raise ConfigError(
        f"tree depth {tree.depth} is too deep for {type(drafter).__name__}: it can draft at "
        f"most {limit} tokens ahead with this configuration")


def check_heads(drafter: Drafter, params: Any, key: str, needed: int) -> None:
  """Raise a clear `ConfigError` unless `params[key]` holds the `needed` draft heads the
  drafter reads (a checkpoint saved without its heads, or a trunk-only `init_params`)."""
  heads = params.get(key) if isinstance(params, dict) else None
  if heads is None or len(heads) < needed:
    have = "is missing" if heads is None else f"has {len(heads)}"
    raise ConfigError(
        f"params['{key}'] {have}: {type(drafter).__name__} needs {needed} trained head(s) "
        f"there (the config says so); load a checkpoint saved with its heads, or pick a "
        "drafter that does not need them (a draft model, n-gram)")


LevelScorer = Callable[[int, np.ndarray, jax.Array, Carry], tuple[jax.Array, Carry]]


def draft_level_by_level(tree: DraftTree, sampling: SamplingConfig, key: jax.Array,
                         draw: bool, root: jax.Array, score: LevelScorer, carry: Carry, *,
                         confidence: float = 0.0) -> tuple[Proposal, Carry]:
  """Fill a tree one depth at a time: the drafting loop every model-based drafter shares.

  For each depth d = 0 .. D - 1, `score(d, parents, tokens, carry)` returns the draft logits
  `[B, M, V]` at the nodes `parents` (the M nodes of depth d, static) given the tokens drafted
  so far (`tokens [B, N + 1]`, root first; nodes deeper than d hold placeholders), and its
  updated carry. The children of each parent get its top-w tokens, or, when `draw`, w tokens
  sampled without replacement (Gumbel top-w, an independent key per depth).

  With a `confidence` threshold, a row stops drafting after the first depth at which no
  drafted token has a draft probability of at least `confidence`; its deeper nodes are left
  out (`Proposal.drafted`), and a depth at which every row has stopped is not scored at all
  (`lax.cond`). The first depth is always drafted. Stopping depends on the drafts alone, never
  on the target, so verification stays exact.

  Args:
    root: `[B]` root tokens (node 0).
    carry: whatever `score` threads from one depth to the next (caches, hidden states).
    confidence: draft probability below which a row stops (0: every row drafts the tree).

  Returns:
    The `Proposal` (with `logprobs` exactly when `draw`, `drafted` exactly with a
    `confidence`) and the final carry.
  """
  b = root.shape[0]
  tokens = jnp.zeros((b, tree.num_nodes + 1), jnp.int32).at[:, 0].set(root)
  live = jnp.ones((b,), bool)  # rows still drafting
  drafted = jnp.zeros((b, tree.num_nodes + 1), bool)
  node_logprobs = None
  for d in range(tree.depth):
    parents = tree.nodes_at_depth(d)
    children, owner, rank = tree.children_of(parents)

    def level(operands, d=d, parents=parents, children=children, owner=owner, rank=rank):
      tokens, node_logprobs, carry = operands
      logits, carry = score(d, parents, tokens, carry)
      logprobs = processed_logprobs(logits, sampling)
      if draw:
        if node_logprobs is None:
          node_logprobs = jnp.zeros(tokens.shape + logprobs.shape[-1:], jnp.float32)
        node_logprobs = node_logprobs.at[:, parents].set(logprobs)
      candidates = top_w(jax.random.fold_in(key, d) if draw else None, logprobs,
                         tree.max_children_of(parents))  # [B, M, w]
      tokens = tokens.at[:, children].set(candidates[:, owner, rank])
      best = jnp.take_along_axis(logprobs, candidates, -1).max((1, 2))  # [B]
      return (tokens, node_logprobs, carry), jnp.exp(best)

    operands = (tokens, node_logprobs, carry)
    if d == 0 or not confidence:
      operands, best = level(operands)
    else:
      skip = lambda operands: (operands, jnp.zeros((b,), jnp.float32))
      operands, best = jax.lax.cond(jnp.any(live), level, skip, operands)
    tokens, node_logprobs, carry = operands
    drafted = drafted.at[:, children].set(live[:, None])
    live &= best >= confidence
  return Proposal(tokens=tokens[:, 1:], logprobs=node_logprobs,
                  drafted=drafted[:, 1:] if confidence else None), carry


def check_confidence(drafter: Drafter, confidence: float) -> None:
  """Raise a `ConfigError` unless `confidence` is a valid early-stop threshold."""
  if not (is_number(confidence) and 0.0 <= confidence < 1.0):
    raise ConfigError(f"{type(drafter).__name__}.confidence={confidence!r} is invalid: must be "
                      "a draft probability in [0, 1) (0: always draft the whole tree)")


def check_draft_cache(drafter: Drafter, max_position: int, max_len: int) -> None:
  """Raise a `ConfigError` unless a drafter's own cache of `max_len` slots (the target's)
  fits the positions its model was configured for."""
  if max_len > max_position:
    raise ConfigError(
        f"{type(drafter).__name__}.config.max_position={max_position} is too small for this "
        f"call: the drafter keeps a cache as long as the target's, {max_len} slots (prompt "
        "buffer + max_new_tokens + draft tree nodes + 1); shorten the prompt or "
        "max_new_tokens, or use a drafter configured for longer sequences")
