"""Multi-host GRPO: the fused step (sync and async) run by 2 local processes x 2 CPU devices
and by 4 processes x 1 device, each feeding its own prompts, gives the single-process
metrics and parameters; the state they checkpoint together restores on one process, on one
device and on another mesh, to the same values. Also: the train state's shardings, and
joining a cluster from flags or the environment."""

import functools
import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from support import (MODEL, PROMPTS, STEPS, TOK, child_env, config, flat, initial_state, optimizer,
                     reader, reward, shared_dir)

from specjax import cli
from specjax.checkpoint import Checkpointer
from specjax.decoding import DraftTree
from specjax.errors import ConfigError
from specjax.models import init_params
from specjax.rl import GRPOConfig, train_state_shardings
from specjax.rl.distributed import join_cluster, process_prompts, process_rows
from specjax.rl.state import RolloutConfig, TrainConfig, init_train_state
from specjax.rl.trainer import make_prime_fn, make_train_step
from specjax.sharding import MeshConfig

METRICS = ("reward_mean", "loss", "kl", "mtp_ce", "entropy", "grad_norm",
           "response_length_mean", "acceptance_length")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _spawn(cmd: list[str], log: Path, **kwargs) -> subprocess.Popen:
  """Start `cmd` with its output in the file `log` (a pipe nobody reads could fill up)."""
  with open(log, "w") as out:
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **kwargs)


def _finish(procs: list[subprocess.Popen], logs: list[Path], meanwhile=lambda: None):
  """Wait for every process (after `meanwhile()`, whose result it returns), killing them all
  if any fails to end; each must have exited 0 (else its log's end is shown)."""
  try:
    result = meanwhile()
    for p in procs:
      p.wait(timeout=600)
  finally:
    for p in procs:
      p.kill()
  for p, log in zip(procs, logs, strict=True):
    assert p.returncode == 0, log.read_text()[-3000:]
  return result


@functools.cache
def _single_process_reference() -> dict:
  """The metrics and parameters of the unsharded step on one device."""
  out = {}
  for mode in ("sync", "async"):
    cfg = config(async_mode=mode == "async")
    state = initial_state(cfg)
    offset = 0
    if cfg.async_mode:
      state = make_prime_fn(cfg, reward, pad_id=TOK.pad_id)(state, reader().batch_at(0))
      offset = PROMPTS
    step = make_train_step(cfg, reward, optimizer(), pad_id=TOK.pad_id)
    for i in range(STEPS):
      state, metrics = step(state, reader().batch_at(offset + PROMPTS * i))
      for key, value in jax.device_get(metrics).items():
        out[f"{mode}/metrics/{i}/{key}"] = np.asarray(value)
    for key, value in flat(state.params).items():
      out[f"{mode}/params/{key}"] = np.asarray(value)
  return out


def _run_cluster(out_dir: Path, processes: int, devices: int) -> None:
  """The workers' results in `out_dir`, then the single-process reference (computed while
  the cluster runs) in `reference.npz`, the mark of a complete run."""
  port = str(_free_port())
  worker = Path(__file__).with_name("multihost_grpo_worker.py")
  env = child_env()
  logs = [out_dir / f"worker{i}.log" for i in range(processes)]
  procs = [_spawn([sys.executable, str(worker), str(i), str(processes), str(devices), port,
                   str(out_dir)], log, env=env) for i, log in enumerate(logs)]
  reference = _finish(procs, logs, _single_process_reference)
  np.savez(out_dir / "reference.npz", **reference)


