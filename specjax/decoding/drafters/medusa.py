"""Medusa drafter: the target's Medusa heads read its last hidden state.

Head k predicts the token k + 2 steps after the hidden state's position, so with the hidden
at position r - 1 (the one that produced the root at r) head k drafts position r + 1 + k:
depth k + 1 of the tree. Heads are independent of the parent token, so every node at one
depth draws from the same distribution. No cache, no state.

Shape letters: see `specjax` (B batch, V vocab).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.decoding.drafters.base import (Drafter, NoState, Proposal, check_depth, check_heads,
                                            draft_level_by_level)
from specjax.decoding.sampling import SamplingConfig
from specjax.decoding.tree import DraftTree
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.heads import medusa_logits


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(Drafter):
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

  def propose(self, params, config: ModelConfig, state: NoState, ctx, tree: DraftTree,
              sampling: SamplingConfig, key: jax.Array) -> tuple[Proposal, NoState]:
    check_heads(self, params, "medusa", tree.depth)
    heads = medusa_logits(params, config, ctx.last_hidden)  # [num_medusa_heads, B, V]

    def score(d, parents, tokens, carry):
      # Every node at depth d has its children drafted by head d, whatever its token.
      return jnp.broadcast_to(heads[d][:, None], (heads.shape[1], len(parents),
                                                  heads.shape[2])), carry

    proposal, _ = draft_level_by_level(tree, sampling, key, self.draws(sampling), ctx.root,
                                       score, None)
    return proposal, state
