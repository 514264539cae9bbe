"""The simulator against accelerator measurements it was not built from.

Each `Source` is one engine on one device: the figures it published (or this project measured
on a lent accelerator), each with the inputs the source gives (model, rows, tokens per row,
committed context) as a `Measurement`. No datasheet states an engine's fixed costs or how
near its kernels come to the memory floor, so each source fits the factors it names
(`fitted`, of `fit.FITTABLE`) on the figures marked `fit` and the simulator predicts the
others from the fitted profile: the held-out figures are the test. What a source leaves out
(a context length, say) is an assumption its `note` states.

  from specjax.sim import public
  print(public.format_table())   # every figure: measured, predicted, error, fitted or held out

The reference system's 8B step table is reproduced separately (`reference_report`).
"""

from __future__ import annotations

import dataclasses

from specjax.sim.devices import device_profile
from specjax.sim.fit import Measurement, fit_efficiency, predict
from specjax.sim.hardware import DeviceProfile
from specjax.sim.presets import model_spec

__all__ = ["Figure", "Row", "SOURCES", "Source", "format_table", "table"]


@dataclasses.dataclass(frozen=True)
class Figure:
  """One measured time and whether its source's factors are fitted to it."""

  label: str
  measurement: Measurement
  fit: bool = False


@dataclasses.dataclass(frozen=True)
class Source:
  """A set of figures from one engine on one device (`devices.device_profile` name)."""

  name: str
  device: str
  note: str
  figures: tuple[Figure, ...]
  fitted: tuple[str, ...]

  def profile(self) -> DeviceProfile:
    """The device's datasheet profile with `fitted` fitted to the `fit` figures."""
    base = device_profile(self.device)
    fit_on = [f.measurement for f in self.figures if f.fit]
    return fit_efficiency(fit_on, base, self.fitted) if self.fitted else base


def _forward(model: str, ms: float, rows: int, context: int, tokens: int = 1) -> Measurement:
  return Measurement("forward", model_spec(model), ms * 1e-3, rows=rows, tokens=tokens,
                     context=context)


# docs/accelerator-h200.md, sections 1 and 2 (second lease: dense attention): the 1.10B bench
# model (sim preset "bench-1b"), bfloat16, 1024 committed slots; a verify forward is its ratio
# times that row's step.
_H200_STEP = {1: 2.039, 4: 1.100, 16: 1.389, 64: 2.555}
_H200_VERIFY = {1: (2.056, {2: 0.51, 4: 0.50, 8: 0.53, 16: 0.55}),
                16: (1.421, {2: 1.13, 4: 1.34, 8: 1.58, 16: 2.56})}

SOURCES = (
    Source(
        "llama3.1-8b, 1 x H200", "h200",
        "Llama-3.1-8B decode on one H200 (issue 36's public figure), T=1: 8.2 ms at 1 "
        "sequence, 8.8 ms at 64. The context is not stated: 1024 tokens assumed",
        figures=(Figure("decode B=1", _forward("llama3-8b", 8.2, 1, 1024), fit=True),
                 Figure("decode B=64", _forward("llama3-8b", 8.8, 64, 1024))),
        fitted=("mem_eff",)),
    Source(
        "specjax, 1 x H200", "h200",
        "This project's engine on one H200, 2026-12-04 (benchmarks/accelerator.py sections 1 "
        "and 2, docs/accelerator-h200.md): the 1.10B bench model, 1024 committed slots",
        figures=tuple(
            [Figure(f"decode B={b}", _forward("bench-1b", ms, b, 1024), fit=b in (4, 64))
             for b, ms in _H200_STEP.items()]
            + [Figure(f"verify B={b} T={t}", _forward("bench-1b", step * ratio, b, 1024, t),
                      fit=(b, t) == (16, 16))
               for b, (step, ratios) in _H200_VERIFY.items() for t, ratio in ratios.items()]),
        fitted=("layer_overhead_s", "kv_scale", "matmul_scale")),
)


@dataclasses.dataclass(frozen=True)
class Row:
  """A figure beside its prediction: error = predicted / measured - 1."""

  source: str
  label: str
  measured_s: float
  predicted_s: float
  datasheet_s: float
  fit: bool

  @property
  def error(self) -> float:
    return self.predicted_s / self.measured_s - 1.0

  @property
  def datasheet_error(self) -> float:
    return self.datasheet_s / self.measured_s - 1.0


def table(sources: tuple[Source, ...] = SOURCES) -> list[Row]:
  """Every figure of `sources` with the fitted and the datasheet profile's predictions."""
  rows = []
  for source in sources:
    fitted, datasheet = source.profile(), device_profile(source.device)
    rows += [Row(source.name, f.label, f.measurement.seconds, predict(f.measurement, fitted),
                 predict(f.measurement, datasheet), f.fit) for f in source.figures]
  return rows


_CURVES = {"kv_scale": "kv_eff", "matmul_scale": "matmul_eff"}


def _factor(profile: DeviceProfile, field: str, datasheet: DeviceProfile) -> float:
  """A fitted field's value; a curve's scale (`fit.FITTABLE`) relative to `datasheet`."""
  if field in _CURVES:
    top = lambda p: getattr(p, _CURVES[field]).knots[-1][1]
    return top(profile) / top(datasheet)
  return getattr(profile, field)


def format_table(sources: tuple[Source, ...] = SOURCES) -> str:
  """The table, each source's note and fitted factors, and its worst held-out error."""
  rows = table(sources)
  lines = [f"{'source':<22} {'figure':<16} {'measured ms':>11} {'predicted':>10} {'error':>7} "
           f"{'':<8} {'datasheet':>10} {'error':>7}"]
  for r in rows:
    lines.append(f"{r.source:<22} {r.label:<16} {1e3 * r.measured_s:11.3f} "
                 f"{1e3 * r.predicted_s:10.3f} {100 * r.error:+6.1f}% "
                 f"{'fitted' if r.fit else 'held out':<8} {1e3 * r.datasheet_s:10.3f} "
                 f"{100 * r.datasheet_error:+6.1f}%")
  for source in sources:
    profile, datasheet = source.profile(), device_profile(source.device)
    factors = ", ".join(f"{f} = {_factor(profile, f, datasheet):.3g} (datasheet "
                        f"{_factor(datasheet, f, datasheet):.3g})" for f in source.fitted)
    held = [abs(r.error) for r in rows if r.source == source.name and not r.fit]
    worst = f"worst held-out error {100 * max(held):.1f}%" if held else "no held-out figure"
    lines.append(f"{source.name}: {source.note}. Fitted: {factors or 'nothing'}; {worst}")
  return "\n".join(lines)
