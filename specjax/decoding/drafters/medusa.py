"""Medusa drafter: the target's Medusa heads read its last hidden state.

Head k predicts the token k + 2 steps after the hidden state's position, so with the hidden
at position r - 1 (the one that produced the root at r) head k drafts position r + 1 + k:
depth k + 1 of the tree. Heads are independent of the parent token, so every node at one
depth draws from the same distribution. No cache, no state.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.decoding.drafters.base import Proposal, check_depth, draft_children
from specjax.decoding.sampling import SamplingConfig, processed_logprobs
from specjax.decoding.tree import DraftTree
from specjax.models.config import ConfigError, ModelConfig
from specjax.models.heads import medusa_logits


@dataclasses.dataclass(frozen=True)
class MedusaDrafter:
  """Drafts from the target's Medusa heads.

  Attributes:
    sampled: sample siblings without replacement from the heads (rejection verification)
      instead of taking the top-w tokens (matching verification). Ignored when greedy.
  """

  sampled: bool = False

  def validate(self, config: ModelConfig, tree: DraftTree) -> None:
    if not config.num_medusa_heads:
      raise ConfigError("MedusaDrafter needs a model with num_medusa_heads >= 1")
    check_depth(self, tree, config.num_medusa_heads)

  def min_prompt_length(self, tree):
    return 1

  def init(self, params, config, drafter_params, ctx, tree, max_len, prompt_hidden):
    return None

  def propose(self, params, config: ModelConfig, state, ctx, tree: DraftTree,
              sampling: SamplingConfig, key: jax.Array) -> Proposal:
    b = ctx.seq.shape[0]
    heads = processed_logprobs(medusa_logits(params, config, ctx.last_hidden), sampling)
    # Node u's children are drafted by the head of depth(u) + 1, i.e. head index depth(u).
    head_of_node = jnp.asarray(tree.depths.clip(max=config.num_medusa_heads - 1))
    node_logprobs = jnp.moveaxis(heads, 0, 1)[:, head_of_node]  # [B, N + 1, V]
    draw = self.sampled and not sampling.greedy
    tokens = jnp.zeros((b, tree.num_nodes + 1), jnp.int32)
    for d in range(tree.depth):
      parents = tree.nodes_at_depth(d)
      k = jax.random.fold_in(key, d) if draw else None
      children, toks = draft_children(tree, parents, node_logprobs[:, parents], k)
      tokens = tokens.at[:, children].set(toks)
    return Proposal(tokens=tokens[:, 1:], logprobs=node_logprobs if draw else None)

  def update(self, params, config, state, result):
    return None
