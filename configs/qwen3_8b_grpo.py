"""Qwen3-8B, GRPO with EAGLE-3 rollouts on 8 accelerators: a preset to plan, not to run here.

  specjax plan --config configs/qwen3_8b_grpo.py --devices 8 [--hbm-gib 80]

Qwen3-8B's architecture from its public config.json (hidden 4096, 36 layers, 32 query and 8
key/value heads of 128, MLP 12288, vocabulary 151936, untied output head, qk-norm, RoPE base
1e6), bfloat16 compute over float32 weights and Adam moments. Rollout and task as
configs/qwen3_1p7b_grpo.py (64 GSM8K-shaped prompts x 8 samples, up to 512 new tokens,
EAGLE-3 chain of 3; the same stand-in task); the update takes 16 minibatches of 32 rows, so
that one minibatch's activations fit beside the 8B model's state. Mesh fsdp=8: an 8B model's
float32 weights, gradients and Adam moments (131 GB) fit 8 accelerators only split eight ways.

Planned (2 CPU cores, lowered 10 s, compiled 98 s), GiB per device: state 12.49 (compiled =
analytical); the step compiles to 112.66 on XLA:CPU (342.6 before the trunk pinned its rows to
the batch axes) against 91.01 analytical with XLA:CPU's float32 activations (x1.24: XLA:CPU
also keeps float32 copies of the vocabulary tables, 2.3 GiB each) and 66.46 with an
accelerator's bfloat16 activations: 83% of an 80 GiB device. Activations of the minibatch
update are the largest term (74 GiB in float32 for 4 rows x 638 positions per device); more
minibatches shrink them.
"""

import dataclasses
import runpy
from pathlib import Path

from specjax.models import ModelConfig
from specjax.rl import GRPOConfig

QWEN3_8B = ModelConfig(
    vocab_size=151936, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
    mlp_dim=12288, rope_theta=1_000_000.0, rms_norm_eps=1e-6, qk_norm=True,
    tie_embeddings=False, max_position=40960, dtype="bfloat16", param_dtype="float32",
    family="qwen3")


def get_config():
  base = runpy.run_path(str(Path(__file__).with_name("qwen3_1p7b_grpo.py")))["get_config"]()
  return dataclasses.replace(
      base,
      run_dir="runs/qwen3_8b_grpo",
      model=QWEN3_8B,
      grpo=GRPOConfig(group_size=8, eps_low=0.2, eps_high=0.28, num_minibatches=16),
  )
