"""The rollout phase of an RL step: prefill, then decoding rounds while the live batch shrinks.

The simulation is deterministic. In the fluid model every live row emits the entry's expected
tokens E per round, so after rounds emitting g tokens per row the live rows are those whose
response is longer than g, and each of them holds prompt_len + g tokens of context. Round r
of an entry therefore costs `cost.round_time(entry, live(g_r), prompt_len + g_r)`, and the
rollout ends when the longest row is done:

    rollout = prefill(b rows, prompt_len) + sum_r round(entry_r, live(g_r), P + g_r),
    g_{r+1} = g_r + E(entry_r)

Stragglers: a speculative row's tokens per round vary (`MenuEntry.token_variance`), so rows of
one length finish in different rounds and the batch waits for its last row. The fluid
schedule's entries, then the tail's (the fixed entry; for the adaptive policy the entry with
the most tokens per second for one live row), are priced accordingly: after rounds
of mean tokens m_r and variance v_r in all (sums over the rounds so far), a row of length L
has emitted S_r ~ Normal(m_r, v_r) tokens, so it is still live with probability
p_r(L) = Phi((L - 1/2 - m_r) / sqrt(v_r)); the batch is still running with probability
q_r = 1 - prod_rows (1 - p_r(L)), and round r costs, in expectation,

    q_r * round(entry_r, sum_rows p_r(L) / q_r, P + m_r)

(the live rows given that the batch runs, at the mean context). Plain decoding (variance 0)
keeps the fluid model exactly. At thousands of tokens per row the correction is
small (the spread of S_r grows as sqrt(r)); at a hundred tokens and a few rows it adds 5-15%
more rounds, as the engine measures (`benchmarks/sim_validation.py`, spec).

Policies: "plain" (no drafter; E = 1, so a rollout of fixed length L is prefill + L rounds),
"fixed" (the chain of the full draft length every round) and "adaptive" (each round the menu
entry with the most expected tokens per second at that round's live batch and context,
plain decoding included, as `specjax.decoding.Adaptive` chooses; here the acceptance is
known, not estimated). Plain rounds of an adaptive rollout pay no drafting: the drafter's
catch-up is folded into the next speculative round's first depth.

The adaptive schedule is chosen on the fluid grid, each entry's tokens discounted for the
stragglers of the live rows (`Adaptive`'s straggler factor), without `Adaptive.cost_margin`
(a hedge against a measured cost table's error; these costs are the model's own). Not
modelled: rows whose acceptance differs systematically from the mean, continuous batching of
more rows than fit, and preemption.

Shape letters: see `specjax` (B rows); R is the number of rounds, I of menu entries.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specjax.stragglers import expected_normal_max, straggler_factor
from specjax.errors import ConfigError
from specjax.sim.cost import prefill_seconds, round_time
from specjax.sim.model import ModelSpec
from specjax.sim.parallel import Cluster, choose_replica
from specjax.sim.speculation import PLAIN, MenuEntry, Speculation
from specjax.sim.workload import Workload

POLICIES = ("plain", "fixed", "adaptive")
_EPS = 1e-9  # progress is a float sum of E's; a row of L tokens ends once g >= L - eps


@dataclasses.dataclass(frozen=True, eq=False)
class RolloutResult:
  """One simulated rollout (of replica 0, the one holding the longest row).

  Attributes:
    policy: "plain", "fixed" or "adaptive".
    drafter: whether the rollout ran with a drafter (False: plain, or adaptive without one).
    seconds: prefill + decoding rounds.
    prefill, verify, draft, sampling, overhead: its parts (verify: the target's forwards in
      rounds; sampling: the sampler's passes over the logits in rounds).
    replica: devices per replica; replicas: how many.
    rows: rows of replica 0; tokens: response tokens of all rows; replica_tokens: of its rows.
    entries: names of the menu entries `entry` indexes.
    live: `[R]` live rows in each round (expected, given that the round runs).
    entry: `[R]` the entry each round ran.
    round_seconds: `[R]` seconds of each round (expected: times the chance it runs).
    progress: `[R]` tokens each live row had emitted before the round (the mean).
    running: `[R]` the probability that the round runs (1 but in a straggler tail).
  """

  policy: str
  drafter: bool
  seconds: float
  prefill: float
  verify: float
  draft: float
  sampling: float
  overhead: float
  replica: int
  replicas: int
  rows: int
  tokens: int
  replica_tokens: int
  entries: tuple[str, ...]
  live: np.ndarray
  entry: np.ndarray
  round_seconds: np.ndarray
  progress: np.ndarray
  running: np.ndarray

  @property
  def rounds(self) -> int:
    """The expected number of rounds, rounded."""
    return int(round(float(self.running.sum())))

  @property
  def tokens_per_round(self) -> float:
    """Response tokens per row-round (the measured acceptance length; 1 for plain)."""
    return self.replica_tokens / max(float((self.live * self.running).sum()), 1.0)

  @property
  def tokens_per_second(self) -> float:
    return self.tokens / self.seconds

  def entry_share(self) -> dict[str, float]:
    """Share of rounds each entry ran."""
    counts = (np.bincount(self.entry, self.running, minlength=len(self.entries))
              / max(float(self.running.sum()), 1e-9))
    return {name: float(c) for name, c in zip(self.entries, counts) if c > 0}


def _rounds_fixed(expected: float, longest: int) -> np.ndarray:
  """Progress before each round of an entry emitting `expected` tokens per round."""
  count = int(np.ceil(longest / expected - _EPS))
  return np.arange(count) * expected


def _normal_cdf(z: np.ndarray) -> np.ndarray:
  """Phi(z), from erfc's Chebyshev fit (Numerical Recipes; relative error < 1.2e-7):
  NumPy has no erf, and the simulator does not depend on SciPy."""
  x = np.abs(z) / np.sqrt(2.0)
  t = 1.0 / (1.0 + 0.5 * x)
  poly = (-1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
      -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
          -0.82215223 + t * 0.17087277)))))))))
  tail = 0.5 * t * np.exp(-x * x + poly)  # P(Z > |z|)
  return np.where(z >= 0, 1.0 - tail, tail)


def _straggler_rounds(lengths: np.ndarray, entries: tuple[MenuEntry, ...], choice: np.ndarray,
                      tail_entry: int | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """(live rows given that the round runs, probability that it runs, mean progress, entry),
  `[R]` each, of rounds running `choice` (the fluid schedule's entries), then `tail_entry`
  (default: the last of them) for the straggler tail, over rows of `lengths` whose tokens
  per round vary (see the module docstring). Rounds run until the batch is done with
  probability 1 - 1e-9."""
  expected = np.array([e.expected_tokens for e in entries])
  variance = np.array([e.token_variance for e in entries])
  last = int(choice[-1] if tail_entry is None else tail_entry)
  mean, var = expected[choice], variance[choice]
  tail = int(np.ceil(9.0 * np.sqrt(var.sum()) / expected[last])) + 2
  choice = np.concatenate([choice, np.full(tail, last)])
  mean = np.concatenate([mean, np.full(tail, expected[last])])
  var = np.concatenate([var, np.full(tail, variance[last])])
  before = lambda x: np.concatenate([[0.0], np.cumsum(x)[:-1]])  # sums over earlier rounds
  progress, spread = before(mean), np.sqrt(np.maximum(before(var), 1e-30))
  live_each = _normal_cdf((lengths[None, :] - 0.5 - progress[:, None]) / spread[:, None])
  running = -np.expm1(np.log1p(-np.minimum(live_each, 1.0 - 1e-16)).sum(1))  # [R]
  running[0] = 1.0
  keep = running > 1e-9
  live = np.maximum(live_each.sum(1)[keep] / running[keep], 1.0)
  return live, running[keep], np.minimum(progress[keep], lengths[0]), choice[keep]


def simulate_rollout(model: ModelSpec, cluster: Cluster, workload: Workload,
                     speculation: Speculation | None = None, policy: str = "plain"
                     ) -> RolloutResult:
  """Simulate the rollout of `workload` on the cluster's rollout devices.

  An adaptive rollout that would not gain from its drafter runs without it, as
  `specjax.decoding.Adaptive.plain_throughout` decides: plain rounds and no drafter prefill
  (its result then has `drafter=False`).
  """
  if policy not in POLICIES:
    raise ConfigError(f"policy={policy!r} is unknown: allowed {', '.join(POLICIES)}")
  if policy != "plain" and speculation is None:
    raise ConfigError(f"policy={policy!r} needs a Speculation (drafter and acceptance)")
  if policy == "plain":
    return _simulate(model, cluster, workload, (PLAIN,), None, policy)
  drafter = speculation.drafter_spec(model)
  if policy == "fixed":
    return _simulate(model, cluster, workload, (speculation.fixed,), drafter, policy)
  with_drafter = _simulate(model, cluster, workload, speculation.menu, drafter, policy)
  alone = _simulate(model, cluster, workload, (PLAIN,), None, policy)
  return alone if alone.seconds < with_drafter.seconds else with_drafter


def _simulate(model: ModelSpec, cluster: Cluster, workload: Workload,
              entries: tuple[MenuEntry, ...], drafter: ModelSpec | None, policy: str
              ) -> RolloutResult:
  """The rollout choosing, each round, the entry of `entries` with the most expected tokens
  per second (the only one when there is one)."""
  profile = cluster.profile
  speculative = any(e.depth for e in entries)
  drafter = drafter if speculative else None
  lengths = workload.row_lengths()
  widest = max(e.verify_tokens for e in entries)
  replica = choose_replica(model, cluster, lengths, workload.prompt_len, widest, drafter)
  replicas = cluster.n_rollout // replica
  mine = lengths[::replicas]  # replica 0: the longest row and every replicas-th after it
  rows = int(mine.size)

  live, choice, progress, round_seconds, totals = _fluid_rounds(
      model, profile, workload, entries, drafter, replica, mine)
  running = np.ones(live.size)
  if any(entries[i].token_variance > 0 for i in np.unique(choice)):
    # The same schedule of entries, priced with stragglers: more rounds, each over the live
    # rows expected when it runs.
    # The straggler tail: the rows the mean has left behind are few, and the adaptive policy
    # re-decides every round on the rows still live, so the tail runs the entry with the
    # most tokens per second for one live row, not the fluid schedule's last pick.
    tail_entry = None
    if len(entries) > 1:
      one = [round_time(model, profile, e, np.array([1]),
                        np.array([workload.prompt_len + int(mine[0])]),
                        drafter if e.depth else None, replica, workload.greedy).total[0]
             for e in entries]
      tail_entry = int(np.argmax([e.expected_tokens / t for e, t in zip(entries, one)]))
    live, running, progress, choice = _straggler_rounds(mine, entries, choice, tail_entry)
    round_seconds, totals = np.zeros(live.size), [0.0] * 4
    for i in np.unique(choice):
      at = choice == i
      t = round_time(model, profile, entries[i], live[at], workload.prompt_len + progress[at],
                     drafter if entries[i].depth else None, replica, workload.greedy)
      round_seconds[at] = t.total * running[at]
      for k, part in enumerate(("verify", "draft", "sampling", "overhead")):
        totals[k] += float((np.broadcast_to(getattr(t, part), live[at].shape)
                            * running[at]).sum())
  prefill = prefill_seconds(model, profile, rows, workload.prompt_len, replica, workload.greedy)
  if speculative and drafter is not None:
    # The drafter reads the prompt too; the first token is the target's to sample.
    prefill += prefill_seconds(drafter, profile, rows, workload.prompt_len, replica,
                               samples=False)
  return RolloutResult(
      policy=policy, drafter=speculative, seconds=float(prefill + round_seconds.sum()),
      prefill=float(prefill), verify=totals[0], draft=totals[1], sampling=totals[2],
      overhead=totals[3], replica=replica, replicas=replicas, rows=rows,
      tokens=int(lengths.sum()), replica_tokens=int(mine.sum()),
      entries=tuple(e.name for e in entries), live=live, entry=choice,
      round_seconds=round_seconds, progress=progress, running=running)


def _fluid_rounds(model: ModelSpec, profile, workload: Workload, entries: tuple[MenuEntry, ...],
                  drafter: ModelSpec | None, replica: int, mine: np.ndarray):
  """The fluid model's rounds over rows of `mine` (longest first): live rows, entry, progress
  and seconds `[R]` each, and the seconds of verify, draft, sampling and overhead."""
  rows, longest = int(mine.size), int(mine[0])
  progress_grid = np.arange(longest)
  live_grid = rows - np.searchsorted(mine[::-1], progress_grid, side="right")  # rows with L > g
  context_grid = workload.prompt_len + progress_grid
  times = [round_time(model, profile, e, live_grid, context_grid,
                      drafter if e.depth else None, replica, workload.greedy) for e in entries]
  cost = np.stack([t.total for t in times])  # [I, longest]
  expected = np.array([e.expected_tokens for e in entries])

  if len(entries) == 1:
    progress = _rounds_fixed(expected[0], longest)
    choice = np.zeros(progress.size, np.int64)
  else:
    # As `specjax.decoding.Adaptive` chooses: tokens per second of the batch's slowest row
    # (its stragglers), given the live rows and the most tokens one of them still needs.
    # That row is behind the mean by the spread of the rounds so far (z sigma for the live
    # rows; the engine reads its budget left, `DecodeLoop._progress`), so near the mean row's
    # end the slowest one still needs more than the mean does.
    variance = np.array([e.token_variance for e in entries])
    z = expected_normal_max(rows)
    picks, marks = [], []
    g, spread2 = 0.0, 0.0
    while g < longest - _EPS:
      k = int(g + _EPS)
      live = int(live_grid[k])
      remaining = min(float(longest), longest - g + float(z[live]) * np.sqrt(spread2))
      pace = straggler_factor(expected, variance, live, remaining, rows, np)
      i = int(np.argmax(expected * pace / cost[:, k]))
      picks.append(i)
      marks.append(g)
      g += expected[i]
      spread2 += variance[i]
    choice, progress = np.array(picks, np.int64), np.array(marks)
  index = np.floor(progress + _EPS).astype(np.int64)
  totals = [float(np.stack([np.broadcast_to(getattr(t, part), (longest,)) for t in times])
                  [choice, index].sum()) for part in ("verify", "draft", "sampling", "overhead")]
  return live_grid[index], choice, progress, cost[choice, index], totals
