"""History drafting: earlier rollouts of the same prompt draft the next ones, no model.

RL revisits its prompts: every epoch over a finite training set asks the policy the same
questions again, and a policy that has begun to converge answers them much as it did before.
A `HistoryBank` keeps, on device, the R latest responses to each prompt (keyed by a hash of
the prompt's tokens, S slots, a new prompt evicting the slot's old one) and the Q latest
responses to any prompt. A GRPO run carries it in its train state, records every rollout into
it inside the compiled step, and checkpoints it (SRT keeps such a per-prompt cache of earlier
steps' rollouts; DAS a suffix tree over recent rollouts).

`HistoryDrafter` drafts for each row the continuation of its longest suffix (`min_ngram` ..
`max_ngram` tokens) found, in this order among equally long matches: its prompt's earlier
responses (aligned after the prompt, so the first tokens of a response draft from the
responses' starts), its siblings in this call and its own text (as `GroupDrafter`, whose bank
it keeps), then the recent responses of other prompts. On a tree the drafts are the trie of
those continuations: each node's children are the distinct next tokens, the best supported
first (`group.trie_draft`), so where earlier answers part ways the tree drafts several of
them (SRT's tree). Deterministic drafts, verified by matching: lossless whatever the bank
holds, a stale or colliding slot only drafts worse.

Shape letters: see `specjax` (B rows in the current bucket, B0 rows of the call, G group size,
L sequence buffer); S bank slots (prompts), R responses per prompt, Q recent responses,
W response width of the bank; k draft tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.checks import is_int
from specjax.decoding.drafters.base import DraftContext, Drafter, Proposal
from specjax.decoding.drafters.fallback import FallbackDrafter
from specjax.decoding.drafters.group import (GroupDrafter, GroupState, group_candidates,
                                             suffix_match)
from specjax.decoding.sampling import SamplingConfig
from specjax.decoding.tree import DraftTree
from specjax.errors import ConfigError

_MULTIPLIER = 0x01000193  # FNV's prime: an odd multiplier spreads token ids over 32 bits


def prompt_keys(tokens: jax.Array, lengths: jax.Array) -> jax.Array:
  """`[B]` uint32 keys of the prompts `tokens[b, :lengths[b]]` (`tokens [B, P]`), never 0.

  A polynomial hash over the valid tokens (arithmetic mod 2^32), then mixed with the length:
  the same prompt gives the same key in any buffer width (padding never enters it).
  """
  p = tokens.shape[1]
  powers = np.ones((p,), np.uint64)
  for i in range(1, p):
    powers[i] = (int(powers[i - 1]) * _MULTIPLIER) % (1 << 32)
  valid = jnp.arange(p)[None, :] < lengths[:, None]
  terms = (tokens.astype(jnp.uint32) + jnp.uint32(1)) * jnp.asarray(powers, jnp.uint32)[None]
  h = jnp.sum(jnp.where(valid, terms, jnp.uint32(0)), axis=1, dtype=jnp.uint32)
  h = h ^ (lengths.astype(jnp.uint32) * jnp.uint32(0x9E3779B1))
  for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):  # murmur3's finaliser
    h = (h ^ (h >> shift)) * jnp.uint32(mult)
  h = h ^ (h >> 16)
  return jnp.where(h == 0, jnp.uint32(1), h)


def _fit(responses: jax.Array, width: int) -> jax.Array:
  """`responses [..., T]` cut or zero-padded to `[..., width]`."""
  t = responses.shape[-1]
  if t >= width:
    return responses[..., :width]
  return jnp.pad(responses, [(0, 0)] * (responses.ndim - 1) + [(0, width - t)])


@struct.dataclass
class HistoryBank:
  """Earlier responses, per prompt and overall, at static shapes.

  Attributes:
    keys: `[S]` uint32 the prompt key (`prompt_keys`) each slot holds responses of; 0: empty.
    tokens: `[S, R, W]` the slot's R latest responses (ring order, `head` next).
    lengths: `[S, R]` their lengths (0: no response there).
    head: `[S]` int32 where the slot's next response goes.
    recent: `[Q, W]` the Q latest responses to any prompt (ring order), `recent_len [Q]`
      their lengths, `recent_head` (a scalar) where the next goes.
  """

  keys: jax.Array
  tokens: jax.Array
  lengths: jax.Array
  head: jax.Array
  recent: jax.Array
  recent_len: jax.Array
  recent_head: jax.Array

  @classmethod
  def create(cls, slots: int, per_prompt: int, recent: int, width: int) -> HistoryBank:
    """An empty bank of `slots` prompts x `per_prompt` responses, `recent` recent ones, each
    at most `width` tokens (longer responses are kept cut)."""
    for name, value, low in (("slots", slots, 1), ("per_prompt", per_prompt, 1),
                             ("recent", recent, 0), ("width", width, 1)):
      if not (is_int(value) and value >= low):
        raise ConfigError(f"HistoryBank {name}={value!r} is invalid: must be an int >= {low}")
    return cls(keys=jnp.zeros((slots,), jnp.uint32),
               tokens=jnp.zeros((slots, per_prompt, width), jnp.int32),
               lengths=jnp.zeros((slots, per_prompt), jnp.int32),
               head=jnp.zeros((slots,), jnp.int32),
               recent=jnp.zeros((recent, width), jnp.int32),
               recent_len=jnp.zeros((recent,), jnp.int32),
               recent_head=jnp.zeros((), jnp.int32))

  @property
  def width(self) -> int:
    return self.tokens.shape[2]

  def nbytes(self) -> int:
    """Bytes the bank holds on device."""
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(self))

  def slot_of(self, keys: jax.Array) -> jax.Array:
    """`[...]` int32 the slot of each prompt key."""
    return (keys % jnp.uint32(self.keys.shape[0])).astype(jnp.int32)

  def record(self, prompts: jax.Array, prompt_lengths: jax.Array, responses: jax.Array,
             lengths: jax.Array, group_size: int) -> HistoryBank:
    """The bank after a rollout of `prompts [B / G, P]` (`prompt_lengths [B / G]`) answered by
    `responses [B, T]` (`lengths [B]`, prompt-major: rows i * G .. i * G + G - 1 answer
    prompt i).

    Each prompt's slot takes its first min(G, R) responses, evicting the oldest; a slot that
    held another prompt is emptied first. The recent store takes the first response of the
    last min(B / G, Q) prompts. Two prompts of one batch on one slot leave one of them there.
    """
    s, r, w = self.tokens.shape
    n = prompts.shape[0]
    keys = prompt_keys(prompts, prompt_lengths)
    slot = self.slot_of(keys)
    m = min(group_size, r)
    grouped = _fit(responses.reshape(n, group_size, -1), w)[:, :m]  # [n, m, W]
    grouped_len = jnp.minimum(lengths.reshape(n, group_size)[:, :m], w).astype(jnp.int32)
    same = self.keys[slot] == keys
    head = jnp.where(same, self.head[slot], 0)
    kept = self.lengths.at[slot].set(jnp.where(same[:, None], self.lengths[slot], 0))
    cols = (head[:, None] + jnp.arange(m)[None, :]) % r
    bank = self.replace(keys=self.keys.at[slot].set(keys),
                        tokens=self.tokens.at[slot[:, None], cols].set(grouped),
                        lengths=kept.at[slot[:, None], cols].set(grouped_len),
                        head=self.head.at[slot].set((head + m) % r))
    q = self.recent.shape[0]
    take = min(n, q)
    if not take:
      return bank
    where = (self.recent_head + jnp.arange(take)) % q
    return bank.replace(recent=self.recent.at[where].set(grouped[n - take:, 0]),
                        recent_len=self.recent_len.at[where].set(grouped_len[n - take:, 0]),
                        recent_head=(self.recent_head + take) % q)


@struct.dataclass
class HistoryState:
  """Attributes:
    group: the call's own texts (`GroupDrafter`'s bank: siblings and the row itself).
    history: `[B0, R, L]` each call row's prompt followed by one of its prompt's earlier
      responses, `history_len [B0, R]` their lengths (0: none).
    recent: `[Q, L]` recent responses to any prompt, `recent_len [Q]`.
  """

  UNBATCHED: ClassVar[tuple[str, ...]] = ("history", "history_len", "recent", "recent_len")

  group: GroupState
  history: jax.Array
  history_len: jax.Array
  recent: jax.Array
  recent_len: jax.Array


# Tie-breaks among equally long matches (`suffix_match`'s priority), best first.
_SAME_PROMPT, _SIBLING, _OWN, _RECENT = 3, 2, 1, 0


@dataclasses.dataclass(frozen=True)
class HistoryDrafter(GroupDrafter):
  """Drafts from its prompt's earlier responses, its group and recent responses (module
  docstring); `drafter_params` is the `HistoryBank` (None: an empty one).

  Attributes:
    group_size, max_ngram, min_ngram: as `GroupDrafter`.
    slots, per_prompt, recent: the bank a run keeps (`new_bank`): prompts, responses per
      prompt, recent responses of any prompt.
    vote: among equally long matches, draft the continuation most candidates agree on
      (`suffix_match`); False: the highest-priority, best-aligned one.
  """

  max_ngram: int = 8
  min_ngram: int = 2
  slots: int = 4096
  per_prompt: int = 8
  recent: int = 8
  vote: bool = True

  def __post_init__(self):
    super().__post_init__()
    for name, low in (("slots", 1), ("per_prompt", 1), ("recent", 0)):
      value = getattr(self, name)
      if not (is_int(value) and value >= low):
        raise ConfigError(f"HistoryDrafter({name}={value!r}) is invalid: must be an int >= "
                          f"{low}")

  def new_bank(self, width: int) -> HistoryBank:
    """An empty bank of this drafter's sizes for responses of up to `width` tokens."""
    return HistoryBank.create(self.slots, self.per_prompt, self.recent, width)

  def bank_bytes(self, width: int) -> int:
    """Bytes `new_bank(width)` takes on a device, without building it."""
    per_slot = 4 + self.per_prompt * (width + 1) * 4 + 4  # key, answers and lengths, head
    return self.slots * per_slot + self.recent * (width + 1) * 4 + 4

  def check_params(self, drafter_params: Any) -> None:
    if drafter_params is not None and not isinstance(drafter_params, HistoryBank):
      raise ConfigError(f"HistoryDrafter drafts from earlier responses: pass "
                        f"drafter_params=<a HistoryBank> (HistoryDrafter.new_bank(width), "
                        f"filled by HistoryBank.record; a GRPO run keeps one in its train "
                        f"state) or None (no earlier responses), not "
                        f"{type(drafter_params).__name__}")

  def init(self, params, config, drafter_params, ctx: DraftContext, tree, max_len, prompt, *,
           plain_rounds=False) -> HistoryState:
    self.check_params(drafter_params)
    b, l = ctx.seq.shape
    # None: nothing answered before (a held-out probe, a calibration); the group drafts alone.
    bank: HistoryBank = (self.new_bank(max(l - prompt.hidden.shape[1], 1))
                         if drafter_params is None else drafter_params)
    prompt_len = ctx.seq_len - 1  # the sequence is the prompt and the first token
    keys = prompt_keys(ctx.seq, prompt_len)
    slot = bank.slot_of(keys)
    known = (bank.keys[slot] == keys)[:, None]  # [B0, 1]
    q = jnp.arange(l)[None, None, :]
    at = q - prompt_len[:, None, None]  # the response position of each column
    earlier = bank.tokens[slot]  # [B0, R, W]
    picked = jnp.take_along_axis(earlier, jnp.clip(at, 0, bank.width - 1), axis=2)
    history = jnp.where(at < 0, ctx.seq[:, None, :], picked)
    history_len = jnp.where(known & (bank.lengths[slot] > 0),
                            jnp.minimum(prompt_len[:, None] + bank.lengths[slot], l), 0)
    group = GroupDrafter.init(self, params, config, drafter_params, ctx, tree, max_len, prompt)
    return HistoryState(group=group, history=history, history_len=history_len,
                        recent=_fit(bank.recent, l), recent_len=jnp.minimum(bank.recent_len, l))

  def propose(self, params, config, state: HistoryState, ctx: DraftContext, tree: DraftTree,
              sampling: SamplingConfig, key: jax.Array) -> tuple[Proposal, HistoryState]:
    group = state.group
    group = group.replace(bank=group.bank.at[group.rows].set(ctx.seq),
                          bank_len=group.bank_len.at[group.rows].set(ctx.seq_len))
    b = ctx.seq.shape[0]
    siblings, siblings_len, own = group_candidates(group.bank, group.bank_len, group.rows,
                                                   self.group_size)
    history, history_len = state.history[group.rows], state.history_len[group.rows]
    r, c = history.shape[1], state.recent.shape[0]
    cand = jnp.concatenate([history, siblings,
                            jnp.broadcast_to(state.recent, (b,) + state.recent.shape)], axis=1)
    cand_len = jnp.concatenate([history_len, siblings_len,
                                jnp.broadcast_to(state.recent_len, (b, c))], axis=1)
    is_own = jnp.concatenate([jnp.zeros((b, r), bool), own, jnp.zeros((b, c), bool)], axis=1)
    priority = jnp.concatenate([jnp.full((b, r), _SAME_PROMPT),
                                jnp.where(own, _OWN, _SIBLING),
                                jnp.full((b, c), _RECENT)], axis=1)
    tokens, drafted = suffix_match(cand, cand_len, is_own, priority, ctx.seq, ctx.seq_len,
                                   self.max_ngram, tree, min_n=self.min_ngram, vote=self.vote)
    return (Proposal(tokens=jnp.where(drafted, tokens, ctx.root[:, None]), drafted=drafted),
            state.replace(group=group))


def with_bank_sizes(drafter: Drafter | None, **sizes: int) -> Drafter | None:
  """`drafter` with every `HistoryDrafter` in it (itself, or a `FallbackDrafter`'s) keeping a
  bank of `sizes` (`slots`, `per_prompt`, `recent`)."""
  if isinstance(drafter, HistoryDrafter):
    return dataclasses.replace(drafter, **sizes)
  if isinstance(drafter, FallbackDrafter):
    return dataclasses.replace(drafter, primary=with_bank_sizes(drafter.primary, **sizes),
                               fallback=with_bank_sizes(drafter.fallback, **sizes))
  return drafter


def history_drafter(drafter: Drafter | None) -> HistoryDrafter | None:
  """The `HistoryDrafter` in `drafter` (itself, or a `FallbackDrafter`'s part), if any."""
  if isinstance(drafter, HistoryDrafter):
    return drafter
  if isinstance(drafter, FallbackDrafter):
    return history_drafter(drafter.primary) or history_drafter(drafter.fallback)
  return None