@pytest.fixture(scope="module", params=[(2, 2), (4, 1)], ids=["2x2", "4x1"])
def cluster_run(request, tmp_path_factory):
  """A cluster of (processes, devices each) run once per test session, whichever worker
  needs it first: its results, the single-process reference and its directory."""
  processes, devices = request.param
  with shared_dir(tmp_path_factory, f"multihost_grpo_{processes}x{devices}") as out_dir:
    if not (out_dir / "reference.npz").exists():
      _run_cluster(out_dir, processes, devices)
  return (dict(np.load(out_dir / "result.npz")), dict(np.load(out_dir / "reference.npz")),
          out_dir)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fused_step_on_several_processes_gives_the_single_process_metrics_and_params(
    cluster_run, mode):
  result, reference, _ = cluster_run
  for i in range(STEPS):
    for key in METRICS:
      name = f"{mode}/metrics/{i}/{key}"
      np.testing.assert_allclose(result[name], reference[name], rtol=1e-5, atol=1e-5,
                                 err_msg=name)
  params = [k for k in reference if k.startswith(f"{mode}/params/")]
  assert params and set(params) == {k for k in result if k.startswith(f"{mode}/params/")}
  for name in params:
    np.testing.assert_allclose(result[name], reference[name], rtol=1e-5, atol=1e-5,
                               err_msg=name)
  # Negative control: the steps moved the parameters by far more than the tolerance.
  initial = flat(init_params(MODEL, jax.random.key(0)))
  moved = max(np.abs(result[f"{mode}/params/{k}"] - np.asarray(v)).max()
              for k, v in initial.items())
  assert moved > 1e-3, moved


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_python_rewards_scored_on_each_process_give_the_single_process_metrics_and_params(
    cluster_run, mode):
  """The split step with the reward in Python, each process scoring the rows of its own
  prompts, trains as the fused step with the same reward in JAX on one process."""
  result, reference, _ = cluster_run
  for i in range(STEPS):
    for key in METRICS:
      name = f"{mode}/metrics/{i}/{key}"
      np.testing.assert_allclose(result[f"split_{name}"], reference[name], rtol=1e-5,
                                 atol=1e-5, err_msg=name)
    # The function's mean over every process's rows: the trained rollout's mean reward.
    np.testing.assert_allclose(result[f"split_{mode}/metrics/{i}/reward_parity"],
                               reference[f"{mode}/metrics/{i}/reward_mean"], atol=1e-6)
    assert 0.0 <= result[f"split_{mode}/metrics/{i}/perf_reward_overlap"] <= 1.0
  for name in (k for k in reference if k.startswith(f"{mode}/params/")):
    np.testing.assert_allclose(result[f"split_{name}"], reference[name], rtol=1e-5, atol=1e-5,
                               err_msg=name)
  # A reward that failed on one process stopped them all within seconds (the worker checks the
  # messages: the failed process's own, the others naming it).
  assert result["fault_s"] < 30


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 2, 2), (1, 8, 1)],
                         ids=["one_device", "2x2x2", "1x8x1"])
def test_checkpoint_saved_by_several_processes_restores_on_one_process_to_identical_values(
    cluster_run, shape):
  result, _, out_dir = cluster_run
  cfg = config(async_mode=True)
  abstract = jax.eval_shape(make_prime_fn(cfg, reward, pad_id=TOK.pad_id),
                            jax.eval_shape(lambda: initial_state(cfg)), reader().batch_at(0))
  mesh_config = MeshConfig(*shape)
  mesh = mesh_config.make(jax.devices()[:1] if shape == (1, 1, 1) else None)
  shardings = train_state_shardings(abstract, mesh, cfg)
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shardings)
  ckpt = Checkpointer(out_dir / "checkpoints")
  state, meta, step = ckpt.restore(target)
  ckpt.close()
  assert step == STEPS and meta == {"step": STEPS}
  restored = flat(state)
  saved = {k[len("saved/"):]: v for k, v in result.items() if k.startswith("saved/")}
  assert set(restored) == set(saved) and ".pending.tokens" in saved
  for name, value in restored.items():
    assert value.sharding == flat(shardings)[name], name
    np.testing.assert_array_equal(np.asarray(value), saved[name], err_msg=name)


ROOT = Path(__file__).resolve().parents[2]
# A run of few compilations: plain rollouts, no warm start, two async steps.
CLI_ARGS = ["--steps", "2", "--checkpoint.every", "1", "--warm-start.steps", "0",
            "--eval.prompts", "4", "--eval.speedup-repeats", "1", "--eval.speedup-seconds", "0",
            "--rollout.prompts-per-step", "4", "--grpo.group-size", "2",
            "--drafter.name", "none", "--pipeline.async-mode", "--grpo.tis-cap", "2.0",
            "--model.d-model", "32",
            "--model.mlp-dim", "64", "--model.n-layers", "1", "--model.head-dim", "16",
            "--model.n-heads", "2", "--model.n-kv-heads", "2", "--model.num-mtp-modules", "0"]


