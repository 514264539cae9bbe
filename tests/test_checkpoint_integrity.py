"""Checkpoint integrity: bytes that change after a save are an error on restore, never
silently different weights. The reference for "unchanged" is the pytree that was saved,
compared exactly. Negative controls: the same save, untouched, restores equal and without a
warning; and a flipped byte with the manifest removed restores into different weights (the
reported bug), so the error comes from the digest and not from orbax."""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from specjax.checkpoint import DIGEST_FILE, Checkpointer
from specjax.errors import CheckpointError


def _state(seed: int = 0) -> dict:
  """A tiny training state: two weight arrays and the Adam state over them."""
  keys = jax.random.split(jax.random.key(seed), 2)
  params = {"w": jax.random.normal(keys[0], (64, 32)), "b": jax.random.normal(keys[1], (32,))}
  return {"params": params, "opt": optax.adam(1e-3).init(params), "step": jnp.int32(seed)}


def _assert_equal_trees(actual, expected) -> None:
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def _saved(tmp_path, steps=(0,), max_to_keep=3) -> Checkpointer:
  ckpt = Checkpointer(tmp_path / "checkpoints", max_to_keep=max_to_keep)
  for step in steps:
    ckpt.save(step, _state(step), {"step": step})
  return ckpt


def _largest_file(step_dir):
  """The largest file orbax wrote in `step_dir`: an array data file, not metadata."""
  files = [p for p in step_dir.rglob("*") if p.is_file() and p.name != DIGEST_FILE]
  return max(files, key=lambda p: p.stat().st_size)


def _flip_byte(path, offset=None) -> None:
  data = bytearray(path.read_bytes())
  offset = len(data) // 2 if offset is None else offset
  data[offset] ^= 0xFF
  path.write_bytes(bytes(data))


def _append_byte(path) -> None:
  with open(path, "ab") as f:
    f.write(b"\0")


def test_intact_step_round_trips_exactly_without_warning_and_has_a_complete_manifest(tmp_path):
  ckpt = _saved(tmp_path)
  step_dir = ckpt.step_dir(0)
  manifest = json.loads((step_dir / DIGEST_FILE).read_text())
  written = {p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*")
             if p.is_file() and p.name != DIGEST_FILE}
  assert set(manifest["files"]) == written and any(f.startswith("state/") for f in written)
  for relative, entry in manifest["files"].items():
    assert entry["size"] == (step_dir / relative).stat().st_size
  assert not [p for p in step_dir.iterdir() if ".tmp-" in p.name]

  with warnings.catch_warnings():
    warnings.simplefilter("error")  # an unverified restore would warn
    state, meta, step = ckpt.restore(jax.eval_shape(_state))
  _assert_equal_trees(state, _state(0))
  assert (meta, step) == ({"step": 0}, 0)
  ckpt.close()


def test_flipped_byte_in_the_largest_data_file_is_an_error_naming_the_file(tmp_path):
  ckpt = _saved(tmp_path, steps=(0, 1))
  step_dir = ckpt.step_dir(1)
  target = _largest_file(step_dir)
  size = target.stat().st_size
  _flip_byte(target)
  assert target.stat().st_size == size  # only the digest can tell

  relative = target.relative_to(step_dir).as_posix()
  with pytest.raises(CheckpointError) as info:
    ckpt.restore(jax.eval_shape(_state))
  message = str(info.value)
  assert f"checkpoint step 1 at {step_dir} is corrupted: {relative} has sha256" in message
  assert "0 are available" in message and "delete" in message  # the remedy names step 0

  # The latest step failed: no fallback to step 0 happened, but asking for it works.
  state, meta, step = ckpt.restore(jax.eval_shape(_state), step=0)
  _assert_equal_trees(state, _state(0))
  assert step == 0

  # Negative control: without its manifest orbax does not notice the flip, and the step
  # restores (with only the unverified warning) into weights that differ from those saved.
  (step_dir / DIGEST_FILE).unlink()
  with pytest.warns(UserWarning, match="cannot be verified"):
    state, _, _ = ckpt.restore(jax.eval_shape(_state))
  with pytest.raises(AssertionError):
    _assert_equal_trees(state, _state(1))
  ckpt.close()


def test_deleted_file_is_an_error_naming_it(tmp_path):
  ckpt = _saved(tmp_path)
  step_dir = ckpt.step_dir(0)
  target = _largest_file(step_dir)
  target.unlink()
  relative = target.relative_to(step_dir).as_posix()
  with pytest.raises(CheckpointError, match=rf"{relative} is missing .*No other step is in"):
    ckpt.restore(jax.eval_shape(_state))
  ckpt.close()


@pytest.mark.parametrize("tamper, problem", [
    (lambda d: _append_byte(_largest_file(d)), "bytes, the manifest recorded"),
    (lambda d: (d / "state" / "extra").write_bytes(b"x"), "state/extra is not in the manifest"),
    (lambda d: (d / DIGEST_FILE).write_text("{not json"), f"manifest {DIGEST_FILE} cannot be"),
])
def test_resized_added_file_or_broken_manifest_is_an_error(tmp_path, tamper, problem):
  ckpt = _saved(tmp_path)
  tamper(ckpt.step_dir(0))
  with pytest.raises(CheckpointError, match=problem):
    ckpt.restore(jax.eval_shape(_state))
  ckpt.close()


