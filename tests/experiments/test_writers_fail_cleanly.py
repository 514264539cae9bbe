"""A run whose files cannot be written (a full disk, a read-only file system) stops within
seconds with one message naming the file and the cause, never hangs and never floods the log,
and its last checkpoint resumes.

The regression these guard: tensorboardX's `SummaryWriter` writes from a thread behind a
bounded queue; on ENOSPC that thread died and the next record blocked the run forever.
"""

import errno
import io
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from support import child_env, tiny_experiment

from specjax.errors import StorageError
from specjax.experiments import grpo
from specjax.experiments.metrics_log import Logging, MetricsLog
from specjax.files import storage

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]


class FullDisk(io.BytesIO):
  """A file on a disk that fills after `room` writes: each later write raises ENOSPC. The
  writes before reach `real` (an open binary file) when one is given."""

  def __init__(self, room: int, real=None):
    super().__init__()
    self.room = room
    self.real = real

  def write(self, data):
    if self.room <= 0:
      raise OSError(errno.ENOSPC, "No space left on device")
    self.room -= 1
    return super().write(data) if self.real is None else self.real.write(data)

  def close(self):
    if self.real is not None:
      self.real.close()
    super().close()


def _finishes(fn, seconds: float):
  """`fn()`'s exception (None when it returned) if it ends within `seconds`; fails if not."""
  outcome = {}

  def target():
    try:
      fn()
      outcome["error"] = None
    except BaseException as err:  # noqa: BLE001 -- handed to the test as the outcome
      outcome["error"] = err

  thread = threading.Thread(target=target, daemon=True)
  thread.start()
  thread.join(seconds)
  assert not thread.is_alive(), f"still writing after {seconds} s: the writer hangs"
  return outcome["error"]


@pytest.mark.parametrize("room", range(10))
def test_a_tensorboard_disk_that_fills_stops_the_writer_with_the_directory_named(
    tmp_path, monkeypatch, room):
  monkeypatch.setattr("tensorboardX.record_writer.open_file", lambda path: FullDisk(room))

  def log_steps():
    log = MetricsLog(tmp_path, Logging(), {})
    for step in range(1, 40):
      log.scalars(step, {"reward/mean": 0.5, "spec/acceptance": 1.0})
      log.text(step, "samples", "1+2= -> 3")

  err = _finishes(log_steps, seconds=10)
  assert isinstance(err, StorageError), err
  assert str(err) == (f"the TensorBoard events in {tmp_path / 'tensorboard'} cannot be written: "
                      "No space left on device")


def test_storage_names_the_file_and_the_operating_systems_cause(tmp_path):
  with pytest.raises(StorageError, match=r"^the metrics file /dev/full cannot be written: No "
                                         r"space left on device$"):
    with storage("/dev/full", "metrics file"), open("/dev/full", "ab", buffering=0) as f:
      f.write(b"{}\n")
  gone = tmp_path / "gone" / "metrics.jsonl"
  with pytest.raises(StorageError, match="No such file or directory"):
    with storage(gone, "metrics file"):
      gone.write_text("")


@pytest.mark.slow
def test_a_metrics_file_that_fills_mid_run_stops_it_and_the_run_resumes(tmp_path, monkeypatch):
  """metrics.jsonl fills after step 1's record: the run stops at step 2 naming the file, and
  a rerun on a disk with room resumes from the intact checkpoint step 1 to the end."""
  run_dir = tmp_path / "run"
  config = tiny_experiment(run_dir, steps=3)
  real_open = open

  def filling_open(path, mode="r", *args, **kwargs):
    if Path(path).name == "metrics.jsonl" and "a" in mode:
      return FullDisk(room=1, real=real_open(path, mode, *args, **kwargs))
    return real_open(path, mode, *args, **kwargs)

  monkeypatch.setattr(grpo, "open", filling_open, raising=False)
  with pytest.raises(StorageError) as caught:
    grpo.run(config, log=lambda _: None)
  assert str(caught.value).startswith(f"the metrics file {run_dir / 'metrics.jsonl'} cannot be "
                                      "written: No space left on device. The run stopped; its "
                                      "checkpoint step 1 in ")
  monkeypatch.undo()
  lines = []
  grpo.run(config, log=lines.append)
  assert any(line.startswith(f"resumed from {run_dir / 'checkpoints'} at step 1")
             for line in lines), lines
  steps = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
  assert len(steps) == 3


_CONFIG = """
import sys
sys.path.insert(0, {tests!r})
from support import tiny_experiment

def get_config():
  return tiny_experiment({run_dir!r}, steps=12)
"""


def _mount_tmpfs(where: Path, size: str) -> bool:
  where.mkdir(parents=True, exist_ok=True)
  done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                        capture_output=True)
  return done.returncode == 0


@pytest.mark.slow
def test_a_disk_that_fills_during_specjax_train_ends_it_with_one_message_then_it_resumes(
    tmp_path):
  """A real full file system (a 700 KiB tmpfs, which holds two checkpoints of the tiny run):
  `specjax train` exits 1 with one line naming the file and the cause, no traceback; with
  room again the same command resumes and finishes."""
  disk = tmp_path / "disk"
  if not _mount_tmpfs(disk, "700k"):
    pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN) here")
  try:
    config = tmp_path / "config.py"
    config.write_text(textwrap.dedent(_CONFIG.format(tests=str(TESTS),
                                                     run_dir=str(disk / "run"))))
    command = [sys.executable, "-m", "specjax.cli", "train", "--config", str(config)]
    env = child_env()
    env.pop("SPECJAX_TRACEBACK", None)
    full = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert full.returncode == 1, full.stdout + full.stderr
    assert "Traceback" not in full.stderr, full.stderr[-4000:]
    errors = [line for line in full.stderr.splitlines() if line.startswith("specjax train: ")]
    assert len(errors) == 1 and "No space left on device" in errors[0], full.stderr[-4000:]
    assert str(disk / "run") in errors[0]
    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
    resumed = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout
  finally:
    subprocess.run(["umount", str(disk)], capture_output=True)
