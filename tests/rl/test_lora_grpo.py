"""GRPO with LoRA (`TrainConfig.lora`): the trunk stays frozen and is the KL reference, the
adapters train, rollouts decode with the merged policy (speculative or plain), on one device
and on a mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from specjax import sharding
from specjax.decoding import DraftModelDrafter, DraftTree, MTPDrafter, SamplingConfig
from specjax.errors import ConfigError
from specjax.models import ModelConfig, init_params
from specjax.models.lora import LoraAdapters, LoraConfig, init_lora
from specjax.rl import ArithmeticTask, GRPOConfig, PromptReader, encode_prompt
from specjax.rl.distributed import train_state_shardings
from specjax.rl.state import DrafterTraining, RolloutConfig, TrainConfig, init_train_state
from specjax.rl.trainer import make_split_step, make_train_step

TASK = ArithmeticTask(max_digits=1, num_train=64, num_test=16)
TOK = TASK.tokenizer
MODEL = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=2, n_kv_heads=2,
                    head_dim=16, mlp_dim=64, max_position=32)
BASE = init_params(MODEL, jax.random.key(0))
LORA = LoraConfig(rank=4, alpha=16.0)
READER = PromptReader([{"prompt": encode_prompt(TOK, e.prompt), "reference": e.reference,
                        "answer": e.answer} for e in TASK.examples("train")],
                      batch_size=4, pad_id=TOK.pad_id)


def _config(speculative=True, sampling=SamplingConfig(1.0), lora=LORA, **grpo):
  # The frozen trunk drafts for the adapted policy: it agrees with it on most tokens.
  rollout = RolloutConfig(max_new_tokens=TASK.max_answer_tokens, eos_id=TOK.eos_id,
                          sampling=sampling,
                          drafter=DraftModelDrafter(MODEL) if speculative else None,
                          tree=DraftTree.chain(2) if speculative else None)
  grpo = GRPOConfig(**{"group_size": 4, "beta": 0.05, "num_minibatches": 2, **grpo})
  return TrainConfig(model=MODEL, grpo=grpo, rollout=rollout, lora=lora)


def _reward(responses, lengths, answers):
  """1 for a row that ended on EOS: a random policy earns it on some rows only, so the
  advantages (and the adapters' gradients) are not all zero."""
  del answers
  last = jnp.take_along_axis(responses, jnp.maximum(lengths - 1, 0)[:, None], 1)[:, 0]
  return ((last == TOK.eos_id) & (lengths > 0)).astype(jnp.float32)


def _start(config, optimizer):
  copy = lambda: jax.tree.map(jnp.copy, BASE)  # the step donates the state's arrays
  drafter = copy() if config.draft_model is not None else None
  return init_train_state(config, copy(), optimizer, seed=1, drafter_params=drafter)


def _run(config, steps, step_fn=None, state=None):
  optimizer = optax.adam(1e-2)
  if state is None:
    state = _start(config, optimizer)
  step_fn = step_fn or make_train_step(config, _reward, optimizer, pad_id=TOK.pad_id)
  history = []
  for i in range(steps):
    state, metrics = step_fn(state, READER.batch_at(4 * i))
    history.append(jax.tree.map(np.asarray, metrics))
  return state, history


@pytest.fixture(scope="module")
def lora_run():
  return _run(_config(), 3)


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_the_adapters_train_and_the_trunk_stays_frozen(lora_run):
  state, history = lora_run
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(BASE)):
    np.testing.assert_array_equal(a, b)
  fresh = init_lora(MODEL, LORA, jax.random.fold_in(jax.random.key(1), 1))
  assert isinstance(state.adapters, LoraAdapters) and state.adapters.config == LORA
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state.adapters),
                                                      jax.tree.leaves(fresh)))
  # The reference is the frozen trunk: no copy; the optimizer holds only adapter moments.
  assert state.ref_params is None
  adapter_count = sum(x.size for x in jax.tree.leaves(state.adapters))
  moments = sum(x.size for x in jax.tree.leaves(state.opt_state))
  assert moments == 2 * adapter_count + 1  # Adam's mu and nu, and its count
  for key in ("loss", "kl", "grad_norm", "reward_mean", "acceptance_length"):
    assert np.all(np.isfinite(history[-1][key])), key
  assert float(history[-1]["kl"]) > 0  # the policy moved away from the trunk
  assert float(history[0]["update_skipped"]) == 0


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_greedy_speculative_and_plain_rollouts_of_the_adapted_policy_train_identically():
  greedy = SamplingConfig(0.0)
  spec_state, spec = _run(_config(True, greedy), 2)
  plain_state, plain = _run(_config(False, greedy), 2)
  for s, p in zip(spec, plain):
    for key in ("reward_mean", "response_length_mean", "loss", "kl"):
      np.testing.assert_allclose(s[key], p[key], rtol=1e-6, atol=1e-7, err_msg=key)
  assert float(spec[-1]["acceptance_length"]) > 1.0  # speculation really ran
  for a, b in zip(jax.tree.leaves(spec_state.adapters), jax.tree.leaves(plain_state.adapters)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_the_split_step_trains_the_adapters_as_the_fused_step_does(lora_run):
  config = _config(sampling=SamplingConfig(0.0))
  fused_state, fused = _run(config, 2)
  host_reward = lambda responses, lengths, batch: np.asarray(
      _reward(jnp.asarray(responses), jnp.asarray(lengths), None))
  split = make_split_step(config, host_reward, optax.adam(1e-2), pad_id=TOK.pad_id)
  split_state, history = _run(config, 2, split)
  for a, b in zip(fused, history):
    for key in ("reward_mean", "loss", "kl"):
      np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)
  for a, b in zip(jax.tree.leaves(fused_state.adapters), jax.tree.leaves(split_state.adapters)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_lora_step_on_a_2x2x2_mesh_gives_the_single_device_metrics():
  config = _config()
  _, single = _run(config, 2)
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  optimizer = optax.adam(1e-2)
  start = _start(config, optimizer)
  shardings = train_state_shardings(start, mesh, config)
  batch_shard = jax.tree.map(lambda x: sharding.batch_sharding(mesh, x.ndim), READER.batch_at(0))
  step = make_train_step(config, _reward, optimizer, pad_id=TOK.pad_id,
                         state_sharding=shardings, batch_sharding=batch_shard)
  state, sharded = _run(config, 2, step, jax.device_put(start, shardings))
  a = state.adapters.factors["layers"][0]["wq"]["a"]
  assert a.sharding == shardings.adapters.factors["layers"][0]["wq"]["a"]
  for s, m in zip(single, sharded):
    for key in ("reward_mean", "loss", "kl", "entropy", "response_length_mean"):
      np.testing.assert_allclose(s[key], m[key], rtol=1e-5, atol=1e-5, err_msg=key)


def test_lora_refuses_draft_heads_it_would_freeze():
  mtp = dataclasses.replace(MODEL, num_mtp_modules=1)
  rollout = RolloutConfig(max_new_tokens=4, eos_id=TOK.eos_id, drafter=MTPDrafter(),
                          tree=DraftTree.chain(1))
  grpo = GRPOConfig(group_size=2)
  with pytest.raises(ConfigError, match="lora with MTP / Medusa heads trained online"):
    TrainConfig(model=mtp, grpo=grpo, rollout=rollout, lora=LORA)
  # Drafting with the heads as they are is allowed.
  TrainConfig(model=mtp, grpo=grpo, rollout=rollout, lora=LORA,
              drafter_training=DrafterTraining(loss_weight=0.0))
  off = TrainConfig(model=mtp, grpo=grpo, rollout=rollout, lora=LoraConfig(rank=0))
  assert off.lora is None  # rank 0: no adapters, every parameter trains
  with pytest.raises(ConfigError, match="lora=4 is invalid: must be a LoraConfig"):
    TrainConfig(model=mtp, grpo=grpo, rollout=rollout, lora=4)


def test_adapters_made_for_another_config_are_refused():
  config = _config()
  other = init_lora(MODEL, LoraConfig(rank=2), jax.random.key(0))
  with pytest.raises(ConfigError, match="adapters were made with"):
    init_train_state(config, BASE, optax.adam(1e-3), 0, drafter_params=BASE, adapters=other)
  with pytest.raises(ConfigError, match="adapters are only used with"):
    init_train_state(_config(lora=None), BASE, optax.adam(1e-3), 0, drafter_params=BASE,
                     adapters=other)
