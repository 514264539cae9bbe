"""Disaggregated async GRPO: rollouts on 4 fake CPU devices, updates on 4 others.

With policy lag 1 it reproduces the fused async step (one program, one device) step for
step; with lag 2 it trains on weights two versions behind, as a plain loop over the same
rollout and update functions does; and neither the weights nor the rollouts pass through
host memory on their way between the meshes (`specjax.sharding.transfer`)."""

import contextlib
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import array as jax_array
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
# The multi-host test's task, policy (one MTP module), optimizer, parity reward and async
# configuration: the disaggregated and the multi-process steps are checked on the same run.
from support import MODEL, PROMPTS, TASK, TOK
from support import config as multihost_config
from support import flat, optimizer, reward, tiny_experiment

from specjax.decoding import (Adaptive, CostTable, DraftTree, Eagle3Drafter, Eagle3Weights,
                              SamplingConfig)
from specjax.errors import ConfigError
from specjax.experiments import Pipeline
from specjax.experiments import grpo as experiment
from specjax.experiments import override
from specjax.models import Eagle3Config, LoraConfig, ModelConfig, init_eagle3, init_params
from specjax.rl import GRPOConfig, PromptReader, encode_prompt
from specjax.rl.disaggregated import DisaggregatedAsync
from specjax.rl.rollouts import rollout_metrics, scored_rollout
from specjax.rl.state import DrafterTraining, RolloutConfig, TrainConfig, init_train_state
from specjax.rl.trainer import make_prime_fn, make_train_step, prime_keys, step_keys
from specjax.rl.updates import update
from specjax.sharding import MeshConfig, make_mesh, transfer

STEPS = 3
GROUP = 4  # support.config's group size
METRICS = ("reward_mean", "loss", "kl", "entropy", "grad_norm", "response_length_mean",
           "acceptance_length")


def meshes():
  """Rollouts split by rows over 4 devices, updates by fsdp x tensor over the other 4: the
  two sides cut every weight differently."""
  devices = jax.devices()
  return make_mesh(data=2, tensor=2, devices=devices[:4]), make_mesh(
      fsdp=2, tensor=2, devices=devices[4:8])


@contextlib.contextmanager
def host_reads():
  """The shapes of device arrays read into host memory meanwhile (JAX's own host bounce of
  a transfer between layouts reads `_value`, which `jax.transfer_guard` does not see)."""
  reads, original = [], jax_array.ArrayImpl._value

  def spy(self):
    reads.append(self.shape)
    return original.fget(self)

  jax_array.ArrayImpl._value = property(spy)
  try:
    yield reads
  finally:
    jax_array.ArrayImpl._value = original


def batches(count: int):
  records = [{"prompt": encode_prompt(TOK, e.prompt), "reference": e.reference,
              "answer": e.answer} for e in TASK.examples("train")]
  reader = PromptReader(records, batch_size=PROMPTS, pad_id=TOK.pad_id)
  return [reader.batch_at(PROMPTS * i) for i in range(count)]


def mtp_config() -> TrainConfig:
  return multihost_config(async_mode=True)


EAGLE_MODEL = MODEL.replace(n_layers=2, num_mtp_modules=0)


def eagle_config() -> TrainConfig:
  """An EAGLE-3 head trained online, adaptive speculation carrying its counts."""
  menu = Adaptive((DraftTree.chain(1), DraftTree.chain(2)),
                  costs=CostTable((16,), ((1.0,), (1.05,), (1.1,))))
  rollout = RolloutConfig(max_new_tokens=TASK.max_answer_tokens, eos_id=TOK.eos_id,
                          sampling=SamplingConfig(1.0),
                          drafter=Eagle3Drafter(Eagle3Config.for_target(EAGLE_MODEL)),
                          speculation=menu, acceptance_carry=0.5)
  return TrainConfig(model=EAGLE_MODEL, grpo=GRPOConfig(group_size=4, num_minibatches=2,
                                                        tis_cap=2.0),
                     rollout=rollout, async_mode=True,
                     drafter_training=DrafterTraining(learning_rate=1e-2, ttt_steps=2))


