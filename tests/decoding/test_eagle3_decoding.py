"""The EAGLE-3 drafter in the engine: greedy equivalence with plain decoding on chains and
trees of any depth, drafts identical to the training-time-test unroll it was trained with,
EOS inside accepted runs, and clear errors for heads that do not fit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import progression_batch
from specjax.decoding import DecodeLoop, DraftTree, SamplingConfig, generate
from specjax.decoding.drafters.eagle3 import Eagle3Drafter, Eagle3Weights
from specjax.errors import ConfigError
from specjax.models import Eagle3Config, eagle3_ttt_logits, forward, select_aux, to_target_vocab

GREEDY = SamplingConfig(temperature=0.0)
TREES = {
    "chain3": DraftTree.chain(3),
    "chain6": DraftTree.chain(6),  # deeper than any MTP stack in these tests
    "tree221": DraftTree.from_widths((2, 2, 1)),
    "irregular": DraftTree.from_parents([0, 0, 0, 1, 1, 4]),
}


def _prompts():
  """A ragged batch: lengths 12, 7, 4, 9 (padding is garbage on purpose)."""
  tokens = progression_batch(np.random.default_rng(5), 4, 12)
  tokens[1, 7:] = 3
  tokens[2, 4:] = 30
  return jnp.asarray(tokens), jnp.array([12, 7, 4, 9])


@pytest.mark.parametrize("name", sorted(TREES))
def test_greedy_eagle3_output_equals_plain_autoregressive(progression_models,
                                                          progression_eagle, name):
  m, e = progression_models, progression_eagle
  prompts, lengths = _prompts()
  plain = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                   max_new_tokens=24, sampling=GREEDY)
  spec = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                  max_new_tokens=24, sampling=GREEDY, drafter=Eagle3Drafter(e["config"]),
                  tree=TREES[name], drafter_params=e["weights"])
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  np.testing.assert_array_equal(spec.lengths, plain.lengths)
  np.testing.assert_allclose(spec.logprobs, plain.logprobs, atol=1e-5)
  # A trained head on a predictable language accepts several tokens per round (not all: its
  # 28-token draft vocabulary misses 3 of the 31 tokens the language uses).
  assert float(spec.stats.tokens_per_round) > 2.5, spec.stats


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_eos_inside_an_accepted_eagle3_run_truncates_like_plain_decoding(progression_models,
                                                                        progression_eagle):
  m, e = progression_models, progression_eagle
  prompts, lengths = _prompts()
  plain = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                   max_new_tokens=20, sampling=GREEDY)
  eos = int(plain.tokens[0, 5])
  kwargs = dict(max_new_tokens=20, sampling=GREEDY, eos_id=eos)
  plain_eos = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0), **kwargs)
  spec = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                  drafter=Eagle3Drafter(e["config"]), tree=DraftTree.chain(4),
                  drafter_params=e["weights"], **kwargs)
  assert float(spec.stats.tokens_per_round) > 2.5
  np.testing.assert_array_equal(spec.tokens, plain_eos.tokens)
  np.testing.assert_array_equal(spec.lengths, plain_eos.lengths)


@pytest.mark.slow
def test_drafted_distributions_equal_the_training_time_test_unroll(progression_models,
                                                                   progression_eagle):
  """The drafter's distribution at depth j + 1 of a chain is the training-time test's step j
  at position r + j - 1 on the same tokens: drafting is exactly what was trained."""
  m, e = progression_models, progression_eagle
  config, weights = e["config"], e["weights"]
  # Perturbed weights: a sharp trained head would hide mismatches behind near-one-hot rows.
  noisy = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape),
                       weights.params)
  weights = Eagle3Weights(params=noisy, d2t=weights.d2t)
  prompts, lengths = _prompts()
  depth = 4
  loop = DecodeLoop(config=m["config"], max_new_tokens=8, max_len=40,
                    sampling=SamplingConfig(1.0), drafter=Eagle3Drafter(config, sampled=True),
                    tree=DraftTree.chain(depth))
  state = loop.prefill(m["params"], prompts, lengths, jax.random.key(0), weights)
  proposal, _ = loop.drafter.propose(m["params"], m["config"], state.drafter_state,
                                     state.context, loop.tree, loop.sampling,
                                     jax.random.key(1))
  for b in range(prompts.shape[0]):
    r = int(lengths[b])
    seq = jnp.concatenate([prompts[b, :r], state.seq[b, r:r + 1], proposal.tokens[b]])[None]
    positions = jnp.arange(seq.shape[1])[None]
    out = forward(m["params"], m["config"], seq, positions, hidden_layers=config.hidden_layers)
    ttt = eagle3_ttt_logits(weights.params, config, m["params"]["embed"], seq,
                            select_aux(config, out.intermediates), depth)  # [J, 1, T, W]
    for j in range(depth):
      expected = jax.nn.log_softmax(to_target_vocab(ttt[j, 0, r + j - 1], weights.d2t,
                                                    config.vocab_size))
      np.testing.assert_allclose(proposal.logprobs[b, j], expected, atol=2e-5)


def test_eagle3_heads_that_do_not_fit_raise_clear_errors(progression_models,
                                                         progression_eagle):
  m, e = progression_models, progression_eagle
  prompts, lengths = _prompts()
  call = lambda drafter, params: generate(
      m["params"], m["config"], prompts, lengths, jax.random.key(0), max_new_tokens=4,
      drafter=drafter, tree=DraftTree.chain(2), drafter_params=params)
  with pytest.raises(ConfigError, match="aux_layers=.*invalid for a 2-layer target"):
    call(Eagle3Drafter(e["config"].replace(aux_layers=(1, 2, 3))), e["weights"])
  with pytest.raises(ConfigError, match="drafter_params=Eagle3Weights"):
    call(Eagle3Drafter(e["config"]), e["weights"].params)
  with pytest.raises(ConfigError, match="d2t has shape"):
    call(Eagle3Drafter(e["config"]), e["weights"].replace(d2t=e["weights"].d2t[:-1]))
  with pytest.raises(ConfigError, match="vocab_size"):
    wide = Eagle3Config.for_target(m["config"].replace(vocab_size=64))
    call(Eagle3Drafter(wide), e["weights"])
