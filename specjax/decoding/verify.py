"""Lossless verification of a draft tree against one target forward pass.

Three exact procedures, each returning the accepted path and the next token:

- greedy: follow the child whose token is the target argmax at each node.
- deterministic drafts (top-w, n-gram; the draft distribution is a point mass): draw one
  target sample at every node at once (the draws are independent, so this equals sampling
  them one after another), then walk from the root along the child that matches the sample.
  The sample at the last node reached is the correction / bonus token.
- sampled drafts (siblings drawn without replacement from the draft distribution q):
  recursive rejection. At a node with target p and children x_1..x_w, accept x_i with
  probability min(1, p_i(x_i) / q_i(x_i)) where q_i is q with x_1..x_{i-1} removed and
  renormalised and p_{i+1} = norm(max(p_i - q_i, 0)); if every child is rejected, emit a sample
  of the final residual. With one child this is the Leviathan / Chen chain rule.

`LosslessVerifier` dispatches between the last two and is what `generate` uses; the loop
takes any `Verifier`, which is how tests inject a broken one as a negative control.

Shape letters: see `specjax` (B batch, N draft nodes, D depth, C children, V vocab).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import struct

from specjax.decoding.sampling import SamplingConfig, processed_logprobs, sample_tokens
from specjax.decoding.tree import DraftTree


@struct.dataclass
class VerifyResult:
  """Outcome of one verification.

  Attributes:
    path: `[B, D + 1]` node indices of the accepted path, `path[:, 0] = 0` (root); entries
      after `num_accepted` repeat the last accepted node.
    num_accepted: `[B]` accepted draft tokens a (the path is `path[:, :a + 1]`).
    next_token: `[B]` token sampled at the last accepted node (correction or bonus).
  """

  path: jax.Array
  num_accepted: jax.Array
  next_token: jax.Array


def _distinct_siblings(child_tokens: jax.Array, valid: jax.Array) -> jax.Array:
  """Invalidate a child whose token equals an earlier sibling's. `[B, N+1, C]` -> same."""
  c = child_tokens.shape[-1]
  same = child_tokens[..., :, None] == child_tokens[..., None, :]  # [B, N+1, C, C]
  earlier = jnp.tril(jnp.ones((c, c), bool), k=-1)
  dup = jnp.any(same & earlier & valid[..., None, :], axis=-1)
  return valid & ~dup


def _row_take(x: jax.Array, idx: jax.Array) -> jax.Array:
  """`x[b, idx[b]]` for x `[B, N + 1, ...]`, idx `[B]`."""
  return jnp.take_along_axis(x, idx.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]


def verify_matching(tree: DraftTree, node_tokens: jax.Array, target_logits: jax.Array,
                    sampling: SamplingConfig, key: jax.Array) -> VerifyResult:
  """Greedy, or deterministic drafts under sampling (one target sample per node).

  Args:
    node_tokens: `[B, N + 1]` tokens of [root] + nodes (the root's is unused).
    target_logits: `[B, N + 1, V]` target logits at every node.
  """
  b = node_tokens.shape[0]
  logp = processed_logprobs(target_logits, sampling)
  y = sample_tokens(key, logp, sampling)  # [B, N + 1]
  children = jnp.asarray(tree.children)  # [N + 1, C]
  child_tokens = jnp.take(node_tokens, jnp.maximum(children, 0), axis=1)  # [B, N + 1, C]
  valid = _distinct_siblings(child_tokens, jnp.broadcast_to(children >= 0, child_tokens.shape))
  cur = jnp.zeros((b,), jnp.int32)
  active = jnp.ones((b,), bool)
  accepted = jnp.zeros((b,), jnp.int32)
  path = [cur]
  for _ in range(tree.depth):
    match = _row_take(valid, cur) & (_row_take(child_tokens, cur) == _row_take(y, cur)[:, None])
    moved = active & jnp.any(match, axis=-1)
    nxt = jnp.take_along_axis(children[cur], jnp.argmax(match, -1)[:, None], axis=1)[:, 0]
    cur = jnp.where(moved, nxt, cur)
    accepted += moved
    active = moved
    path.append(cur)
  return VerifyResult(path=jnp.stack(path, 1), num_accepted=accepted,
                      next_token=_row_take(y, cur))


