"""Adaptive speculation: the policy's choice against a synthetic cost table, greedy output
equal to plain decoding while the tree changes from round to round (for every drafter that
keeps state), calibration and its disk cache, one executable across calls."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import CyclingPolicy, progression_batch

from specjax.decoding import (AcceptanceCounts, Adaptive, CostTable, DecodeLoop, DraftModelDrafter,
                              DraftTree, MTPDrafter, MedusaDrafter, NGramDrafter, SamplingConfig,
                              calibrate, generate)
from specjax.decoding.drafters.eagle3 import Eagle3Drafter
from specjax.errors import ConfigError
from specjax.models import init_params
from specjax.stragglers import expected_normal_max

GREEDY = SamplingConfig(temperature=0.0)
CHAINS = (DraftTree.chain(1), DraftTree.chain(2), DraftTree.chain(4))


def _counts(policy: Adaptive, alpha: float, rows: float = 1e6) -> AcceptanceCounts:
  """Counts that say: every entry continues from depth d to d + 1 with probability alpha."""
  shape = (len(policy.menu), policy.depth)
  return AcceptanceCounts(reached=jnp.full(shape, rows), hits=jnp.full(shape, alpha * rows),
                          rounds=jnp.zeros((), jnp.int32))


def test_expected_tokens_follow_the_acceptance_per_depth():
  policy = Adaptive(CHAINS)
  e = np.asarray(policy.expected_tokens(_counts(policy, 0.5)))
  np.testing.assert_allclose(e, [1.0, 1.5, 1.75, 1.9375], rtol=1e-5)
  # No evidence: the prior everywhere.
  e0 = np.asarray(policy.expected_tokens(AcceptanceCounts.zeros(4, 4)))
  np.testing.assert_allclose(e0[2], 1 + 0.9 + 0.81, rtol=1e-5)


@pytest.mark.parametrize("margin", [0.0, 0.25])
@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0])
def test_the_policy_never_picks_an_entry_that_costs_more_than_it_brings(alpha, margin):
  rng = np.random.default_rng(int(alpha * 10))
  policy = Adaptive(CHAINS, cost_margin=margin)
  for _ in range(20):
    seconds = np.sort(rng.uniform(1.0, 4.0, size=4))  # deeper trees cost more
    costs = CostTable(batches=(8,), seconds=tuple((float(x),) for x in seconds))
    policy = policy.with_costs(costs)
    counts = _counts(policy, alpha)
    choice = int(policy.choose(counts, 8))
    weighed = seconds * np.array([1.0] + [1.0 + margin] * 3)  # drafting entries' margin
    rate = np.asarray(policy.expected_tokens(counts)) / weighed
    assert rate[choice] == rate.max()
    # Never worse than plain decoding; with a margin, better by at least the margin.
    assert rate[choice] * weighed[choice] / seconds[choice] >= (
        (1.0 + margin) / seconds[0] if choice else 1.0 / seconds[0])
  if alpha == 0.0:
    assert choice == 0


def test_a_tree_must_beat_plain_decoding_by_the_cost_margin_to_run():
  # chain2 at a = 0.9 emits 2.71 tokens for 2.26 s: 1.2x plain decoding's 1 token a second.
  costs = CostTable((4,), ((1.0,), (2.71 / 1.2,)))
  menu = (DraftTree.chain(2),)
  counts = _counts(Adaptive(menu), 0.9)
  assert int(Adaptive(menu, costs=costs, cost_margin=0.0).choose(counts, 4)) == 1
  assert int(Adaptive(menu, costs=costs).choose(counts, 4)) == 1  # the default 10%
  assert int(Adaptive(menu, costs=costs, cost_margin=0.25).choose(counts, 4)) == 0
  assert Adaptive(menu, costs=costs, cost_margin=0.25).plain_throughout((4,))
  with pytest.raises(ConfigError, match="cost_margin"):
    Adaptive(menu, cost_margin=-0.1)


def test_the_expected_maximum_of_normals_matches_its_closed_forms():
  z = expected_normal_max(16)
  # E max of 2 and 3 standard normals: 1/sqrt(pi) and 3/(2 sqrt(pi)); 16: 1.7660 (tables).
  np.testing.assert_allclose(z[:4], [0.0, 0.0, 1 / np.sqrt(np.pi), 1.5 / np.sqrt(np.pi)],
                             atol=1e-6)
  np.testing.assert_allclose(z[16], 1.7660, atol=2e-4)
  assert (np.diff(z[1:]) > 0).all()


def test_the_token_variance_of_a_round_is_that_of_the_accepted_drafts():
  policy = Adaptive((DraftTree.chain(2),))
  # a = 0.5 at each depth: K = 0, 1, 2 drafts accepted with probability 1/2, 1/4, 1/4.
  var = np.asarray(policy.token_variance(_counts(policy, 0.5)))
  k, p = np.array([0, 1, 2]), np.array([0.5, 0.25, 0.25])
  np.testing.assert_allclose(var, [0.0, (p * k * k).sum() - (p * k).sum() ** 2], rtol=1e-5)


def test_stragglers_tip_a_marginal_tree_to_plain_decoding_until_few_rows_are_left():
  # chain1 at a = 0.5 emits 1.5 tokens (variance 1/4) for 1.5 / 1.05 s: 5% more tokens per
  # second than plain decoding for the mean row. With 16 rows needing 96 tokens each, the
  # slowest of them advances 1 / (1 + 1.766 sqrt(0.25 / (96 * 1.5))) = 0.931 as fast: a loss.
  costs = CostTable((16,), ((1.0,), (1.5 / 1.05,)))
  policy = Adaptive((DraftTree.chain(1),), costs=costs, cost_margin=0.0)
  counts = _counts(policy, 0.5)
  rates = np.asarray(policy.rates(counts, 16, jnp.int32(16), jnp.float32(96.0)))
  np.testing.assert_allclose(rates[1], 1.05 / (1 + 1.76599 * np.sqrt(0.25 / 144)), rtol=1e-4)
  assert int(policy.choose(counts, 16)) == 1  # no progress given: the mean row
  assert int(policy.choose(counts, 16, jnp.int32(16), jnp.float32(96.0))) == 0
  assert int(policy.choose(counts, 16, jnp.int32(1), jnp.float32(96.0))) == 1  # one row left
  assert int(policy.choose(counts, 16, jnp.int32(16), jnp.float32(5000.0))) == 1
  strict = dataclasses.replace(policy, switch_margin=0.0)  # 0.978 is within the 5% margin
  assert not bool(strict.keeps(1, counts, 16, jnp.int32(16), jnp.float32(96.0)))
  # Before the call, at the prior: chain1's 1.9 tokens (variance 0.09) for 1.43 s pay at
  # batch 16 over 96 tokens (1.25x plain, stragglers' 4% off), not for 1.85 s over 8 tokens.
  assert not policy.plain_throughout((16,), new_tokens=96)
  dear = policy.with_costs(CostTable((16,), ((1.0,), (1.85,)), alone=(1.0,)))
  assert not dear.plain_throughout((16,))  # 1.9 / 1.85 > 1 for the mean row
  assert dear.plain_throughout((16,), new_tokens=8)


def test_the_choice_moves_with_acceptance_and_with_the_batch_size():
  # Verify cost barely grows with depth at 1 row, steeply at 64 (a compute-bound device).
  costs = CostTable(batches=(1, 64), seconds=((1.0, 4.0), (1.1, 8.0), (1.2, 12.0),
                                              (1.4, 20.0)))
  policy = Adaptive(CHAINS, costs=costs)
  assert int(policy.choose(_counts(policy, 0.9), 1)) == 3
  assert int(policy.choose(_counts(policy, 0.9), 64)) == 0
  assert int(policy.choose(_counts(policy, 0.05), 1)) == 0
  np.testing.assert_allclose(costs.at(32), [1.0 + 3.0 * 31 / 63, 1.1 + 6.9 * 31 / 63,
                                            1.2 + 10.8 * 31 / 63, 1.4 + 18.6 * 31 / 63])
  np.testing.assert_allclose(costs.at(128), np.array([4.0, 8.0, 12.0, 20.0]) * 2)


def test_the_running_entry_keeps_its_place_within_the_switch_margin():
  costs = CostTable((4,), ((1.0,), (1.0,), (1.35,), (3.0,)))
  policy = Adaptive(CHAINS, costs=costs)
  counts = _counts(policy, 0.5)  # E = 1, 1.5, 1.75, 1.94: rates 1.0, 1.5, 1.30, 0.65
  assert int(policy.choose(counts, 4)) == 1
  assert bool(policy.keeps(1, counts, 4))
  assert not bool(policy.keeps(0, counts, 4)) and not bool(policy.keeps(3, counts, 4))
  close = policy.with_costs(CostTable((4,), ((1.0,), (1.0,), (1.2,), (3.0,))))
  assert int(close.choose(counts, 4)) == 1  # rates 1.5, 1.458: chain2 within 5% of chain1
  assert bool(close.keeps(2, counts, 4))
  strict = dataclasses.replace(close, switch_margin=0.0)
  assert not bool(strict.keeps(2, counts, 4)) and bool(strict.keeps(1, counts, 4))


def test_a_change_of_tree_must_save_what_it_costs_over_the_tokens_still_needed():
  # Without a margin, chain2 (the running entry) loses to chain1 by 1 / 1.167 - 1 / 1.2 =
  # 0.024 s a token (both with the 25% cost margin). A change costs 1 s: it pays only when
  # the rows still need more than ~42 tokens.
  table = CostTable((4,), ((1.0,), (1.0,), (1.2,), (3.0,)), switch=(1.0,))
  policy = Adaptive(CHAINS, costs=table, switch_margin=0.0)
  counts, one_row = _counts(policy, 0.5), jnp.array(1)
  assert int(policy.choose(counts, 4, one_row, jnp.array(100.0))) == 1
  assert bool(policy.keeps(2, counts, 4, one_row, jnp.array(10.0)))
  assert not bool(policy.keeps(2, counts, 4, one_row, jnp.array(100.0)))
  # Free changes, or no count of the tokens left: the rates alone decide.
  free = policy.with_costs(dataclasses.replace(table, switch=(0.0,)))
  assert not bool(free.keeps(2, counts, 4, one_row, jnp.array(10.0)))
  assert not bool(policy.keeps(2, counts, 4))
  assert "change of tree" in table.format(policy.menu)
  with pytest.raises(ConfigError, match="switch"):
    CostTable((4,), ((1.0,),), switch=(-1.0,))


@pytest.mark.parametrize("make,needle", [
    (lambda: Adaptive(()), "non-empty"),
    (lambda: Adaptive((DraftTree.chain(2), DraftTree.chain(2))), "twice"),
    (lambda: Adaptive(CHAINS, prior=1.5), "prior"),
    # Each number field by type as well as range: a string or a bool is named, not compared.
    (lambda: Adaptive(CHAINS, decay="0.9"), r"Adaptive\.decay='0\.9' is invalid: must be a "
                                            r"factor in \(0, 1\]"),
    (lambda: Adaptive(CHAINS, prior_rounds="2"), r"prior_rounds='2' .* row-rounds > 0"),
    (lambda: Adaptive(CHAINS, switch_margin=None), r"switch_margin=None .* \[0, 1\)"),
    (lambda: Adaptive(CHAINS, cost_margin=True), r"cost_margin=True .* \[0, 10\)"),
    (lambda: Adaptive(CHAINS, prior=float("nan")), r"prior=nan .* \(0, 1\)"),
    (lambda: Adaptive(CHAINS, costs=CostTable((1,), ((1.0,),))), "rows for a menu of 4"),
    (lambda: CostTable((4, 2), ((1.0, 1.0),)), "increasing"),
    (lambda: CostTable((1,), ((float("nan"),),)), "finite"),
    (lambda: CostTable((1, 2), ((1.0, 1.0),), alone=(1.0,)), "alone"),
    (lambda: CostTable((1,), ((1.0,),), setup=(-1.0,)), "setup"),
])
def test_bad_policies_raise_clear_errors(make, needle):
  with pytest.raises(ConfigError, match=needle):
    make()


def _prompts():
  tokens = progression_batch(np.random.default_rng(5), 4, 12)
  tokens[1, 7:] = 3
  return jnp.asarray(tokens), jnp.array([12, 7, 5, 9])


def _drafters(m, e):
  return {
      "mtp": (MTPDrafter(), None, (DraftTree.chain(1), DraftTree.from_widths((2, 1, 1)))),
      "eagle3": (Eagle3Drafter(e["config"]), e["weights"],
                 (DraftTree.chain(2), DraftTree.from_widths((2, 2)), DraftTree.chain(5))),
      "draft_model": (DraftModelDrafter(m["draft_config"]), m["draft_params"],
                      (DraftTree.chain(3), DraftTree.from_widths((2, 1)))),
      "medusa": (MedusaDrafter(), None, (DraftTree.chain(1), DraftTree.from_widths((3, 2)))),
      "ngram": (NGramDrafter(), None, (DraftTree.chain(2), DraftTree.chain(4))),
  }


# The fast tier keeps the drafter that compiles quickest; the slow tier runs them all.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  for n in ("mtp", "eagle3", "draft_model", "ngram")] + ["medusa"])
def test_greedy_output_equals_plain_while_the_tree_changes_every_round(
    progression_models, progression_eagle, name):
  m = progression_models
  drafter, drafter_params, menu = _drafters(m, progression_eagle)[name]
  prompts, lengths = _prompts()
  plain = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                   max_new_tokens=30, sampling=GREEDY, eos_id=5)
  policy = CyclingPolicy(menu, costs=CostTable((4,), ((1.0,),) * (len(menu) + 1)))
  spec = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                  max_new_tokens=30, sampling=GREEDY, eos_id=5, drafter=drafter,
                  speculation=policy, drafter_params=drafter_params)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  np.testing.assert_array_equal(spec.lengths, plain.lengths)
  np.testing.assert_allclose(spec.logprobs, plain.logprobs, atol=1e-5)
  rounds = np.asarray(spec.stats.tree_rounds)
  assert rounds.sum() == int(spec.stats.rounds) and (rounds >= 2).all(), rounds
  assert int(spec.stats.segments) == int(spec.stats.rounds)  # a change of tree every round
  assert int(plain.stats.segments) == 0
  if name != "ngram":  # plain rounds in between must not leave the drafter behind
    assert float(spec.stats.tokens_per_round) > 1.5, spec.stats


@pytest.mark.slow
def test_adaptive_calibrates_once_caches_the_table_and_compiles_once(progression_models,
                                                                    tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
  m = progression_models
  prompts, lengths = _prompts()
  kwargs = dict(max_new_tokens=24, sampling=GREEDY, drafter=MTPDrafter(),
                speculation=Adaptive((DraftTree.chain(1), DraftTree.chain(3))))
  plain = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                   max_new_tokens=24, sampling=GREEDY)
  out = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0), **kwargs)
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  files = list((tmp_path / "calibration").glob("*.json"))
  assert len(files) == 1
  # The table generate measured, read back from disk: the same shapes and sampling find it.
  table = calibrate(m["params"], m["config"], MTPDrafter(), kwargs["speculation"],
                    batch_sizes=(4,), prompt_len=12, max_new_tokens=24, sampling=GREEDY)
  assert list((tmp_path / "calibration").glob("*.json")) == files
  assert len(table.seconds) == 3 and all(x > 0 for row in table.seconds for x in row)
  # Nested entries: plain <= chain1 <= chain3, whatever the timing noise did.
  assert table.seconds[0][0] <= table.seconds[1][0] <= table.seconds[2][0], table.seconds
  # What leaving the drafter out costs is measured too: its plain rounds and its prefill.
  assert table.alone[0] > 0 and table.setup[0] >= 0 and table.switch[0] >= 0
  text = table.format(kwargs["speculation"].menu)
  assert "chain3" in text and "no drafter" in text and "drafter prefill" in text
  before = DecodeLoop.__call__._cache_size()
  for seed in range(2):  # the same table from disk: the same static loop, no new compile
    generate(m["params"], m["config"], prompts, lengths, jax.random.key(seed), **kwargs)
  assert DecodeLoop.__call__._cache_size() == before


@pytest.mark.slow
def test_an_unwritable_calibration_cache_warns_once_and_the_measured_table_is_used(tmp_path):
  """A cache that cannot be written (a read-only or full home; here a path below a file, which
  root cannot write either) costs a warning, not the call: the table is measured in memory."""
  from support import MODEL
  blocked = tmp_path / "a-file"
  blocked.write_text("")
  params = init_params(MODEL, jax.random.key(0))
  measure = lambda: calibrate(params, MODEL, MTPDrafter(), (DraftTree.chain(1),),
                              batch_sizes=(2,), prompt_len=4, max_new_tokens=4, rounds=2,
                              repeats=1, cache_dir=blocked / "cache")
  with pytest.warns(UserWarning, match="cache .*a-file/cache cannot be written"):
    table = measure()
  assert len(table.seconds) == 2 and all(x > 0 for row in table.seconds for x in row)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # once per directory
    measure()


def test_no_entry_is_listed_cheaper_than_an_entry_whose_work_it_does():
  from specjax.decoding.calibrate import _dominance_floor
  menu = (DraftTree.empty(), DraftTree.chain(1), DraftTree.chain(2), DraftTree.chain(4),
          DraftTree.chain(6), DraftTree.from_widths((3, 1)))
  # A noisy batch-1 table (seconds x 1e3, one column per batch): chain2 and chain6 came out
  # cheaper than chain1 and chain4; the (3, 1) tree (3 nodes at depths 1 and 2) cheaper
  # than chain2, which it covers. It does not cover chain4, nor chain4 it.
  noisy = [[10.0, 40.0], [16.0, 60.0], [15.0, 70.0], [21.0, 90.0], [18.0, 80.0], [14.0, 95.0]]
  assert _dominance_floor(menu, noisy) == [
      [10.0, 40.0], [16.0, 60.0], [16.0, 70.0], [21.0, 90.0], [21.0, 90.0], [16.0, 95.0]]


def test_drafting_costs_are_pooled_by_a_fit_in_depth_and_nodes():
  from specjax.decoding.calibrate import _fit_to_work
  menu = (DraftTree.empty(), DraftTree.chain(1), DraftTree.chain(2), DraftTree.chain(4),
          DraftTree.from_widths((3, 1)), DraftTree.chain(6))
  # Costs exactly 5 + 2 depth + 1 node (two batch sizes, the second doubled): kept as they are.
  work = lambda t: 5.0 + 2.0 * t.depth + t.num_nodes
  exact = [[1.0, 2.0]] + [[work(t), 2 * work(t)] for t in menu[1:]]
  np.testing.assert_allclose(_fit_to_work(menu, exact), exact)
  # One entry timed 20% high: pulled back towards the others' line, plain decoding untouched.
  noisy = [list(row) for row in exact]
  noisy[3][0] *= 1.2
  fitted = np.array(_fit_to_work(menu, noisy))
  assert fitted[0, 0] == 1.0
  assert abs(fitted[3, 0] - exact[3][0]) < 0.5 * (noisy[3][0] - exact[3][0])
  np.testing.assert_allclose(fitted[:, 1], np.array(exact)[:, 1])
  # No more drafting entries than the fit's parameters (chains: depth = nodes): as measured.
  two = (DraftTree.empty(), DraftTree.chain(1), DraftTree.chain(3))
  assert _fit_to_work(two, [[1.0], [9.0], [20.0]]) == [[1.0], [9.0], [20.0]]


@pytest.mark.parametrize("costs,expect", [
    # Speculation as cheap as a plain step: the trained MTP stack accepts most drafts, so
    # the deepest chain runs nearly every round.
    pytest.param(((1.0,), (1.0,), (1.0,)), 2, marks=pytest.mark.slow),
    # A chain-3 round as dear as 5 plain steps: no acceptance can pay for it, never tried.
    (((1.0,), (3.0,), (5.0,)), 0),
])
def test_the_loop_runs_what_the_cost_table_makes_worthwhile(progression_models, costs, expect):
  m = progression_models
  prompts, lengths = _prompts()
  policy = Adaptive((DraftTree.chain(1), DraftTree.chain(3)), costs=CostTable((4,), costs))
  plain = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                   max_new_tokens=24, sampling=GREEDY)
  out = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                 max_new_tokens=24, sampling=GREEDY, drafter=MTPDrafter(), speculation=policy)
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  rounds = np.asarray(out.stats.tree_rounds)
  assert rounds[expect] >= rounds.sum() - 1, rounds


def test_the_drafter_is_left_out_unless_it_beats_plain_decoding_without_it():
  menu = (DraftTree.chain(1), DraftTree.chain(3))
  # chain3 at the prior (0.9) emits 3.44 tokens for 3.0 s: 0.87 s per token. That beats a
  # plain round that keeps the drafter in step (1.0 s), not one without a drafter (0.8 s).
  table = dict(batches=(4,), seconds=((1.0,), (2.5,), (3.0,)))
  assert not Adaptive(menu, cost_margin=0.0, costs=CostTable(**table)).plain_throughout((4,))
  assert Adaptive(menu, cost_margin=0.0, costs=CostTable(**table, alone=(0.8,))).plain_throughout((4,))
  # Against 0.9 s alone it pays by 0.03 s a token: by 3 s over 100 tokens, not by 6 s of
  # drafter prefill.
  paying = CostTable(**table, alone=(0.9,), setup=(6.0,))
  assert not Adaptive(menu, cost_margin=0.0, costs=paying).plain_throughout((4,))
  assert not Adaptive(menu, cost_margin=0.0, costs=paying).plain_throughout((4,), new_tokens=1000)
  assert Adaptive(menu, cost_margin=0.0, costs=paying).plain_throughout((4,), new_tokens=100)


def test_the_policy_switches_the_drafter_off_when_plain_decoding_alone_beats_every_tree():
  menu = (DraftTree.chain(1), DraftTree.chain(3))
  table = dict(batches=(4,), seconds=((1.0,), (1.5,), (2.5,)))
  poor, good = _counts(Adaptive(menu), 0.2), _counts(Adaptive(menu), 0.95)
  policy = Adaptive(menu, cost_margin=0.0, costs=CostTable(**table, alone=(0.8,)))
  assert int(policy.choose(poor, 4)) == policy.off == 3  # 1.25 tokens/s alone beat 1.0, 0.8
  assert not bool(policy.keeps(1, poor, 4))
  assert int(policy.choose(good, 4)) == 2  # chain3: 3.71 tokens in 2.5 s
  # Without a measured drafter-free cost, off ties with plain decoding, which comes first.
  assert int(Adaptive(menu, cost_margin=0.0, costs=CostTable(**table)).choose(poor, 4)) == 0


def test_the_drafter_is_switched_off_only_on_enough_evidence():
  # Batch 1: three poor rounds (drafts accepted 0, 1, 0) where the drafter-free round is 1%
  # cheaper than a plain one with the drafter. Off is for the rest of the call, so three
  # rounds must not decide it: plain with the drafter runs, and the tree is tried again.
  menu = (DraftTree.chain(6), DraftTree.chain(8))
  policy = Adaptive(menu, costs=CostTable((1,), ((2.63,), (5.89,), (6.74,)), alone=(2.60,)))
  counts = AcceptanceCounts.zeros(len(policy.menu), policy.depth)
  for entry, accepted in ((1, 0), (1, 1), (2, 0)):
    counts = counts.observe(entry, policy.menu[entry].depth, jnp.array([accepted]),
                            jnp.array([True]), policy.decay)
  assert int(policy.choose(counts, 1)) == 0
  assert int(dataclasses.replace(policy, off_evidence=0.0).choose(counts, 1)) == policy.off
  for _ in range(40):  # plain rounds: the poor evidence decays towards the prior
    counts = counts.observe(0, 0, jnp.array([0]), jnp.array([True]), policy.decay)
    if not bool(policy.keeps(0, counts, 1)):
      break
  assert int(policy.choose(counts, 1)) in (1, 2)
  # The same poor acceptance over 64 rows is evidence enough.
  poor = _counts(policy, 0.05, rows=64.0)
  assert int(policy.choose(poor, 64)) == policy.off, np.asarray(policy.rates(poor, 64))
  with pytest.raises(ConfigError, match="off_evidence"):
    Adaptive(menu, off_evidence=-1.0)


def _ragged_batch_and_plain(m):
  """8 ragged prompts and their greedy plain decoding (40 tokens, EOS 7): an EOS that some
  rows meet early and others late or never, so a compacting batch shrinks 8 -> 4 -> 2."""
  tokens = progression_batch(np.random.default_rng(9), 8, 10)
  prompts, lengths = jnp.asarray(tokens), jnp.array([10, 4, 7, 10, 5, 9, 6, 8])
  plain = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                   max_new_tokens=40, sampling=GREEDY, eos_id=7)
  return prompts, lengths, plain


class _OffAtRoundTwo(Adaptive):
  """chain3 for two rounds, drafter off at the third, then chain3 again (which the loop
  must not follow: the drafter's state is stale once it was switched off)."""

  def choose(self, counts, batch, live=None, remaining=None):
    return jnp.where(counts.rounds == 2, self.off, 1).astype(jnp.int32)

  def keeps(self, entry, counts, batch, live=None, remaining=None):
    return self.choose(counts, batch) == entry


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
@pytest.mark.parametrize("name", ["mtp", "draft_model"])
def test_switching_the_drafter_off_mid_call_stays_exact_and_stays_off(
    progression_models, progression_eagle, name):
  m = progression_models
  drafter, drafter_params, _ = _drafters(m, progression_eagle)[name]
  prompts, lengths, plain = _ragged_batch_and_plain(m)
  policy = _OffAtRoundTwo((DraftTree.chain(3),), costs=CostTable((8,), ((1.0,), (1.0,))))
  # Compaction: the later phases ask the policy again, and it says chain3.
  out = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                 max_new_tokens=40, sampling=GREEDY, eos_id=7, drafter=drafter,
                 drafter_params=drafter_params, compaction=2, speculation=policy)
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  np.testing.assert_array_equal(out.lengths, plain.lengths)
  rounds = np.asarray(out.stats.tree_rounds)
  assert rounds[1] == 2 and rounds[0] == int(out.stats.rounds) - 2 > 0, rounds
  # Once off, the plain rounds run outside the segments' switch (no pass over the caches).
  assert int(out.stats.segments) == 1


