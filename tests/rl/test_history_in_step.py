"""History drafting inside the GRPO step programs: the bank is train state, recorded after
every rollout, drafted from in the next, checkpointed exactly; greedy rollouts, and so the
whole training, equal plain decoding's."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from specjax.checkpoint import Checkpointer
from specjax.decoding import DraftTree, FallbackDrafter, MTPDrafter, SamplingConfig
from specjax.decoding.drafters.history import HistoryDrafter
from specjax.errors import ConfigError
from specjax.models import ModelConfig, init_params
from specjax.rl import ArithmeticTask, GRPOConfig, PromptReader, encode_prompt
from specjax.rl.state import RolloutConfig, TrainConfig, init_train_state
from specjax.rl.trainer import make_split_step, make_train_step

TASK = ArithmeticTask(max_digits=1, num_train=64, num_test=16)
TOK = TASK.tokenizer
MODEL = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                    head_dim=16, mlp_dim=64, num_mtp_modules=2, max_position=32)
GREEDY = SamplingConfig(0.0)


def _config(drafter, tree, compaction=1):
  rollout = RolloutConfig(max_new_tokens=TASK.max_answer_tokens, eos_id=TOK.eos_id,
                          sampling=GREEDY, drafter=drafter, tree=tree, compaction=compaction)
  return TrainConfig(model=MODEL, grpo=GRPOConfig(group_size=4, num_minibatches=2),
                     rollout=rollout)


def _batch():
  records = [{"prompt": encode_prompt(TOK, e.prompt), "reference": e.reference,
              "answer": e.answer} for e in TASK.examples("train")]
  return PromptReader(records, batch_size=4, pad_id=TOK.pad_id).batch_at(0)


def _ended_reward(responses, lengths, answers):
  del answers  # a reward a random policy earns on some rows: the policy moves every step
  last = jnp.take_along_axis(responses, jnp.maximum(lengths - 1, 0)[:, None], 1)[:, 0]
  return ((last == TOK.eos_id) & (lengths > 0)).astype(jnp.float32)


def _train(config, steps, split=False):
  """`steps` steps on one repeated batch (a prompt comes back every step, as over epochs)."""
  optimizer = optax.adam(1e-3)
  state = init_train_state(config, init_params(MODEL, jax.random.key(0)), optimizer, seed=1)
  if split:
    host = lambda responses, lengths, batch: np.asarray(_ended_reward(responses, lengths, None))
    step = make_split_step(config, host, optimizer, pad_id=TOK.pad_id)
  else:
    step = make_train_step(config, _ended_reward, optimizer, pad_id=TOK.pad_id)
  history = []
  for _ in range(steps):
    state, metrics = step(state, _batch())
    history.append(jax.tree.map(np.asarray, metrics))
  return state, history


@pytest.mark.parametrize("split, with_mtp", [
    (False, False), pytest.param(True, True, marks=pytest.mark.slow)],  # slow: README's < 10 min
    ids=["fused-history", "split-history+mtp"])
def test_greedy_history_rollouts_train_as_plain_ones_and_draft_from_the_last_step(split,
                                                                                  with_mtp):
  drafter = HistoryDrafter(group_size=4)
  if with_mtp:
    drafter = FallbackDrafter(drafter, MTPDrafter())
  spec_state, spec = _train(_config(drafter, DraftTree.chain(2 if with_mtp else 4)), 3, split)
  plain_state, plain = _train(_config(None, None), 3, split)
  for s, p in zip(spec, plain):
    for key in ("reward_mean", "response_length_mean", "loss"):
      np.testing.assert_allclose(s[key], p[key], rtol=1e-6, atol=1e-7, err_msg=key)
  for a, b in zip(jax.tree.leaves(spec_state.params), jax.tree.leaves(plain_state.params)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  # The bank holds the last rollouts of the 4 prompts: G = 4 answers a step, 3 steps, at most
  # R (8) each.
  kept = min(3 * 4, HistoryDrafter().per_prompt)
  assert int((spec_state.history.lengths > 0).sum()) == 4 * kept
  # The first step has no history: each row drafts from its siblings, which decode in step
  # (greedy: identically). Later steps draft the earlier answer of the same prompt.
  first, later = float(spec[0]["acceptance_length"]), float(spec[-1]["acceptance_length"])
  assert later > first + 1.0, (first, later)


def test_the_bank_is_checkpointed_and_restored_exactly(tmp_path):
  config = _config(HistoryDrafter(group_size=4), DraftTree.chain(4))
  state, _ = _train(config, 2)
  saved = jax.tree.map(np.array, state.history)
  ckpt = Checkpointer(tmp_path / "ckpt")
  ckpt.save(2, state, {"step": 2})
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  restored, _, _ = ckpt.restore(abstract)
  for a, b in zip(jax.tree.leaves(restored.history), jax.tree.leaves(saved)):
    np.testing.assert_array_equal(np.asarray(a), b)
  ckpt.close()


def test_a_history_drafter_beside_a_drafter_with_weights_must_be_in_front_of_it():
  from specjax.decoding import DraftModelDrafter
  draft = MODEL.replace(num_mtp_modules=0)
  with pytest.raises(ConfigError, match=r"a HistoryDrafter beside a draft model or an EAGLE-3 "
                                        r"head drafts as FallbackDrafter\(HistoryDrafter"):
    _config(FallbackDrafter(DraftModelDrafter(draft), HistoryDrafter(group_size=4)),
            DraftTree.chain(2))
  config = _config(FallbackDrafter(HistoryDrafter(group_size=4), DraftModelDrafter(draft)),
                   DraftTree.chain(2))
  assert config.draft_model == DraftModelDrafter(draft)


@pytest.mark.slow  # four compiled steps
def test_greedy_history_rollouts_in_front_of_a_draft_model_train_as_plain_ones():
  """history+draft-model: the bank (the primary's drafter_params) and the draft model's
  weights (the fallback's) both come from the train state (`FallbackParams`); greedy
  rollouts are plain decoding's, so the training is, and later steps draft from the bank."""
  from specjax.decoding import DraftModelDrafter
  from specjax.models import init_params as init
  draft = MODEL.replace(num_mtp_modules=0, n_layers=1)
  config = _config(FallbackDrafter(HistoryDrafter(group_size=4, min_ngram=1),
                                   DraftModelDrafter(draft)), DraftTree.chain(3))
  optimizer = optax.adam(1e-3)
  state = init_train_state(config, init_params(MODEL, jax.random.key(0)), optimizer, seed=1,
                           drafter_params=init(draft, jax.random.key(7)))
  step, spec = make_train_step(config, _ended_reward, optimizer, pad_id=TOK.pad_id), []
  for _ in range(3):
    state, metrics = step(state, _batch())
    spec.append(jax.tree.map(np.asarray, metrics))
  plain_state, plain = _train(_config(None, None), 3)
  for s, p in zip(spec, plain, strict=True):
    for key in ("reward_mean", "response_length_mean", "loss"):
      np.testing.assert_allclose(s[key], p[key], rtol=1e-6, atol=1e-7, err_msg=key)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(plain_state.params)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert int((state.history.lengths > 0).sum()) > 0
  # The bank drafts the prompt's earlier answers from the second step on.
  assert float(spec[-1]["drafted_by_history"]) > 0 and float(spec[0]["drafted_by_draftmodel"]) > 0
