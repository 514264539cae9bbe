"""Drafter caches hold a round's entries wherever the root is in the buffer.

Module d of the MTP drafter writes, after its committed entries, the accepted window and one
chain of d entries per node at depth d (never committed). A tree wide at a middle depth needs
more of those slots than the target's cache has beyond the root; sized like the target's, the
drafter's caches dropped those writes near the end of the sequence buffer and its drafts there
differed from the same drafts far from the end (the output stayed exact, the speed did not).

The EAGLE-3 head and the draft model keep caches of the target's size: their scratch slots for
a round's nodes end before the target's, and the entries of a plain-round window past the
committed ones that do not fit are padding. Run to the end of a just-large-enough buffer,
their rounds must accept exactly what they accept in a buffer with room to spare.
"""

import jax
import numpy as np
import pytest

from support import CyclingPolicy, progression_batch
from specjax.decoding import (Adaptive, CostTable, DecodeLoop, DraftModelDrafter, DraftTree,
                              Eagle3Drafter, MTPDrafter, SamplingConfig, generate)
from specjax.errors import ConfigError
from specjax.models import ModelConfig, init_params

CONFIG = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                     head_dim=16, mlp_dim=32, max_position=64, num_mtp_modules=4)
PARAMS = init_params(CONFIG, jax.random.key(0))
# Depth 3, one node at depth 1, six at depth 2 (one of which has a child): module 2 drafts
# depth 3 from six chains of two entries, 12 slots, while the whole tree has 8 nodes.
WIDE_MIDDLE = DraftTree((0, 1, 1, 1, 1, 1, 1, 2))
PROMPTS = np.array([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]], np.int32)
LENGTHS = np.array([6, 6], np.int32)
SAMPLED = SamplingConfig(1.0)


def _first_proposal(max_new_tokens: int):
  """The MTP drafter's first proposal after the prefill, in a loop whose caches are just large
  enough for the target (generate's default), and the root's distance to the buffer's end."""
  drafter = MTPDrafter(sampled=True)  # sampled: the proposal carries every node's log q
  p = PROMPTS.shape[1]
  loop = DecodeLoop(config=CONFIG, max_new_tokens=max_new_tokens,
                    max_len=p + max_new_tokens + WIDE_MIDDLE.num_nodes + 1, sampling=SAMPLED,
                    drafter=drafter, tree=WIDE_MIDDLE)
  state = loop.prefill(PARAMS, PROMPTS, LENGTHS, jax.random.key(1), None)
  proposal, _ = drafter.propose(PARAMS, CONFIG, state.drafter_state, state.context,
                                WIDE_MIDDLE, SAMPLED, jax.random.key(2))
  return proposal, loop.max_len


@pytest.mark.slow
def test_mtp_drafts_near_the_end_of_the_buffer_equal_drafts_far_from_it():
  near, near_slots = _first_proposal(max_new_tokens=2)
  far, _ = _first_proposal(max_new_tokens=30)
  # Near the end, module 2 (committed through r - 3, root r = 6) writes its window of 4 and
  # its 12 chain entries up to slot 3 + 4 + 12 = 19, past the target's 17 slots: the case
  # whose writes were dropped.
  r = int(LENGTHS[0])
  assert (r - 2) + 4 + 12 > near_slots
  np.testing.assert_array_equal(near.tokens, far.tokens)
  # log q of every node, depth-2 nodes (read from module 2's chains) included.
  np.testing.assert_allclose(near.logprobs, far.logprobs, atol=1e-5)


def test_a_menu_tree_wider_than_its_deepest_tree_is_refused_not_drafted_with_dropped_writes():
  # The state is built for the deepest tree, a chain of 4; the wide-middle tree of the menu
  # needs 12 chain slots in module 2, more than that state's caches have past the root.
  menu = Adaptive((WIDE_MIDDLE, DraftTree.chain(4)),
                  costs=CostTable((2,), ((1.0,), (1.0,), (1.0,))))
  with pytest.raises(ConfigError, match=r"6 nodes at depth 2, more than its state's caches "
                                        r"were built for .*at least as wide at every depth"):
    generate(PARAMS, CONFIG, PROMPTS, LENGTHS, jax.random.key(0), max_new_tokens=2,
             drafter=MTPDrafter(), speculation=menu)


def _sized_like_the_target(name, m, e):
  return {"eagle3": (Eagle3Drafter(e["config"], sampled=True), e["weights"]),
          "draft_model": (DraftModelDrafter(m["draft_config"], sampled=True),
                          m["draft_params"])}[name]


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
@pytest.mark.parametrize("name", ["eagle3", "draft_model"])
def test_drafts_of_caches_sized_like_the_targets_are_the_same_near_the_end_of_the_buffer(
    progression_models, progression_eagle, name):
  m = progression_models
  drafter, weights = _sized_like_the_target(name, m, progression_eagle)
  tree = DraftTree.from_widths((2, 2, 1))
  tokens, lengths = progression_batch(np.random.default_rng(3), 2, 8), np.array([8, 5])

  def first_proposal(max_new_tokens):
    loop = DecodeLoop(config=m["config"], max_new_tokens=max_new_tokens,
                      max_len=8 + max_new_tokens + tree.num_nodes + 1, sampling=SAMPLED,
                      drafter=drafter, tree=tree)
    state = loop.prefill(m["params"], tokens, lengths, jax.random.key(1), weights)
    return drafter.propose(m["params"], m["config"], state.drafter_state, state.context,
                           tree, SAMPLED, jax.random.key(2))[0]

  near, far = first_proposal(1), first_proposal(40)
  np.testing.assert_array_equal(near.tokens, far.tokens)
  np.testing.assert_allclose(near.logprobs, far.logprobs, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["eagle3", "draft_model"])
def test_drafter_caches_sized_like_the_targets_lose_nothing_at_the_end_of_the_buffer(
    progression_models, progression_eagle, name):
  m, e = progression_models, progression_eagle
  drafter, weights = _sized_like_the_target(name, m, e)
  # Plain rounds in turn with a chain and a tree: plain-round windows are committed in
  # passes of 8 entries, wider than the chain's and the tree's rounds.
  menu = (DraftTree.chain(4), DraftTree.from_widths((2, 2, 1)))
  policy = CyclingPolicy(menu, costs=CostTable((4,), ((1.0,),) * 3))
  tokens = progression_batch(np.random.default_rng(11), 4, 10)
  lengths = np.array([10, 6, 3, 8], np.int32)
  new, nodes = 40, max(t.num_nodes for t in menu)
  results = [generate(m["params"], m["config"], tokens, lengths, jax.random.key(0),
                      max_new_tokens=new, sampling=SAMPLED, drafter=drafter,
                      speculation=policy, drafter_params=weights, max_len=10 + new + nodes + 1
                      + spare) for spare in (0, 32)]
  exact, roomy = results  # sampled: every draft's q enters the acceptance test
  np.testing.assert_array_equal(exact.tokens, roomy.tokens)
  jax.tree.map(np.testing.assert_array_equal, exact.stats, roomy.stats)
  assert float(exact.stats.tokens_per_round) > 1.5, exact.stats