def eagle_state(config: TrainConfig):
  head = Eagle3Weights(params=init_eagle3(config.eagle3.config, jax.random.key(5)),
                       d2t=jnp.arange(TOK.vocab_size, dtype=jnp.int32))
  return init_train_state(config, init_params(EAGLE_MODEL, jax.random.key(0)), optimizer(),
                          seed=1, drafter_params=head)


def host_parity(responses, lengths, batch):
  """`reward` computed on the host, with its values as a per-row metric."""
  assert len(responses) == len(lengths) == len(batch.tokens) * GROUP
  values = (np.asarray(responses)[:, 0] % 2).astype(np.float64)
  return values, {"reward_parity": values}


def run_disaggregated(config, state, data, lag, host=False):
  """With `host`, the rewards are `host_parity`'s, scored between the meshes."""
  rollout_mesh, train_mesh = meshes()
  run = DisaggregatedAsync(config, host_parity if host else reward, optimizer(), rollout_mesh,
                           train_mesh, policy_lag=lag, pad_id=TOK.pad_id, host_reward=host)
  run.start(state, data[0])
  history = []
  with host_reads() as reads, jax.transfer_guard_device_to_host("disallow"):
    for batch in data[1:]:
      history.append(run.step(batch))
  # A host reward reads the responses [B, T] and their lengths [B] (in its own thread), and
  # nothing else: the weights and the rollouts move between the meshes device to device.
  rows = len(data[0].tokens) * config.grpo.group_size
  read = {(rows, config.rollout.max_new_tokens), (rows,)} if host else set()
  assert set(reads) <= read, f"arrays read into host memory during the steps: {reads}"
  final = run.settled()
  assert final.params["embed"].sharding.mesh == train_mesh
  return [jax.device_get(m) for m in history], final, run


@functools.cache
def reference_programs(config):
  """The rollout and the update of `config`, each one jitted program on one device (cached:
  the lag-1 control reuses the lag-2 reference's)."""
  roll_fn = jax.jit(lambda params, drafter, acceptance, batch, key: scored_rollout(
      params, drafter, acceptance, config, batch, key, reward, TOK.pad_id))

  @jax.jit
  def update_fn(state, pending, key):
    state, metrics = update(state, config, optimizer(), pending, key)
    return state, metrics | rollout_metrics(config, pending)

  return roll_fn, update_fn


def reference_loop(config, state, data, lag):
  """The same rollouts and updates in one loop on one device, with the weights of each
  rollout picked by hand: step t rolls out with theta_max(0, t - lag + 1)."""
  roll_fn, update_fn = reference_programs(config)
  key, k_roll = prime_keys(state.key)
  versions = [(state.params, state.drafter_weights)]
  pending, acceptance = roll_fn(*versions[0], state.acceptance, data[0], k_roll)
  state, history = state.replace(key=key), []
  for t, batch in enumerate(data[1:]):
    key, k_roll, k_update = step_keys(state.key)
    roll, acceptance = roll_fn(*versions[max(0, t - lag + 1)], acceptance, batch, k_roll)
    state, metrics = update_fn(state, pending, k_update)
    state, pending = state.replace(key=key), roll
    versions.append((state.params, state.drafter_weights))
    history.append(jax.device_get(metrics))
  return history, state.replace(pending=pending, acceptance=acceptance)


def assert_same_run(history, final, ref_history, ref_final):
  for i, (got, want) in enumerate(zip(history, ref_history, strict=True)):
    for key in METRICS:
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5,
                                 err_msg=f"step {i}: {key}")
  got, want = flat(final), flat(ref_final)
  assert set(got) == set(want) and ".pending.tokens" in got
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("source, target", [
    (((4, 1, 1), 0, P("data")), ((1, 2, 2), 4, P("fsdp", "tensor"))),
    (((1, 1, 4), 0, P(None, "tensor")), ((2, 1, 2), 4, P())),
    (((2, 1, 1), 0, P("data")), ((1, 3, 2), 2, P("tensor", "fsdp"))),
    (((1, 3, 2), 2, P("fsdp", "tensor")), ((2, 1, 1), 6, P(None, "data"))),
    (((1, 1, 1), 0, P()), ((1, 2, 2), 4, P("tensor"))),
], ids=["4to4", "4to4_replicated", "2to6", "6to2", "1to4"])
def test_transfer_copies_device_to_device_between_any_layouts_and_device_counts(source, target):
  value = np.arange(144.0, dtype=np.float32).reshape(12, 12)
  shardings = []
  for shape, first, spec in (source, target):
    mesh = make_mesh(*shape, devices=jax.devices()[first:first + int(np.prod(shape))])
    shardings.append(NamedSharding(mesh, spec))
  x, scalar = jax.device_put(value, shardings[0]), jnp.float32(3.0)
  with host_reads() as reads, jax.transfer_guard("disallow"):
    y = transfer({"x": x, "scalar": scalar},
                 {"x": shardings[1], "scalar": NamedSharding(shardings[1].mesh, P())})
    jax.block_until_ready(y)
  assert reads == []
  assert y["x"].sharding == shardings[1] and y["scalar"].sharding.mesh == shardings[1].mesh
  np.testing.assert_array_equal(np.asarray(y["x"]), value)
  assert float(y["scalar"]) == 3.0


