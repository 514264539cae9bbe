"""`specjax plan`: the train step compiled for fake devices beside its analytical estimate.

The fast tests run in this process, on the 8 fake CPU devices of conftest.py, and in a fresh
process where the command must set the device count itself. The slow tests plan the
Qwen3-1.7B preset (about 3 minutes of compilation on 2 cores).
"""

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from support import child_env

from specjax.cli import load_experiment, plan_command
from specjax.errors import ConfigError
from specjax.experiments.grpo import ExperimentConfig
from specjax.experiments.plan import GIB, estimate_config, plan
from specjax.models import ModelConfig
from specjax.sharding import MeshConfig

ROOT = Path(__file__).resolve().parents[2]

TINY_CONFIG = """
from specjax.models import ModelConfig
from specjax.rl import ArithmeticTask, GRPOConfig
from specjax.experiments import Drafting, ExperimentConfig, RolloutSettings
from specjax.sharding import MeshConfig


def get_config():
  task = ArithmeticTask(max_digits=1, num_operands=2, num_train=64, num_test=8)
  return ExperimentConfig(
      task=task,
      model=ModelConfig(vocab_size=task.tokenizer.vocab_size, d_model=32, n_layers=1,
                        n_heads=2, n_kv_heads=2, head_dim=16, mlp_dim=64, max_position=32),
      grpo=GRPOConfig(group_size=4, num_minibatches=2),
      rollout=RolloutSettings(max_new_tokens=3, prompts_per_step=8),
      drafter=Drafting(name="none"), mesh=MeshConfig(data=4, fsdp=2))
"""


def _tiny() -> ExperimentConfig:
  namespace = {}
  exec(TINY_CONFIG, namespace)
  return namespace["get_config"]()


def test_plan_state_bytes_per_device_equal_the_compiled_arguments():
  """The analytical state (parameter shards, Adam moments, step, key, prompts) is exactly
  what XLA's buffer assignment gives the compiled step as arguments, on a data x fsdp mesh;
  the report carries both columns, the FLOPs and the verdict."""
  result = plan(_tiny(), 8, hbm_gib=1.0, name="tiny")
  assert result.mesh == {"data": 4, "fsdp": 2, "tensor": 1, "expert": 1}
  assert result.compiled.arguments == result.estimate.arguments
  # By hand: every weight has an E=32 axis, split over fsdp=2: embed and unembed 17 x 16,
  # wq, wk, wv, wo 2 x 16 x 16 each, w_gate, w_up, w_down 16 x 64 each, three norms 16;
  # float32. Adam's two moments as much again each, plus int32 step counts.
  shard = 4 * (2 * 17 * 16 + 4 * 2 * 16 * 16 + 3 * 16 * 64 + 3 * 16)
  assert result.estimate.parameters == shard
  assert 2 * shard <= result.estimate.optimizer_state <= 2 * shard + 16
  assert result.compiled.temporaries > 0 and result.compiled_flops > 0
  assert result.estimate.logprob_pass > 0  # two minibatches: pi_old over all rows first
  assert result.fits and result.compiled.total < GIB
  text = result.format()
  for line in ("plan: tiny on 8 fake CPU devices, mesh data=4 x fsdp=2 x tensor=1",
               "= arguments", "= temporaries", "compiled / analytical", "fits in 1 GiB",
               "FLOPs per device"):
    assert line in text, text


def test_plan_rejects_a_mesh_that_does_not_cover_the_devices():
  with pytest.raises(ConfigError, match=r"mesh data=1, fsdp=3, tensor=1 does not fit 8 "
                                        r"devices"):
    plan(_tiny(), 8, MeshConfig(data=1, fsdp=3, tensor=1))


def test_plan_says_when_jax_already_started_with_fewer_devices():
  jax.devices()  # started with conftest's 8, also when this test runs first in its process
  with pytest.raises(ConfigError, match=r"already initialised with 8 CPU device\(s\)"):
    plan(_tiny(), 16)


