"""How much a batch's slowest row holds it back when rows advance by random amounts.

Pure Python and NumPy, so that both the decode loop's speculation policy
(`specjax.decoding.policy`, with `xp=jax.numpy`) and the simulator (`specjax.sim`, which must
import without JAX) weigh stragglers with one formula.
"""

from __future__ import annotations

import functools
import math

import numpy as np


@functools.lru_cache(maxsize=None)
def expected_normal_max(rows: int) -> np.ndarray:
  """`[rows + 1]` (read-only): the expected maximum of L independent standard normals, for
  L = 0..rows (0 for L <= 1), integrated numerically: E max = int x L phi(x) Phi(x)^(L-1) dx.
  """
  x = np.linspace(-12.0, 12.0, 24001)
  cdf = 0.5 * np.array([math.erfc(-v / math.sqrt(2.0)) for v in x])
  density = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
  dx = x[1] - x[0]
  out = np.zeros(rows + 1)
  for n in range(2, rows + 1):
    out[n] = float((x * n * density * cdf ** (n - 1)).sum() * dx)
  out.flags.writeable = False
  return out


def straggler_factor(mean, variance, live, remaining, rows: int, xp=np):
  """The fraction of its rows' mean progress per round at which a batch of `live` rows (of
  at most `rows`), each needing `remaining` more tokens, advances its slowest row, for rounds
  emitting `mean` tokens of `variance` per row (see `specjax.decoding.policy`):
  1 / (1 + z_live sqrt(V / (n E))); 1 for plain decoding (V = 0). Broadcasts; `xp` = numpy or
  jax.numpy."""
  z = xp.asarray(expected_normal_max(rows), xp.float32)[xp.clip(live, 0, rows)]
  n = xp.maximum(remaining, 1.0)
  return 1.0 / (1.0 + z * xp.sqrt(variance / (n * mean)))
