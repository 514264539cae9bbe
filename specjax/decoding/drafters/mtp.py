"""MTP drafter: the target's own DeepSeek-V3 multi-token-prediction modules, chained.

Module k at position i reads (state h^k_i, token t_{i+k+1}) and predicts t_{i+k+2}; h^0 is
the trunk's hidden, h^{k+1} is module k's output stream. Module k's input at i needs the
token k + 1 ahead, so with the root at position r, module k can be *committed* (its KV
cache made final) exactly through position r - k - 1. The drafter keeps each used module at
that frontier (or behind it, below), plus its output stream at its last committed position.

After a verification each module must advance by the accepted count: its *window* of
a + 1 positions reads the same new tokens (accepted drafts, then the new root) for every
module, and the state inputs of module k are module k - 1's window outputs shifted by one.
Drafting depth d + 1 (module d) from a node x at depth d needs module d at positions
r - d .. r - 1, whose token inputs are x's ancestors at depths 1..d (x last) and whose state
inputs are module d - 1's outputs for x's parent — computed one level earlier.

Both happen in one pass per round: `update` only records the window, and `propose` runs each
module once over [its window ; one chain per node of its depth], committing the window's
valid prefix. The mask lets a chain see the committed cache, the window's valid prefix and its
own earlier entries; one forward per module per round instead of two halves the weight reads
of the drafter, which is what a memory-bound decode step pays for. A round that drafts nothing
(a plain round of an adaptive policy) leaves its entry in the window until the window is full,
then commits it into module 0 alone.

A round that drafts less deep than the deepest tree the state was built for (an adaptive
policy's choice) leaves the deeper modules behind instead of running a pass of each to commit
the window. Module k's *backlog* holds the entries it has not committed whose state inputs
module k - 1 has computed (its outputs, shifted by one as above, with the same tokens); a pass
of module k over its pending entries commits them and makes as many ready for module k + 1.
A deeper round first catches up the modules it drafts with, in order; a backlog that cannot
take a round's entries catches up its module then (and, through the same rule, the deeper
ones). With a backlog of `BACKLOG_WINDOWS` windows, a run of chain-1 rounds pays one pass of
each deeper module every few rounds instead of one per round; its drafts are the same
(`tests/decoding/test_mtp_backlog.py` holds them against the modules run from scratch).

A module's chains are written to its cache after its committed entries and never committed:
module d writes d entries per node at depth d, with a wide middle level more than the N + 1
slots the target's cache has past the root. Its cache is sized for them (`_module_slots`);
sized like the target's, near the end of the sequence buffer those writes would be dropped
and the drafts there degrade (the output stays exact).

Shape letters: see `specjax` (B batch, D depth, M nodes at one depth, E d_model, V vocab);
r is the root position, d the depth being drafted, and a window has D + 1 entries.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.decoding.drafters.base import (AcceptedWindow, Drafter, Proposal, check_depth,
                                            check_heads, commit_if_full, draft_level_by_level)
from specjax.decoding.sampling import SamplingConfig
from specjax.decoding.tree import DraftTree
from specjax.errors import ConfigError
from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig
from specjax.models.heads import mtp_forward, mtp_head_logits

BACKLOG_WINDOWS = 4  # accepted windows a module deeper than the round's tree may fall behind


@struct.dataclass
class MTPState:
  """Per used module: its one-layer cache, its output stream at its newest committed position
  and the entries it has pending; module 0's pending entries are the accepted window.

  Attributes:
    caches: D one-layer `KVCache`s; module k is committed through position r - k - 1, or,
      when it is behind (deeper than recent rounds drafted), through an earlier position.
    last: D arrays `[B, E]`, module k's output at its newest committed position.
    window: module 0's pending entries, the accepted paths not yet committed; the state
      inputs (`hidden`) are the target's features, `start` is the old root's position.
    backlogs: D - 1 `AcceptedWindow`s, module k's (k >= 1) entries whose state inputs module
      k - 1 has computed but module k has not committed; `start` is a module-k position.
      Width 0 (commit at once) unless the state was built for rounds of differing depths.
  """

  caches: tuple[KVCache, ...]
  last: tuple[jax.Array, ...]
  window: AcceptedWindow
  backlogs: tuple[AcceptedWindow, ...]


def _chain_mask(num_chains: int, length: int) -> np.ndarray:
  """Block-diagonal causal mask `[num_chains * length, num_chains * length]`: `num_chains`
  causal chains of `length` entries each."""
  return np.kron(np.eye(num_chains, dtype=bool), np.tril(np.ones((length, length), bool)))


def _window_and_chains_mask(count: jax.Array, width: int, chain_len: int,
                            d: int) -> jax.Array:
  """`[B, width + chain_len, width + chain_len]` visibility: the window (`width` = D + 1
  entries) is causal; each chain of length d sees the window's first `count` entries (the
  committed ones) and its own earlier entries."""
  t = width + chain_len
  mask = np.zeros((t, t), bool)
  mask[:width, :width] = np.tril(np.ones((width, width), bool))
  if chain_len:
    mask[width:, width:] = _chain_mask(chain_len // d, d)
  mask = jnp.broadcast_to(jnp.asarray(mask), (count.shape[0], t, t))
  committed = jnp.arange(width)[None, None, :] < count[:, None, None]  # [B, 1, D + 1]
  chain_rows = (jnp.arange(t) >= width)[None, :, None]
  sees_window = jnp.zeros((count.shape[0], t, t), bool).at[:, :, :width].set(
      chain_rows & committed)
  return mask | sees_window


def _module_slots(tree: DraftTree, d: int, width: int, buffer: int) -> int:
  """Cache slots module d writes at most in one pass of a round drafting `tree`: its committed
  entries (through r - d - 1, with the root r at most at the last buffer position
  `buffer - 1`), then the window (`width` = D + 1 entries of the state's deepest tree), then
  one chain of d entries per node at depth d."""
  chains = d * len(tree.nodes_at_depth(d)) if d < tree.depth else 0
  return buffer - 1 - d + width + chains


def _module_cache(config: ModelConfig, batch: int, slots: int) -> KVCache:
  """An empty one-layer module cache of `slots` slots. Not `KVCache.create`, which refuses
  more slots than config.max_position: the slots past the target's hold only a round's
  uncommitted chain entries, whose positions (r - d .. r - 1) are below the root's."""
  shape = (batch, config.n_kv_heads, slots, config.head_dim)
  return KVCache(keys=(jnp.zeros(shape, config.compute_dtype),),
                 values=(jnp.zeros(shape, config.compute_dtype),),
                 lengths=jnp.zeros((batch,), jnp.int32))


def _no_chains(pending: AcceptedWindow) -> tuple[jax.Array, ...]:
  """Empty (states, tokens, positions) chains: a module pass that only commits."""
  b, _, e = pending.hidden.shape
  return (jnp.zeros((b, 0, e), pending.hidden.dtype), jnp.zeros((b, 0), jnp.int32),
          jnp.zeros((b, 0), jnp.int32))


def _pending(state: MTPState, d: int) -> AcceptedWindow:
  """Module d's pending entries."""
  return state.window if d == 0 else state.backlogs[d - 1]


def _with_pending(state: MTPState, d: int, pending: AcceptedWindow) -> MTPState:
  if d == 0:
    return state.replace(window=pending)
  return state.replace(backlogs=state.backlogs[:d - 1] + (pending,) + state.backlogs[d:])


@dataclasses.dataclass(frozen=True)
class MTPDrafter(Drafter):
  """Drafts depth d with MTP module d - 1 (the tree depth is at most num_mtp_modules).

  Attributes:
    sampled: sample siblings without replacement (rejection verification) instead of top-w.
  """

  sampled: bool = False

  def validate(self, config: ModelConfig, tree: DraftTree) -> None:
    if not config.num_mtp_modules:
      raise ConfigError("MTPDrafter needs a model with num_mtp_modules >= 1")
    check_depth(self, tree, config.num_mtp_modules)

  def min_prompt_length(self, tree: DraftTree) -> int:
    # Module k's committed frontier is r - k - 1 >= 0 at the first round (r = prompt length).
    return max(tree.depth, 1)

  def init(self, params, config, drafter_params, ctx, tree, max_len, prompt, *,
           plain_rounds=False) -> MTPState:
    """Teacher-force the used modules over the prompt (ragged) and commit their frontiers.

    Module k's cache has `max_len` slots, or more where `tree`'s chains at depth k need them
    (`_module_slots`). With `plain_rounds` (an adaptive menu: rounds shallower than `tree`),
    each module past the first gets a backlog of `BACKLOG_WINDOWS` accepted windows.
    """
    check_heads(self, params, "mtp", tree.depth)
    b, p, e = prompt.hidden.shape
    r = ctx.seq_len - 1  # root position == prompt length
    positions = jnp.broadcast_to(jnp.arange(p), (b, p))
    seq = jnp.pad(ctx.seq, ((0, 0), (0, config.num_mtp_modules + 1)))
    caches, last = [], []
    state_in = prompt.hidden
    for k in range(tree.depth):  # module k drafts depth k + 1; deeper ones are unused
      slots = max(max_len, _module_slots(tree, k, tree.depth + 1, ctx.seq.shape[1]))
      cache = _module_cache(config, b, slots)
      commit = jnp.maximum(r - k, 0)
      out = mtp_forward(params, config, k, state_in, seq[:, k + 1:k + 1 + p], positions, cache,
                        advance=commit, compute_logits=False)
      caches.append(out.cache)
      last.append(jnp.take_along_axis(out.hidden, jnp.maximum(commit - 1, 0)[:, None, None],
                                      axis=1)[:, 0])
      state_in = out.hidden
    # An empty pending window: nothing to commit before the first proposal.
    window = AcceptedWindow.empty(b, tree.depth + 1, e, prompt.hidden.dtype, start=r)
    backlog = AcceptedWindow.empty(b, BACKLOG_WINDOWS * (tree.depth + 1) if plain_rounds else 0,
                                   e, prompt.hidden.dtype, start=r)
    return MTPState(caches=tuple(caches), last=tuple(last), window=window,
                    backlogs=(backlog,) * (tree.depth - 1))

  def _module(self, params, config: ModelConfig, d: int, carry: tuple,
              chains: tuple[jax.Array, jax.Array, jax.Array]) -> tuple:
    """Run module d over [its pending entries ; chains], committing the entries' valid prefix.

    `carry` is (caches, last, pending): every module's cache and newest committed output, and
    module d's pending entries. `chains` are (states, tokens, positions) of M chains of d
    entries each, `[B, M * d, ...]`. Returns the module's chain outputs `[B, M * d, E]` and
    the carry for module d + 1, whose pending entries are the ones this pass made ready:
    module d's newest output before them, then its outputs over them shifted by one, at the
    same tokens one position earlier.
    """
    caches, last, pending = carry
    width = pending.tokens.shape[1]
    chain_states, chain_tokens, chain_pos = chains
    positions = pending.start[:, None] + jnp.arange(width)[None, :]
    out = mtp_forward(
        params, config, d, jnp.concatenate([pending.hidden, chain_states], 1),
        jnp.concatenate([pending.tokens, chain_tokens], 1),
        jnp.concatenate([positions, chain_pos], 1), caches[d],
        new_mask=_window_and_chains_mask(pending.count, width, chain_tokens.shape[1], d),
        advance=pending.count, compute_logits=False)
    outputs = out.hidden[:, :width]
    newest = jnp.take_along_axis(outputs, jnp.maximum(pending.count - 1, 0)[:, None, None],
                                 axis=1)[:, 0]
    ready = pending.replace(hidden=jnp.concatenate([last[d][:, None], outputs[:, :-1]], 1),
                            start=pending.start - 1)
    caches = caches[:d] + (out.cache,) + caches[d + 1:]
    last = last[:d] + (jnp.where((pending.count > 0)[:, None], newest, last[d]),) + last[d + 1:]
    return out.hidden[:, width:], (caches, last, ready)

  def _commit_module(self, params, config: ModelConfig, state: MTPState, d: int,
                     pending: AcceptedWindow) -> MTPState:
    """Commit `pending` into module d now and hand what that makes ready to module d + 1."""
    _, (caches, last, ready) = self._module(params, config, d,
                                            (state.caches, state.last, pending),
                                            _no_chains(pending))
    return self._hand_over(params, config, state.replace(caches=caches, last=last), d + 1,
                           ready)

  def _hand_over(self, params, config: ModelConfig, state: MTPState, d: int,
                 ready: AcceptedWindow) -> MTPState:
    """Queue `ready` in module d's backlog, first catching module d up (and so on deeper)
    when some row's backlog cannot take it; a module without a backlog commits at once."""
    if d == len(state.caches):
      return state
    backlog = state.backlogs[d - 1]
    if backlog.tokens.shape[1] < ready.tokens.shape[1]:
      return self._commit_module(params, config, state, d, ready)
    state = jax.lax.cond(backlog.overflows(ready.count),
                         lambda s: self._catch_up(params, config, s, d), lambda s: s, state)
    backlog = state.backlogs[d - 1]
    return _with_pending(state, d, backlog.append(ready.tokens, ready.hidden, ready.start,
                                                  ready.count))

  def _catch_up(self, params, config: ModelConfig, state: MTPState, d: int) -> MTPState:
    """Commit module d's pending entries (and queue what that makes ready deeper)."""
    pending = _pending(state, d)
    state = _with_pending(state, d, pending.cleared())
    return self._commit_module(params, config, state, d, pending)

  def _commit(self, params, config: ModelConfig, state: MTPState) -> MTPState:
    """Commit the accepted window into module 0; deeper modules get it as a backlog."""
    return self._catch_up(params, config, state, 0)

  def propose(self, params, config: ModelConfig, state: MTPState, ctx, tree: DraftTree,
              sampling: SamplingConfig, key: jax.Array) -> tuple[Proposal, MTPState]:
    b = ctx.seq.shape[0]
    r = ctx.seq_len - 1
    width = state.window.tokens.shape[1]
    for d, cache in enumerate(state.caches):
      # Only a menu whose shallower tree is wider at some depth than its deepest one can
      # get here; its chain entries would be dropped near the end of the buffer.
      if _module_slots(tree, d, width, ctx.seq.shape[1]) > cache.max_len:
        raise ConfigError(
            f"MTPDrafter: tree {tree.parents} has {len(tree.nodes_at_depth(d))} nodes at "
            f"depth {d}, more than its state's caches were built for (the deepest tree of "
            f"the menu, of depth {width - 1}, has {cache.max_len} slots for module {d}); "
            "make the menu's deepest tree at least as wide at every depth")
    # Modules this tree drafts with that earlier, shallower rounds left behind catch up
    # first (in order: each one's pass makes entries ready for the next).
    for d in range(1, tree.depth):
      state = jax.lax.cond(jnp.any(state.backlogs[d - 1].count > 0),
                           lambda s, d=d: self._catch_up(params, config, s, d), lambda s: s,
                           state)

    def score(d, parents, tokens, carry):
      """Module d over [its pending entries ; one chain per depth-d node], committing them.

      The chain of a depth-d node x sits at positions r - d .. r - 1: its tokens are x's
      ancestors at depths 1..d (x last), its states module d-1's newest committed output
      followed by module d-1's chain for x's parent (computed one depth earlier).
      """
      carry, chain_out = carry
      m = len(parents)
      if d > 0:
        anc = np.stack([tree.path_to(int(x)) for x in parents])  # [M, d]
        parent_slot = tree.level_slot[tree.parent_array[parents]]
        last = carry[1]
        first = jnp.broadcast_to(last[d - 1][:, None, None], (b, m, 1, config.d_model))
        rest = chain_out[:, parent_slot, :d - 1] if d > 1 else first[:, :, :0]
        chains = (jnp.concatenate([first, rest], axis=2).reshape(b, m * d, -1),
                  tokens[:, anc].reshape(b, m * d),
                  jnp.broadcast_to((r - d)[:, None, None] + jnp.arange(d)[None, None, :],
                                   (b, m, d)).reshape(b, m * d))
      else:
        chains = _no_chains(carry[2])
      out, carry = self._module(params, config, d, carry, chains)
      if d == 0:
        logits = mtp_head_logits(params, config, 0, carry[1][0])[:, None]  # [B, 1, V]
        return logits, (carry, None)
      chain_out = out.reshape(b, m, d, -1)
      return mtp_head_logits(params, config, d, chain_out[:, :, -1]), (carry, chain_out)

    carry = ((state.caches, state.last, state.window), None)
    proposal, ((caches, last, ready), _) = draft_level_by_level(
        tree, sampling, key, self.draws(sampling), ctx.root, score, carry)
    state = state.replace(caches=caches, last=last, window=state.window.cleared())
    # Modules deeper than this tree (an adaptive policy's shallower round) fall behind.
    return proposal, self._hand_over(params, config, state, tree.depth, ready)

  def update(self, params, config, state: MTPState, result) -> MTPState:
    """Record the accepted window; `propose` commits it in the same pass that drafts."""
    if result.path_tokens.shape[1] == 1:  # a plain round: the window may be full
      state = commit_if_full(state, result.count, lambda s: self._commit(params, config, s))
    # After a speculative round the window is empty: `propose` committed it.
    return state.replace(window=state.window.append(
        result.next_tokens, result.features.hidden, result.start, result.count))
