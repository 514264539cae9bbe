"""GSM8K: the JSONL reader, answer extraction and the task with its Python reward; and
`gsm8k_dataset`, the same data as a `DatasetTask` (the user's-data path, math-verify reward).

The reward parses the last number of a completion (signs, "$", thousands commas, decimals;
`extract_answer`) and compares it with the reference within a relative tolerance
(`answers_match`); it runs on the host between the rollout and the update (`reward_in_jax`
is False, see `specjax.rl.tasks`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specjax.errors import ConfigError, TaskError
from specjax.files import DuplicateKey, strict_json
from specjax.rl.datasets import DatasetTask
from specjax.rl.rewards import math_answer_reward
from specjax.rl.tasks import Example, PythonReward, _check_split, _in_test_split
from specjax.tokenizer import Tokenizer

# A number: optional sign (not a hyphen inside a word or range such as "3-4"), optional "$",
# then digits with thousands commas, plain digits, or a bare decimal such as ".5".
# A number: sign, "$", thousands commas, decimals, an exponent ("1e3"), and a fraction of
# integers ("3/4"); reading only a prefix of "1e3" or "3/4" would be a silent wrong answer.
_NUMBER = re.compile(r"(?:(?<![\w)])(?P<sign>-))?\$?(?P<digits>\d{1,3}(?:,\d{3})+(?:\.\d+)?"
                     r"|\d+(?:\.\d+)?|\.\d+)(?P<exponent>[eE][-+]?\d+)?"
                     r"(?:/(?P<denominator>\d+)(?!/|\.?\d))?")
_UNICODE_MINUS = ("\u2212", "\u2013")


def parse_number(text: str) -> float | None:
  """The first number in `text`, or None.

  Handles thousands commas ("1,234"), a "$" ("$-5", "-$5"), signs, decimals, exponents
  ("1e3"), fractions of integers ("3/4", "-1/2"), and trailing punctuation ("42."). A hyphen
  between two numbers ("3-4") is not a sign.
  """
  for minus in _UNICODE_MINUS:
    text = text.replace(minus, "-")
  text = text.replace("$-", "-$")
  match = _NUMBER.search(text)
  return None if match is None else _match_value(match)


def _match_value(match: re.Match) -> float:
  value = float(match["digits"].replace(",", "") + (match["exponent"] or ""))
  if match["denominator"] is not None:
    denominator = float(match["denominator"])
    value = value / denominator if denominator else math.inf  # never equal to an answer
  return -value if match["sign"] else value


def extract_answer(text: str) -> float | None:
  """A model's final answer: the first number after the last "####" when there is one,
  else the last number in the text; None when there is no number."""
  if "####" in text:
    return parse_number(text.rsplit("####", 1)[1])
  for minus in _UNICODE_MINUS:
    text = text.replace(minus, "-")
  matches = list(_NUMBER.finditer(text.replace("$-", "-$")))
  return _match_value(matches[-1]) if matches else None


def format_number(value: float) -> str:
  """Canonical text of a number: "18", "-3", "0.5" (integers without a decimal point)."""
  return str(int(value)) if float(value).is_integer() else repr(float(value))


def answers_match(predicted: float | None, reference: float) -> bool:
  """Numeric equality up to a relative 1e-6 (decimals such as 0.1 + 0.2); never for a
  non-finite number (an overflowing "999...9" is not equal to everything)."""
  if predicted is None or not (math.isfinite(predicted) and math.isfinite(reference)):
    return False
  return abs(predicted - reference) <= 1e-6 * max(1.0, abs(reference))


def read_gsm8k_jsonl(path: str | os.PathLike) -> list[tuple[str, float]]:
  """`(question, numeric answer)` pairs of a GSM8K-format JSONL file.

  Each non-blank line is an object with string fields "question" and "answer"; the answer's
  number follows its last "####". A line that breaks this raises `TaskError` naming the file
  and the line number.
  """
  path = Path(path)
  if not path.is_file():
    raise TaskError(f"{path}: no such file")
  rows = []
  with path.open("rb") as f:  # bytes, so a line that is not UTF-8 can be named
    for lineno, raw in enumerate(f, start=1):
      where = f"{path}:{lineno}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise TaskError(f"{where}: not UTF-8 text (byte {e.start + 1} of the line); the "
                        "file must be UTF-8 JSON lines") from None
      if not line.strip():
        continue
      try:
        row = strict_json(line)
      except DuplicateKey as e:
        raise TaskError(f"{where}: names the key {e.key!r} twice (JSON would keep only the "
                        "last); every key may appear once per row") from None
      except json.JSONDecodeError as e:
        raise TaskError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
      if not isinstance(row, dict):
        raise TaskError(f"{where}: expected a JSON object with 'question' and 'answer', got "
                        f"{type(row).__name__}")
      for key in ("question", "answer"):
        if not isinstance(row.get(key), str):
          raise TaskError(f"{where}: field {key!r} is missing or not a string")
      if "####" not in row["answer"]:
        raise TaskError(f"{where}: 'answer' has no '#### <number>' final answer")
      value = parse_number(row["answer"].rsplit("####", 1)[1])
      if value is None:
        raise TaskError(f"{where}: no number after '####' in 'answer'")
      if not math.isfinite(value):
        raise TaskError(f"{where}: the answer after '####' is too large for a float "
                        f"({value}); every completion would compare wrongly with it")
      rows.append((row["question"], value))
  if not rows:
    raise TaskError(f"{path}: no questions (the file is empty or blank); expected one JSON "
                    "object with 'question' and 'answer' per line")
  return rows


@dataclasses.dataclass(frozen=True, eq=False)
class GSM8KTask:
  """Grade-school math from local GSM8K-format JSONL files, rewarded in Python.

  Reward: 1.0 when the completion's final answer (`extract_answer`) equals the reference
  number (`answers_match`); `format_reward` when it has a number but the wrong one; else 0.

  Attributes:
    train_file: JSONL with "question" and "answer" ("... #### 18").
    tokenizer: the policy's tokenizer.
    test_file: JSONL of the held-out split; when None, `test_fraction` of the training
      questions (chosen by a stable hash of the question) are held out instead.
    test_fraction: in [0, 1); only used without `test_file`.
    template: prompt text, with "{question}" replaced by the question.
    seed: seeds the hashed split.
    format_reward: reward of a wrong numeric answer, in [0, 1).
    name: the task's name.
  """

  train_file: str | os.PathLike
  tokenizer: Tokenizer
  test_file: str | os.PathLike | None = None
  test_fraction: float = 0.0
  template: str = "Question: {question}\nAnswer:"
  seed: int = 0
  format_reward: float = 0.0
  name: str = "gsm8k"

  reward_in_jax = False

  def __post_init__(self):
    if not 0 <= self.test_fraction < 1:
      raise ConfigError(f"test_fraction={self.test_fraction!r} is invalid: must be in [0, 1)")
    if self.test_file is not None and self.test_fraction:
      raise ConfigError(f"test_fraction={self.test_fraction!r} is invalid with test_file: "
                        "leave it 0 when the held-out split has its own file")
    if "{question}" not in self.template:
      raise ConfigError(f"template={self.template!r} is invalid: must contain '{{question}}'")
    if not 0 <= self.format_reward < 1:
      raise ConfigError(f"format_reward={self.format_reward!r} is invalid: must be in [0, 1)")

  def _example(self, question: str, value: float) -> Example:
    return Example(prompt=self.template.replace("{question}", question),
                   reference=format_number(value), answer=value)

  @functools.cached_property
  def _splits(self) -> dict[str, tuple[Example, ...]]:
    train = read_gsm8k_jsonl(self.train_file)
    if self.test_file is not None:
      test = read_gsm8k_jsonl(self.test_file)
    else:
      held = [_in_test_split(self.seed, q, self.test_fraction) for q, _ in train]
      test = [row for row, h in zip(train, held) if h]
      train = [row for row, h in zip(train, held) if not h]
    return {"train": tuple(self._example(q, v) for q, v in train),
            "test": tuple(self._example(q, v) for q, v in test)}

  def examples(self, split: str) -> tuple[Example, ...]:
    _check_split(split)
    return self._splits[split]

  def _score(self, completion: str, reference: str) -> float:
    predicted = extract_answer(completion)
    if answers_match(predicted, float(reference)):
      return 1.0
    return self.format_reward if predicted is not None else 0.0

  def reward(self, completions: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """`[B]` completions and reference numbers (text) -> `[B]` float32 rewards."""
    return PythonReward(self._score, self.name)(completions, references)



def gsm8k_dataset(train_file: str | os.PathLike, tokenizer: Tokenizer, *,
                  test_file: str | os.PathLike | None = None, test_fraction: float = 0.1,
                  template: str = "Question: {question}\nAnswer:", chat: bool = False,
                  chat_variables: dict | None = None, rewards=None,
                  seed: int = 0) -> DatasetTask:
  """GSM8K through the user's-data path: a `DatasetTask` of GSM8K-format JSONL (rows
  `prompt` and `answer`, the final number as text) rewarded by `rewards` (default:
  `math_answer_reward()`, math-verify's judgement of the completion's final answer).

  Args:
    train_file, test_file: GSM8K JSONL ("question", "answer" ending "#### 18"); without
      `test_file`, `test_fraction` of the training questions are held out (a stable hash).
    tokenizer: the policy's tokenizer.
    template: the prompt text, "{question}" replaced by the question.
    chat: render the prompt as one user turn with the tokenizer's chat template.
    chat_variables: the template's options (`DatasetTask.chat_variables`), e.g.
      `{"enable_thinking": False}` for Qwen3.
    rewards: the reward functions (any `DatasetTask` rewards over the columns `answer`).
    seed: seeds the hashed split.
  """
  if "{question}" not in template:
    raise ConfigError(f"template={template!r} is invalid: must contain '{{question}}'")

  def rows(path):
    return [{"prompt": template.replace("{question}", q), "answer": format_number(v)}
            for q, v in read_gsm8k_jsonl(path)]

  return DatasetTask(rows(train_file), tokenizer,
                     math_answer_reward() if rewards is None else rewards,
                     reference_column="answer", chat_template=True if chat else None,
                     chat_variables=chat_variables,
                     test_source=None if test_file is None else rows(test_file),
                     test_fraction=test_fraction, seed=seed, name="gsm8k")
