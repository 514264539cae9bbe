"""One RL step's rollout work: prompts, group size, prompt length, response lengths.

Response lengths in reasoning RL are long-tailed: most rows stop early, a few run to the
length cap, and the batch waits for them while its live rows thin out. The simulator does not
draw random lengths: row i of B gets the (i + 1/2) / B quantile of the distribution, so a
simulation is deterministic and a larger batch samples the tail more finely.

Shape letters: see `specjax` (B rows = prompts x G, G group size).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from typing import Union

import numpy as np

from specjax.sim import _checks as C


def _quantiles(n: int) -> np.ndarray:
  return (np.arange(n) + 0.5) / n


@dataclasses.dataclass(frozen=True)
class Fixed:
  """Every response has `length` tokens."""

  length: int

  def __post_init__(self):
    C.positive_int("Fixed.length", self.length)

  @property
  def max_tokens(self) -> int:
    return self.length

  def lengths(self, n: int) -> np.ndarray:
    return np.full(n, self.length, np.int64)

  def describe(self) -> str:
    return f"fixed {self.length}"


@dataclasses.dataclass(frozen=True)
class Lognormal:
  """Lengths whose logarithm is normal: `median` tokens, log-space spread `sigma`, capped at
  `max_tokens` (the rollout's max_new_tokens; the rows at the cap are the clipped ones)."""

  median: float
  sigma: float
  max_tokens: int

  def __post_init__(self):
    C.positive("Lognormal.median", self.median)
    C.nonneg("Lognormal.sigma", self.sigma)
    C.positive_int("Lognormal.max_tokens", self.max_tokens)

  def lengths(self, n: int) -> np.ndarray:
    z = np.array([statistics.NormalDist().inv_cdf(q) for q in _quantiles(n)])
    return np.clip(np.rint(self.median * np.exp(self.sigma * z)), 1, self.max_tokens).astype(
        np.int64)

  def describe(self) -> str:
    return f"lognormal(median {self.median:g}, sigma {self.sigma:g}, max {self.max_tokens})"


@dataclasses.dataclass(frozen=True)
class Empirical:
  """Lengths measured in a rollout; B rows take their quantiles (B = len: the list itself)."""

  values: tuple[int, ...]

  def __post_init__(self):
    values = tuple(self.values) if isinstance(self.values, (tuple, list, np.ndarray)) else ()
    C.require(bool(values) and all(C.is_int(v) and v >= 1 for v in values), "Empirical.values",
              self.values, "must be a non-empty sequence of response lengths (ints >= 1)")
    object.__setattr__(self, "values", tuple(int(v) for v in values))

  @property
  def max_tokens(self) -> int:
    return max(self.values)

  def lengths(self, n: int) -> np.ndarray:
    return np.quantile(np.array(self.values), _quantiles(n), method="inverted_cdf").astype(
        np.int64)

  def describe(self) -> str:
    v = np.array(self.values)
    return f"empirical ({len(v)} lengths, median {np.median(v):g}, max {v.max()})"


ResponseLengths = Union[Fixed, Lognormal, Empirical]


@dataclasses.dataclass(frozen=True)
class Workload:
  """What one RL step generates and trains on.

  Attributes:
    prompts: prompts per step (B / G).
    group_size: G, responses per prompt.
    prompt_len: tokens per prompt.
    responses: the response-length distribution.
    greedy: tokens are argmaxes (temperature 0), not draws: the sampler skips the random draw
      over the vocabulary (RL rollouts sample; greedy is for evaluation and benchmarks).
  """

  prompts: int
  group_size: int
  prompt_len: int
  responses: ResponseLengths
  greedy: bool = False

  def __post_init__(self):
    C.positive_int("Workload.prompts", self.prompts)
    C.positive_int("Workload.group_size", self.group_size)
    C.positive_int("Workload.prompt_len", self.prompt_len)
    C.require(isinstance(self.responses, (Fixed, Lognormal, Empirical)), "Workload.responses",
              self.responses, "must be Fixed, Lognormal or Empirical")
    C.require(isinstance(self.greedy, bool), "Workload.greedy", self.greedy, "must be a bool")

  @property
  def rows(self) -> int:
    return self.prompts * self.group_size

  def row_lengths(self) -> np.ndarray:
    """`[B]` response lengths, longest first (read-only)."""
    return _sorted_lengths(self.responses, self.rows)

  @property
  def max_context(self) -> int:
    return self.prompt_len + int(self.row_lengths()[0])

  def train_tokens(self) -> float:
    """Tokens the trainer processes: every row's prompt and response (sequences packed)."""
    return float(self.rows * self.prompt_len + self.row_lengths().sum())

  def describe(self) -> str:
    return (f"{self.prompts} prompts x G {self.group_size} = {self.rows} rows, prompt "
            f"{self.prompt_len}, response {self.responses.describe()}"
            + (", greedy" if self.greedy else ""))


@functools.lru_cache(maxsize=64)
def _sorted_lengths(responses: ResponseLengths, rows: int) -> np.ndarray:
  # Cached: a step asks for them several times, and a sweep for every cell.
  lengths = np.sort(responses.lengths(rows))[::-1].copy()
  lengths.flags.writeable = False
  return lengths
