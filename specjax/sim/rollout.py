"""The rollout phase of an RL step: prefill, then decoding rounds while the live batch shrinks.

The simulation is deterministic and fluid: every live row emits the entry's expected tokens E
per round, so after rounds emitting g tokens per row the live rows are those whose response
is longer than g, and each of them holds prompt_len + g tokens of context. Round r of an
entry therefore costs `cost.round_time(entry, live(g_r), prompt_len + g_r)`, and the rollout
ends when the longest row is done:

    rollout = prefill(b rows, prompt_len) + sum_r round(entry_r, live(g_r), P + g_r),
    g_{r+1} = g_r + E(entry_r)

Policies: "plain" (no drafter; E = 1, so a rollout of fixed length L is prefill + L rounds),
"fixed" (the chain of the full draft length every round) and "adaptive" (each round the menu
entry with the most expected tokens per second at that round's live batch and context,
plain decoding included, as `specjax.decoding.Adaptive` chooses; here the acceptance is
known, not estimated). Plain rounds of an adaptive rollout pay no drafting: the drafter's
catch-up is folded into the next speculative round's first depth.

Not modelled: the spread of accepted tokens across rows (a row that accepts less than E
rounds more often: speculation's stragglers), continuous batching of more rows than fit,
and preemption.

Shape letters: see `specjax` (B rows); R is the number of rounds, I of menu entries.
"""

from __future__ import annotations

import dataclasses

import numpy as np

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
    prefill, verify, draft, overhead: its parts (verify: the target's forwards in rounds).
    replica: devices per replica; replicas: how many.
    rows: rows of replica 0; tokens: response tokens of all rows; replica_tokens: of its rows.
    entries: names of the menu entries `entry` indexes.
    live: `[R]` live rows in each round.
    entry: `[R]` the entry each round ran.
    round_seconds: `[R]` seconds of each round.
    progress: `[R]` tokens each live row had emitted before the round.
  """

  policy: str
  drafter: bool
  seconds: float
  prefill: float
  verify: float
  draft: float
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

  @property
  def rounds(self) -> int:
    return int(self.live.size)

  @property
  def tokens_per_round(self) -> float:
    """Response tokens per row-round (the measured acceptance length; 1 for plain)."""
    return self.replica_tokens / max(float(self.live.sum()), 1.0)

  @property
  def tokens_per_second(self) -> float:
    return self.tokens / self.seconds

  def entry_share(self) -> dict[str, float]:
    """Share of rounds each entry ran."""
    counts = np.bincount(self.entry, minlength=len(self.entries)) / max(self.rounds, 1)
    return {name: float(c) for name, c in zip(self.entries, counts) if c > 0}


def _rounds_fixed(expected: float, longest: int) -> np.ndarray:
  """Progress before each round of an entry emitting `expected` tokens per round."""
  count = int(np.ceil(longest / expected - _EPS))
  return np.arange(count) * expected


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
  rows, longest = int(mine.size), int(mine[0])

  progress_grid = np.arange(longest)
  live_grid = rows - np.searchsorted(mine[::-1], progress_grid, side="right")  # rows with L > g
  context_grid = workload.prompt_len + progress_grid
  times = [round_time(model, profile, e, live_grid, context_grid,
                      drafter if e.depth else None, replica) for e in entries]
  cost = np.stack([t.total for t in times])  # [I, longest]
  expected = np.array([e.expected_tokens for e in entries])

  if len(entries) == 1:
    progress = _rounds_fixed(expected[0], longest)
    index = np.floor(progress + _EPS).astype(np.int64)
    choice = np.zeros(progress.size, np.int64)
  else:
    best = np.argmax(expected[:, None] / cost, axis=0)  # [longest]
    picks, marks = [], []
    g = 0.0
    while g < longest - _EPS:
      i = int(best[int(g + _EPS)])
      picks.append(i)
      marks.append(g)
      g += expected[i]
    choice, progress = np.array(picks, np.int64), np.array(marks)
    index = np.floor(progress + _EPS).astype(np.int64)

  round_seconds = cost[choice, index]
  parts = [np.stack([np.broadcast_to(getattr(t, part), (longest,)) for t in times])
           [choice, index].sum() for part in ("verify", "draft", "overhead")]
  prefill = prefill_seconds(model, profile, rows, workload.prompt_len, replica)
  if speculative and drafter is not None:
    prefill += prefill_seconds(drafter, profile, rows, workload.prompt_len, replica)
  return RolloutResult(
      policy=policy, drafter=speculative, seconds=float(prefill + round_seconds.sum()),
      prefill=float(prefill), verify=float(parts[0]), draft=float(parts[1]),
      overhead=float(parts[2]), replica=replica, replicas=replicas, rows=rows,
      tokens=int(lengths.sum()), replica_tokens=int(mine.sum()),
      entries=tuple(e.name for e in entries), live=live_grid[index], entry=choice,
      round_seconds=round_seconds, progress=progress)
