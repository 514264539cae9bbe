"""External draft model: a smaller `ModelConfig` sharing the target's tokenizer.

The draft model keeps its own KV cache, committed in lockstep with the target's (everything
before the root). To draft a tree it runs level by level: a pass over [root] + nodes with the
tree mask (nothing committed) scores the nodes of depth d - 1, whose children are then drawn.
A chain needs one token per level instead: each node's keys wait in a scratch slot past the
committed entries, where the next level reads them.
After verification one pass over the accepted path commits exactly those entries, which is
the rollback: rejected drafts were never committed. Rounds that draft nothing (an adaptive
policy's plain rounds) only append their token to a window, committed in one pass when it is
full or before the next proposal, so they cost the draft model almost nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from specjax.decoding.drafters.base import (PLAIN_WINDOW, AcceptedWindow, Drafter, Proposal,
                                            check_confidence, check_draft_cache, commit_if_full,
                                            commit_if_pending, draft_level_by_level)
from specjax.decoding.sampling import SamplingConfig
from specjax.decoding.tree import DraftTree
from specjax.errors import ConfigError
from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig
from specjax.models.params import check_params
from specjax.models.transformer import forward, unembed


@struct.dataclass
class DraftModelState:
  """The draft model's parameters, its cache, and the plain rounds' tokens not yet committed
  (`window.tokens` holds path tokens here; the model reads no target features)."""

  UNBATCHED: ClassVar[tuple[str, ...]] = ("params",)

  params: Any
  cache: KVCache
  window: AcceptedWindow


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter(Drafter):
  """Drafts with a separate small model; pass its params as `generate(drafter_params=...)`.

  Attributes:
    config: the draft model's configuration (same vocabulary as the target).
    sampled: sample siblings without replacement (rejection verification) instead of top-w.
    confidence: a row stops drafting once no token it drafted at a depth has at least this
      draft probability (0: draft the whole tree); see `draft_level_by_level`. With a deep
      chain this gives each row and round the draft length its drafter is confident about.
  """

  config: ModelConfig
  sampled: bool = False
  confidence: float = 0.0

  def validate(self, config: ModelConfig, tree: DraftTree) -> None:
    check_confidence(self, self.confidence)
    if not isinstance(self.config, ModelConfig):
      raise ConfigError(f"DraftModelDrafter(config={self.config!r}) is invalid: must be the "
                        "draft model's specjax.models.ModelConfig")
    if self.config.vocab_size != config.vocab_size:
      raise ConfigError(
          f"draft model vocab_size={self.config.vocab_size} differs from the target's "
          f"{config.vocab_size}: a draft model must share the target's tokenizer")

  def init(self, params, config, drafter_params, ctx, tree, max_len, prompt, *,
           plain_rounds=False):
    if drafter_params is None:
      raise ConfigError("DraftModelDrafter needs generate(..., drafter_params=<draft params>)")
    check_params(drafter_params, self.config, "drafter_params")
    check_draft_cache(self, self.config.max_position, max_len)
    b, prompt_width = prompt.hidden.shape[:2]
    cache = KVCache.create(self.config, b, max_len)
    positions = jnp.broadcast_to(jnp.arange(prompt_width), (b, prompt_width))
    out = forward(drafter_params, self.config, ctx.seq[:, :prompt_width], positions, cache,
                  advance=ctx.seq_len - 1, compute_logits=False)
    window = AcceptedWindow.empty(b, PLAIN_WINDOW if plain_rounds else 0, 0, jnp.float32,
                                  start=ctx.seq_len - 1)
    return DraftModelState(params=drafter_params, cache=out.cache, window=window)

  def _commit(self, state: DraftModelState) -> DraftModelState:
    win = state.window
    positions = win.start[:, None] + jnp.arange(win.tokens.shape[1])[None, :]
    out = forward(state.params, self.config, win.tokens, positions, state.cache,
                  advance=win.count, compute_logits=False)
    return state.replace(cache=out.cache, window=win.cleared())

  def propose(self, params, config, state: DraftModelState, ctx, tree: DraftTree,
              sampling: SamplingConfig, key: jax.Array) -> tuple[Proposal, DraftModelState]:
    state = commit_if_pending(state, self._commit)
    positions = (ctx.seq_len - 1)[:, None] + jnp.asarray(tree.depths)[None, :]
    if tree.is_chain():
      return self._propose_chain(state, ctx, tree, sampling, key, positions)
    mask = jnp.asarray(tree.ancestor_mask)

    def score(d, parents, tokens, carry):
      # Undrafted nodes hold placeholders; no drafted node can see them (mask = ancestors).
      out = forward(state.params, self.config, tokens, positions, state.cache, new_mask=mask,
                    advance=0, compute_logits=False)
      return unembed(state.params, self.config, out.hidden[:, parents]), carry

    proposal, _ = draft_level_by_level(tree, sampling, key, self.draws(sampling), ctx.root,
                                       score, None, confidence=self.confidence)
    return proposal, state

  def _propose_chain(self, state: DraftModelState, ctx, tree: DraftTree,
                     sampling: SamplingConfig, key: jax.Array,
                     positions: jax.Array) -> tuple[Proposal, DraftModelState]:
    """A chain one token per depth: node d's keys go to scratch slot `committed + d`, where
    the next depth sees them as its ancestors' (as the committed entries, by moving the
    cache's lengths there for that pass). The accepted path's commit in `update` overwrites
    the scratch slots."""
    committed = state.cache.lengths

    def score(d, parents, tokens, cache):
      out = forward(state.params, self.config, tokens[:, d:d + 1], positions[:, d:d + 1],
                    cache.set_lengths(committed + d), advance=0, compute_logits=False)
      return (unembed(state.params, self.config, out.hidden),
              out.cache.set_lengths(committed))

    proposal, cache = draft_level_by_level(tree, sampling, key, self.draws(sampling),
                                           ctx.root, score, state.cache,
                                           confidence=self.confidence)
    return proposal, state.replace(cache=cache)

  def update(self, params, config, state: DraftModelState, result) -> DraftModelState:
    b, width = result.path_tokens.shape
    if width == 1:  # a round that drafted nothing: its token waits in the window
      state = commit_if_full(state, result.count, self._commit)
      return state.replace(window=state.window.append(
          result.path_tokens, jnp.zeros((b, 1, 0)), result.start, result.count))
    # `propose` committed the window: only this round's path is pending.
    positions = result.start[:, None] + jnp.arange(width)[None, :]
    out = forward(state.params, self.config, result.path_tokens, positions, state.cache,
                  advance=result.count, compute_logits=False)
    return state.replace(cache=out.cache)
