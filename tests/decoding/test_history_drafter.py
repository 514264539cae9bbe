"""History drafting (`HistoryDrafter`, `HistoryBank`): earlier responses to a prompt draft it.

Prompt keys ignore padding and tell prompts apart; the bank keeps the latest responses per
prompt and overall exactly as a NumPy model of it does; greedy decoding with any bank equals
plain decoding (with and without compaction, alone and in front of MTP); a prompt answered
before is answered again in whole chains; a bank that is missing is refused by name. The
sampled case is in test_lossless_sampling.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decoding import (DraftSource, DraftTree, FallbackDrafter, MTPDrafter,
                              SamplingConfig, build_drafter, generate)
from specjax.decoding.drafters.history import (HistoryBank, HistoryDrafter, history_drafter,
                                               prompt_keys)
from specjax.errors import ConfigError
from specjax.models import ModelConfig, init_params

GREEDY = SamplingConfig(temperature=0.0)
CONFIG = ModelConfig(vocab_size=12, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                     head_dim=16, mlp_dim=64, max_position=64, num_mtp_modules=2)


def test_a_prompts_key_ignores_its_padding_and_tells_prompts_apart():
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, 50, (2000, 9))
  lengths = rng.integers(1, 10, 2000)
  keys = np.asarray(prompt_keys(jnp.asarray(prompts), jnp.asarray(lengths)))
  padded = np.where(np.arange(16)[None] < lengths[:, None], np.pad(prompts, ((0, 0), (0, 7))),
                    rng.integers(0, 50, (2000, 16)))  # other padding, a wider buffer
  np.testing.assert_array_equal(np.asarray(prompt_keys(jnp.asarray(padded),
                                                       jnp.asarray(lengths))), keys)
  distinct = {tuple(p[:n]) for p, n in zip(prompts, lengths)}
  assert len(set(keys.tolist())) == len(distinct) and (keys != 0).all()
  # A prompt and the same tokens one shorter differ (the length enters the key).
  assert int(prompt_keys(jnp.asarray([[3, 0]]), jnp.asarray([2]))[0]) != int(
      prompt_keys(jnp.asarray([[3, 0]]), jnp.asarray([1]))[0])


class _NumpyBank:
  """The bank's contract, slot by slot, written with Python lists."""

  def __init__(self, slots, per_prompt, recent, width):
    self.s, self.r, self.q, self.w = slots, per_prompt, recent, width
    self.slot = {}  # slot -> (key, [responses, oldest first])
    self.recent = []

  def record(self, keys, responses, lengths, g):
    m = min(g, self.r)
    for i, key in enumerate(keys):
      slot = key % self.s
      old_key, kept = self.slot.get(slot, (None, []))
      kept = kept if old_key == key else []
      news = [list(responses[i * g + j][:min(lengths[i * g + j], self.w)]) for j in range(m)]
      self.slot[slot] = (key, (kept + news)[-self.r:])
    firsts = [list(responses[i * g][:min(lengths[i * g], self.w)]) for i in range(len(keys))]
    self.recent = (self.recent + firsts[-self.q:])[-self.q:] if self.q else []

  def responses_of(self, key):
    got = self.slot.get(key % self.s)
    return sorted(got[1]) if got and got[0] == key else []


def _bank_responses(bank: HistoryBank, key: int) -> list:
  slot = key % bank.keys.shape[0]
  if int(bank.keys[slot]) != key:
    return []
  return sorted(list(np.asarray(bank.tokens[slot, j, :int(bank.lengths[slot, j])]))
                for j in range(bank.tokens.shape[1]) if int(bank.lengths[slot, j]) > 0)


@pytest.mark.parametrize("group_size, per_prompt", [(4, 2), (2, 3)])
def test_the_bank_keeps_the_latest_responses_per_prompt_and_overall(group_size, per_prompt):
  rng = np.random.default_rng(group_size)
  bank = HistoryBank.create(slots=5, per_prompt=per_prompt, recent=3, width=6)
  model = _NumpyBank(5, per_prompt, 3, 6)
  pool = rng.integers(0, 9, (7, 4))  # 7 distinct prompts: some share a slot and evict
  record = jax.jit(lambda bank, *a: bank.record(*a, group_size=group_size))
  for _ in range(12):
    chosen = rng.choice(7, 2, replace=False)  # distinct slots within one batch below
    keys = np.asarray(prompt_keys(jnp.asarray(pool[chosen]), jnp.full((2,), 4)))
    if keys[0] % 5 == keys[1] % 5:
      continue  # two prompts of one batch on one slot: which stays is unspecified
    responses = rng.integers(1, 9, (2 * group_size, 8))
    lengths = rng.integers(0, 9, 2 * group_size)
    bank = record(bank, jnp.asarray(pool[chosen]), jnp.full((2,), 4), jnp.asarray(responses),
                  jnp.asarray(lengths))
    model.record(keys.tolist(), responses, lengths, group_size)
    for key in keys.tolist():
      expected = [r for r in model.responses_of(key) if r]
      assert _bank_responses(bank, key) == sorted(expected)
  recent = [list(np.asarray(bank.recent[j, :int(bank.recent_len[j])]))
            for j in range(3)]
  assert sorted(recent) == sorted(model.recent)


