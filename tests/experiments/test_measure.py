"""What a GRPO run measures beside training: the rollout's arms and its tail."""

import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decoding import AcceptanceCounts, CostTable
from specjax.errors import ConfigError
from specjax.experiments import ExperimentConfig, measure, override
from specjax.experiments.measure import (rollout_arms, rollout_speedup, simulated_speedup,
                                         tail_round_share)
from specjax.models import ModelConfig, init_params
from specjax.rl import ArithmeticTask, encode_prompt
from specjax.timing import interleaved

TASK = ArithmeticTask(max_digits=1, num_operands=2, max_operands=6, operand_decay=0.5,
                      operators="+", worked=True, num_train=64, num_test=16)
MODEL = ModelConfig(vocab_size=TASK.tokenizer.vocab_size, d_model=32, n_layers=1, n_heads=2,
                    n_kv_heads=2, head_dim=16, mlp_dim=64, num_mtp_modules=2, max_position=96)


def _batch(n: int) -> types.SimpleNamespace:
  """The first `n` training prompts, right-padded, as a `PromptReader` batch holds them."""
  prompts = [encode_prompt(TASK.tokenizer, e.prompt) for e in TASK.examples("train")[:n]]
  width = max(map(len, prompts))
  return types.SimpleNamespace(
      tokens=np.array([p + [TASK.tokenizer.pad_id] * (width - len(p)) for p in prompts]),
      lengths=np.array([len(p) for p in prompts]))


@pytest.mark.parametrize("row_rounds,share", [
    ([10, 10, 2, 2, 2, 2, 2, 2], 0.8),  # rounds 2..9: 2 of 8 rows live
    ([10, 9, 8, 2, 2, 2, 2, 2], 0.2),  # rounds 8, 9: 2 or 1 live; round 2..7: 3 live
    ([5, 5, 5, 5], 0.0),
    ([7, 1, 1], 0.0),  # a quarter of 3 rows is none: no round has 0 rows live
])
def test_tail_round_share_counts_rounds_with_a_quarter_of_the_rows_live(row_rounds, share):
  assert tail_round_share(row_rounds) == pytest.approx(share)
  assert tail_round_share(row_rounds, live_fraction=1.0) == 1.0


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_rollout_speedup_reports_three_arms_when_the_rollout_compacts():
  """Plain and speculative decoding both compacted, and plain decoding without compaction,
  from one interleaved measurement."""
  batch = _batch(4)
  params = init_params(MODEL, jax.random.key(0))
  config = override(ExperimentConfig(task=TASK, model=MODEL), {
      "rollout.compaction": 2, "rollout.max_new_tokens": 40, "rollout.temperature": 0.0,
      "drafter.name": "group", "grpo.group_size": 4, "eval.speedup_repeats": 1,
      "eval.speedup_seconds": 0})
  summary = rollout_speedup(params, config, batch)
  assert {"uncompacted_tokens_per_s", "compaction_speedup", "total_speedup"} <= set(summary)
  assert summary["speedup"] > 0 and summary["acceptance_length"] >= 1
  assert 0 <= summary["tail_share"] <= 1
  assert len(summary["response_lengths"]) == 16  # 4 prompts x G = 4, the plain arm's lengths
  assert all(1 <= n <= 40 for n in summary["response_lengths"])
  assert summary["prompt_length"] == pytest.approx(batch.lengths.mean())


def test_rollout_speedup_times_the_arms_it_is_given():
  """A run builds its arms once (timed along training, then at the end): the final
  measurement calls those, compiled already, rather than building and compiling new ones."""
  config = override(ExperimentConfig(task=TASK, model=MODEL), {
      "rollout.max_new_tokens": 8, "drafter.name": "none", "grpo.group_size": 2,
      "eval.speedup_repeats": 1, "eval.speedup_seconds": 0})
  batch = _batch(2)
  built, calls = rollout_arms(config, batch), {}

  def counted(name, arm):
    def call(*args, **kwargs):
      calls[name] = calls.get(name, 0) + 1
      return arm(*args, **kwargs)
    return call

  arms = {name: counted(name, arm) for name, arm in built.items()}
  summary = rollout_speedup(init_params(MODEL, jax.random.key(0)), config, batch, arms=arms)
  assert calls == {"plain": 2, "spec": 2}  # compile, then one repeat each
  assert summary["speedup"] > 0
  # One repeat of a few milliseconds: recorded, and stated as too short to measure.
  assert summary["speedup_repeats"] == 1 and summary["speedup_measured"] is False
  assert measure.speedup_text(summary).startswith("too short to measure (1 repeat(s), ")


