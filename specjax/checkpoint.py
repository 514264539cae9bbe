"""Orbax checkpoints of a whole training state (any pytree) plus JSON metadata, verified on
restore.

Orbax writes each step into a temporary directory and renames it when complete, so a
process killed mid-save leaves the previous checkpoints intact and no half-written step
that looks finished. A directory that cannot be restored is reported, never deleted.

Orbax does not notice bytes that change after the save (a flipped bit on disk, a truncated
copy, an edit): such a step restores without error into different weights. So after each
save the primary process records the size and sha256 of every file of the step in
`specjax_digest.json` inside the step directory, and `restore` checks them before orbax
reads a byte. A step that fails is an error naming the file and the other steps; it is never
skipped for an older one, since resuming from an older step silently repeats training the
user may not want to repeat. A step without the file (written before specjax recorded
digests) restores with a warning.

With several processes (`jax.distributed`) every process calls `save` and `restore` together
on a directory they share: each writes its own shards and reads the ones its devices need,
so a state saved on one topology restores on another (pass the new shardings in the abstract
state); `save` returns on every process once the digest is written.

Saving is synchronous: `save` blocks until the step is on disk anyway, and a failed
asynchronous save leaves orbax's background threads unjoinable, so the process could not
exit after the error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from specjax.checks import is_int
from specjax.errors import CheckpointError, ConfigError
from specjax.files import fsync, write_text_atomic

DIGEST_FILE = "specjax_digest.json"
_DIGEST_FORMAT = 1
_CHUNK_BYTES = 1 << 20  # hashing streams the files: a checkpoint may not fit in memory

# What tensorstore's errors (a ValueError, not an OSError) say when the disk, not the state,
# is at fault: a full or read-only file system, a missing or foreign directory.
_STORAGE_FAULT = re.compile(r"RESOURCE_EXHAUSTED|PERMISSION_DENIED|os_error_code|No space left|"
                            r"Read-only file system|Permission denied|Not a directory")


def _storage_fault(err: BaseException) -> bool:
  """Whether `err`, raised while saving, is the storage's fault rather than the state's."""
  return isinstance(err, OSError) or (isinstance(err, ValueError)
                                      and bool(_STORAGE_FAULT.search(str(err))))


_FAULT_NAMES = ("No space left on device", "Read-only file system", "Permission denied",
                "Not a directory", "No such file or directory")


def _fault_name(err: BaseException) -> str:
  """The operating system's name of a storage fault (tensorstore buries it in a long text)."""
  if isinstance(err, OSError) and err.errno:
    return os.strerror(err.errno)
  text = str(err)
  return next((name for name in _FAULT_NAMES if name in text), "a storage fault")


class _DropOrbaxErrors(logging.Filter):
  """Drops orbax's error records (its writer threads log each failure with a traceback before
  `save` re-raises it): the `CheckpointError` that follows names the cause once."""

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR or "orbax" not in record.pathname


@contextlib.contextmanager
def _quiet_orbax_errors():
  """Orbax's error records dropped while saving, and for good once a save failed on its
  storage: the writes it left in flight fail in orbax's threads after `save` has raised (the
  run is then ending on the `CheckpointError`), each logging a traceback."""
  logger, drop = logging.getLogger("absl"), _DropOrbaxErrors()
  logger.addFilter(drop)
  keep = False
  try:
    yield
  except BaseException as err:
    keep = _storage_fault(err)  # decided before the filter could be removed: no gap
    raise
  finally:
    if not keep:
      logger.removeFilter(drop)


class _DropAbandonedWrites(logging.Filter):
  """Drops asyncio's "exception was never retrieved" records of the orbax writes a storage
  fault left behind: one per array, each a full traceback, after the save already failed."""

  def filter(self, record: logging.LogRecord) -> bool:
    text = record.getMessage()
    return not ("never retrieved" in text and bool(_STORAGE_FAULT.search(text)))