def verify_sampled(tree: DraftTree, node_tokens: jax.Array, target_logits: jax.Array,
                   draft_logprobs: jax.Array, sampling: SamplingConfig,
                   key: jax.Array) -> VerifyResult:
  """Recursive rejection sampling for drafts sampled without replacement.

  Args:
    node_tokens: `[B, N + 1]` tokens of [root] + nodes.
    target_logits: `[B, N + 1, V]` target logits at every node.
    draft_logprobs: `[B, N + 1, V]` log q at every node: the distribution its children were
      drawn from (without replacement, in rank order).
  """
  b = node_tokens.shape[0]
  p_all = jnp.exp(processed_logprobs(target_logits, sampling))
  q_all = jnp.exp(draft_logprobs.astype(jnp.float32))
  children = jnp.asarray(tree.children)
  c_max = tree.max_children
  cur = jnp.zeros((b,), jnp.int32)
  active = jnp.ones((b,), bool)
  accepted = jnp.zeros((b,), jnp.int32)
  residual = p_all[:, 0]
  path = [cur]
  rows = jnp.arange(b)
  for d in range(tree.depth):
    p, q = residual, _row_take(q_all, cur)
    kids = children[cur]  # [B, C]
    chosen = jnp.full((b,), -1, jnp.int32)
    for j in range(c_max):
      child = kids[:, j]
      x = _row_take(node_tokens, jnp.maximum(child, 0))
      trying = active & (child >= 0) & (x >= 0) & (chosen < 0)
      px, qx = p[rows, x], q[rows, x]
      # u in (0, 1]: accept with probability min(1, px / qx) without dividing; qx = 0 means
      # the drafter could not have proposed x, so such a child is never accepted. A child
      # left out (x < 0) is not tried: p stays as it is, as if the tree ended here.
      u = 1.0 - jax.random.uniform(jax.random.fold_in(key, d * c_max + j), (b,))
      accept = trying & (qx > 0) & (u * qx <= px)
      reject = trying & ~accept
      chosen = jnp.where(accept, child, chosen)
      res = jnp.maximum(p - q, 0.0)
      mass = res.sum(-1, keepdims=True)
      # mass == 0 only when p == q up to rounding, where rejection has probability ~0.
      res = jnp.where(mass > 1e-12, res / jnp.maximum(mass, 1e-30), p)
      p = jnp.where(reject[:, None], res, p)
      q_wo = q.at[rows, x].set(0.0)
      q_wo = q_wo / jnp.maximum(q_wo.sum(-1, keepdims=True), 1e-30)
      q = jnp.where(reject[:, None], q_wo, q)
    moved = chosen >= 0
    cur = jnp.where(moved, chosen, cur)
    accepted += moved
    residual = jnp.where(moved[:, None], _row_take(p_all, cur), p)
    active = moved
    path.append(cur)
  logits = jnp.log(jnp.maximum(residual, 0.0))
  next_token = jax.random.categorical(jax.random.fold_in(key, 1 << 20), logits, axis=-1)
  return VerifyResult(path=jnp.stack(path, 1), num_accepted=accepted, next_token=next_token)


class Verifier(Protocol):
  """Chooses the accepted path and the next token from one target forward over a tree.

  Args:
    tree: the draft tree (static).
    node_tokens: `[B, N + 1]` tokens of [root] + nodes; a negative token marks a node the
      drafter left out (`Proposal.drafted`), which is never accepted.
    target_logits: `[B, N + 1, V]` target logits at every node.
    draft_logprobs: `[B, N + 1, V]` log q of sampled drafts, or None for deterministic ones.
    sampling: the target's sampling configuration.
    key: PRNG key.
  """

  def __call__(self, tree: DraftTree, node_tokens: jax.Array, target_logits: jax.Array,
               draft_logprobs: jax.Array | None, sampling: SamplingConfig,
               key: jax.Array) -> VerifyResult:
    ...


@dataclasses.dataclass(frozen=True)
class LosslessVerifier:
  """Matching verification for greedy or deterministic drafts, recursive rejection for
  sampled ones: both keep the target distribution exactly."""

  def __call__(self, tree: DraftTree, node_tokens: jax.Array, target_logits: jax.Array,
               draft_logprobs: jax.Array | None, sampling: SamplingConfig,
               key: jax.Array) -> VerifyResult:
    if sampling.greedy or draft_logprobs is None:
      return verify_matching(tree, node_tokens, target_logits, sampling, key)
    return verify_sampled(tree, node_tokens, target_logits, draft_logprobs, sampling, key)
