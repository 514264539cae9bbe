"""A run whose files cannot be written (a full disk, a read-only file system) stops within
seconds with one message naming the file and the cause, never hangs and never floods the log,
and its last checkpoint resumes.

The regression these guard: tensorboardX's `SummaryWriter` writes from a thread behind a
bounded queue; on ENOSPC that thread died and the next record blocked the run forever.
"""

import errno
import json
import io
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from support import child_env, tiny_experiment

from specjax.checkpoint import CheckpointError
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
@pytest.mark.parametrize("room", range(10))
def test_a_metrics_file_that_fills_mid_run_stops_it_and_the_run_resumes(tmp_path, monkeypatch,
                                                                        room):
  """metrics.jsonl fills after step `room`'s record (ten moments): the run stops at the next
  step naming the file, and a rerun on a disk with room resumes from the intact checkpoint of
  step `room` to the end."""
  run_dir = tmp_path / "run"
  config = tiny_experiment(run_dir, steps=room + 2)
  real_open = open

  def filling_open(path, mode="r", *args, **kwargs):
    if Path(path).name == "metrics.jsonl" and "a" in mode:
      return FullDisk(room=room, real=real_open(path, mode, *args, **kwargs))
    return real_open(path, mode, *args, **kwargs)

  monkeypatch.setattr(grpo, "open", filling_open, raising=False)
  with pytest.raises(StorageError) as caught:
    grpo.run(config, log=lambda _: None)
  assert str(caught.value).startswith(f"the metrics file {run_dir / 'metrics.jsonl'} cannot be "
                                      "written: No space left on device. The run stopped; its "
                                      f"checkpoint step {room} in ")
  monkeypatch.undo()
  lines = []
  grpo.run(config, log=lines.append)
  assert any(line.startswith(f"resumed from {run_dir / 'checkpoints'} at step {room}")
             for line in lines), lines
  steps = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
  assert len(steps) == room + 2


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


# Sizes of a tmpfs that the tiny run fills at ten different moments: from its first files
# (config, the step-0 checkpoint) to a later checkpoint (a checkpoint is about 1 MiB, and the
# run keeps up to 4 MiB of them).
_DISK_SIZES_K = (40, 150, 400, 700, 1000, 1400, 1800, 2300, 2800, 3400)


@pytest.mark.slow  # ten runs that fill a disk, and ten that resume: about 3 minutes
def test_a_disk_that_fills_at_ten_moments_of_a_run_ends_it_cleanly_each_time(tmp_path, capfd):
  """Issue 57's matrix: a real full file system under the run directory, filling at ten
  different moments (whichever writer hits it: config and inputs records, metrics,
  TensorBoard, checkpoints). Each run stops within 30 s with one StorageError naming a file
  of the run and the cause (a CheckpointError for a checkpoint), no writer thread's traceback reaches the log, and with room again
  the same run finishes, resumed from its last checkpoint when it had written one."""
  disk = tmp_path / "disk"
  if not _mount_tmpfs(disk, "64m"):
    pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN) here")
  subprocess.run(["umount", str(disk)], check=True)
  named = set()  # what each run's message names: "checkpoint step 3", "the metrics file ..."
  for size in _DISK_SIZES_K:
    assert _mount_tmpfs(disk, f"{size}k")
    try:
      run_dir = disk / "run"
      config = tiny_experiment(run_dir, steps=12)
      capfd.readouterr()
      err = _finishes(lambda: grpo.run(config, log=lambda _: None), seconds=30)
      assert isinstance(err, (StorageError, CheckpointError)), (size, err)
      assert "No space left on device" in str(err) and str(run_dir) in str(err), str(err)
      assert "Traceback" not in capfd.readouterr().err, size
      named.add(str(err).split(" cannot ")[0])
      subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
      saved = (run_dir / "checkpoints").is_dir() and any(
          p.name.isdigit() for p in (run_dir / "checkpoints").iterdir())
      lines = []
      grpo.run(config, log=lines.append)
      assert any(line.startswith("resumed from") for line in lines) == saved, (size, lines)
      records = (run_dir / "metrics.jsonl").read_text().splitlines()
      assert [json.loads(r)["step"] for r in records] == list(range(1, 13)), size
    finally:
      subprocess.run(["umount", str(disk)], capture_output=True)
  assert len(named) >= 3, named  # it filled at several moments (checkpoint steps)