def test_step_saved_without_manifest_restores_with_a_warning_that_it_is_unverified(tmp_path):
  ckpt = _saved(tmp_path)
  (ckpt.step_dir(0) / DIGEST_FILE).unlink()  # as a checkpoint from before digests
  ckpt.close()
  ckpt = Checkpointer(tmp_path / "checkpoints")
  with pytest.warns(UserWarning, match=rf"step 0 at {ckpt.step_dir(0)} has no {DIGEST_FILE}"):
    state, meta, step = ckpt.restore(jax.eval_shape(_state))
  _assert_equal_trees(state, _state(0))
  assert (meta, step) == ({"step": 0}, 0)
  ckpt.close()


def test_max_to_keep_cleanup_removes_old_steps_and_keeps_the_rest_verifiable(tmp_path):
  ckpt = _saved(tmp_path, steps=(0, 1, 2, 3), max_to_keep=2)
  assert ckpt.all_steps() == [2, 3]
  assert sorted(p.name for p in ckpt.directory.iterdir()) == ["2", "3"]
  assert all(ckpt.verify(step) for step in (2, 3))
  ckpt.close()

  ckpt = Checkpointer(tmp_path / "checkpoints", max_to_keep=2)  # a resumed run
  ckpt.save(4, _state(4), {"step": 4})
  assert ckpt.all_steps() == [3, 4]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    state, _, step = ckpt.restore(jax.eval_shape(_state))
  _assert_equal_trees(state, _state(4))
  assert step == 4
  ckpt.close()


def test_resave_of_an_existing_step_does_not_bless_its_corrupted_bytes(tmp_path):
  ckpt = _saved(tmp_path)
  _flip_byte(_largest_file(ckpt.step_dir(0)))
  ckpt.save(0, _state(0), {"step": 0})  # orbax skips a step that is not new
  with pytest.raises(CheckpointError, match="is corrupted"):
    ckpt.restore(jax.eval_shape(_state))
  ckpt.close()


@pytest.mark.slow
def test_resume_of_a_training_run_from_a_corrupted_checkpoint_raises_instead_of_training(
    tmp_path):
  from support import Killed as _Killed
  from support import kill_after_first_checkpoint as _kill_after_first_checkpoint
  from support import tiny_experiment as _config

  from specjax.experiments.grpo import run

  config = _config(tmp_path, steps=1)
  with pytest.raises(_Killed):
    run(config, log=_kill_after_first_checkpoint)
  step_dir = tmp_path / "checkpoints" / "0"
  target = _largest_file(step_dir)
  _flip_byte(target)
  logs = []
  with pytest.raises(CheckpointError,
                     match=rf"step 0 at {step_dir} is corrupted: "
                           rf"{target.relative_to(step_dir).as_posix()}"):
    run(config, log=logs.append)
  assert not any("resumed from" in line for line in logs), logs


# What tensorstore raises when the disk fills mid-write: a ValueError, not an OSError.
_DISK_FULL = ("RESOURCE_EXHAUSTED: Error writing \"params/w/0\" in OCDBT database at local file "
              "\"{dir}/1.orbax-checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_0/\": "
              "Failed to write 559417 bytes to file 7: No space left on device "
              "[os_error_code='28']")


def _fill_the_disk_at_the_next_save(ckpt, monkeypatch):
  """The next `ckpt.save` fails as a full disk makes orbax fail: it leaves its temporary
  step directory behind, logs the failure from a writer thread, and raises tensorstore's
  error."""
  import logging

  def save(step, args):
    (ckpt.directory / f"{step}.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
    logger = logging.getLogger("absl")
    logger.handle(logging.makeLogRecord({
        "name": "absl", "levelno": logging.ERROR, "levelname": "ERROR",
        "pathname": "site-packages/orbax/checkpoint/_src/futures/future.py",
        "msg": "_SignalingThread.run() raised an exception"}))
    raise ValueError(_DISK_FULL.format(dir=ckpt.directory))

  monkeypatch.setattr(ckpt._manager, "save", save)


def test_a_full_disk_at_a_save_is_one_checkpoint_error_naming_the_cause(tmp_path, monkeypatch,
                                                                       caplog):
  """The save's failure is a CheckpointError naming the directory and the cause (one
  exception, no chained tensorstore traceback), orbax's own error records are not printed,
  the partial step is removed (its bytes are what the next save needs), and the steps saved
  before restore unchanged."""
  ckpt = _saved(tmp_path, steps=(0,))
  _fill_the_disk_at_the_next_save(ckpt, monkeypatch)
  with caplog.at_level("ERROR", logger="absl"), pytest.raises(CheckpointError) as info:
    ckpt.save(1, _state(1), {"step": 1})
  message = str(info.value)
  assert message.startswith(f"checkpoint step 1 cannot be written to {ckpt.directory} "
                            "(ValueError: RESOURCE_EXHAUSTED")
  assert "No space left on device" in message and "check free space" in message
  assert info.value.__cause__ is None and info.value.__suppress_context__
  assert not [r for r in caplog.records if "orbax" in r.pathname]
  assert sorted(p.name for p in ckpt.directory.iterdir()) == ["0"]
  monkeypatch.undo()
  _assert_equal_trees(ckpt.restore(_state(0))[0], _state(0))


def test_a_state_orbax_cannot_save_is_not_reported_as_a_disk_fault(tmp_path, monkeypatch):
  """Negative control: a ValueError about the state itself reaches the caller unchanged,
  not dressed as an unwritable directory."""
  ckpt = _saved(tmp_path, steps=(0,))

  def save(step, args):
    raise ValueError("Unsupported type: <class 'object'>")

  monkeypatch.setattr(ckpt._manager, "save", save)
  with pytest.raises(ValueError, match="^Unsupported type") as info:
    ckpt.save(1, _state(1), {"step": 1})
  assert not isinstance(info.value, CheckpointError)
