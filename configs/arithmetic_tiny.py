"""The CPU demo: one-digit arithmetic, a ~0.7M-parameter policy with 2 MTP heads.

  specjax train --config configs/arithmetic_tiny.py [--steps 300 --grpo.group-size 8 ...]

A supervised warm start teaches the answer format and part of the skill; GRPO with
speculative (MTP) rollouts then improves held-out accuracy. Sized for a 2-core CPU.
"""

from specjax.models import ModelConfig
from specjax.rl import ArithmeticTask, GRPOConfig
from specjax.rl.experiment import ExperimentConfig


def get_config() -> ExperimentConfig:
  task = ArithmeticTask(max_digits=1, operators="+-", test_fraction=0.3, num_test=200)
  return ExperimentConfig(
      run_dir="runs/arithmetic_tiny",
      task=task,
      model=ModelConfig(vocab_size=task.tokenizer.vocab_size, d_model=128, n_layers=2,
                        n_heads=4, n_kv_heads=2, head_dim=32, mlp_dim=256, num_mtp_modules=2,
                        max_position=32),
      grpo=GRPOConfig(group_size=8, eps_low=0.2, eps_high=0.28),
      max_new_tokens=task.max_answer_tokens,
      drafter="mtp",
      tree_widths=(1, 1),
      steps=150,
      prompts_per_step=16,
      learning_rate=1e-3,
      sft_steps=100,
  )
