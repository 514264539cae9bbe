"""Timing on a shared, noisy machine: the arms of a comparison run in turn, repeat after
repeat, so that a slow spell hits every arm alike instead of bending their ratio.

Used wherever a figure is a ratio of arms measured in one run (`specjax generate`'s
speculative / plain throughput, `experiments.measure.rollout_speedup`, the device profile's
curves). JAX-free: each function must return only once its work is done (block on the
result).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np


def interleaved(fns: Sequence[Callable[[int], Any]], repeats: int,
                seconds: float = 0.0) -> tuple[list[np.ndarray], list[list[Any]]]:
  """Call each of `fns` (compiled and warmed up already) once per repeat, with the repeat's
  index, until `repeats` repeats have run and every function has spent `seconds` in all.

  Repeat r starts with function r mod F (F = len(fns)) and goes on in turn, so that none is
  always first after a pause. Returns each function's seconds per call (`[R]`, in repeat
  order: a ratio of two arms is best taken repeat by repeat, `np.median(a / b)`, which a
  machine whose speed drifts between repeats disturbs less than a ratio of medians) and its
  outputs, one per call (keep them small: what the caller needs of each call).
  """
  if not fns:
    raise ValueError("interleaved needs at least one function to time")
  if repeats < 1 or seconds < 0:
    raise ValueError(f"interleaved needs repeats >= 1 and seconds >= 0, got {repeats}, "
                     f"{seconds}")
  times: list[list[float]] = [[] for _ in fns]
  outputs: list[list[Any]] = [[] for _ in fns]
  r = 0
  while r < repeats or min(sum(t) for t in times) < seconds:
    for i in np.roll(np.arange(len(fns)), -r):
      start = time.perf_counter()
      outputs[i].append(fns[i](r))
      times[i].append(time.perf_counter() - start)
    r += 1
  return [np.asarray(t) for t in times], outputs
