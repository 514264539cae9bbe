"""Validation of simulator inputs: one message format, naming the field and what is allowed."""

from __future__ import annotations

import math
import numbers

from specjax.errors import ConfigError


def require(ok: bool, field: str, value, allowed: str) -> None:
  if not ok:
    raise ConfigError(f"{field}={value!r} is invalid: {allowed}")


def is_int(value) -> bool:
  """A Python or NumPy integer, not a bool (True would pass as a count of 1)."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
  """A finite real number, not a bool, a string or NaN / inf."""
  return (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value))


def positive_int(field: str, value) -> int:
  require(is_int(value) and value > 0, field, value, "must be an int > 0")
  return int(value)


def nonneg_int(field: str, value) -> int:
  require(is_int(value) and value >= 0, field, value, "must be an int >= 0")
  return int(value)


def positive(field: str, value) -> float:
  require(is_real(value) and value > 0, field, value, "must be a finite number > 0")
  return float(value)


def nonneg(field: str, value) -> float:
  require(is_real(value) and value >= 0, field, value, "must be a finite number >= 0")
  return float(value)


def fraction(field: str, value, upper: float = 1.0) -> float:
  """A number in (0, upper]: an efficiency or a share."""
  require(is_real(value) and 0 < value <= upper, field, value, f"must be in (0, {upper:g}]")
  return float(value)
