"""What a run directory records, read back on a resume: the config that made it (and what a
resume may change), and the metrics logged up to the checkpoint it resumes from.

A run writes its resolved config to `config.json` when it starts. A rerun on the same
directory compares its own config with it field by field (nested fields by dotted name,
`model.rope_theta`): a change to a field that defines what was trained or measured is
refused, naming the fields, their old and new values and the fields that may change; a
change to the others (how long to run, how often to checkpoint, ...) is logged and recorded.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from specjax.checks import is_int
from specjax.errors import CheckpointError, ConfigError
from specjax.files import write_text_atomic

CONFIG_FILE = "config.json"
ENVIRONMENT_FILE = "environment.json"


def config_record(config: Any) -> dict[str, Any]:
  """`config` (a dataclass) as JSON values: nested dataclasses as objects (without the fields
  marked `metadata={"record": False}`, such as a loaded tokenizer's tables), functions by their
  qualified name (a reward's `module.fn`, the same in every run), others as text."""
  return json.loads(json.dumps(_recordable(config), default=str))


def _recordable(value: Any) -> Any:
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: _recordable(getattr(value, f.name)) for f in dataclasses.fields(value)
            if f.metadata.get("record", True)}
  if isinstance(value, (list, tuple)):
    return [_recordable(v) for v in value]
  if isinstance(value, dict):
    return {k: _recordable(v) for k, v in value.items()}
  if callable(value) and hasattr(value, "__qualname__"):
    return f"{getattr(value, '__module__', None) or '?'}.{value.__qualname__}"
  return value


def _flat(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in record.items():
    if isinstance(value, dict):
      out |= _flat(value, f"{prefix}{key}.")
    else:
      out[f"{prefix}{key}"] = value
  return out


def _may_change(field: str, resumable: set[str]) -> bool:
  """Whether `field` (dotted) or a group above it is in `resumable`."""
  parts = field.split(".")
  return any(".".join(parts[:i]) in resumable for i in range(1, len(parts) + 1))


def _renamed(flat: dict[str, Any], renamed: Mapping[str, str]) -> dict[str, Any]:
  """`flat` with each field recorded under an old name (or below one) under its new name."""
  out = {}
  for key, value in flat.items():
    top, _, rest = key.partition(".")
    out[f"{renamed[top]}.{rest}" if rest and top in renamed else renamed.get(key, key)] = value
  return out


def check_resume(run_dir: Path, config: Any, resumable: Iterable[str], *, started: bool,
                 defines: str, log: Callable[[str], None],
                 renamed: Mapping[str, str] | None = None) -> None:
  """Refuse to continue the run in `run_dir` with a config that differs from the recorded
  one in a field outside `resumable` (dotted field names; a group's name covers all of its
  fields).

  A field the record lacks (one added since the run started) counts as its default value,
  which is how the run behaved without it.

  Args:
    renamed: old field name -> its dotted name now, for records of runs started before a
      field moved (a renamed field is compared under its new name).
    started: whether the directory holds work this run would continue (checkpoints, data);
      a directory without any may be reused with any config.
    defines: what the fixed fields define, for the message ("the policy, its task and
      its training").

  Raises:
    ConfigError: a fixed field changed.
    CheckpointError: the recorded `config.json` is not a JSON object.
  """
  path = Path(run_dir) / CONFIG_FILE
  if not started or not path.is_file():
    return
  try:
    old = json.loads(path.read_text())
  except (OSError, ValueError) as err:
    raise CheckpointError(f"{path}: the config this run started with cannot be read ({err}); "
                          "restore it, or delete it to continue without the check") from None
  if not isinstance(old, dict):
    raise CheckpointError(f"{path}: holds a JSON {type(old).__name__}, expected the config "
                          "object this run started with")
  renamed = renamed or {}
  fields = {f.name for f in dataclasses.fields(config)}
  if any(key in renamed and key not in fields for key in old):  # recorded before the renames
    old = _renamed(_flat(old), renamed)
  else:
    old = _flat(old)
  new = _flat(config_record(config))
  # A field this config has and the record lacks was added since: it ran as its default. (Only
  # fields the config has: a task of another kind than the default's has other fields.)
  defaults = _flat(config_record(type(config)()))
  old = {k: v for k, v in defaults.items() if k in new} | old
  changed = sorted(k for k in new.keys() | old.keys() if old.get(k) != new.get(k))
  allowed = set(resumable)
  fixed = [k for k in changed if not _may_change(k, allowed)]
  if fixed:
    detail = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in fixed)
    raise ConfigError(
        f"{', '.join(fixed)} changed since {run_dir} was started ({detail}). These define "
        f"{defines}, so the run cannot continue with them: use the old values or a new "
        f"run_dir. Fields a resume may change: {', '.join(sorted(allowed))}")
  if changed:
    log(f"resuming with changed {', '.join(changed)}")


def record_config(run_dir: Path, config: Any) -> None:
  """Write `config` as the run's `config.json`, and what ran it (`environment()`) as
  `environment.json` (atomically)."""
  write_text_atomic(Path(run_dir) / CONFIG_FILE,
                    json.dumps(config_record(config), indent=2) + "\n")
  write_text_atomic(Path(run_dir) / ENVIRONMENT_FILE, json.dumps(environment(), indent=2) + "\n")


def environment() -> dict[str, Any]:
  """The versions of specjax and of the libraries a run's numbers depend on, the Python, the
  platform and devices, and specjax's git commit when it runs from a checkout (None
  otherwise; "+changes" marks uncommitted ones)."""
  import platform

  import jax

  import specjax
  versions = {"specjax": specjax.__version__}
  for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy"):
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  return {"versions": versions, "python": platform.python_version(),
          "platform": platform.platform(), "devices": f"{jax.device_count()} x "
          f"{jax.devices()[0].device_kind}", "processes": jax.process_count(),
          "git": _git_commit(Path(specjax.__file__).resolve().parent)}


def _git_commit(where: Path) -> str | None:
  def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True,
                          timeout=10, check=True).stdout.strip()
  try:
    commit = git("rev-parse", "HEAD")
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
  except (OSError, subprocess.SubprocessError):
    return None


def kept_metrics(path: Path, step: int, log=print) -> list[str]:
  """The lines of `path` (metrics.jsonl) logged up to `step`, the resumed checkpoint's.

  A run killed mid-append leaves a truncated last line; it is dropped with a warning (its
  step runs again). A malformed line before the last is not a kill's trace: it raises
  CheckpointError naming the file and line.
  """
  if not path.exists():  # killed between the first checkpoint and creating the file
    return []
  lines = path.read_text().splitlines()
  kept = []
  for number, line in enumerate(lines, 1):
    if not line:
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as err:
      if number == len(lines):
        log(f"warning: dropped the truncated last line {number} of {path} (a run killed "
            f"mid-write): {line[:80]!r}")
        continue
      raise CheckpointError(f"{path} line {number} is not a JSON record ({err}): "
                            f"{line[:80]!r}. Fix or delete that line to resume.") from err
    if not isinstance(record, dict) or not is_int(record.get("step")):
      raise CheckpointError(f"{path} line {number} has no integer \"step\": {line[:80]!r}. "
                            "Fix or delete that line to resume.")
    if record["step"] <= step:
      kept.append(line)
  return kept
