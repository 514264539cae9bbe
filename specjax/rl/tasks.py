"""Tasks: prompts, references and rewards.

A task gives examples per split ("train", "test") and a reward. Two kinds of reward exist:

- In JAX (`reward_in_jax = True`): `reward(tokens [B, T], lengths [B], answers [B]) -> [B]`
  traces inside the compiled train step (the built-in `ArithmeticTask`).
- In Python (`reward_in_jax = False`): `reward(completions, references) -> [B]` on the host,
  so the step runs split: rollout in one compiled program, the reward between, the update in
  a second (`CustomTask`, and `GSM8KTask` in `specjax.rl.gsm8k`). `decode_completions` turns
  a `GenerationResult`'s tokens into the completions it takes.

Shape letters: see `specjax` (B rows, T generated tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.errors import ConfigError, RewardError
from specjax.tokenizer import CharTokenizer, Tokenizer, with_bos

SPLITS = ("train", "test")
ARITHMETIC_ALPHABET = "0123456789+-*="
# Worked solutions add a step separator and the mark before the final answer (appended, so
# every other id is the same as in ARITHMETIC_ALPHABET).
WORKED_ALPHABET = ARITHMETIC_ALPHABET + ",;"
ARITHMETIC_OPERATORS = "+-*"
# The JAX reward parses answers into int32; nine digits always fit, ten may not.
_MAX_ANSWER_DIGITS = 9
# A long-tail worked task's answers carry each problem's step count in their low bits
# (`ArithmeticTask.answer_key`), since a JAX reward sees answers, not prompts.
_STEP_BITS = 5


@dataclasses.dataclass(frozen=True)
class Example:
  """One prompt with its reference.

  Attributes:
    prompt: the prompt text (without special tokens).
    reference: the reference answer as text (what a Python reward compares against).
    answer: the reference as a number (what a JAX reward compares against); NaN when the
      task has no numeric answer.
    columns: the dataset row it came from, every column (a `DatasetTask`'s rewards read
      them); empty for the built-in tasks.
  """

  prompt: str
  reference: str
  answer: int | float = math.nan
  columns: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False,
                                                 repr=False)


@runtime_checkable
class Task(Protocol):
  """What the data pipeline and the train step need of a task."""

  @property
  def name(self) -> str:
    """Short identifier (used in dataset names and error messages)."""
    ...

  @property
  def tokenizer(self) -> Tokenizer:
    """Tokenizer of the prompts and of the policy's outputs."""
    ...

  @property
  def reward_in_jax(self) -> bool:
    """True: `reward(tokens, lengths, answers)` is jit-able; False: a host-side reward
    `reward(completions, references)`."""
    ...

  def examples(self, split: str) -> Sequence[Example]:
    """The examples of `split` (one of `SPLITS`), in a fixed order."""
    ...

  def reward(self, *args):
    """Rewards `[B]`; the arguments depend on `reward_in_jax` (see the module docstring)."""
    ...


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
  """Prompt ids as the policy sees them: BOS (when the tokenizer has one and the text does not
  already start with it), then the text."""
  return with_bos(tokenizer.encode(text), tokenizer.bos_id)


def task_prompt_ids(task: Task, text: str) -> list[int]:
  """Prompt ids of `task`'s prompt `text`: the task's own `encode_prompt` where it has one (a
  `DatasetTask` whose chat template writes its special tokens), else `encode_prompt`."""
  own = getattr(task, "encode_prompt", None)
  return own(text) if own is not None else encode_prompt(task.tokenizer, text)


def decode_completions(tokenizer: Tokenizer, tokens, lengths) -> list[str]:
  """Texts of generated rows, each cut at its length (special tokens dropped).

  Args:
    tokenizer: the policy's tokenizer.
    tokens: `[B, T]` generated ids.
    lengths: `[B]` generated tokens per row.
  """
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  return [tokenizer.decode(row[:n].tolist()) for row, n in zip(tokens, lengths)]


