"""Several end ids (`eos_id=(a, b)`, as Llama-3 style checkpoints list them): a row stops after
the first emitted token that is any of them, speculative decoding included, and one id in a
tuple behaves exactly as the int."""

import jax
import numpy as np
import pytest

from specjax.decoding import (DecodeLoop, DraftTree, MTPDrafter, NGramDrafter, SamplingConfig,
                              generate)
from specjax.errors import ConfigError
from specjax.models import ModelConfig

GREEDY = SamplingConfig(temperature=0.0)
MAX_NEW = 16


def _prompts():
  """Progressions mod 31 (what `progression_models` learnt), lengths 8, 6, 5."""
  tokens = np.array([[(3 + 2 * i) % 31 for i in range(8)],
                     [(10 + i) % 31 for i in range(8)],
                     [(20 + 3 * i) % 31 for i in range(8)]])
  return tokens, np.array([8, 6, 5])


def _generate(models, **kwargs):
  tokens, lengths = _prompts()
  return generate(models["params"], models["config"], tokens, lengths, jax.random.key(0),
                  max_new_tokens=MAX_NEW, sampling=GREEDY, **kwargs)


def _cut_at_first(stream: np.ndarray, ids) -> tuple[np.ndarray, np.ndarray]:
  """Reference in NumPy: each row of a run without EOS, cut after its first id in `ids`."""
  tokens, lengths = np.zeros_like(stream), np.full(stream.shape[0], stream.shape[1])
  for r, row in enumerate(stream):
    hits = np.flatnonzero(np.isin(row, ids))
    n = hits[0] + 1 if hits.size else row.size
    tokens[r, :n], lengths[r] = row[:n], n
  return tokens, lengths


@pytest.fixture(scope="module")
def unstopped(progression_models):
  """Greedy tokens without any end id: `[B, MAX_NEW]`."""
  return np.asarray(_generate(progression_models).tokens)


def _end_ids(unstopped) -> tuple[int, int]:
  """Two ids that end rows at different places: row 0's 7th token and row 1's 3rd."""
  a, b = int(unstopped[0, 6]), int(unstopped[1, 2])
  assert a != b
  return a, b


def test_greedy_stops_at_whichever_end_id_comes_first(progression_models, unstopped):
  ids = _end_ids(unstopped)
  want_tokens, want_lengths = _cut_at_first(unstopped, ids)
  assert len(set(want_lengths.tolist())) > 1, want_lengths  # the ids cut rows differently
  for eos in (ids, ids[::-1], list(ids)):
    out = _generate(progression_models, eos_id=eos)
    np.testing.assert_array_equal(out.lengths, want_lengths)
    np.testing.assert_array_equal(out.tokens, want_tokens)
    np.testing.assert_array_equal(out.done, True)  # ended on an id or at MAX_NEW


def test_one_id_in_a_tuple_equals_the_int(progression_models, unstopped):
  a, _ = _end_ids(unstopped)
  as_int = _generate(progression_models, eos_id=a)
  for eos in ((a,), [a], np.array([a])):
    out = _generate(progression_models, eos_id=eos)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(as_int)):
      np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("drafter,tree", [(MTPDrafter(), DraftTree.chain(3)),
                                          (MTPDrafter(), DraftTree.from_widths((2, 2, 1))),
                                          (NGramDrafter(), DraftTree.chain(4))],
                         ids=["mtp_chain3", "mtp_tree221", "ngram_chain4"])
def test_speculative_decoding_with_several_end_ids_equals_plain(progression_models, unstopped,
                                                                drafter, tree):
  ids = _end_ids(unstopped)
  plain = _generate(progression_models, eos_id=ids)
  spec = _generate(progression_models, eos_id=ids, drafter=drafter, tree=tree)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  np.testing.assert_array_equal(spec.lengths, plain.lengths)
  np.testing.assert_array_equal(spec.done, plain.done)
  want_tokens, want_lengths = _cut_at_first(unstopped, ids)
  np.testing.assert_array_equal(spec.lengths, want_lengths)
  np.testing.assert_array_equal(spec.tokens, want_tokens)


def test_an_end_id_emitted_by_the_prefill_stops_the_row_at_one_token(progression_models,
                                                                     unstopped):
  out = _generate(progression_models, eos_id=(int(unstopped[2, 0]), int(unstopped[0, 6])))
  assert int(out.lengths[2]) == 1 and bool(out.done[2])


CONFIG = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                     head_dim=16, mlp_dim=64, max_position=64)


@pytest.mark.parametrize("eos_id,needle", [
    ((3, 16), r"eos_id=\(3, 16\) is invalid \(16 not a token id\): must be None, a token id "
              r"in \[0, 16\) or a non-empty sequence of them"),
    ([3, -1], r"eos_id=\[3, -1\] is invalid \(-1 not a token id\)"),
    ((2, 2.0), r"\(2\.0 not a token id\)"),
    ((True,), r"\(True not a token id\)"),
    ((), r"eos_id=\(\) is invalid: must be None, a token id in \[0, 16\) or a non-empty"),
    (16, r"eos_id=16 is invalid \(16 not a token id\)"),
])
def test_an_invalid_end_id_is_named(eos_id, needle):
  with pytest.raises(ConfigError, match=needle):
    DecodeLoop(config=CONFIG, max_new_tokens=4, max_len=16, eos_id=eos_id)


def test_a_list_of_end_ids_is_stored_as_a_hashable_tuple_of_ints():
  loop = DecodeLoop(config=CONFIG, max_new_tokens=4, max_len=16, eos_id=[3, np.int64(5)])
  assert loop.eos_id == (3, 5) and all(type(i) is int for i in loop.eos_id)
  assert hash(loop) == hash(DecodeLoop(config=CONFIG, max_new_tokens=4, max_len=16,
                                       eos_id=(3, 5)))
