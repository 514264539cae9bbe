"""Reward functions a user writes in Python, batched, with the dataset's columns.

A `RewardFunction` wraps `fn(prompts, completions, **columns) -> list[float | None]`: one call
per rollout batch, `prompts` and `completions` the texts of the B rows (each prompt repeated
for its G samples), and every other parameter a column of the dataset by name (the same row's
value for each sample), or all columns when `fn` takes `**columns`. A row's None means "this
function does not score that row" (a format check that applies to some prompts only); the
row's reward is the weighted sum of the functions that scored it.

`score` calls a tuple of them and returns the total reward per row with one mean per function,
logged as `reward_<name>` (TensorBoard `reward/<name>`). Whether a function can be called with
a dataset's columns is checked against its signature (`check_columns`) when the task is built,
before any model is loaded or trained.

A `JaxReward` is written in JAX instead: `fn(tokens [B, T], lengths [B], answers [B]) -> [B]`
on the generated ids, with each row's numeric answer (a `DatasetTask`'s `answer_column`).
When every reward of a task is one, the rewards trace into the fused train step (one compiled
program, no host round trip); beside Python rewards, they run compiled between the rollout and
the update. `check_traceable` traces one on abstract inputs when the task is built.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.checks import is_plain_int, is_real
from specjax.errors import ConfigError, RewardError

if TYPE_CHECKING:
  from specjax.rl.reward_workers import RewardPool

# What every reward function is passed besides the dataset's columns.
TEXT_ARGUMENTS = ("prompts", "completions")


def _check_reward(reward: RewardFunction | JaxReward, signature: str) -> None:
  """Check a reward's function, weight and name (defaulting to the function's)."""
  if not callable(reward.fn):
    raise ConfigError(f"reward function {reward.fn!r} is invalid: must be a function "
                      f"{signature}")
  if reward.name is None:
    object.__setattr__(reward, "name", getattr(reward.fn, "__name__", type(reward.fn).__name__))
  if not (isinstance(reward.name, str) and reward.name.isidentifier()):
    raise ConfigError(f"reward function name={reward.name!r} is invalid: must be an identifier "
                      "(it names the metric reward_<name>); pass name=")
  if not is_real(reward.weight):
    raise ConfigError(f"reward function {reward.name!r}: weight={reward.weight!r} is invalid: "
                      "must be a finite number")
  object.__setattr__(reward, "weight", float(reward.weight))  # a NumPy scalar too


@dataclasses.dataclass(frozen=True, eq=False)
class RewardFunction:
  """One weighted, batched Python reward.

  Attributes:
    fn: `fn(prompts, completions, **columns) -> list[float | None]` with one entry per
      completion (see the module docstring).
    weight: its weight in the total reward (may be negative: a penalty).
    name: the name of its metric (`reward_<name>`); default `fn.__name__`.
  """

  fn: Callable[..., Sequence[float | None]]
  weight: float = 1.0
  name: str | None = None

  def __post_init__(self):
    _check_reward(self, "fn(prompts, completions, **columns) -> list[float | None]")
    self._parameters()  # a function whose signature cannot be read fails here

  def _parameters(self) -> tuple[dict[str, inspect.Parameter], bool]:
    """The function's named parameters and whether it takes `**kwargs`."""
    try:
      params = inspect.signature(self.fn).parameters
    except (TypeError, ValueError) as err:
      raise ConfigError(f"reward function {self.name!r}: its signature cannot be read ({err}); "
                        "wrap it in a def fn(prompts, completions, **columns)") from None
    named = {n: p for n, p in params.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind is p.VAR_KEYWORD for p in params.values())

  def check_columns(self, columns: Iterable[str]) -> None:
    """Raise a `ConfigError` unless `fn` can be called with `prompts`, `completions` and the
    dataset `columns` as keywords: every parameter without a default must be one of them,
    and `prompts` and `completions` must be accepted."""
    columns = list(columns)
    taken = [c for c in TEXT_ARGUMENTS if c in columns]
    if taken:
      raise ConfigError(f"the dataset's column(s) {', '.join(taken)} take the name of an "
                        "argument every reward is passed (fn(prompts=..., completions=..., "
                        "**columns)); rename the column")
    named, var_keyword = self._parameters()
    offered = set(TEXT_ARGUMENTS) | set(columns)
    if not var_keyword:
      refused = [a for a in TEXT_ARGUMENTS if a not in named]
      if refused:
        raise ConfigError(f"reward function {self.name!r} takes no {' or '.join(refused)} "
                          "argument: every reward is called as fn(prompts=..., "
                          "completions=..., **columns); add the parameter (or **kwargs)")
    missing = [n for n, p in named.items() if p.default is p.empty and n not in offered]
    if missing:
      raise ConfigError(f"reward function {self.name!r} needs column(s) {', '.join(missing)}, "
                        f"which the dataset lacks (its columns: {', '.join(columns)}); give "
                        "the parameter a default or add the column")

  def arguments(self, columns: Mapping[str, Any]) -> dict[str, Any]:
    """The columns `fn` is passed: all with `**kwargs`, else those it names."""
    named, var_keyword = self._parameters()
    return dict(columns) if var_keyword else {k: v for k, v in columns.items() if k in named}

  def __call__(self, prompts: Sequence[str], completions: Sequence[str],
               columns: Mapping[str, Sequence[Any]], pool: RewardPool | None = None
               ) -> np.ndarray:
    """`[B]` float64 rewards, NaN where `fn` returned None: one call, or calls on chunks of
    rows over `pool`'s workers (`specjax.rl.reward_workers`)."""
    arguments = {"prompts": list(prompts), "completions": list(completions),
                 **self.arguments(columns)}
    if pool is None or pool.settings.inline:
      try:
        values = self.fn(**arguments)
      except Exception as err:
        raise RewardError(f"reward function {self.name!r} raised {type(err).__name__}: "
                          f"{err}") from err
      return self.values(values, completions)
    chunks = pool.map_rows(self.name, self.fn, arguments, len(completions))
    return np.concatenate([self.values(values, completions[first:last], first)
                           for first, last, values in chunks])

  def values(self, values: Any, completions: Sequence[str], first: int | None = None
             ) -> np.ndarray:
    """What `fn` returned for `completions` (the batch, or its rows `first`, `first + 1`, ...
    when one call scored those) as `[len(completions)]` float64, NaN for None.

    Raises:
      RewardError: not one number or None per completion, or a number that is not finite.
    """
    rows = "" if first is None else f" (rows {first}-{first + len(completions) - 1})"
    first = first or 0
    try:
      if isinstance(values, (str, bytes, Mapping, Set)):  # iterable, but not one value a row
        raise TypeError
      values = list(values)
    except TypeError:
      raise RewardError(f"reward function {self.name!r} returned {values!r}{rows}: allowed a "
                        f"list of {len(completions)} numbers or None") from None
    if len(values) != len(completions):
      raise RewardError(f"reward function {self.name!r} returned {len(values)} values for "
                        f"{len(completions)} completions{rows}: allowed one per completion")
    out = np.empty(len(values), np.float64)
    for i, value in enumerate(values):
      if value is None:
        out[i] = np.nan
        continue
      try:
        if isinstance(value, (str, bytes)):  # float("1") would read text as a reward
          raise TypeError
        out[i] = float(value)
      except (TypeError, ValueError, OverflowError):
        raise RewardError(f"reward function {self.name!r} returned {value!r} for sample "
                          f"{first + i} (completion={completions[i]!r}): allowed a number or "
                          "None") from None
      if not math.isfinite(out[i]):
        raise RewardError(f"reward function {self.name!r} returned {value!r} for sample "
                          f"{first + i} (completion={completions[i]!r}): rewards must be "
                          "finite (None: not scored)")
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class JaxReward:
  """One weighted reward written in JAX, traced into the compiled step.

  Attributes:
    fn: `fn(tokens [B, T] int32, lengths [B] int32, answers [B]) -> [B]` rewards of the
      generated ids (`lengths` generated tokens per row, EOS included where one was
      generated); `answers` are the rows' numeric answers (NaN without an answer column).
    weight: its weight in the total reward.
    name: the name of its metric (`reward_<name>`); default `fn.__name__`.
  """

  fn: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
  weight: float = 1.0
  name: str | None = None

  def __post_init__(self):
    _check_reward(self, "fn(tokens, lengths, answers) -> [B] rewards, in JAX")

  def check_traceable(self, answer_dtype=jnp.float32) -> None:
    """Raise a `ConfigError` unless `fn` traces on `[3, 5]` ids, `[3]` lengths and answers and
    returns `[3]` real numbers (before any model exists; `__call__` checks the shape again on
    the step's own batch)."""
    ids = jax.ShapeDtypeStruct((3, 5), jnp.int32)
    rows = jax.ShapeDtypeStruct((3,), jnp.int32)
    try:
      out = jax.eval_shape(self.fn, ids, rows, jax.ShapeDtypeStruct((3,), answer_dtype))
    except Exception as err:
      raise ConfigError(f"JAX reward {self.name!r} does not trace on tokens [B, T] int32, "
                        f"lengths [B] int32 and answers [B] ({type(err).__name__}: {err}); "
                        "write it in jax.numpy, or make it a Python RewardFunction") from None
    self._check_output(out, 3)

  def _check_output(self, out: Any, rows: int) -> None:
    """A `ConfigError` unless `out` (traced or abstract) is `[rows]` real numbers."""
    if not (hasattr(out, "shape") and out.shape == (rows,)
            and jnp.issubdtype(out.dtype, jnp.number)):
      what = (f"shape {tuple(out.shape)} {out.dtype}" if hasattr(out, "shape")
              and hasattr(out, "dtype") else repr(out))
      raise ConfigError(f"JAX reward {self.name!r} returns {what} for {rows} rows: allowed one "
                        "real number per row, shape [B]")

  def __call__(self, tokens, lengths, answers) -> jax.Array:
    """`[B]` float32 rewards (checked for shape `[B]` as it traces)."""
    out = self.fn(tokens, lengths, answers)
    self._check_output(out, tokens.shape[0])
    return jnp.asarray(out, jnp.float32)


