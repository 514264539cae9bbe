"""GRPO with speculative (MTP) rollouts on short arithmetic answers, ~0.7M parameters.

  specjax train --config configs/arithmetic_tiny.py [--steps 300 --grpo.group-size 8 ...]

Task: three one-digit operands with + and - ("3+9-4=" -> "8"), held-out prompts disjoint
from training. The supervised warm start learns the answers from text in which only 10% of
the answers end with EOS; the others run on into the next problem, as concatenated text
without separators does. The warm-started policy therefore rarely stops, and the reward
(the exact answer, then EOS) is almost never earned. GRPO learns to stop after the answer —
a behaviour that carries over to unseen prompts — and sharpens the answers themselves.
Sized to finish in a few minutes on a 2-core CPU; the README's demo
(configs/arithmetic_worked.py) runs the same recipe on worked sums, whose longer responses
are what speculation drafts.
"""

from specjax.experiments import Drafting, ExperimentConfig, Optimization, RolloutSettings, WarmStart
from specjax.models import ModelConfig
from specjax.rl import ArithmeticTask, GRPOConfig


def get_config() -> ExperimentConfig:
  task = ArithmeticTask(max_digits=1, num_operands=3, operators="+-", test_fraction=0.3,
                        num_test=200)
  return ExperimentConfig(
      run_dir="runs/arithmetic_tiny",
      task=task,
      model=ModelConfig(vocab_size=task.tokenizer.vocab_size, d_model=128, n_layers=2,
                        n_heads=4, n_kv_heads=2, head_dim=32, mlp_dim=256, num_mtp_modules=2,
                        max_position=32),
      grpo=GRPOConfig(group_size=8, eps_low=0.2, eps_high=0.28),
      steps=300,
      rollout=RolloutSettings(prompts_per_step=16, max_new_tokens=task.max_answer_tokens,
                              speculation="adaptive", tree_widths=(1, 1)),
      drafter=Drafting(name="mtp"),
      optim=Optimization(learning_rate=3e-4),
      warm_start=WarmStart(steps=400, eos_fraction=0.1),
  )
