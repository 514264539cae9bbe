"""Prompt datasets: TensorFlow Datasets builders writing ArrayRecord files, and a reader.

The builders are `tfds.core.GeneratorBasedBuilder`s with `file_format="array_record"`;
writing and reading ArrayRecord needs neither TensorFlow nor network access
(tensorflow-datasets >= 4.9 with `array_record`). Each record holds one example:

    prompt     int32 [P_i]  prompt ids (BOS first when the tokenizer has one)
    reference  text         the reference answer (what a Python reward takes)
    answer     scalar       the numeric answer (int64 for arithmetic, float64 otherwise)
    index      int64        the example's position in `task.examples(split)`

A dataset is content-addressed: its builder config name is a hash of every record, so a
changed task, file or tokenizer writes a new dataset instead of reusing a stale one.

`PromptReader` turns a split into fixed-shape batches. Batch contents are a pure function of
an integer data position (examples consumed so far), so the position is all a checkpoint
needs to resume the exact stream.

Shape letters: see `specjax` (B / G prompts of one step, global over all processes: each
becomes G rollout rows; P prompt buffer width). P_i is the length of prompt i.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from etils import epath
from flax import struct

from specjax.checks import is_int
from specjax.errors import ConfigError, TaskError
from specjax.rl.gsm8k import GSM8KTask
from specjax.rl.tasks import SPLITS, ArithmeticTask, Task, task_prompt_ids

_RECORD_FORMAT = "1"  # bump when the record layout changes, so old datasets are not reused


class _TaskBuilderConfig(tfds.core.BuilderConfig):
  """A builder config carrying the records to write (named by their hash)."""

  def __init__(self, *, name: str, task_name: str, records: Mapping[str, list[dict]]):
    super().__init__(name=name, description=f"prompts of task {task_name!r}")
    self.records = records


class TaskPrompts(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Prompts of any `Task`, one ArrayRecord dataset per split ("train", "test").

  Build with `TaskPrompts(task=task, data_dir=dir)`, then `download_and_prepare()` (a no-op
  when the same records were written before) and `as_data_source(split)`.
  """

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Prompt ids, reference text, numeric answer, example index."}
  ANSWER_DTYPE: Any = np.float64

  def __init__(self, *, task: Task, data_dir: str | os.PathLike, **kwargs):
    records = {split: _records(task, split, self.ANSWER_DTYPE) for split in SPLITS}
    config = _TaskBuilderConfig(name=f"{task.name}-{_digest(records)}", task_name=task.name,
                                records=records)
    super().__init__(data_dir=os.fspath(data_dir), config=config,
                     file_format="array_record", **kwargs)

  # tfds 4.9.10 derives `code_path` through `importlib_resources.abc`, a package it declares
  # only for Python < 3.9, so for a builder inside an installed package (like this one)
  # preparing fails with ModuleNotFoundError. The path is this file; say so directly.
  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    return epath.Path(__file__)

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description="Tokenized prompts with references for RL post-training (specjax).",
        features=tfds.features.FeaturesDict({
            "prompt": tfds.features.Tensor(shape=(None,), dtype=np.int32),
            "reference": tfds.features.Text(),
            "answer": tfds.features.Scalar(dtype=self.ANSWER_DTYPE),
            "index": tfds.features.Scalar(dtype=np.int64),
        }),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # everything is local: the records were built from the task
    return {split: self._generate_examples(split) for split in SPLITS}

  def _generate_examples(self, split: str):
    for record in self.builder_config.records[split]:
      yield int(record["index"]), record


class ArithmeticPrompts(TaskPrompts, skip_registration=True):
  """`TaskPrompts` of an `ArithmeticTask` (integer answers)."""

  ANSWER_DTYPE = np.int64

  def __init__(self, *, task: ArithmeticTask, data_dir: str | os.PathLike, **kwargs):
    if not isinstance(task, ArithmeticTask):
      raise TypeError(f"task={task!r} is invalid: ArithmeticPrompts needs an ArithmeticTask")
    super().__init__(task=task, data_dir=data_dir, **kwargs)


class GSM8KPrompts(TaskPrompts, skip_registration=True):
  """`TaskPrompts` of a `GSM8KTask` (local JSONL; float answers)."""

  def __init__(self, *, task: GSM8KTask, data_dir: str | os.PathLike, **kwargs):
    if not isinstance(task, GSM8KTask):
      raise TypeError(f"task={task!r} is invalid: GSM8KPrompts needs a GSM8KTask")
    super().__init__(task=task, data_dir=data_dir, **kwargs)


