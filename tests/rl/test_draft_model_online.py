"""An external draft model distilled from the policy inside the GRPO step
(`DrafterTraining.draft_model_learning_rate`): it moves towards the policy's distributions,
stays frozen by default, and its optimizer state shards like its weights."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

from specjax import sharding
from specjax.decoding import DraftModelDrafter, DraftTree
from specjax.errors import ConfigError
from specjax.experiments import Drafting
from specjax.models import ModelConfig, init_params
from specjax.optimizers import MasterState
from specjax.rl import ArithmeticTask, GRPOConfig, PromptReader, encode_prompt
from specjax.rl.distributed import train_state_shardings
from specjax.rl.state import DrafterTraining, RolloutConfig, TrainConfig, init_train_state
from specjax.rl.trainer import make_train_step

TASK = ArithmeticTask(max_digits=1, num_train=64, num_test=16)
TOK = TASK.tokenizer
MODEL = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=2, n_kv_heads=2,
                    head_dim=16, mlp_dim=64, max_position=32)
DRAFT = ModelConfig(vocab_size=TOK.vocab_size, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                    head_dim=8, mlp_dim=32, max_position=32)
READER = PromptReader([{"prompt": encode_prompt(TOK, e.prompt), "reference": e.reference,
                        "answer": e.answer} for e in TASK.examples("train")],
                      batch_size=4, pad_id=TOK.pad_id)


def _config(rate, draft=DRAFT):
  rollout = RolloutConfig(max_new_tokens=TASK.max_answer_tokens, eos_id=TOK.eos_id,
                          drafter=DraftModelDrafter(draft), tree=DraftTree.chain(2))
  return TrainConfig(model=MODEL, grpo=GRPOConfig(group_size=4, num_minibatches=2),
                     rollout=rollout,
                     drafter_training=DrafterTraining(draft_model_learning_rate=rate))


def _state(config, draft=DRAFT):
  return init_train_state(config, init_params(MODEL, jax.random.key(0)), optax.adam(1e-3),
                          seed=1, drafter_params=init_params(draft, jax.random.key(1)))


def _run(config, steps):
  state = _state(config)
  start = jax.tree.map(np.array, state.drafter.weights)
  step = make_train_step(config, TASK.reward, optax.adam(1e-3), pad_id=TOK.pad_id)
  history = []
  for i in range(steps):
    state, metrics = step(state, READER.batch_at(4 * i))
    history.append(jax.tree.map(np.asarray, metrics))
  return start, state, history


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_the_draft_model_is_distilled_towards_the_policy():
  start, state, history = _run(_config(3e-3), 6)
  kl = [float(h["draft_model_kl"]) for h in history]
  assert kl[-1] < 0.7 * kl[0], kl  # the policy barely moves at 1e-3; the draft model does
  assert all(np.isfinite(kl))
  moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(state.drafter.weights),
                                                        jax.tree.leaves(start)))
  assert moved > 1e-3
  assert 0.0 <= float(history[-1]["draft_model_accuracy"]) <= 1.0


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_the_draft_model_stays_frozen_by_default():
  start, state, history = _run(_config(0.0), 2)
  assert state.drafter.opt_state is None and "draft_model_kl" not in history[-1]
  for a, b in zip(jax.tree.leaves(state.drafter.weights), jax.tree.leaves(start)):
    np.testing.assert_array_equal(a, b)


def test_a_bfloat16_draft_model_trains_on_float32_master_weights():
  draft = dataclasses.replace(DRAFT, dtype="bfloat16", param_dtype="bfloat16")
  config = _config(1e-5, draft)
  assert isinstance(_state(config, draft).drafter.opt_state, MasterState)


def test_the_draft_models_optimizer_state_shards_like_its_weights():
  config = _config(1e-3)
  state = _state(config)
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  shardings = train_state_shardings(state, mesh, config)
  placed = jax.device_put(state, shardings)
  mu = placed.drafter.opt_state[0].mu["layers"][0]["wq"]
  assert mu.sharding == shardings.drafter.weights["layers"][0]["wq"]


def test_draft_model_distillation_is_configured_for_a_draft_model_only():
  with pytest.raises(ConfigError, match="drafter.draft_model_learning_rate=0.001 is invalid"):
    Drafting(name="mtp", draft_model_learning_rate=1e-3)
  with pytest.raises(ConfigError, match="draft_model_learning_rate=-1 is invalid"):
    DrafterTraining(draft_model_learning_rate=-1)
