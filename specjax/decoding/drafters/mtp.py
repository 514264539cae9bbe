"""MTP drafter: the target's own DeepSeek-V3 multi-token-prediction modules, chained.

Module k at position i reads (state h^k_i, token t_{i+k+1}) and predicts t_{i+k+2}; h^0 is
the trunk's hidden, h^{k+1} is module k's output stream. Module k's input at i needs the
token k + 1 ahead, so with the root at position r, module k can be *committed* (its KV
cache made final) exactly through position r - k - 1. The drafter keeps each used module at
that frontier, plus its output stream at its last committed position.

Drafting depth d + 1 (module d) from a node x at depth d needs module d at positions
r - d .. r - 1, whose token inputs are x's ancestors at depths 1..d (x last) and whose state
inputs are module d - 1's outputs for x's parent — computed one level earlier. Each node's
chain runs as one forward with a block-diagonal causal mask over the committed cache, and
nothing is committed. After verification each module is advanced by the accepted count:
its window of a + 1 positions reads the same new tokens (accepted drafts, then the new root)
for every module, and the state inputs of module k are module k - 1's window shifted by one.

Glossary: B batch, r root position, D tree depth, M_d nodes at depth d, Dm d_model.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decoding.drafters.base import Proposal, check_depth, draft_children
from specjax.decoding.sampling import SamplingConfig, processed_logprobs
from specjax.decoding.tree import DraftTree
from specjax.models.cache import KVCache
from specjax.models.config import ConfigError, ModelConfig
from specjax.models.heads import mtp_forward, mtp_head_logits


def _chain_mask(num_chains: int, length: int) -> np.ndarray:
  """Block-diagonal causal mask `[C * T, C * T]` of `num_chains` chains of `length`."""
  return np.kron(np.eye(num_chains, dtype=bool), np.tril(np.ones((length, length), bool)))


@dataclasses.dataclass(frozen=True)
class MTPDrafter:
  """Drafts depth d with MTP module d - 1 (the tree depth is at most num_mtp_modules).

  Attributes:
    sampled: sample siblings without replacement (rejection verification) instead of top-w.
  """

  sampled: bool = False

  def validate(self, config: ModelConfig, tree: DraftTree) -> None:
    if not config.num_mtp_modules:
      raise ConfigError("MTPDrafter needs a model with num_mtp_modules >= 1")
    check_depth(self, tree, config.num_mtp_modules)

  def min_prompt_length(self, tree: DraftTree) -> int:
    # Module k's committed frontier is r - k - 1 >= 0 at the first round (r = prompt length).
    return max(tree.depth, 1)

  def init(self, params, config, drafter_params, ctx, tree, max_len, prompt_hidden):
    """Teacher-force the used modules over the prompt (ragged) and commit their frontiers."""
    b, p, _ = prompt_hidden.shape
    r = ctx.seq_len - 1  # root position == prompt length
    positions = jnp.broadcast_to(jnp.arange(p), (b, p))
    seq = jnp.pad(ctx.seq, ((0, 0), (0, config.num_mtp_modules + 1)))
    caches, last = [], []
    state_in = prompt_hidden
    for k in range(tree.depth):  # module k drafts depth k + 1; deeper ones are unused
      cache = KVCache.create(config, b, max_len, n_layers=1)
      commit = jnp.maximum(r - k, 0)
      out = mtp_forward(params, config, k, state_in, seq[:, k + 1:k + 1 + p], positions, cache,
                        advance=commit, compute_logits=False)
      caches.append(out.cache)
      last.append(jnp.take_along_axis(out.hidden, jnp.maximum(commit - 1, 0)[:, None, None],
                                      axis=1)[:, 0])
      state_in = out.hidden
    return {"caches": tuple(caches), "last": tuple(last)}

  def propose(self, params, config: ModelConfig, state, ctx, tree: DraftTree,
              sampling: SamplingConfig, key: jax.Array) -> Proposal:
    b = ctx.seq.shape[0]
    draw = self.sampled and not sampling.greedy
    r = ctx.seq_len - 1
    tokens = jnp.zeros((b, tree.num_nodes + 1), jnp.int32)
    node_logprobs = jnp.zeros((b, tree.num_nodes + 1, config.vocab_size), jnp.float32)
    # chain_out: module (d - 1)'s outputs along each depth-(d - 1) node's chain [B, M, d - 1, Dm].
    chain_out = None
    for d in range(tree.depth):
      parents = tree.nodes_at_depth(d)
      m = len(parents)
      if d == 0:
        logits = mtp_head_logits(params, config, 0, state["last"][0])[:, None]  # [B, 1, V]
      else:
        # For each depth-d node x: positions r - d .. r - 1; tokens = x's ancestors at depths
        # 1..d; states = [module d-1's last committed output, module d-1's chain for parent].
        anc = np.stack([self._ancestors(tree, int(x), d) for x in parents])  # [M, d]
        chain_tokens = tokens[:, anc]  # [B, M, d]
        parent_slot = np.array([self._slot(tree, d - 1, int(tree.parent_array[x]))
                                for x in parents])
        first = jnp.broadcast_to(state["last"][d - 1][:, None, None],
                                 (b, m, 1, config.d_model))
        rest = chain_out[:, parent_slot, :d - 1] if d > 1 else first[:, :, :0]
        states = jnp.concatenate([first, rest], axis=2)  # [B, M, d, Dm]
        pos = (r - d)[:, None, None] + jnp.arange(d)[None, None, :]
        pos = jnp.broadcast_to(pos, (b, m, d)).reshape(b, m * d)
        out = mtp_forward(params, config, d, states.reshape(b, m * d, -1),
                          chain_tokens.reshape(b, m * d), pos, state["caches"][d],
                          new_mask=jnp.asarray(_chain_mask(m, d)), advance=0,
                          compute_logits=False)
        chain_out = out.hidden.reshape(b, m, d, -1)
        logits = mtp_head_logits(params, config, d, chain_out[:, :, -1])  # [B, M, V]
      lp = processed_logprobs(logits, sampling)
      node_logprobs = node_logprobs.at[:, parents].set(lp)
      children, toks = draft_children(tree, parents, lp,
                                      jax.random.fold_in(key, d) if draw else None)
      tokens = tokens.at[:, children].set(toks)
    return Proposal(tokens=tokens[:, 1:], logprobs=node_logprobs if draw else None)

  @staticmethod
  def _ancestors(tree: DraftTree, node: int, d: int) -> np.ndarray:
    """Node indices of `node`'s ancestors at depths 1..d (`node` itself last)."""
    path = []
    while node > 0:
      path.append(node)
      node = int(tree.parent_array[node])
    return np.array(path[::-1][:d], np.int32)

  @staticmethod
  def _slot(tree: DraftTree, d: int, node: int) -> int:
    return int(np.nonzero(tree.nodes_at_depth(d) == node)[0][0])

  def update(self, params, config, state, result):
    b, width = result.next_tokens.shape
    caches, last = [], []
    prev_window = result.path_hidden  # module 0's state inputs: the trunk along the path
    for k, cache in enumerate(state["caches"]):
      if k > 0:
        prev_window = jnp.concatenate([state["last"][k - 1][:, None], prev_window[:, :-1]], 1)
      positions = (result.start - k)[:, None] + jnp.arange(width)[None, :]
      out = mtp_forward(params, config, k, prev_window, result.next_tokens, positions, cache,
                        advance=result.count, compute_logits=False)
      caches.append(out.cache)
      newest = jnp.take_along_axis(out.hidden, jnp.maximum(result.count - 1, 0)[:, None, None],
                                   axis=1)[:, 0]
      last.append(jnp.where((result.count > 0)[:, None], newest, state["last"][k]))
      prev_window = out.hidden
    return {"caches": tuple(caches), "last": tuple(last)}
