"""Type tests that argument checks share: a number the way a config field means one.

`isinstance(x, int)` alone lets `True` through as 1, and `float(x)` turns "0.9" into 0.9;
these say what a field's check means by "an int" or "a number", so that its message
(`ConfigError`, naming the field and what is allowed) can follow.
"""

from __future__ import annotations

import math
import numbers


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
  return is_number(value) and math.isfinite(value)