def test_a_speedup_is_stated_with_its_spread_and_as_one_when_the_spread_holds_it():
  measured = {"speedup_measured": True, "speedup": 1.02, "speedup_low": 0.91,
              "speedup_high": 1.2, "speedup_repeats": 5, "arm_call_s": 0.3}
  assert measure.speedup_text(measured) == "1.02x (repeats 0.91-1.20), 1.0 within its spread"
  measured |= {"speedup": 1.5, "speedup_low": 1.31, "speedup_high": 1.7}
  assert measure.speedup_text(measured) == "1.50x (repeats 1.31-1.70)"
  few = measured | {"speedup_measured": False, "speedup_repeats": 2, "arm_call_s": 0.004}
  assert measure.speedup_text(few) == (
      "too short to measure (2 repeat(s), 4.0 ms a call; a ratio needs >= 3 repeats and >= "
      "0.2 s in each arm: raise eval.speedup_repeats or eval.speedup_seconds)")


def test_nothing_compiles_inside_the_timed_calls(monkeypatch):
  """The timed call once also summed the response lengths eagerly, whose first use compiled
  inside the first arm's (plain's) first repeat: 20-50x at one repeat."""
  compiled = []

  class Compiles(logging.Handler):
    def emit(self, record):
      if record.getMessage().startswith("Compiling"):
        compiled.append(record.getMessage())

  def watched(fns, repeats, seconds):
    handler = Compiles()
    logging.getLogger("jax").addHandler(handler)
    try:
      with jax.log_compiles():
        return interleaved(fns, repeats, seconds)
    finally:
      logging.getLogger("jax").removeHandler(handler)

  monkeypatch.setattr(measure, "interleaved", watched)
  config = override(ExperimentConfig(task=TASK, model=MODEL), {
      "rollout.max_new_tokens": 8, "drafter.name": "none", "grpo.group_size": 2,
      "eval.speedup_repeats": 1, "eval.speedup_seconds": 0})
  rollout_speedup(init_params(MODEL, jax.random.key(0)), config, _batch(2))
  assert compiled == []


def test_the_summary_reads_each_arm_by_name_whatever_the_dicts_order():
  """Fake arms, each with its own lengths and statistics, given in another order."""
  def arm(length, per_round):
    stats = types.SimpleNamespace(tokens_per_round=per_round, tree_rounds=[3, 1],
                                  row_rounds=[4, 4])
    return lambda params, drafter_params, key, acceptance=None: types.SimpleNamespace(
        lengths=np.full(4, length), stats=stats)
  config = override(ExperimentConfig(task=TASK, model=MODEL), {
      "rollout.compaction": 1, "eval.speedup_repeats": 1, "eval.speedup_seconds": 0})
  arms = {"uncompacted": arm(3, 1.0), "spec": arm(2, 2.5), "plain": arm(1, 1.0)}
  summary = rollout_speedup(None, config, _batch(2), arms=arms)
  assert summary["response_lengths"] == [1, 1, 1, 1]  # plain's
  assert summary["acceptance_length"] == 2.5  # the speculative arm's
  assert summary["plain_share"] == 0.75


@pytest.mark.parametrize("arms", [{}, ["plain", "spec"], {"plain": None}])
def test_rollout_speedup_refuses_arms_that_are_not_rollout_arms(arms):
  config = override(ExperimentConfig(task=TASK, model=MODEL), {"drafter.name": "none"})
  with pytest.raises(ConfigError, match="must be rollout_arms"):
    rollout_speedup(None, config, _batch(2), arms=arms)


