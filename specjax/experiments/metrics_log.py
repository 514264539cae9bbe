"""Where a run's scalars go besides metrics.jsonl: TensorBoard always, Weights & Biases when
asked (`Logging.wandb_project`; the optional `wandb` package).

A resumed run continues the same W&B run: its id is kept in the run directory
(`wandb_id.txt`) and passed back with `resume="allow"`; steps logged again after a resume
replace nothing in TensorBoard (it keeps the latest value per step) and W&B drops steps below
the run's last one, so both show each step once.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import secrets
from pathlib import Path
from typing import Any, Mapping

from specjax.checks import require_field, require_ints
from specjax.errors import ConfigError
from specjax.files import write_text_atomic

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


class MetricsLog:
  """TensorBoard (and W&B) scalars of one run; only the process that logs makes one."""

  def __init__(self, run_dir: str | Path, logging: Logging, config: Mapping[str, Any]):
    from tensorboardX import SummaryWriter
    run_dir = Path(run_dir)
    self._tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
    self._wandb = None
    if logging.wandb_project is not None:
      import wandb
      id_file = run_dir / WANDB_ID_FILE
      if not id_file.is_file():
        write_text_atomic(id_file, secrets.token_hex(8) + "\n")
      self._wandb = wandb.init(project=logging.wandb_project, entity=logging.wandb_entity,
                               mode=logging.wandb_mode, dir=str(run_dir),
                               id=id_file.read_text().strip(), resume="allow",
                               config=dict(config), name=run_dir.name)

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    for name, value in values.items():
      self._tensorboard.add_scalar(name, value, step)
    if self._wandb is not None:
      self._wandb.log(dict(values), step=step)

  def text(self, step: int, name: str, text: str) -> None:
    """A text record (markdown): TensorBoard's text tab, and with W&B a `wandb.Html` panel
    (the markdown as preformatted text) under the same name."""
    self._tensorboard.add_text(name, text, step)
    if self._wandb is not None:
      import html

      import wandb
      self._wandb.log({name: wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

  def close(self) -> None:
    self._tensorboard.close()
    if self._wandb is not None:
      self._wandb.finish()
