"""Group drafting: drafts from the other responses to the same prompt, on device, no model.

A GRPO rollout samples G responses to each prompt (rows i * G .. i * G + G - 1, prompt-major),
and as training converges they say nearly the same thing. A row that is behind, or in the
long tail after its siblings finished, can draft what a sibling wrote after the text the row
has just produced: the row's last n tokens are looked up in each sibling of its group (and,
failing that, in its own prompt and response, as n-gram prompt lookup does), longest n first,
and the k tokens that followed the best match are the draft (on a tree: the distinct
continuations of the matches, best first, `trie_draft`). Deterministic drafts, verified by
matching: lossless like every drafter.

The drafter keeps every row's text of the call in a bank `[B0, L]` that the loop's compaction
does not shrink, so a row still generating in a small bucket drafts from siblings that have
finished and left the batch. The bank is refreshed from the live rows at each proposal; rows
map to their bank row (and so to their group) by their index in the full batch.

Shape letters: see `specjax` (B rows in the current bucket, B0 rows of the call, G group size,
L sequence buffer); k is the number of draft tokens.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from specjax.checks import is_int
from specjax.decoding.drafters.base import DraftContext, Drafter, Proposal
from specjax.decoding.drafters.fallback import FallbackDrafter
from specjax.decoding.sampling import SamplingConfig
from specjax.decoding.tree import DraftTree
from specjax.errors import ConfigError


@struct.dataclass
class GroupState:
  """Attributes:
    bank: `[B0, L]` every row's sequence as of its last proposal (not compacted).
    bank_len: `[B0]` valid tokens of each bank row.
    rows: `[B]` each current row's index in the full batch (compacted with the rows).
  """

  UNBATCHED: ClassVar[tuple[str, ...]] = ("bank", "bank_len")

  bank: jax.Array
  bank_len: jax.Array
  rows: jax.Array


def suffix_match(cand: jax.Array, cand_len: jax.Array, own: jax.Array, priority: jax.Array,
                 seq: jax.Array, seq_len: jax.Array, n: int, tree: DraftTree,
                 min_n: int | None = None, vote: bool = False) -> tuple[jax.Array, jax.Array]:
  """A draft `tree` of what followed each row's longest suffix of `min_n` .. `n` tokens
  (`min_n` None: `n` only) in its candidate texts.

  A candidate's match may sit anywhere with a token after it; in the row's own text (`own`) it
  must end before the suffix starts. Each candidate offers the continuation of its best
  occurrence (`candidate_matches`); the tree is the trie of those continuations, its nodes
  the best distinct tokens at each branch point (`trie_draft`): a chain follows the best
  continuation, a tree also the next-best distinct ones (SRT's tree over earlier rollouts).
  Best: the longest match first; among equally long ones, with `vote`, the token most of
  them continue with (the policy's likeliest next token is the one most of its earlier samples
  took); then the higher `priority`, then the match closest to the row's own position (texts
  that answer one prompt run in parallel, so the aligned occurrence is the likely one).

  Args:
    cand, cand_len: `[B, C, L]`, `[B, C]` each row's C candidate texts and their lengths (0:
      an absent candidate, which matches nothing).
    own: `[B, C]` which candidate is the row's own text; `priority`: `[B, C]` ints in
      [0, 4), the tie-break between candidates of one match length.
    seq, seq_len: `[B, L]`, `[B]` the rows' texts.

  Returns:
    `(tokens [B, N], drafted [B, N])`: each node's token and whether it was drafted (a node
    whose parent was not, or with no candidate left to continue it, is not).
  """
  matches = candidate_matches(cand, cand_len, own, priority, seq, seq_len, n, tree.depth,
                              min_n)
  return trie_draft(*matches, tree, vote=vote)


def candidate_matches(cand: jax.Array, cand_len: jax.Array, own: jax.Array,
                      priority: jax.Array, seq: jax.Array, seq_len: jax.Array, n: int,
                      depth: int, min_n: int | None = None
                      ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Each candidate's best occurrence of the row's suffix (`suffix_match`'s arguments) and
  the `depth` tokens after it.

  Candidates are indexed by q, the position their continuation starts at: a suffix of m tokens
  matches there when `cand[q - i] == seq[seq_len - i]` for i = 1 .. m, so the matches of every
  suffix length come from one pass over i (each length's the running AND of the first ones).

  Returns:
    `(cont [B, C, D], valid [B, C, D], length [B, C], rank [B, C])`: the continuation and
    which of its tokens exist (a match near the end of a text has fewer than D after it), the
    match's length (0: none) and its rank among equally long matches (priority, then
    nearness to the row's position; higher is better).
  """
  min_n = n if min_n is None else min_n
  b, c, l = cand.shape
  q = jnp.arange(l)[None, None, :]
  ends = jnp.where(own, jnp.minimum(cand_len, seq_len[:, None]), cand_len)
  # A token follows the match; the row's own match ends before its suffix starts.
  usable = (q < ends[:, :, None]) & (~own[:, :, None] | (q < seq_len[:, None, None]))
  run = usable
  longest = jnp.zeros((b, c, l), jnp.int32)  # the longest matching suffix length, 0: none
  for i in range(1, n + 1):
    want = jnp.take_along_axis(seq, jnp.maximum(seq_len - i, 0)[:, None], axis=1)  # [B, 1]
    run &= (jnp.roll(cand, i, axis=2) == want[:, :, None]) & (q >= i)
    run &= (seq_len >= i)[:, None, None]
    if i >= min_n:
      longest = jnp.where(run, i, longest)
  # Within one length a rank lies in [0, 4 (l + 1)): priority tiers l + 1 apart, then
  # nearness to the row's position.
  rank = priority[:, :, None] * (l + 1) + (l - jnp.abs(q - seq_len[:, None, None]))
  score = jnp.where(longest > 0, longest * 4 * (l + 1) + rank, -1)
  at = jnp.argmax(score, axis=2)  # [B, C] each candidate's best occurrence
  length = jnp.take_along_axis(longest, at[:, :, None], axis=2)[:, :, 0]
  rank = jnp.take_along_axis(rank, at[:, :, None], axis=2)[:, :, 0]
  idx = at[:, :, None] + jnp.arange(depth)[None, None, :]
  cont = jnp.take_along_axis(cand, jnp.minimum(idx, l - 1), axis=2)
  valid = (length > 0)[:, :, None] & (idx < ends[:, :, None])
  return cont, valid, length, rank


