"""What a run's data and rewards were, recorded so that a resume notices when they change.

`config.json` records a task's fields: a dataset's path, a reward function's qualified name
and weight. It cannot see a file rewritten at the same path, or a reward function edited
under the same name, and a run resumed across either would go on training on other prompts,
or another reward, under the old data position and without a word. A run therefore records
`inputs.json` when it starts: a digest of each split's rows (every column, in file order)
and, for each reward, its name, weight and a digest of its source code where Python can read
it. A resume compares the task's digests with the record and refuses one that changed,
naming what changed, unless the run is told to accept it (`ExperimentConfig.
accept_changed_inputs`), which records the new digests and logs what changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
from pathlib import Path
from typing import Any, Callable

from specjax.errors import CheckpointError, ConfigError
from specjax.files import read_object, write_text_atomic
from specjax.rl.rewards import as_reward_functions
from specjax.rl.tasks import SPLITS, Task

INPUTS_FILE = "inputs.json"


def _digest(value: Any) -> str:
  text = json.dumps(value, sort_keys=True, default=repr, allow_nan=True)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def _source(fn: Any) -> str:
  """A digest of `fn`'s source code, or of its qualified name where there is none to read (a
  builtin, a function made at run time)."""
  target = getattr(fn, "__func__", fn)
  try:
    return _digest(inspect.getsource(target))
  except (OSError, TypeError):
    return _digest(f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', target)}")


def input_digests(task: Task) -> dict[str, Any]:
  """`task`'s data and rewards, as `inputs.json` records them: `data.<split>` (rows and a
  digest of every example, columns included, in order) and `rewards` (name -> weight and a
  digest of its source; a built-in task's reward is its `reward` method)."""
  out: dict[str, Any] = {}
  for split in SPLITS:
    examples = task.examples(split)
    out[f"data.{split}"] = {"rows": len(examples), "digest": _digest(
        [dataclasses.asdict(e) for e in examples])}
  rewards = getattr(task, "rewards", None)
  if rewards:
    out["rewards"] = {r.name: {"weight": float(getattr(r, "weight", 1.0)),
                               "source": _source(r.fn)} for r in as_reward_functions(rewards)}
  else:
    out["rewards"] = {"reward": {"weight": 1.0, "source": _source(task.reward)}}
  return out


def _changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
  """What differs between two records, in words."""
  out = []
  for split in SPLITS:
    key = f"data.{split}"
    a, b = old.get(key), new[key]
    if a != b:
      rows = ("" if a is None or a.get("rows") == b["rows"]
              else f": {a.get('rows')} -> {b['rows']} rows")
      out.append(f"the {split} split's rows{rows or ' (same count, other contents or order)'}")
  before, after = old.get("rewards") or {}, new["rewards"]
  for name in sorted(before.keys() | after.keys()):
    a, b = before.get(name), after.get(name)
    if a is None:
      out.append(f"reward {name!r} added")
    elif b is None:
      out.append(f"reward {name!r} removed")
    else:
      if a.get("weight") != b["weight"]:
        out.append(f"reward {name!r}'s weight {a.get('weight')} -> {b['weight']}")
      if a.get("source") != b["source"]:
        out.append(f"reward {name!r}'s source code")
  return out


def check_inputs(run_dir: Path, task: Task, *, started: bool, accept: bool, write: bool,
                 log: Callable[[str], None]) -> None:
  """Record `task`'s inputs in `run_dir/inputs.json`, or on a resume (`started`) compare them
  with the record: a change is refused naming it, or with `accept` logged and recorded.
  `write`: whether this process writes the record (process 0).

  Raises:
    ConfigError: the data or rewards changed since the run started, and `accept` is off.
    CheckpointError: the record is not a JSON object.
  """
  path = Path(run_dir) / INPUTS_FILE
  new = input_digests(task)
  if started and path.is_file():
    old = read_object(path, CheckpointError, "restore it from a copy, or delete it to "
                      "continue without the check")
    changes = _changes(old, new)
    if changes and not accept:
      raise ConfigError(
          f"the run in {run_dir} started on other inputs: {'; '.join(changes)} changed since "
          f"(recorded in {path}). Continuing would train the rest of the run on them under the "
          "old data position. Restore them, use a new run_dir, or pass "
          "--accept-changed-inputs to continue knowingly")
    if changes:
      log(f"resuming with changed inputs (accept_changed_inputs): {'; '.join(changes)}")
    elif old == new:
      return
  if write:
    write_text_atomic(path, json.dumps(new, indent=1) + "\n")