def test_counts_that_already_switch_the_drafter_off_run_the_call_without_it(progression_models):
  m = progression_models
  prompts, lengths = _prompts()
  menu = (DraftTree.chain(1), DraftTree.chain(3))
  # At the prior a chain pays at 4 rows, so the call keeps its drafter (decided while
  # tracing); counts of a drafter that accepts nothing switch it off before the first round,
  # plain decoding alone being the cheaper (decided on device).
  policy = Adaptive(menu, costs=CostTable((4,), ((1.0,), (1.2,), (1.5,)), alone=(0.9,)))
  assert not policy.plain_throughout((4,), 24)
  poor = _counts(policy, 0.0, rows=64.0)
  assert int(policy.choose(poor, 4)) == policy.off
  sampling = SamplingConfig(temperature=1.0)
  run = lambda **kw: generate(m["params"], m["config"], prompts, lengths, jax.random.key(3),
                              max_new_tokens=24, sampling=sampling, **kw)
  plain = run()
  out = run(drafter=MTPDrafter(), speculation=policy, acceptance=poor)
  # Plain decoding's very program: its draws, tokens and log-probs.
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  np.testing.assert_allclose(out.logprobs, plain.logprobs, atol=1e-6)
  rounds = int(plain.stats.rounds)
  np.testing.assert_array_equal(out.stats.tree_rounds, [rounds, 0, 0])
  assert int(out.stats.segments) == 0 and int(out.stats.acceptance.rounds) == rounds
  # Rounds without the drafter tell nothing about it: the counts come back as they were
  # (a GRPO run's carry fades them from call to call, and the tree is tried again).
  np.testing.assert_array_equal(out.stats.acceptance.reached, poor.reached)
  np.testing.assert_array_equal(out.stats.acceptance.hits, poor.hits)
  # Counts that favour a chain run it.
  good = run(drafter=MTPDrafter(), speculation=policy, acceptance=_counts(policy, 0.95, 64.0))
  assert int(np.asarray(good.stats.tree_rounds)[1:].sum()) > 0


