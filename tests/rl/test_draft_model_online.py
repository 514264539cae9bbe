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
  with pytest.raises(ConfigError, match="drafter.draft_model_learning_rate=0.001 is invalid"):
    Drafting(name="group+eagle3", draft_model_learning_rate=1e-3)
  # Behind group drafts as alone: the draft model's checkpoint is needed, and only there.
  with pytest.raises(ConfigError, match=r"drafter.checkpoint=None is invalid: give it exactly "
                                        r"with name 'draft-model', 'group\+draft-model' or "
                                        r"'history\+draft-model'"):
    Drafting(name="group+draft-model")
  with pytest.raises(ConfigError, match="drafter.checkpoint='/x' is invalid"):
    Drafting(name="group+eagle3", checkpoint="/x")
  assert Drafting(name="group+draft-model", checkpoint="/x").weights == "draft-model"
  assert Drafting(name="group+eagle3").weights == "eagle3" and Drafting().weights is None
  with pytest.raises(ConfigError, match="draft_model_learning_rate=-1 is invalid"):
    DrafterTraining(draft_model_learning_rate=-1)


@pytest.mark.slow  # four compiled steps: kept out of the README's test command
def test_group_drafting_in_front_of_a_draft_model_trains_as_plain_decoding():
  """`FallbackDrafter(GroupDrafter, DraftModelDrafter)` in the GRPO step: the draft model's
  weights live in the train state as for a lone draft model (and are distilled online), the
  group drafts where a sibling wrote ahead, and greedy rollouts are token for token plain
  decoding's, so the fused and the split steps train exactly as plain rollouts do."""
  from specjax.decoding import FallbackDrafter, GroupDrafter, SamplingConfig
  from specjax.rl.trainer import make_split_step
  greedy = SamplingConfig(0.0)

  def config(drafter):
    rollout = RolloutConfig(max_new_tokens=TASK.max_answer_tokens, eos_id=TOK.eos_id,
                            sampling=greedy, drafter=drafter,
                            tree=None if drafter is None else DraftTree.chain(2))
    return TrainConfig(model=MODEL, grpo=GRPOConfig(group_size=4, num_minibatches=2),
                       rollout=rollout,
                       drafter_training=DrafterTraining(draft_model_learning_rate=3e-3))

  both = config(FallbackDrafter(GroupDrafter(group_size=4), DraftModelDrafter(DRAFT)))
  assert both.draft_model == DraftModelDrafter(DRAFT) and both.trains_draft_model
  plain = config(None)
  optimizer = optax.adam(1e-3)

  def python_reward(responses, lengths, batch):  # TASK.reward's rule needs answers: length
    return [float(n) / TASK.max_answer_tokens for n in lengths]

  jax_reward = lambda responses, lengths, answers: lengths / TASK.max_answer_tokens
  runs = {}
  for name, cfg, make in (
      ("plain", plain, lambda c: make_train_step(c, jax_reward, optimizer, pad_id=TOK.pad_id)),
      ("fused", both, lambda c: make_train_step(c, jax_reward, optimizer, pad_id=TOK.pad_id)),
      ("split", both, lambda c: make_split_step(c, python_reward, optimizer,
                                                pad_id=TOK.pad_id))):
    state = (_state(cfg) if cfg.draft_model is not None else
             init_train_state(cfg, init_params(MODEL, jax.random.key(0)), optimizer, seed=1))
    step, history = make(cfg), []
    for i in range(2):
      state, metrics = step(state, READER.batch_at(4 * i))
      history.append(jax.tree.map(np.asarray, metrics))
    runs[name] = state, history
  for name in ("fused", "split"):
    for p, s in zip(runs["plain"][1], runs[name][1]):
      for key in ("reward_mean", "loss", "response_length_mean"):
        np.testing.assert_allclose(p[key], s[key], rtol=1e-5, atol=1e-6, err_msg=(name, key))
      assert float(s["plain_share"]) == 0.0  # every round drafted (a fixed chain)
      assert "draft_model_kl" in s  # the fallback's weights were distilled
    for a, b in zip(jax.tree.leaves(runs["plain"][0].params),
                    jax.tree.leaves(runs[name][0].params)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
