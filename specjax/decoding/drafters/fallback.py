"""Two drafters, row by row: a free one where it has a whole draft, a model where it has not.

`FallbackDrafter(primary, fallback)` asks both drafters every round; a row whose `primary`
proposal drafts the tree's main path (every node of a chain; in a tree, the first child at
every depth: the primary's best continuation) takes it, the other rows take `fallback`'s. Made for
group drafting (`GroupDrafter` as primary: long, exact drafts where a sibling has already
written the text) in front of a model drafter (MTP, EAGLE-3, a draft model: a guess at every
position). Both must draft deterministically (drafts verified by matching: a sampled draft's
distribution would have to be the one its tokens came from, row by row), and both keep their
state up to date every round: whichever drafted, the accepted path is the same text.

Each part gets its own `drafter_params`: pass `FallbackParams(primary=..., fallback=...)`
(a history bank in front of a draft model's weights), or one value, which goes to each part
that takes it (`check_params`) and None to the others (a draft model's weights behind group
drafts, which read none).

The engine counts a round as one proposal, whichever drafter made it; the drafter's own
counts (`stats`: the row-rounds each of the two drafted and the tokens those emitted) tell
which one pays, e.g. `group_rounds`, `group_tokens`, `mtp_rounds`, `mtp_tokens` for group
drafting in front of MTP (a GRPO run logs them as `acceptance_group`, `acceptance_mtp`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.decoding.drafters.base import Drafter, Proposal, take_rows
from specjax.decoding.sampling import SamplingConfig
from specjax.decoding.tree import DraftTree
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig


def main_path(tree: DraftTree) -> np.ndarray:
  """`[N]` whether each draft node is on the tree's main path: the first child of the root,
  its first child, and so on (a chain: every node)."""
  on = np.zeros(tree.num_nodes + 1, bool)
  on[0] = True
  seen = set()
  for node, parent in enumerate(tree.parents, start=1):
    on[node] = on[parent] and parent not in seen
    seen.add(parent)
  return on[1:]


@struct.dataclass
class FallbackState:
  """Attributes:
    primary: the primary drafter's state.
    fallback: the fallback drafter's state.
    primary_rows: `[B]` whether each row took the primary's draft in the last proposal.
    counts: `[2, 2]` int32 over the call so far: row-rounds the primary (row 0) and the
      fallback (row 1) drafted, and the tokens the target accepted in them (drafts + its own
      next token, before EOS or `max_new_tokens` cut a row's last round).
  """

  UNBATCHED: ClassVar[tuple[str, ...]] = ("counts",)

  primary: Any
  fallback: Any
  primary_rows: jax.Array
  counts: jax.Array


@struct.dataclass
class FallbackParams:
  """What each of a `FallbackDrafter`'s two drafters reads as its `drafter_params`."""

  primary: Any = None
  fallback: Any = None


def _taken(drafter: Drafter, drafter_params: Any) -> Any:
  """`drafter_params` where `drafter` takes them, else None (what it reads without)."""
  try:
    drafter.check_params(drafter_params)
  except ConfigError:
    return None
  return drafter_params


def part_name(drafter: Drafter) -> str:
  """How a drafter's counts are named: `GroupDrafter` "group", `MTPDrafter` "mtp"."""
  return type(drafter).__name__.removesuffix("Drafter").lower()


@dataclasses.dataclass(frozen=True)
class FallbackDrafter(Drafter):
  """`primary`'s draft for rows where it drafts the whole tree, else `fallback`'s (module
  docstring).

  Attributes:
    primary: a drafter that may leave nodes out (`Proposal.drafted`), e.g. `GroupDrafter`.
    fallback: a drafter that always drafts, e.g. `MTPDrafter()`.
  """

  primary: Drafter
  fallback: Drafter

  def __post_init__(self):
    for name in ("primary", "fallback"):
      if not isinstance(getattr(self, name), Drafter):
        raise ConfigError(f"FallbackDrafter({name}={getattr(self, name)!r}) is invalid: must be "
                          "a Drafter")
    for name in ("primary", "fallback"):
      if getattr(self, name).sampled:
        raise ConfigError(f"FallbackDrafter's {name} samples its drafts; both must draft "
                          "deterministically (their drafts are verified by matching)")

  def hidden_layers(self, config: ModelConfig) -> tuple[int, ...]:
    first, second = self.primary.hidden_layers(config), self.fallback.hidden_layers(config)
    if first and second:
      raise ConfigError("FallbackDrafter: only one of its drafters may read the target's "
                        f"hidden layers (the primary reads {first}, the fallback {second})")
    return first or second

  def validate(self, config: ModelConfig, tree: DraftTree) -> None:
    self.primary.validate(config, tree)
    self.fallback.validate(config, tree)

  def split_params(self, drafter_params: Any) -> tuple[Any, Any]:
    """The primary's and the fallback's `drafter_params` (module docstring)."""
    if isinstance(drafter_params, FallbackParams):
      return drafter_params.primary, drafter_params.fallback
    return _taken(self.primary, drafter_params), _taken(self.fallback, drafter_params)

  def check_params(self, drafter_params: Any) -> None:
    first, second = self.split_params(drafter_params)
    if (drafter_params is not None and not isinstance(drafter_params, FallbackParams)
        and first is None and second is None):
      raise ConfigError(f"FallbackDrafter: neither {type(self.primary).__name__} nor "
                        f"{type(self.fallback).__name__} drafts from drafter_params of type "
                        f"{type(drafter_params).__name__} (pass FallbackParams(primary=, "
                        "fallback=) to give each its own)")
    self.primary.check_params(first)
    self.fallback.check_params(second)

  def min_prompt_length(self, tree: DraftTree) -> int:
    return max(self.primary.min_prompt_length(tree), self.fallback.min_prompt_length(tree))

  def init(self, params, config, drafter_params, ctx, tree, max_len, prompt, *,
           plain_rounds=False) -> FallbackState:
    first, second = self.split_params(drafter_params)
    init = lambda d, p: d.init(params, config, p, ctx, tree, max_len, prompt,
                               plain_rounds=plain_rounds)
    return FallbackState(primary=init(self.primary, first),
                         fallback=init(self.fallback, second),
                         primary_rows=jnp.zeros(ctx.seq.shape[:1], bool),
                         counts=jnp.zeros((2, 2), jnp.int32))

  def propose(self, params, config, state: FallbackState, ctx, tree: DraftTree,
              sampling: SamplingConfig, key: jax.Array) -> tuple[Proposal, FallbackState]:
    k_primary, k_fallback = jax.random.split(key)
    first, primary = self.primary.propose(params, config, state.primary, ctx, tree, sampling,
                                          k_primary)
    second, fallback = self.fallback.propose(params, config, state.fallback, ctx, tree,
                                             sampling, k_fallback)
    b, n = first.tokens.shape
    drafted = (jnp.ones((b, n), bool) if first.drafted is None else first.drafted)
    use = drafted[:, main_path(tree)].all(axis=1)
    tokens = jnp.where(use[:, None], first.tokens, second.tokens)
    theirs = jnp.ones((b, n), bool) if second.drafted is None else second.drafted
    out = jnp.where(use[:, None], drafted, theirs)
    return (Proposal(tokens=tokens, drafted=out),
            state.replace(primary=primary, fallback=fallback, primary_rows=use))

  def update(self, params, config, state: FallbackState, result) -> FallbackState:
    counts = state.counts
    if result.path_tokens.shape[1] > 1:  # a drafting round (a plain one's path is its root)
      active = result.count > 0
      took = jnp.stack([state.primary_rows, ~state.primary_rows]) & active  # [2, B]
      counts = counts + jnp.stack([took.sum(1, dtype=jnp.int32),
                                   jnp.where(took, result.count, 0).sum(1, dtype=jnp.int32)], 1)
    return state.replace(primary=self.primary.update(params, config, state.primary, result),
                         fallback=self.fallback.update(params, config, state.fallback, result),
                         counts=counts)

  def take_rows(self, state: FallbackState, rows: jax.Array) -> FallbackState:
    return state.replace(primary=self.primary.take_rows(state.primary, rows),
                         fallback=self.fallback.take_rows(state.fallback, rows),
                         primary_rows=take_rows(state.primary_rows, rows))

  def part_names(self) -> tuple[str, str]:
    """The names of the two drafters' counts: their kinds ("group", "mtp"), or "primary" and
    "fallback" when the kinds are the same."""
    names = part_name(self.primary), part_name(self.fallback)
    return names if names[0] != names[1] and all(names) else ("primary", "fallback")

  def stats(self, state: FallbackState | None) -> dict[str, jax.Array]:
    counts = jnp.zeros((2, 2), jnp.int32) if state is None else state.counts
    return {f"{name}_{what}": counts[i, j] for i, name in enumerate(self.part_names())
            for j, what in enumerate(("rounds", "tokens"))}