def trie_draft(cont: jax.Array, valid: jax.Array, length: jax.Array, rank: jax.Array,
               tree: DraftTree, *, vote: bool) -> tuple[jax.Array, jax.Array]:
  """The trie of the candidates' continuations laid onto `tree` (static shapes): `(tokens
  [B, N], drafted [B, N])`.

  A node continues its parent's path with the best token among the candidates that followed
  that path and were not taken by an earlier sibling: the token whose longest match is
  longest, then (with `vote`) offered by most candidates at that length, then of the best
  rank (`candidate_matches`). So the first child of each node is the likeliest next token and
  its siblings are the next distinct ones, most supported first; a chain (one child per node)
  is the best continuation, re-voted among the candidates still on its path at every depth.
  """
  b, c, _ = cont.shape
  parents, depths = tree.parent_array, tree.depths
  top_rank = jnp.maximum(jnp.max(rank), 0) + 1  # ranks are tiers below a length step
  on_path = {0: length > 0}  # [B, C] candidates whose continuation is the node's path
  taken: dict[int, jax.Array] = {}  # per parent: candidates an earlier child continued
  drafted = {0: jnp.ones((b,), bool)}
  tokens, flags = [], []
  for node in range(1, tree.num_nodes + 1):
    parent, d = int(parents[node]), int(depths[node]) - 1
    offered = cont[:, :, d]
    eligible = on_path[parent] & valid[:, :, d] & ~taken.get(parent, False)
    same = (offered[:, :, None] == offered[:, None, :]) & eligible[:, None, :]  # [B, C, C]
    longest = jnp.max(jnp.where(same, length[:, None, :], 0), axis=2)  # per offered token
    at_longest = same & (length[:, None, :] == longest[:, :, None])
    support = at_longest.sum(2) if vote else 0
    best = jnp.max(jnp.where(at_longest, rank[:, None, :], 0), axis=2)
    key = jnp.where(eligible, (longest * (c + 1) + support) * top_rank + best, -1)
    choice = jnp.argmax(key, axis=1)
    token = jnp.take_along_axis(offered, choice[:, None], axis=1)[:, 0]
    flag = drafted[parent] & (jnp.max(key, axis=1) >= 0)
    follows = eligible & (offered == token[:, None])
    on_path[node] = follows
    taken[parent] = taken.get(parent, jnp.zeros((b, c), bool)) | follows
    drafted[node] = flag
    tokens.append(token)
    flags.append(flag)
  return jnp.stack(tokens, axis=1), jnp.stack(flags, axis=1)


