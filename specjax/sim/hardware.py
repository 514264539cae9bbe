"""What one accelerator can do, and the roofline that turns work into seconds.

A `DeviceProfile` holds a device's nominal (or measured) rates and the efficiency factors
that say how much of them each class of operation reaches. The classes and their prices:

  matmul      max(FLOP / (peak_flops * matmul_eff(I)), weight bytes / (hbm_bw * mem_eff)),
              I = FLOP / weight bytes, the arithmetic intensity (for bf16 weights about the
              tokens in the forward: the ridge point is peak_flops / hbm_bw FLOP per byte)
  attention   max(FLOP / (peak_flops * attn_flops_eff), KV bytes / (hbm_bw * kv_eff(KV bytes)))
  overhead    layer_overhead_s per layer per forward (kernel launches, norms, RoPE);
              round_overhead_s per decoding round (scheduling, host sync), plus
              spec_round_overhead_s per speculative round (acceptance test, KV commit)
  logits      per decoding round, for every live row and every position it verifies (and
              every draft node a drafter samples), over the vocabulary: logit_s per logit
              (the log-softmax passes, greedy included), plus sample_logit_s when tokens are
              drawn (temperature > 0: the random draw). A cost per row, unlike the overheads:
              at a large vocabulary it grows with the live batch as fast as the KV reads do.
  collective  bytes / (link bandwidth * collective_eff) + collective_latency_s
  training    FLOP / (peak_flops * train_mfu)

Every factor is a plain number or a `Curve`, so a profile can be fitted from measured
forwards (`specjax.sim.fit_efficiency`) or measured outright
(`specjax.experiments.device_profile.calibrate_profile`).
Units: seconds, bytes, FLOP; bandwidths in bytes per second.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from specjax.errors import ConfigError
from specjax.sim import _checks as C


@dataclasses.dataclass(frozen=True)
class Curve:
  """An efficiency as a function of a positive size: piecewise linear in log(size).

  Attributes:
    knots: ((size, value), ...) with strictly increasing sizes > 0 and values in (0, 1.5];
      below the first size the first value holds, above the last the last.
  """

  knots: tuple[tuple[float, float], ...]

  def __post_init__(self):
    ok = isinstance(self.knots, (tuple, list)) and len(self.knots) >= 1 and all(
        isinstance(k, (tuple, list)) and len(k) == 2 and C.is_real(k[0]) and C.is_real(k[1])
        and k[0] > 0 and 0 < k[1] <= 1.5 for k in self.knots)
    C.require(ok, "Curve.knots", self.knots,
              "must be ((size, efficiency), ...) with sizes > 0 and efficiencies in (0, 1.5]")
    knots = tuple((float(x), float(y)) for x, y in self.knots)
    C.require(all(a[0] < b[0] for a, b in zip(knots, knots[1:])), "Curve.knots", self.knots,
              "sizes must be strictly increasing")
    object.__setattr__(self, "knots", knots)

  @classmethod
  def constant(cls, value: float) -> Curve:
    return cls(((1.0, value),))

  def __call__(self, size):
    """The efficiency at `size` (a number or an array of them)."""
    xs = np.log([k[0] for k in self.knots])
    ys = np.array([k[1] for k in self.knots])
    return np.interp(np.log(np.maximum(size, 1e-30)), xs, ys)

  def scaled(self, factor: float) -> Curve:
    """Every value times `factor` (capped at 1.5): what a fit adjusts."""
    return Curve(tuple((x, min(y * factor, 1.5)) for x, y in self.knots))


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
  """One accelerator: rates and efficiency factors.

  Attributes:
    name: what the profile describes ("H100 SXM (spec sheet)", "measured: cpu").
    peak_flops: dense bf16 FLOP/s (float32 for a measured CPU profile).
    hbm_bw: memory bandwidth, bytes/s.
    hbm_bytes: memory capacity, bytes.
    link_bw: scale-up interconnect bandwidth per device and direction (NVLink, ICI), bytes/s.
    scaleout_bw: bandwidth per device between scale-up domains (InfiniBand, DCN), bytes/s.
    domain: devices in one scale-up domain (8 for an HGX board, 72 for GB200 NVL72, a pod
      slice for TPUs); collectives over more devices use `scaleout_bw`.
    matmul_eff: fraction of `peak_flops` a weight matmul reaches, by arithmetic intensity.
    mem_eff: fraction of `hbm_bw` reached while streaming weights.
    kv_eff: fraction of `hbm_bw` attention reaches, by KV bytes read per forward and device
      (small reads do not fill the memory system).
    attn_flops_eff: fraction of `peak_flops` attention's products reach (prefill, long T).
    layer_overhead_s: fixed seconds per layer per forward.
    round_overhead_s: fixed seconds per decoding round.
    spec_round_overhead_s: extra fixed seconds per speculative round.
    train_mfu: model FLOP utilisation of the trainer (forward, backward, log-prob passes).
    collective_eff: fraction of the link bandwidth a collective reaches.
    collective_latency_s: fixed seconds per collective.
    logit_s: seconds per logit per round: the log-softmax passes over the vocabulary of
      every verified position of every live row (greedy decoding pays it too).
    sample_logit_s: extra seconds per logit when tokens are drawn (temperature > 0).
    source: where the numbers come from.
  """

  name: str
  peak_flops: float
  hbm_bw: float
  hbm_bytes: float
  link_bw: float
  scaleout_bw: float
  domain: int
  matmul_eff: Curve
  mem_eff: float
  kv_eff: Curve
  attn_flops_eff: float
  layer_overhead_s: float
  round_overhead_s: float
  spec_round_overhead_s: float
  train_mfu: float
  collective_eff: float
  collective_latency_s: float
  logit_s: float = 0.0
  sample_logit_s: float = 0.0
  source: str = ""

  def __post_init__(self):
    C.require(isinstance(self.name, str) and self.name, "DeviceProfile.name", self.name,
              "must be a non-empty string")
    for field in ("peak_flops", "hbm_bw", "hbm_bytes", "link_bw", "scaleout_bw"):
      C.positive(f"DeviceProfile.{field}", getattr(self, field))
    C.positive_int("DeviceProfile.domain", self.domain)
    for field in ("matmul_eff", "kv_eff"):
      C.require(isinstance(getattr(self, field), Curve), f"DeviceProfile.{field}",
                getattr(self, field), "must be a Curve (Curve.constant(0.8) for a constant)")
    for field in ("mem_eff", "attn_flops_eff", "train_mfu", "collective_eff"):
      C.fraction(f"DeviceProfile.{field}", getattr(self, field), upper=1.5)
    for field in ("layer_overhead_s", "round_overhead_s", "spec_round_overhead_s",
                  "collective_latency_s", "logit_s", "sample_logit_s"):
      C.nonneg(f"DeviceProfile.{field}", getattr(self, field))

  @property
  def ridge(self) -> float:
    """FLOP per byte above which a matmul is compute-bound (nominal rates)."""
    return self.peak_flops / self.hbm_bw

  def replace(self, **changes: Any) -> DeviceProfile:
    return dataclasses.replace(self, **changes)

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=1)

  @classmethod
  def from_json(cls, text: str) -> DeviceProfile:
    """The profile `to_json` wrote (what `specjax sim calibrate` saves).

    Raises:
      ConfigError: `text` is not JSON, not an object, lacks a field or has an unknown one, a
        curve is not `{"knots": [[size, efficiency], ...]}`, or a value is out of range.
    """
    allowed = "allowed a DeviceProfile as JSON, as `specjax sim calibrate` writes it"
    try:
      raw = json.loads(text)
    except ValueError as err:
      raise ConfigError(f"DeviceProfile JSON is invalid: not JSON ({err}); {allowed}") from None
    if not isinstance(raw, dict):
      raise ConfigError(f"DeviceProfile JSON is invalid: a JSON {type(raw).__name__}; "
                        f"{allowed} (an object)")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    missing = [n for n, f in fields.items() if n not in raw
               and f.default is dataclasses.MISSING]
    unknown = sorted(set(raw) - set(fields))
    if missing or unknown:
      problems = [f"{what} fields {names}" for what, names in (("missing", missing),
                                                               ("unknown", unknown)) if names]
      raise ConfigError(f"DeviceProfile JSON is invalid: {', '.join(problems)}; {allowed}")
    for field in ("matmul_eff", "kv_eff"):
      knots = raw[field].get("knots") if isinstance(raw[field], dict) else None
      C.require(isinstance(knots, list) and all(isinstance(k, list) for k in knots),
                f"DeviceProfile.{field}", raw[field],
                'allowed {"knots": [[size, efficiency], ...]}')
      raw[field] = Curve(tuple(tuple(k) for k in knots))
    return cls(**raw)


def matmul_seconds(profile: DeviceProfile, flops, weight_bytes):
  """Weight matmuls: the slower of compute at the intensity's efficiency and streaming the
  weights. Numbers or arrays of the same shape."""
  flops = np.asarray(flops, float)
  weight_bytes = np.maximum(np.asarray(weight_bytes, float), 1.0)
  compute = flops / (profile.peak_flops * profile.matmul_eff(flops / weight_bytes))
  return np.maximum(compute, weight_bytes / (profile.hbm_bw * profile.mem_eff))


def logits_seconds(profile: DeviceProfile, logits, greedy: bool = False):
  """Processing `logits` logits (rows x positions x vocabulary) in a round: log-softmax,
  plus the random draw unless `greedy`. A number or an array."""
  per_logit = profile.logit_s + (0.0 if greedy else profile.sample_logit_s)
  return np.asarray(logits, float) * per_logit


def attention_seconds(profile: DeviceProfile, flops, kv_bytes):
  """Attention: the slower of its products and reading the KV cache."""
  kv_bytes = np.maximum(np.asarray(kv_bytes, float), 1.0)
  compute = np.asarray(flops, float) / (profile.peak_flops * profile.attn_flops_eff)
  return np.maximum(compute, kv_bytes / (profile.hbm_bw * profile.kv_eff(kv_bytes)))
