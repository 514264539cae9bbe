"""Grids of simulated speedups, and their heatmaps.

- draft length x acceptance: for draft lengths k and per-depth acceptance rates alpha (the
  chance each next draft is accepted; mean acceptance length (1 - alpha^(k+1)) / (1 - alpha)),
  the step (or generation) speedup of speculative over plain rollouts.
- devices x model: for device counts and models, the same speedup with one drafter quality;
  cells whose model does not fit are NaN (blank in the plot).
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Callable, Sequence

import numpy as np

from specjax.errors import ConfigError
from specjax.sim.model import ModelSpec
from specjax.sim.parallel import Cluster
from specjax.sim.speculation import Speculation
from specjax.sim.step import Schedule, simulate_step
from specjax.sim.workload import Workload

SWEEPS = ("draft-length-x-acceptance", "devices-x-model")
METRICS = ("overall", "generation")


@dataclasses.dataclass(frozen=True, eq=False)
class Heatmap:
  """`values[i, j]`: the speedup at y tick i and x tick j (NaN: not simulated)."""

  title: str
  xlabel: str
  ylabel: str
  xticks: tuple[str, ...]
  yticks: tuple[str, ...]
  values: np.ndarray

  def format(self) -> str:
    """The grid as a text table."""
    width = max(8, *(len(t) for t in self.yticks))
    lines = [f"{self.title}", f"{self.ylabel} \\ {self.xlabel}",
             " " * width + "".join(f"{t:>9}" for t in self.xticks)]
    for tick, row in zip(self.yticks, self.values):
      cells = "".join(f"{'-':>9}" if np.isnan(v) else f"{v:8.2f}x" for v in row)
      lines.append(f"{tick:<{width}}{cells}")
    return "\n".join(lines)


def _check_metric(metric: str) -> None:
  if metric not in METRICS:
    raise ConfigError(f"metric={metric!r} is unknown: allowed {', '.join(METRICS)}")


def sweep_draft_acceptance(model: ModelSpec, cluster: Cluster, workload: Workload,
                           drafter: str, draft_lengths: Sequence[int] = tuple(range(1, 9)),
                           rates: Sequence[float] = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95),
                           schedule: Schedule = Schedule(), policy: str = "fixed",
                           metric: str = "overall", **speculation_kwargs) -> Heatmap:
  """Speedup over plain rollouts for each (acceptance rate, draft length)."""
  _check_metric(metric)
  plain = getattr(simulate_step(model, cluster, workload, None, "plain", schedule), metric)
  values = np.full((len(rates), len(draft_lengths)), np.nan)
  for i, rate in enumerate(rates):
    for j, k in enumerate(draft_lengths):
      spec = Speculation.chain(drafter, k, per_depth=(rate,) * k, **speculation_kwargs)
      step = simulate_step(model, cluster, workload, spec, policy, schedule)
      values[i, j] = plain / getattr(step, metric)
  what = "step" if metric == "overall" else "generation"
  return Heatmap(
      title=f"{what} speedup, {policy} speculation ({drafter}): {model.name}, "
            f"{cluster.describe()}", xlabel="draft length k", ylabel="acceptance per depth",
      xticks=tuple(str(k) for k in draft_lengths), yticks=tuple(f"{r:g}" for r in rates),
      values=values)


def sweep_devices_models(models: Sequence[ModelSpec], device_counts: Sequence[int],
                         cluster_for: Callable[[int], Cluster], workload: Workload,
                         speculation_for: Callable[[ModelSpec], Speculation],
                         schedule: Schedule = Schedule(), policy: str = "fixed",
                         metric: str = "overall") -> Heatmap:
  """Speedup over plain rollouts for each (model, device count); NaN where it does not fit.
  `cluster_for(n)` builds the cluster of n devices, `speculation_for(model)` the drafter."""
  _check_metric(metric)
  values = np.full((len(models), len(device_counts)), np.nan)
  for i, model in enumerate(models):
    spec = speculation_for(model)
    for j, n in enumerate(device_counts):
      cluster = cluster_for(n)
      try:
        plain = simulate_step(model, cluster, workload, None, "plain", schedule)
        fast = simulate_step(model, cluster, workload, spec, policy, schedule)
      except ConfigError as error:
        if "does not fit" not in str(error):
          raise
        continue
      values[i, j] = getattr(plain, metric) / getattr(fast, metric)
  what = "step" if metric == "overall" else "generation"
  return Heatmap(
      title=f"{what} speedup, {policy} speculation: {cluster_for(device_counts[0]).profile.name}",
      xlabel="devices", ylabel="model", xticks=tuple(str(n) for n in device_counts),
      yticks=tuple(m.name for m in models), values=values)


def save_heatmap(heatmap: Heatmap, path) -> pathlib.Path:
  """Write the heatmap as a PNG (matplotlib, no display needed)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  v = heatmap.values
  fig, ax = plt.subplots(figsize=(1.0 + 0.8 * v.shape[1], 1.2 + 0.5 * v.shape[0]))
  image = ax.imshow(np.ma.masked_invalid(v), cmap="viridis", aspect="auto", origin="lower")
  ax.set_xticks(range(v.shape[1]), heatmap.xticks)
  ax.set_yticks(range(v.shape[0]), heatmap.yticks)
  ax.set_xlabel(heatmap.xlabel)
  ax.set_ylabel(heatmap.ylabel)
  ax.set_title(heatmap.title, fontsize=8)
  finite = v[np.isfinite(v)]
  middle = (finite.min() + finite.max()) / 2 if finite.size else 0.0
  for (i, j), value in np.ndenumerate(v):
    if np.isfinite(value):
      ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7,
              color="black" if value > middle else "white")
  fig.colorbar(image, ax=ax, label="speedup over plain")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path