def test_device_put_between_layouts_does_go_through_the_host():
  """Negative control for the spy: JAX's own cross-mesh `device_put` reads the array into
  host memory when the layouts differ (what `transfer` avoids)."""
  rollout_mesh, train_mesh = meshes()
  x = jax.device_put(np.ones((8, 8), np.float32), NamedSharding(rollout_mesh, P("data")))
  with host_reads() as reads:
    jax.block_until_ready(jax.device_put(x, NamedSharding(train_mesh, P(None, "tensor"))))
  assert reads == [(8, 8)]


def lag_1_against_the_fused_async_step(config, host=False):
  """`config` run disaggregated with lag 1 (with `host`, rewarded in Python between the
  meshes) and, as the independent reference, as async mode's fused step with the JAX reward
  (one program on one device); asserts the two runs are the same and returns the
  disaggregated run's metrics, final state and runner."""
  data = batches(STEPS + 1)
  initial = lambda: init_train_state(config, init_params(MODEL, jax.random.key(0)),
                                     optimizer(), seed=1)
  state = make_prime_fn(config, reward, pad_id=TOK.pad_id)(initial(), data[0])
  step = make_train_step(config, reward, optimizer(), pad_id=TOK.pad_id)
  fused = []
  for batch in data[1:]:
    state, metrics = step(state, batch)
    fused.append(jax.device_get(metrics))
  history, final, run = run_disaggregated(config, initial(), data, lag=1, host=host)
  assert_same_run(history, final, fused, state)
  return history, final, run


@pytest.mark.slow
def test_lag_1_reproduces_the_fused_async_step_with_no_transfer_through_the_host():
  _, final, run = lag_1_against_the_fused_async_step(mtp_config())
  assert run._rollout.jitted._cache_size() == 2 and run._update.jitted._cache_size() == 1
  # Negative control: the steps moved the parameters by far more than the tolerance.
  start = flat(init_params(MODEL, jax.random.key(0)))
  moved = max(np.abs(np.asarray(final.params[k]) - start[f"['{k}']"]).max()
              for k in ("embed", "unembed"))
  assert moved > 1e-3, moved


@pytest.mark.slow
def test_lag_1_with_a_python_reward_scored_between_the_meshes_reproduces_the_fused_async_step():
  """Issue 55: the host scores rollout t while the meshes run update t - 1 and rollout
  t + 1; the run is the fused async step's with the same reward in JAX."""
  history, final, run = lag_1_against_the_fused_async_step(mtp_config(), host=True)
  for metrics in history:  # each step's rewards' own metrics, and their time on the host
    np.testing.assert_allclose(metrics["reward_parity"], metrics["reward_mean"], atol=1e-6)
    assert metrics["perf_reward_s"] > 0 and 0 <= metrics["perf_reward_overlap"] <= 1
  assert np.isfinite(np.asarray(final.pending.advantages)).all()
  assert run._rollout.jitted._cache_size() == 2 and run._update.jitted._cache_size() == 1


