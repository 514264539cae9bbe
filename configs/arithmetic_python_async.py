"""GRPO rewarded in Python (math-verify) in async mode, on one process or on several.

  specjax train --config configs/arithmetic_python_async.py        # one process, ~5 min

  # 2 processes x 2 CPU devices, as two hosts would run it (README, "Multi-host"):
  export JAX_NUM_CPU_DEVICES=2
  specjax train --config configs/arithmetic_python_async.py --coordinator-address \\
      localhost:12355 --num-processes 2 --process-id 0 &
  specjax train --config configs/arithmetic_python_async.py --coordinator-address \\
      localhost:12355 --num-processes 2 --process-id 1

`configs/arithmetic_tiny.py`'s recipe through the user's-data path: its problems become rows
of a `DatasetTask` shaped as GSM8K's (a question, its final number as `answer`, a worked
`reference` for the warm start), rewarded by `math_answer_reward()`: math-verify extracts the
completion's final answer and compares it with the row's, on the host. The warm-started
policy rarely stops, so its completions run on into other numbers and score 0; GRPO learns to
stop after the answer. In async mode the host scores each rollout in the background while the
devices run the update and the next rollout; on several processes each scores the rows of its
own prompts. Two reward workers in processes (math-verify's sympy holds the GIL; its own
timeout works in a worker's main thread), each call under 30 s.
"""

import dataclasses
import runpy
from pathlib import Path

from specjax.experiments import ExperimentConfig, Pipeline
from specjax.rl import ArithmeticTask
from specjax.rl.datasets import DatasetTask
from specjax.rl.reward_workers import RewardWorkers
from specjax.rl.rewards import math_answer_reward


def rows(task: ArithmeticTask, split: str) -> list[dict]:
  return [{"prompt": e.prompt, "answer": str(e.answer), "reference": e.reference}
          for e in task.examples(split)]


def get_config() -> ExperimentConfig:
  tiny = runpy.run_path(str(Path(__file__).with_name("arithmetic_tiny.py")))["get_config"]()
  problems = tiny.task
  task = DatasetTask(rows(problems, "train"), problems.tokenizer, [math_answer_reward()],
                     reference_column="reference", test_source=rows(problems, "test"),
                     name="arithmetic_python")
  return dataclasses.replace(
      tiny, run_dir="runs/arithmetic_python_async", task=task, steps=150,
      pipeline=Pipeline(async_mode=True),
      rewards=RewardWorkers(workers=2, kind="process", timeout_s=30))
