"""A GRPO run's metrics: how each step's figures are written (metrics.jsonl values,
TensorBoard sections) and what is read back from them after training (the summary's
per-drafter acceptance, `curves.png`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def is_part_acceptance(key: str) -> bool:
  """Whether a metric is one drafter part's acceptance (`rollouts.drafter_metrics`:
  `acceptance_group`, `acceptance_mtp`), not the rollout's own `acceptance_length`."""
  return key.startswith("acceptance_") and key != "acceptance_length"


def part_keys(history: list[dict]) -> list[str]:
  """The drafter parts' acceptance metrics logged anywhere in `history`, sorted."""
  return sorted({key for record in history for key in record if is_part_acceptance(key)})


# TensorBoard's sections: a metric goes under the first whose prefix or name it matches, else
# under train/. metrics.jsonl keeps the plain names.
_SECTIONS = (("arm/", ("arm_",)),
             ("reward/", ("reward_", "accuracy")),
             ("spec/", ("acceptance_", "accepted_per_depth", "plain_share", "drafted_by_")),
             ("rollout/", ("response_", "rollout_")),
             ("perf/", ("step_time_s", "perf_")))


def tensorboard_scalars(record: dict, learning_rate: float | None = None) -> dict[str, float]:
  """A metrics record as TensorBoard scalars, namespaced by what they measure (`reward/`,
  `spec/`, `rollout/`, `perf/`, `train/`; README's metrics glossary); a per-depth vector
  becomes one scalar per depth (`spec/accepted_per_depth/1`, ...)."""
  out = {}
  for key, value in record.items():
    if key in ("step", "position") or value is None:  # None: nothing measured this step
      continue
    section = next((name for name, starts in _SECTIONS
                    if any(key.startswith(s) for s in starts)), "train/")
    short = key.removeprefix(section.rstrip("/") + "_")  # reward/mean, not reward/reward_mean
    if np.ndim(value) == 0:
      out[section + short] = float(value)
    else:
      for depth, v in enumerate(np.ravel(value), 1):
        out[f"{section}{short}/{depth}"] = float(v)
  if learning_rate is not None:
    out["train/learning_rate"] = learning_rate
  return out


def jsonable(metrics: dict) -> dict:
  """Metrics as JSON values. A drafter part's acceptance is NaN in a step where the part never
  drafted (`drafter_metrics`): null here, nothing measured, and skipped by TensorBoard; any
  other NaN stays NaN, a sign of divergence that must show."""
  value = lambda key, x: (None if is_part_acceptance(key) and np.isnan(x)
                         else np.asarray(x).tolist())
  return {k: value(k, v) for k, v in metrics.items()}


def part_acceptance(history: list[dict]) -> dict[str, float]:
  """`acceptance_<name>_first` / `_last`: each drafter part's acceptance length (a combined
  drafter's, `drafter_metrics`) over the first and last 5 steps where it drafted; none for a
  part that never did."""
  out = {}
  for key in part_keys(history):
    seen = [h[key] for h in history if h.get(key) is not None]
    if seen:
      out[f"{key}_first"], out[f"{key}_last"] = float(np.mean(seen[:5])), float(np.mean(seen[-5:]))
  return out


def arm_keys(history: list[dict]) -> list[str]:
  """The acceptance arms' metrics (`eval.arm_drafters`) logged anywhere in `history`, sorted."""
  return sorted({key for record in history for key in record
                 if key.startswith(("arm_acceptance_", "arm_tail_acceptance_"))})


def arm_summary(history: list[dict]) -> dict[str, float]:
  """Each acceptance arm's `<key>_first`, `_last` (its first and last measurement) and
  `_mean` (over every measurement after the first)."""
  out = {}
  for key in arm_keys(history):
    seen = [h[key] for h in history if h.get(key) is not None]
    out[f"{key}_first"], out[f"{key}_last"] = float(seen[0]), float(seen[-1])
    out[f"{key}_mean"] = float(np.mean(seen[1:] if len(seen) > 1 else seen))
  return out


def plot_curves(history: list[dict], path: Path) -> None:
  """The run's curves as a PNG. A bare `Figure` (no pyplot), so a notebook's or script's
  matplotlib backend and open figures are left as they were."""
  from matplotlib.figure import Figure
  steps = [h["step"] for h in history]
  arms = [k for k in ("rollout_s_plain", "rollout_s_spec", "rollout_s_uncompacted")
          if any(k in h for h in history)]
  fig = Figure(figsize=(17 if arms else 13, 3.5))
  axes = fig.subplots(1, 4 if arms else 3)
  for ax, key, title in zip(axes, ("reward_mean", "acceptance_length", "rollout_tokens_per_s"),
                            ("reward (mean)", "acceptance length (tokens / round)",
                             "rollout tokens / s (whole step)")):
    ax.plot(steps, [h[key] for h in history], label="all rounds")
    ax.set_title(title)
    ax.set_xlabel("step")
  # Each part of a combined drafter (group drafting in front of MTP) where it drafted: which
  # one pays along training. A step where a part never drafted is a gap (null).
  parts = part_keys(history)
  for key in parts:
    axes[1].plot(steps, [np.nan if h.get(key) is None else h[key] for h in history],
                 label=f"{key.removeprefix('acceptance_')} drafted")
  # Each acceptance arm (a fixed chain of one drafter on the first batch), all rounds.
  for key in (k for k in arm_keys(history) if k.startswith("arm_acceptance_")):
    measured = [h for h in history if h.get(key) is not None]
    axes[1].plot([h["step"] for h in measured], [h[key] for h in measured], marker=".",
                 linestyle="--", label=f"{key.removeprefix('arm_acceptance_')} (fixed chain)")
  if parts or arm_keys(history):
    axes[1].legend(fontsize="small")
  labels = {"rollout_s_plain": "plain", "rollout_s_spec": "speculative",
            "rollout_s_uncompacted": "plain, no compaction"}
  for key in arms:  # one call of each arm on the first batch, every eval.arms_every steps
    timed = [h for h in history if key in h]
    axes[3].plot([h["step"] for h in timed], [h[key] for h in timed], marker=".",
                 label=labels[key])
  if arms:
    axes[3].set_title("rollout seconds, first batch, per arm")
    axes[3].set_xlabel("step")
    axes[3].legend(fontsize="small")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
