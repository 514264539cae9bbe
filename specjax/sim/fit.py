"""Fit a profile's efficiency factors to measured times.

A `Measurement` is one timed operation the cost model can predict: a forward (B rows x T
tokens against a context), a decoding round of a menu entry (the target's verification, the
drafter's depths and the fixed round cost), or a training / log-prob pass over some tokens.
`fit_efficiency` chooses the named factors of a profile that minimise the squared log error
of the predictions, sum_i log(predicted_i / measured_i)^2 (a relative error, so a 1 ms step
and a 1 s step weigh alike), by Nelder-Mead over the logarithms of the factors (all stay
positive). Measured decode-step and verify costs (`benchmarks/decode_step.py`, `calibrate`'s
`CostTable`) fit `mem_eff`, `kv_scale`, `layer_overhead_s` and `round_overhead_s`; prefill and
large-batch verify forwards fit `matmul_scale`; training steps fit `train_mfu`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from specjax.errors import ConfigError
from specjax.sim import _checks as C
from specjax.sim.cost import forward_time, round_time
from specjax.sim.hardware import DeviceProfile
from specjax.sim.model import ModelSpec
from specjax.sim.parallel import Cluster
from specjax.sim.speculation import PLAIN, MenuEntry
from specjax.sim.step import Schedule, logprob_seconds, training_seconds

KINDS = ("forward", "round", "train", "logprob")
# Fields a fit may change; "matmul_scale" and "kv_scale" multiply the two curves.
FITTABLE = ("mem_eff", "matmul_scale", "kv_scale", "attn_flops_eff", "layer_overhead_s",
            "round_overhead_s", "spec_round_overhead_s", "train_mfu", "collective_eff",
            "logit_s", "sample_logit_s")
_EFFICIENCY_CAP = 1.5


@dataclasses.dataclass(frozen=True)
class Measurement:
  """One measured time.

  Attributes:
    kind: "forward", "round" (a decoding round of `entry`, drafting with `drafter`),
      "train" (one update over `tokens` tokens) or "logprob" (one no-gradient pass).
    model: the model that ran.
    seconds: the measured time.
    rows, tokens, context: B, T per row and committed context (forward / round); for
      "train" and "logprob", `tokens` is the batch's total.
    replica: devices the operation ran on.
    entry, drafter: the round's menu entry (None: plain) and drafter spec (None: free).
    greedy: the round's tokens were argmaxes (its sampler made no random draw).
  """

  kind: str
  model: ModelSpec
  seconds: float
  rows: int = 1
  tokens: int = 1
  context: int = 0
  replica: int = 1
  entry: MenuEntry | None = None
  drafter: ModelSpec | None = None
  greedy: bool = False

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ConfigError(f"Measurement.kind={self.kind!r} is unknown: allowed {', '.join(KINDS)}")
    C.positive("Measurement.seconds", self.seconds)
    C.positive_int("Measurement.rows", self.rows)
    C.positive_int("Measurement.tokens", self.tokens)
    C.nonneg_int("Measurement.context", self.context)
    C.positive_int("Measurement.replica", self.replica)
    C.require(isinstance(self.greedy, bool), "Measurement.greedy", self.greedy, "must be a bool")


def predict(measurement: Measurement, profile: DeviceProfile) -> float:
  """The cost model's seconds for what `measurement` timed."""
  m = measurement
  if m.kind == "forward":
    return float(forward_time(m.model, profile, m.rows, m.tokens, m.context, m.replica).total)
  if m.kind == "round":
    return float(round_time(m.model, profile, m.entry or PLAIN, m.rows, m.context, m.drafter,
                            m.replica, m.greedy).total)
  cluster = Cluster(profile, m.replica)
  if m.kind == "train":
    return training_seconds(m.model, cluster, float(m.tokens), Schedule())
  return logprob_seconds(m.model, cluster, float(m.tokens), Schedule())


def prediction_errors(measured: Sequence[Measurement], profile: DeviceProfile) -> np.ndarray:
  """predicted / measured - 1 for each measurement."""
  return np.array([predict(m, profile) / m.seconds - 1.0 for m in measured])


def _get(profile: DeviceProfile, field: str) -> float:
  if field in ("matmul_scale", "kv_scale"):
    return 1.0
  return getattr(profile, field)


def _with(profile: DeviceProfile, values: dict[str, float]) -> DeviceProfile:
  changes = {}
  for field, value in values.items():
    value = float(value)
    if field == "matmul_scale":
      changes["matmul_eff"] = profile.matmul_eff.scaled(value)
    elif field == "kv_scale":
      changes["kv_eff"] = profile.kv_eff.scaled(value)
    elif field.endswith("_s"):
      changes[field] = value
    else:
      changes[field] = min(value, _EFFICIENCY_CAP)
  return profile.replace(**changes)


def _nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, step: float = 0.7,
                 iterations: int = 600, tolerance: float = 1e-12) -> np.ndarray:
  """Minimise f from x0 (standard reflection / expansion / contraction / shrink)."""
  points = np.vstack([x0] + [x0 + step * e for e in np.eye(x0.size)])
  values = np.array([f(p) for p in points])
  for _ in range(iterations):
    order = np.argsort(values)
    points, values = points[order], values[order]
    if values[-1] - values[0] < tolerance:
      break
    centroid = points[:-1].mean(0)
    reflected = centroid + (centroid - points[-1])
    fr = f(reflected)
    if fr < values[0]:
      expanded = centroid + 2.0 * (centroid - points[-1])
      fe = f(expanded)
      points[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
    elif fr < values[-2]:
      points[-1], values[-1] = reflected, fr
    else:
      contracted = centroid + 0.5 * (points[-1] - centroid)
      fc = f(contracted)
      if fc < values[-1]:
        points[-1], values[-1] = contracted, fc
      else:
        points[1:] = points[0] + 0.5 * (points[1:] - points[0])
        values[1:] = [f(p) for p in points[1:]]
  return points[np.argmin(values)]


def fit_efficiency(measured: Sequence[Measurement], profile: DeviceProfile,
                   fields: Sequence[str] = ("mem_eff", "layer_overhead_s")) -> DeviceProfile:
  """`profile` with `fields` (of `FITTABLE`) set to minimise the relative error of the
  predictions of `measured`; the other fields are kept. Efficiencies are capped at 1.5."""
  measured = tuple(measured)
  if not measured or not all(isinstance(m, Measurement) for m in measured):
    raise ConfigError("fit_efficiency needs at least one Measurement")
  fields = tuple(fields)
  unknown = [f for f in fields if f not in FITTABLE]
  if not fields or unknown or len(set(fields)) != len(fields):
    raise ConfigError(f"fields={fields!r} is invalid: name distinct fields among "
                      f"{', '.join(FITTABLE)}")
  seconds = np.array([m.seconds for m in measured])
  start = np.log([max(_get(profile, f), 1e-7) for f in fields])

  def loss(theta: np.ndarray) -> float:
    candidate = _with(profile, dict(zip(fields, np.exp(theta))))
    predicted = np.array([predict(m, candidate) for m in measured])
    return float(np.sum(np.log(predicted / seconds) ** 2))

  best = np.exp(_nelder_mead(loss, start))
  fitted = _with(profile, dict(zip(fields, best)))
  return fitted.replace(name=f"{profile.name} (fitted: {', '.join(fields)})")
