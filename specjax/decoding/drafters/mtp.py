"""MTP drafter: the target's own DeepSeek-V3 multi-token-prediction modules, chained.

Module k at position i reads (state h^k_i, token t_{i+k+1}) and predicts t_{i+k+2}; h^0 is
the trunk's hidden, h^{k+1} is module k's output stream. Module k's input at i needs the
token k + 1 ahead, so with the root at position r, module k can be *committed* (its KV
cache made final) exactly through position r - k - 1. The drafter keeps each used module at
that frontier, plus its output stream at its last committed position.

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
of the drafter, which is what a memory-bound decode step pays for. A round that drafts less
deep than the deepest tree the state was built for (an adaptive policy's choice) still
commits the window into the deeper modules, and a round that drafts nothing leaves its entry
in the window until the window is full.

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
                                            check_heads, commit_if_full,
                                            draft_level_by_level)
from specjax.decoding.sampling import SamplingConfig
from specjax.decoding.tree import DraftTree
from specjax.errors import ConfigError
from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig
from specjax.models.heads import mtp_forward, mtp_head_logits


@struct.dataclass
class MTPState:
  """Per used module: its one-layer cache and its output stream at its newest committed
  position; plus the accepted window the next `propose` commits.

  Attributes:
    caches: D one-layer `KVCache`s, module k committed through position r - k - 1.
    last: D arrays `[B, E]`, module k's output at its newest committed position.
    window: the pending `AcceptedWindow`.
  """

  caches: tuple[KVCache, ...]
  last: tuple[jax.Array, ...]
  window: AcceptedWindow


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


def _no_chains(state: MTPState, config: ModelConfig) -> tuple[jax.Array, ...]:
  """Empty (states, tokens, positions) chains: a module pass that only commits."""
  b = state.window.tokens.shape[0]
  return (jnp.zeros((b, 0, config.d_model), state.window.hidden.dtype),
          jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.int32))


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
    (`_module_slots`).
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
    return MTPState(caches=tuple(caches), last=tuple(last), window=window)

  def _module(self, params, config: ModelConfig, state: MTPState, d: int,
              carry: tuple, chains: tuple[jax.Array, jax.Array, jax.Array]) -> tuple:
    """Run module d over [the pending window ; chains], committing the window's valid prefix.

    `carry` is (caches, last, window_in): every module's cache and newest committed output
    (modules < d already advanced this round) and module d's window state inputs. `chains`
    are (states, tokens, positions) of M chains of d entries each, `[B, M * d, ...]`.
    Returns the module's chain outputs `[B, M * d, E]` and the carry for module d + 1.
    """
    caches, last, window_in = carry
    win = state.window
    width = win.tokens.shape[1]
    chain_states, chain_tokens, chain_pos = chains
    window_pos = (win.start - d)[:, None] + jnp.arange(width)[None, :]
    out = mtp_forward(
        params, config, d, jnp.concatenate([window_in, chain_states], 1),
        jnp.concatenate([win.tokens, chain_tokens], 1),
        jnp.concatenate([window_pos, chain_pos], 1), caches[d],
        new_mask=_window_and_chains_mask(win.count, width, chain_tokens.shape[1], d),
        advance=win.count, compute_logits=False)
    window_out = out.hidden[:, :width]
    newest = jnp.take_along_axis(window_out, jnp.maximum(win.count - 1, 0)[:, None, None],
                                 axis=1)[:, 0]
    caches = caches[:d] + (out.cache,) + caches[d + 1:]
    last = last[:d] + (jnp.where((win.count > 0)[:, None], newest, last[d]),) + last[d + 1:]
    # Module d + 1's window states: module d's newest output before this window, then its
    # window outputs shifted by one.
    next_window_in = jnp.concatenate([state.last[d][:, None], window_out[:, :-1]], 1)
    return out.hidden[:, width:], (caches, last, next_window_in)

  def _commit_from(self, params, config: ModelConfig, state: MTPState, first: int,
                   carry: tuple) -> MTPState:
    """Commit the window into modules `first` .. D - 1 (those this round did not draft with)."""
    for d in range(first, len(state.caches)):
      _, carry = self._module(params, config, state, d, carry, _no_chains(state, config))
    caches, last, _ = carry
    return MTPState(caches=caches, last=last, window=state.window.cleared())

  def _commit(self, params, config: ModelConfig, state: MTPState) -> MTPState:
    return self._commit_from(params, config, state, 0,
                             (state.caches, state.last, state.window.hidden))

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

    def score(d, parents, tokens, carry):
      """Module d over [its window ; one chain per depth-d node], committing the window.

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
        chains = _no_chains(state, config)
      out, carry = self._module(params, config, state, d, carry, chains)
      if d == 0:
        logits = mtp_head_logits(params, config, 0, carry[1][0])[:, None]  # [B, 1, V]
        return logits, (carry, None)
      chain_out = out.reshape(b, m, d, -1)
      return mtp_head_logits(params, config, d, chain_out[:, :, -1]), (carry, chain_out)

    carry = ((state.caches, state.last, state.window.hidden), None)
    proposal, (carry, _) = draft_level_by_level(
        tree, sampling, key, self.draws(sampling), ctx.root, score, carry)
    # Modules deeper than this tree (an adaptive policy's shallower round) commit only.
    return proposal, self._commit_from(params, config, state, tree.depth, carry)

  def update(self, params, config, state: MTPState, result) -> MTPState:
    """Record the accepted window; `propose` commits it in the same pass that drafts."""
    if result.path_tokens.shape[1] == 1:  # a plain round: the window may be full
      state = commit_if_full(state, result.count, lambda s: self._commit(params, config, s))
    # After a speculative round the window is empty: `propose` committed it.
    return state.replace(window=state.window.append(
        result.next_tokens, result.features.hidden, result.start, result.count))