def _abandoned_write(exc: BaseException | None) -> bool:
  """Whether `exc`, raised where nothing can catch it, is an orbax write a failed save left:
  its storage fault, a tensorstore callback into the event loop orbax has closed, or its
  coroutine finalised as the interpreter exits."""
  return exc is not None and (_storage_fault(exc)
                              or (isinstance(exc, RuntimeError)
                                  and str(exc) == "Event loop is closed")
                              or (isinstance(exc, ImportError)
                                  and "Python is likely shutting down" in str(exc)))


_quieted = False


def _quiet_abandoned_writes() -> None:
  """Once a save fails on its storage, the writes orbax has in flight fail one by one in
  its threads, as the save unwinds and at exit, each printing a traceback (a hundred on a
  small state): the `CheckpointError` names the cause once, so those are dropped from the
  first save on. Every other unraisable error and asyncio record still prints."""
  global _quieted
  if _quieted:
    return
  _quieted = True
  logging.getLogger("asyncio").addFilter(_DropAbandonedWrites())
  previous = sys.unraisablehook

  def hook(unraisable):
    if not _abandoned_write(unraisable.exc_value):
      previous(unraisable)

  sys.unraisablehook = hook


def _sha256(path: Path) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK_BYTES):
      digest.update(chunk)
  return digest.hexdigest()


def _is_digest_file(name: str) -> bool:
  """The manifest or a temporary a killed writer left of it: never part of the digest."""
  return name == DIGEST_FILE or name.startswith(f".{DIGEST_FILE}.tmp-")


def _step_files(step_dir: Path) -> dict[str, Path]:
  """Every file below `step_dir` by its relative POSIX path, the manifest excluded."""
  files = {}
  for root, _, names in os.walk(step_dir):
    for name in names:
      path = Path(root) / name
      relative = path.relative_to(step_dir).as_posix()
      if not (path.parent == step_dir and _is_digest_file(name)):
        files[relative] = path
  return dict(sorted(files.items()))


def _write_digest(step_dir: Path) -> None:
  """Record the size and sha256 of every file of `step_dir` in its `DIGEST_FILE`.

  Written to a temporary file, fsynced and renamed, so the manifest is either absent or
  complete: a torn one would make an intact step look corrupted.
  """
  files = {relative: {"size": path.stat().st_size, "sha256": _sha256(path)}
           for relative, path in _step_files(step_dir).items()}
  text = json.dumps({"format": _DIGEST_FORMAT, "algorithm": "sha256", "files": files},
                    indent=1, sort_keys=True)
  write_text_atomic(step_dir / DIGEST_FILE, text)
  fsync(step_dir)


def _read_digest(step_dir: Path) -> dict[str, tuple[int, str]]:
  """The `DIGEST_FILE` of `step_dir` as relative path -> (size, sha256).

  Raises:
    FileNotFoundError: the step has no manifest.
    ValueError: the manifest is not one `_write_digest` writes (the message says how).
  """
  try:
    manifest = json.loads((step_dir / DIGEST_FILE).read_text())
  except UnicodeDecodeError as err:
    raise ValueError(f"it is not UTF-8 text ({err})") from err
  except json.JSONDecodeError as err:
    raise ValueError(f"it is not JSON ({err})") from err
  if not (isinstance(manifest, dict) and manifest.get("format") == _DIGEST_FORMAT
          and manifest.get("algorithm") == "sha256"
          and isinstance(manifest.get("files"), dict)):
    raise ValueError(f'it is not a format-{_DIGEST_FORMAT} sha256 manifest (expected an '
                     '{"format": 1, "algorithm": "sha256", "files": {...}} object)')
  recorded = {}
  for relative, entry in manifest["files"].items():
    size = entry.get("size") if isinstance(entry, dict) else None
    sha = entry.get("sha256") if isinstance(entry, dict) else None
    if not (isinstance(size, int) and size >= 0 and isinstance(sha, str) and len(sha) == 64):
      raise ValueError(f"its entry for {relative!r} is {entry!r}, expected "
                       '{"size": <int >= 0>, "sha256": <64 hex digits>}')
    recorded[relative] = (size, sha)
  return recorded