def _check_split(split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"split={split!r} is invalid: allowed {SPLITS}")


def _in_test_split(seed: int, text: str, fraction: float) -> bool:
  """Stable assignment of a prompt to the held-out split (independent of Python's hash)."""
  digest = hashlib.blake2b(f"{seed}:{text}".encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little") / 2.0**64 < fraction


# ---------------------------------------------------------------------------------------------
# Arithmetic


def _evaluate(operands: Sequence[int], operators: Sequence[str]) -> int:
  """Value of `o0 op1 o1 op2 o2 ...` with `*` binding tighter than `+` and `-`."""
  terms, signs = [operands[0]], [1]
  for op, x in zip(operators, operands[1:]):
    if op == "*":
      terms[-1] *= x
    else:
      terms.append(x)
      signs.append(1 if op == "+" else -1)
  return sum(s * t for s, t in zip(signs, terms))


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
  """Integer arithmetic such as "12+7=" -> "19", with a reward computed in JAX.

  Problems are drawn from `numpy.random.default_rng(seed)`: each operand uniform in
  `0 .. 10**max_digits - 1`, each operator uniform in `operators` (`*` binds tighter than
  `+`, `-`; answers may be negative). Each distinct prompt belongs to one split, chosen by a
  stable hash, so held-out prompts never occur in training; small problem spaces repeat
  prompts within a split.

  The policy must answer with the canonical decimal of the answer (optional "-", no leading
  zeros) and then EOS. Reward: 1.0 when it does; `format_reward` when the response up to EOS
  is `-?[0-9]+` and EOS was generated, but the value (or its canonical form) is wrong; else 0.

  With `worked`, the reference first works the problem left to right, one operation per
  step, and then gives the answer after ";": "3+9-4=" -> "3+9=12,12-4=8;8". The reward
  reads the number after the response's last ";" and asks for one "=" per operator before
  it (the steps themselves are not graded, but they cannot be skipped), so responses are
  several times longer and mostly predictable from the prompt and the previous step: the kind
  of text on which speculative decoding pays.

  With `max_operands`, problems have from `num_operands` to `max_operands` operands, a count
  `n` drawn with probability proportional to `operand_decay ** (n - num_operands)`: most
  problems are short and a few are several times longer, so worked responses spread over an
  order of magnitude within a batch, with a long tail, as reasoning RL rollouts do
  (`configs/arithmetic_long_tail.py`). A worked reward needs each problem's step count, so
  its `answers` are then keys, `answer_key(answer, steps)`: the answer shifted left by
  `_STEP_BITS` bits with the step count below.

  Attributes:
    max_digits: digits per operand, >= 1.
    num_operands: operands per problem, >= 2.
    operators: a non-empty subset of "+-*".
    num_train: training examples.
    num_test: held-out examples.
    test_fraction: share of the problem space reserved for the held-out split, in (0, 1).
    seed: seeds problem generation and the split.
    format_reward: reward of a well-formed but wrong answer, in [0, 1).
    worked: references are worked solutions (operators "+" and "-" only).
    max_operands: most operands per problem (None: every problem has `num_operands`).
    operand_decay: with `max_operands`, each operand beyond `num_operands` is this many
      times as likely as one fewer, in (0, 1].
  """

  max_digits: int = 2
  num_operands: int = 2
  operators: str = "+-"
  num_train: int = 10_000
  num_test: int = 500
  test_fraction: float = 0.1
  seed: int = 0
  format_reward: float = 0.0
  worked: bool = False
  max_operands: int | None = None
  operand_decay: float = 0.5

  name = "arithmetic"
  reward_in_jax = True

  def __post_init__(self):
    def require(ok: bool, field: str, allowed: str):
      if not ok:
        raise ConfigError(f"{field}={getattr(self, field)!r} is invalid: {allowed}")

    def positive_int(field: str, minimum: int):
      value = getattr(self, field)
      require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum, field,
              f"must be an int >= {minimum}")

    for field in ("test_fraction", "format_reward", "operand_decay"):
      value = getattr(self, field)
      require(isinstance(value, (int, float)) and not isinstance(value, bool), field,
              "must be a number")
    positive_int("max_digits", 1)
    positive_int("num_operands", 2)
    positive_int("num_train", 1)
    positive_int("num_test", 1)
    require(isinstance(self.seed, int), "seed", "must be an int")
    require(isinstance(self.operators, str) and len(self.operators) > 0
            and set(self.operators) <= set(ARITHMETIC_OPERATORS)
            and len(set(self.operators)) == len(self.operators), "operators",
            f"must be a non-empty subset of {ARITHMETIC_OPERATORS!r} without repeats")
    require(0 < self.test_fraction < 1, "test_fraction", "must be in (0, 1)")
    require(0 <= self.format_reward < 1, "format_reward", "must be in [0, 1)")
    require(isinstance(self.worked, bool), "worked", "must be True or False")
    if self.max_operands is not None:
      positive_int("max_operands", self.num_operands)
      require(0 < self.operand_decay <= 1, "operand_decay", "must be in (0, 1]")
      require(self.max_operands - 1 < 2**_STEP_BITS, "max_operands",
              f"must be at most {2**_STEP_BITS} (the reward reads at most "
              f"{2**_STEP_BITS - 1} steps from an answer key)")
    require(not self.worked or set(self.operators) <= set("+-"), "operators",
            "worked solutions go left to right: with worked=True only '+' and '-' are allowed")
    digits = len(str(self.max_abs_answer))
    keyed = self.keyed_answers
    limit = len(str(2**(31 - _STEP_BITS) - 1)) - 1 if keyed else _MAX_ANSWER_DIGITS
    require(digits <= limit, "max_digits",
            f"with {self.most_operands} operands and operators={self.operators!r} answers "
            f"reach {self.max_abs_answer} ({digits} digits), more than the {limit} the int32 "
            f"reward parses{' from an answer key' if keyed else ''}; lower max_digits or the "
            "operand count")

  @property
  def keyed_answers(self) -> bool:
    """Whether answers are keys (`answer_key`): a worked task of varying operand counts,
    whose reward needs each problem's step count."""
    return self.worked and self.max_operands is not None

  @property
  def most_operands(self) -> int:
    """Operands of the longest problem."""
    return self.num_operands if self.max_operands is None else self.max_operands

  @property
  def operand_probabilities(self) -> dict[int, float]:
    """Operand count -> probability that a drawn problem has it."""
    counts = range(self.num_operands, self.most_operands + 1)
    weights = [self.operand_decay ** (n - self.num_operands) for n in counts]
    return {n: w / sum(weights) for n, w in zip(counts, weights)}

  @property
  def max_abs_answer(self) -> int:
    """Largest |answer| the configuration can produce."""
    top, n = 10**self.max_digits - 1, self.most_operands
    return top**n if "*" in self.operators else n * top

  @staticmethod
  def answer_key(answer: int, steps: int) -> int:
    """What a long-tail worked task stores as a problem's answer: `answer` and its step
    count in one int32 (`_STEP_BITS` low bits)."""
    return answer * 2**_STEP_BITS + steps

  @property
  def max_answer_tokens(self) -> int:
    """Tokens of the longest correct response: sign, digits, EOS (a bound for max_new_tokens);
    with `worked`, each step "total op operand = total," before ";" and the answer."""
    number = len(str(self.max_abs_answer)) + ("-" in self.operators)
    if not self.worked:
      return number + 1
    step = number + 1 + self.max_digits + 1 + number + 1
    return (self.most_operands - 1) * step + number + 1

  @property
  def tokenizer(self) -> CharTokenizer:
    return CharTokenizer(WORKED_ALPHABET if self.worked else ARITHMETIC_ALPHABET)

  def _reference(self, operands: Sequence[int], operators: Sequence[str], answer: int) -> str:
    if not self.worked:
      return str(answer)
    steps, total = [], operands[0]
    for op, x in zip(operators, operands[1:]):
      new = total + x if op == "+" else total - x
      steps.append(f"{total}{op}{x}={new}")
      total = new
    return ",".join(steps) + f";{answer}"

  @functools.cached_property
  def _splits(self) -> dict[str, tuple[Example, ...]]:
    rng = np.random.default_rng(self.seed)
    wanted = {"train": self.num_train, "test": self.num_test}
    out = {"train": [], "test": []}
    # Each draw lands in the split its hash picks; give up when one split is so rare in the
    # problem space that filling it would take far longer than expected.
    budget = 100 * (self.num_train + self.num_test) + int(100 / self.test_fraction)
    batch = 1024
    counts, probabilities = zip(*self.operand_probabilities.items())
    for _ in range(0, budget, batch):
      operands = rng.integers(0, 10**self.max_digits, (batch, self.most_operands))
      ops = rng.integers(0, len(self.operators), (batch, self.most_operands - 1))
      # A task of one operand count draws nothing more, so its problems stay what they were.
      sizes = (rng.choice(counts, size=batch, p=probabilities) if self.max_operands is not None
               else np.full(batch, self.num_operands))
      for xs, os_, n in zip(operands.tolist(), ops.tolist(), sizes.tolist()):
        xs, symbols = xs[:n], [self.operators[i] for i in os_[:n - 1]]
        prompt = str(xs[0]) + "".join(o + str(x) for o, x in zip(symbols, xs[1:])) + "="
        split = "test" if _in_test_split(self.seed, prompt, self.test_fraction) else "train"
        if len(out[split]) < wanted[split]:
          answer = _evaluate(xs, symbols)
          out[split].append(Example(
              prompt=prompt, reference=self._reference(xs, symbols, answer),
              answer=self.answer_key(answer, n - 1) if self.keyed_answers else answer))
      if all(len(out[s]) == wanted[s] for s in SPLITS):
        return {s: tuple(v) for s, v in out.items()}
    raise ConfigError(f"test_fraction={self.test_fraction!r} is invalid for this problem "
                      f"space: after {budget} draws train has {len(out['train'])}/"
                      f"{self.num_train} and test {len(out['test'])}/{self.num_test} "
                      "examples; raise max_digits or num_operands, or change test_fraction")

  def examples(self, split: str) -> tuple[Example, ...]:
    _check_split(split)
    return self._splits[split]

  def reward(self, tokens: jax.Array, lengths: jax.Array, answers: jax.Array) -> jax.Array:
    """Rewards of generated answers, computed on device (jit-able, static shapes).

    Args:
      tokens: `[B, T]` generated ids (the `CharTokenizer` of this task).
      lengths: `[B]` generated tokens per row (EOS included when generated).
      answers: `[B]` integer answers.

    Returns:
      `[B]` float32: 1.0 correct, `format_reward` well-formed but wrong, 0.0 otherwise.
    """
    steps = self.num_operands - 1 if self.worked else None
    if self.keyed_answers:
      answers = jnp.asarray(answers, jnp.int32)
      answers, steps = answers >> _STEP_BITS, answers & (2**_STEP_BITS - 1)
    return arithmetic_reward(tokens, lengths, answers, format_reward=self.format_reward,
                             steps=steps)