@pytest.mark.slow
def test_a_python_reward_that_raises_stops_every_later_call_and_a_nan_pending_is_refused():
  """A failed host reward is not forgotten: the step that needs it raises, and so do the
  steps and `settled()` after it (the rollout stays unscored, never trained on). A state
  saved while its rollout was still being scored (`state()`, NaN rewards) does not start."""
  calls = []

  def flaky(responses, lengths, batch):
    calls.append(len(responses))
    if len(calls) == 2:
      raise ValueError("the verifier crashed on row 3")
    return host_parity(responses, lengths, batch)

  config, data = mtp_config(), batches(3)
  rollout_mesh, train_mesh = meshes()
  make = lambda: DisaggregatedAsync(config, flaky, optimizer(), rollout_mesh, train_mesh,
                                    pad_id=TOK.pad_id, host_reward=True)
  run = make()
  run.start(init_train_state(config, init_params(MODEL, jax.random.key(0)), optimizer(),
                             seed=1), data[0])
  run.step(data[1])  # trains on the first rollout, scored; starts scoring the second
  unscored = jax.device_get(run.state().pending.rewards)
  for again in (lambda: run.step(data[2]), run.settled, lambda: run.step(data[2])):
    with pytest.raises(ValueError, match="the verifier crashed on row 3"):
      again()
  assert np.isnan(unscored).all()
  with pytest.raises(ConfigError, match=r"pending rollout has no rewards \(NaN.*settled\(\)"):
    make().start(run.state())


@pytest.mark.slow
def test_lag_1_with_lora_moves_the_adapters_and_reproduces_the_fused_async_step():
  """With LoRA the rollout side merges the adapters it is sent into the frozen trunk."""
  config = dataclasses.replace(mtp_config(), lora=LoraConfig(rank=4),
                               drafter_training=DrafterTraining(loss_weight=0.0))
  _, final, _ = lag_1_against_the_fused_async_step(config)
  assert ".adapters.factors['layers'][0]['wq']['b']" in flat(final)
  assert np.abs(np.asarray(final.adapters.factors["layers"][0]["wq"]["b"])).max() > 1e-4


@pytest.mark.slow
def test_lag_2_rolls_out_with_weights_two_versions_behind_eagle3_head_included():
  config, data = eagle_config(), batches(STEPS + 1)
  history, final, _ = run_disaggregated(config, eagle_state(config), data, lag=2)
  ref_history, ref_final = reference_loop(config, eagle_state(config), data, lag=2)
  assert_same_run(history, final, ref_history, ref_final)
  assert int(final.acceptance.rounds) > 0 and "eagle3_ce" in history[-1]
  # Negative control: with lag 1 the last rollout comes from newer weights.
  _, lag1 = reference_loop(config, eagle_state(config), data, lag=1)
  assert not np.allclose(np.asarray(final.pending.behaviour_logprobs),
                         np.asarray(lag1.pending.behaviour_logprobs), atol=1e-4)


def test_configurations_that_cannot_work_are_refused_with_the_reason():
  config = mtp_config()
  rollout_mesh, train_mesh = meshes()
  make = lambda **kw: DisaggregatedAsync(**({
      "config": config, "reward_fn": reward, "optimizer": optimizer(),
      "rollout_mesh": rollout_mesh, "train_mesh": train_mesh} | kw))
  with pytest.raises(ConfigError, match="async_mode=True"):
    make(config=dataclasses.replace(config, async_mode=False))
  for lag in (0, 1.5, True):
    with pytest.raises(ConfigError, match=f"policy_lag={lag!r} is invalid"):
      make(policy_lag=lag)
  with pytest.raises(ConfigError, match=r"share devices \[4, 5, 6, 7\]"):
    make(rollout_mesh=train_mesh)
  run = make()
  with pytest.raises(ConfigError, match="call start"):
    run.step(batches(1)[0])
  state = init_train_state(config, init_params(MODEL, jax.random.key(0)), optimizer(), seed=1)
  with pytest.raises(ConfigError, match="needs the first batch"):
    run.start(state)
  primed = make_prime_fn(config, reward, pad_id=TOK.pad_id)(state, batches(1)[0])
  with pytest.raises(ConfigError, match="already holds a pending rollout"):
    run.start(primed, batches(1)[0])
  with pytest.raises(ConfigError, match=r"with pipeline.rollout_devices=4 the mesh covers the "
                                        r"4 devices "
                                        r"the rollouts leave, of 8: mesh.data=1, mesh.fsdp=8"):
    experiment._meshes(experiment.ExperimentConfig(
        pipeline=Pipeline(async_mode=True, rollout_devices=4), mesh=MeshConfig(data=1, fsdp=8)))


