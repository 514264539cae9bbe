"""Orbax checkpoints of a whole training state (any pytree) plus JSON metadata.

Orbax writes each step into a temporary directory and renames it when complete, so a
process killed mid-save leaves the previous checkpoints intact and no half-written step
that looks finished. A directory that cannot be restored is reported, never deleted.

Saving is synchronous: `save` blocks until the step is on disk anyway, and a failed
asynchronous save leaves orbax's background threads unjoinable, so the process could not
exit after the error.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from specjax.errors import CheckpointError, ConfigError


class Checkpointer:
  """Saves and restores `(state, meta)` pairs by step.

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
    try:
      self._manager = ocp.CheckpointManager(
          self.directory,
          options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=False),
          item_names=("state", "meta"))
    except OSError as err:
      raise CheckpointError(f"checkpoint directory {self.directory} cannot be created or read "
                            f"({type(err).__name__}: {err}); pass a writable directory") from err

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    """Save `state` (a pytree of arrays) and `meta` (JSON-serialisable) as `step`; blocks.

    Raises:
      CheckpointError: the step could not be written (a read-only or full disk, ...); the
        checkpoints saved before are intact.
    """
    try:
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
      self._manager.wait_until_finished()
    except OSError as err:
      raise CheckpointError(
          f"checkpoint step {step} cannot be written to {self.directory} ({type(err).__name__}"
          f": {err}). Earlier checkpoints are intact; make the directory writable (and check "
          "free space) or pass another one.") from err

  def restore(self, abstract_state: Any, step: int | None = None
              ) -> tuple[Any, dict[str, Any], int] | None:
    """Restore `step` (default: the latest) into the structure of `abstract_state`.

    `abstract_state` may hold `jax.ShapeDtypeStruct`s (with shardings) or arrays. Returns
    None when the directory holds no checkpoint.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      return None
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    except Exception as err:  # orbax raises many types; re-raise with the path and the fix.
      raise CheckpointError(
          f"checkpoint step {step} in {self.directory} cannot be restored ({type(err).__name__}"
          f": {err}). Nothing was deleted; move it aside or pass another directory.") from err
    return restored["state"], dict(restored["meta"]), step

  def close(self) -> None:
    self._manager.close()
