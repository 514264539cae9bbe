"""Reward workers: the same rewards as one direct call, a timeout policy that holds, and workers
that raise, hang or die never hang the caller."""

import os
import runpy
import signal
import sys
import threading
import time

import cloudpickle
import numpy as np
import pytest

from specjax.errors import ConfigError, RewardError
from specjax.rl.reward_workers import RewardPool, RewardWorkers
from specjax.rl.rewards import RewardFunction, score

# This module's functions travel to worker processes by value: a worker then starts without
# importing the test suite (and JAX with it), as a user's reward module would not.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROWS = 7
PROMPTS = [f"p{i}" for i in range(ROWS)]
COMPLETIONS = [f"answer {i * 3}" for i in range(ROWS)]
COLUMNS = {"target": [str(i * 3 if i % 2 else i) for i in range(ROWS)], "extra": [0] * ROWS}


def matches(prompts, completions, target):
  return [float(c.split()[-1] == t) for c, t in zip(completions, target, strict=True)]


def length(prompts, completions):
  return [None if c.endswith("0") else len(c) / 10 for c in completions]


def _score(settings, rewards=(matches, length)):
  with RewardPool(settings) as pool:
    return score([RewardFunction(f) for f in rewards], PROMPTS, COMPLETIONS, COLUMNS, pool=pool)


@pytest.mark.parametrize("settings", [
    RewardWorkers(workers=3, rows_per_call=2),
    RewardWorkers(workers=2, timeout_s=30),
    RewardWorkers(workers=2, kind="process", rows_per_call=3),
    RewardWorkers(workers=1, kind="process")], ids=["threads", "threads-timeout", "processes",
                                                     "one-process"])
def test_workers_give_the_rewards_of_one_direct_call(settings):
  direct, direct_means = _score(RewardWorkers())
  pooled, means = _score(settings)
  np.testing.assert_array_equal(pooled, direct)
  assert means == direct_means
  # By hand: 1 where the answer matches, plus its length / 10 but for "answer 0" (unscored).
  np.testing.assert_allclose(direct, [1.0, 1.8, 0.8, 1.8, 0.9, 1.9, 0.9], rtol=1e-6)


def test_a_pool_keeps_its_workers_across_batches():
  pids = []

  def pid(prompts, completions):
    pids.append(threading.get_ident())
    return [0.0] * len(completions)

  with RewardPool(RewardWorkers(workers=2)) as pool:
    for _ in range(3):
      score([RewardFunction(pid)], PROMPTS, COMPLETIONS, COLUMNS, pool=pool)
  assert len(set(pids)) == 2 and len(pids) == 6


def failing(prompts, completions):
  if "answer 9" in completions:
    raise ValueError("cannot parse")
  return [0.0] * len(completions)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_an_error_names_the_function_and_its_rows(kind):
  with pytest.raises(RewardError, match=r"'failing' raised ValueError: cannot parse \(on rows "
                                        r"2-3") as err:
    _score(RewardWorkers(workers=2, kind=kind, rows_per_call=2), (failing,))
  if kind == "process":  # the worker's traceback comes with it
    assert "reward worker process" in str(err.value) and "Traceback" in str(err.value)


def short(prompts, completions):
  return [1.0] * (len(completions) - 1)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_call_that_returns_too_few_values_is_named_with_its_rows(kind):
  with pytest.raises(RewardError, match=r"'short' returned 1 values for 2 completions \(rows "
                                        r"0-1\)"):
    _score(RewardWorkers(workers=2, kind=kind, rows_per_call=2), (short,))


