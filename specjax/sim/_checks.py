"""Validation of simulator inputs: one message format, naming the field and what is allowed."""

from __future__ import annotations

from specjax.checks import is_int, is_real
from specjax.errors import ConfigError


def require(ok: bool, field: str, value, allowed: str) -> None:
  if not ok:
    raise ConfigError(f"{field}={value!r} is invalid: {allowed}")


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
