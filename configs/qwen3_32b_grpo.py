"""Qwen3-32B, GRPO with EAGLE-3 rollouts on 32 accelerators: a preset to plan, not to run here.

  specjax plan --config configs/qwen3_32b_grpo.py --devices 32 [--hbm-gib 80]

Qwen3-32B's architecture from its public config.json (hidden 5120, 64 layers, 64 query and 8
key/value heads of 128, MLP 25600, vocabulary 151936, untied output head, qk-norm, RoPE base
1e6). What makes it fit 80 GiB devices: bfloat16 parameters trained on float32 master weights
and Adam moments (14 bytes per parameter, 459 GB in all), split 32 ways by a mesh of fsdp=8 x
tensor=4 (the tensor axis splits heads, MLP units and the vocabulary, so each device also
holds a quarter of every layer's activations); every layer rematerialised in the update; 32
minibatches of 16 rows. Rollout and task as configs/qwen3_1p7b_grpo.py (64 GSM8K-shaped
prompts x 8 samples, up to 512 new tokens, EAGLE-3 chain of 3; the same stand-in task).
Figures: README, Plans.
"""

import dataclasses
import runpy
from pathlib import Path

from specjax.models import ModelConfig
from specjax.rl import GRPOConfig
from specjax.sharding import MeshConfig

QWEN3_32B = ModelConfig(
    vocab_size=151936, d_model=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128,
    mlp_dim=25600, rope_theta=1_000_000.0, rms_norm_eps=1e-6, qk_norm=True,
    tie_embeddings=False, max_position=40960, dtype="bfloat16", param_dtype="bfloat16",
    family="qwen3", remat="full")


def get_config():
  base = runpy.run_path(str(Path(__file__).with_name("qwen3_1p7b_grpo.py")))["get_config"]()
  return dataclasses.replace(
      base,
      run_dir="runs/qwen3_32b_grpo",
      model=QWEN3_32B,
      grpo=GRPOConfig(group_size=8, eps_low=0.2, eps_high=0.28, num_minibatches=32),
      mesh=MeshConfig(data=1, fsdp=8, tensor=4),
  )