@pytest.mark.slow
def test_specjax_train_on_2_processes_joins_from_flags_or_environment_and_process_0_reports(
    tmp_path):
  port = _free_port()
  run_dir = tmp_path / "run"
  cmd = [sys.executable, "-m", "specjax.cli", "train", "--config",
         str(ROOT / "configs" / "arithmetic_tiny.py"), "--run-dir", str(run_dir), *CLI_ARGS]
  env = child_env(JAX_NUM_CPU_DEVICES="1")
  by_env = env | {"JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": "2",
                  "JAX_PROCESS_ID": "0"}
  by_flags = [f"--coordinator-address=localhost:{port}", "--num-processes=2", "--process-id=1"]
  logs = [tmp_path / f"process{i}.log" for i in range(2)]
  procs = [_spawn(cmd, logs[0], env=by_env, cwd=ROOT),
           _spawn(cmd + by_flags, logs[1], env=env, cwd=ROOT)]
  _finish(procs, logs)
  outputs = [log.read_text() for log in logs]
  assert "held-out accuracy, greedy" in outputs[0]
  assert "held-out accuracy" not in outputs[1] and "policy:" not in outputs[1]
  lines = (run_dir / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in lines] == [1, 2]
  ckpt = Checkpointer(run_dir / "checkpoints")
  assert ckpt.all_steps() == [1, 2]
  ckpt.close()


@pytest.mark.slow
def test_specjax_train_rewarded_in_python_on_2_processes_x_2_devices(tmp_path):
  """The README's multi-host Python-reward config, shortened: math-verify over reward worker
  processes on each of 2 processes, async; process 0 logs the reward over every row."""
  port = _free_port()
  run_dir = tmp_path / "run"
  cmd = [sys.executable, "-m", "specjax.cli", "train", "--config",
         str(ROOT / "configs" / "arithmetic_python_async.py"), "--run-dir", str(run_dir),
         *CLI_ARGS, f"--coordinator-address=localhost:{port}", "--num-processes=2"]
  env = child_env(JAX_NUM_CPU_DEVICES="2")
  logs = [tmp_path / f"process{i}.log" for i in range(2)]
  procs = [_spawn(cmd + [f"--process-id={i}"], logs[i], env=env, cwd=ROOT) for i in range(2)]
  _finish(procs, logs)
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2]
  for record in records:
    assert 0.0 <= record["reward_math_answer"] <= 1.0
    assert record["perf_reward_s"] > 0


def test_specjax_train_with_a_partial_cluster_specification_exits_naming_what_is_missing(
    monkeypatch):
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  with pytest.raises(SystemExit, match=r"^specjax train: .* but not the coordinator address "
                                       r"\(--coordinator-address or JAX_COORDINATOR_ADDRESS\)"):
    cli.main(["train", "--config", str(ROOT / "configs" / "arithmetic_tiny.py"),
              "--num-processes", "2", "--process-id", "0"])