def group_candidates(bank: jax.Array, bank_len: jax.Array, rows: jax.Array, group_size: int
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Each row's group as `suffix_match` candidates: `(cand [B, G, L], cand_len [B, G],
  own [B, G])`, the texts of the bank rows of its group (a batch of partial groups has fewer
  members at its end: those are absent)."""
  g = group_size
  members = (rows // g)[:, None] * g + jnp.arange(g)[None, :]  # [B, G] bank rows of the group
  present = members < bank.shape[0]
  members = jnp.minimum(members, bank.shape[0] - 1)
  cand_len = jnp.where(present, bank_len[members], 0)
  return bank[members], cand_len, (members == rows[:, None]) & present


def group_lookup(bank: jax.Array, bank_len: jax.Array, rows: jax.Array, group_size: int,
                 seq: jax.Array, seq_len: jax.Array, n: int, tree: DraftTree,
                 min_n: int | None = None) -> tuple[jax.Array, jax.Array]:
  """`suffix_match` over each row's group: its siblings (preferred) and its own text.

  Args:
    bank, bank_len: `[B0, L]`, `[B0]` the texts of every row of the call.
    rows: `[B]` the current rows' indices in the bank; `seq [B, L]`, `seq_len [B]` their texts.
    n, min_n, tree: as `suffix_match`.
  """
  cand, cand_len, own = group_candidates(bank, bank_len, rows, group_size)
  return suffix_match(cand, cand_len, own, jnp.where(own, 0, 1), seq, seq_len, n, tree, min_n)


def group_sizes(drafter: Drafter | None) -> tuple[int, ...]:
  """The group sizes of the `GroupDrafter`s in `drafter` (itself, or a `FallbackDrafter`'s)."""
  if isinstance(drafter, GroupDrafter):
    return (drafter.group_size,)
  if isinstance(drafter, FallbackDrafter):
    return group_sizes(drafter.primary) + group_sizes(drafter.fallback)
  return ()


def with_group_size(drafter: Drafter | None, group_size: int) -> Drafter | None:
  """`drafter` with every `GroupDrafter` in it (itself, or a `FallbackDrafter`'s) reading
  groups of `group_size` rows: a GRPO rollout's G answers to each prompt."""
  if isinstance(drafter, GroupDrafter):
    return dataclasses.replace(drafter, group_size=group_size)
  if isinstance(drafter, FallbackDrafter):
    return dataclasses.replace(drafter, primary=with_group_size(drafter.primary, group_size),
                               fallback=with_group_size(drafter.fallback, group_size))
  return drafter


@dataclasses.dataclass(frozen=True)
class GroupDrafter(Drafter):
  """Drafts from the sibling responses of each row's group (module docstring).

  Attributes:
    group_size: G, consecutive rows answering one prompt (the GRPO group size). 1: each row
      drafts from its own text only (n-gram prompt lookup).
    max_ngram, min_ngram: the suffix lengths tried, longest first.
  """

  group_size: int = 1
  max_ngram: int = 4
  min_ngram: int = 2

  def __post_init__(self):
    if not (is_int(self.group_size) and self.group_size >= 1):
      raise ConfigError(f"GroupDrafter(group_size={self.group_size!r}) is invalid: must be an "
                        "int >= 1 (the rows that answer one prompt)")
    if not (is_int(self.min_ngram) and is_int(self.max_ngram)
            and 1 <= self.min_ngram <= self.max_ngram):
      raise ConfigError(f"GroupDrafter(min_ngram={self.min_ngram!r}, max_ngram="
                        f"{self.max_ngram!r}) is invalid: need 1 <= min_ngram <= max_ngram")

  def init(self, params, config, drafter_params, ctx: DraftContext, tree, max_len, prompt, *,
           plain_rounds=False) -> GroupState:
    # Rows i * G .. i * G + G - 1 are a group; a batch that is not a multiple of G (a
    # calibration bucket, say) ends with a smaller one. Any grouping is lossless: it only
    # decides what is drafted.
    b = ctx.seq.shape[0]
    return GroupState(bank=ctx.seq, bank_len=ctx.seq_len, rows=jnp.arange(b, dtype=jnp.int32))

  def propose(self, params, config, state: GroupState, ctx: DraftContext, tree: DraftTree,
              sampling: SamplingConfig, key: jax.Array) -> tuple[Proposal, GroupState]:
    state = state.replace(bank=state.bank.at[state.rows].set(ctx.seq),
                          bank_len=state.bank_len.at[state.rows].set(ctx.seq_len))
    tokens, drafted = group_lookup(state.bank, state.bank_len, state.rows, self.group_size,
                                   ctx.seq, ctx.seq_len, self.max_ngram, tree,
                                   min_n=self.min_ngram)
    return Proposal(tokens=jnp.where(drafted, tokens, ctx.root[:, None]), drafted=drafted), state
