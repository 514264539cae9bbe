"""Qwen3-0.6B, GRPO with EAGLE-3 rollouts on ONE accelerator: a preset to plan, not to run here.

  specjax plan --config configs/qwen3_0p6b_grpo.py --devices 1 --hbm-gib 24 [--model.remat none]

Qwen3-0.6B's architecture from its public config.json (hidden 1024, 28 layers, 16 query and
8 key/value heads of 128, MLP 3072, vocabulary 151936, tied embeddings, qk-norm, RoPE base
1e6). What one researcher's device holds: bfloat16 parameters with float32 master weights and
Adam moments (`optim.master_weights`, 14 bytes per parameter), every layer rematerialised in
the update (`model.remat="full"`), 16 GSM8K-shaped prompts x 8 samples (128 rows) of up to
512 new tokens, EAGLE-3 drafting a chain of 3, 16 minibatches of 8 rows. The task is the
1.7B preset's stand-in (worked arithmetic with GSM8K's shapes; see configs/qwen3_1p7b_grpo.py).
configs/qwen3_1p7b_one_device.py is the same run with Qwen3-1.7B. Figures: README, Plans.
"""

import dataclasses
import runpy
from pathlib import Path

from specjax.models import ModelConfig
from specjax.sharding import MeshConfig

QWEN3_0P6B = ModelConfig(
    vocab_size=151936, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
    mlp_dim=3072, rope_theta=1_000_000.0, rms_norm_eps=1e-6, qk_norm=True, tie_embeddings=True,
    max_position=40960, dtype="bfloat16", param_dtype="bfloat16", family="qwen3",
    remat="full")


def get_config(model: ModelConfig = QWEN3_0P6B):
  """The 1.7B preset's task, rollout and update cut to one device's share."""
  base = runpy.run_path(str(Path(__file__).with_name("qwen3_1p7b_grpo.py")))["get_config"]()
  return dataclasses.replace(
      base, run_dir="runs/qwen3_0p6b_grpo", model=model,
      grpo=dataclasses.replace(base.grpo, num_minibatches=16),
      rollout=dataclasses.replace(base.rollout, prompts_per_step=16),
      mesh=MeshConfig(data=1, fsdp=1, tensor=1))