def hangs_on_nine(prompts, completions):
  if "answer 9" in completions:
    time.sleep(600)
  return [2.0] * len(completions)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_timeout_policies(kind):
  """A call past rewards.timeout_s gets the policy within the timeout and a second, whatever
  the hung function still does; the other rows keep their rewards."""
  for policy, expect in (("unscored", [2.0, 2.0, 2.0, 0.0, 2.0, 2.0, 2.0]),
                         ("score", [2.0, 2.0, 2.0, -0.5, 2.0, 2.0, 2.0])):
    begin = time.monotonic()
    total, means = _score(RewardWorkers(workers=3, kind=kind, rows_per_call=1, timeout_s=1.0,
                                        on_timeout=policy, timeout_score=-0.5),
                          (hangs_on_nine, matches))
    assert time.monotonic() - begin < 1.0 + 5.0
    # Beside `matches`: 2 a row, and on the hung row nothing (unscored) or the timeout score.
    np.testing.assert_allclose(total - np.asarray(_score(RewardWorkers(), (matches,))[0]),
                               expect)
  begin = time.monotonic()
  with pytest.raises(RewardError, match=r"'hangs_on_nine' took more than rewards.timeout_s=1 s "
                                        r"on row 3 \(rewards.on_timeout='stop'"):
    _score(RewardWorkers(workers=2, kind=kind, rows_per_call=1, timeout_s=1.0),
           (hangs_on_nine,))
  assert time.monotonic() - begin < 1.0 + 5.0


def test_a_timed_out_process_is_killed_and_replaced():
  settings = RewardWorkers(workers=1, kind="process", rows_per_call=1, timeout_s=1.0,
                           on_timeout="score")
  with RewardPool(settings) as pool:
    score([RewardFunction(hangs_on_nine)], PROMPTS, COMPLETIONS, COLUMNS, pool=pool)
    assert pool.timed_out == 1
    total, _ = score([RewardFunction(hangs_on_nine)], PROMPTS[:2], COMPLETIONS[:2],
                     {k: v[:2] for k, v in COLUMNS.items()}, pool=pool)
    assert total.tolist() == [2.0, 2.0]


def test_a_killed_worker_is_replaced_and_its_rows_run_again(tmp_path):
  marker = tmp_path / "killed"

  def dies_once(prompts, completions):
    if not marker.exists():
      marker.write_text("x")
      os.kill(os.getpid(), signal.SIGKILL)
    return [1.0] * len(completions)

  total, _ = _score(RewardWorkers(workers=2, kind="process"), (dies_once,))
  assert total.tolist() == [1.0] * ROWS and marker.exists()


def dies(prompts, completions):
  os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_that_dies_twice_on_the_same_rows_stops_the_run():
  begin = time.monotonic()
  with pytest.raises(RewardError, match=r"'dies': its worker process killed by SIGKILL twice "
                                        r"while scoring rows 0-6"):
    _score(RewardWorkers(workers=1, kind="process"), (dies,))
  assert time.monotonic() - begin < 30


def test_a_reward_from_a_config_file_travels_to_a_worker_process(tmp_path):
  """A function of a file run by path (as `specjax train` runs a config) is not importable by
  name in a fresh process: it is pickled by value, closure and globals with it."""
  path = tmp_path / "my_config.py"
  path.write_text("import math\nSCALE = 3.0\n\ndef make(offset):\n"
                  "  def scaled(prompts, completions):\n"
                  "    return [math.floor(SCALE * len(c)) + offset for c in completions]\n"
                  "  return scaled\n")
  fn = runpy.run_path(str(path))["make"](0.5)
  total, _ = _score(RewardWorkers(workers=2, kind="process"), (fn,))
  assert total.tolist() == [3.0 * len(c) + 0.5 for c in COMPLETIONS]


@pytest.mark.parametrize("field, value, allowed", [
    ("workers", 0, ">= 1"), ("kind", "fork", "'thread', 'process'"),
    ("timeout_s", 0, "> 0"), ("timeout_s", float("nan"), "> 0"),
    ("on_timeout", "skip", "'stop', 'unscored', 'score'"),
    ("timeout_score", float("inf"), "finite"), ("rows_per_call", -1, ">= 0")])
def test_bad_settings_name_the_field(field, value, allowed):
  with pytest.raises(ConfigError, match=rf"rewards.{field}=.*{allowed}"):
    RewardWorkers(**{field: value})


def test_a_reward_that_cannot_be_pickled_is_refused_for_process_workers():
  lock = threading.Lock()

  def locked(prompts, completions):
    with lock:
      return [0.0] * len(completions)

  RewardWorkers(kind="thread").check_functions([RewardFunction(locked)])  # threads share it
  with pytest.raises(ConfigError, match=r"reward function 'locked' cannot be sent to a worker "
                                        r"process \(rewards.kind='process'\)"):
    RewardWorkers(kind="process").check_functions([RewardFunction(locked)])
