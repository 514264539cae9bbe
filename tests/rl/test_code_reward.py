"""The code reward: a correct program scores 1, a wrong one 0, and programs that loop, fork,
allocate, flood their output or reach for the network score 0 within their limits while the
run goes on."""

import os
import time

import pytest

from specjax.errors import ConfigError
from specjax.rl.code_reward import CodeLimits, code_reward, extract_program, run_program
from specjax.rl.datasets import DatasetTask
from specjax.rl.reward_workers import RewardPool, RewardWorkers
from specjax.tokenizer import CharTokenizer

LIMITS = CodeLimits(timeout_s=5, cpu_s=2, memory_mb=256, output_kb=64)
ADD = "def add(a, b):\n  return a + b\n"


def test_extract_program_takes_the_last_fenced_block_or_the_whole_text():
  assert extract_program("plan\n```python\nx = 1\n```\nthen\n```py\nx = 2\n```\n") == "x = 2\n"
  assert extract_program("```\ny = 3\n```") == "y = 3\n"
  assert extract_program("z = 4") == "z = 4"


@pytest.mark.parametrize("source, status", [
    (ADD + "assert add(2, 3) == 5\n", "passed"),
    (ADD + "assert add(2, 3) == 6\n", "failed"),
    ("while True:\n  pass\n", "timeout"),  # CPU limit
    ("import time\ntime.sleep(60)\n", "timeout"),  # wall clock
    ("import os\nwhile True:\n  os.fork()\n", "refused"),  # a fork bomb
    ("x = bytearray(10 * 2**30)\n", "memory"),  # 10 GiB
    ("while True:\n  print('x' * 1000)\n", "output"),
    ("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=2)\n",
     "refused"),
    ("import socket\nsocket.socket().connect(('127.0.0.1', 9))\n", "refused"),
    ("import subprocess\nsubprocess.run(['true'])\n", "refused"),
], ids=["correct", "wrong", "loop", "sleep", "fork-bomb", "10GiB", "output", "url", "socket",
        "subprocess"])
def test_each_run_ends_within_its_limits(source, status):
  processes = len(os.listdir("/proc")) if os.path.isdir("/proc") else 0
  begin = time.monotonic()
  result = run_program(source, LIMITS)
  assert result.status == status, result.detail
  assert result.passed == (status == "passed")
  assert time.monotonic() - begin < LIMITS.timeout_s + 5
  if processes:  # nothing left running (a fork bomb's children included)
    assert len(os.listdir("/proc")) <= processes + 5


def test_the_reward_is_the_share_of_tests_passed_and_unscored_without_tests():
  reward = code_reward(timeout_s=5, cpu_s=2, memory_mb=256)
  completions = ["```python\n" + ADD + "```", "def add(a, b):\n  return a * b\n", ADD, ADD]
  tests = ["assert add(2, 3) == 5",
           "assert add(2, 3) == 5",
           ["assert add(1, 1) == 2", "assert add(2, 2) == 4", "assert add(0, 0) == 1"],
           None]
  values = reward(["p"] * 4, completions, {"tests": tests})
  assert values[:3].tolist() == pytest.approx([1.0, 0.0, 2 / 3])
  assert values[3] != values[3]  # NaN: not scored
  with RewardPool(RewardWorkers(workers=2)) as pool:  # threads wait on the subprocesses
    pooled = reward(["p"] * 4, completions, {"tests": tests}, pool)
  assert pooled[:3].tolist() == values[:3].tolist()


def test_a_code_reward_needs_its_tests_column_and_sane_limits():
  rows = [{"prompt": f"{i}", "solution": "x"} for i in range(100)]
  with pytest.raises(ConfigError, match=r"'code' needs column\(s\) tests"):
    DatasetTask(rows, CharTokenizer("0123456789"), [code_reward()])
  for field, value in (("timeout_s", 0), ("cpu_s", 0), ("memory_mb", 8), ("output_kb", 1.5)):
    with pytest.raises(ConfigError, match=rf"{field}={value!r} is invalid"):
      code_reward(**{field: value})


@pytest.mark.slow  # a short run of the config: under a minute on 2 cores
def test_the_code_config_trains_with_its_tests_as_a_column(tmp_path):
  import json
  from pathlib import Path

  from specjax.cli import main as cli_main
  config = Path(__file__).resolve().parents[2] / "configs" / "code_tests.py"
  run_dir = tmp_path / "run"
  cli_main(["train", "--config", str(config), "--run-dir", str(run_dir), "--steps", "2",
            "--warm-start.steps", "20", "--eval.prompts", "4", "--eval.speedup-repeats", "1",
            "--eval.speedup-seconds", "0"])
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2]
  for record in records:
    assert 0.0 <= record["reward_code"] <= 1.0 and record["perf_reward_s"] > 0