def _check_step(step: Any, allow_none: bool) -> None:
  """A step is an int >= 0 (orbax names directories by it; a string would be reported as a
  missing step that looks present, a negative one saved as if it were valid)."""
  if step is None and allow_none:
    return
  if not is_int(step) or step < 0:
    raise ConfigError(f"step={step!r} is invalid: allowed an int >= 0"
                      + (", or None for the latest" if allow_none else ""))


def _check_meta(meta: Any) -> None:
  """`meta` must be a dict that JSON can write (orbax would fail in a background thread,
  naming no key)."""
  if not isinstance(meta, dict):
    raise ConfigError(f"meta={meta!r} is invalid: allowed a dict of JSON values")
  for key, value in meta.items():
    try:
      json.dumps({key: value})
    except (TypeError, ValueError) as err:
      raise ConfigError(f"meta[{key!r}]={value!r} is invalid: it cannot be written as JSON "
                        f"({err}); allowed str, int, float, bool, None, lists and dicts of "
                        "them") from None


def _leaf_problems(saved: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
  """How the leaves `wanted` (name -> ShapeDtypeStruct of the state to restore into) differ
  from `saved` (name -> orbax array metadata of the step): missing, added, reshaped or of
  another dtype."""
  problems = [f"{name} is in the checkpoint but not in the state" for name in
              sorted(saved.keys() - wanted.keys())]
  problems += [f"{name} is in the state but not in the checkpoint" for name in
               sorted(wanted.keys() - saved.keys())]
  for name in sorted(saved.keys() & wanted.keys()):
    have, want = saved[name], wanted[name]
    if not (hasattr(want, "shape") and hasattr(want, "dtype")):
      continue  # a Python scalar: restored as saved
    if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
      continue  # a key is stored as its uint32 data, of another shape and dtype
    have_shape, have_dtype = getattr(have, "shape", None), getattr(have, "dtype", None)
    if have_shape is not None and tuple(have_shape) != tuple(want.shape):
      problems.append(f"{name} has shape {tuple(have_shape)} in the checkpoint and "
                      f"{tuple(want.shape)} in the state")
    elif have_dtype is not None and np.dtype(have_dtype) != np.dtype(want.dtype):
      problems.append(f"{name} has dtype {np.dtype(have_dtype)} in the checkpoint and "
                      f"{np.dtype(want.dtype)} in the state (it would be cast)")
  return problems


def _first_mismatch(step_dir: Path, recorded: dict[str, tuple[int, str]]) -> str | None:
  """What is wrong with the first file of `step_dir` that differs from `recorded`, or None.

  Missing, added and resized files are found before any file is hashed, so a truncated
  step is reported without reading the rest of it.
  """
  present = _step_files(step_dir)
  for relative in sorted(recorded.keys() | present.keys()):
    if relative not in present:
      return f"{relative} is missing (the manifest lists it with {recorded[relative][0]} bytes)"
    if relative not in recorded:
      return f"{relative} is not in the manifest (it was added after the save)"
    size = present[relative].stat().st_size
    if size != recorded[relative][0]:
      return f"{relative} is {size} bytes, the manifest recorded {recorded[relative][0]}"
  for relative, (_, expected) in recorded.items():
    actual = _sha256(present[relative])
    if actual != expected:
      return (f"{relative} has sha256 {actual[:16]}..., the manifest recorded "
              f"{expected[:16]}... (same size: its bytes changed)")
  return None


class Checkpointer:
  """Saves and restores `(state, meta)` pairs by step; restore verifies the step's digest.

  Args:
    directory: where step directories live (created if missing).
    max_to_keep: newest checkpoints kept; older ones are removed after a successful save.
  """

  def __init__(self, directory: str | os.PathLike, max_to_keep: int = 3):
    self.directory = Path(directory).absolute()
    if self.directory.exists() and not self.directory.is_dir():
      raise CheckpointError(f"checkpoint path {self.directory} exists and is not a directory")
    if not (isinstance(max_to_keep, int) and max_to_keep >= 1):
      raise ConfigError(f"max_to_keep={max_to_keep!r} is invalid: must be an int >= 1 (0 "
                        "would keep no checkpoint to resume from)")
    # Pinned (it is orbax's default) so that `step_dir` names the directory orbax writes.
    self._name_format = ocp.step.standard_name_format()
    try:
      self._manager = ocp.CheckpointManager(
          self.directory,
          options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=False,
                                               step_name_format=self._name_format),
          item_names=("state", "meta"))
    except OSError as err:
      raise CheckpointError(f"checkpoint directory {self.directory} cannot be created or read "
                            f"({type(err).__name__}: {err}); pass a writable directory") from err

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def step_dir(self, step: int) -> Path:
    """The directory that holds `step` (and its `DIGEST_FILE`)."""
    return self.directory / self._name_format.build_name(step)

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    """Save `state` (a pytree of arrays) and `meta` (JSON-serialisable) as `step`; blocks.

    Orbax skips a step not above the latest one (and writes nothing); then no digest is
    written either, so the existing step's manifest is never recomputed over bytes that may
    have changed since.

    Raises:
      ConfigError: `step` is not an int >= 0, or `meta` cannot be written as JSON.
      CheckpointError: the step could not be written (a read-only or full disk, ...); the
        checkpoints saved before are intact.
    """
    _check_step(step, allow_none=False)
    _check_meta(meta)
    _quiet_abandoned_writes()
    try:
      with _quiet_orbax_errors():
        saved = self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        self._manager.wait_until_finished()
    except (OSError, ValueError) as err:
      if not _storage_fault(err):
        raise
      self._drop_partial(step)
      detail = str(err).splitlines()[0] if str(err) else ""
      if len(detail) > 400:  # tensorstore's texts run to kilobytes: keep the start and cause
        detail = f"{detail[:400]} ...; {_fault_name(err)}"
      raise CheckpointError(
          f"checkpoint step {step} cannot be written to {self.directory} ({type(err).__name__}"
          f": {detail}). Earlier checkpoints are intact; make the directory writable (and check "
          "free space) or pass another one.") from None
    # One writer: every process sees the same finished step directory (orbax has synced
    # them), and two writers renaming over one manifest would be a needless race.
    if not saved:
      latest = self.latest_step()
      warnings.warn(f"checkpoint step {step} was not saved: {self.directory} already holds step "
                    f"{latest}, and only a step above the latest is written (the existing one "
                    "is unchanged)", stacklevel=2)
      return
    step_dir = self.step_dir(step)
    try:
      if jax.process_index() == 0:
        _write_digest(step_dir)
    except OSError as err:
      raise CheckpointError(
          f"checkpoint step {step} was written to {step_dir} but its digest {DIGEST_FILE} "
          f"cannot be ({type(err).__name__}: {err}); the step restores only with a warning "
          "that it is unverified. Make the directory writable (and check free space) or pass "
          "another one.") from err
    finally:
      if jax.process_count() > 1:
        # Every process returns once the step is verifiable: a restore or a listing right
        # after the save must not find the digest missing.
        multihost_utils.sync_global_devices(f"specjax checkpoint {step} digest")

  def _drop_partial(self, step: int) -> None:
    """Remove what a failed save of `step` left (orbax's temporary directory): on a full disk
    it holds the space the next save needs. Process 0 only, after every process failed."""
    if jax.process_index() != 0:
      return
    for partial in self.directory.glob(f"{self.step_dir(step).name}.orbax-checkpoint-tmp*"):
      shutil.rmtree(partial, ignore_errors=True)

  def verify(self, step: int) -> bool:
    """Check every file of `step` against its `DIGEST_FILE`; False (with a warning) when the
    step has none, True when all match.

    Raises:
      CheckpointError: a file is missing, added, resized or changed, or the manifest is
        unreadable. The message names the step directory, the first bad file and the other
        steps to restore instead.
    """
    step_dir = self.step_dir(step)
    try:
      recorded = _read_digest(step_dir)
    except FileNotFoundError:
      warnings.warn(
          f"checkpoint step {step} at {step_dir} has no {DIGEST_FILE} (it was written before "
          "specjax recorded digests, or the process was killed between the save and the "
          "digest): its bytes cannot be verified and are restored as they are", stacklevel=3)
      return False
    except (OSError, ValueError) as err:
      raise self._corrupted(step, f"its manifest {DIGEST_FILE} cannot be used: {err}") from err
    try:
      problem = _first_mismatch(step_dir, recorded)
    except OSError as err:
      raise self._corrupted(step, f"a file cannot be read ({type(err).__name__}: {err})"
                            ) from err
    if problem is not None:
      raise self._corrupted(step, problem)
    return True

  def _corrupted(self, step: int, problem: str) -> CheckpointError:
    others = [s for s in self.all_steps() if s != step]
    if others:
      remedy = (f"Restore another step ({', '.join(map(str, others))} are available) with "
                f"`restore(..., step=N)`, or delete {self.step_dir(step)} (or move it out of "
                f"{self.directory}) so that a resumed run starts from step {max(others)}.")
    else:
      remedy = (f"No other step is in {self.directory}: restore {self.step_dir(step)} from a "
                "copy, or delete it to start over.")
    return CheckpointError(
        f"checkpoint step {step} at {self.step_dir(step)} is corrupted: {problem}. Restoring it "
        f"would load different weights than were saved, so nothing was restored (or deleted). "
        f"{remedy}")

  def restore(self, abstract_state: Any, step: int | None = None
              ) -> tuple[Any, dict[str, Any], int] | None:
    """Restore `step` (default: the latest) into the structure of `abstract_state`.

    `abstract_state` may hold `jax.ShapeDtypeStruct`s (with shardings) or arrays. Returns
    None when the directory holds no checkpoint. Every process verifies the step's digest
    first (see `verify`), so all of them raise together rather than some waiting forever in
    orbax for the others.

    Raises:
      ConfigError: `step` is not an int >= 0 or None.
      CheckpointError: `step` is not in the directory, fails its digest (an older step is
        never restored in its place), holds leaves that differ from `abstract_state`'s (in
        name, shape or dtype), or orbax cannot read it.
    """
    _check_step(step, allow_none=True)
    step = self.latest_step() if step is None else int(step)
    if step is None:
      return None
    if step not in self.all_steps():
      raise CheckpointError(f"checkpoint step {step} is not in {self.directory} (available: "
                            f"{', '.join(map(str, self.all_steps())) or 'none'})")
    self.verify(step)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    self._check_leaves(step, abstract)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    except Exception as err:  # orbax raises many types; re-raise with the path and the fix.
      raise CheckpointError(
          f"checkpoint step {step} in {self.directory} cannot be restored ({type(err).__name__}"
          f": {err}). Nothing was deleted; move it aside or pass another directory.") from err
    return restored["state"], dict(restored["meta"]), step

  def _check_leaves(self, step: int, abstract: Any) -> None:
    """Raise a `CheckpointError` naming the leaves in which `step` differs from `abstract`.

    Orbax reports a different tree as a diff that suggests an option specjax does not expose,
    a different shape without naming the array, and casts a different dtype silently.
    """
    try:  # read by a handler of its own: a manager that has not saved knows no handlers
      saved = ocp.StandardCheckpointHandler().metadata(self.step_dir(step) / "state")
      saved = ocp.tree.to_flat_dict(getattr(saved, "tree", saved), sep=".")
    except Exception:  # unreadable metadata: orbax's restore reports what is wrong
      return
    if not saved:  # an empty tree: nothing to compare
      return
    problems = _leaf_problems(saved, ocp.tree.to_flat_dict(abstract, sep="."))
    if problems:
      more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
      raise CheckpointError(
          f"checkpoint step {step} at {self.step_dir(step)} does not match the state to "
          f"restore into: {'; '.join(problems[:5])}{more}. It was saved with another "
          "configuration (model, optimizer, drafter or training mode), or by a version of "
          "specjax whose train state held other fields: restore it with that configuration "
          "and version, or pass another directory. Nothing was restored or deleted.")

  def close(self) -> None:
    self._manager.close()