def _records(task: Task, split: str, answer_dtype) -> list[dict]:
  return [{"prompt": np.asarray(task_prompt_ids(task, e.prompt), np.int32),
           "reference": e.reference,
           "answer": np.asarray(e.answer, answer_dtype),
           "index": np.int64(i)}
          for i, e in enumerate(task.examples(split))]


def _digest(records: Mapping[str, list[dict]]) -> str:
  h = hashlib.sha256(_RECORD_FORMAT.encode())
  for split in SPLITS:
    h.update(f"|{split}|{len(records[split])}".encode())
    for r in records[split]:
      h.update(r["prompt"].tobytes())
      h.update(b"\0" + r["reference"].encode() + b"\0" + r["answer"].tobytes())
  return h.hexdigest()[:16]


def prompt_builder(task: Task, data_dir: str | os.PathLike) -> TaskPrompts:
  """The builder of `task`'s prompts (arithmetic and GSM8K get their own classes)."""
  if isinstance(task, ArithmeticTask):
    return ArithmeticPrompts(task=task, data_dir=data_dir)
  if isinstance(task, GSM8KTask):
    return GSM8KPrompts(task=task, data_dir=data_dir)
  return TaskPrompts(task=task, data_dir=data_dir)


def prepare_prompts(task: Task, data_dir: str | os.PathLike) -> dict[str, Sequence[dict]]:
  """Write `task`'s ArrayRecord datasets under `data_dir` (once) and open every split.

  Returns:
    split name -> random-access source of decoded records (a tfds `ArrayRecordDataSource`).

  Raises:
    TaskError: a prepared file is corrupt or truncated (naming the directory to delete).
  """
  builder = prompt_builder(task, data_dir)
  builder.download_and_prepare(
      download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  sources = {}
  for split in SPLITS:
    try:
      sources[split] = builder.as_data_source(split)
      if len(sources[split]):
        sources[split][len(sources[split]) - 1]  # a truncated file fails here, not mid-run
    except RuntimeError as err:  # array_record's C++ reader: corrupt or truncated file
      raise TaskError(
          f"{builder.data_dir}: the {split!r} prompt file is unreadable ({err}). It is a "
          f"cache derived from task {task.name!r}: delete {builder.data_dir} and rerun to "
          "rebuild it") from None
  return sources


@struct.dataclass
class PromptBatch:
  """Prompts of one step, host-side NumPy (a pytree, so it goes straight into `jit`).

  Attributes:
    tokens: `[B / G, P]` int32 prompt ids, right-padded with `pad_id`.
    lengths: `[B / G]` int32 prompt lengths.
    answers: `[B / G]` numeric answers (int32 for integer answers, else float32).
    index: `[B / G]` int32 record positions in the split (for `PromptReader.references`).
  """

  tokens: np.ndarray
  lengths: np.ndarray
  answers: np.ndarray
  index: np.ndarray


@functools.lru_cache(maxsize=4)
def _epoch_order(num_examples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
  if not shuffle:
    return np.arange(num_examples)
  return np.random.default_rng([seed, epoch]).permutation(num_examples)


@dataclasses.dataclass(frozen=True, eq=False)
class PromptReader:
  """Deterministic, resumable batches of one split.

  Position p (an int, examples consumed) maps to the p % n-th record of epoch p // n's order
  (a permutation seeded by `(seed, epoch)` when shuffling, else file order). The batch at
  position p holds positions `p .. p + batch_size - 1`, so batches cross epoch boundaries
  without a short batch; the next batch is at `p + batch_size`. Checkpoint the position.

  With several processes each reads its slice of the global batch: prompts
  `process_index * batch_size / process_count ..` of it.

  Attributes:
    source: random-access records (`prepare_prompts(...)[split]` or any sequence of dicts with
      "prompt", "reference", "answer").
    batch_size: B / G, the global number of prompts per step (each repeated G times for the
      rollouts; G = 1 when the batch is not rolled out in groups).
    pad_id: filler of `tokens` past each prompt.
    prompt_len: P; None means the longest prompt in the source.
    shuffle: reshuffle every epoch.
    seed: seeds the shuffles.
    process_index: this process (multi-host).
    process_count: processes sharing the global batch; must divide `batch_size`.
  """

  source: Sequence[Mapping[str, Any]]
  batch_size: int
  pad_id: int = 0
  prompt_len: int | None = None
  shuffle: bool = True
  seed: int = 0
  process_index: int = 0
  process_count: int = 1

  def __post_init__(self):
    def require(ok: bool, field: str, allowed: str):
      if not ok:
        raise ConfigError(f"{field}={getattr(self, field)!r} is invalid: {allowed}")

    require(len(self.source) > 0, "source", "has no records")
    require(is_int(self.batch_size) and self.batch_size >= 1, "batch_size",
            "must be an int >= 1")
    require(self.prompt_len is None or (is_int(self.prompt_len) and self.prompt_len >= 1),
            "prompt_len", "must be an int >= 1, or None for the longest prompt")
    require(is_int(self.pad_id), "pad_id", "must be an int (a token id)")
    require(is_int(self.seed), "seed", "must be an int")
    require(is_int(self.process_count) and self.process_count >= 1
            and self.batch_size % self.process_count == 0, "process_count",
            f"must be an int >= 1 dividing batch_size={self.batch_size}")
    require(is_int(self.process_index)
            and 0 <= self.process_index < self.process_count, "process_index",
            f"allowed 0..{self.process_count - 1}")

  @property
  def num_examples(self) -> int:
    return len(self.source)

  @functools.cached_property
  def padded_len(self) -> int:
    """P: `prompt_len`, or the longest prompt of the source (read once)."""
    if self.prompt_len is not None:
      return self.prompt_len
    return max(len(r["prompt"]) for r in self._read(range(self.num_examples)))

  def _read(self, indices) -> list[Mapping[str, Any]]:
    indices = [int(i) for i in indices]
    getitems = getattr(self.source, "__getitems__", None)
    try:
      return list(getitems(indices)) if getitems else [self.source[i] for i in indices]
    except RuntimeError as err:  # array_record's C++ reader: a damaged chunk mid-file
      info = getattr(self.source, "dataset_info", None)
      where = info.data_dir if info is not None else "the prepared prompt dataset"
      raise TaskError(f"{where}: prompt records {indices[:4]}{'...' if len(indices) > 4 else ''}"
                      f" are unreadable ({err}); delete {where} and rerun `prepare_prompts` "
                      "to rebuild it from the task") from None

  def record_indices(self, position: int) -> np.ndarray:
    """`[batch_size / process_count]` record indices of this process's prompts of the batch
    at `position`."""
    if not (isinstance(position, (int, np.integer)) and position >= 0):
      raise ValueError(f"position={position!r} is invalid: must be an int >= 0")
    per_process = self.batch_size // self.process_count
    first = int(position) + self.process_index * per_process
    out = np.empty(per_process, np.int64)
    for j, p in enumerate(range(first, first + per_process)):
      epoch, offset = divmod(p, self.num_examples)
      out[j] = _epoch_order(self.num_examples, self.seed, epoch, self.shuffle)[offset]
    return out

  def batch_at(self, position: int) -> PromptBatch:
    """The batch starting at data position `position` (this process's rows)."""
    index = self.record_indices(position)
    records = self._read(index)
    width = self.padded_len
    tokens = np.full((len(records), width), self.pad_id, np.int32)
    lengths = np.empty(len(records), np.int32)
    for row, (i, r) in enumerate(zip(index, records)):
      prompt = np.asarray(r["prompt"], np.int32)
      if len(prompt) > width:
        raise ValueError(f"record {i} has a prompt of {len(prompt)} tokens, more than "
                         f"prompt_len={width}; raise prompt_len or pass None")
      tokens[row, :len(prompt)] = prompt
      lengths[row] = len(prompt)
    answers = np.asarray([r["answer"] for r in records])
    answers = answers.astype(np.int32 if np.issubdtype(answers.dtype, np.integer)
                             else np.float32)
    return PromptBatch(tokens=tokens, lengths=lengths, answers=answers,
                       index=index.astype(np.int32))

  def next_position(self, position: int) -> int:
    """The data position after the batch at `position` (global, the same on every process)."""
    return int(position) + self.batch_size

  def references(self, index) -> list[str]:
    """Reference texts of records `index` (e.g. `PromptBatch.index`, possibly repeated G
    times per prompt)."""
    refs = [r["reference"] for r in self._read(np.asarray(index).reshape(-1))]
    return [r.decode() if isinstance(r, bytes) else str(r) for r in refs]