def jax_rewards(rewards: Sequence[JaxReward], tokens, lengths, answers
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The weighted total `[B]` of `rewards` and each one's `[B]` values by name (traceable)."""
  parts = {r.name: r(tokens, lengths, answers) for r in rewards}
  total = sum(r.weight * parts[r.name] for r in rewards)
  return jnp.asarray(total, jnp.float32), parts


def as_reward_functions(rewards: Any) -> tuple[RewardFunction | JaxReward, ...]:
  """`rewards` (one function, `RewardFunction` or `JaxReward`, or a sequence of them) as a
  tuple with distinct names; a plain function is a Python `RewardFunction`."""
  items = list(rewards) if isinstance(rewards, (list, tuple)) else [rewards]
  if not items:
    raise ConfigError("rewards=() is invalid: give at least one reward function")
  out = tuple(r if isinstance(r, (RewardFunction, JaxReward)) else RewardFunction(r)
              for r in items)
  names = [r.name for r in out]
  twice = sorted({n for n in names if names.count(n) > 1})
  if twice:
    raise ConfigError(f"reward functions named {', '.join(twice)} appear more than once: each "
                      "names its metric; pass RewardFunction(fn, name=...) to tell them apart")
  return out


def _computed(reward: JaxReward, values: Any, completions: Sequence[str]) -> np.ndarray:
  """A `JaxReward`'s `[B]` values, computed in the step, as `score` takes them: it scores
  every row, so a NaN is an error there (not "unscored", as a Python reward's None is)."""
  values = np.asarray(values, np.float64)
  if values.shape != (len(completions),):
    raise RewardError(f"JAX reward {reward.name!r} returned shape {values.shape} for "
                      f"{len(completions)} completions: allowed one value per completion")
  bad = np.flatnonzero(~np.isfinite(values))
  if bad.size:
    i = int(bad[0])
    raise RewardError(f"JAX reward {reward.name!r} returned {values[i]} for sample {i} "
                      f"(completion={completions[i]!r}; {bad.size} such): rewards must be "
                      "finite (answers are NaN where the task has no answer column)")
  return values


def score(rewards: Sequence[RewardFunction], prompts: Sequence[str],
          completions: Sequence[str], columns: Mapping[str, Sequence[Any]],
          computed: Mapping[str, np.ndarray] | None = None, pool: RewardPool | None = None,
          per_row: bool = False) -> tuple[np.ndarray, dict[str, Any]]:
  """The total reward of each row and each function's mean.

  Args:
    rewards: the functions; a `JaxReward` among them takes its `[B]` values from `computed`.
    prompts, completions: `[B]` texts.
    columns: the dataset's columns, each `[B]` (the row's prompt's values).
    computed: values of the `JaxReward`s by name (`jax_rewards`).
    pool: the workers that call the Python functions (`RewardPool`; None: called directly).
    per_row: return each function's values instead of its mean (to average over the rows of
      several processes).

  Returns:
    `[B]` float32 weighted sums over the functions that scored each row, and
    `{"reward_<name>": mean over the rows it scored}` (NaN when it scored none), or with
    `per_row` its `[B]` float64 values (NaN where it did not score).

  Raises:
    RewardError: a function failed or returned something other than B numbers or None, a
      `JaxReward` a value that is not finite, no function scored a row, or a row's weighted
      total is beyond float32's range.
  """
  computed = computed or {}
  per_function = {r.name: _computed(r, computed[r.name], completions)
                  if isinstance(r, JaxReward) else r(prompts, completions, columns, pool)
                  for r in rewards}
  stacked = np.stack([per_function[r.name] * r.weight for r in rewards])
  unscored = np.flatnonzero(np.isnan(stacked).all(axis=0))
  if unscored.size:
    i = int(unscored[0])
    raise RewardError(f"no reward function scored sample {i} (completion={completions[i]!r}; "
                      f"{unscored.size} such of {len(completions)}): every function returned "
                      "None; at least one must score each completion")
  total = np.nansum(stacked, axis=0)
  beyond = np.flatnonzero(np.abs(total) > np.finfo(np.float32).max)
  if beyond.size:
    i = int(beyond[0])
    raise RewardError(f"the weighted total reward of sample {i} is {total[i]:g} "
                      f"(completion={completions[i]!r}; {beyond.size} such): beyond float32's "
                      "range, in which the step computes advantages; scale the rewards down")
  total = total.astype(np.float32)
  if per_row:
    return total, {f"reward_{name}": values for name, values in per_function.items()}
  means = {}
  for name, values in per_function.items():
    scored = values[~np.isnan(values)]
    means[f"reward_{name}"] = float(scored.mean()) if scored.size else math.nan
  return total, means


def math_answer_reward(column: str = "answer", weight: float = 1.0,
                       name: str = "math_answer", timeout_s: int | None = 5) -> RewardFunction:
  """A reward of 1 for a completion whose final mathematical answer equals the row's `column`
  (text such as "18", "\\frac{1}{2}", "0.5"), else 0, judged by Hugging Face's `math-verify`
  (it extracts the answer from free text, \\boxed{} or LaTeX and compares values symbolically,
  so "1/2", "0.5" and "\\frac{1}{2}" agree).

  `timeout_s` bounds math-verify's parse and comparison of one completion (a pathological
  expression can keep sympy busy for minutes); past it the completion scores 0. math-verify
  enforces it with SIGALRM, which works in a process's main thread only: a worker process
  (`--rewards.kind process`) or a sync run that scores in its main thread. Elsewhere (async
  mode's background scoring, thread workers) math-verify runs without its own limit, and
  `--rewards.timeout-s` with process workers is the bound.

  Raises:
    ConfigError: `math-verify` is not installed (`pip install 'specjax[math]'`), or
      `timeout_s` is not None or a whole number of seconds >= 1.
  """
  try:
    import math_verify
  except ImportError:
    raise ConfigError("math_answer_reward needs math-verify: pip install 'specjax[math]'") \
        from None
  if not (timeout_s is None or (is_plain_int(timeout_s) and timeout_s >= 1)):
    raise ConfigError(f"math_answer_reward: timeout_s={timeout_s!r} is invalid: allowed None "
                      "(no limit) or a whole number of seconds >= 1 (math-verify's alarm)")

  def math_answer(prompts, completions, **columns):
    # SIGALRM can be set from the main thread only; math-verify refuses it elsewhere.
    limit = timeout_s if threading.current_thread() is threading.main_thread() else None
    parse = lambda text: math_verify.parse(str(text), parsing_timeout=limit)
    return [float(math_verify.verify(parse(ref), parse(text), timeout_seconds=limit))
            for text, ref in zip(completions, columns[column], strict=True)]

  # The column it reads, as a named parameter: `check_columns` names it when a dataset lacks it.
  math_answer.__signature__ = inspect.Signature(
      [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY)
       for n in (*TEXT_ARGUMENTS, column)])
  return RewardFunction(math_answer, weight=weight, name=name)


