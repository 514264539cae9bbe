"""The fused GRPO step: equivalences, compilation, sharding, async and split modes, resume."""

import dataclasses
import json
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support import child_env

from specjax import sharding
from specjax.checkpoint import DIGEST_FILE, CheckpointError, Checkpointer
from specjax.decoding import (AcceptanceCounts, Adaptive, CostTable, DraftTree, FallbackDrafter,
                              GroupDrafter, MTPDrafter, SamplingConfig)
from specjax.errors import ConfigError
from specjax.experiments import override
from specjax.models import ModelConfig, init_params
from specjax.rl import ArithmeticTask, GRPOConfig, PromptReader, encode_prompt, updates
from specjax.rl.distributed import rollout_shardings, train_state_shardings
from specjax.rl.rollouts import rollout, rollout_metrics
from specjax.rl.state import DrafterTraining, RolloutConfig, TrainConfig, init_train_state
from specjax.rl.trainer import make_prime_fn, make_split_step, make_train_step

ROOT = Path(__file__).resolve().parents[2]
TASK = ArithmeticTask(max_digits=1, num_train=64, num_test=16)
TOK = TASK.tokenizer
MODEL = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                    head_dim=16, mlp_dim=64, num_mtp_modules=2, max_position=32)


def _reader(batch_size=4):
  records = [{"prompt": encode_prompt(TOK, e.prompt), "reference": e.reference,
              "answer": e.answer} for e in TASK.examples("train")]
  return PromptReader(records, batch_size=batch_size, pad_id=TOK.pad_id)


def _config(sampling=SamplingConfig(1.0), speculative=True, compaction=0, max_new_tokens=None,
            **kwargs):
  rollout = RolloutConfig(max_new_tokens=max_new_tokens or TASK.max_answer_tokens,
                          eos_id=TOK.eos_id, sampling=sampling,
                          drafter=MTPDrafter() if speculative else None,
                          tree=DraftTree.chain(2) if speculative else None,
                          compaction=compaction)
  grpo = kwargs.pop("grpo", GRPOConfig(group_size=4, beta=0.05, num_minibatches=2))
  return TrainConfig(model=MODEL, grpo=grpo, rollout=rollout, **kwargs)


def _ended_reward(responses, lengths, answers):
  """1 for a row that ended on EOS, 0 for one cut at max_new_tokens. A random policy earns it
  on some rows and not on others, so advantages and the policy's gradient are never all zero
  (the task's own reward rarely pays a random policy anything, and then the trunk would not
  move, whatever the test checks)."""
  del answers
  last = jnp.take_along_axis(responses, jnp.maximum(lengths - 1, 0)[:, None], 1)[:, 0]
  return ((last == TOK.eos_id) & (lengths > 0)).astype(jnp.float32)


def _run(config, steps, step_fn=None, state=None, params_seed=0, first=0):
  """`steps` steps from `state` (default: a fresh one), on the batches of steps `first`,
  `first + 1`, ...; returns the state, the metrics of each step and the step function."""
  optimizer = optax.adam(1e-3)
  if state is None:
    state = init_train_state(config, init_params(MODEL, jax.random.key(params_seed)),
                             optimizer, seed=1)
  step_fn = step_fn or make_train_step(config, _ended_reward, optimizer, pad_id=TOK.pad_id)
  reader, history = _reader(), []
  for i in range(first, first + steps):
    state, metrics = step_fn(state, reader.batch_at(4 * i))
    history.append(jax.tree.map(np.asarray, metrics))
  return state, history, step_fn


@pytest.fixture(scope="module")
def fused_run():
  """The default config's fused step, run for 4 steps from a fresh state, compiled once for
  the tests that check it: its history, the parameters after step 3 (copied, as the next
  step donates them) and the final state and step function."""
  state, history, step = _run(_config(), 3)
  params_at_3 = jax.tree.map(np.array, state.params)
  state, last, step = _run(_config(), 1, step, state, first=3)
  return {"history": history + last, "params_at_3": params_at_3, "state": state,
          "step": step}