def test_train_state_shardings_split_parameters_moments_and_pending_rows_and_replicate_the_rest():
  cfg = config(async_mode=True)
  abstract = jax.eval_shape(make_prime_fn(cfg, reward, pad_id=TOK.pad_id),
                            jax.eval_shape(lambda: initial_state(cfg)), reader().batch_at(0))
  mesh = MeshConfig(data=2, fsdp=2, tensor=2).make()
  sh = train_state_shardings(abstract, mesh, cfg)
  assert sh.params["layers"][0]["wq"].spec == P("fsdp", "tensor", None)
  assert sh.ref_params["layers"][0]["wq"].spec == P("fsdp", "tensor", None)
  adam = sh.opt_state[0]
  assert adam.mu["layers"][0]["wq"].spec == P("fsdp", "tensor", None)
  assert adam.nu["embed"] == sh.params["embed"]
  assert adam.count.spec == P()
  # 16 rows (4 prompts x G=4) over data x fsdp = 4; the rollout's statistics replicated.
  assert sh.pending.tokens.spec == P(("data", "fsdp", "expert"), None)
  assert sh.pending.rewards.spec == P(("data", "fsdp", "expert"))
  assert sh.pending.accepted_per_depth.spec == P()
  assert sh.step.spec == P() and sh.key.spec == P()
  # A structure of shardings for every leaf of the state, nothing more.
  assert jax.tree.structure(sh) == jax.tree.structure(abstract)
  # 4 prompts over 8 batch shards do not divide: the prompts fall back to fewer axes, and
  # the one process holds (and reads) all of them.
  assert list(process_rows(mesh, PROMPTS)) == [0, 1, 2, 3]
  np.testing.assert_array_equal(process_prompts(reader(), mesh)(8).tokens,
                                reader().batch_at(8).tokens)


def test_train_state_shardings_place_an_eagle3_head_and_its_moments_like_the_policy():
  from specjax.decoding import Eagle3Drafter, Eagle3Weights
  from specjax.models import Eagle3Config
  from specjax.models.eagle3 import init_eagle3

  model = MODEL.replace(n_layers=2, num_mtp_modules=0)
  eagle = Eagle3Config.for_target(model)
  cfg = TrainConfig(model=model, grpo=GRPOConfig(group_size=4), rollout=RolloutConfig(
      max_new_tokens=4, eos_id=TOK.eos_id, drafter=Eagle3Drafter(eagle),
      tree=DraftTree.chain(2)))
  abstract = jax.eval_shape(lambda: init_train_state(
      cfg, init_params(model, jax.random.key(0)), optimizer(), seed=1,
      drafter_params=Eagle3Weights(init_eagle3(eagle, jax.random.key(1)),
                                   jnp.zeros((eagle.draft_vocab_size,), jnp.int32))))
  mesh = MeshConfig(data=2, fsdp=2, tensor=2).make()
  sh = train_state_shardings(abstract, mesh, cfg)
  head = sh.drafter.weights.params
  assert head["layer"]["wo"].spec == P("tensor", None, "fsdp")
  assert sh.drafter.opt_state[0].mu["layer"]["wo"] == head["layer"]["wo"]
  assert sh.drafter.weights.d2t.spec == P()
  assert sh.ref_params is None and sh.pending is None
  assert jax.tree.structure(sh) == jax.tree.structure(abstract)


def test_mesh_config_rejects_shapes_that_do_not_cover_the_devices():
  with pytest.raises(ConfigError, match=r"mesh.data=3, mesh.fsdp=1, mesh.tensor=1 is invalid: "
                                        r"there are 8 devices"):
    MeshConfig(data=3).make()
  with pytest.raises(ConfigError, match=r"mesh.data=-1 and mesh.tensor=-1 is invalid"):
    MeshConfig(data=-1, tensor=-1)
  with pytest.raises(ConfigError, match=r"mesh.fsdp=0 is invalid: must be an int >= 1"):
    MeshConfig(fsdp=0)
  assert MeshConfig().make().shape == {"data": 8, "fsdp": 1, "tensor": 1, "expert": 1}
  assert MeshConfig(data=2, tensor=-1).make().shape == {"data": 2, "fsdp": 1, "tensor": 4,
                                                        "expert": 1}
  assert MeshConfig(data=2, expert=4).make().shape == {"data": 2, "fsdp": 1, "tensor": 1,
                                                       "expert": 4}
  with pytest.raises(ConfigError, match=r"mesh.data=1, mesh.fsdp=1, mesh.tensor=1, mesh.expert=3 "
                                        r"is invalid: there are 8 "
                                        r"devices"):
    MeshConfig(data=1, expert=3).make()


