"""The CPU demo: GRPO with speculative (MTP) rollouts on worked sums, ~0.7M parameters.

  specjax train --config configs/arithmetic_worked.py [--steps 300 --grpo.group-size 8 ...]

Task: four one-digit operands added left to right, every step written out before the answer
("3+9+4+5=" -> "3+9=12,12+4=16,16+5=21;21"): responses of 24 tokens on average, most of them
predictable from the prompt and the previous step, the kind of text a drafter accepts several
tokens of. Held-out prompts are disjoint from training. The supervised warm start learns the
worked solutions from text in which only 10% of them end with EOS; the others run on into the
next problem, as concatenated text without separators does. The warm-started policy
therefore rarely stops, and the reward (the right number after ";", then EOS) is almost never
earned. GRPO learns to stop after the answer, a behaviour that carries over to unseen
prompts. Rollouts use adaptive speculation: each round runs the menu entry (plain decoding,
MTP chains of 1 and 2) with the most tokens per second by the costs measured at the start of
the run, so speculation is never a loss.
"""

import runpy
from pathlib import Path

from specjax.experiments import override
from specjax.rl import ArithmeticTask


def get_config():
  """configs/arithmetic_tiny.py's policy, GRPO and adaptive MTP rollouts on worked sums."""
  base = runpy.run_path(str(Path(__file__).with_name("arithmetic_tiny.py")))["get_config"]()
  task = ArithmeticTask(max_digits=1, num_operands=4, operators="+", worked=True,
                        test_fraction=0.3, num_test=200)
  return override(base, {
      "run_dir": "runs/arithmetic_worked",
      "task": task,
      "model": base.model.replace(vocab_size=task.tokenizer.vocab_size, max_position=48),
      "rollout.max_new_tokens": task.max_answer_tokens,
      "warm_start.steps": 600,
      # Each rollout arm (plain, speculative) timed on the current policy every 20 steps:
      # curves.png's fourth panel.
      "eval.arms_every": 20,
  })
