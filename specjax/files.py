"""Files specjax writes and reads back: files and whole directories replaced atomically,
JSON objects read from a user's files with errors that name the file and the place, and one
owner per run directory (`DirectoryLock`).

Directories: a writer builds the new version in a temporary sibling (`.<name>.tmp-<pid>`),
fsyncs it, and calls `swap_into_place`: the old directory is renamed to a backup sibling,
the new one renamed in, the backup deleted. At every instant either `path` holds a complete
version or (between the two renames) the backup does; readers call `existing(path, marker)`,
writers call `recover(path)` first (`save_hf`, `save_eagle3`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import os
import shutil
import socket
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

from specjax.errors import CheckpointError, RunDirectoryInUse, SpecjaxError, StorageError


def backup_dirs(path: Path) -> list[Path]:
  """Backups `swap_into_place` leaves beside `path` while it swaps, oldest first."""
  found = path.parent.glob(f".{glob.escape(path.name)}.old-*")
  return sorted((p for p in found if p.is_dir()), key=lambda p: p.stat().st_mtime)


def existing(path: Path, marker: str) -> Path:
  """`path`, or, when a writer was killed between the two renames of `swap_into_place` so
  that `path` is missing, the complete previous version it had moved aside (one holding the
  file `marker`; the next `recover` puts it back)."""
  if path.exists():
    return path
  backups = [b for b in backup_dirs(path) if (b / marker).is_file()]
  if not backups:
    return path
  warnings.warn(f"{path} is missing: an interrupted write left the previous version at "
                f"{backups[-1]}; reading that (the next write to {path} restores it)",
                stacklevel=3)
  return backups[-1]


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
  """Write the file `path` by `write(tmp)` on a temporary sibling (`.<name>.tmp-<pid>`),
  fsynced and renamed over `path`: a killed writer leaves the old file or the new one, never
  half of one. The temporary is removed when `write` fails."""
  path = Path(path)
  tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
  try:
    write(tmp)
    fsync(tmp)
    os.replace(tmp, path)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise


def write_text_atomic(path: Path, text: str) -> None:
  """`write_atomic` of a text file (UTF-8)."""
  write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def fsync(path: Path) -> None:
  """Flush `path` (a file or a directory's entries) to disk."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


@contextlib.contextmanager
def storage(path: str | os.PathLike, what: str) -> Iterator[None]:
  """Writes to `path` (a run's `what`: "metrics file", "TensorBoard events", ...) whose
  `OSError` (a full disk, a read-only file system, a vanished directory) becomes one
  `StorageError` naming the file and the cause."""
  try:
    yield
  except StorageError:
    raise
  except OSError as err:
    cause = os.strerror(err.errno) if err.errno else str(err) or type(err).__name__
    raise StorageError(f"the {what} {path} cannot be written: {cause}") from err


def link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
  try:
    os.link(src, dst)  # the old tree is deleted after the swap, so sharing inodes is safe
  except OSError:
    shutil.copy2(src, dst)


def _pid_alive(name: str) -> bool:
  """Whether the process whose id ends the sibling directory `name` still runs."""
  try:
    pid = int(name.rsplit("-", 1)[1])
  except (IndexError, ValueError):
    return False
  if pid == os.getpid():
    return False  # a leftover of an earlier process that had our id
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def recover(path: Path) -> None:
  """Undo what a killed writer left beside `path`: restore the previous version it had moved
  aside if `path` is missing, else delete that backup; delete half-written temporaries
  (`.<name>.tmp-<pid>`).

  Directories of a writer still running in another process are left alone (two writers of
  one path at once are not supported, but this keeps them from destroying each other's work).
  """
  backups = [b for b in backup_dirs(path) if not _pid_alive(b.name)]
  if backups and not path.exists():
    os.rename(backups.pop(), path)
  stale = backups + [t for t in path.parent.glob(f".{glob.escape(path.name)}.tmp-*")
                     if not _pid_alive(t.name)]
  for directory in stale:
    shutil.rmtree(directory, ignore_errors=True)


def replace_directory(path: Path, write: Callable[[Path], None],
                      written: Callable[[str], bool]) -> None:
  """Replace the directory `path` by the one `write(tmp)` builds, never leaving less than one
  complete version: what a killed earlier writer left is undone first (`recover`), the new
  version is built in a temporary sibling, the old one's entries that `written(name)` does
  not claim are carried over (hard links where possible), and the result is swapped in
  (`swap_into_place`).

  Raises:
    CheckpointError: `path` exists and is not a directory.
    OSError: writing failed (e.g. ENOSPC); `path` is unchanged and the temporary removed.
  """
  path = Path(os.path.abspath(path))
  path.parent.mkdir(parents=True, exist_ok=True)
  recover(path)
  if path.exists() and not path.is_dir():
    raise CheckpointError(f"{path} exists and is not a directory: allowed a directory or a "
                          "new path")
  tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir()
  try:
    try:
      write(tmp)
      if path.is_dir():
        _carry_over(path, tmp, written)
        shutil.copymode(path, tmp)
      fsync(tmp)
    except OSError as err:
      err.add_note(f"writing the new version of {path} in {tmp} failed; {path} is unchanged")
      raise
    swap_into_place(tmp, path)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _carry_over(old: Path, new: Path, written: Callable[[str], bool]) -> None:
  """Copy the entries of `old` that the new version does not write into `new`."""
  for entry in old.iterdir():
    if written(entry.name):
      continue
    target = new / entry.name
    if entry.is_symlink():
      os.symlink(os.readlink(entry), target)
    elif entry.is_dir():
      shutil.copytree(entry, target, symlinks=True, copy_function=link_or_copy)
    else:
      link_or_copy(entry, target)


def swap_into_place(new: Path, path: Path) -> None:
  """Rename the complete directory `new` to `path`, replacing any directory there.

  rename(2) is atomic but cannot replace a non-empty directory, so the old one is first
  renamed to a backup sibling. A crash between the two renames leaves no directory at `path`
  but the complete old export in the backup: `load_hf` reads it and the next `save_hf`
  restores it (see `recover`).
  """
  try:
    os.rename(new, path)  # works when `path` is absent or an empty directory
  except OSError as err:
    if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
      raise
  else:
    fsync(path.parent)
    return
  backup = path.parent / f".{path.name}.old-{os.getpid()}"
  try:
    os.rename(path, backup)
  except OSError as err:  # e.g. `path` is a mount point
    raise CheckpointError(f"{path}: cannot move the existing directory aside to replace it "
                          f"atomically ({err}); save into a subdirectory of it instead"
                          ) from err
  try:
    os.rename(new, path)
  except BaseException:
    os.rename(backup, path)
    raise
  fsync(path.parent)
  shutil.rmtree(backup, ignore_errors=True)


class DuplicateKey(SpecjaxError, ValueError):
  """A JSON object that names one key twice (`strict_json`); `key` is the key. Its readers
  turn it into their own error, naming the file and the row."""

  def __init__(self, key: str):
    super().__init__(key)
    self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  out = {}
  for key, value in pairs:
    if key in out:
      raise DuplicateKey(key)
    out[key] = value
  return out


def strict_json(text: str) -> Any:
  """`json.loads`, except that an object naming a key twice raises `DuplicateKey` (Python's
  parser silently keeps the last value: a row whose reward column appears twice would be
  scored on one of them without a word)."""
  return json.loads(text, object_pairs_hook=_unique_keys)


def read_object(file: Path, error: type[Exception], remedy: str) -> dict[str, Any]:
  """The JSON object in `file`; `error` naming the file, the position and `remedy` when the
  text is not UTF-8, not JSON, not an object, or an object that names a key twice."""
  try:
    value = strict_json(Path(file).read_text(encoding="utf-8"))
  except DuplicateKey as err:
    raise error(f"{file}: an object names the key {err.key!r} twice (JSON would keep only "
                f"the last); every key may appear once per object; {remedy}") from None
  except json.JSONDecodeError as err:
    raise error(f"{file}: malformed JSON at line {err.lineno} column {err.colno} "
                f"(char {err.pos}): {err.msg}; {remedy}") from None
  except UnicodeDecodeError as err:
    raise error(f"{file}: not UTF-8 text (byte {err.start}): {err.reason}; {remedy}") from None
  if not isinstance(value, dict):
    raise error(f"{file}: holds a JSON {type(value).__name__}, expected an object")
  return value


LOCK_FILE = ".lock"


class DirectoryLock:
  """One owner per run directory: an exclusive `flock` on `<directory>/.lock`, which holds
  the owner's host, pid and start time.

  The operating system drops the lock when its owner dies (killed, crashed, its machine
  rebooted for a local disk), so a stale lock is taken over by the next run, which says
  whose it was; a live owner's is refused with `RunDirectoryInUse` naming it. Use as a
  context manager around everything the run writes.
  """

  def __init__(self, directory: str | os.PathLike, what: str = "run"):
    self.directory = Path(directory)
    self.what = what
    self.previous: str | None = None  # the holder a stale lock named, once taken over
    self._fd: int | None = None

  def __enter__(self) -> DirectoryLock:
    self.directory.mkdir(parents=True, exist_ok=True)
    path = self.directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
      os.close(fd)
      raise RunDirectoryInUse(
          f"{self.directory} is in use by a run of {holder}; wait for that run to end or stop "
          f"it, or give this {self.what} another directory (--run-dir)") from None
    except BaseException:
      os.close(fd)
      raise
    self.previous = os.pread(fd, 4096, 0).decode(errors="replace").strip() or None
    owner = (f"host {socket.gethostname()} pid {os.getpid()} since "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, owner, 0)
    self._fd = fd
    return self

  def __exit__(self, *exc) -> None:
    if self._fd is not None:
      os.ftruncate(self._fd, 0)  # no holder named once released
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None
