"""Replacing a directory so that a crash never leaves less than one complete version.

A writer builds the new version in a temporary sibling (`.<name>.tmp-<pid>`), fsyncs it, and
calls `swap_into_place`: the old directory is renamed to a backup sibling, the new one
renamed in, the backup deleted. At every instant either `path` holds a complete version or
(between the two renames) the backup does; readers call `existing(path, marker)`, writers
call `recover(path)` first. Used by `specjax.models.save_hf`.
"""

from __future__ import annotations

import errno
import glob
import os
import shutil
import warnings
from pathlib import Path

from specjax.errors import CheckpointError


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


def fsync(path: Path) -> None:
  """Flush `path` (a file or a directory's entries) to disk."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


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
