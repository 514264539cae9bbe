"""Reading a JSON object from a user's file, with an error that names the file and the place.

Checkpoint and tokenizer directories hold small JSON files (config.json,
tokenizer_config.json, generation_config.json, index files); a truncated download or a
hand edit must fail with the file, the position and a remedy, in the error type of the
component that reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_object(file: Path, error: type[Exception], remedy: str) -> dict[str, Any]:
  """The JSON object in `file`; `error` naming the file, the position and `remedy` when the
  text is not UTF-8, not JSON, or not an object."""
  try:
    value = json.loads(Path(file).read_text(encoding="utf-8"))
  except json.JSONDecodeError as err:
    raise error(f"{file}: malformed JSON at line {err.lineno} column {err.colno} "
                f"(char {err.pos}): {err.msg}; {remedy}") from None
  except UnicodeDecodeError as err:
    raise error(f"{file}: not UTF-8 text (byte {err.start}): {err.reason}; {remedy}") from None
  if not isinstance(value, dict):
    raise error(f"{file}: holds a JSON {type(value).__name__}, expected an object")
  return value