@pytest.mark.slow
def test_a_call_the_policy_would_run_plain_throughout_runs_without_the_drafter(
    progression_models):
  m = progression_models
  prompts, lengths = _prompts()
  menu = (DraftTree.chain(1), DraftTree.chain(3))
  # Even at the prior acceptance (0.9) no chain pays at 4 rows; one would at 1 row.
  dear = Adaptive(menu, costs=CostTable((1, 4), ((1.0, 1.0), (1.2, 3.0), (1.5, 5.0))))
  assert dear.plain_throughout((4,)) and not dear.plain_throughout((4, 1))
  sampling = SamplingConfig(temperature=1.0)
  plain = generate(m["params"], m["config"], prompts, lengths, jax.random.key(3),
                   max_new_tokens=24, sampling=sampling)
  out = generate(m["params"], m["config"], prompts, lengths, jax.random.key(3),
                 max_new_tokens=24, sampling=sampling, drafter=MTPDrafter(), speculation=dear)
  # The very same program as plain decoding: same draws, same tokens and log-probs.
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  np.testing.assert_allclose(out.logprobs, plain.logprobs, atol=1e-6)
  rounds = int(plain.stats.rounds)
  np.testing.assert_array_equal(out.stats.tree_rounds, [rounds, 0, 0])
  assert out.stats.acceptance.hits.shape == (3, 3) and int(out.stats.acceptance.rounds) == rounds
  assert out.stats.accepted_per_depth.shape == (3,)
  # Counts carried from an earlier call do not bring the drafter back where the prior says
  # no tree pays (a static decision): the call runs plain and returns them unchanged.
  carried = AcceptanceCounts(reached=jnp.full((3, 3), 1e6), hits=jnp.full((3, 3), 1e6),
                             rounds=jnp.full((), 7, jnp.int32))
  out = generate(m["params"], m["config"], prompts, lengths, jax.random.key(3),
                 max_new_tokens=24, sampling=sampling, drafter=MTPDrafter(), speculation=dear,
                 acceptance=carried)
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  np.testing.assert_array_equal(out.stats.acceptance.hits, carried.hits)
  assert int(out.stats.acceptance.rounds) == 7 + rounds
  # Counts of another menu are refused, naming the shape this policy needs.
  with pytest.raises(ConfigError, match=r"menu of 3 entries .* need \(3, 3\)"):
    generate(m["params"], m["config"], prompts, lengths, jax.random.key(3), max_new_tokens=24,
             sampling=sampling, drafter=MTPDrafter(), speculation=dear,
             acceptance=AcceptanceCounts.zeros(2, 3))
  # Where a chain can pay, carried counts that favour one make the policy run it.
  cheap = dear.with_costs(CostTable((4,), ((1.0,), (1.01,), (1.02,))))
  out = generate(m["params"], m["config"], prompts, lengths, jax.random.key(3),
                 max_new_tokens=24, sampling=sampling, drafter=MTPDrafter(), speculation=cheap,
                 acceptance=carried)
  assert int(np.asarray(out.stats.tree_rounds)[1:].sum()) > 0


