"""EAGLE-3 drafter: one small decoder layer on fused target features, drafting a whole tree.

The layer at position p reads (feature at p, token t_{p+1}) and predicts t_{p+2} (see
`specjax.models.eagle3`). With the root at position r:

- positions <= r - 1 are *committed* in the drafter's one-layer KV cache, computed from the
  target's own features (three residual streams fused by `fc`). The target computes those
  features for free in the verify forward (`hidden_layers`), and `update` commits the
  accepted path in one layer pass over its entries, so a round costs one layer pass per tree
  depth (the commit, then one per depth beyond the first) and nothing more. A round that
  drafted nothing (an adaptive policy's plain round) leaves its entry in a window, committed
  in one pass when full or before the next proposal;
- the depth-1 drafts come from the layer's output at r - 1;
- a node x at depth d >= 1 runs the layer at position r + d - 1 on (its parent's output
  stream, x's token) and drafts x's children. Its keys/values go to scratch slots beyond the
  committed length (slot = committed + x - 1), visible only to x's descendants, so each
  depth is one pass over that depth's nodes with no recomputation. Scratch slots are never
  committed: the next round's commit overwrites them, which is the rollback.

The head scores a reduced draft vocabulary of W target ids; its distribution is mapped to
the full vocabulary with zero mass elsewhere, so verification (matching or rejection) stays
exact for any W.

Shape letters: see `specjax` (B batch, T new positions, P prompt buffer, N draft nodes, D depth,
M nodes at one depth, S cache slots, E d_model, V vocab, W draft vocab).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.decoding.drafters.base import (PLAIN_WINDOW, AcceptedWindow, Drafter, Proposal,
                                            check_confidence, check_draft_cache, commit_if_full,
                                            commit_if_pending, draft_level_by_level)
from specjax.decoding.sampling import SamplingConfig
from specjax.decoding.tree import DraftTree
from specjax.errors import ConfigError
from specjax.models.cache import KVCache, attention_mask
from specjax.models.config import ModelConfig
from specjax.models.eagle3 import (Eagle3Config, check_d2t, eagle3_cache, eagle3_draft_logits,
                                   eagle3_layer, fuse, init_eagle3, select_aux, to_target_vocab)
from specjax.models.params import Params, check_leaves, init_shapes
from specjax.models.transformer import embed


@struct.dataclass
class Eagle3Weights:
  """A trained EAGLE-3 head: pass it as `generate(..., drafter_params=Eagle3Weights(...))`.

  Attributes:
    params: the head's float parameters (`init_eagle3`, `load_eagle3`, `train_eagle3`).
    d2t: `[W]` int32 target id of each draft-vocabulary entry.
  """

  params: Params
  d2t: jax.Array


@struct.dataclass
class Eagle3State:
  """The head, its one-layer cache (committed through position r - 1 once `propose` has
  committed the window), its output stream at the newest committed position, and the
  accepted path waiting to be committed.

  Attributes:
    weights: `Eagle3Weights`.
    cache: one-layer `KVCache`.
    last: `[B, E]` the layer's output at the newest committed position.
    window: `AcceptedWindow` whose `hidden` holds fused target features.
  """

  UNBATCHED: ClassVar[tuple[str, ...]] = ("weights",)

  weights: Eagle3Weights
  cache: KVCache
  last: jax.Array
  window: AcceptedWindow


def _check_weights(weights: Any, config: Eagle3Config) -> None:
  """Static shape checks (these run at trace time, so they see shapes, not values)."""
  if not isinstance(weights, Eagle3Weights):
    raise ConfigError(f"Eagle3Drafter needs generate(..., drafter_params=Eagle3Weights(params, "
                      f"d2t)), got {type(weights).__name__}")
  w = config.draft_vocab_size
  if tuple(jnp.shape(weights.d2t)) != (w,):
    raise ConfigError(f"Eagle3Weights.d2t has shape {tuple(jnp.shape(weights.d2t))}: expected "
                      f"({w},) (the draft vocabulary size of the drafter's Eagle3Config)")
  if not jnp.issubdtype(jnp.result_type(weights.d2t), jnp.integer):
    raise ConfigError(f"Eagle3Weights.d2t has dtype {jnp.result_type(weights.d2t)}: must be "
                      "integer target ids, one per draft id (load_eagle3 returns them)")
  if not isinstance(weights.params, dict):
    raise ConfigError(f"Eagle3Weights.params must be a dict of arrays as init_eagle3 or "
                      f"load_eagle3 return, got {type(weights.params).__name__}")
  check_leaves(weights.params, init_shapes(init_eagle3, config), "Eagle3Weights.params", (),
               f"Eagle3Config: d_model={config.d_model}, draft_vocab_size={w}, mlp_dim="
               f"{config.mlp_dim}; pass the config the head was made with (load_eagle3 "
               "returns both)")


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(Drafter):
  """Drafts trees of any depth with an EAGLE-3 head (`drafter_params=Eagle3Weights`).

  Attributes:
    config: the head's architecture (`Eagle3Config.for_target(target_config, ...)`).
    sampled: sample siblings without replacement (rejection verification) instead of top-w.
    confidence: a row stops drafting once no token it drafted at a depth has at least this
      draft probability (0: draft the whole tree); see `draft_level_by_level`. With a deep
      chain this gives each row and round the draft length its drafter is confident about.
  """

  config: Eagle3Config
  sampled: bool = False
  confidence: float = 0.0

  def hidden_layers(self, config: ModelConfig) -> tuple[int, ...]:
    return self.config.hidden_layers

  def validate(self, config: ModelConfig, tree: DraftTree) -> None:
    check_confidence(self, self.confidence)
    if not isinstance(self.config, Eagle3Config):
      raise ConfigError(f"Eagle3Drafter(config={self.config!r}) is invalid: must be the head's "
                        "specjax.models.Eagle3Config (Eagle3Config.for_target(...))")
    self.config.check_target(config)

  def check_params(self, drafter_params: Any) -> None:
    _check_weights(drafter_params, self.config)
    if not isinstance(drafter_params.d2t, jax.core.Tracer):
      try:  # out-of-range or repeated ids would silently drop or misplace drafts
        check_d2t(np.asarray(drafter_params.d2t), self.config)
      except ConfigError as e:
        raise ConfigError(f"Eagle3Weights.{e} (load_eagle3 returns a valid d2t: target ids, "
                          "not the checkpoint's offsets)") from None

  def _logits(self, weights: Eagle3Weights, stream: jax.Array) -> jax.Array:
    """`[B, M, V]` full-vocabulary logits (-1e30 outside the draft vocabulary)."""
    return to_target_vocab(eagle3_draft_logits(weights.params, self.config, stream),
                           weights.d2t, self.config.vocab_size)

  def _layer(self, weights: Eagle3Weights, params: Params, config: ModelConfig,
             cache: KVCache, hidden: jax.Array, tokens: jax.Array, positions: jax.Array,
             slots: jax.Array, new_mask: jax.Array) -> tuple[jax.Array, KVCache]:
    """One layer pass over T entries written to `slots`; they see the committed slots and the
    slots `lengths + j` where `new_mask [B, T, n]` allows (n new slots). Returns the output
    and the cache (lengths unchanged)."""
    mask = attention_mask(cache.lengths, new_mask.shape[-1], cache.max_len, new_mask)
    out, (keys, values) = eagle3_layer(
        weights.params, self.config, embed(params, config, tokens), hidden, positions,
        mask=mask, kv=(cache.keys[0], cache.values[0]), slots=slots)
    return out, cache.replace(keys=(keys,), values=(values,))

  def init(self, params, config, drafter_params, ctx, tree, max_len, prompt, *,
           plain_rounds=False) -> Eagle3State:
    """Run the layer over the prompt on the target's features and commit r positions."""
    _check_weights(drafter_params, self.config)
    check_draft_cache(self, self.config.max_position, max_len)
    b, p, e = prompt.hidden.shape
    r = ctx.seq_len - 1  # root position == prompt length
    features = fuse(drafter_params.params, self.config, select_aux(self.config, prompt.layers))
    positions = jnp.broadcast_to(jnp.arange(p), (b, p))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((p, p), bool)), (b, p, p))
    cache = eagle3_cache(self.config, b, max_len)
    out, cache = self._layer(drafter_params, params, config, cache, features,
                             ctx.seq[:, 1:p + 1], positions, positions, causal)
    last = jnp.take_along_axis(out, (r - 1)[:, None, None], axis=1)[:, 0]
    window = AcceptedWindow.empty(b, PLAIN_WINDOW if plain_rounds else 0, e, features.dtype,
                                  start=r)
    return Eagle3State(weights=drafter_params, cache=cache.set_lengths(r), last=last,
                       window=window)

  def _commit_entries(self, params: Params, config: ModelConfig, state: Eagle3State,
                      entries: AcceptedWindow) -> Eagle3State:
    """One layer pass committing `entries` (positions start .. start + count - 1)."""
    b, width = entries.tokens.shape
    offsets = jnp.arange(width)[None, :]
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((width, width), bool)), (b, width, width))
    out, cache = self._layer(state.weights, params, config, state.cache, entries.hidden,
                             entries.tokens, entries.start[:, None] + offsets,
                             state.cache.lengths[:, None] + offsets, causal)
    newest = jnp.take_along_axis(out, jnp.maximum(entries.count - 1, 0)[:, None, None],
                                 1)[:, 0]
    return state.replace(cache=cache.advance(entries.count),
                         last=jnp.where((entries.count > 0)[:, None], newest, state.last))

  def _commit(self, params: Params, config: ModelConfig, state: Eagle3State) -> Eagle3State:
    """Commit the window of plain rounds' entries."""
    state = self._commit_entries(params, config, state, state.window)
    return state.replace(window=state.window.cleared())

  def propose(self, params, config: ModelConfig, state: Eagle3State, ctx, tree: DraftTree,
              sampling: SamplingConfig, key: jax.Array) -> tuple[Proposal, Eagle3State]:
    state = commit_if_pending(state, lambda s: self._commit(params, config, s))
    weights, cache, last = state.weights, state.cache, state.last
    b = last.shape[0]
    r = ctx.seq_len - 1
    # Node x's keys go to scratch slot committed + x - 1; x sees its ancestors' and its own.
    node_sees = jnp.asarray(tree.ancestor_mask[:, 1:])  # [N + 1, N]

    def score(d, parents, tokens, carry):
      cache, streams = carry  # streams: [B, N + 1, E] output stream of each node (root: last)
      if d == 0:
        return self._logits(weights, last[:, None]), carry
      m = len(parents)
      hidden = streams[:, tree.parent_array[parents]]
      positions = jnp.broadcast_to((r + d - 1)[:, None], (b, m))
      slots = cache.lengths[:, None] + jnp.asarray(parents - 1)[None, :]
      new_mask = jnp.broadcast_to(node_sees[parents], (b, m, tree.num_nodes))
      out, cache = self._layer(weights, params, config, cache, hidden, tokens[:, parents],
                               positions, slots, new_mask)
      return self._logits(weights, out), (cache, streams.at[:, parents].set(out))

    streams = jnp.zeros((b, tree.num_nodes + 1, self.config.d_model), last.dtype)
    streams = streams.at[:, 0].set(last)
    proposal, (cache, _) = draft_level_by_level(tree, sampling, key, self.draws(sampling),
                                                ctx.root, score, (cache, streams),
                                                confidence=self.confidence)
    # The scratch slots hold the nodes' keys beyond `lengths`: the next commit overwrites them.
    return proposal, state.replace(cache=cache)

  def update(self, params, config, state: Eagle3State, result) -> Eagle3State:
    """Commit the accepted path with its fused target features; a round that drafted
    nothing leaves its entry in the window (committed when full or before a proposal)."""
    features = fuse(state.weights.params, self.config,
                    select_aux(self.config, result.features.layers))
    if result.path_tokens.shape[1] == 1:
      state = commit_if_full(state, result.count, lambda s: self._commit(params, config, s))
      return state.replace(window=state.window.append(result.next_tokens, features,
                                                      result.start, result.count))
    # `propose` committed the window: only this round's path is pending.
    return self._commit_entries(params, config, state, AcceptedWindow(
        tokens=result.next_tokens, hidden=features, start=result.start, count=result.count))
