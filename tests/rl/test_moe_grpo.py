"""GRPO on a mixture-of-experts policy: the fused step with its experts split over an "expert"
mesh axis (expert parallelism, `specjax.models.moe.experts_parallel`) trains as on one device,
and its checkpoint restores on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from specjax import sharding
from specjax.checkpoint import Checkpointer
from specjax.decoding import DraftTree, MTPDrafter, SamplingConfig
from specjax.errors import ConfigError
from specjax.models import ModelConfig, forward, init_params
from specjax.rl import ArithmeticTask, GRPOConfig, PromptReader, encode_prompt
from specjax.rl.distributed import train_state_shardings
from specjax.rl.state import RolloutConfig, TrainConfig, init_train_state
from specjax.rl.trainer import make_train_step

TASK = ArithmeticTask(max_digits=1, num_train=64, num_test=16)
TOK = TASK.tokenizer
MOE = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                  head_dim=16, mlp_dim=64, qk_norm=True, family="qwen3_moe", n_experts=8,
                  experts_per_token=2, expert_dim=16, num_mtp_modules=1, max_position=32)
READER = PromptReader([{"prompt": encode_prompt(TOK, e.prompt), "reference": e.reference,
                        "answer": e.answer} for e in TASK.examples("train")],
                      batch_size=4, pad_id=TOK.pad_id)


def _params():
  params = init_params(MOE, jax.random.key(0))
  for layer in params["layers"] + [m["block"] for m in params["mtp"]]:
    layer["router"] = layer["router"] * 10.0  # tokens spread over the experts
  return params


def _reward(responses, lengths, answers):
  """1 for a row that ended on EOS: some rows of a random policy do, some do not."""
  del answers
  last = jnp.take_along_axis(responses, jnp.maximum(lengths - 1, 0)[:, None], 1)[:, 0]
  return ((last == TOK.eos_id) & (lengths > 0)).astype(jnp.float32)


def _config():
  rollout = RolloutConfig(max_new_tokens=TASK.max_answer_tokens, eos_id=TOK.eos_id,
                          sampling=SamplingConfig(1.0), drafter=MTPDrafter(),
                          tree=DraftTree.chain(1))
  return TrainConfig(model=MOE, grpo=GRPOConfig(group_size=4, beta=0.05), rollout=rollout)


def _run(mesh, steps=3):
  config, optimizer = _config(), optax.adam(1e-3)
  state = init_train_state(config, _params(), optimizer, seed=1)
  step = make_train_step(config, _reward, optimizer, pad_id=TOK.pad_id)
  if mesh is not None:
    shardings = train_state_shardings(state, mesh, config)
    # 4 prompts: split over the batch axes that divide them (data), the 16 rows over all 8.
    batch = jax.tree.map(lambda x: sharding.logical_sharding(P("batch"), mesh, x.shape),
                         READER.batch_at(0))
    step = make_train_step(config, _reward, optimizer, pad_id=TOK.pad_id,
                           state_sharding=shardings, batch_sharding=batch)
    state = jax.device_put(state, shardings)
  history = []
  for i in range(steps):
    state, metrics = step(state, READER.batch_at(4 * i))
    history.append(jax.tree.map(np.asarray, metrics))
  return state, history


@pytest.mark.slow
def test_three_steps_on_a_data_x_expert_mesh_equal_one_device_and_restore_there(tmp_path):
  single_state, single = _run(None)
  mesh = sharding.make_mesh(data=2, expert=4)
  state, sharded = _run(mesh)
  gate = state.params["layers"][0]["experts_gate"]
  assert gate.sharding.spec[0] == ("expert", "fsdp")  # each device holds 2 of the 8 experts
  assert {s.data.shape[0] for s in gate.addressable_shards} == {2}
  for a, b in zip(single, sharded):
    assert float(a["reward_mean"]) not in (0.0, 1.0)  # advantages are not all zero
    for key in ("reward_mean", "loss", "kl", "mtp_ce", "response_length_mean"):
      np.testing.assert_allclose(a[key], b[key], rtol=1e-6, atol=1e-6, err_msg=key)
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()),
                                       single_state.params, _params()))
  assert max(moved) > 1e-4  # the policy trained
  for a, b in zip(jax.tree.leaves(single_state.params), jax.tree.leaves(state.params)):
    np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6, atol=1e-6)

  # Written from the mesh, read back onto one device: the same parameters.
  ckpt = Checkpointer(tmp_path / "ckpt")
  ckpt.save(3, state.params, {"step": 3})
  ckpt.close()
  one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                    sharding=jax.sharding.SingleDeviceSharding(
                                                        jax.devices()[0])), single_state.params)
  restored, _, step = Checkpointer(tmp_path / "ckpt").restore(one)
  assert step == 3
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state.params)):
    assert len(a.sharding.device_set) == 1
    np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize("mesh_shape, rows", [
    pytest.param(dict(data=2, expert=4), 8, marks=pytest.mark.slow),
    pytest.param(dict(fsdp=8), 8, marks=pytest.mark.slow),
    pytest.param(dict(expert=2, fsdp=2, tensor=2), 8, marks=pytest.mark.slow),
    # 3 x 6 tokens: padded to a multiple of the 8 experts' devices
    pytest.param(dict(fsdp=8), 3, marks=pytest.mark.slow)])
def test_experts_split_over_the_expert_and_fsdp_axes_in_the_compiled_forward(mesh_shape,
                                                                                rows):
  """Forward and gradient with the experts split over the "expert" axis, or over fsdp (no
  expert is gathered), equal one device's; the compiled program gathers the expert group's
  tokens and reduce-scatters the experts' outputs."""
  params = _params()
  tokens = jax.random.randint(jax.random.key(1), (rows, 6), 0, MOE.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(6), (rows, 6))
  loss = lambda p, t: jnp.mean(forward(p, MOE, t, positions).logits ** 2)
  want, want_grad = loss(params, tokens), jax.grad(loss)(params, tokens)
  mesh = sharding.make_mesh(**({"data": -1} | mesh_shape))
  shardings = sharding.param_shardings(MOE, mesh)
  split = mesh.shape["expert"] * mesh.shape["fsdp"]
  assert shardings["layers"][0]["experts_gate"].shard_shape((8, 32, 16))[0] == 8 // split
  placed = jax.device_put(params, shardings)
  rows = jax.device_put(tokens, sharding.logical_sharding(P("batch"), mesh, tokens.shape))
  with jax.sharding.set_mesh(mesh):
    fn = jax.jit(jax.value_and_grad(loss))
    got, grad = fn(placed, rows)
    hlo = fn.lower(placed, rows).compile().as_text()
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(want_grad)):
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-7)
  assert "reduce-scatter" in hlo and "all-gather" in hlo