def test_adaptive_speculation_errors(progression_models):
  m = progression_models
  prompts, lengths = _prompts()
  with pytest.raises(ConfigError, match="not both"):
    generate(m["params"], m["config"], prompts, lengths, jax.random.key(0), max_new_tokens=4,
             drafter=MTPDrafter(), tree=DraftTree.chain(2),
             speculation=Adaptive((DraftTree.chain(1),)))
  with pytest.raises(ConfigError, match="needs a drafter"):
    generate(m["params"], m["config"], prompts, lengths, jax.random.key(0), max_new_tokens=4,
             speculation=Adaptive((DraftTree.chain(1),)))
  with pytest.raises(ConfigError, match="too deep"):
    generate(m["params"], m["config"], prompts, lengths, jax.random.key(0), max_new_tokens=4,
             drafter=MTPDrafter(), speculation=Adaptive((DraftTree.chain(4),)))

  @jax.jit
  def under_jit(params):
    return generate(params, m["config"], prompts, lengths, jax.random.key(0), max_new_tokens=4,
                    drafter=MTPDrafter(), speculation=Adaptive((DraftTree.chain(1),))).tokens
  with pytest.raises(ConfigError, match="under jit"):
    under_jit(m["params"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mtp", "eagle3", "draft_model"])
def test_compacting_the_batch_as_rows_finish_keeps_every_row_exact(
    progression_models, progression_eagle, name):
  m = progression_models
  drafter, drafter_params, menu = _drafters(m, progression_eagle)[name]
  prompts, lengths, plain = _ragged_batch_and_plain(m)
  assert len(set(np.asarray(plain.lengths).tolist())) >= 3, plain.lengths
  policy = CyclingPolicy(menu, costs=CostTable((2, 8), ((1.0, 1.0),) * (len(menu) + 1)))
  # Two halvings with one tree; one halving with the policy, whose every bucket compiles
  # every entry of the menu.
  for kwargs in (dict(tree=menu[-1], compaction=2), dict(speculation=policy, compaction=1)):
    out = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                   max_new_tokens=40, sampling=GREEDY, eos_id=7, drafter=drafter,
                   drafter_params=drafter_params, **kwargs)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.lengths, plain.lengths)
    np.testing.assert_allclose(out.logprobs, plain.logprobs, atol=1e-5)
    assert bool(out.done.all())
  assert DecodeLoop(config=m["config"], max_new_tokens=4, max_len=32,
                    compaction=3).buckets(8) == (8, 4, 2, 1)