def test_the_speculative_arm_starts_from_the_runs_carried_counts():
  """As the run's next rollout would: counts that switch the drafter off make the arm plain
  decoding's own program (same draws); without them it drafts at the prior."""
  config = override(ExperimentConfig(task=TASK, model=MODEL), {
      "rollout.speculation": "adaptive", "rollout.tree_widths": (1, 1),
      "rollout.max_new_tokens": 16, "grpo.group_size": 2})
  # Plain decoding alone is the cheapest round; at the prior (0.9) chain2 still pays.
  costs = CostTable((8,), ((1.0,), (1.2,), (1.5,)), alone=(0.9,))
  arms = rollout_arms(config, _batch(4), costs)
  params = init_params(MODEL, jax.random.key(0))
  shape = (3, 2)  # plain, chain1, chain2; depth 2
  poor = AcceptanceCounts(reached=jnp.full(shape, 64.0), hits=jnp.zeros(shape),
                          rounds=jnp.zeros((), jnp.int32))  # halved by the carry: still enough
  key = jax.random.key(1)
  plain = arms["plain"](params, None, key)
  off = arms["spec"](params, None, key, poor)
  np.testing.assert_array_equal(off.tokens, plain.tokens)
  assert int(np.asarray(off.stats.tree_rounds)[1:].sum()) == 0
  fresh = arms["spec"](params, None, key)
  assert int(np.asarray(fresh.stats.tree_rounds)[1:].sum()) > 0


def test_the_arms_check_their_prompts_once_as_they_are_built():
  """The compiled arms do not check prompt ids call by call: `rollout_arms` checks them."""
  batch = _batch(2)
  batch.tokens[1, 0] = MODEL.vocab_size
  with pytest.raises(ValueError, match=r"prompt_tokens\[1, 0\] = .* is not a token id"):
    rollout_arms(ExperimentConfig(task=TASK, model=MODEL), batch)


def test_simulated_speedup_predicts_the_runs_rollout_on_an_accelerator():
  """The simulator on the run's own shapes: more acceptance never predicts less, the
  adaptive policy never predicts a loss, and a run without a modelled drafter gets nothing."""
  config = override(ExperimentConfig(task=TASK, model=MODEL),
                    {"rollout.tree_widths": (1, 1), "rollout.speculation": "adaptive"})
  lengths = [8] * 120 + [60] * 8  # 16 prompts x G = 8, a long tail
  rates = [simulated_speedup(config, 6.0, lengths, a)["simulated_generation_speedup"]
           for a in (1.0, 2.0, 2.5, 3.0)]
  assert rates[0] == pytest.approx(1.0)  # nothing accepted: the policy decodes plainly
  assert rates == sorted(rates) and rates[-1] > 1.2
  capped = simulated_speedup(config, 6.0, lengths, 7.0)  # a chain of 2 emits at most 3
  assert capped["simulated_acceptance"] == 3.0 and capped["simulated_device"] == "H200"
  assert capped["simulated_generation_speedup"] == pytest.approx(rates[-1])
  fixed = override(config, {"rollout.speculation": "fixed"})
  assert simulated_speedup(fixed, 6.0, lengths, 1.0)["simulated_generation_speedup"] < 1.0
  assert simulated_speedup(override(config, {"drafter.name": "none"}), 6.0, lengths, 3.0) == {}
  huge = override(config, {"model": MODEL.replace(d_model=8192, n_layers=96, n_heads=64,
                                                 n_kv_heads=8, head_dim=128, mlp_dim=32768)})
  with pytest.raises(ConfigError, match="does not fit"):  # grpo.run logs it and ends the run
    simulated_speedup(huge, 6.0, [4096] * 128, 3.0)


def test_the_acceptance_probe_is_clipped_to_the_models_positions_and_named_when_none_fit(
    monkeypatch):
  """The probe generates a fixed 16 tokens: where the longest held-out prompt and the tree
  leave fewer positions it generates what fits; where none fit the error names the probe."""
  from specjax.experiments import measure
  model = MODEL.replace(max_position=24)
  config = override(ExperimentConfig(task=TASK, model=model), {"rollout.tree_widths": (1, 1)})
  asked = []

  def fake_generate(*args, max_new_tokens, **kwargs):
    asked.append(max_new_tokens)
    return types.SimpleNamespace(stats=types.SimpleNamespace(tokens_per_round=1.5))

  monkeypatch.setattr(measure, "generate", fake_generate)
  records = lambda n: [{"prompt": [3] * n, "reference": "", "answer": 0.0}]
  assert measure.probe_acceptance(None, config, records(4)) == 1.5
  assert measure.probe_acceptance(None, config, records(10)) == 1.5
  assert asked == [16, 24 - 10 - 2 - 1]  # prompt + new tokens + 2 tree nodes + 1 slots
  with pytest.raises(ConfigError, match=r"the acceptance probe \(probe_acceptance\) decodes "
                                        r"prompts of 21 tokens with a 2-node draft tree"):
    measure.probe_acceptance(None, config, records(21))
