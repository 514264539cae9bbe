"""Qwen3-1.7B on ONE accelerator: configs/qwen3_0p6b_grpo.py's run with the 1.7B model
(bfloat16 parameters, float32 master weights and moments, full remat).

  specjax plan --config configs/qwen3_1p7b_one_device.py --devices 1 --hbm-gib 40
"""

import dataclasses
import runpy
from pathlib import Path

HERE = Path(__file__).parent


def get_config():
  one_device = runpy.run_path(str(HERE / "qwen3_0p6b_grpo.py"))
  qwen3_1p7b = runpy.run_path(str(HERE / "qwen3_1p7b_grpo.py"))["QWEN3_1P7B"]
  model = dataclasses.replace(qwen3_1p7b, param_dtype="bfloat16", remat="full")
  return dataclasses.replace(one_device["get_config"](model), run_dir="runs/qwen3_1p7b_one_device")
