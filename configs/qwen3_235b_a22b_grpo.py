"""Qwen3-235B-A22B (mixture of experts), GRPO with EAGLE-3 rollouts on 128 accelerators: a
preset to plan, not to run here.

  specjax plan --config configs/qwen3_235b_a22b_grpo.py --devices 128 [--hbm-gib 80]

Qwen3-235B-A22B's architecture from its public config.json: configs/qwen3_30b_a3b_grpo.py's
model with hidden 4096, 94 layers, 64 query heads and experts of width 1536 (4 key/value
heads of 128, 128 routed experts per layer, 8 per token with renormalised weights,
vocabulary 151936, untied output head, qk-norm, RoPE base 1e6): 235B parameters, 22B active
per token. bfloat16 parameters trained on float32 master weights and Adam moments (14 bytes
per parameter, 3.3 TB in all: 39 devices of 80 GiB for the state alone), every layer
rematerialised, 4 minibatches of 128 rows (one row per device). Mesh fsdp=16 x expert=8:
each device holds one of every layer's 128 experts whole (`specjax.models.moe`'s expert
parallelism) and a sixteenth of the 8.1B parameters outside them. On 64 devices (fsdp=8 x
expert=8) the analytical state takes 59.98 GiB per device and the step 107.88: it does not
fit 80 GiB. Rollout and task as configs/qwen3_1p7b_grpo.py (64 GSM8K-shaped prompts x 8
samples, up to 512 new tokens, EAGLE-3 chain of 3).

Measured plans: README.md, "Plans".
"""

import dataclasses
import runpy
from pathlib import Path

from specjax.rl import GRPOConfig
from specjax.sharding import MeshConfig


def get_config():
  base = runpy.run_path(str(Path(__file__).with_name("qwen3_30b_a3b_grpo.py")))
  model = dataclasses.replace(base["QWEN3_30B_A3B"], d_model=4096, n_layers=94, n_heads=64,
                              mlp_dim=12288, expert_dim=1536)
  return dataclasses.replace(
      base["get_config"](),
      run_dir="runs/qwen3_235b_a22b_grpo",
      model=model,
      grpo=GRPOConfig(group_size=8, eps_low=0.2, eps_high=0.28, num_minibatches=4),
      mesh=MeshConfig(data=1, fsdp=16, tensor=1, expert=8),
  )
