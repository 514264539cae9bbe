"""The reference system's published step table, reproduced; and its 235B projection, redone.

The reference system (NeMo RL + vLLM, EAGLE-3 drafter, synchronous GRPO on 32 GB200,
Qwen3-8B, k = 3 draft tokens) published, per workload (seconds):

  workload   acceptance   generation plain -> spec   overall step plain -> spec
  RL-Zero    3.32         100.0 -> 56.6              151.2 -> 107.5
  RL-Think   2.77         133.6 -> 87.0              185.3 -> 137.4

and, from its own simulator, "up to 2.5x end-to-end" for Qwen3-235B-A22B on 2048 GB200 with
asynchronous RL (policy lag 2), k = 5 and acceptance length 4.

What `reproduce_table` assumes, as `ReferenceSetup` fields (the table gives none of them):
the DAPO recipe's batch (512 prompts x 16 responses; NeMo RL's `dapo-qwen2.5-7b` recipe) with
256-token prompts, responses capped at 16,384 new tokens, lognormal lengths of log-space
spread 0.8, data and prepare stages of 0 s, and the GB200 spec-sheet profile
(`specjax.sim.devices`). The response lengths' median is not published here either: it is
**inferred** per workload, the median whose simulated plain generation equals the table's
(an input the table implies, not an efficiency factor). Then exactly **one efficiency factor
is fitted**: `spec_round_overhead_s`, the fixed cost of a speculative round, to RL-Zero's
speculative generation. Every other number of the table is a prediction.

`project_235b` runs the 235B case with that fitted profile and prints its speedup next to the
reference's claim, with the assumptions it turns on (rows per rollout replica, the split of
devices between rollout and training) varied around the defaults.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from specjax.errors import ConfigError
from specjax.sim.devices import parse_devices
from specjax.sim.hardware import DeviceProfile
from specjax.sim.parallel import Cluster
from specjax.sim.presets import model_spec
from specjax.sim.rollout import simulate_rollout
from specjax.sim.speculation import Speculation
from specjax.sim.step import Schedule, StepBreakdown, simulate_step
from specjax.sim.workload import Lognormal, Workload

TOLERANCE = 0.15  # issue 12: every stage within +-15% after one fitted factor
CLAIM_235B = 2.5  # the reference's "up to 2.5x end-to-end" at 235B


@dataclasses.dataclass(frozen=True)
class ReferenceWorkload:
  """One published workload: its acceptance length and measured seconds."""

  name: str
  acceptance: float
  plain_generation: float
  spec_generation: float
  plain_overall: float
  spec_overall: float


REFERENCE_WORKLOADS = (ReferenceWorkload("RL-Zero", 3.32, 100.0, 56.6, 151.2, 107.5),
                       ReferenceWorkload("RL-Think", 2.77, 133.6, 87.0, 185.3, 137.4))


@dataclasses.dataclass(frozen=True)
class ReferenceSetup:
  """What the reproduction assumes (see the module docstring for where each comes from)."""

  model: str = "qwen3-8b"
  devices: str = "32xGB200"
  drafter: str = "eagle3"
  draft_length: int = 3
  prompts: int = 512
  group_size: int = 16
  prompt_len: int = 256
  sigma: float = 0.8
  max_tokens: int = 16384
  fitted: str = "spec_round_overhead_s"

  def workload(self, median: float) -> Workload:
    return Workload(self.prompts, self.group_size, self.prompt_len,
                    Lognormal(median, self.sigma, self.max_tokens))


@dataclasses.dataclass(frozen=True)
class TableRow:
  """One simulated workload of the table: the inferred median and both steps."""

  workload: ReferenceWorkload
  median: float
  plain: StepBreakdown
  spec: StepBreakdown

  def errors(self) -> dict[str, tuple[float, float]]:
    """(reference, simulated) seconds per published number."""
    w = self.workload
    return {"generation plain": (w.plain_generation, self.plain.generation),
            "generation spec": (w.spec_generation, self.spec.generation),
            "overall plain": (w.plain_overall, self.plain.overall),
            "overall spec": (w.spec_overall, self.spec.overall)}


@dataclasses.dataclass(frozen=True)
class Reproduction:
  """The table as simulated: the fitted profile and one `TableRow` per workload."""

  setup: ReferenceSetup
  spec_sheet: DeviceProfile
  profile: DeviceProfile
  rows: tuple[TableRow, ...]

  @property
  def worst_error(self) -> float:
    return max(abs(sim / ref - 1) for row in self.rows for ref, sim in row.errors().values())


def _solve(f: Callable[[float], float], target: float, lo: float, hi: float) -> float:
  """x in [lo, hi] with f(x) = target for an increasing f (geometric bisection)."""
  for _ in range(40):
    mid = (lo * hi) ** 0.5
    lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
  return (lo * hi) ** 0.5


def _speculation(setup: ReferenceSetup, acceptance: float) -> Speculation:
  return Speculation.chain(setup.drafter, setup.draft_length, acceptance=acceptance)


def reproduce_table(setup: ReferenceSetup = ReferenceSetup()) -> Reproduction:
  """Infer each workload's median response length from its plain generation, fit
  `setup.fitted` to RL-Zero's speculative generation, and simulate both workloads."""
  model, (spec_sheet, count) = model_spec(setup.model), parse_devices(setup.devices)
  cluster = lambda profile: Cluster(profile, count)
  # Plain rounds pay no speculative overhead, so the medians do not depend on the fit.
  medians = [_solve(lambda m: simulate_rollout(model, cluster(spec_sheet),
                                               setup.workload(m)).seconds,
                    w.plain_generation, 64.0, float(setup.max_tokens))
             for w in REFERENCE_WORKLOADS]
  first = REFERENCE_WORKLOADS[0]
  spec_time = lambda value: simulate_rollout(
      model, cluster(spec_sheet.replace(**{setup.fitted: value})), setup.workload(medians[0]),
      _speculation(setup, first.acceptance), "fixed").seconds
  profile = spec_sheet.replace(**{setup.fitted: _solve(spec_time, first.spec_generation,
                                                       1e-7, 1.0)})
  rows = []
  for w, median in zip(REFERENCE_WORKLOADS, medians):
    workload, speculation = setup.workload(median), _speculation(setup, w.acceptance)
    rows.append(TableRow(
        w, median, simulate_step(model, cluster(profile), workload, None, "plain"),
        simulate_step(model, cluster(profile), workload, speculation, "fixed")))
  return Reproduction(setup, spec_sheet, profile, tuple(rows))