@pytest.mark.parametrize("devices", [0, 100_000, 8.0, True])
def test_plan_refuses_a_device_count_it_cannot_create(devices):
  """100,000 fake CPU devices ran for minutes without a word: the count is bounded."""
  with pytest.raises(ConfigError, match=rf"devices={devices!r} is invalid: must be an int in "
                                        r"\[1, 4096\]"):
    plan(_tiny(), devices)


def test_plan_takes_the_devices_themselves_as_any_sequence():
  devices = jax.devices()[:8]
  counted = estimate_config(_tiny(), 8)
  for given in (devices, tuple(devices), np.array(devices)):
    assert estimate_config(_tiny(), given) == counted


def test_plan_rejects_a_config_that_is_not_an_experiment():
  with pytest.raises(ConfigError, match="plan needs an ExperimentConfig"):
    plan(ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=1, n_kv_heads=1,
                     head_dim=8, mlp_dim=8), 8)


def test_plan_command_names_an_unknown_config_file():
  with pytest.raises(SystemExit, match="no-such-config.py: no such file"):
    plan_command(["--config", "configs/no-such-config.py", "--devices", "8"])


@pytest.mark.slow
def test_plan_command_sets_the_fake_device_count_itself(tmp_path):
  """A fresh process without a device count in XLA_FLAGS: `specjax plan` asks JAX for the devices before it
  starts, applies the mesh flags over the config's mesh, and exits 0 when the step fits."""
  config = tmp_path / "tiny.py"
  config.write_text(textwrap.dedent(TINY_CONFIG))
  env = child_env()
  env.pop("JAX_NUM_CPU_DEVICES", None)
  out = subprocess.run(
      [sys.executable, "-m", "specjax.cli", "plan", "--config", str(config), "--devices", "2",
       "--mesh.data", "1"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "on 2 fake CPU devices, mesh data=1 x fsdp=2 x tensor=1" in out.stdout, out.stdout
  assert "fits in 80 GiB per device" in out.stdout


@pytest.fixture(scope="module")
def qwen3_1p7b_plan():
  from specjax.cli import load_experiment
  return plan(load_experiment(str(ROOT / "configs/qwen3_1p7b_grpo.py")), 8,
              name="configs/qwen3_1p7b_grpo.py")


@pytest.mark.slow
def test_qwen3_1p7b_state_per_device_matches_the_estimate(qwen3_1p7b_plan):
  """fsdp=8 over 8 devices: float32 weights, Adam moments and the EAGLE-3 head's, 1/8 each."""
  result = qwen3_1p7b_plan
  assert result.mesh == {"data": 1, "fsdp": 8, "tensor": 1, "expert": 1}
  assert result.compiled.arguments == result.estimate.arguments
  # 1.72B policy + 0.14B head, 12 bytes each (weight, two moments), split 8 ways but for the
  # few leaves without an E axis (norms, the head's draft vocabulary map), which replicate.
  split = 12 * result.shapes["parameters"] / 8
  assert split <= result.estimate.arguments <= 1.1 * split


@pytest.mark.slow
def test_qwen3_1p7b_compiled_memory_matches_the_estimate(qwen3_1p7b_plan):
  """Compiled 57.55 GiB per device against 52.32 estimated (x1.10, jax 0.10.2): the rest is
  XLA:CPU keeping more float32 buffers per layer than the model counts. The bound leaves room
  for other XLA versions; the bug it guards against, rows not split over the devices, was
  x6.4 (333.7 GiB)."""
  result = qwen3_1p7b_plan
  here = result.estimate_here.total  # float32 activations, as XLA:CPU keeps them
  assert 0.9 * here <= result.compiled.total <= 1.12 * here, (
      result.format())


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_the_plan_estimates_each_remat_policy_and_reports_them_side_by_side():
  config = _tiny()
  config = dataclasses.replace(config, model=dataclasses.replace(config.model, n_layers=4,
                                                                 remat="full"))
  result = plan(config, 8, hbm_gib=1.0, name="tiny")
  totals = result.shapes["total_by_remat"]
  assert totals["full"] < totals["dots"] < totals["none"]
  assert result.estimate.total == totals["full"]
  assert "by model.remat (GiB): none" in result.format() and "this plan: full" in \
      result.format()


# GiB per device of the fused step compiled by XLA:GPU for one NVIDIA H200 (jax 0.11.2,
# `benchmarks/accelerator.py` section 5 and docs/accelerator-h200.md, 2026-12-04). The 0.6B
# full-remat row fitted the EAGLE-3 head's vocabulary-sized term; the other two are held out.
H200_COMPILED_GIB = {("qwen3_0p6b_grpo.py", "full"): 22.97, ("qwen3_0p6b_grpo.py", "none"): 34.76,
                     ("qwen3_1p7b_one_device.py", "full"): 42.99}


def test_the_accelerator_estimate_matches_the_step_compiled_for_an_h200():
  estimates = {}
  for (name, remat), compiled in H200_COMPILED_GIB.items():
    config = load_experiment(str(ROOT / "configs" / name))
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, remat=remat))
    estimates[name, remat] = estimate_config(config, 1).total / GIB
    assert abs(estimates[name, remat] / compiled - 1) <= 0.08, (name, remat, estimates)
  # What full remat saves on the 0.6B preset, compiled against predicted (issue 36: +-20%).
  full, none = ("qwen3_0p6b_grpo.py", "full"), ("qwen3_0p6b_grpo.py", "none")
  compiled = H200_COMPILED_GIB[none] - H200_COMPILED_GIB[full]
  predicted = estimates[none] - estimates[full]
  assert abs(compiled / predicted - 1) <= 0.2, (compiled, predicted)