def _prompts(rows=3, length=5):
  rng = np.random.default_rng(7)
  return jnp.asarray(rng.integers(0, CONFIG.vocab_size, (rows, length))), jnp.full((rows,), 5)


def _bank_after(params, prompts, lengths, sampling, group_size, key=1):
  """A bank holding one rollout of `prompts` (each answered `group_size` times)."""
  rows = jnp.repeat(prompts, group_size, 0), jnp.repeat(lengths, group_size, 0)
  out = generate(params, CONFIG, *rows, jax.random.key(key), max_new_tokens=24,
                 sampling=sampling)
  bank = HistoryDrafter().new_bank(24)
  return bank.record(prompts, lengths, out.tokens, out.lengths, group_size), out


@pytest.mark.parametrize("compaction, with_mtp, widths", [
    (0, False, None),  # the others slow: they keep the README's tests < 10 min
    pytest.param(2, False, None, marks=pytest.mark.slow),
    pytest.param(1, True, None, marks=pytest.mark.slow),
    pytest.param(2, False, (3, 2, 1), marks=pytest.mark.slow),
    pytest.param(1, True, (2, 1), marks=pytest.mark.slow)])
def test_greedy_history_drafting_equals_plain_decoding(compaction, with_mtp, widths):
  params = init_params(CONFIG, jax.random.key(0))
  prompts, lengths = _prompts()
  bank, _ = _bank_after(params, prompts, lengths, SamplingConfig(1.0), 2)  # other texts
  rows = jnp.repeat(prompts, 2, 0), jnp.repeat(lengths, 2, 0)
  kwargs = dict(max_new_tokens=24, sampling=GREEDY, eos_id=3, compaction=compaction)
  plain = generate(params, CONFIG, *rows, jax.random.key(0), **kwargs)
  drafter = HistoryDrafter(group_size=2, min_ngram=1)
  if with_mtp:
    drafter = FallbackDrafter(drafter, MTPDrafter())
  tree = (DraftTree.from_widths(widths) if widths
          else DraftTree.chain(2 if with_mtp else 4))
  spec = generate(params, CONFIG, *rows, jax.random.key(0), drafter=drafter, tree=tree,
                  drafter_params=bank, **kwargs)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  np.testing.assert_array_equal(spec.lengths, plain.lengths)
  np.testing.assert_allclose(spec.logprobs, plain.logprobs, atol=1e-5)
  assert float(spec.stats.tokens_per_round) > 1.0  # the bank's texts drafted something


def test_a_prompt_answered_before_is_answered_again_in_whole_chains():
  """Greedy decoding repeats its answer: with the last answer in the bank every round
  emits the whole chain and the target's next token (5 a round), and an empty bank or one
  holding other prompts drafts from the row's own text alone."""
  params = init_params(CONFIG, jax.random.key(0))
  prompts, lengths = _prompts()
  bank, first = _bank_after(params, prompts, lengths, GREEDY, 1)
  kwargs = dict(max_new_tokens=24, sampling=GREEDY, drafter=HistoryDrafter(),
                tree=DraftTree.chain(4))
  again = generate(params, CONFIG, prompts, lengths, jax.random.key(0), drafter_params=bank,
                   **kwargs)
  np.testing.assert_array_equal(again.tokens, first.tokens)
  assert float(again.stats.tokens_per_round) >= 4.5, again.stats.tokens_per_round
  other_prompts = (prompts + 1) % CONFIG.vocab_size
  other_bank, _ = _bank_after(params, other_prompts, lengths, GREEDY, 1)
  for unrelated in (HistoryDrafter().new_bank(24), other_bank.replace(recent_len=jnp.zeros(8,
                                                                        jnp.int32))):
    cold = generate(params, CONFIG, prompts, lengths, jax.random.key(0),
                    drafter_params=unrelated, **kwargs)
    np.testing.assert_array_equal(cold.tokens, first.tokens)
    assert float(cold.stats.tokens_per_round) < float(again.stats.tokens_per_round) - 1