def format_reproduction(r: Reproduction) -> str:
  """The table: reference vs simulated per published number, and what was fitted."""
  s = r.setup
  fitted, nominal = getattr(r.profile, s.fitted), getattr(r.spec_sheet, s.fitted)
  lines = [
      f"reference step table: {s.model}, {s.devices} colocated, sync, {s.drafter} k="
      f"{s.draft_length}; assumed {s.prompts} prompts x G {s.group_size}, prompt "
      f"{s.prompt_len}, lognormal responses (sigma {s.sigma}, max {s.max_tokens}), data and "
      f"prepare 0 s",
      f"fitted (one efficiency factor): {s.fitted} = {1e3 * fitted:.2f} ms (spec sheet "
      f"{1e3 * nominal:.2f} ms), to {REFERENCE_WORKLOADS[0].name}'s speculative generation",
      f"{'workload':<9} {'acc':>5} {'median*':>8} {'stage':<17} {'reference s':>11} "
      f"{'simulated s':>11} {'error':>7}"]
  for row in r.rows:
    for i, (stage, (ref, simulated)) in enumerate(row.errors().items()):
      head = (f"{row.workload.name:<9} {row.workload.acceptance:5.2f} {row.median:8.0f}" if i == 0
              else " " * 24)
      lines.append(f"{head} {stage:<17} {ref:11.1f} {simulated:11.1f} "
                   f"{100 * (simulated / ref - 1):+6.1f}%")
  verdict = "within" if r.worst_error <= TOLERANCE else "NOT within"
  lines.append(f"* median response length inferred from the workload's plain generation "
               f"(an input the table implies). Worst error {100 * r.worst_error:.1f}%: "
               f"{verdict} +-{100 * TOLERANCE:.0f}%; RL-Zero's plain and speculative generation "
               f"and RL-Think's plain generation are matched by construction")
  return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Projection:
  """One 235B case: the plain sync colocated baseline and the async speculative step."""

  prompts: int
  rollout_devices: int
  train_devices: int
  baseline: StepBreakdown
  spec: StepBreakdown

  @property
  def speedup(self) -> float:
    return self.baseline.overall / self.spec.overall


