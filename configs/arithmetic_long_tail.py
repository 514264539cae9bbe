"""GRPO on worked sums whose lengths look like reasoning RL's: a few rows much longer.

  specjax train --config configs/arithmetic_long_tail.py [--rollout.compaction 3 ...]

configs/arithmetic_worked.py's recipe on problems of 2 to 16 one-digit operands (issue 33):
each operand beyond two is 0.75 times as likely as one fewer, so a quarter of the problems
have two operands and 4% twelve or more. Worked responses run from 8 tokens to 122
in the training set (154 at most), median 24. In a step's 16 prompts x 8 samples with the
references' lengths, the longest row is 10x the shortest (median over batches) and 54% of
plain decoding's rounds run with at most a quarter of the rows still live: the tail where
compaction (`rollout.compaction`) and speculation pay. The reward reads each problem's step
count from its answer key (`ArithmeticTask.answer_key`), so no step can be skipped on a long
problem either. Its warm start is slow on a CPU: 2.5 s per step of 64 x 160-token sequences on
2 cores (measured at max_operands=12), about half an hour for the 600 steps.
"""

import runpy
from pathlib import Path

from specjax.experiments import override
from specjax.rl import ArithmeticTask


def get_config():
  """configs/arithmetic_worked.py with the long-tail task."""
  base = runpy.run_path(str(Path(__file__).with_name("arithmetic_worked.py")))["get_config"]()
  task = ArithmeticTask(max_digits=1, num_operands=2, max_operands=16, operand_decay=0.75,
                        operators="+", worked=True, test_fraction=0.3, num_test=200)
  return override(base, {
      "run_dir": "runs/arithmetic_long_tail",
      "task": task,
      "model": base.model.replace(vocab_size=task.tokenizer.vocab_size, max_position=192),
      "rollout.max_new_tokens": task.max_answer_tokens,
  })
