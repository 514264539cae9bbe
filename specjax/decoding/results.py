"""What a generation call returns: `GenerationResult` and its `GenerationStats`.

They describe the output of `generate` / `DecodeLoop`, independent of how the loop runs, so
callers that only read results need not import the loop.

Shape letters: see `specjax` (B batch, L = P + max_new sequence buffer, D depth).
"""

from __future__ import annotations

import jax
from flax import struct

from specjax.decoding.policy import AcceptanceCounts


@struct.dataclass
class GenerationStats:
  """Speculation statistics of one `generate` call.

  Attributes:
    rounds: loop iterations (verify passes after the prefill).
    row_rounds: `[B]` rounds in which each row was still generating.
    accepted_per_depth: `[D]` fraction of row-rounds whose draft at depth d + 1 was accepted
      and emitted (drafts accepted beyond EOS or max_new_tokens are not counted).
    tokens_per_round: mean tokens emitted per row-round (mean acceptance length; 1 = plain).
    drafts_per_round: mean draft tokens verified per row-round (the tree's nodes, fewer when a
      drafter stops early: `confidence`).
    tree_rounds: `[I]` rounds that ran each tree of the menu (one entry for a fixed tree).
    segments: runs of rounds of one tree that the speculation policy started (at each change
      of tree and at the start of each compaction bucket while the drafter is on), each a
      pass over the caches into and out of `lax.switch` (`CostTable.switch`); 0 for a fixed
      tree. Rounds after the policy switched the drafter off run outside them.
    acceptance: the policy's `AcceptanceCounts` at the end of the call; pass them to the next
      call (`DecodeLoop.__call__(..., acceptance=...)`) to start from what was learnt.
    drafter: the drafter's own counts over the call (`Drafter.stats`): e.g. which of a
      `FallbackDrafter`'s two drafters drafted how many row-rounds, and the tokens they
      emitted; empty for most drafters and without one.
  """

  rounds: jax.Array
  row_rounds: jax.Array
  accepted_per_depth: jax.Array
  tokens_per_round: jax.Array
  drafts_per_round: jax.Array
  tree_rounds: jax.Array
  segments: jax.Array
  acceptance: AcceptanceCounts
  drafter: dict[str, jax.Array] = struct.field(default_factory=dict)


@struct.dataclass
class GenerationResult:
  """Output of `generate`.

  Attributes:
    tokens: `[B, max_new_tokens]` generated tokens; entries at or after `lengths` are `pad_id`.
    lengths: `[B]` generated tokens per row (EOS included when it was generated).
    logprobs: `[B, max_new_tokens]` log softmax(logits / temperature) of each generated token
      under the target (temperature 1 for greedy); 0 after `lengths`.
    done: `[B]` rows that stopped at EOS or at `max_new_tokens`.
    stats: `GenerationStats`.
  """

  tokens: jax.Array
  lengths: jax.Array
  logprobs: jax.Array
  done: jax.Array
  stats: GenerationStats