def project_235b(profile: DeviceProfile, median: float, prompts: int = 2048,
                 rollout_devices: int = 1024, train_devices: int = 1024,
                 setup: ReferenceSetup = ReferenceSetup()) -> Projection:
  """Qwen3-235B-A22B on 2048 devices of `profile`: plain, sync and colocated (the baseline)
  vs EAGLE-3 with k = 5 at acceptance 4, async with policy lag 2 on split device sets."""
  model, devices = model_spec("qwen3-235b-a22b"), 2048
  workload = dataclasses.replace(setup, prompts=prompts).workload(median)
  baseline = simulate_step(model, Cluster(profile, devices), workload, None, "plain",
                           Schedule(), "plain sync colocated")
  split = Cluster(profile, devices, rollout_devices, train_devices)
  spec = simulate_step(model, split, workload, Speculation.chain(setup.drafter, 5, 4.0),
                       "fixed", Schedule(asynchronous=True, policy_lag=2), "spec async")
  return Projection(prompts, rollout_devices, train_devices, baseline, spec)


def format_projection(profile: DeviceProfile, median: float) -> str:
  """The default projection next to the reference's claim, and what moves it."""
  p = project_235b(profile, median)
  r, b = p.spec.rollout, p.baseline
  lines = [
      f"Qwen3-235B-A22B on 2048 GB200, {p.prompts} prompts x G 16 (assumed), responses as "
      f"RL-Zero's (median {median:.0f}), profile fitted above:",
      f"  baseline plain, sync, colocated: step {b.overall:.1f} s (generation "
      f"{b.generation:.1f}, log-prob {b.logprob:.1f}, training {b.training:.1f}, sync "
      f"{b.sync:.1f}); replicas of {b.rollout.replica} devices, {b.rollout.rows} rows each",
      f"  spec k=5, acceptance 4, async policy lag 2, {p.rollout_devices} rollout + "
      f"{p.train_devices} training devices: step {p.spec.overall:.1f} s (generation "
      f"{p.spec.generation:.1f} on replicas of {r.replica} with {r.rows} rows, training side "
      f"{p.spec.logprob + p.spec.training:.1f}, sync {p.spec.sync:.1f})",
      f"  end-to-end speedup: {p.speedup:.2f}x here vs the reference's ~{CLAIM_235B:.1f}x "
      f"(its simulator, unpublished inputs)",
      "  what drives the difference (speedup by rollout batch and device split):"]
  for prompts in (512, 2048, 8192):
    cells = []
    for rollout in (512, 1024, 1536):
      try:
        q = project_235b(profile, median, prompts, rollout, 2048 - rollout)
        cells.append(f"{rollout}/{2048 - rollout} {q.speedup:.2f}x")
      except ConfigError:  # the rollout's KV cache does not fit those devices
        cells.append(f"{rollout}/{2048 - rollout} does not fit")
    rows_per = prompts * 16 // (1024 // b.rollout.replica)
    lines.append(f"    {prompts:>5} prompts (~{rows_per} rows per replica): " + ", ".join(cells))
  lines.append(f"  With few rows per replica the fitted fixed cost of a speculative round "
               f"({1e3 * profile.spec_round_overhead_s:.1f} ms) weighs most against a short "
               "verify forward and the baseline has little training for async to hide; with "
               "many, the baseline's training grows (async hides it) while verification turns "
               "compute-bound. A larger rollout share shortens generation until training is the "
               "longer side. Not modelled: continuous batching, rows that accept less than the "
               "mean, MoE load imbalance, the reference's own batch and device split.")
  return "\n".join(lines)


def reference_report(setup: ReferenceSetup = ReferenceSetup()) -> str:
  """Both: the 8B table reproduced, then the 235B projection on its fitted profile."""
  reproduction = reproduce_table(setup)
  return (format_reproduction(reproduction) + "\n\n"
          + format_projection(reproduction.profile, reproduction.rows[0].median))
