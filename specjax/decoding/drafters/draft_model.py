"""External draft model: a smaller `ModelConfig` sharing the target's tokenizer.

The draft model keeps its own KV cache, committed in lockstep with the target's (everything
before the root). To draft a tree it runs level by level: a pass over [root] + nodes with the
tree mask (nothing committed) scores the nodes of depth d - 1, whose children are then drawn.
After verification one pass over the accepted path commits exactly those entries, which is
the rollback: rejected drafts were never committed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.decoding.drafters.base import Proposal, draft_children
from specjax.decoding.sampling import SamplingConfig, processed_logprobs
from specjax.decoding.tree import DraftTree
from specjax.models.cache import KVCache
from specjax.models.config import ConfigError, ModelConfig
from specjax.models.transformer import forward, unembed


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
  """Drafts with a separate small model; pass its params as `generate(drafter_params=...)`.

  Attributes:
    config: the draft model's configuration (same vocabulary as the target).
    sampled: sample siblings without replacement (rejection verification) instead of top-w.
  """

  config: ModelConfig
  sampled: bool = False

  def validate(self, config: ModelConfig, tree: DraftTree) -> None:
    if self.config.vocab_size != config.vocab_size:
      raise ConfigError(
          f"draft model vocab_size={self.config.vocab_size} differs from the target's "
          f"{config.vocab_size}: a draft model must share the target's tokenizer")

  def min_prompt_length(self, tree):
    return 1

  def init(self, params, config, drafter_params, ctx, tree, max_len, prompt_hidden):
    if drafter_params is None:
      raise ConfigError("DraftModelDrafter needs generate(..., drafter_params=<draft params>)")
    b, prompt_width = prompt_hidden.shape[:2]
    cache = KVCache.create(self.config, b, max_len)
    positions = jnp.broadcast_to(jnp.arange(prompt_width), (b, prompt_width))
    out = forward(drafter_params, self.config, ctx.seq[:, :prompt_width], positions, cache,
                  advance=ctx.seq_len - 1, compute_logits=False)
    return {"params": drafter_params, "cache": out.cache}

  def propose(self, params, config, state, ctx, tree: DraftTree, sampling: SamplingConfig,
              key: jax.Array) -> Proposal:
    dcfg = self.config
    b = ctx.seq.shape[0]
    draw = self.sampled and not sampling.greedy
    positions = (ctx.seq_len - 1)[:, None] + jnp.asarray(tree.depths)[None, :]
    mask = jnp.asarray(tree.ancestor_mask)
    tokens = jnp.zeros((b, tree.num_nodes + 1), jnp.int32).at[:, 0].set(ctx.root)
    node_logprobs = jnp.zeros((b, tree.num_nodes + 1, dcfg.vocab_size), jnp.float32)
    for d in range(tree.depth):
      # Undrafted nodes hold placeholders; no drafted node can see them (mask = ancestors).
      out = forward(state["params"], dcfg, tokens, positions, state["cache"], new_mask=mask,
                    advance=0, compute_logits=False)
      parents = tree.nodes_at_depth(d)
      lp = processed_logprobs(unembed(state["params"], dcfg, out.hidden[:, parents]), sampling)
      node_logprobs = node_logprobs.at[:, parents].set(lp)
      k = jax.random.fold_in(key, d) if draw else None
      children, toks = draft_children(tree, parents, lp, k)
      tokens = tokens.at[:, children].set(toks)
    return Proposal(tokens=tokens[:, 1:], logprobs=node_logprobs if draw else None)

  def update(self, params, config, state, result):
    width = result.path_tokens.shape[1]
    positions = result.start[:, None] + jnp.arange(width)[None, :]
    out = forward(state["params"], self.config, result.path_tokens, positions, state["cache"],
                  advance=result.count, compute_logits=False)
    return {"params": state["params"], "cache": out.cache}
