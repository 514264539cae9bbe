"""Group drafting (`GroupDrafter`): drafts from the other responses to the same prompt.

Lossless (greedy output equals plain decoding, with and without compaction; the sampled case
is in test_lossless_sampling), what the lookup matches and prefers, and that a row behind its
sibling drafts the sibling's continuation and has it accepted, also after the sibling left a
compacted batch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import progression_batch

from specjax.decoding import (Adaptive, CostTable, DraftModelDrafter, DraftSource, DraftTree,
                              FallbackDrafter, GroupDrafter, MTPDrafter, SamplingConfig,
                              build_drafter, generate)
from specjax.decoding.drafters.base import NoState, RoundResult, TargetFeatures
from specjax.decoding.drafters.fallback import FallbackState
from specjax.decoding.drafters.group import group_lookup
from specjax.decoding.drafters.registry import CONFIDENT_NGRAM
from specjax.errors import ConfigError
from specjax.models import ModelConfig, init_params

GREEDY = SamplingConfig(temperature=0.0)


def _lookup(bank, rows, group_size, n, k, seq=None, seq_len=None):
  bank = jnp.asarray(bank, jnp.int32)
  bank_len = jnp.full((bank.shape[0],), bank.shape[1], jnp.int32)
  rows = jnp.asarray(rows, jnp.int32)
  seq = bank[rows] if seq is None else jnp.asarray(seq, jnp.int32)
  seq_len = bank_len[rows] if seq_len is None else jnp.asarray(seq_len, jnp.int32)
  tokens, drafted = group_lookup(bank, bank_len, rows, group_size, seq, seq_len, n,
                                 DraftTree.chain(k))
  return np.asarray(drafted[:, 0]), np.asarray(tokens), np.asarray(drafted)


def test_a_row_drafts_what_its_sibling_wrote_after_the_same_text():
  # Row 1 ends "... 5 6"; its sibling row 0 wrote "5 6 7 8 9" further on.
  bank = [[1, 5, 6, 7, 8, 9, 2, 2],
          [3, 4, 4, 4, 4, 4, 5, 6]]
  found, tokens, valid = _lookup(bank, [1], 2, n=2, k=3)
  assert found[0] and tokens[0].tolist() == [7, 8, 9] and valid[0].all()
  # Another group's rows are not looked at: alone in its group, row 1 finds nothing.
  found, _, valid = _lookup(bank, [1], 1, n=2, k=3)
  assert not found[0] and not valid.any()


def test_a_sibling_beats_the_row_itself_and_the_aligned_occurrence_wins():
  # Row 0's suffix "4 5" occurs in itself (position 1) and twice in row 1 (positions 1, 5).
  bank = [[9, 4, 5, 0, 0, 0, 4, 5],
          [8, 4, 5, 1, 2, 4, 5, 3]]
  found, tokens, valid = _lookup(bank, [0], 2, n=2, k=1)
  # The sibling's occurrence nearest row 0's own position (6) is at 5: then "3".
  assert found[0] and tokens[0].tolist() == [3]
  found, tokens, _ = _lookup(bank, [0], 1, n=2, k=1)  # no sibling: the row's own match
  assert found[0] and tokens[0].tolist() == [0]


def test_a_match_near_the_end_of_a_text_drafts_only_what_follows_it():
  bank = [[1, 2, 3, 4, 7, 7],
          [0, 0, 0, 0, 2, 3]]
  found, tokens, valid = _lookup(bank, [1], 2, n=2, k=4)
  assert found[0] and tokens[0, :3].tolist() == [4, 7, 7]
  assert valid[0].tolist() == [True, True, True, False]
  bank = [[1, 2, 3, 4],
          [0, 0, 2, 3]]
  found, tokens, valid = _lookup(bank, [1], 2, n=2, k=4)
  assert found[0] and tokens[0, 0] == 4 and valid[0].tolist() == [True, False, False, False]


def test_a_batch_of_partial_groups_looks_only_at_members_that_exist():
  bank = [[1, 2, 3, 4], [5, 6, 1, 2], [1, 2, 9, 9]]  # three rows, groups of 2: {0, 1}, {2}
  found, tokens, _ = _lookup(bank, [1, 2], 2, n=2, k=1)
  assert found.tolist() == [True, False] and tokens[0, 0] == 3


def test_one_pass_over_suffix_lengths_finds_what_trying_each_longest_first_finds():
  """`min_n`: the longest matching suffix of min_n .. n tokens, as a loop over each length
  (longest first, the first that matches anywhere wins) finds it; on random texts of a
  four-token vocabulary, so that matches of every length occur. (Deeper drafts may go on
  along a shorter match that agrees with the path so far, so the first token is compared.)"""
  rng = np.random.default_rng(0)
  chosen = {4: 0, 3: 0, 2: 0, None: 0}  # rows whose longest match has each length
  tree = DraftTree.chain(3)
  for trial in range(20):
    b0, l, g = 6, 24, 3
    bank = jnp.asarray(rng.integers(0, 4, (b0, l)), jnp.int32)
    bank_len = jnp.asarray(rng.integers(0, l + 1, b0), jnp.int32)
    rows = jnp.asarray(rng.choice(b0, 4, replace=False), jnp.int32)
    seq, seq_len = bank[rows], bank_len[rows]
    got_tokens, got = map(np.asarray, group_lookup(bank, bank_len, rows, g, seq, seq_len, 4,
                                                   tree, min_n=2))
    found, first = np.zeros(4, bool), np.zeros(4, np.int32)
    for n in (4, 3, 2):
      cont, ok = map(np.asarray, group_lookup(bank, bank_len, rows, g, seq, seq_len, n, tree))
      take = ok[:, 0] & ~found
      first[take] = cont[take, 0]
      found |= take
      chosen[n] += int(take.sum())
    np.testing.assert_array_equal(got[:, 0], found, err_msg=f"trial {trial}")
    np.testing.assert_array_equal(np.where(found, got_tokens[:, 0], 0),
                                  np.where(found, first, 0), err_msg=f"trial {trial}")
    chosen[None] += int((~found).sum())
  assert min(chosen.values()) > 0, chosen  # every length, and no match, occurred


def _progression(models, rows=4):
  rng = np.random.default_rng(3)
  return jnp.asarray(progression_batch(rng, rows, 10)), jnp.full((rows,), 10)


@pytest.mark.parametrize("with_mtp, compaction", [
    (False, 0),  # the others slow: they keep the README's tests < 10 min
    pytest.param(False, 2, marks=pytest.mark.slow), pytest.param(True, 0, marks=pytest.mark.slow),
    pytest.param(True, 2, marks=pytest.mark.slow)],
    ids=["group-0", "group-2", "group+mtp-0", "group+mtp-2"])
def test_greedy_group_drafting_equals_plain_decoding(progression_models, compaction, with_mtp):
  m = progression_models
  tokens, lengths = _progression(m, 8)
  tokens, lengths = jnp.repeat(tokens, 2, 0), jnp.repeat(lengths, 2, 0)
  lengths = lengths.at[1::2].add(-3)  # each group's second row starts 3 tokens behind
  kwargs = dict(max_new_tokens=20, sampling=GREEDY, eos_id=int(tokens[0, 9]),
                compaction=compaction)
  plain = generate(m["params"], m["config"], tokens, lengths, jax.random.key(0), **kwargs)
  drafter = GroupDrafter(group_size=2)
  if with_mtp:  # MTP drafts (3 modules, chain of 3) where the group has no whole draft
    drafter = FallbackDrafter(drafter, MTPDrafter())
  spec = generate(m["params"], m["config"], tokens, lengths, jax.random.key(0),
                  drafter=drafter, tree=DraftTree.chain(3 if with_mtp else 4), **kwargs)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  np.testing.assert_array_equal(spec.lengths, plain.lengths)
  np.testing.assert_allclose(spec.logprobs, plain.logprobs, atol=1e-5)


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_a_row_behind_its_sibling_has_the_siblings_text_accepted(progression_models):
  """Row 1's prompt is row 0's prompt; row 0's prompt continues with row 1's greedy answer,
  so every draft of row 1 from row 0 is right: greedy, it emits a whole chain per round."""
  m = progression_models
  tokens, lengths = _progression(m, 1)
  answer = generate(m["params"], m["config"], tokens, lengths, jax.random.key(0),
                    max_new_tokens=16, sampling=GREEDY)
  ahead = jnp.concatenate([tokens, answer.tokens], 1)  # prompt + its own answer
  pair = jnp.concatenate([ahead, jnp.pad(tokens, ((0, 0), (0, 16)))], 0)
  pair_lengths = jnp.array([26, 10])
  out = generate(m["params"], m["config"], pair, pair_lengths, jax.random.key(0),
                 max_new_tokens=16, sampling=GREEDY, drafter=GroupDrafter(group_size=2),
                 tree=DraftTree.chain(4))
  np.testing.assert_array_equal(out.tokens[1], answer.tokens[0])
  rounds = np.asarray(out.stats.row_rounds)
  assert rounds[1] <= 16 / 5 + 1, rounds  # 5 tokens a round: 4 drafts + the target's own
  alone = generate(m["params"], m["config"], pair[1:], pair_lengths[1:], jax.random.key(0),
                   max_new_tokens=16, sampling=GREEDY, drafter=GroupDrafter(group_size=1),
                   tree=DraftTree.chain(4))
  assert int(alone.stats.row_rounds[0]) > rounds[1]  # without its sibling it is slower
  # In front of MTP, the group's whole drafts win where they exist: as many tokens a round.
  both = generate(m["params"], m["config"], pair, pair_lengths, jax.random.key(0),
                  max_new_tokens=16, sampling=GREEDY,
                  drafter=FallbackDrafter(GroupDrafter(group_size=2), MTPDrafter()),
                  tree=DraftTree.chain(3))
  np.testing.assert_array_equal(both.tokens[1], answer.tokens[0])
  assert int(both.stats.row_rounds[1]) <= 16 / 4 + 1, both.stats.row_rounds


def test_a_fallback_drafter_counts_the_rounds_each_drafter_drafted(progression_models):
  """Row 1 starts behind its sibling (row 0 continues with row 1's answer): the group drafts
  whole chains for it, MTP the rest; the counts split the row-rounds exactly, also across a
  compaction, and a round that drafted nothing is counted for neither."""
  m = progression_models
  tokens, lengths = _progression(m, 1)
  answer = generate(m["params"], m["config"], tokens, lengths, jax.random.key(0),
                    max_new_tokens=16, sampling=GREEDY)
  pair = jnp.concatenate([jnp.concatenate([tokens, answer.tokens], 1),
                          jnp.pad(tokens, ((0, 0), (0, 16)))], 0)
  out = generate(m["params"], m["config"], pair, jnp.array([26, 10]), jax.random.key(0),
                 max_new_tokens=16, sampling=GREEDY, compaction=1, tree=DraftTree.chain(3),
                 drafter=FallbackDrafter(GroupDrafter(group_size=2), MTPDrafter()))
  counts = {k: int(v) for k, v in out.stats.drafter.items()}
  assert set(counts) == {"group_rounds", "group_tokens", "mtp_rounds", "mtp_tokens"}
  assert counts["group_rounds"] + counts["mtp_rounds"] == int(out.stats.row_rounds.sum())
  assert counts["group_rounds"] >= 3 and counts["group_tokens"] >= 4 * 3  # row 1: whole chains
  # Every emitted token but the prefill's came from one of the two (uncut: >=).
  assert counts["group_tokens"] + counts["mtp_tokens"] >= int(out.lengths.sum()) - 2
  # Under an adaptive policy, plain rounds (each emits one token a row) are counted for
  # neither: a random policy drafts first (the prior) and then decodes plainly.
  config = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                       head_dim=16, mlp_dim=64, max_position=96, num_mtp_modules=2)
  prompts = jnp.asarray(np.repeat(np.random.default_rng(0).integers(0, 16, (3, 8)), 2, 0))
  costs = CostTable(batches=(1, 8), seconds=((0.5, 0.5), (0.7, 0.7), (0.9, 0.9)))
  out = generate(init_params(config, jax.random.key(1)), config, prompts, jnp.full((6,), 8),
                 jax.random.key(0), max_new_tokens=40, sampling=GREEDY, compaction=1,
                 speculation=Adaptive((DraftTree.chain(1), DraftTree.chain(2)), costs=costs,
                                      prior=0.9),
                 drafter=FallbackDrafter(GroupDrafter(group_size=2, min_ngram=1), MTPDrafter()))
  counts = {k: int(v) for k, v in out.stats.drafter.items()}
  drafted = counts["group_rounds"] + counts["mtp_rounds"]
  plain = int(out.stats.row_rounds.sum()) - drafted
  assert drafted > 0 and plain > 0 and int(out.stats.tree_rounds[0]) > 0
  in_drafted = int(out.lengths.sum()) - 6 - plain  # emitted in drafted rounds
  assert in_drafted <= counts["group_tokens"] + counts["mtp_tokens"] <= in_drafted + 6 * 2
  # A plain round (its path is the root alone) leaves the counts as they were.
  fallback = FallbackDrafter(GroupDrafter(), GroupDrafter(min_ngram=1))
  assert fallback.part_names() == ("primary", "fallback")  # two of a kind
  state = FallbackState(primary=NoState(), fallback=NoState(),
                        primary_rows=jnp.array([True, False]), counts=jnp.zeros((2, 2), int))
  result = lambda d: RoundResult(path_tokens=jnp.zeros((2, d + 1), int),
                                 next_tokens=jnp.zeros((2, d + 1), int),
                                 features=TargetFeatures(hidden=None), start=jnp.zeros(2, int),
                                 count=jnp.array([3, 0]))  # row 1 was already done
  assert int(fallback.update(None, None, state, result(0)).counts.sum()) == 0
  stats = fallback.stats(fallback.update(None, None, state, result(2)))
  assert {k: int(v) for k, v in stats.items()} == {
      "primary_rounds": 1, "primary_tokens": 3, "fallback_rounds": 0, "fallback_tokens": 0}
  assert {k: int(v) for k, v in fallback.stats(None).items()} == dict.fromkeys(stats, 0)


def test_a_fallback_drafter_needs_two_deterministic_drafters():
  with pytest.raises(ConfigError, match="primary samples its drafts"):
    FallbackDrafter(DraftModelDrafter(None, sampled=True), MTPDrafter())
  with pytest.raises(ConfigError, match="fallback samples its drafts"):
    FallbackDrafter(GroupDrafter(), MTPDrafter(sampled=True))
  with pytest.raises(ConfigError, match="fallback=None\\) is invalid: must be a Drafter"):
    FallbackDrafter(GroupDrafter(), None)
  drafter, _ = build_drafter("group+mtp", DraftSource(target=None))
  assert isinstance(drafter.primary, GroupDrafter) and isinstance(drafter.fallback, MTPDrafter)
  # Only long matches beat the model's guess (registry.CONFIDENT_NGRAM's measurements).
  assert drafter.primary.min_ngram == CONFIDENT_NGRAM == 6 < drafter.primary.max_ngram


def test_the_group_drafter_is_registered_and_checks_its_settings():
  drafter, params = build_drafter("group", DraftSource(target=None))
  assert isinstance(drafter, GroupDrafter) and params is None and drafter.group_size == 1
  with pytest.raises(ConfigError, match=r"group_size=0\) is invalid"):
    GroupDrafter(group_size=0)
  with pytest.raises(ConfigError, match="need 1 <= min_ngram <= max_ngram"):
    GroupDrafter(min_ngram=3, max_ngram=2)
