"""A task from the user's own data: prompts in a JSONL / JSON / Parquet file (or any sequence
of rows, such as a Hugging Face `datasets.Dataset`), scored by the user's reward functions.

Each row holds a prompt — text, or chat messages `[{"role", "content"}, ...]` that the
tokenizer's chat template turns into text — and any other columns its rewards read
(`specjax.rl.rewards`). The task is checked when it is built: the file, every row's prompt, the
chat template on every prompt, and each reward's signature against the columns; a run that
cannot work fails there, before any model is loaded or trained.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from specjax.checks import is_int, is_real
from specjax.errors import ConfigError, TaskError
from specjax.files import DuplicateKey, strict_json
from specjax.rl.reward_workers import RewardPool
from specjax.rl.rewards import JaxReward, RewardFunction, as_reward_functions, jax_rewards, score
from specjax.rl.tasks import SPLITS, Example, _check_split, _in_test_split
from specjax.tokenizer import Tokenizer, with_bos

FLOAT32_MAX = float(np.finfo(np.float32).max)

FORMATS = (".jsonl", ".json", ".parquet")


def read_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
  """The rows of a JSONL (one object per line), JSON (a list of objects) or Parquet file.

  Raises:
    TaskError: a missing or unreadable file, a line that is not a JSON object, another format.
  """
  path = Path(path)
  if path.suffix not in FORMATS:
    raise TaskError(f"{path}: unknown dataset format {path.suffix!r}: allowed "
                    f"{', '.join(FORMATS)}")
  if not path.is_file():
    raise TaskError(f"{path}: no such dataset file")
  if path.suffix == ".parquet":
    import pyarrow.parquet
    try:
      return pyarrow.parquet.read_table(path).to_pylist()
    except Exception as err:  # pyarrow's ArrowInvalid and friends
      raise TaskError(f"{path}: not a readable Parquet file ({err})") from None
  try:
    text = path.read_text(encoding="utf-8")
  except UnicodeDecodeError as err:
    raise TaskError(f"{path}: not UTF-8 text (byte {err.start + 1}); JSON and JSONL datasets "
                    "must be UTF-8") from None
  if path.suffix == ".json":
    try:
      rows = strict_json(text)
    except DuplicateKey as err:
      raise TaskError(f"{path}: an object names the key {err.key!r} twice (JSON would keep "
                      "only the last); every key may appear once per row") from None
    except json.JSONDecodeError as err:
      raise TaskError(f"{path}: not JSON ({err})") from None
    if not isinstance(rows, list):
      raise TaskError(f"{path}: holds a JSON {type(rows).__name__}; expected a list of rows")
    lines = enumerate(rows, 1)
    what = "element"
  else:
    lines = ((n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip())
    what = "line"
  out = []
  for n, row in lines:
    if isinstance(row, str):
      try:
        row = strict_json(row)
      except DuplicateKey as err:
        raise TaskError(f"{path} line {n} names the key {err.key!r} twice (JSON would keep "
                        "only the last); every key may appear once per row") from None
      except json.JSONDecodeError as err:
        raise TaskError(f"{path} line {n} is not JSON ({err}): {row[:80]!r}") from None
    if not isinstance(row, dict):
      raise TaskError(f"{path} {what} {n} is a JSON {type(row).__name__}; expected an object "
                      "with the prompt and the reward's columns")
    out.append(row)
  if not out:
    raise TaskError(f"{path}: holds no rows")
  return out


# What `HFTokenizer.render_chat` passes a chat template itself (not a template option).
RENDER_NAMES = ("messages", "add_generation_prompt", "bos_token", "eos_token", "pad_token")


def _is_chat(prompt: Any) -> bool:
  return isinstance(prompt, (list, tuple))


def _check_messages(messages: Sequence[Any], where: str) -> None:
  for i, m in enumerate(messages):
    if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m):
      raise TaskError(f"{where}: message {i} is {m!r:.80}; chat messages are objects with a "
                      "'role' (str) and a 'content'")


@dataclasses.dataclass(frozen=True, eq=False)
class DatasetTask:
  """Prompts and columns from `source`, rewarded by Python `rewards` (split-mode train step).

  Attributes:
    source: a `.jsonl` / `.json` / `.parquet` file, or a sequence of row mappings (a
      `datasets.Dataset`, a list of dicts).
    tokenizer: the policy's tokenizer (`HFTokenizer.from_dir(model_dir)` for a chat model).
    rewards: reward functions `fn(prompts, completions, **columns) -> list[float | None]`
      or `RewardFunction`s (weights, names); `prompts` are the rows' prompts as the dataset
      holds them (text or messages), `completions` the generated texts. `JaxReward`s among
      them score the generated ids in JAX; when all are, the task is rewarded in JAX
      (`reward_in_jax`) and its rewards trace into the fused train step.
    prompt_column: the column with each row's prompt: text, or chat messages.
    reference_column: a column with the reference response text, which the supervised warm
      start learns (`warm_start.steps > 0` needs one); None: no reference.
    answer_column: a numeric column, each row's `answers` entry of a `JaxReward`; None: NaN.
    chat_template: None: chat-message prompts are rendered with the tokenizer's chat template
      and text prompts are used as they are; True: text prompts too become one user message,
      rendered; False: the template is never applied (chat-message prompts are an error).
    chat_variables: the chat template's own options, as transformers'
      `apply_chat_template(**kwargs)` passes them: `{"enable_thinking": False}` for a Qwen3
      that should answer without a thinking block. None: the template's defaults.
    test_source: the held-out rows (same columns); None: `test_fraction` of `source`'s rows,
      chosen by a stable hash of the prompt.
    test_fraction: in (0, 1), without `test_source`.
    success_reward: a held-out response counts as solved when its total reward is at least
      this (the accuracy a run reports before and after RL).
    seed: seeds the hashed split.
    name: the task's name.
  """

  # Typed Any: a file path or rows, set in a config file (a union would make `specjax train`
  # parse it as a subcommand).
  source: Any
  tokenizer: Tokenizer
  rewards: Any
  prompt_column: str = "prompt"
  reference_column: str | None = None
  answer_column: str | None = None
  chat_template: bool | None = None
  # Typed Any, as `source`: a dict of the template's options is set in a config file.
  chat_variables: Any = None
  test_source: Any = None
  test_fraction: float = 0.1
  success_reward: float = 1.0
  seed: int = 0
  name: str = "dataset"

  def __post_init__(self):
    object.__setattr__(self, "rewards", as_reward_functions(self.rewards))
    for field in ("prompt_column", "name"):
      if not (isinstance(getattr(self, field), str) and getattr(self, field)):
        raise ConfigError(f"task.{field}={getattr(self, field)!r} is invalid: must be a "
                          "non-empty str")
    for field in ("reference_column", "answer_column"):
      if getattr(self, field) is not None and not isinstance(getattr(self, field), str):
        raise ConfigError(f"task.{field}={getattr(self, field)!r} is invalid: must be a "
                          "column name (str) or None")
    fraction = self.test_fraction
    if self.test_source is None and not (is_real(fraction) and 0 < fraction < 1):
      raise ConfigError(f"task.test_fraction={self.test_fraction!r} is invalid: must be in "
                        "(0, 1) without task.test_source (the held-out prompts)")
    variables = self.chat_variables
    if variables is not None and not (
        isinstance(variables, Mapping) and all(isinstance(k, str) and k.isidentifier()
                                               and k not in RENDER_NAMES for k in variables)):
      raise ConfigError(f"task.chat_variables={variables!r} is invalid: must be None or a dict "
                        "of the chat template's options by name (e.g. {'enable_thinking': "
                        f"False}}), not one of {', '.join(RENDER_NAMES)}")
    if self.chat_template not in (None, True, False):
      raise ConfigError(f"task.chat_template={self.chat_template!r} is invalid: allowed None, "
                        "True or False")
    if not (isinstance(self.success_reward, (int, float)) and math.isfinite(
        self.success_reward)):
      raise ConfigError(f"task.success_reward={self.success_reward!r} is invalid: must be a "
                        "finite number")
    splits = self._splits  # reads, renders and checks every row now
    for split in SPLITS:
      if not splits[split]:
        raise ConfigError(f"task {self.name!r} has no {split} prompts ({self._describe()}): "
                          + ("add rows" if split == "train" or self.test_source is not None
                             else "raise task.test_fraction or give task.test_source"))
    for reward in self.rewards:
      if isinstance(reward, JaxReward):
        reward.check_traceable()
      else:
        reward.check_columns(self.columns)

  @property
  def reward_in_jax(self) -> bool:
    """Whether every reward is a `JaxReward` (the fused step's `reward(tokens, lengths,
    answers)`); otherwise the step runs split, the Python rewards on the host."""
    return all(isinstance(r, JaxReward) for r in self.rewards)

  def _describe(self, source: Any = None) -> str:
    source = self.source if source is None else source
    return str(source) if isinstance(source, (str, os.PathLike)) else f"{len(source)} rows"

  def _rows(self, source: Any) -> list[Mapping[str, Any]]:
    if isinstance(source, (str, os.PathLike)):
      return read_rows(source)
    if isinstance(source, (bytes, Mapping)) or not hasattr(source, "__iter__"):
      raise TaskError(f"task {self.name!r}: source={source!r:.80} is invalid: allowed a "
                      f"{' / '.join(FORMATS)} file path, or a sequence of rows (dicts)")
    rows = list(source)
    if not rows:
      raise TaskError(f"task {self.name!r}: its source holds no rows")
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, Mapping)), None)
    if bad is not None:
      raise TaskError(f"task {self.name!r}: row {bad} is a {type(rows[bad]).__name__}; rows "
                      "are mappings of column name to value")
    return rows

  @functools.cached_property
  def columns(self) -> tuple[str, ...]:
    """The columns every reward may read: the dataset's, but for the prompt's."""
    return tuple(c for c in self._columns if c != self.prompt_column)

  @functools.cached_property
  def _source_rows(self) -> list[Mapping[str, Any]]:
    return self._rows(self.source)

  @functools.cached_property
  def _columns(self) -> tuple[str, ...]:
    return tuple(self._source_rows[0])

  def render(self, prompt: Any, where: str = "prompt") -> str:
    """A row's prompt as the text the policy continues (the chat template applied)."""
    if _is_chat(prompt):
      if self.chat_template is False:
        raise TaskError(f"{where} holds chat messages, but task.chat_template=False: give text "
                        "prompts or allow the template")
      _check_messages(prompt, where)
      messages = prompt
    elif isinstance(prompt, str):
      if not self.chat_template:
        return prompt
      messages = [{"role": "user", "content": prompt}]
    else:
      raise TaskError(f"{where} is {prompt!r:.80}: allowed text or a list of chat messages")
    render = getattr(self.tokenizer, "render_chat", None)
    if render is None:
      raise TaskError(f"{where} needs a chat template, and the tokenizer "
                      f"{type(self.tokenizer).__name__} has none: use an HFTokenizer of a chat "
                      "model, or text prompts")
    return render(messages, **dict(self.chat_variables or {}))

  def encode_prompt(self, text: str) -> list[int]:
    """The prompt ids of rendered prompt `text`: a chat template writes its own special tokens
    (BOS included, where the model has one), so only plain text gets a BOS added.

    Each prompt is tokenized once: building the task encodes every row to check it, and the
    run's prompt records ask for the same ids again (`_encoded`)."""
    ids = self._encoded.get(text)
    if ids is None:
      ids = self.tokenizer.encode(text)
      ids = tuple(ids if self._templated else with_bos(ids, self.tokenizer.bos_id))
      self._encoded[text] = ids
    return list(ids)

  @functools.cached_property
  def _encoded(self) -> dict[str, tuple[int, ...]]:
    """Prompt ids by rendered prompt, for every prompt encoded so far."""
    return {}

  @functools.cached_property
  def _templated(self) -> bool:
    first = self._source_rows[0].get(self.prompt_column)
    return bool(self.chat_template) or (_is_chat(first) and self.chat_template is None)

  def _examples(self, rows: Sequence[Mapping[str, Any]], which: str) -> list[Example]:
    out = []
    for i, row in enumerate(rows):
      where = f"task {self.name!r}, {which} row {i}"
      if set(row) != set(self._columns):
        raise TaskError(f"{where} has columns {sorted(row)}, the first row "
                        f"{sorted(self._columns)}: every row needs the same columns")
      if self.prompt_column not in row:
        raise TaskError(f"{where} has no prompt column {self.prompt_column!r} (columns: "
                        f"{', '.join(row)}); set task.prompt_column")
      text = self.render(row[self.prompt_column], f"{where}, column {self.prompt_column!r}")
      if _is_chat(row[self.prompt_column]) != _is_chat(rows[0][self.prompt_column]):
        form = "chat messages" if _is_chat(row[self.prompt_column]) else "text"
        raise TaskError(f"{where}: its prompt is {form} and the first row's is not; give every "
                        "prompt the same form")
      try:
        ids = self.encode_prompt(text)
      except ValueError as err:
        raise TaskError(f"{where}: the tokenizer cannot encode its prompt ({err})") from None
      if not ids:
        raise TaskError(f"{where}: its prompt {text!r} encodes to no tokens (and the tokenizer "
                        "adds no BOS): every prompt needs at least one token")
      reference = ""
      if self.reference_column is not None:
        if self.reference_column not in row:
          raise TaskError(f"{where} has no reference column {self.reference_column!r}")
        value = row[self.reference_column]
        if value is None or (isinstance(value, float) and math.isnan(value)):
          raise TaskError(f"{where}: reference column {self.reference_column!r} holds {value}; "
                          "allowed a string, the reference text the warm start learns")
        reference = str(row[self.reference_column])
      answer = math.nan
      if self.answer_column is not None:
        value = row.get(self.answer_column)
        if not (is_real(value) and abs(value) <= (2**31 - 1 if is_int(value) else FLOAT32_MAX)):
          raise TaskError(f"{where}: answer column {self.answer_column!r} holds {value!r}; "
                          "allowed a finite number within float32's range, an integer within "
                          "int32's (what a JaxReward compares against)")
        answer = int(value) if is_int(value) else float(value)
      out.append(Example(prompt=text, reference=reference, answer=answer, columns=dict(row)))
    return out

  @functools.cached_property
  def _splits(self) -> dict[str, tuple[Example, ...]]:
    train = self._examples(self._source_rows, "train")
    if self.test_source is not None:
      test = self._examples(self._rows(self.test_source), "test")
    else:
      held = [_in_test_split(self.seed, e.prompt, self.test_fraction) for e in train]
      test = [e for e, h in zip(train, held) if h]
      train = [e for e, h in zip(train, held) if not h]
    return {"train": tuple(train), "test": tuple(test)}

  def examples(self, split: str) -> tuple[Example, ...]:
    _check_split(split)
    return self._splits[split]

  def reward(self, tokens: jax.Array, lengths: jax.Array, answers: jax.Array
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A task rewarded in JAX (`reward_in_jax`): the weighted total `[B]` of its `JaxReward`s
    on generated ids and each one's `[B]` values (traceable; the fused step logs their means
    as `reward_<name>`)."""
    return jax_rewards([r for r in self.rewards if isinstance(r, JaxReward)], tokens, lengths,
                       answers)

  def score(self, examples: Sequence[Example], completions: Sequence[str], tokens=None,
            lengths=None, pool: RewardPool | None = None, per_row: bool = False
            ) -> tuple[np.ndarray, dict[str, Any]]:
    """`[B]` total rewards of `completions` to `examples` (one per completion) and each reward
    function's mean (`specjax.rl.rewards.score`), the Python functions called over `pool`'s
    workers (None: directly), or with `per_row` its values; the `JaxReward`s among them run
    compiled on the generated ids `tokens [B, T]` and `lengths [B]`."""
    prompts = [e.columns[self.prompt_column] for e in examples]
    columns = {c: [e.columns[c] for e in examples] for c in self.columns}
    computed = {}
    if any(isinstance(r, JaxReward) for r in self.rewards):
      answers = np.asarray([e.answer for e in examples], np.float32)
      computed = jax.device_get(_compiled_rewards(self)(tokens, lengths, answers)[1])
    return score(self.rewards, prompts, completions, columns, computed, pool, per_row)


@functools.lru_cache(maxsize=8)
def _compiled_rewards(task: DatasetTask):
  return jax.jit(task.reward)


def host_scores(task: Any, examples: Sequence[Example], completions: Sequence[str], tokens,
                lengths, pool: RewardPool | None = None, per_row: bool = False
                ) -> tuple[np.ndarray, dict[str, Any]]:
  """Rewards of a Python-reward task for `completions` to `examples` (generated as `tokens`
  `[B, T]` with `lengths` `[B]`), and per-function means (or `[B]` values, with `per_row`): a
  `DatasetTask`'s functions (over `pool`'s workers), or `task.reward(completions, references)`
  of the others (`CustomTask`, `GSM8KTask`)."""
  if isinstance(task, DatasetTask):
    return task.score(examples, completions, tokens, lengths, pool, per_row)
  rewards = task.reward(list(completions), [e.reference for e in examples])
  return np.asarray(rewards, np.float32), {}


__all__ = ["DatasetTask", "FORMATS", "JaxReward", "RewardFunction", "host_scores", "read_rows"]