def format_reward(pattern: str, *, weight: float = 1.0, name: str = "format",
                  full: bool = False) -> RewardFunction:
  """1 for a completion that matches the regular expression `pattern` (`re.search`, or the
  whole completion with `full`), else 0: a format check such as
  `format_reward(r"<think>.*</think>\\s*<answer>.*</answer>", full=True)` (DOTALL: `.`
  crosses lines).

  Raises:
    ConfigError: `pattern` is not a string or not a valid regular expression.
  """
  compiled = _regex(pattern, "format_reward")
  match = compiled.fullmatch if full else compiled.search

  def format_check(prompts, completions):
    return [float(match(text.strip() if full else text) is not None) for text in completions]

  return RewardFunction(format_check, weight=weight, name=name)


def answer_tag_reward(column: str = "answer", *, tag: str = "answer", weight: float = 1.0,
                      name: str = "answer_tag") -> RewardFunction:
  """1 for a completion whose last `<tag>...</tag>` holds the row's `column` (both stripped of
  surrounding whitespace, compared as text), 0 for another answer or none: the exact-match
  reward of recipes that ask for the answer in tags (DeepSeek-R1's `<answer>`). Use
  `math_answer_reward` to compare numbers by value.

  Raises:
    ConfigError: `tag` is not a plain tag name (letters, digits, `_`, `-`).
  """
  if not (isinstance(tag, str) and re.fullmatch(r"[A-Za-z_][\w-]*", tag)):
    raise ConfigError(f"tag={tag!r} is invalid: allowed a tag name of letters, digits, '_' "
                      "and '-' (e.g. 'answer')")
  find = re.compile(rf"<{tag}>(.*?)</{tag}>", re.DOTALL).findall

  def answer_tag(prompts, completions, **columns):
    references = columns[column]
    out = []
    for text, ref in zip(completions, references):
      found = find(text)
      out.append(float(bool(found) and found[-1].strip() == str(ref).strip()))
    return out

  # The column it reads, as a named parameter: `check_columns` names it when a dataset lacks it.
  answer_tag.__signature__ = inspect.Signature(
      [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY)
       for n in (*TEXT_ARGUMENTS, column)])
  return RewardFunction(answer_tag, weight=weight, name=name)


def _regex(pattern: Any, where: str) -> re.Pattern:
  if not isinstance(pattern, str):
    raise ConfigError(f"{where}: pattern={pattern!r} is invalid: allowed a regular expression "
                      "string")
  try:
    return re.compile(pattern, re.DOTALL)
  except re.error as err:
    raise ConfigError(f"{where}: pattern={pattern!r} is not a valid regular expression "
                      f"({err})") from None
