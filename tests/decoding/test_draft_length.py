"""Draft length per row and round: a drafter with a `confidence` threshold stops a row's
chain at the first depth where it is unsure, the verify pass never accepts the nodes it left
out, and greedy output still equals plain decoding token for token. (Sampled output is
checked against the exact target distribution in `test_lossless_sampling.py`.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import CyclingPolicy, progression_batch
from specjax.decoding import (CostTable, DraftModelDrafter, DraftTree, SamplingConfig, generate,
                              verify)
from specjax.decoding.drafters import draft_level_by_level
from specjax.decoding.drafters.eagle3 import Eagle3Drafter
from specjax.errors import ConfigError

GREEDY = SamplingConfig(temperature=0.0)
DEEP = DraftTree.chain(6)


def _prompts():
  tokens = progression_batch(np.random.default_rng(11), 6, 12)
  tokens[2, 6:] = 3  # a row the drafters have not seen the like of: they stop early there
  tokens[4] = np.random.default_rng(2).integers(0, 31, 12)
  return jnp.asarray(tokens), jnp.array([12, 9, 12, 5, 12, 8])


def test_a_row_stops_after_the_first_depth_it_is_unsure_of():
  # Two rows, a chain of 4; the draft's top probability per depth is scripted per row.
  probs = jnp.array([[0.9, 0.2, 0.9, 0.9], [0.9, 0.9, 0.9, 0.9]])

  def score(d, parents, tokens, carry):  # token d + 1 with probability p, the rest spread
    p = probs[:, d, None]
    logits = jnp.broadcast_to(jnp.log((1 - p) / 9), (2, 10)).at[:, d + 1].set(jnp.log(p)[:, 0])
    return logits[:, None], carry

  for confidence, expect in ((0.5, [[1, 1, 0, 0], [1, 1, 1, 1]]), (0.95, [[1, 0, 0, 0]] * 2)):
    proposal, _ = draft_level_by_level(DraftTree.chain(4), GREEDY, jax.random.key(0), False,
                                       jnp.array([7, 7]), score, None, confidence=confidence)
    np.testing.assert_array_equal(proposal.drafted, np.array(expect, bool))
    drafted = np.asarray(proposal.drafted)
    np.testing.assert_array_equal(np.asarray(proposal.tokens)[drafted],
                                  np.broadcast_to([1, 2, 3, 4], (2, 4))[drafted])
  proposal, _ = draft_level_by_level(DraftTree.chain(4), GREEDY, jax.random.key(0), False,
                                     jnp.array([7, 7]), score, None)
  assert proposal.drafted is None


def test_a_node_left_out_is_never_accepted():
  tree = DraftTree.chain(2)
  logits = jnp.zeros((1, 3, 4)).at[:, :, 2].set(10.0)  # the target wants token 2 everywhere
  tokens = jnp.array([[0, 2, 2]])
  full = verify.verify_matching(tree, tokens, logits, GREEDY, jax.random.key(0))
  cut = verify.verify_matching(tree, tokens.at[:, 2].set(-1), logits, GREEDY, jax.random.key(0))
  assert int(full.num_accepted[0]) == 2 and int(cut.num_accepted[0]) == 1
  assert int(cut.next_token[0]) == 2
  q = jnp.log(jnp.full((1, 3, 4), 0.25))
  sampled = verify.verify_sampled(tree, tokens.at[:, 2].set(-1), logits, q,
                                  SamplingConfig(1.0), jax.random.key(0))
  assert int(sampled.num_accepted[0]) <= 1


def _drafters(m, e):
  return {"draft_model": (DraftModelDrafter(m["draft_config"], confidence=0.9),
                          m["draft_params"]),
          "eagle3": (Eagle3Drafter(e["config"], confidence=0.9), e["weights"])}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["draft_model", "eagle3"])
def test_greedy_output_equals_plain_with_early_stopping(progression_models, progression_eagle,
                                                        name):
  m = progression_models
  drafter, drafter_params = _drafters(m, progression_eagle)[name]
  prompts, lengths = _prompts()
  plain = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                   max_new_tokens=30, sampling=GREEDY, eos_id=5)
  policy = CyclingPolicy((DraftTree.chain(2), DEEP), costs=CostTable((6,), ((1.0,),) * 3))
  for kwargs in (dict(tree=DEEP), dict(speculation=policy)):
    spec = generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                    max_new_tokens=30, sampling=GREEDY, eos_id=5, drafter=drafter,
                    drafter_params=drafter_params, **kwargs)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    np.testing.assert_array_equal(spec.lengths, plain.lengths)
    np.testing.assert_allclose(spec.logprobs, plain.logprobs, atol=1e-5)
    assert float(spec.stats.tokens_per_round) > 1.5, spec.stats
  # With the fixed deep chain (and no EOS), rows drafted fewer than its 6 nodes on average,
  # and more than 1; without a threshold, all 6.
  fixed, always = (generate(m["params"], m["config"], prompts, lengths, jax.random.key(0),
                            max_new_tokens=30, sampling=GREEDY, drafter=d,
                            drafter_params=drafter_params, tree=DEEP)
                   for d in (drafter, dataclasses.replace(drafter, confidence=0.0)))
  np.testing.assert_array_equal(fixed.tokens, always.tokens)
  assert 1.5 < float(fixed.stats.drafts_per_round) < 5.5, fixed.stats.drafts_per_round
  assert float(always.stats.drafts_per_round) == 6.0


@pytest.mark.parametrize("confidence", [-0.1, 1.0, float("nan"), "0.5"])
def test_bad_confidence_is_a_clear_error(progression_models, confidence):
  m = progression_models
  prompts, lengths = _prompts()
  with pytest.raises(ConfigError, match="confidence"):
    generate(m["params"], m["config"], prompts, lengths, jax.random.key(0), max_new_tokens=4,
             drafter=DraftModelDrafter(m["draft_config"], confidence=confidence),
             drafter_params=m["draft_params"], tree=DEEP)