def arithmetic_reward(tokens: jax.Array, lengths: jax.Array, answers: jax.Array, *,
                      format_reward: float = 0.0, steps: int | None = None) -> jax.Array:
  """`ArithmeticTask`'s reward for ids of `CharTokenizer(ARITHMETIC_ALPHABET)` (or of
  `WORKED_ALPHABET`, whose other ids are the same).

  The response is the tokens before the first EOS; its answer is the whole response, or for
  a worked solution (`steps` given) what follows its last ";", which `steps` "=" must
  precede. It is well-formed when EOS was generated (within `lengths`), the answer is
  `-?[0-9]+` and a worked solution has its ";" and its steps;
  correct when also canonical (no leading zero unless it is "0", no "-0"), at most nine
  digits, and equal to the reference answer.

  Args:
    tokens: `[B, T]` generated ids.
    lengths: `[B]` generated tokens per row.
    answers: `[B]` integer answers (|answer| < 10**9).
    format_reward: reward of a well-formed but wrong response.
    steps: responses are worked solutions ("a+b=c,c-d=e;e") of this many steps (an int, or
      `[B]` one per row); None: the response is the answer alone.

  Returns:
    `[B]` float32 rewards.
  """
  if not (jnp.ndim(tokens) == 2 and jnp.shape(lengths) == jnp.shape(tokens)[:1]
          and jnp.shape(answers) == jnp.shape(tokens)[:1]):
    raise ValueError(f"arithmetic_reward: tokens {jnp.shape(tokens)}, lengths "
                     f"{jnp.shape(lengths)}, answers {jnp.shape(answers)}: allowed tokens "
                     "[B, T] with lengths and answers [B]")
  tok = CharTokenizer(WORKED_ALPHABET)
  zero_id, minus_id, mark_id, equals_id = (tok.encode(c)[0] for c in "0-;=")
  tokens = jnp.asarray(tokens, jnp.int32)
  lengths = jnp.asarray(lengths, jnp.int32)
  answers = jnp.asarray(answers, jnp.int32)
  t = tokens.shape[1]
  pos = jnp.arange(t)[None, :]                                        # [1, T]

  is_eos = (tokens == tok.eos_id) & (pos < lengths[:, None])
  has_eos = is_eos.any(axis=1)
  end = jnp.where(has_eos, jnp.argmax(is_eos, axis=1), lengths)     # [B] response length
  begin = jnp.zeros_like(end)                                        # [B] the answer's start
  has_mark = jnp.ones_like(has_eos)  # a worked solution's ";" and steps
  if steps is not None:
    is_mark = (tokens == mark_id) & (pos < end[:, None])
    begin = jnp.where(is_mark.any(axis=1), jnp.max(jnp.where(is_mark, pos, -1), axis=1) + 1,
                      end)
    equals = ((tokens == equals_id) & (pos < begin[:, None])).sum(axis=1)
    has_mark = is_mark.any(axis=1) & (equals == steps)
  first = jnp.take_along_axis(tokens, jnp.minimum(begin, t - 1)[:, None], axis=1)[:, 0]
  negative = (first == minus_id) & (end > begin)
  start = begin + negative.astype(jnp.int32)                         # [B] first digit index
  digit = tokens - zero_id                                           # "0".."9" are consecutive
  is_digit = (digit >= 0) & (digit <= 9)
  in_number = (pos >= start[:, None]) & (pos < end[:, None])
  num_digits = end - start
  well_formed = (has_eos & has_mark & (num_digits >= 1)
                 & jnp.all(is_digit | ~in_number, axis=1))

  # Place value 10**(end - 1 - pos); exponents past nine would overflow int32, and numbers
  # that long are rejected by `num_digits` below anyway.
  exponent = end[:, None] - 1 - pos
  powers = jnp.asarray([10**k for k in range(_MAX_ANSWER_DIGITS)], jnp.int32)
  place = powers[jnp.clip(exponent, 0, _MAX_ANSWER_DIGITS - 1)]
  take = in_number & (exponent < _MAX_ANSWER_DIGITS)
  magnitude = jnp.sum(jnp.where(take, jnp.clip(digit, 0, 9) * place, 0), axis=1)
  value = jnp.where(negative, -magnitude, magnitude)

  first_digit = jnp.take_along_axis(digit, jnp.minimum(start, t - 1)[:, None], axis=1)[:, 0]
  canonical = ~((num_digits > 1) & (first_digit == 0)) & ~(negative & (magnitude == 0))
  correct = (well_formed & canonical & (num_digits <= _MAX_ANSWER_DIGITS)
             & (value == answers))
  return jnp.where(correct, 1.0, jnp.where(well_formed, format_reward, 0.0)).astype(
      jnp.float32)


