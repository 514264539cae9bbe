"""The generation loop: prefill, then a `lax.while_loop` of draft -> verify -> commit rounds.

Speculative and plain autoregressive decoding are the same compiled loop; plain decoding is
the empty tree (the verify pass is then a one-token decode step), so comparisons between them
measure only what speculation changes.

Per round, for every row: the drafter proposes a tree, one target forward scores the root and
every node (tree attention mask, positions = root position + depth), verification picks the
accepted path and the next token, the keys/values of the accepted path are moved into
contiguous cache slots, and the emitted tokens (accepted drafts + next token) are appended.
Rows accept different numbers of tokens; EOS and `max_new_tokens` are applied per row.

Glossary: B batch, P prompt buffer, L = P + max_new sequence buffer, N draft nodes, D depth,
V vocab, Dm d_model.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.decoding import verify as verify_lib
from specjax.decoding.drafters.base import DraftContext, Drafter, Proposal, RoundResult
from specjax.decoding.sampling import (SamplingConfig, processed_logprobs, reported_logprobs,
                                       sample_tokens)
from specjax.decoding.tree import DraftTree
from specjax.models.cache import KVCache
from specjax.models.config import ConfigError, ModelConfig
from specjax.models.transformer import forward

Params = dict[str, Any]


@struct.dataclass
class GenerationStats:
  """Speculation statistics of one `generate` call.

  Attributes:
    rounds: loop iterations (verify passes after the prefill).
    row_rounds: `[B]` rounds in which each row was still generating.
    accepted_per_depth: `[D]` fraction of row-rounds whose draft at depth d + 1 was accepted
      and emitted (drafts accepted beyond EOS or max_new_tokens are not counted).
    tokens_per_round: mean tokens emitted per row-round (mean acceptance length; 1 = plain).
  """

  rounds: jax.Array
  row_rounds: jax.Array
  accepted_per_depth: jax.Array
  tokens_per_round: jax.Array


@struct.dataclass
class GenerationResult:
  """Output of `generate`.

  Attributes:
    tokens: `[B, max_new_tokens]` generated tokens; entries at or after `lengths` are `pad_id`.
    lengths: `[B]` generated tokens per row (EOS included when it was generated).
    logprobs: `[B, max_new_tokens]` log softmax(logits / temperature) of each generated token
      under the target (temperature 1 for greedy); 0 after `lengths`.
    done: `[B]` rows that stopped at EOS or at `max_new_tokens`.
    stats: `GenerationStats`.
  """

  tokens: jax.Array
  lengths: jax.Array
  logprobs: jax.Array
  done: jax.Array
  stats: GenerationStats


@struct.dataclass
class DecodeState:
  """Carry of the decode loop.

  Attributes:
    seq: `[B, L]` prompt + generated tokens.
    seq_len: `[B]` valid entries of `seq`; the last is the root (not yet in the cache).
    logp: `[B, L]` reported log-probability of each generated token (at its `seq` index).
    generated: `[B]` tokens generated so far.
    done: `[B]`.
    cache: target `KVCache` holding `seq_len - 1` committed entries per row.
    last_hidden: `[B, Dm]` target hidden at position `seq_len - 2`.
    drafter_state: the drafter's pytree.
    key: PRNG key for the next round.
    rounds: scalar round counter.
    row_rounds: `[B]`.
    accepted_at_depth: `[D]` accepted-draft counts per depth, summed over row-rounds.
    emitted: scalar tokens emitted in rounds (excluding the first token from the prefill).
  """

  seq: jax.Array
  seq_len: jax.Array
  logp: jax.Array
  generated: jax.Array
  done: jax.Array
  cache: KVCache
  last_hidden: jax.Array
  drafter_state: Any
  key: jax.Array
  rounds: jax.Array
  row_rounds: jax.Array
  accepted_at_depth: jax.Array
  emitted: jax.Array


def _scatter_rows(buf: jax.Array, start: jax.Array, values: jax.Array,
                  count: jax.Array) -> jax.Array:
  """`buf[b, start[b] + j] = values[b, j]` for `j < count[b]`; other writes are dropped."""
  j = jnp.arange(values.shape[1])[None, :]
  idx = jnp.where(j < count[:, None], start[:, None] + j, buf.shape[1])
  return buf.at[jnp.arange(buf.shape[0])[:, None], idx].set(values.astype(buf.dtype),
                                                           mode="drop")


def _check_inputs(config: ModelConfig, prompt_tokens, prompt_lengths, max_new_tokens: int,
                  tree: DraftTree, drafter: Drafter | None, max_len: int) -> None:
  if prompt_tokens.ndim != 2:
    raise ValueError(f"prompt_tokens must be [batch, prompt_len], got shape "
                     f"{prompt_tokens.shape}")
  if prompt_lengths.shape != prompt_tokens.shape[:1]:
    raise ValueError(f"prompt_lengths must have shape [batch]={prompt_tokens.shape[:1]}, got "
                     f"{prompt_lengths.shape}")
  if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
    raise ConfigError(f"max_new_tokens={max_new_tokens!r} is invalid: must be an int >= 1")
  if tree.num_nodes and drafter is None:
    raise ConfigError("a draft tree needs a drafter: pass drafter=... or tree=None")
  if drafter is not None:
    drafter.validate(config, tree)
  if not isinstance(prompt_lengths, jax.core.Tracer):
    lengths = np.asarray(prompt_lengths)
    shortest = 1 if drafter is None else drafter.min_prompt_length(tree)
    if lengths.min() < shortest or lengths.max() > prompt_tokens.shape[1]:
      raise ValueError(f"prompt_lengths must be in [{shortest}, {prompt_tokens.shape[1]}] "
                       f"(the shortest prompt this drafter and tree can start from is "
                       f"{shortest}), got min {lengths.min()} max {lengths.max()}")
  needed = prompt_tokens.shape[1] + max_new_tokens + tree.num_nodes + 1
  if needed > max_len:
    raise ConfigError(
        f"prompt length {prompt_tokens.shape[1]} + max_new_tokens {max_new_tokens} + draft "
        f"tree nodes {tree.num_nodes} + 1 = {needed} does not fit the cache of {max_len} "
        f"slots (config.max_position={config.max_position}); shorten the prompt or "
        f"max_new_tokens, or raise max_position")


def generate(params: Params, config: ModelConfig, prompt_tokens: jax.Array,
             prompt_lengths: jax.Array, key: jax.Array, *, max_new_tokens: int,
             sampling: SamplingConfig = SamplingConfig(), drafter: Drafter | None = None,
             tree: DraftTree | None = None, eos_id: int | None = None,
             drafter_params: Any = None, max_len: int | None = None,
             pad_id: int = 0) -> GenerationResult:
  """Generate up to `max_new_tokens` per row, speculatively when a drafter is given.

  Args:
    params: target parameters (including its MTP / Medusa heads when those draft).
    config: target configuration.
    prompt_tokens: `[B, P]` right-padded prompts.
    prompt_lengths: `[B]` prompt lengths (1..P).
    key: PRNG key.
    max_new_tokens: exact upper bound of generated tokens per row.
    sampling: temperature / top-k / top-p (temperature 0 = greedy).
    drafter: a drafter (`specjax.decoding.drafters`), or None for plain decoding.
    tree: the draft tree (default: empty, i.e. plain decoding).
    eos_id: stop a row after it emits this token.
    drafter_params: parameters owned by the drafter (e.g. an external draft model's).
    max_len: cache slots (default: just enough: P + max_new_tokens + N + 1).
    pad_id: filler of `tokens` after each row's end.

  Returns:
    A `GenerationResult`. One compiled program per (shapes, config, sampling, drafter, tree).
  """
  tree = DraftTree.empty() if tree is None else tree
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
  if max_len is None:
    max_len = min(prompt_tokens.shape[1] + max_new_tokens + tree.num_nodes + 1,
                  config.max_position)
  _check_inputs(config, prompt_tokens, prompt_lengths, max_new_tokens, tree, drafter, max_len)
  return _generate(params, prompt_tokens, prompt_lengths, key, drafter_params, config=config,
                   max_new_tokens=max_new_tokens, sampling=sampling, drafter=drafter,
                   tree=tree, eos_id=eos_id, max_len=max_len, pad_id=pad_id)


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "sampling", "drafter",
                                             "tree", "eos_id", "max_len", "pad_id"))
def _generate(params, prompt_tokens, prompt_lengths, key, drafter_params, *, config,
              max_new_tokens, sampling, drafter, tree, eos_id, max_len, pad_id):
  b, p = prompt_tokens.shape
  total = p + max_new_tokens
  state = _prefill(params, config, prompt_tokens, prompt_lengths, key, drafter_params,
                   max_new_tokens=max_new_tokens, sampling=sampling, drafter=drafter,
                   tree=tree, eos_id=eos_id, max_len=max_len)

  def cond(s: DecodeState):
    return jnp.any(~s.done) & (s.rounds < max_new_tokens)

  body = functools.partial(_round, params, config, max_new_tokens=max_new_tokens,
                           sampling=sampling, drafter=drafter, tree=tree, eos_id=eos_id)
  state = jax.lax.while_loop(cond, body, state)

  j = jnp.arange(max_new_tokens)[None, :]
  idx = jnp.minimum(prompt_lengths[:, None] + j, total - 1)
  valid = j < state.generated[:, None]
  tokens = jnp.where(valid, jnp.take_along_axis(state.seq, idx, axis=1), pad_id)
  logprobs = jnp.where(valid, jnp.take_along_axis(state.logp, idx, axis=1), 0.0)
  row_rounds = state.row_rounds
  denom = jnp.maximum(row_rounds.sum(), 1).astype(jnp.float32)
  stats = GenerationStats(
      rounds=state.rounds, row_rounds=row_rounds,
      accepted_per_depth=state.accepted_at_depth.astype(jnp.float32) / denom,
      tokens_per_round=state.emitted.astype(jnp.float32) / denom)
  return GenerationResult(tokens=tokens, lengths=state.generated, logprobs=logprobs,
                          done=state.done, stats=stats)


def _prefill(params, config, prompt_tokens, prompt_lengths, key, drafter_params, *,
             max_new_tokens, sampling, drafter, tree, eos_id, max_len) -> DecodeState:
  """Run the prompt, sample the first token, and initialise the drafter."""
  b, p = prompt_tokens.shape
  total = p + max_new_tokens
  positions = jnp.broadcast_to(jnp.arange(p), (b, p))
  cache = KVCache.create(config, b, max_len)
  out = forward(params, config, prompt_tokens, positions, cache, advance=prompt_lengths)
  last = prompt_lengths - 1
  logits = jnp.take_along_axis(out.logits, last[:, None, None], axis=1)[:, 0]
  last_hidden = jnp.take_along_axis(out.hidden, last[:, None, None], axis=1)[:, 0]
  key, k_first = jax.random.split(key)
  first = sample_tokens(k_first, processed_logprobs(logits, sampling), sampling)
  seq = jnp.zeros((b, total), jnp.int32).at[:, :p].set(prompt_tokens)
  seq = seq.at[jnp.arange(b), prompt_lengths].set(first)
  logp = jnp.zeros((b, total), jnp.float32).at[jnp.arange(b), prompt_lengths].set(
      reported_logprobs(logits, first, sampling))
  done = jnp.full((b,), max_new_tokens <= 1)
  if eos_id is not None:
    done |= first == eos_id
  seq_len = prompt_lengths + 1
  ctx = DraftContext(seq=seq, seq_len=seq_len, last_hidden=last_hidden, done=done)
  drafter_state = None
  if drafter is not None:
    drafter_state = drafter.init(params, config, drafter_params, ctx, tree, max_len, out.hidden)
  return DecodeState(
      seq=seq, seq_len=seq_len, logp=logp, generated=jnp.ones((b,), jnp.int32), done=done,
      cache=out.cache, last_hidden=last_hidden, drafter_state=drafter_state, key=key,
      rounds=jnp.zeros((), jnp.int32), row_rounds=jnp.zeros((b,), jnp.int32),
      accepted_at_depth=jnp.zeros((max(tree.depth, 1),), jnp.int32),
      emitted=jnp.zeros((), jnp.int32))


def _round(params, config, s: DecodeState, *, max_new_tokens, sampling, drafter, tree,
           eos_id) -> DecodeState:
  """One draft -> verify -> commit round."""
  b = s.seq.shape[0]
  d = tree.depth
  key, k_draft, k_verify = jax.random.split(s.key, 3)
  ctx = DraftContext(seq=s.seq, seq_len=s.seq_len, last_hidden=s.last_hidden, done=s.done)
  if drafter is None or not tree.num_nodes:
    proposal = Proposal(tokens=jnp.zeros((b, 0), jnp.int32))
  else:
    proposal = drafter.propose(params, config, s.drafter_state, ctx, tree, sampling, k_draft)

  # One target pass over [root] + nodes; nothing is committed until the path is known.
  root_pos = s.seq_len - 1
  node_tokens = jnp.concatenate([ctx.root[:, None], proposal.tokens.astype(jnp.int32)], 1)
  positions = root_pos[:, None] + jnp.asarray(tree.depths)[None, :]
  out = forward(params, config, node_tokens, positions, s.cache,
                new_mask=jnp.asarray(tree.ancestor_mask), advance=0)
  if sampling.greedy or proposal.logprobs is None:
    ver = verify_lib.verify_matching(tree, node_tokens, out.logits, sampling, k_verify)
  else:
    ver = verify_lib.verify_sampled(tree, node_tokens, out.logits, proposal.logprobs,
                                    sampling, k_verify)
  a = ver.num_accepted

  # Tokens emitted this round: accepted drafts, then the next token at index a.
  j = jnp.arange(d + 1)[None, :]
  path_tokens = jnp.take_along_axis(node_tokens, ver.path, axis=1)  # [B, D + 1]
  shifted = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], 1)
  next_tokens = jnp.where(j == a[:, None], ver.next_token[:, None], shifted)
  count = a + 1
  if eos_id is not None:  # cut after the first EOS among the emitted tokens
    is_eos = (next_tokens == eos_id) & (j < count[:, None])
    count = jnp.where(jnp.any(is_eos, 1), jnp.argmax(is_eos, 1) + 1, count)
  count = jnp.where(s.done, 0, jnp.minimum(count, max_new_tokens - s.generated))
  finished = s.generated + count >= max_new_tokens
  if eos_id is not None:  # the last emitted token is EOS exactly when the row ended on it
    last_emitted = jnp.take_along_axis(next_tokens, jnp.maximum(count - 1, 0)[:, None], 1)
    finished |= (count > 0) & (last_emitted[:, 0] == eos_id)
  done = s.done | finished

  path_logits = jnp.take_along_axis(out.logits, ver.path[:, :, None], axis=1)
  emitted_logp = reported_logprobs(path_logits, next_tokens, sampling)
  seq = _scatter_rows(s.seq, s.seq_len, next_tokens, count)
  logp = _scatter_rows(s.logp, s.seq_len, emitted_logp, count)

  # Move the accepted path's keys/values (root + a drafts) to contiguous slots.
  base = s.cache.lengths
  cache = out.cache
  if not tree.is_chain():  # in a chain the accepted path is already contiguous
    cache = cache.gather_slots(base[:, None] + ver.path, base[:, None] + j)
  committed = jnp.where(s.done, 0, a + 1)
  cache = cache.advance(committed)

  path_hidden = jnp.take_along_axis(out.hidden, ver.path[:, :, None], axis=1)
  # The path repeats its last accepted node, so its last entry produced the next token.
  last_hidden = jnp.where(s.done[:, None], s.last_hidden, path_hidden[:, -1])
  drafter_state = s.drafter_state
  if proposal.drafter_state is not None:
    drafter_state = proposal.drafter_state
  if drafter is not None and tree.num_nodes:
    result = RoundResult(path_tokens=path_tokens, next_tokens=next_tokens,
                         path_hidden=path_hidden, start=root_pos, count=committed)
    drafter_state = drafter.update(params, config, drafter_state, result)

  active = ~s.done
  # Count accepted drafts that were emitted: EOS or max_new_tokens may cut an accepted run.
  emitted_drafts = jnp.minimum(a, count)
  depth_hits = (emitted_drafts[:, None] > jnp.arange(max(d, 1))[None, :]) & active[:, None]
  return DecodeState(
      seq=seq, seq_len=s.seq_len + count, logp=logp, generated=s.generated + count, done=done,
      cache=cache, last_hidden=last_hidden, drafter_state=drafter_state, key=key,
      rounds=s.rounds + 1, row_rounds=s.row_rounds + active,
      accepted_at_depth=s.accepted_at_depth + depth_hits.sum(0),
      emitted=s.emitted + count.sum())
