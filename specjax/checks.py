"""Type tests and the field check that argument checks share: a number the way a config field
means one, and one message form for a value that is not allowed.

`isinstance(x, int)` alone lets `True` through as 1, and `float(x)` turns "0.9" into 0.9;
these say what a field's check means by "an int" or "a number", so that its message
(`ConfigError`, naming the field and what is allowed) can follow.
"""

from __future__ import annotations

import math
import numbers

from specjax.errors import ConfigError


def is_int(value) -> bool:
  """A Python or NumPy integer, not a bool (True would pass as a count of 1)."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_plain_int(value) -> bool:
  """A Python int, not a bool or a NumPy integer: for fields of frozen configs, which are
  hashed as static arguments and written to JSON."""
  return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
  """A Python or NumPy real number, not a bool or a string; NaN and inf included (the
  field's range check decides those)."""
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_real(value) -> bool:
  """A finite real number, not a bool, a string or NaN / inf."""
  try:
    return is_number(value) and math.isfinite(value)
  except OverflowError:  # an int past float's range (10**400)
    return False


def require(ok: bool, field: str, value, allowed: str) -> None:
  """Raise `ConfigError("{field}={value!r} is invalid: {allowed}")` unless `ok`: the one
  message form of every config check (the field, its value, what is allowed)."""
  if not ok:
    raise ConfigError(f"{field}={value!r} is invalid: {allowed}")


def require_field(config, field: str, ok: bool, allowed: str, prefix: str = "") -> None:
  """`require` for a field of `config`, named `{prefix}{field}` in the message."""
  require(ok, prefix + field, getattr(config, field), allowed)


def require_ints(config, fields: tuple[str, ...], minimum: int, prefix: str = "") -> None:
  """Each of `fields` of `config` is an int (`is_int`) >= `minimum`."""
  for field in fields:
    value = getattr(config, field)
    require(is_int(value) and value >= minimum, prefix + field, value,
            f"must be an int >= {minimum}")


def require_reals(config, fields: tuple[str, ...], *, positive: bool, prefix: str = "") -> None:
  """Each of `fields` of `config` is a finite number (`is_real`), > 0 with `positive`, else
  >= 0."""
  for field in fields:
    value = getattr(config, field)
    ok = is_real(value) and (value > 0 if positive else value >= 0)
    require(ok, prefix + field, value,
            f"must be a finite number {'>' if positive else '>='} 0")