def _metrics(run_dir) -> list[dict]:
  return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_an_experiment_with_rollout_devices_gives_the_fused_async_runs_metrics_and_resumes(
    tmp_path):
  """`ExperimentConfig(pipeline=Pipeline(rollout_devices=4))` (4 devices roll out, 4 train)
  logs the metrics of the fused async run on all 8, and a run stopped after 2 steps resumes
  from its checkpoint to the same third step."""
  tiny = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2,
                     n_kv_heads=2, head_dim=16, mlp_dim=64, max_position=32)
  config = tiny_experiment(tmp_path / "fused", {
      "drafter.name": "none", "pipeline.async_mode": True, "warm_start.steps": 30,
      "eval.prompts": 4, "optim.learning_rate": 1e-3}, model=tiny, steps=3,
      grpo=GRPOConfig(group_size=4, tis_cap=2.0))
  logs = []
  experiment.run(config, log=logs.append)
  split = override(config, {"run_dir": str(tmp_path / "split"), "pipeline.rollout_devices": 4})
  experiment.run(dataclasses.replace(split, steps=2), log=logs.append)
  experiment.run(split, log=logs.append)
  assert any("rollouts on 4 device(s), updates on 4" in line for line in logs)
  assert any("resumed from" in line for line in logs)
  fused, disaggregated = _metrics(tmp_path / "fused"), _metrics(tmp_path / "split")
  assert [m["step"] for m in disaggregated] == [1, 2, 3]
  # The comparison has something to compare: the warm start earns rewards, and gradients.
  assert sum(m["grad_norm"] > 0 for m in fused) >= 2, fused
  for want, got in zip(fused, disaggregated, strict=True):
    for key in ("reward_mean", "loss", "kl", "entropy", "grad_norm", "response_length_mean"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5,
                                 err_msg=f"step {want['step']}: {key}")


@pytest.mark.slow
@pytest.mark.parametrize("rollout_devices", [0, 4], ids=["fused", "disaggregated"])
def test_async_runs_with_adaptive_speculation_start_and_resume(tmp_path, monkeypatch,
                                                               rollout_devices):
  """Async mode with the configs' default (MTP drafts, adaptive speculation, acceptance
  counts carried in the state) runs 2 steps and resumes to a third, fused on one mesh and
  with rollouts on 4 devices of 8. Regression: priming the state's structure went through the
  fixed-tree step, which has no policy to update the carried counts, and every such run
  stopped before its first step."""
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
  tiny = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2,
                     n_kv_heads=2, head_dim=16, mlp_dim=64, max_position=32,
                     num_mtp_modules=2)
  config = tiny_experiment(tmp_path / "run", {
      "rollout.tree_widths": (1, 1), "rollout.speculation": "adaptive",
      "pipeline.async_mode": True, "pipeline.rollout_devices": rollout_devices,
      "warm_start.steps": 30, "eval.prompts": 4, "optim.learning_rate": 1e-3},
      model=tiny, steps=3, grpo=GRPOConfig(group_size=4, tis_cap=2.0))
  assert config.carry > 0  # the counts the regression tripped over are in the state
  logs = []
  experiment.run(dataclasses.replace(config, steps=2), log=logs.append)
  experiment.run(config, log=logs.append)
  assert any("resumed from" in line for line in logs)
  metrics = _metrics(tmp_path / "run")
  assert [m["step"] for m in metrics] == [1, 2, 3]
  assert all(m["acceptance_length"] >= 1 for m in metrics), metrics


@pytest.mark.slow
def test_lag_1_with_a_history_drafter_keeps_the_bank_on_the_rollout_side_as_the_fused_step():
  """The bank lives where the rollouts run and comes back with the state: the run, its bank
  included (`flat` compares every leaf), equals the fused async step's."""
  from specjax.decoding.drafters.history import HistoryDrafter
  base = mtp_config()
  rollout = dataclasses.replace(base.rollout, tree=DraftTree.chain(3),
                                drafter=HistoryDrafter(group_size=base.grpo.group_size))
  _, final, _ = lag_1_against_the_fused_async_step(dataclasses.replace(base, rollout=rollout))
  assert int((np.asarray(final.history.lengths) > 0).sum()) > 0
