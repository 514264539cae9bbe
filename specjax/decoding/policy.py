"""Speculation that pays: choose each round's draft tree from a menu, inside the compiled loop.

A round of entry i (a draft tree; the empty tree is plain decoding) costs `c_i` seconds at
the loop's batch size (measured: `specjax.decoding.calibrate`) and emits, per row, an
expected

    E_i = 1 + sum_{j=1..D_i} P(at least j drafts accepted) = 1 + sum_j prod_{d<j} a_{i,d}

tokens, where a_{i,d} is the probability that the path continues from depth d to depth
d + 1 given that it reached depth d. `Adaptive` picks argmax_i E_i / c_i every round: the
entry with the most expected tokens per second, plain decoding (E = 1) whenever nothing
beats it; the entry that ran the last round keeps running while it is within a small margin
of the best (hysteresis against switching on noise). A drafting entry's measured cost is
taken `cost_margin` higher (10%): a table measured on a busy machine errs low, and a tree
that pays only on paper must not run. The a_{i,d} are running estimates from
the rounds of this call (optionally carried over from earlier calls, e.g. across RL steps):
exponentially decayed counts per entry and depth, shrunk towards the estimate pooled over
all entries, which is itself shrunk towards a prior. The prior is optimistic on purpose: a
depth no entry has tried yet, or one whose evidence has decayed while plain rounds ran, gets
tried again.

Stragglers. A batch runs until its slowest row is done. Plain decoding advances every row by
one token a round; a speculative entry advances each by a random count of mean E_i and
variance V_i (from the same a_{i,d}), so rows that need n more tokens finish after about
n / E_i rounds give or take sqrt(n V_i / E_i^3) (a renewal process), and the last of L live
rows after n / E_i + z_L sqrt(n V_i / E_i^3), with z_L the expected maximum of L standard
normals (0 for one row; 1.77 for 16; 2.34 for 64). Per round, the batch therefore advances at
the rate of its slowest row, E_i / (1 + z_L sqrt(V_i / (n E_i))), and that is what the
policy weighs when the loop tells it the live rows and n, the most tokens one of them still
needs (about 10% below E_i for a three-draft chain at batch 16 and 96 new tokens, where
`benchmarks/spec_decode.py` measures a tail of 0.87; it fades as rows finish, so the tail
itself speculates more). n is the slowest row's need, not the live rows' mean: plain
decoding too takes n rounds, and once speculation has spread the rows apart the mean
understates n (with the mean, a draft model's chain4 at batch 16 fell to plain decoding
with 9 tokens to go on average, and ran 17 rounds of it). Not modelled: rows that stop at
an EOS before n.

Leaving the drafter out is a choice too. A plain round of a loop with a drafter still keeps
the drafter's state in step with the text (`CostTable.seconds[0]`); one without does not
(`CostTable.alone`). A call whose prior already says no tree pays runs without a drafter
from the start (`plain_throughout`); one whose evidence says so later switches the drafter
off (`Adaptive.off`) for the rest of the call, since its state is no longer kept.

Choosing a tree from earlier rounds' outcomes keeps decoding lossless: each round's tree is
fixed before its drafts and its verification draw, and verification is exact for any tree.

Shape letters: see `specjax` (B batch, D depth); I is the number of menu entries.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.checks import is_number
from specjax.decoding.tree import DraftTree
from specjax.errors import ConfigError
from specjax.stragglers import straggler_factor


@dataclasses.dataclass(frozen=True)
class CostTable:
  """Measured seconds per decoding round of each menu entry, at a few batch sizes.

  Attributes:
    batches: increasing batch sizes (rows in the compiled round) that were measured.
    seconds: `seconds[i][j]`, one round of menu entry i at `batches[j]` rows. The plain entry
      (i = 0) is a plain round of a loop that has a drafter: it keeps the drafter's state in
      step with the text (an MTP drafter's modules, a draft model's cache), which is not free.
    alone: `alone[j]`, one round of plain decoding with no drafter at all, at `batches[j]`
      rows: what a call that leaves speculation out pays per token. None: `seconds[0]`.
    setup: `setup[j]`, the seconds a drafter adds to a call's prefill (its state built from
      the prompt), at `batches[j]` rows. None: 0.
    switch: `switch[j]`, the seconds one change of tree costs at `batches[j]` rows: the
      compiled loop runs each tree's rounds as a segment inside `lax.switch`, and entering
      and leaving it copies the caches (calibrated at batch 16 on a 2-core CPU, for a draft
      model's menu: 2.2 ms, a ninth of a three-draft round). None: 0.
  """

  batches: tuple[int, ...]
  seconds: tuple[tuple[float, ...], ...]
  alone: tuple[float, ...] | None = None
  setup: tuple[float, ...] | None = None
  switch: tuple[float, ...] | None = None

  def __post_init__(self):
    def number(x, integral: bool) -> float:  # what float()/int() would silently change
      return (x if not integral or float(x).is_integer() else None) if is_number(x) else None

    raw_batches = tuple(self.batches) if isinstance(self.batches, (tuple, list)) else ()
    if not raw_batches or any(number(b, True) is None for b in raw_batches):
      raise ConfigError(f"CostTable.batches={self.batches!r} is invalid: must be increasing "
                        "batch sizes >= 1 (ints)")
    if not isinstance(self.seconds, (tuple, list)) or not all(
        isinstance(row, (tuple, list)) and all(number(x, False) is not None for x in row)
        for row in self.seconds):
      raise ConfigError(f"CostTable.seconds={self.seconds!r} is invalid: must be one row of "
                        "seconds (numbers) per menu entry")
    batches = tuple(int(b) for b in raw_batches)
    seconds = tuple(tuple(float(x) for x in row) for row in self.seconds)
    if not batches or list(batches) != sorted(set(batches)) or batches[0] < 1:
      raise ConfigError(f"CostTable.batches={self.batches!r} is invalid: must be increasing "
                        "batch sizes >= 1")
    if not seconds or any(len(row) != len(batches) for row in seconds):
      raise ConfigError(f"CostTable.seconds must hold one row per menu entry with one cost per "
                        f"batch size ({len(batches)}), got {self.seconds!r}")
    if not all(np.isfinite(x) and x > 0 for row in seconds for x in row):
      raise ConfigError(f"CostTable.seconds must be finite and > 0, got {self.seconds!r}")
    for name, least in (("alone", 0.0), ("setup", None), ("switch", None)):
      row = getattr(self, name)
      if row is None:
        continue
      if not isinstance(row, (tuple, list)) or any(number(x, False) is None for x in row):
        raise ConfigError(f"CostTable.{name}={row!r} is invalid: must be one number of "
                          "seconds per batch size")
      row = tuple(float(x) for x in row)
      if len(row) != len(batches) or not all(
          np.isfinite(x) and (x > 0 if least is not None else x >= 0) for x in row):
        raise ConfigError(f"CostTable.{name} must hold one finite "
                          f"{'positive' if least is not None else 'non-negative'} number of "
                          f"seconds per batch size ({len(batches)}), got {getattr(self, name)!r}")
      object.__setattr__(self, name, row)
    object.__setattr__(self, "batches", batches)
    object.__setattr__(self, "seconds", seconds)

  def _interp(self, row: Sequence[float], batch: int) -> float:
    """`row` (one number per measured batch size) at `batch` rows: linear in between the
    measured sizes; beyond them, the largest measured size scaled by rows."""
    if batch > self.batches[-1]:
      return float(row[-1]) * batch / self.batches[-1]
    return float(np.interp(batch, self.batches, row))

  def at(self, batch: int) -> np.ndarray:
    """`[I]` seconds per round of each entry at `batch` rows."""
    return np.array([self._interp(row, batch) for row in self.seconds])

  def alone_at(self, batch: int) -> float:
    """Seconds per round of plain decoding without a drafter at `batch` rows."""
    return self._interp(self.alone if self.alone is not None else self.seconds[0], batch)

  def setup_at(self, batch: int) -> float:
    """Seconds the drafter adds to the prefill at `batch` rows."""
    return self._interp(self.setup, batch) if self.setup is not None else 0.0

  def switch_at(self, batch: int) -> float:
    """Seconds one change of tree costs at `batch` rows."""
    return self._interp(self.switch, batch) if self.switch is not None else 0.0

  def format(self, menu: Sequence[DraftTree]) -> str:
    """The table as text: one line per entry, milliseconds per round at each batch size."""
    names = [describe(t) for t in menu]
    width = max(len(n) for n in names + ["entry"])
    rows = list(zip(names, self.seconds))
    if self.alone is not None:
      rows.append(("plain, no drafter", self.alone))
    if self.setup is not None:
      rows.append(("drafter prefill (once)", self.setup))
    if self.switch is not None:
      rows.append(("change of tree (each)", self.switch))
    width = max(width, *(len(n) for n, _ in rows))
    lines = [f"{'entry':<{width}} " + " ".join(f"{f'B={b}':>9}" for b in self.batches)]
    for name, row in rows:
      lines.append(f"{name:<{width}} " + " ".join(f"{1e3 * x:7.2f}ms" for x in row))
    return "\n".join(lines)


def describe(tree: DraftTree) -> str:
  """A short name for a tree: `plain`, `chain3`, or `tree(N=20,D=3)`."""
  if not tree.num_nodes:
    return "plain"
  if tree.is_chain():
    return f"chain{tree.depth}"
  return f"tree(N={tree.num_nodes},D={tree.depth})"


@struct.dataclass
class AcceptanceCounts:
  """Decayed row-round counts from which per-depth acceptance is estimated.

  Attributes:
    reached: `[I, D]` row-rounds of entry i whose path reached depth d (d drafts accepted)
      while the tree had a depth d + 1 to try.
    hits: `[I, D]` of those, the row-rounds that accepted the draft at depth d + 1 too.
    rounds: scalar int32, rounds observed (not decayed).
  """

  reached: jax.Array
  hits: jax.Array
  rounds: jax.Array

  @classmethod
  def zeros(cls, entries: int, depth: int) -> AcceptanceCounts:
    return cls(reached=jnp.zeros((entries, depth), jnp.float32),
               hits=jnp.zeros((entries, depth), jnp.float32), rounds=jnp.zeros((), jnp.int32))

  def normalized(self) -> AcceptanceCounts:
    """These counts in the dtypes the loop carries (float32 counts, an int32 round count), so
    integer counts or nested lists a caller wrote down serve as an earlier call's do; a
    `ConfigError` for counts that are not numbers or a round count that is not one integer."""
    rounds = self.rounds
    try:
      whole = np.shape(rounds) == () and jnp.issubdtype(jnp.result_type(rounds), jnp.integer)
      rounds = jnp.asarray(rounds, jnp.int32) if whole else None
    except (TypeError, ValueError, OverflowError):
      whole = False
    if not whole:
      raise ConfigError(f"acceptance.rounds={self.rounds!r} is invalid: must be one integer "
                        "within int32, the rounds observed (an earlier call's "
                        "stats.acceptance.rounds)")
    counts = {}
    for name in ("reached", "hits"):
      try:
        x = jnp.asarray(getattr(self, name))
      except (TypeError, ValueError, OverflowError) as err:
        raise ConfigError(f"acceptance.{name} is invalid: must be an array of counts ({err})"
                          ) from None
      if not jnp.issubdtype(x.dtype, jnp.number) or jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise ConfigError(f"acceptance.{name} is invalid: must hold real counts, not {x.dtype}")
      counts[name] = x.astype(jnp.float32)
    return self.replace(rounds=rounds, **counts)

  def check_values(self) -> None:
    """Raise a `ConfigError` if concrete counts cannot be counts (NaN, negative, or more hits
    than row-rounds that reached the depth): the policy would read them as evidence. Traced
    counts are not checked."""
    if any(isinstance(x, jax.core.Tracer) for x in (self.reached, self.hits, self.rounds)):
      return
    reached, hits, rounds = jax.device_get((self.reached, self.hits, self.rounds))  # one read
    for name, x in (("reached", np.asarray(reached)), ("hits", np.asarray(hits))):
      if not (np.all(np.isfinite(x)) and np.all(x >= 0)):
        raise ConfigError(f"acceptance.{name} holds {x[~(np.isfinite(x) & (x >= 0))][0]}: "
                          "counts must be finite and >= 0 (pass an earlier call's "
                          "stats.acceptance, or None to start from the prior)")
    if np.any(np.asarray(rounds) < 0):
      raise ConfigError(f"acceptance.rounds={rounds} is invalid: must be >= 0 (pass an "
                        "earlier call's stats.acceptance, or None)")
    if np.any(np.asarray(hits) > np.asarray(reached) * (1 + 1e-5) + 1e-6):
      raise ConfigError("acceptance.hits exceeds acceptance.reached: a depth cannot be "
                        "accepted in more row-rounds than reached it (pass an earlier call's "
                        "stats.acceptance, or None)")

  def scaled(self, weight: float) -> AcceptanceCounts:
    """The counts weighing `weight` times as much evidence (the round count unchanged)."""
    return self.replace(reached=weight * self.reached, hits=weight * self.hits)

  def observe(self, entry: int, tree_depth: int, accepted: jax.Array, active: jax.Array,
              decay: float) -> AcceptanceCounts:
    """Add one round of entry `entry` (a tree of depth `tree_depth`): `accepted [B]` drafts
    accepted per row, counted for `active [B]` rows; older counts decay by `decay`."""
    d = jnp.arange(self.reached.shape[1])[None, :]
    tried = (d < tree_depth) & active[:, None]
    reached = (tried & (accepted[:, None] >= d)).sum(0).astype(jnp.float32)
    hits = (tried & (accepted[:, None] > d)).sum(0).astype(jnp.float32)
    return AcceptanceCounts(reached=(decay * self.reached).at[entry].add(reached),
                            hits=(decay * self.hits).at[entry].add(hits), rounds=self.rounds + 1)


@dataclasses.dataclass(frozen=True)
class Adaptive:
  """Pick each round's draft tree from `menu` by expected tokens per second.

  A policy is a static argument of the compiled loop, compared by its fields: a subclass
  must keep any behaviour in its class (its methods), not in attributes set on an instance,
  or jit reuses one sibling's compiled loop for another.

  Attributes:
    menu: the trees to choose from; plain decoding (the empty tree) is always an entry and is
      put first when missing, so ties and a lack of evidence never cost a round.
    costs: seconds per round of each entry (`calibrate`, or a table of your own; one row per
      entry of the normalised `menu`). None: `generate` calibrates (cached on disk).
    prior: acceptance probability assumed at a depth with no evidence. Optimistic on purpose:
      an entry is tried as soon as it would pay at this acceptance, and tried again once the
      evidence against it has decayed (a round in every few dozen, when it does not pay).
    prior_rounds: weight of the prior, and of the pooled estimate in each entry's, in
      row-rounds.
    decay: factor applied to the counts every round that keeps the drafter, so that the
      estimates follow a drafter whose acceptance changes along the generation (1: never
      forget). Rounds with the drafter off leave them as they are.
    switch_margin: the entry that ran the last round runs again while its expected tokens per
      second are within this fraction of the best entry's (hysteresis): the estimates are
      noisy, and a switch driven by noise costs a worse round. (What the change itself
      costs, a pass over the caches, is weighed apart: `CostTable.switch`.)
    cost_margin: every drafting entry's measured cost is taken as this fraction higher, so
      that a tree must beat plain decoding by that much on paper before it runs: a measured
      table errs low on a busy machine (how 10% was chosen: docs/decoding.md). 0: trust
      the table.
    off_evidence: row-rounds that tried a first draft (decayed like the counts) before the
      policy may switch the drafter off. Off is for the rest of the call, so a few poor
      rounds must not decide it (docs/decoding.md); a plain round with the drafter lets the
      evidence decay and the tree be tried again.
  """

  menu: tuple[DraftTree, ...]
  costs: CostTable | None = None
  prior: float = 0.9
  prior_rounds: float = 2.0
  decay: float = 0.98
  switch_margin: float = 0.05
  cost_margin: float = 0.10
  off_evidence: float = 16.0

  def __post_init__(self):
    menu = tuple(self.menu) if isinstance(self.menu, (tuple, list)) else ()
    if not menu or not all(isinstance(t, DraftTree) for t in menu):
      raise ConfigError(f"Adaptive.menu={self.menu!r} is invalid: must be a non-empty sequence "
                        "of DraftTree (e.g. (DraftTree.chain(2), DraftTree.chain(4)))")
    if len(set(menu)) != len(menu):
      raise ConfigError(f"Adaptive.menu has a tree twice: {[describe(t) for t in menu]}")
    plain = DraftTree.empty()
    menu = (plain,) + tuple(t for t in menu if t != plain)
    object.__setattr__(self, "menu", menu)
    # (field, whether its value is allowed, what is allowed), each a number first: a string
    # or a bool would otherwise compare (or fail to) in ways that say nothing of the field.
    for name, ok, allowed in (
        ("prior", lambda x: 0.0 < x < 1.0, "a probability in (0, 1)"),
        ("prior_rounds", lambda x: x > 0.0, "a number of row-rounds > 0"),
        ("decay", lambda x: 0.0 < x <= 1.0, "a factor in (0, 1]"),
        ("switch_margin", lambda x: 0.0 <= x < 1.0, "a fraction in [0, 1)"),
        ("cost_margin", lambda x: 0.0 <= x < 10.0,
         "a fraction in [0, 10) (0: trust the measured costs)"),
        ("off_evidence", lambda x: x >= 0.0, "a number of row-rounds >= 0")):
      value = getattr(self, name)
      if not (is_number(value) and ok(value)):
        raise ConfigError(f"Adaptive.{name}={value!r} is invalid: must be {allowed}")
    if self.costs is not None and len(self.costs.seconds) != len(menu):
      raise ConfigError(
          f"Adaptive.costs has {len(self.costs.seconds)} rows for a menu of {len(menu)} "
          f"entries {[describe(t) for t in menu]} (plain decoding first): measure the costs "
          "with calibrate(...) for this menu")

  @classmethod
  def up_to(cls, tree: DraftTree, costs: CostTable | None = None) -> Adaptive:
    """The menu plain decoding, chains of 1 .. `tree.depth` drafts, and `tree` itself."""
    chains = tuple(DraftTree.chain(k) for k in range(1, tree.depth + 1))
    return cls(chains + ((tree,) if tree not in chains else ()), costs=costs)

  @property
  def depth(self) -> int:
    return max(t.depth for t in self.menu)

  def with_costs(self, costs: CostTable) -> Adaptive:
    return dataclasses.replace(self, costs=costs)

  def acceptance(self, counts: AcceptanceCounts) -> jax.Array:
    """`[I, D]` estimated probability of continuing from depth d to d + 1 with entry i."""
    s = self.prior_rounds
    pooled = (counts.hits.sum(0) + s * self.prior) / (counts.reached.sum(0) + s)  # [D]
    return (counts.hits + s * pooled[None, :]) / (counts.reached + s)

  def expected_tokens(self, counts: AcceptanceCounts) -> jax.Array:
    """`[I]` expected tokens a row emits in one round of each entry."""
    return self._moments(self.acceptance(counts), jnp)[0]

  def _moments(self, acceptance, xp):
    """(`[I]` mean, `[I]` variance) of the tokens a row emits in one round of each entry,
    from an `[I, D]` acceptance matrix, with `xp` = jnp or numpy (numpy where the answer
    must be known while the loop is traced): with K drafts accepted and r_j = P(K >= j),
    E K = sum_j r_j and E K^2 = sum_j (2 j - 1) r_j."""
    depths = np.array([t.depth for t in self.menu])
    d = np.arange(acceptance.shape[1])[None, :]
    reach = xp.where(d < depths[:, None], xp.cumprod(acceptance, axis=1), 0.0)  # r_{d+1}
    mean = reach.sum(1)
    return 1.0 + mean, xp.maximum((reach * (2 * d + 1)).sum(1) - mean * mean, 0.0)

  def token_variance(self, counts: AcceptanceCounts) -> jax.Array:
    """`[I]` variance of the tokens a row emits in one round of each entry."""
    return self._moments(self.acceptance(counts), jnp)[1]

  def plain_throughout(self, batches: Sequence[int], new_tokens: int | None = None) -> bool:
    """Whether a call that starts without evidence should leave the drafter out altogether.

    With no counts every acceptance estimate is the prior. A call that keeps a drafter pays
    its prefill (`CostTable.setup`) and, in plain rounds, keeping its state in step
    (`CostTable.seconds[0]`); a call without one pays plain decoding alone
    (`CostTable.alone`). So the drafter is left out when, for each of the loop's `batches`,
    no tree's expected seconds per token at the prior (its batch waiting for the slowest of
    its rows, to `new_tokens` each), plus the setup spread over `new_tokens` (None: neither
    counted), beat plain decoding's seconds per token alone.
    """
    self._check_costs()
    prior = np.full((len(self.menu), max(self.depth, 1)), self.prior, np.float32)
    mean, variance = self._moments(prior, np)
    for b in batches:
      setup = self.costs.setup_at(b) / new_tokens if new_tokens else 0.0
      pace = (straggler_factor(mean, variance, b, new_tokens, b, np) if new_tokens
              else 1.0)
      per_token = (self._seconds(b)[1:-1] / (mean * pace)[1:]).min(initial=np.inf) + setup
      if per_token < self.costs.alone_at(b):
        return False
    return True

  def _seconds(self, batch: int) -> np.ndarray:
    """`[I + 1]` seconds per round at `batch` rows that the choice weighs: each entry's
    measured cost, raised by `cost_margin` for the drafting entries, then drafter off's."""
    self._check_costs()
    seconds = np.append(self.costs.at(batch), self.costs.alone_at(batch))
    seconds[1:-1] *= 1.0 + self.cost_margin
    return seconds

  def _check_costs(self) -> None:
    if self.costs is None:
      raise ConfigError("Adaptive.costs is None: pass costs=calibrate(...) (generate does this "
                        "itself outside jit)")

  @property
  def off(self) -> int:
    """The index `choose` returns for *drafter off*: plain rounds that no longer keep the
    drafter's state in step, for the rest of the call (`CostTable.alone` each)."""
    return len(self.menu)

  def rates(self, counts: AcceptanceCounts, batch: int, live: jax.Array | None = None,
            remaining: jax.Array | None = None) -> jax.Array:
    """`[I + 1]` expected tokens per second of each entry at `batch` rows, then of drafter
    off (one token per plain round without the drafter). Given the `live` rows and the most
    tokens one of them still needs (`remaining`), a speculative entry's tokens are those of
    the batch's slowest row (`straggler_factor`). Drafter off's rate is 0 until the counts hold
    `off_evidence` row-rounds of first drafts."""
    seconds = self._seconds(batch)
    mean, variance = self._moments(self.acceptance(counts), jnp)
    if live is not None and remaining is not None:
      mean = mean * straggler_factor(mean, variance, live, remaining, batch, jnp)
    off = jnp.where(counts.reached[:, 0].sum() >= self.off_evidence, 1.0, 0.0)
    return (jnp.append(mean, off)
            / jnp.asarray(seconds, jnp.float32))  # off ties plain exactly without `alone`

  def choose(self, counts: AcceptanceCounts, batch: int, live: jax.Array | None = None,
             remaining: jax.Array | None = None) -> jax.Array:
    """The entry with the most expected tokens per second at `batch` rows (scalar int32), or
    `off` when plain decoding without the drafter beats every entry; on a tie the first
    (plain decoding with the drafter, whose evidence can still decay back to the prior).
    `live`, `remaining`: see `rates`."""
    return jnp.argmax(self.rates(counts, batch, live, remaining)).astype(jnp.int32)

  def keeps(self, entry: int, counts: AcceptanceCounts, batch: int,
            live: jax.Array | None = None, remaining: jax.Array | None = None) -> jax.Array:
    """Whether entry `entry`, which ran the last round, runs the next one too: while its
    rate is within `switch_margin` of the best, or while changing to the best would not
    save what the change costs (`CostTable.switch`) over the tokens the live rows still
    need (scalar bool). `live`, `remaining`: see `rates`."""
    rates = self.rates(counts, batch, live, remaining)
    best = rates.max()
    keep = rates[entry] >= (1.0 - self.switch_margin) * best
    if remaining is not None and self.costs.switch is not None:
      saved = remaining * (1.0 / rates[entry] - 1.0 / best)  # seconds, at the rates as now
      keep = keep | (saved < self.costs.switch_at(batch))
    return keep
