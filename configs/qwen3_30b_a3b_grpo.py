"""Qwen3-30B-A3B (mixture of experts), GRPO with EAGLE-3 rollouts on 8 accelerators: a preset
to plan, not to run here.

  specjax plan --config configs/qwen3_30b_a3b_grpo.py --devices 8 [--hbm-gib 80]

Qwen3-30B-A3B's architecture from its public config.json (hidden 2048, 48 layers, 32 query
and 4 key/value heads of 128, 128 routed experts of width 768 per layer, 8 per token with
renormalised weights, vocabulary 151936, untied output head, qk-norm, RoPE base 1e6): 30.5B
parameters, 3.3B active per token. bfloat16 parameters trained on float32 master weights and
Adam moments (14 bytes per parameter, 427 GB in all), every layer rematerialised in the update
(`remat="full"`). Rollout and task as
configs/qwen3_1p7b_grpo.py (64 GSM8K-shaped prompts x 8 samples, up to 512 new tokens,
EAGLE-3 chain of 3; the same stand-in task); the update takes 32 minibatches of 16 rows. Mesh
fsdp=8: the state fits 8 accelerators only split eight ways; the experts are split over fsdp
whole (16 of each layer's 128 on a device, `specjax.models.moe.experts_parallel`), so no
expert's weights are ever gathered, and the 1.5B parameters outside them split along E.

Measured plans: README.md, "Plans".
"""

import dataclasses
import runpy
from pathlib import Path

from specjax.models import ModelConfig
from specjax.rl import GRPOConfig

QWEN3_30B_A3B = ModelConfig(
    vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
    mlp_dim=6144, rope_theta=1_000_000.0, rms_norm_eps=1e-6, qk_norm=True,
    tie_embeddings=False, max_position=40960, dtype="bfloat16", param_dtype="bfloat16",
    family="qwen3_moe", n_experts=128, experts_per_token=8, expert_dim=768,
    normalize_top_k=True, remat="full")


def get_config():
  base = runpy.run_path(str(Path(__file__).with_name("qwen3_1p7b_grpo.py")))["get_config"]()
  return dataclasses.replace(
      base,
      run_dir="runs/qwen3_30b_a3b_grpo",
      model=QWEN3_30B_A3B,
      grpo=GRPOConfig(group_size=8, eps_low=0.2, eps_high=0.28, num_minibatches=32),
  )
