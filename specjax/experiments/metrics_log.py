"""Where a run's scalars go besides metrics.jsonl: TensorBoard always, Weights & Biases when
asked (`Logging.wandb_project`; the optional `wandb` package).

A resumed run continues the same W&B run: its id is kept in the run directory
(`wandb_id.txt`) and passed back with `resume="allow"`; steps logged again after a resume
replace nothing in TensorBoard (it keeps the latest value per step) and W&B drops steps below
the run's last one, so both show each step once.

TensorBoard events are written in the caller's thread and flushed at every record, not by
tensorboardX's `SummaryWriter`: that one writes from a thread behind a bounded queue, and when
a write fails (a full disk) the thread dies and the next record blocks the run forever. Here a
failed write raises a `StorageError` naming the directory, in the step that wrote it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import secrets
import time
from pathlib import Path
from typing import Any, Mapping

from specjax.checks import require_field, require_ints
from specjax.errors import ConfigError
from specjax.files import storage, write_text_atomic

WANDB_ID_FILE = "wandb_id.txt"


@dataclasses.dataclass(frozen=True)
class Logging:
  """Metrics backends of a run beside metrics.jsonl and TensorBoard.

  Attributes:
    wandb_project: a Weights & Biases project to log every step's scalars to (None: no W&B;
      `pip install 'specjax[wandb]'`). The run's config is the W&B run's config.
    wandb_entity: the W&B team or user (None: the account's default).
    wandb_mode: "online", "offline" (synced later with `wandb sync`) or "disabled".
    samples_every: write the first rows' prompts, completions and rewards as TensorBoard
      text (and a W&B HTML panel) every this many steps (0: never).
  """

  wandb_project: str | None = None
  wandb_entity: str | None = None
  wandb_mode: str = "online"
  samples_every: int = 10

  def __post_init__(self):
    require_ints(self, ("samples_every",), 0, "log.")
    require_field(self, "wandb_mode", self.wandb_mode in ("online", "offline", "disabled"),
                  "allowed 'online', 'offline' or 'disabled'", "log.")
    if self.wandb_project is not None:
      require_field(self, "wandb_project", isinstance(self.wandb_project, str)
                    and bool(self.wandb_project), "must be a non-empty str or None", "log.")
      if importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"log.wandb_project={self.wandb_project!r} needs the wandb package: "
                          "pip install 'specjax[wandb]' (or leave log.wandb_project None)")


class _EventFile:
  """One TensorBoard events file of `directory`, written synchronously."""

  def __init__(self, directory: Path):
    from tensorboardX.event_file_writer import EventsWriter
    self.directory = directory
    with self._storage():
      directory.mkdir(parents=True, exist_ok=True)
      self._events = EventsWriter(str(directory / "events"))

  def _storage(self):
    return storage(self.directory, "TensorBoard events in")

  def write(self, step: int, summaries: list) -> None:
    """Each `tensorboardX.summary` protobuf as an event at `step`, then flushed."""
    from tensorboardX.proto.event_pb2 import Event
    now = time.time()
    try:
      with self._storage():
        for summary in summaries:
          self._events.write_event(Event(wall_time=now, step=int(step), summary=summary))
        self._events.flush()
    except BaseException:
      self.abandon()
      raise

  def abandon(self) -> None:
    """Close the file without flushing what a failed write left buffered (its flush would
    fail again, later, from the garbage collector)."""
    recordio = getattr(self._events, "_py_recordio_writer", None)
    handle = getattr(recordio, "_writer", None)
    if handle is not None:
      try:
        handle.close()
      except OSError:
        pass  # the buffered tail of a failed record: already reported

  def close(self) -> None:
    with self._storage():
      self._events.close()


class MetricsLog:
  """TensorBoard (and W&B) scalars of one run; only the process that logs makes one.

  Raises (from any method):
    StorageError: a TensorBoard file cannot be written (full disk, read-only file system, a
      vanished directory), naming the directory and the cause.
  """

  def __init__(self, run_dir: str | Path, logging: Logging, config: Mapping[str, Any]):
    run_dir = Path(run_dir)
    self._run_dir = run_dir
    self._tensorboard = _EventFile(run_dir / "tensorboard")
    self._wandb = None
    if logging.wandb_project is not None:
      import wandb
      id_file = run_dir / WANDB_ID_FILE
      if not id_file.is_file():
        with storage(id_file, "W&B run id file"):
          write_text_atomic(id_file, secrets.token_hex(8) + "\n")
      self._wandb = wandb.init(project=logging.wandb_project, entity=logging.wandb_entity,
                               mode=logging.wandb_mode, dir=str(run_dir),
                               id=id_file.read_text().strip(), resume="allow",
                               config=dict(config), name=run_dir.name)

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    from tensorboardX.summary import scalar
    self._tensorboard.write(step, [scalar(name, float(value)) for name, value in values.items()])
    if self._wandb is not None:
      with storage(self._run_dir / "wandb", "W&B files in"):
        self._wandb.log(dict(values), step=step)

  def text(self, step: int, name: str, text: str) -> None:
    """A text record (markdown): TensorBoard's text tab, and with W&B a `wandb.Html` panel
    (the markdown as preformatted text) under the same name."""
    from tensorboardX.summary import text as text_summary
    self._tensorboard.write(step, [text_summary(name, text)])
    if self._wandb is not None:
      import html

      import wandb
      with storage(self._run_dir / "wandb", "W&B files in"):
        self._wandb.log({name: wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

  def close(self) -> None:
    self._tensorboard.close()
    if self._wandb is not None:
      self._wandb.finish()

  def abandon(self) -> None:
    """End a run that failed: close the TensorBoard file without writing more, and finish
    the W&B run (what it logged is kept; a resume continues it)."""
    self._tensorboard.abandon()
    if self._wandb is not None:
      self._wandb.finish()
