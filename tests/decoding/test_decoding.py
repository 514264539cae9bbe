"""Speculative decoding engine: greedy equivalence, log-probabilities, compilation, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import progression_batch
from specjax.decoding import (DecodeLoop, DraftModelDrafter, DraftTree, MedusaDrafter,
                              MTPDrafter, NGramDrafter, SamplingConfig, generate)
from specjax.decoding.drafters.ngram import lookup
from specjax.models import ConfigError, forward

GREEDY = SamplingConfig(temperature=0.0)

DRAFTERS = {
    "mtp_chain3": (MTPDrafter(), DraftTree.chain(3)),
    "mtp_tree221": (MTPDrafter(), DraftTree.from_widths((2, 2, 1))),
    "mtp_irregular": (MTPDrafter(), DraftTree.from_parents([0, 0, 0, 1, 1, 4])),
    "medusa_chain2": (MedusaDrafter(), DraftTree.chain(2)),
    "medusa_tree32": (MedusaDrafter(), DraftTree.from_widths((3, 2))),
    "draft_model_chain4": (None, DraftTree.chain(4)),
    "draft_model_tree22": (None, DraftTree.from_widths((2, 2))),
    "ngram_chain4": (NGramDrafter(), DraftTree.chain(4)),
}


def _prompts(models):
  """A ragged batch: lengths 12, 7, 4, 9 (padding is garbage on purpose)."""
  rng = np.random.default_rng(5)
  tokens = progression_batch(rng, 4, 12)
  tokens[1, 7:] = 3
  tokens[2, 4:] = 30
  return jnp.asarray(tokens), jnp.array([12, 7, 4, 9])


def _spec(models, name):
  drafter, tree = DRAFTERS[name]
  kwargs = {}
  if drafter is None:
    drafter = DraftModelDrafter(models["draft_config"])
    kwargs["drafter_params"] = models["draft_params"]
  return drafter, tree, kwargs


# The deepest draft-model chain compiles the longest; the fast tier keeps the others.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n == "draft_model_chain4" else n for n in sorted(DRAFTERS)])
def test_greedy_speculative_output_equals_plain_autoregressive(progression_models, name):
  m = progression_models
  prompts, lengths = _prompts(m)
  plain = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                   max_new_tokens=24, sampling=GREEDY)
  drafter, tree, kwargs = _spec(m, name)
  spec = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                  max_new_tokens=24, sampling=GREEDY, drafter=drafter, tree=tree, **kwargs)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  np.testing.assert_array_equal(spec.lengths, plain.lengths)
  np.testing.assert_allclose(spec.logprobs, plain.logprobs, atol=1e-5)
  assert float(plain.stats.tokens_per_round) == 1.0
  if not name.startswith("ngram"):  # trained drafters must actually speed things up
    assert float(spec.stats.tokens_per_round) > 1.5, spec.stats


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_eos_inside_an_accepted_run_truncates_exactly_like_plain_decoding(progression_models):
  m = progression_models
  prompts, lengths = _prompts(m)
  plain = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                   max_new_tokens=20, sampling=GREEDY)
  # Row 0's 6th token as EOS: with ~4 tokens per round it falls inside an accepted run.
  eos = int(plain.tokens[0, 5])
  plain_eos = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                       max_new_tokens=20, sampling=GREEDY, eos_id=eos)
  spec = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                  max_new_tokens=20, sampling=GREEDY, drafter=MTPDrafter(),
                  tree=DraftTree.chain(3), eos_id=eos)
  n = int(plain_eos.lengths[0])
  assert n <= 6 and int(plain_eos.tokens[0, n - 1]) == eos
  assert float(spec.stats.tokens_per_round) > 2.5  # runs longer than the EOS offset
  np.testing.assert_array_equal(spec.tokens, plain_eos.tokens)
  np.testing.assert_array_equal(spec.lengths, plain_eos.lengths)
  assert bool(spec.done.all())


@pytest.mark.parametrize("sampling", [pytest.param(SamplingConfig(1.0), marks=pytest.mark.slow),
                                      SamplingConfig(0.7, top_k=5, top_p=0.9)])
def test_returned_logprobs_equal_target_log_softmax_at_emitted_tokens(progression_models,
                                                                      sampling):
  m = progression_models
  prompts, lengths = _prompts(m)
  out = generate(m["params"], m["config"], prompts, lengths, jax.random.key(1),
                 max_new_tokens=16, sampling=sampling, drafter=MTPDrafter(sampled=True),
                 tree=DraftTree.from_widths((2, 1)))
  for b in range(prompts.shape[0]):
    n, p = int(out.lengths[b]), int(lengths[b])
    seq = jnp.concatenate([prompts[b, :p], out.tokens[b, :n]])[None]
    logits = forward(m["params"], m["config"], seq, jnp.arange(seq.shape[1])[None]).logits[0]
    ref = jax.nn.log_softmax(logits[p - 1:p - 1 + n] / sampling.temperature, -1)
    ref = np.take_along_axis(np.asarray(ref), np.asarray(out.tokens[b, :n])[:, None], 1)[:, 0]
    np.testing.assert_allclose(out.logprobs[b, :n], ref, atol=1e-5)


def test_each_configuration_compiles_once_and_the_loop_never_calls_the_host(
    progression_models):
  m = progression_models
  prompts, lengths = _prompts(m)
  kwargs = dict(max_new_tokens=8, sampling=SamplingConfig(1.0), drafter=MTPDrafter(),
                tree=DraftTree.chain(2))
  generate(m["params"], m["config"], prompts, lengths, jax.random.key(0), **kwargs)
  before = DecodeLoop.__call__._cache_size()
  for seed in range(3):
    generate(m["params"], m["config"], prompts, lengths, jax.random.key(seed), **kwargs)
  assert DecodeLoop.__call__._cache_size() == before
  loop = DecodeLoop(config=m["config"], max_len=32, **kwargs)
  hlo = DecodeLoop.__call__.lower(loop, m["params"], prompts, lengths,
                                  jax.random.key(0)).as_text()
  assert "while" in hlo
  for marker in ("callback", "outfeed", "infeed", "send", "recv"):
    assert marker not in hlo.lower(), marker


def test_max_new_tokens_is_exact_and_prompts_of_different_lengths_are_ragged(
    progression_models):
  m = progression_models
  prompts, lengths = _prompts(m)
  out = generate(m["params"], m["config"], prompts, lengths, jax.random.key(3),
                 max_new_tokens=7, sampling=SamplingConfig(1.0), drafter=MTPDrafter(),
                 tree=DraftTree.chain(3))
  np.testing.assert_array_equal(out.lengths, [7, 7, 7, 7])
  assert out.tokens.shape == (4, 7)


def test_ngram_lookup_proposes_the_continuation_of_the_latest_match():
  seq = jnp.array([[5, 6, 7, 8, 5, 6, 9, 1, 5, 6, 0, 0]])
  found, toks = lookup(seq, jnp.array([10]), 2, 3)
  assert bool(found[0])
  np.testing.assert_array_equal(toks[0], [9, 1, 5])  # latest "5 6" before the suffix
  found, _ = lookup(seq, jnp.array([10]), 3, 3)
  assert not bool(found[0])


def test_draft_tree_structure_from_widths():
  tree = DraftTree.from_widths((2, 2))
  assert tree.num_nodes == 6 and tree.depth == 2 and tree.max_children == 2
  np.testing.assert_array_equal(tree.depths, [0, 1, 1, 2, 2, 2, 2])
  np.testing.assert_array_equal(tree.children[0], [1, 2])
  np.testing.assert_array_equal(tree.children[2], [5, 6])
  assert tree.ancestor_mask[6].tolist() == [True, False, True, False, False, False, True]


@pytest.mark.parametrize("make,needle", [
    (lambda: DraftTree.from_parents([0, 2]), "parents"),
    (lambda: DraftTree.from_parents([0, -1]), "parents"),
    (lambda: DraftTree.from_widths((2, 0)), "widths"),
    (lambda: SamplingConfig(top_p=0.0), "top_p"),
    (lambda: SamplingConfig(top_p=1.5), "top_p"),
    (lambda: SamplingConfig(temperature=-0.1), "temperature"),
    (lambda: SamplingConfig(top_k=-1), "top_k"),
])
def test_malformed_tree_or_sampling_config_raises_clear_error(make, needle):
  with pytest.raises(ConfigError, match=needle):
    make()


def test_bad_generate_inputs_raise_clear_errors(progression_models):
  m = progression_models
  prompts, lengths = _prompts(m)
  call = lambda **kw: generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                               **{"max_new_tokens": 8, **kw})
  with pytest.raises(ConfigError, match="too deep for MTPDrafter"):
    call(drafter=MTPDrafter(), tree=DraftTree.chain(4))
  with pytest.raises(ConfigError, match="does not fit the cache"):
    call(max_new_tokens=200)
  with pytest.raises(ConfigError, match="needs a drafter"):
    call(tree=DraftTree.chain(2))
  with pytest.raises(ConfigError, match="chain"):
    call(drafter=NGramDrafter(), tree=DraftTree.from_widths((2,)))
  with pytest.raises(ValueError, match="prompt_lengths"):
    generate(m["params"], m["config"], prompts, jnp.array([12, 7, 0, 9]), jax.random.key(0),
             max_new_tokens=4)