def test_a_history_banks_bytes_are_counted_in_the_plan():
  """The bank is replicated train state: twice the slots add the bank's bytes per slot
  (tokens and lengths of R answers of T tokens, the slot's key and ring head, int32)."""
  from specjax.experiments import override
  config = load_experiment(str(ROOT / "configs" / "arithmetic_worked_history.py"))
  small = estimate_config(config, 1)
  big = estimate_config(override(config, {"drafter.history_slots": 2048}), 1)
  r, t = config.drafter.history_per_prompt, config.rollout.max_new_tokens
  assert big.state_and_batch - small.state_and_batch == 1024 * 4 * (r * t + r + 2)
  assert big.kv_cache == small.kv_cache  # the call's copy holds rows, not slots


@pytest.mark.slow  # a compile of the whole step on 8 fake devices
def test_plan_of_an_moe_policy_with_its_experts_split_over_the_expert_axis():
  """A Qwen3-MoE policy on a data=2 x expert=4 mesh: each device holds 2 of the 8 experts
  (parameters, moments), the compiled step's arguments equal the analytical state, and the
  report names the expert axis."""
  base = _tiny()
  moe = dataclasses.replace(base.model, family="qwen3_moe", qk_norm=True, n_experts=8,
                            experts_per_token=2, expert_dim=16)
  config = dataclasses.replace(base, model=moe, mesh=MeshConfig(data=2, expert=4))
  result = plan(config, 8, hbm_gib=1.0, name="moe")
  assert result.mesh == {"data": 2, "fsdp": 1, "tensor": 1, "expert": 4}
  assert result.compiled.arguments == result.estimate.arguments
  # By hand (float32, nothing split but the experts): embed and unembed 17 x 32, attention
  # 4 x 32 x 32, norms 3 x 32 and q/k norms 2 x 16, the router 32 x 8, and 2 experts of
  # 3 x 32 x 16 each.
  own = 4 * (2 * 17 * 32 + 4 * 32 * 32 + 3 * 32 + 2 * 16 + 32 * 8 + 2 * 3 * 32 * 16)
  assert result.estimate.parameters == own
  assert "mesh data=2 x fsdp=1 x tensor=1 x expert=4" in result.format()