@pytest.mark.parametrize("flags, env, missing", [
    (dict(coordinator_address="localhost:1234"), {}, "number of processes .* process id"),
    ({}, {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, "coordinator address"),
    (dict(process_id=0), {"JAX_COORDINATOR_ADDRESS": "h:1"}, "number of processes"),
])
def test_a_partial_cluster_specification_is_an_error_naming_what_is_missing(flags, env,
                                                                           missing):
  with pytest.raises(ConfigError, match=rf"but not the {missing}"):
    join_cluster(**flags, env=env, detect=False)


@pytest.mark.parametrize("flags, message", [
    (dict(coordinator_address="localhost:1", num_processes=2, process_id=2),
     r"process id=2 is invalid: allowed 0..1"),
    (dict(coordinator_address="localhost", num_processes=2, process_id=0),
     r"coordinator address='localhost' is invalid: must be HOST:PORT"),
    (dict(coordinator_address="localhost:1", num_processes=0, process_id=0),
     r"number of processes=0 is invalid"),
])
def test_an_out_of_range_cluster_specification_is_an_error(flags, message):
  with pytest.raises(ConfigError, match=message):
    join_cluster(**flags, env={}, detect=False)


def test_no_cluster_specification_or_a_cluster_of_one_is_a_single_process():
  assert not join_cluster(env={}, detect=False)
  assert not join_cluster(env={"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "1",
                               "JAX_PROCESS_ID": "0"}, detect=False)
  with pytest.raises(ConfigError, match=r"JAX_PROCESS_ID='one' is invalid: must be an int"):
    join_cluster(env={"JAX_PROCESS_ID": "one"}, detect=False)


def test_a_process_that_finds_nobody_at_the_coordinator_fails_fast_naming_the_address():
  """Was: a C++ abort after 5 minutes that named no cause. Now: a few seconds, the address."""
  port = _free_port()
  with pytest.raises(ConfigError, match=rf"nobody answers at the coordinator address "
                                        rf"localhost:{port} after 1s"):
    join_cluster(f"localhost:{port}", 2, 1, env={}, detect=False, timeout_s=1,
                 log=lambda _: None)
  with pytest.raises(ConfigError, match=r"cluster timeout=0 is invalid"):
    join_cluster(f"localhost:{port}", 2, 1, env={}, detect=False, timeout_s=0)


_MISMATCH = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 1)
    from specjax.errors import ConfigError
    from specjax.rl.distributed import check_same_config, join_cluster
    port, pid, lr = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    join_cluster(f"localhost:{port}", 2, pid, env={}, timeout_s=60, log=lambda _: None)
    try:
      check_same_config({"learning_rate": lr, "steps": 10})
      print("same")
    except ConfigError as err:
      print("refused:", err)
    """)


@pytest.mark.slow
@pytest.mark.parametrize("rates, expect", [((1e-3, 1e-3), "same"),
                                           ((1e-3, 1e-4), "refused: processes [1] run a "
                                                          "different config")])
def test_processes_with_different_configs_all_stop_before_the_first_collective(rates, expect):
  """Two local processes compare their resolved configs first; with different ones every
  process stops naming which differ, instead of stalling in a collective (the negative
  control: equal configs pass)."""
  port = str(_free_port())
  procs = [subprocess.Popen([sys.executable, "-c", _MISMATCH, port, str(i), str(rate)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=child_env()) for i, rate in enumerate(rates)]
  outs = [proc.communicate(timeout=240)[0] for proc in procs]
  for out in outs:
    assert expect in out, out


def test_local_copy_is_a_copy_that_a_donating_step_leaves_intact():
  """Weights already on the first device came back as the same buffers, so a train step
  donating them deleted the "copy" kept for evaluation."""
  from specjax.rl.distributed import local_copy
  tree = {"w": jnp.arange(4.0), "b": jax.device_put(jnp.ones(2), jax.devices()[0])}
  copy = local_copy(tree)
  jax.jit(lambda t: jax.tree.map(lambda x: x * 2, t), donate_argnums=0)(tree)
  assert tree["w"].is_deleted() and tree["b"].is_deleted()  # the donation took place
  np.testing.assert_array_equal(copy["w"], np.arange(4.0))
  np.testing.assert_array_equal(copy["b"], np.ones(2))
  assert all(x.sharding.device_set == {jax.local_devices()[0]} for x in jax.tree.leaves(copy))