def test_greedy_rollouts_with_and_without_speculation_train_identically():
  greedy = SamplingConfig(0.0)
  spec_state, spec_hist, _ = _run(_config(greedy, speculative=True), 3)
  plain_state, plain_hist, _ = _run(_config(greedy, speculative=False), 3)
  for s, p in zip(spec_hist, plain_hist):
    for key in ("reward_mean", "response_length_mean", "loss", "kl", "mtp_ce"):
      np.testing.assert_allclose(s[key], p[key], rtol=1e-6, atol=1e-7, err_msg=key)
  assert float(spec_hist[-1]["acceptance_length"]) > 1.0  # speculation really ran
  # A fixed tree drafts every round; plain rollouts never do.
  assert [float(h["plain_share"]) for h in spec_hist + plain_hist] == [0.0] * 3 + [1.0] * 3
  for a, b in zip(jax.tree.leaves(spec_state.params), jax.tree.leaves(plain_state.params)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_train_step_compiles_once_and_updates_the_policy_and_drafter(fused_run):
  config = _config()
  state0 = init_train_state(config, init_params(MODEL, jax.random.key(0)), optax.adam(1e-3), 1)
  embed0 = np.asarray(state0.params["embed"])
  mtp0 = np.asarray(state0.params["mtp"][0]["proj"])
  state, history, step = fused_run["state"], fused_run["history"], fused_run["step"]
  assert len(history) == 4 and step._cache_size() == 1
  assert int(state.step) == 4
  assert not np.allclose(state.params["embed"], embed0)
  assert not np.allclose(state.params["mtp"][0]["proj"], mtp0)
  for key in ("reward_mean", "accuracy", "response_length_max", "response_clip_frac", "kl",
              "clip_frac_low", "clip_frac_high", "entropy", "grad_norm", "acceptance_length",
              "accepted_per_depth", "mtp_ce", "rollout_tokens"):
    assert key in history[-1], key
    assert np.all(np.isfinite(history[-1][key])), key


def test_rollout_and_trainer_log_probs_agree_in_float32(fused_run):
  """`logprob_gap_*`: the rollout's recorded log-probs (speculative: from the verify forward
  over a draft chain against the cache) against the update's teacher-forced ones on the same
  response tokens; in float32 two programs that compute the same thing."""
  for h in fused_run["history"]:
    assert 0.0 <= float(h["logprob_gap_mean"]) <= float(h["logprob_gap_max"]) <= 1e-5, h


def test_the_log_prob_gap_is_the_masked_absolute_difference():
  trainer = jnp.asarray([[-1.0, -2.0, -3.0], [-0.5, -0.25, 9.0]])
  engine = jnp.asarray([[-1.5, -2.0, -2.0], [-0.5, -0.5, 0.0]])
  mask = jnp.asarray([[1, 1, 1], [1, 1, 0]])  # the 9 nats of the last token are padding
  gap = updates.logprob_gap(trainer, engine, mask)
  np.testing.assert_allclose(float(gap["logprob_gap_mean"]), (0.5 + 0 + 1 + 0 + 0.25) / 5)
  assert float(gap["logprob_gap_max"]) == 1.0


@pytest.mark.slow
def test_the_log_prob_gap_of_bfloat16_is_reported_and_bounded():
  """In bfloat16 the two programs may round differently (on XLA:CPU, inside one compiled
  step, this tiny model's two paths measured exactly alike; eagerly they differ by ~2e-4
  nats): the gap is reported, finite, and small."""
  model = MODEL.replace(dtype="bfloat16", param_dtype="bfloat16")
  config = dataclasses.replace(_config(), model=model)
  optimizer = optax.adam(1e-3)
  state = init_train_state(config, init_params(model, jax.random.key(0)), optimizer, seed=1)
  step = make_train_step(config, _ended_reward, optimizer, pad_id=TOK.pad_id)
  _, metrics = step(state, _reader().batch_at(0))
  mean, peak = float(metrics["logprob_gap_mean"]), float(metrics["logprob_gap_max"])
  assert 0.0 <= mean <= peak < 0.05, (mean, peak)


def test_a_rollout_with_group_drafting_in_front_of_mtp_reports_each_drafters_acceptance():
  """Which drafter pays, from inside the step's program: `acceptance_group`, `acceptance_mtp`
  and their shares of the drafted row-rounds (the shares sum to 1; sharded replicated)."""
  base = _config(compaction=1)
  drafter = FallbackDrafter(GroupDrafter(group_size=4, min_ngram=1), MTPDrafter())
  config = dataclasses.replace(base, rollout=dataclasses.replace(base.rollout, drafter=drafter))
  params = init_params(MODEL, jax.random.key(0))
  batch = _reader().batch_at(0)

  @jax.jit
  def metrics(params, key):
    roll = rollout(params, config, batch.tokens, batch.lengths, key, TOK.pad_id)[0]
    return roll, rollout_metrics(config, roll)
  roll, m = metrics(params, jax.random.key(0))
  counts = {k: int(v) for k, v in roll.drafter_stats.items()}
  assert counts["group_rounds"] + counts["mtp_rounds"] > 0
  assert float(m["drafted_by_group"]) + float(m["drafted_by_mtp"]) == pytest.approx(1.0)
  for name in ("group", "mtp"):
    rounds = counts[f"{name}_rounds"]
    got = float(m[f"acceptance_{name}"])
    assert (got == pytest.approx(counts[f"{name}_tokens"] / rounds)) if rounds else np.isnan(got)
  assert 1.0 <= float(m["acceptance_mtp"]) <= 3.0  # a chain of 2: at most 3 tokens a round
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  assert all(s.is_fully_replicated for s in
             jax.tree.leaves(rollout_shardings(roll, mesh).drafter_stats))


def test_a_rollout_starts_from_the_last_rollouts_counts_weighed_by_the_carry():
  menu = Adaptive((DraftTree.chain(1), DraftTree.chain(2)),
                  costs=CostTable((16,), ((1.0,), (1.05,), (1.1,))))
  rc = dataclasses.replace(_config().rollout, tree=None, speculation=menu, acceptance_carry=0.25)
  last = AcceptanceCounts.zeros(3, 2).replace(reached=jnp.full((3, 2), 8.0),
                                              hits=jnp.full((3, 2), 4.0), rounds=jnp.asarray(7))
  carried = rc.carried(last)
  np.testing.assert_array_equal(carried.reached, np.full((3, 2), 2.0))
  np.testing.assert_array_equal(carried.hits, np.full((3, 2), 1.0))
  assert int(carried.rounds) == 7  # the round count is not evidence
  assert rc.carried(None) is None


@pytest.mark.slow
def test_adaptive_rollouts_carry_their_acceptance_counts_from_step_to_step():
  # Chains of 1 and 2 pay at the prior (0.9) at 16 rows: without evidence the policy drafts.
  menu = Adaptive((DraftTree.chain(1), DraftTree.chain(2)),
                  costs=CostTable((16,), ((1.0,), (1.05,), (1.1,))))
  base = _config()
  config = dataclasses.replace(base, rollout=dataclasses.replace(
      base.rollout, tree=None, speculation=menu, acceptance_carry=1.0))
  state0 = init_train_state(config, init_params(MODEL, jax.random.key(0)), optax.adam(1e-3), 1)
  assert state0.acceptance.reached.shape == (3, 2) and int(state0.acceptance.rounds) == 0
  mesh = sharding.make_mesh(devices=jax.devices()[:1])
  spec = train_state_shardings(state0, mesh, config).acceptance
  assert all(s.is_fully_replicated for s in jax.tree.leaves(spec))

  batch = _reader().batch_at(0)
  roll = jax.jit(lambda acceptance: rollout(state0.params, config, batch.tokens, batch.lengths,
                                            jax.random.key(0), TOK.pad_id, None, acceptance))
  r, _, _, fresh = roll(state0.acceptance)
  assert float(fresh.reached[1:].sum()) >= 1  # no evidence: a chain ran
  assert float(r.plain_share) < 1.0
  # Evidence that no draft is ever accepted, carried in: every round is plain, no new counts.
  never = state0.acceptance.replace(reached=jnp.full((3, 2), 1e6))
  r, _, _, after = roll(never)
  assert float(r.tokens_per_round) == 1.0 and float(r.plain_share) == 1.0
  assert np.all(np.asarray(after.reached) <= 1e6) and float(after.hits.sum()) == 0
  assert int(after.rounds) > 0

  state, _, step = _run(config, 1, state=state0)
  first = int(state.acceptance.rounds)
  assert first > 0
  state, _, step = _run(config, 1, step, state, first=1)
  assert step._cache_size() == 1
  # The second rollout's counts run on from the first's instead of starting from the prior.
  assert int(state.acceptance.rounds) > first
  with pytest.raises(ConfigError, match="acceptance_carry=1.5 is invalid"):
    dataclasses.replace(config.rollout, acceptance_carry=1.5)
  with pytest.raises(ConfigError, match="needs speculation"):
    dataclasses.replace(base.rollout, acceptance_carry=0.5)


def test_experiments_carry_acceptance_by_default_only_where_the_adaptive_policy_keeps_it():
  from specjax.experiments import Drafting, ExperimentConfig, RolloutSettings
  from specjax.experiments.grpo_config import DEFAULT_ACCEPTANCE_CARRY
  adaptive = ExperimentConfig(rollout=RolloutSettings(speculation="adaptive"))
  assert adaptive.carry == DEFAULT_ACCEPTANCE_CARRY == 0.5
  counts = adaptive.initial_acceptance()
  assert counts.reached.shape == (len(adaptive.adaptive().menu), 2)  # (1, 1) tree: depth 2
  for config in (ExperimentConfig(),
                 ExperimentConfig(rollout=adaptive.rollout, drafter=Drafting(name="none")),
                 ExperimentConfig(rollout=RolloutSettings(speculation="adaptive",
                                                          acceptance_carry=0.0))):
    assert config.carry == 0.0 and config.initial_acceptance() is None, config
  assert ExperimentConfig(rollout=RolloutSettings(speculation="adaptive",
                                                  acceptance_carry=1)).carry == 1.0


def test_the_fused_step_runs_no_host_callback_while_generate_under_jit_checks_its_prompts():
  """generate checks traced prompts with a host callback (which also gathers them to one
  device on a mesh); the train step's prompts come from its data pipeline and skip it."""
  optimizer = optax.adam(1e-3)
  config = _config(speculative=False)
  state = init_train_state(config, init_params(MODEL, jax.random.key(0)), optimizer, seed=1)
  step = make_train_step(config, _ended_reward, optimizer, pad_id=TOK.pad_id)
  assert "callback" not in step.lower(state, _reader().batch_at(0)).as_text()
  # Control: the same rollout with the check on lowers with one.
  batch = _reader().batch_at(0)
  checked = jax.jit(lambda p, t, n: rollout(p, config, t, n, jax.random.key(0), TOK.pad_id)[1])
  assert "callback" in checked.lower(state.params, batch.tokens, batch.lengths).as_text()


def test_experiment_passes_its_drafter_training_to_the_train_step():
  from specjax.experiments import Drafting, ExperimentConfig, RolloutSettings
  config = ExperimentConfig(rollout=RolloutSettings(tree_widths=(1, 1, 1, 1)),
                            drafter=Drafting(name="eagle3", ttt_steps=4, loss_weight=0.5,
                                             learning_rate=2e-3))
  assert config.train_config().drafter_training == DrafterTraining(0.5, 2e-3, 4)
  eagle = ExperimentConfig(drafter=Drafting(name="eagle3"))
  assert eagle.train_config().drafter_training == DrafterTraining(1.0, 1e-3, 3)
  compacting = ExperimentConfig(rollout=RolloutSettings(compaction=2))
  assert compacting.train_config().rollout.compaction == 2
  assert compacting.train_config("none").rollout.compaction == 2  # the plain arm compacts too


# A second end token beside the tokenizer's EOS: a digit the untrained policy samples often.
TWO_EOS = (TOK.eos_id, TOK.encode("9")[0])


@pytest.fixture(scope="module")
def two_eos_step():
  """One fused step (plain rollouts, the cheapest to compile) whose rollout ends rows on
  either id of `TWO_EOS`, given as a list. Its reward, 1 for a row that ended on an end token
  and 0 for one cut at max_new_tokens, gives groups unequal advantages, so the policy loss
  reaches the trunk. Returns the config, the step's metrics and the responses and lengths
  the reward saw."""
  # One minibatch: its gradient norms are the step's, not means over minibatches.
  base = _config(speculative=False, grpo=GRPOConfig(group_size=4, beta=0.05))
  config = dataclasses.replace(base, rollout=dataclasses.replace(base.rollout,
                                                                 eos_id=list(TWO_EOS)))
  seen = {}

  def reward(responses, lengths, answers):
    del answers
    jax.debug.callback(lambda r, n: seen.update(responses=np.asarray(r), lengths=np.asarray(n)),
                       responses, lengths)
    last = jnp.take_along_axis(responses, jnp.maximum(lengths - 1, 0)[:, None], 1)[:, 0]
    return jnp.isin(last, jnp.asarray(TWO_EOS)).astype(jnp.float32)

  optimizer = optax.adam(1e-3)
  state = init_train_state(config, init_params(MODEL, jax.random.key(0)), optimizer, seed=1)
  step = make_train_step(config, reward, optimizer, pad_id=TOK.pad_id)
  _, metrics = step(state, _reader().batch_at(0))
  metrics = jax.tree.map(np.asarray, metrics)
  return config, metrics, seen["responses"], seen["lengths"]


def test_rollouts_with_two_eos_ids_end_each_row_on_either(two_eos_step):
  config, metrics, responses, lengths = two_eos_step
  assert config.rollout.eos_id == TWO_EOS and hash(config)  # the list became a tuple
  n = config.rollout.max_new_tokens
  ended_on = []
  for row, length in zip(responses, lengths):
    stops = [j for j in range(length) if row[j] in TWO_EOS]
    # A row ends right after its first end token, or runs to max_new_tokens without one.
    assert (stops == [] and length == n) or stops == [length - 1], (row, length)
    ended_on.append(row[length - 1] if stops else None)
  assert set(ended_on) >= set(TWO_EOS)  # rows ended on each of the two ids
  # rollout_metrics counts a row ending on either id as ended, not clipped.
  clipped = np.mean([e is None for e in ended_on])
  np.testing.assert_allclose(metrics["response_clip_frac"], clipped)
  np.testing.assert_allclose(metrics["reward_mean"], 1 - clipped)


def test_rollout_config_eos_ids_are_checked():
  base = _config().rollout
  assert dataclasses.replace(base, eos_id=np.int64(2)).eos_id == 2
  assert dataclasses.replace(base, eos_id=None).eos_id is None
  for bad, match in ((True, r"eos_id=True is invalid \(True not a token id\)"),
                     ((), r"eos_id=\(\) is invalid: must be None, a token id >= 0, or a "
                          r"non-empty list or tuple of them"),
                     ([2, "3"], r"eos_id=\[2, '3'\] is invalid \('3' not a token id\)"),
                     (-1, r"eos_id=-1 is invalid \(-1 not a token id\)")):
    with pytest.raises(ConfigError, match=match):
      dataclasses.replace(base, eos_id=bad)


def test_grad_norms_of_the_trunk_and_the_heads_make_up_the_total(two_eos_step):
  _, metrics, _, _ = two_eos_step
  total, trunk, heads = (float(metrics[k]) for k in
                         ("grad_norm", "grad_norm_trunk", "grad_norm_heads"))
  assert trunk > 0 and heads > 0  # the policy loss reaches the trunk, the drafter loss the heads
  np.testing.assert_allclose(np.hypot(trunk, heads), total, rtol=1e-5)


def test_grad_norms_are_float32_and_omit_the_heads_when_the_model_has_none():
  grads = {"embed": jnp.full((3, 4), 1e-3, jnp.bfloat16),
           "layers": [{"w": jnp.full((256, 256), 1e-2, jnp.bfloat16)}],
           "mtp": [{"proj": jnp.full((2,), 3.0, jnp.bfloat16)}]}
  norms = updates._grad_norms(grads)
  trunk = np.sqrt(12 * np.float64(np.float32(jnp.bfloat16(1e-3))) ** 2
                  + 256 * 256 * np.float64(np.float32(jnp.bfloat16(1e-2))) ** 2)
  np.testing.assert_allclose(norms["grad_norm_trunk"], trunk, rtol=1e-6)
  np.testing.assert_allclose(norms["grad_norm_heads"], np.sqrt(18.0), rtol=1e-6)
  np.testing.assert_allclose(norms["grad_norm"], np.hypot(trunk, np.sqrt(18.0)), rtol=1e-6)
  assert all(v.dtype == jnp.float32 for v in norms.values())
  without = updates._grad_norms({k: v for k, v in grads.items() if k != "mtp"})
  assert set(without) == {"grad_norm", "grad_norm_trunk"}


def test_async_step_updates_on_the_rollout_generated_one_step_earlier():
  config = _config(async_mode=True)
  optimizer = optax.adam(1e-3)
  state = init_train_state(config, init_params(MODEL, jax.random.key(0)), optimizer, 1)
  reader = _reader()
  state = make_prime_fn(config, TASK.reward, pad_id=TOK.pad_id)(state, reader.batch_at(0))
  step = make_train_step(config, TASK.reward, optimizer, pad_id=TOK.pad_id)
  for i in range(3):
    pending_reward = float(state.pending.rewards.mean())
    pending_tokens = int(state.pending.lengths.sum())
    state, metrics = step(state, reader.batch_at(4 * (i + 1)))
    assert float(metrics["reward_mean"]) == pytest.approx(pending_reward)
    assert int(metrics["rollout_tokens"]) == pending_tokens
  assert step._cache_size() == 1


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_split_mode_with_a_python_reward_matches_the_fused_step(fused_run):
  config = _config()

  def python_reward(responses, lengths, batch):  # _ended_reward on the host
    return [float(n > 0 and int(responses[i, n - 1]) == TOK.eos_id)
            for i, n in enumerate(lengths)]

  optimizer = optax.adam(1e-3)
  fused, fused_params = fused_run["history"][:3], fused_run["params_at_3"]
  split_state, split, _ = _run(config, 3, make_split_step(config, python_reward, optimizer,
                                                          pad_id=TOK.pad_id))
  assert len(fused) == len(split) == 3
  for f, s in zip(fused, split):
    for key in ("reward_mean", "loss", "mtp_ce", "response_length_mean"):
      np.testing.assert_allclose(f[key], s[key], rtol=1e-5, atol=1e-6, err_msg=key)
  for a, b in zip(jax.tree.leaves(fused_params), jax.tree.leaves(split_state.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # beside its sync sibling: keeps the README's tests under 10 minutes
def test_async_split_mode_with_a_python_reward_matches_the_fused_async_step():
  """A Python reward in async mode: the host scores rollout t while the device runs the
  update on rollout t - 1; the same keys, samples, losses and parameters as the fused async
  step with the JAX reward that computes the same thing."""
  config = _config(async_mode=True)
  optimizer = optax.adam(1e-3)
  reader = _reader()

  def python_reward(responses, lengths, batch):  # _ended_reward on the host
    return [float(n > 0 and int(responses[i, n - 1]) == TOK.eos_id)
            for i, n in enumerate(lengths)]

  runs = {}
  split = make_split_step(config, python_reward, optimizer, pad_id=TOK.pad_id)
  for name, prime, step in (
      ("fused", make_prime_fn(config, _ended_reward, pad_id=TOK.pad_id),
       make_train_step(config, _ended_reward, optimizer, pad_id=TOK.pad_id)),
      ("split", split.prime, split)):
    state = init_train_state(config, init_params(MODEL, jax.random.key(0)), optimizer, 1)
    state = prime(state, reader.batch_at(0))
    history = []
    for i in range(3):
      state, metrics = step(state, reader.batch_at(4 * (i + 1)))
      history.append(jax.tree.map(np.asarray, metrics))
    runs[name] = getattr(step, "settled", lambda s: s)(state), history
  for f, s in zip(runs["fused"][1], runs["split"][1]):
    for key in ("reward_mean", "loss", "kl", "mtp_ce", "response_length_mean"):
      np.testing.assert_allclose(f[key], s[key], rtol=1e-6, atol=1e-6, err_msg=key)
  fused, split = runs["fused"][0], runs["split"][0]
  for a, b in zip(jax.tree.leaves((fused.params, fused.pending)),
                  jax.tree.leaves((split.params, split.pending))):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def _on_mesh(config, steps):
  """`_run` of `config`'s fused step on a 2 x 2 x 2 mesh of the 8 fake devices."""
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  optimizer = optax.adam(1e-3)
  params = init_params(MODEL, jax.random.key(0))
  start = init_train_state(config, params, optimizer, seed=1)
  p_shard = sharding.param_shardings(MODEL, mesh)
  state_shard = start.replace(
      params=p_shard, ref_params=p_shard,
      opt_state=sharding.opt_state_shardings(start.opt_state, params, p_shard),
      step=sharding.replicated(mesh), key=sharding.replicated(mesh))
  batch_shard = jax.tree.map(lambda x: sharding.batch_sharding(mesh, x.ndim),
                             _reader().batch_at(0))
  step = make_train_step(config, _ended_reward, optimizer, pad_id=TOK.pad_id,
                         state_sharding=state_shard, batch_sharding=batch_shard)
  return _run(config, steps, step, jax.device_put(start, state_shard))


# Both slow (a minute on 2 cores); the decode loop's compaction is checked in the fast tier.
@pytest.mark.parametrize("devices", [pytest.param(1, marks=pytest.mark.slow),
                                     pytest.param(8, marks=pytest.mark.slow)])
def test_greedy_rollouts_that_compact_their_batch_train_identically(devices):
  """Compaction gathers the live rows into smaller batches as rows finish, inside the fused
  step: greedy, the responses, rewards and the update are those of the full-batch rollout, on
  one device and on a 2 x 2 x 2 mesh (whose rows the gather crosses). Each is compared with
  the full batch on the same devices: across device counts, float sums in another order may
  flip a near-tie of a later greedy step."""
  greedy = SamplingConfig(0.0)
  full, compact = (_config(greedy, compaction=c, max_new_tokens=12) for c in (0, 2))
  run = _run if devices == 1 else _on_mesh
  full_state, full_history, _ = run(full, 2)
  lengths = np.asarray([h["response_length_mean"] for h in full_history])
  assert np.all(lengths < 12), lengths  # rows end early: the batch really compacts
  state, history, _ = run(compact, 2)
  for a, b in zip(full_history, history):
    for key in ("reward_mean", "response_length_mean", "rollout_tokens", "loss", "kl",
                "mtp_ce", "acceptance_length"):
      np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)
  for a, b in zip(jax.tree.leaves(full_state.params), jax.tree.leaves(state.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fused_step_on_8_devices_gives_the_single_device_metrics():
  config = _config(grpo=GRPOConfig(group_size=4, beta=0.05))
  _, single, _ = _run(config, 2)
  sharded_state, sharded, _ = _on_mesh(config, 2)
  wq = sharded_state.params["layers"][0]["wq"].sharding
  assert wq == sharding.param_shardings(MODEL, wq.mesh)["layers"][0]["wq"]
  for a, b in zip(single, sharded):
    for key in ("reward_mean", "loss", "kl", "mtp_ce", "entropy", "response_length_mean"):
      np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-5, err_msg=key)


def test_corrupt_checkpoint_is_reported_and_nothing_is_deleted(tmp_path):
  ckpt = Checkpointer(tmp_path / "ckpt")
  state = {"w": jnp.arange(4.0)}
  ckpt.save(3, state, {"step": 3})
  ckpt.close()
  files = sorted(p for p in (tmp_path / "ckpt").rglob("*") if p.is_file())
  for f in files:  # scribble over every data file
    f.write_bytes(b"not a checkpoint")
  # The digest check finds it (the manifest is scribbled over too) ...
  with pytest.raises(CheckpointError, match="step 3 .* is corrupted"):
    Checkpointer(tmp_path / "ckpt").restore(state)
  assert sorted(p for p in (tmp_path / "ckpt").rglob("*") if p.is_file()) == files
  # ... and orbax's own error is reported too for a step written before digests existed.
  for f in (tmp_path / "ckpt").rglob(DIGEST_FILE):
    f.unlink()
  files = sorted(p for p in (tmp_path / "ckpt").rglob("*") if p.is_file())
  with pytest.raises(CheckpointError, match="step 3 .* cannot be restored"), \
       pytest.warns(UserWarning, match="cannot be verified"):
    Checkpointer(tmp_path / "ckpt").restore(state)
  assert sorted(p for p in (tmp_path / "ckpt").rglob("*") if p.is_file()) == files


TRAIN_ARGS = ["--steps", "12", "--checkpoint.every", "2", "--warm-start.steps", "5",
              "--warm-start.batch", "8", "--rollout.prompts-per-step", "4",
              "--grpo.group-size", "4", "--eval.prompts", "8", "--eval.speedup-repeats", "1",
              "--eval.speedup-seconds", "0",
              "--model.d-model", "32", "--model.mlp-dim", "64",
              "--model.n-layers", "1", "--model.head-dim", "16", "--model.n-heads", "2",
              "--model.n-kv-heads", "2"]


README_DEMO = ROOT / "configs" / "arithmetic_worked.py"  # the README's first command


def test_the_readme_demo_runs_long_responses_with_adaptive_mtp_rollouts():
  """The demo's task is one on which speculation can pay (responses of 24 tokens or more on
  average, fitting its token budget and cache) and its rollouts choose their trees."""
  config = runpy.run_path(str(README_DEMO))["get_config"]()
  lengths = [len(e.reference) + 1 for e in config.task.examples("train")]  # + EOS
  assert np.mean(lengths) >= 24 and max(lengths) <= config.rollout.max_new_tokens
  assert config.rollout.speculation == "adaptive" and config.drafter.name == "mtp"
  menu = config.adaptive().menu
  prompt = max(len(encode_prompt(config.task.tokenizer, e.prompt))
               for split in ("train", "test") for e in config.task.examples(split))
  assert prompt + config.rollout.max_new_tokens + max(t.num_nodes for t in menu) + 1 <= (
      config.model.max_position)
  first = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].splitlines()[0]
  assert f"specjax train --config configs/{README_DEMO.name}" in first


def _train(run_dir, compiled, extra=(), **popen):
  """Start `specjax train` on the README's demo config in a subprocess; its programs are
  cached in and read from the directory `compiled`, so a run after the first loads them
  instead of compiling again."""
  cmd = [sys.executable, "-m", "specjax.cli", "train", "--config", str(README_DEMO),
         "--run-dir", str(run_dir),
         *TRAIN_ARGS, *extra]
  env = child_env(JAX_COMPILATION_CACHE_DIR=str(compiled),
                  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, **popen)


def _metrics(run_dir):
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  drop = ("step_time_s", "rollout_tokens_per_s")
  return [{k: v for k, v in r.items() if k not in drop} for r in rows]


def _wait_for_steps(run, run_dir, steps, timeout=300):
  """Wait until `run` has logged `steps` steps in `run_dir`; it must not exit before."""
  metrics = run_dir / "metrics.jsonl"
  deadline = time.time() + timeout
  while time.time() < deadline:
    if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
      return
    assert run.poll() is None, run.stdout.read()
    time.sleep(0.02)
  raise AssertionError(f"{run_dir} logged fewer than {steps} steps in {timeout} s")


@pytest.mark.slow
def test_kill_9_then_resume_reproduces_the_uninterrupted_run(tmp_path):
  compiled = tmp_path / "compiled"
  full = _train(tmp_path / "full", compiled)
  # Once the full run has logged a step it has compiled (and cached) every program a run
  # needs up to its training steps: the run to kill then loads them rather than compiling
  # them a second time on the same cores.
  _wait_for_steps(full, tmp_path / "full", 1)
  killed = _train(tmp_path / "killed", compiled)
  # Kill once step 3 is logged: checkpoint 2 is complete and the run is far from step 12.
  _wait_for_steps(killed, tmp_path / "killed", 3)
  killed.send_signal(signal.SIGKILL)
  killed.wait()
  steps = Checkpointer(tmp_path / "killed" / "checkpoints").all_steps()
  assert steps and 2 <= max(steps) < 12, steps  # killed mid-run, after a checkpoint
  resumed = _train(tmp_path / "killed", compiled)
  out, _ = resumed.communicate(timeout=600)
  assert resumed.returncode == 0, out
  assert "resumed from" in out
  full_out, _ = full.communicate(timeout=600)
  assert full.returncode == 0, full_out
  assert _metrics(tmp_path / "killed") == _metrics(tmp_path / "full")


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_grpo_raises_the_reward_of_a_simple_preference():
  """Sign and alignment check of the whole step: reward 1 when the response starts with '7'."""
  seven = TOK.encode("7")[0]
  reward = lambda tokens, lengths, answers: (tokens[:, 0] == seven).astype(jnp.float32)
  config = _config(grpo=GRPOConfig(group_size=8))
  optimizer = optax.adam(1e-2)
  state = init_train_state(config, init_params(MODEL, jax.random.key(0)), optimizer, 1)
  step = make_train_step(config, reward, optimizer, pad_id=TOK.pad_id)
  reader, rewards = _reader(), []
  for i in range(25):
    state, metrics = step(state, reader.batch_at(4 * i))
    rewards.append(float(metrics["reward_mean"]))
  assert np.mean(rewards[:3]) < 0.3 and np.mean(rewards[-3:]) > 0.8, rewards


EAGLE_MODEL = MODEL.replace(n_layers=2, num_mtp_modules=0)


def _eagle_config(drafter_loss_weight, learning_rate, sampling):
  from specjax.decoding import Eagle3Drafter
  from specjax.models import Eagle3Config
  rollout = RolloutConfig(max_new_tokens=TASK.max_answer_tokens, eos_id=TOK.eos_id,
                          sampling=sampling,
                          drafter=Eagle3Drafter(Eagle3Config.for_target(EAGLE_MODEL)),
                          tree=DraftTree.chain(2))
  return TrainConfig(model=EAGLE_MODEL, grpo=GRPOConfig(group_size=4, num_minibatches=2),
                     rollout=rollout,
                     drafter_training=DrafterTraining(drafter_loss_weight, learning_rate, 2))


def _eagle_run(steps, sampling, drafter_loss_weight, learning_rate=3e-3):
  """GRPO with EAGLE-3 rollouts from a random head, trained online unless the weight is 0.

  The random policy's output head is scaled up so that its samples are nearly a function of
  the context (as a trained policy's are), which a head can learn to predict.
  """
  from specjax.decoding import Eagle3Weights
  from specjax.models import init_eagle3
  config = _eagle_config(drafter_loss_weight, learning_rate, sampling)
  optimizer = optax.adam(1e-3)
  head = Eagle3Weights(params=init_eagle3(config.eagle3.config, jax.random.key(5)),
                       d2t=jnp.arange(TOK.vocab_size, dtype=jnp.int32))
  initial = jax.tree.map(np.array, head)  # the step donates the state's buffers
  policy = init_params(EAGLE_MODEL, jax.random.key(0))
  policy["unembed"] = policy["unembed"] * 20.0
  state = init_train_state(config, policy, optimizer, seed=1, drafter_params=head)
  step = make_train_step(config, TASK.reward, optimizer, pad_id=TOK.pad_id)
  reader, history = _reader(8), []
  for i in range(steps):
    state, metrics = step(state, reader.batch_at(8 * i))
    history.append(jax.tree.map(np.asarray, metrics))
  return state, history, step, initial


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_eagle3_head_trains_online_and_no_gradient_reaches_the_policy():
  greedy = SamplingConfig(0.0)  # rollouts then do not depend on the drafter at all
  trained, hist, step, head0 = _eagle_run(3, greedy, 1.0)
  frozen, frozen_hist, _, _ = _eagle_run(3, greedy, 0.0)
  assert step._cache_size() == 1
  for a, b in zip(jax.tree.leaves(trained.params), jax.tree.leaves(frozen.params)):
    np.testing.assert_array_equal(a, b)
  moved = [not np.allclose(a, b) for a, b in zip(jax.tree.leaves(trained.drafter.weights.params),
                                                 jax.tree.leaves(head0.params))]
  assert all(moved)
  for a, b in zip(jax.tree.leaves(frozen.drafter.weights.params), jax.tree.leaves(head0.params)):
    np.testing.assert_array_equal(a, b)
  assert hist[-1]["eagle3_ce"].shape == (2,) and np.all(np.isfinite(hist[-1]["eagle3_ce"]))
  assert hist[-1]["eagle3_ce"][0] < hist[0]["eagle3_ce"][0]
  assert "eagle3_ce" not in frozen_hist[-1]


@pytest.mark.slow  # six compiled programs
def test_group_drafting_in_front_of_an_eagle3_head_trains_as_plain_decoding():
  """Issue 57: `FallbackDrafter(GroupDrafter, Eagle3Drafter)` ("group+eagle3") in the fused
  and split steps: the head lives in the train state and trains online as a lone head does,
  the group drafts where a sibling wrote ahead, and greedy rollouts are plain decoding's
  token for token, so both steps train exactly as plain rollouts do."""
  from specjax.decoding import Eagle3Drafter, Eagle3Weights, GroupDrafter
  from specjax.models import Eagle3Config, init_eagle3
  greedy = SamplingConfig(0.0)
  eagle = Eagle3Drafter(Eagle3Config.for_target(EAGLE_MODEL))

  def config(drafter):
    rollout = RolloutConfig(max_new_tokens=TASK.max_answer_tokens, eos_id=TOK.eos_id,
                            sampling=greedy, drafter=drafter,
                            tree=None if drafter is None else DraftTree.chain(2))
    return TrainConfig(model=EAGLE_MODEL, grpo=GRPOConfig(group_size=4, num_minibatches=2),
                       rollout=rollout, drafter_training=DrafterTraining(1.0, 3e-3, 2))

  both = config(FallbackDrafter(GroupDrafter(group_size=4), eagle))
  assert both.eagle3 == eagle
  optimizer = optax.adam(1e-3)
  policy = init_params(EAGLE_MODEL, jax.random.key(0))
  policy["unembed"] = policy["unembed"] * 20.0  # near-deterministic answers: groups repeat
  jax_reward = lambda responses, lengths, answers: lengths / TASK.max_answer_tokens
  python_reward = lambda responses, lengths, batch: (np.asarray(lengths, np.float32)
                                                     / TASK.max_answer_tokens)
  runs = {}
  for name, cfg, make in (
      ("plain", config(None), lambda c: make_train_step(c, jax_reward, optimizer,
                                                        pad_id=TOK.pad_id)),
      ("fused", both, lambda c: make_train_step(c, jax_reward, optimizer, pad_id=TOK.pad_id)),
      ("split", both, lambda c: make_split_step(c, python_reward, optimizer,
                                                pad_id=TOK.pad_id))):
    head = None if cfg.eagle3 is None else Eagle3Weights(
        params=init_eagle3(eagle.config, jax.random.key(5)),
        d2t=jnp.arange(TOK.vocab_size, dtype=jnp.int32))
    state = init_train_state(cfg, jax.tree.map(jnp.copy, policy), optimizer, seed=1,
                             drafter_params=head)
    step, history = make(cfg), []
    for i in range(2):
      state, metrics = step(state, _reader(8).batch_at(8 * i))
      history.append(jax.tree.map(np.asarray, metrics))
    runs[name] = state, history
  for name in ("fused", "split"):
    for p, s in zip(runs["plain"][1], runs[name][1], strict=True):
      for key in ("reward_mean", "loss", "response_length_mean"):
        np.testing.assert_allclose(p[key], s[key], rtol=1e-5, atol=1e-6, err_msg=(name, key))
      assert float(s["plain_share"]) == 0.0  # every round drafted (a fixed chain)
      # Greedy siblings decode in lock step, so the group has no whole draft here (the
      # sampled case, tests/decoding/test_lossless_sampling.py, drafts from both).
      assert "drafted_by_group" in s and float(s["drafted_by_eagle3"]) > 0
      assert np.all(np.isfinite(s["eagle3_ce"]))  # the head trained on the rollouts
    for a, b in zip(jax.tree.leaves(runs["plain"][0].params),
                    jax.tree.leaves(runs[name][0].params), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_online_training_raises_eagle3_acceptance_over_a_frozen_copy():
  """After GRPO with online training, the head drafts the current policy better than the
  head it started from (the frozen copy), on the same prompts, keys and fixed length."""
  from specjax.decoding import generate
  state, hist, _, initial = _eagle_run(12, SamplingConfig(1.0), 1.0, learning_rate=1e-2)
  assert hist[-1]["eagle3_accuracy"][0] > hist[0]["eagle3_accuracy"][0] + 0.3
  batch = _reader(16).batch_at(0)
  rollout = _eagle_config(1.0, 1e-2, SamplingConfig(1.0)).rollout
  accept = {}
  for name, head in (("online", state.drafter.weights),
                     ("frozen", jax.tree.map(jnp.asarray, initial))):
    out = generate(state.params, EAGLE_MODEL, batch.tokens, batch.lengths, jax.random.key(2),
                   max_new_tokens=16, sampling=rollout.sampling, drafter=rollout.drafter,
                   tree=rollout.tree, drafter_params=head)
    accept[name] = float(out.stats.tokens_per_round)
  assert accept["online"] > accept["frozen"] + 0.3, accept


@pytest.mark.slow
def test_eagle3_experiment_runs_resumes_and_reports_its_frozen_copy(tmp_path):
  from specjax.experiments.grpo import run
  from specjax.models import load_eagle3
  base = runpy.run_path(str(ROOT / "configs" / "arithmetic_eagle3.py"))["get_config"]()
  config = override(base, {"run_dir": str(tmp_path), "steps": 2, "warm_start.steps": 20,
                           "drafter.distill_steps": 5, "eval.prompts": 8,
                           "eval.speedup_repeats": 1, "eval.speedup_seconds": 0,
                           "checkpoint.every": 1, "rollout.prompts_per_step": 4})
  logs = []
  summary = run(config, log=logs.append)
  assert "probe_acceptance_after_frozen" in summary and summary["speedup"] > 0
  eagle, head, d2t = load_eagle3(tmp_path / "eagle3", config.model)
  assert eagle == config.eagle3_config() and d2t.shape == (eagle.draft_vocab_size,)
  _, start, _ = load_eagle3(tmp_path / "eagle3_initial", config.model)
  assert not np.allclose(head["fc"], start["fc"])  # trained online, the start kept apart
  resumed_logs = []
  run(dataclasses.replace(config, steps=3), log=resumed_logs.append)
  assert any("resumed from" in line for line in resumed_logs), resumed_logs
  assert not any("distilled" in line for line in resumed_logs)
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


def test_the_step_trains_the_objective_its_config_names(monkeypatch):
  """`GRPOConfig(objective=name)` routes the update through the loss registered as `name`
  (traced only: the routing, not the numbers, is under test)."""
  from support import TOK as SHARED_TOK
  from support import config as shared_config
  from support import initial_state, optimizer, reader, reward

  from specjax.rl import losses, register_objective

  monkeypatch.setattr(losses, "_OBJECTIVES", dict(losses._OBJECTIVES))
  calls = []

  def spy(config, logprobs, *args, **kwargs):
    calls.append(logprobs.shape)
    return losses.grpo_loss(config, logprobs, *args, **kwargs)

  register_objective("spy", spy)
  base = shared_config(async_mode=False)
  cfg = dataclasses.replace(base, grpo=dataclasses.replace(base.grpo, objective="spy"))
  step = make_train_step(cfg, reward, optimizer(), pad_id=SHARED_TOK.pad_id)
  jax.eval_shape(step, initial_state(cfg), reader().batch_at(0))
  rows = reader().batch_at(0).tokens.shape[0] * cfg.grpo.group_size
  assert calls and calls[0][0] == rows // cfg.grpo.num_minibatches, calls  # one minibatch
  with pytest.raises(ConfigError, match="objective='nope' is invalid: allowed one of grpo, spy"):
    GRPOConfig(objective="nope")
  with pytest.raises(ConfigError, match="'grpo' is registered already"):
    register_objective("grpo", spy)


def test_split_step_reports_reward_time_and_carries_the_pending_means():
  """The host's reward time is a metric of every split step; in async mode a step reports the
  reward means of the rollout it trained on (the one scored in the background since the step
  before), and the share of the scoring the device spent on work of its own."""
  config = _config(speculative=False, async_mode=True)
  calls = []

  def python_reward(responses, lengths, batch):
    calls.append(len(calls))
    time.sleep(0.05)
    return np.zeros(len(lengths), np.float32), {"reward_call": float(len(calls) - 1)}

  optimizer = optax.adam(1e-3)
  step = make_split_step(config, python_reward, optimizer, pad_id=TOK.pad_id)
  state = init_train_state(config, init_params(MODEL, jax.random.key(0)), optimizer, 1)
  reader = _reader()
  state = step.prime(state, reader.batch_at(0))
  assert np.isnan(np.asarray(state.pending.rewards)).all()  # being scored
  for i in range(3):
    if i == 1:  # settled, as before a checkpoint: scored, and its means still reported
      state = step.settled(state)
      assert (np.asarray(state.pending.rewards) == 0).all()
    state, metrics = step(state, reader.batch_at(4 * (i + 1)))
    assert metrics["reward_call"] == i  # scored a call before: the prime's, then step 1's
    assert metrics["perf_reward_s"] >= 0.05
    assert 0.0 <= metrics["perf_reward_overlap"] <= 1.0
    assert np.isfinite(metrics["loss"])
  with pytest.raises(ConfigError, match="prime"):
    step(state.replace(pending=None), reader.batch_at(0))


def test_a_reward_that_raises_in_the_background_stops_the_next_step():
  config = _config(speculative=False, async_mode=True)

  def broken(responses, lengths, batch):
    raise ValueError("no answer")

  optimizer = optax.adam(1e-3)
  step = make_split_step(config, broken, optimizer, pad_id=TOK.pad_id)
  state = init_train_state(config, init_params(MODEL, jax.random.key(0)), optimizer, 1)
  state = step.prime(state, _reader().batch_at(0))
  with pytest.raises(ValueError, match="no answer"):
    step.settled(state)


def test_ready_watch_measures_how_long_the_host_waited_with_the_device_idle():
  from specjax.rl.host_scoring import ReadyWatch
  assert ReadyWatch(None).idle(0.0, 1.0) == 1.0  # nothing on the device: idle throughout
  ready = jnp.ones(4)
  watch = ReadyWatch(ready)
  time.sleep(0.2)  # long done before the host starts waiting
  begin = time.perf_counter()
  time.sleep(0.05)
  assert watch.idle(begin, time.perf_counter()) >= 0.05
  slow = jax.jit(lambda x: jax.lax.fori_loop(0, 30, lambda _, y: jnp.tanh(y @ y), x))
  x = jnp.eye(512) * 0.5
  slow(x).block_until_ready()  # compiled
  begin = time.perf_counter()
  watch = ReadyWatch(slow(x))
  assert watch.idle(begin, time.perf_counter()) == 0.0  # still running