@dataclasses.dataclass(frozen=True)
class _Heavy(NGramDrafter):
  """n-gram drafts after a pile of matrix products nothing else in a round comes near."""

  def propose(self, params, config, state, ctx, tree, sampling, key):
    x = jnp.full((256, 256), 1e-3, jnp.float32) + ctx.seq_len[0].astype(jnp.float32)
    for _ in range(40):
      x = jnp.tanh(x @ x)
    proposal, state = super().propose(params, config, state, ctx, tree, sampling, key)
    return proposal.replace(tokens=proposal.tokens + (x[0, 0] > 2.0)), state


def test_round_parts_split_a_round_into_drafting_verify_and_the_engines_rest():
  from support import MODEL

  from specjax.decoding import round_parts
  from specjax.decoding.calibrate import _Echo
  params = init_params(MODEL, jax.random.key(0))
  measure = lambda drafter: round_parts(params, MODEL, drafter, (DraftTree.chain(2),),
                                        batch_sizes=(2,), prompt_len=4, max_new_tokens=6,
                                        rounds=2, repeats=3)
  heavy = measure(_Heavy(max_ngram=2))
  assert heavy.trees == (DraftTree.chain(2),) and heavy.batches == (2,)
  # The drafter is nearly the whole round, so the round is its drafting plus one verify.
  assert heavy.drafting(0, 0) > 0.8 * heavy.round[0][0]
  assert heavy.lean(0, 0) == pytest.approx(1.0, abs=0.2)
  # A drafter that does no work leaves the round to the verify forward and the engine. The
  # parts are tens of microseconds: a busy spell during one of them (a shared CI machine)
  # can swamp it, so up to three measurements are taken; the property must hold in one.
  for _ in range(3):
    idle = measure(_Echo())
    if (idle.drafting(0, 0) < 0.5 * idle.round[0][0]
        and 0 < idle.verify[0][0] < idle.engine[0][0] * 1.5):
      break
  assert idle.drafting(0, 0) < 0.5 * idle.round[0][0], idle
  assert 0 < idle.verify[0][0] < idle.engine[0][0] * 1.5, idle
  assert "chain2" in idle.format() and "lean" in idle.format()
  with pytest.raises(ConfigError, match="at least one drafting tree"):
    round_parts(params, MODEL, _Echo(), (DraftTree.empty(),), batch_sizes=(2,), prompt_len=4,
                max_new_tokens=6)


def test_a_stale_calibration_file_is_replaced_not_returned(tmp_path):
  """A table kept for another menu (a stale entry) used to be measured again on every call,
  and the stale one still returned; the fresh table now replaces it."""
  import json

  from specjax.decoding.calibrate import _keep_first
  path = tmp_path / "table.json"
  stale = CostTable(batches=(2,), seconds=((1.0,),), alone=(1.0,), setup=(0.0,), switch=(0.0,))
  fresh = CostTable(batches=(2,), seconds=((1.0,), (2.0,)), alone=(1.0,), setup=(0.0,),
                    switch=(0.0,))
  fits = lambda table: len(table.seconds) == 2
  path.write_text(json.dumps(dataclasses.asdict(stale)))
  assert _keep_first(path, fresh, fits) == fresh
  assert CostTable(**json.loads(path.read_text())) == fresh
  other = dataclasses.replace(fresh, seconds=((1.5,), (2.5,)))
  assert _keep_first(path, other, fits) == fresh  # a fitting table is kept: the first wins
