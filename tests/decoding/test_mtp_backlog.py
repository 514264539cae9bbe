"""The MTP drafter's incremental state against a from-scratch referee.

The drafter keeps one cache per module and, under an adaptive menu, lets the modules deeper
than a round's tree fall behind (a backlog they catch up on when a deeper round needs them or
the backlog is full). Whatever the sequence of rounds, a proposal must be what the modules
compute from scratch: every module run over the whole sequence so far, no cache, the drafted
tokens appended. These tests drive the drafter through rounds of every depth, plain rounds,
ragged rows, a finished row and backlogs that overflow, and compare each proposal's draft
distribution with the referee's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decoding import DraftTree, MTPDrafter, SamplingConfig
from specjax.decoding.drafters.base import DraftContext, RoundResult, TargetFeatures
from specjax.decoding.drafters.mtp import BACKLOG_WINDOWS
from specjax.models import ModelConfig, forward, init_params
from specjax.models.heads import mtp_forward

DEPTH = 3
CONFIG = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                     head_dim=16, mlp_dim=32, max_position=256, num_mtp_modules=DEPTH)
PARAMS = init_params(CONFIG, jax.random.key(0))
SAMPLED = SamplingConfig(1.0)
DRAFTER = MTPDrafter(sampled=True)  # sampled: each proposal carries every node's log q
LENGTH = 200


@jax.jit
def _trunk_hidden(tokens):
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  return forward(PARAMS, CONFIG, tokens, positions, compute_logits=False).hidden


@jax.jit
def _referee(hidden, extended, roots):
  """Log q of each depth from scratch: module k over positions 0 .. L - 1 (causal, so the
  positions past the root's do not matter), read at the root's position - 1."""
  b, length = extended.shape[0], hidden.shape[1]
  positions = jnp.broadcast_to(jnp.arange(length), (b, length))
  state, out = hidden, []
  for k in range(DEPTH):
    head = mtp_forward(PARAMS, CONFIG, k, state, extended[:, k + 1:k + 1 + length], positions)
    out.append(jnp.take_along_axis(head.logits, (roots - 1)[:, None, None], 1)[:, 0])
    state = head.hidden
  return jax.nn.log_softmax(jnp.stack(out, 1).astype(jnp.float32), -1)  # [B, D, V]


@functools.cache
def _propose(depth):
  tree = DraftTree.chain(depth)
  return jax.jit(lambda state, ctx, key: DRAFTER.propose(PARAMS, CONFIG, state, ctx, tree,
                                                         SAMPLED, key))


_update = jax.jit(lambda state, result: DRAFTER.update(PARAMS, CONFIG, state, result))


def _run(schedule, prompt_lengths, *, plain_rounds=True, finish_row_at=None, seed=0):
  """Drive the drafter through `schedule` (tree depth per round, 0 = plain round) over a
  fixed random sequence, each round accepting a random count, and check every proposal.
  Returns how many proposals were checked."""
  rng = np.random.default_rng(seed)
  b = len(prompt_lengths)
  full = rng.integers(0, CONFIG.vocab_size, (b, LENGTH)).astype(np.int32)
  hidden = np.asarray(_trunk_hidden(jnp.asarray(full)))
  seq_len = np.asarray(prompt_lengths) + 1  # the prompt and the first generated token (root)
  done = np.zeros(b, bool)

  def context():
    seq = np.where(np.arange(LENGTH)[None] < seq_len[:, None], full, 0)
    last = hidden[np.arange(b), seq_len - 2]
    return DraftContext(seq=jnp.asarray(seq), seq_len=jnp.asarray(seq_len, jnp.int32),
                        last_hidden=jnp.asarray(last), done=jnp.asarray(done))

  p = max(prompt_lengths)
  state = DRAFTER.init(PARAMS, CONFIG, None, context(), DraftTree.chain(DEPTH), LENGTH,
                       TargetFeatures(hidden=jnp.asarray(hidden[:, :p])),
                       plain_rounds=plain_rounds)
  checked = 0
  for i, depth in enumerate(schedule):
    if finish_row_at is not None and i == finish_row_at:
      done[-1] = True
    roots = seq_len - 1
    if depth:
      proposal, state = _propose(depth)(state, context(), jax.random.key(i))
      drafts = np.asarray(proposal.tokens)
      extended = np.pad(full, ((0, 0), (0, DEPTH + 1)))
      for row in range(b):
        extended[row, roots[row] + 1:roots[row] + 1 + depth] = drafts[row]
        extended[row, roots[row] + 1 + depth:] = 0
      want = np.asarray(_referee(jnp.asarray(hidden), jnp.asarray(extended),
                                 jnp.asarray(roots)))
      got = np.asarray(proposal.logprobs)[:, :depth]
      live = ~done
      np.testing.assert_allclose(got[live], want[live, :depth], atol=2e-4,
                                 err_msg=f"round {i} (depth {depth}) of {schedule}")
      checked += 1
    count = np.where(done, 0, rng.integers(1, depth + 2, b)).astype(np.int32)
    ahead = roots[:, None] + np.arange(depth + 1)[None]
    result = RoundResult(
        path_tokens=jnp.asarray(full[np.arange(b)[:, None], ahead]),
        next_tokens=jnp.asarray(full[np.arange(b)[:, None], ahead + 1]),
        features=TargetFeatures(hidden=jnp.asarray(hidden[np.arange(b)[:, None], ahead])),
        start=jnp.asarray(roots, jnp.int32), count=jnp.asarray(count))
    state = _update(state, result)
    seq_len = seq_len + count
  assert seq_len.max() + DEPTH + 2 < LENGTH
  return checked


def test_backlog_holds_the_windows_of_several_shallow_rounds():
  state = DRAFTER.init(PARAMS, CONFIG, None, DraftContext(
      seq=jnp.zeros((1, 16), jnp.int32).at[0, :5].set(1), seq_len=jnp.array([5]),
      last_hidden=jnp.zeros((1, CONFIG.d_model)), done=jnp.array([False])),
      DraftTree.chain(DEPTH), 16, TargetFeatures(hidden=jnp.zeros((1, 4, CONFIG.d_model))),
      plain_rounds=True)
  assert [w.tokens.shape[1] for w in state.backlogs] == [BACKLOG_WINDOWS * (DEPTH + 1)] * 2


@pytest.mark.parametrize("schedule", [
    # deep, then long runs of shallow rounds that fill and overflow the deeper backlogs
    [3] + [1] * 14 + [2] * 8 + [3, 1, 3],
    # plain rounds (the window fills and commits into module 0 only), then every depth
    [2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 3, 2, 1],
    # a different depth every round
    [1, 3, 2, 1, 2, 3, 3, 1, 1, 2, 0, 1, 3, 0, 2, 2, 1, 3],
], ids=["overflow", "plain", "alternating"])
def test_proposals_equal_the_modules_run_from_scratch(schedule):
  assert _run(schedule, [5, 9]) == sum(1 for d in schedule if d)


def test_a_finished_row_leaves_the_other_rows_proposals_exact():
  _run([1] * 6 + [2, 0, 1, 1, 3] + [1] * 6 + [3], [4, 7, 6], finish_row_at=5, seed=1)


def test_without_plain_rounds_shallow_rounds_commit_every_module_at_once():
  _run([1, 2, 1, 1, 3, 1, 2], [5, 6], plain_rounds=False, seed=2)
