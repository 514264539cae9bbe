"""The README demo on a training set that comes back, its rollouts drafted from history.

  specjax train --config configs/arithmetic_worked_history.py
  # acceptance at one fixed depth in every round, instead of the adaptive choice:
  specjax train --config configs/arithmetic_worked_history.py --rollout.speculation fixed

RL recipes go over a finite set of training prompts several times (GSM8K's 7.5k questions
for a few epochs). Here 256 worked sums, 16 a step: every prompt comes back every 16 steps,
some 19 times in 300 steps. The rollout drafter is `history`: each row drafts what earlier
answers to its prompt wrote after its last tokens (the train state's `HistoryBank`, recorded
inside every step and checkpointed), else what a sibling or a recent answer to another prompt
wrote. No drafter model, so no forward pass of its own; the adaptive policy picks plain
decoding or a chain of 1 .. 8 drafts each round by the costs measured at the start. Every 20
steps the acceptance arms measure group, history and n-gram drafting on fixed chains of 8
(`arm_acceptance_*`: what each would accept, also where the policy decodes plainly).
Measured on a 2-core CPU: docs/decoding.md, "History drafting".
"""

import runpy
from pathlib import Path

from specjax.experiments import override
from specjax.rl import ArithmeticTask


def get_config():
  """configs/arithmetic_worked.py on 256 training prompts, history-drafted chains up to 8."""
  base = runpy.run_path(str(Path(__file__).with_name("arithmetic_worked.py")))["get_config"]()
  task = ArithmeticTask(max_digits=1, num_operands=4, operators="+", worked=True,
                        test_fraction=0.3, num_test=200, num_train=256)
  return override(base, {
      "run_dir": "runs/arithmetic_worked_history",
      "task": task,
      "drafter.name": "history",
      "drafter.history_slots": 1024,  # 4x the prompts: few of them share a slot
      "rollout.tree_widths": (1,) * 8,
      "eval.arm_drafters": ("group", "history", "ngram"),
  })