def test_a_history_drafter_given_no_bank_drafts_from_its_group_and_another_thing_is_refused():
  params = init_params(CONFIG, jax.random.key(0))
  prompts, lengths = _prompts()
  kwargs = dict(max_new_tokens=12, sampling=GREEDY, tree=DraftTree.chain(2))
  alone = generate(params, CONFIG, prompts, lengths, jax.random.key(0),
                   drafter=HistoryDrafter(), **kwargs)
  empty = generate(params, CONFIG, prompts, lengths, jax.random.key(0),
                   drafter=HistoryDrafter(), drafter_params=HistoryDrafter().new_bank(12),
                   **kwargs)
  np.testing.assert_array_equal(alone.tokens, empty.tokens)
  np.testing.assert_array_equal(alone.stats.row_rounds, empty.stats.row_rounds)
  with pytest.raises(ConfigError, match=r"HistoryDrafter drafts from earlier responses: pass "
                                        r"drafter_params=<a HistoryBank>.*not dict"):
    generate(params, CONFIG, prompts, lengths, jax.random.key(0), drafter=HistoryDrafter(),
             drafter_params={"tokens": 1}, **kwargs)
  with pytest.raises(ConfigError, match=r"HistoryDrafter\(slots=0\) is invalid"):
    HistoryDrafter(slots=0)
  with pytest.raises(ConfigError, match=r"HistoryBank width=0 is invalid"):
    HistoryBank.create(4, 2, 2, 0)


def test_the_registry_builds_history_and_history_before_mtp():
  drafter, params = build_drafter("history", DraftSource(CONFIG))
  assert isinstance(drafter, HistoryDrafter) and params is None
  both, _ = build_drafter("history+mtp", DraftSource(CONFIG))
  assert isinstance(both, FallbackDrafter) and isinstance(both.fallback, MTPDrafter)
  assert history_drafter(both) is both.primary and history_drafter(MTPDrafter()) is None


def test_a_tree_drafts_the_distinct_continuations_most_supported_first():
  """Five earlier texts continue the row's suffix "5 6": three with "7 8", one with "7 3",
  one with "9 1". A (2, 2) tree drafts 7 then 9 at depth 1 (three votes before one), 8 then
  3 under 7, and 1 alone under 9: its second child has no candidate left, so it is not
  drafted. A chain drafts the majority's path, 7 8."""
  from specjax.decoding.drafters.group import suffix_match
  texts = [[1, 5, 6, 7, 8], [2, 5, 6, 7, 8], [3, 5, 6, 9, 1], [4, 5, 6, 7, 3], [0, 5, 6, 7, 8]]
  cand = jnp.asarray([texts])
  seq, seq_len = jnp.asarray([[8, 5, 6, 0, 0]]), jnp.asarray([3])
  args = (cand, jnp.full((1, 5), 5), jnp.zeros((1, 5), bool), jnp.zeros((1, 5), jnp.int32),
          seq, seq_len, 2)
  tree = DraftTree.from_widths((2, 2))  # nodes: 7, 9 | 7's children, 9's children
  tokens, drafted = map(np.asarray, suffix_match(*args, tree, vote=True))
  assert drafted[0].tolist() == [True, True, True, True, True, False]
  assert tokens[0, :5].tolist() == [7, 9, 8, 3, 1]
  tokens, drafted = map(np.asarray, suffix_match(*args, DraftTree.chain(2), vote=True))
  assert tokens[0].tolist() == [7, 8] and drafted[0].all()


def test_a_vote_drafts_the_continuation_most_earlier_texts_agree_on():
  """Four texts match the row's suffix "5 6" equally long: one of high priority goes on with
  9, three with 7. By priority the draft is 9; by vote it is 7, and priority still breaks a
  tie of votes. A longer match beats any vote."""
  from specjax.decoding.drafters.group import suffix_match
  cand = jnp.asarray([[[1, 5, 6, 9, 0], [2, 5, 6, 7, 0], [3, 5, 6, 7, 0], [4, 5, 6, 7, 0]]])
  seq, seq_len = jnp.asarray([[8, 5, 6, 0, 0]]), jnp.asarray([3])
  one = DraftTree.chain(1)
  args = (cand, jnp.full((1, 4), 4), jnp.zeros((1, 4), bool), jnp.asarray([[3, 0, 0, 0]]),
          seq, seq_len, 2, one)
  assert int(suffix_match(*args)[0][0, 0]) == 9
  assert int(suffix_match(*args, vote=True)[0][0, 0]) == 7
  tie = cand.at[0, 2, 3].set(9).at[0, 3, 3].set(4)  # 9 twice (one of priority 3), 7 once
  assert int(suffix_match(tie, *args[1:], vote=True)[0][0, 0]) == 9
  longer = cand.at[0, 0, 0].set(8)  # "8 5 6" in the first: a match of 3
  assert int(suffix_match(longer, *args[1:6], 3, one, min_n=2, vote=True)[0][0, 0]) == 9