def test_an_expert_axis_that_does_not_divide_the_experts_is_refused():
  mesh = sharding.make_mesh(data=-1, expert=4)
  odd = MOE.replace(n_experts=6)
  params = init_params(odd, jax.random.key(0))
  tokens = jnp.zeros((8, 2), jnp.int32)
  with jax.sharding.set_mesh(mesh), pytest.raises(
      ConfigError, match=r"expert axis has 4 devices, which do not divide the model's "
                         r"n_experts=6"):
    jax.jit(lambda p: forward(p, odd, tokens, jnp.zeros((8, 2), jnp.int32)).logits)(params)


@pytest.mark.slow  # (the loss itself is checked against transformers in the fast tier)
def test_the_router_aux_weight_adds_the_load_balancing_loss_to_the_update():
  from specjax.models.moe import load_balancing_loss
  from specjax.rl.updates import _minibatch_loss
  tokens = jax.random.randint(jax.random.key(2), (4, 8), 0, MOE.vocab_size)
  mask = jnp.ones((4, 8), bool).at[2:, 6:].set(False)
  mb = {"tokens": tokens, "valid_mask": mask, "response_mask": mask.at[:, :3].set(False),
        "advantages": jnp.array([1.0, -1.0, 0.5, -0.5]),
        "behaviour_logprobs": jnp.full((4, 8), -3.0)}
  params = _params()
  losses, grads = {}, {}
  for weight in (0.0, 0.5):
    config = TrainConfig(model=MOE, grpo=GRPOConfig(group_size=4, router_aux_weight=weight),
                         rollout=_config().rollout)
    (loss, (metrics, out)), grad = jax.value_and_grad(_minibatch_loss, has_aux=True)(
        params, config, mb)
    losses[weight], grads[weight] = loss, grad["layers"][0]["router"]
    balance = load_balancing_loss(out.router_logits, MOE, mask)
    np.testing.assert_allclose(metrics["router_balance"], balance, rtol=1e-6)
  np.testing.assert_allclose(losses[0.5] - losses[0.0], 0.5 * balance, rtol=1e-4)
  assert float(jnp.abs(grads[0.5] - grads[0.0]).max()) > 1e-6  # the router learns balance
  dense = MOE.replace(family="qwen3", n_experts=0, experts_per_token=0, expert_dim=0)
  with pytest.raises(ConfigError, match=r"grpo.router_aux_weight=0.5 is invalid: .* this model "
                                        r"is dense"):
    TrainConfig(model=dense, grpo=GRPOConfig(group_size=4, router_aux_weight=0.5),
                rollout=_config().rollout)


@pytest.mark.slow
def test_a_bfloat16_moe_on_an_fsdp_mesh_compiles_and_matches_one_device():
  """XLA:CPU aborts on bfloat16 reduce-scatters; floats cross devices as float32 there."""
  config = MOE.replace(dtype="bfloat16")
  params = _params()
  tokens = jax.random.randint(jax.random.key(3), (8, 4), 0, MOE.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(4), (8, 4))
  loss = lambda p: jnp.mean(forward(p, config, tokens, positions).logits ** 2)
  want = jax.grad(loss)(params)["layers"][0]["experts_up"]
  mesh = sharding.make_mesh(fsdp=8)
  with jax.sharding.set_mesh(mesh):
    got = jax.jit(jax.grad(loss))(jax.device_put(params, sharding.param_shardings(MOE, mesh)))
  np.testing.assert_allclose(np.asarray(got["layers"][0]["experts_up"]), want, atol=2e-3,
                             rtol=5e-2)