# ---------------------------------------------------------------------------------------------
# Python rewards


@dataclasses.dataclass(frozen=True, eq=False)
class PythonReward:
  """A user reward function `fn(completion, reference) -> float`, checked sample by sample.

  Calling it scores a batch; if `fn` raises, or returns something that is not a finite real
  number, a `RewardError` names the task, the sample index, the completion and the reference.

  Attributes:
    fn: the user's function.
    task_name: named in errors.
  """

  fn: Callable[[str, str], float]
  task_name: str

  def __call__(self, completions: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """`[B]` completions and references -> `[B]` float32 rewards."""
    if len(completions) != len(references):
      raise ValueError(f"task {self.task_name!r}: {len(completions)} completions but "
                       f"{len(references)} references")
    out = np.empty(len(completions), np.float32)
    for i, (completion, reference) in enumerate(zip(completions, references)):
      where = (f"reward function of task {self.task_name!r} on sample {i} "
               f"(completion={completion!r}, reference={reference!r})")
      try:
        value = self.fn(completion, reference)
      except Exception as e:
        raise RewardError(f"{where} raised {type(e).__name__}: {e}") from e
      try:
        value = float(value)
      except (TypeError, ValueError):
        raise RewardError(f"{where} returned {value!r}, which is not a real number") from None
      if not math.isfinite(value):
        raise RewardError(f"{where} returned {value!r}; rewards must be finite")
      out[i] = value
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class CustomTask:
  """A user task: given examples and a Python reward function (split-mode train step).

  Attributes:
    name: the task's name.
    tokenizer: the policy's tokenizer.
    train: training examples.
    test: held-out examples.
    reward_fn: `fn(completion, reference) -> float`, wrapped in `PythonReward`.
  """

  name: str
  tokenizer: Tokenizer
  train: Sequence[Example]
  test: Sequence[Example]
  reward_fn: Callable[[str, str], float]

  reward_in_jax = False

  def __post_init__(self):
    if not (isinstance(self.name, str) and self.name):
      raise ConfigError(f"name={self.name!r} is invalid: must be a non-empty str")
    for split in SPLITS:
      bad = [i for i, e in enumerate(getattr(self, split)) if not isinstance(e, Example)]
      if bad:
        raise ConfigError(f"{split}[{bad[0]}] of task {self.name!r} is invalid: must be an "
                          "Example")
    if not callable(self.reward_fn):
      raise ConfigError(f"reward_fn={self.reward_fn!r} is invalid: must be a function "
                        "(completion: str, reference: str) -> float")
    for split in SPLITS:  # prompts the tokenizer cannot encode fail here, not at data prep
      for i, e in enumerate(getattr(self, split)):
        try:
          self.tokenizer.encode(e.prompt)
        except ValueError as err:
          raise ConfigError(f"{split}[{i}] of task {self.name!r} is invalid: its prompt "
                            f"{e.prompt!r} cannot be encoded by the tokenizer ({err})") from None
    object.__setattr__(self, "train", tuple(self.train))
    object.__setattr__(self, "test", tuple(self.test))

  def examples(self, split: str) -> tuple[Example, ...]:
    _check_split(split)
    return getattr(self, split)

  def reward(self, completions: Sequence[str], references: Sequence[str]) -> np.ndarray:
    """`[B]` completions and references -> `[B]` float32 rewards."""
    return PythonReward(self.reward_fn, self.name)(completions, references)
