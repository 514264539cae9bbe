"""The generation loop: prefill, then a `lax.while_loop` of draft -> verify -> commit rounds.

Speculative and plain autoregressive decoding are the same compiled loop; plain decoding is
the empty tree (the verify pass is then a one-token decode step), so comparisons between them
measure only what speculation changes.

Per round, for every row: the drafter proposes a tree, one target forward scores the root and
every node (tree attention mask, positions = root position + depth), verification picks the
accepted path and the next token, the emitted tokens (accepted drafts + next token) are
appended, the keys/values of the accepted path are moved into contiguous cache slots, and the
drafter sees what was accepted. Rows accept different numbers of tokens; EOS and
`max_new_tokens` are applied per row.

`DecodeLoop` holds everything static about a call (model and sampling configuration,
drafter, tree, stopping rules, verifier) and is itself the static argument of the compiled
loop, as gemma's sampler is; `specjax.decoding.generate` is the function most callers want.
What the loop carries from round to round is `specjax.decoding.loop_state`'s.

Shape letters: see `specjax` (B batch, P prompt buffer, L = P + max_new sequence buffer,
N draft nodes, D depth, V vocab, E d_model).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from specjax.decoding.drafters.base import Drafter, Proposal, RoundResult, TargetFeatures, take_rows
from specjax.decoding.inputs import check_loop, check_prompt_values, host_check
from specjax.decoding.loop_state import (DecodeState, Emission, RowOutputs, compaction_buckets,
                                         scatter_rows, take_path)
from specjax.decoding.policy import AcceptanceCounts, Adaptive
from specjax.decoding.results import GenerationResult, GenerationStats
from specjax.decoding.sampling import (SamplingConfig, processed_logprobs, reported_logprobs,
                                       sample_tokens)
from specjax.decoding.tree import DraftTree
from specjax.decoding.verify import LosslessVerifier, Verifier, VerifyResult
from specjax.errors import ConfigError
from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig
from specjax.models.params import Params
from specjax.models.transformer import ForwardOutput, forward, unembed


@dataclasses.dataclass(frozen=True)
class DecodeLoop:
  """Everything static about a generation call; calling it runs the compiled loop.

  Attributes:
    config: target configuration.
    max_new_tokens: exact upper bound of generated tokens per row.
    max_len: target cache slots (must hold prompt buffer + max_new_tokens + N + 1).
    sampling: temperature / top-k / top-p (temperature 0 = greedy).
    drafter: a `Drafter`, or None for plain decoding.
    tree: the draft tree of every round (empty: plain decoding); unused with `speculation`.
    speculation: an `Adaptive` policy choosing each round's tree from its menu (needs costs).
    compaction: halvings of the batch as rows finish (0: none). With 2, the loop runs at B
      rows until at most B/2 are still generating, gathers those into a batch of B/2 (one
      copy of the caches), and so on down to B/4, so the long tail of a few slow rows runs
      at small-batch cost. The policy sees each phase's batch size.
    eos_id: stop a row after it emits this token, or any of these tokens (a sequence is
      stored as a tuple, so the loop stays hashable; chat checkpoints end turns on several,
      e.g. Llama 3's <|end_of_text|> and <|eot_id|>); None: run to max_new_tokens.
    pad_id: filler of `GenerationResult.tokens` after each row's end.
    verifier: how a tree is verified; `LosslessVerifier` keeps the target distribution.
  """

  config: ModelConfig
  max_new_tokens: int
  max_len: int
  sampling: SamplingConfig = SamplingConfig()
  drafter: Drafter | None = None
  tree: DraftTree = DraftTree.empty()
  speculation: Adaptive | None = None
  compaction: int = 0
  eos_id: int | tuple[int, ...] | None = None
  pad_id: int = 0
  verifier: Verifier = LosslessVerifier()

  def __post_init__(self):
    for field, value in check_loop(self).items():
      object.__setattr__(self, field, value)

  @property
  def menu(self) -> tuple[DraftTree, ...]:
    """The trees rounds may run: the policy's menu, or the one fixed tree."""
    return self.speculation.menu if self.speculation is not None else (self.tree,)

  @property
  def envelope(self) -> DraftTree:
    """The deepest tree of the menu: the drafter's state is built to serve it (and so every
    shallower one)."""
    return max(self.menu, key=lambda t: (t.depth, t.num_nodes))

  @property
  def max_nodes(self) -> int:
    return max(t.num_nodes for t in self.menu)

  @property
  def speculative(self) -> bool:
    return self.drafter is not None and self.max_nodes > 0

  @property
  def hidden_layers(self) -> tuple[int, ...]:
    """Target layers whose activations the drafter reads."""
    return self.drafter.hidden_layers(self.config) if self.speculative else ()

  def check_prompts(self, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
                    values: bool = True) -> None:
    """Raise a clear error unless the prompts fit this loop (shapes, lengths, ids, cache).

    Shapes and the cache's size are always checked here (`__call__` checks them too). Values
    (unless `values` is False) are checked here when they are
    concrete; under a caller's own `jit` they are checked when the program runs, by one host
    callback per call that raises the same message (the call fails, as it would outside
    `jit`, instead of returning a row decoded from past its prompt or with NaN log-probs),
    on every backend (`host_check`).
    """
    if prompt_tokens.ndim != 2:
      raise ValueError(f"prompt_tokens must be [batch, prompt_len], got shape "
                       f"{prompt_tokens.shape}")
    if prompt_lengths.shape != prompt_tokens.shape[:1]:
      raise ValueError(f"prompt_lengths must have shape [batch]={prompt_tokens.shape[:1]}, "
                       f"got {prompt_lengths.shape}")
    needed = prompt_tokens.shape[1] + self.max_new_tokens + self.max_nodes + 1
    if needed > self.max_len:
      raise ConfigError(
          f"prompt length {prompt_tokens.shape[1]} + max_new_tokens {self.max_new_tokens} + "
          f"draft tree nodes {self.max_nodes} + 1 = {needed} does not fit the cache of "
          f"{self.max_len} slots (config.max_position={self.config.max_position}); shorten "
          f"the prompt or max_new_tokens, or raise max_position")
    if not values:
      return
    check = functools.partial(
        check_prompt_values, vocab_size=self.config.vocab_size,
        shortest=self.drafter.min_prompt_length(self.envelope) if self.speculative else 1)
    if isinstance(prompt_tokens, jax.core.Tracer) or isinstance(prompt_lengths, jax.core.Tracer):
      host_check(check, prompt_tokens, prompt_lengths)
    else:
      check(prompt_tokens, prompt_lengths)

  @functools.partial(jax.jit, static_argnums=0)
  def __call__(self, params: Params, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
               key: jax.Array, drafter_params: Any = None,
               acceptance: AcceptanceCounts | None = None) -> GenerationResult:
    """Generate from `[B, P]` right-padded prompts of `[B]` lengths (see `generate`). Their
    shapes are checked here, their values are not: `generate` checks them, or call
    `check_prompts` first.

    `acceptance`: the speculation policy's counts from an earlier call (`stats.acceptance`).
    A call that the prior alone shows cannot gain from its drafter
    (`Adaptive.plain_throughout`, decided while tracing) runs without one whatever the counts
    say, and returns them unchanged. So does a call whose counts already have the policy
    switch the drafter off (`Adaptive.off`, which lasts for the rest of a call), asked for the
    whole batch before the prefill, decided on device: no drafter prefill, no drafter state.
    Rounds with the drafter off tell nothing about it and leave the counts as they are (what
    fades them between calls is the caller's carry, e.g. `RolloutConfig.acceptance_carry`).
    """
    # Shapes and the cache's size (static); values are `generate`'s to check (check_prompts).
    self.check_prompts(prompt_tokens, prompt_lengths, values=False)
    if acceptance is not None:
      acceptance = self._checked_acceptance(acceptance)
    # Padding may hold anything (`check_prompt_values`), but an id past the vocabulary embeds
    # as NaN, and the attention mask's zero weights times NaN would poison the row: zero it.
    prompt_tokens = jnp.where(jnp.arange(prompt_tokens.shape[1]) < prompt_lengths[:, None],
                              prompt_tokens, 0)
    if (self.speculation is not None
        and self.speculation.plain_throughout(self.buckets(prompt_tokens.shape[0]),
                                              self.max_new_tokens)):
      return self._without_drafter(params, prompt_tokens, prompt_lengths, key, acceptance)
    speculate = functools.partial(self._speculate, params, prompt_tokens, prompt_lengths, key,
                                  drafter_params)
    if self.speculation is None or acceptance is None:
      return speculate(acceptance)
    b = prompt_tokens.shape[0]
    first = self.speculation.choose(acceptance, b, jnp.asarray(b),
                                    jnp.asarray(self.max_new_tokens - 1, jnp.float32))
    return jax.lax.cond(first == self.speculation.off,
                        functools.partial(self._without_drafter, params, prompt_tokens,
                                          prompt_lengths, key),
                        speculate, acceptance)

  def _speculate(self, params: Params, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
                 key: jax.Array, drafter_params: Any,
                 acceptance: AcceptanceCounts | None) -> GenerationResult:
    """The call with its drafter (and policy, if any): prefill, then each compaction phase."""
    state = self.prefill(params, prompt_tokens, prompt_lengths, key, drafter_params)
    if acceptance is not None:
      state = state.replace(acceptance=acceptance)
    buckets = self.buckets(prompt_tokens.shape[0])
    outputs, rows = RowOutputs.of(state), jnp.arange(prompt_tokens.shape[0])
    for k in range(len(buckets)):
      smaller = buckets[k + 1] if k + 1 < len(buckets) else 0

      def cond(s: DecodeState, smaller=smaller):
        return ((~s.done).sum() > smaller) & (s.rounds < self.max_new_tokens)

      state = self.phase(params, cond, state)
      if smaller:  # file every row's output, then keep the live rows (and some finished)
        outputs = outputs.put(rows, RowOutputs.of(state))
        keep = jnp.argsort(state.done, stable=True)[:smaller]
        rows, state = rows[keep], self._take_rows(state, keep)
    last = RowOutputs.of(state)
    return self._result(state, outputs.put(rows, last) if len(buckets) > 1 else last,
                        prompt_lengths)

  def _without_drafter(self, params: Params, prompt_tokens: jax.Array,
                       prompt_lengths: jax.Array, key: jax.Array,
                       acceptance: AcceptanceCounts | None = None) -> GenerationResult:
    """Plain decoding with no drafter state at all, its statistics shaped as the policy's
    (every round counted as the menu's plain entry): what a call runs when the policy would
    choose plain decoding in every round (`Adaptive.plain_throughout`) or switch the drafter
    off before the first. Counts passed in come back as they were: rounds without the drafter
    tell nothing about it."""
    result = self.drafter_free(prompt_tokens.shape[1])(params, prompt_tokens, prompt_lengths,
                                                       key)
    stats = result.stats
    depth = max(self.envelope.depth, 1)
    if acceptance is None:
      acceptance = AcceptanceCounts.zeros(len(self.menu), depth)
    return result.replace(stats=stats.replace(
        accepted_per_depth=jnp.zeros((depth,), jnp.float32),
        tree_rounds=jnp.zeros((len(self.menu),), jnp.int32).at[0].set(stats.rounds),
        acceptance=acceptance.replace(rounds=acceptance.rounds + stats.rounds),
        drafter=self.drafter.stats(None) if self.speculative else {}))

  def _checked_acceptance(self, acceptance: Any) -> AcceptanceCounts:
    """Counts from another call must be this policy's: `[I, D]` for its menu; returned in
    the dtypes the loop carries (`AcceptanceCounts.normalized`)."""
    want = (len(self.menu), max(self.envelope.depth, 1))
    if self.speculation is None:
      raise ConfigError("acceptance counts are the speculation policy's; this call has none "
                        "(pass speculation=Adaptive(...), or acceptance=None)")
    if not isinstance(acceptance, AcceptanceCounts):
      raise ConfigError(f"acceptance must be AcceptanceCounts (an earlier call's "
                        f"stats.acceptance), got {type(acceptance).__name__}")
    acceptance = acceptance.normalized()
    shapes = (acceptance.reached.shape, acceptance.hits.shape)
    if shapes != (want, want):
      raise ConfigError(f"acceptance counts of shape {shapes[0]} do not fit this policy: its "
                        f"menu of {want[0]} entries (plain decoding included) and depth "
                        f"{want[1]} need {want}; pass the counts of a call with the same menu")
    return acceptance

  def drafter_free(self, prompt_len: int) -> DecodeLoop:
    """This loop without its drafter, nor the cache slots its trees would need (attention
    reads every slot), for prompts of `prompt_len` tokens: plain decoding alone."""
    slots = prompt_len + self.max_new_tokens + 1
    return dataclasses.replace(self, drafter=None, speculation=None,
                               max_len=min(self.max_len, slots))

  def buckets(self, batch: int) -> tuple[int, ...]:
    """The batch sizes the loop runs at (`compaction_buckets`)."""
    return compaction_buckets(batch, self.compaction)

  def _take_rows(self, s: DecodeState, rows: jax.Array) -> DecodeState:
    """The loop's state for rows `rows` only (per-row arrays, caches, drafter state)."""
    drafter_state = (self.drafter.take_rows(s.drafter_state, rows) if self.speculative
                     else s.drafter_state)
    return take_rows(s, rows).replace(drafter_state=drafter_state)

  # The prefill ----------------------------------------------------------------------------

  def prefill(self, params: Params, prompt_tokens: jax.Array, prompt_lengths: jax.Array,
              key: jax.Array, drafter_params: Any) -> DecodeState:
    """Run the prompt, sample the first token, and initialise the drafter."""
    b, p = prompt_tokens.shape
    positions = jnp.broadcast_to(jnp.arange(p), (b, p))
    cache = KVCache.create(self.config, b, self.max_len)
    # The output head only where the first token is sampled: `[B, P, V]` logits of every
    # prompt position would be the largest array of a rollout with a real vocabulary.
    out = forward(params, self.config, prompt_tokens, positions, cache, advance=prompt_lengths,
                  hidden_layers=self.hidden_layers, compute_logits=False)
    last = (prompt_lengths - 1)[:, None]
    last_hidden = take_path(out.hidden, last)[:, 0]
    logits = unembed(params, self.config, last_hidden)
    key, k_first = jax.random.split(key)
    first = sample_tokens(k_first, processed_logprobs(logits, self.sampling), self.sampling)
    rows = jnp.arange(b)
    seq = jnp.zeros((b, p + self.max_new_tokens), jnp.int32).at[:, :p].set(prompt_tokens)
    seq = seq.at[rows, prompt_lengths].set(first)
    logp = jnp.zeros(seq.shape, jnp.float32).at[rows, prompt_lengths].set(
        reported_logprobs(logits, first, self.sampling))
    done = jnp.full((b,), self.max_new_tokens <= 1)
    if self.eos_id is not None:
      done |= jnp.isin(first, jnp.asarray(self.eos_id))
    state = DecodeState(
        seq=seq, seq_len=prompt_lengths + 1, logp=logp, generated=jnp.ones((b,), jnp.int32),
        done=done, cache=out.cache, last_hidden=last_hidden, drafter_state=None, key=key,
        rounds=jnp.zeros((), jnp.int32), row_rounds=jnp.zeros((b,), jnp.int32),
        accepted_at_depth=jnp.zeros((max(self.envelope.depth, 1),), jnp.int32),
        emitted=jnp.zeros((), jnp.int32), drafts=jnp.zeros((), jnp.int32),
        tree_rounds=jnp.zeros((len(self.menu),), jnp.int32), segments=jnp.zeros((), jnp.int32),
        acceptance=AcceptanceCounts.zeros(len(self.menu), max(self.envelope.depth, 1)),
        drafter_off=jnp.zeros((), bool))
    if self.speculative:
      prompt = TargetFeatures(hidden=out.hidden, layers=out.intermediates)
      state = state.replace(drafter_state=self.drafter.init(
          params, self.config, drafter_params, state.context, self.envelope, self.max_len,
          prompt, plain_rounds=self.speculation is not None))
    return state

  # Phases, segments, rounds ---------------------------------------------------------------

  def phase(self, params: Params, more: Any, s: DecodeState) -> DecodeState:
    """The rounds at one batch size, while `more(state)` holds.

    With a speculation policy: segments (`segment`) while the policy picks a menu entry,
    then, once it switches the drafter off (`Adaptive.off`, for the rest of the call), plain
    rounds that leave the drafter behind. Those run outside the segments' `lax.switch`, which
    copies the caches into and out of its branch: a phase that starts with the drafter off
    (the counts carried into the call already say that no tree pays, or an earlier phase
    switched it off) costs what plain decoding without a drafter costs.
    """
    if self.speculation is None:
      return jax.lax.while_loop(more, functools.partial(self.round_of, 0, params), s)
    off = self.speculation.off
    drafting = lambda s: more(s) & ~s.drafter_off & (self._choice(s) != off)
    s = jax.lax.while_loop(drafting, functools.partial(self.segment, params, more), s)
    s = s.replace(drafter_off=s.drafter_off | more(s))  # the policy chose off, or already had
    plain = functools.partial(self.round_of, 0, params, keep_drafter=False)
    return jax.lax.while_loop(more, plain, s)

  def _progress(self, s: DecodeState) -> tuple[jax.Array, jax.Array]:
    """The live rows and the most tokens one of them still needs (the policy's stragglers):
    the batch is done when its slowest row is, in as many plain rounds."""
    live = (~s.done).sum()
    left = jnp.where(s.done, 0, self.max_new_tokens - s.generated).max()
    return live, left.astype(jnp.float32)

  def _choice(self, s: DecodeState) -> jax.Array:
    """The menu entry (or `Adaptive.off`) the policy picks for the next round."""
    return self.speculation.choose(s.acceptance, s.seq.shape[0], *self._progress(s))

  def segment(self, params: Params, more: Any, s: DecodeState) -> DecodeState:
    """Rounds of the menu entry the policy picks (never drafter off: `phase` runs those), for
    as long as `more(state)` holds and the policy keeps it (`Adaptive.keeps`).

    Running a segment rather than a round per `lax.switch` matters: XLA copies the caches
    into and out of the switch, a full pass over them, which per round cost more than the
    speculation saved at batch 16 (see `benchmarks/spec_decode.py`); per segment it is paid
    only when the choice changes.
    """
    batch = s.seq.shape[0]

    def run(entry: int, s: DecodeState) -> DecodeState:
      keep = lambda s: more(s) & self.speculation.keeps(entry, s.acceptance, batch,
                                                        *self._progress(s))
      return jax.lax.while_loop(keep, functools.partial(self.round_of, entry, params),
                                self.round_of(entry, params, s))

    # `phase` enters a segment only when its own evaluation of the choice is a menu entry;
    # should this one round differently to off, the segment runs plain decoding.
    entry = self._choice(s)
    entry = jnp.where(entry == self.speculation.off, 0, entry)
    branches = [functools.partial(run, i) for i in range(len(self.menu))]
    return jax.lax.switch(entry, branches, s.replace(segments=s.segments + 1))

  def round_of(self, entry: int, params: Params, s: DecodeState, *,
               keep_drafter: bool = True) -> DecodeState:
    """One draft -> verify -> emit -> commit round with menu entry `entry`'s tree
    (`keep_drafter=False`: a plain round that leaves the drafter's state behind)."""
    tree = self.menu[entry]
    key, k_draft, k_verify = jax.random.split(s.key, 3)
    proposal, drafter_state = self._draft(tree, params, s, k_draft)
    node_tokens = jnp.concatenate([s.context.root[:, None], proposal.tokens], 1)
    out, ver = self._verify(tree, params, s, node_tokens, proposal, k_verify)
    emission = self._emit(tree, s, node_tokens, out, ver)
    cache = self._commit(tree, s, out.cache, ver)
    if keep_drafter:
      drafter_state = self._update_drafter(params, s, drafter_state, node_tokens, out, ver,
                                           emission)
    last_hidden = jnp.where(s.done[:, None], s.last_hidden,
                            take_path(out.hidden, ver.path[:, -1:])[:, 0])
    return self._count(entry, s, proposal, ver, emission, keep_drafter).replace(
        seq=scatter_rows(s.seq, s.seq_len, emission.tokens, emission.count),
        logp=scatter_rows(s.logp, s.seq_len, emission.logprobs, emission.count),
        seq_len=s.seq_len + emission.count, generated=s.generated + emission.count,
        done=emission.done, cache=cache, last_hidden=last_hidden, drafter_state=drafter_state,
        key=key)

  def _draft(self, tree: DraftTree, params: Params, s: DecodeState,
             key: jax.Array) -> tuple[Proposal, Any]:
    if not (self.speculative and tree.num_nodes):
      return Proposal(tokens=jnp.zeros((s.seq.shape[0], 0), jnp.int32)), s.drafter_state
    proposal, state = self.drafter.propose(params, self.config, s.drafter_state, s.context,
                                           tree, self.sampling, key)
    if self.drafter.draws(self.sampling) != (proposal.logprobs is not None):
      raise ConfigError(
          f"{type(self.drafter).__name__}.propose returned "
          f"{'no' if proposal.logprobs is None else ''} draft logprobs while draws() is "
          f"{self.drafter.draws(self.sampling)}: sampled drafts must carry the distribution "
          "they were drawn from, deterministic drafts must not")
    return proposal.replace(tokens=proposal.tokens.astype(jnp.int32)), state

  def _verify(self, tree: DraftTree, params: Params, s: DecodeState, node_tokens: jax.Array,
              proposal: Proposal, key: jax.Array) -> tuple[ForwardOutput, VerifyResult]:
    """One target pass over [root] + nodes; nothing is committed until the path is known."""
    positions = (s.seq_len - 1)[:, None] + jnp.asarray(tree.depths)[None, :]
    out = forward(params, self.config, node_tokens, positions, s.cache,
                  new_mask=jnp.asarray(tree.ancestor_mask), advance=0,
                  hidden_layers=self.hidden_layers)
    if proposal.drafted is not None:  # nodes left out are marked -1: never accepted
      drafted = jnp.concatenate([jnp.ones_like(proposal.drafted[:, :1]), proposal.drafted], 1)
      node_tokens = jnp.where(drafted, node_tokens, -1)
    return out, self.verifier(tree, node_tokens, out.logits, proposal.logprobs,
                              self.sampling, key)

  def _emit(self, tree: DraftTree, s: DecodeState, node_tokens: jax.Array,
            out: ForwardOutput, ver: VerifyResult) -> Emission:
    """Accepted drafts then the next token, cut after the first EOS (any of `eos_id`) and at
    max_new_tokens."""
    b, eos = s.seq.shape[0], self.eos_id
    stops = lambda t: jnp.isin(t, jnp.asarray(eos))
    j = jnp.arange(tree.depth + 1)[None, :]
    a = ver.num_accepted
    path_tokens = take_path(node_tokens, ver.path)
    shifted = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], 1)
    tokens = jnp.where(j == a[:, None], ver.next_token[:, None], shifted)
    count = a + 1
    if eos is not None:  # cut after the first EOS among the emitted tokens
      is_eos = stops(tokens) & (j < count[:, None])
      count = jnp.where(jnp.any(is_eos, 1), jnp.argmax(is_eos, 1) + 1, count)
    count = jnp.where(s.done, 0, jnp.minimum(count, self.max_new_tokens - s.generated))
    finished = s.generated + count >= self.max_new_tokens
    if eos is not None:  # the last emitted token is EOS exactly when the row ended on it
      last = jnp.take_along_axis(tokens, jnp.maximum(count - 1, 0)[:, None], 1)[:, 0]
      finished |= (count > 0) & stops(last)
    logprobs = reported_logprobs(take_path(out.logits, ver.path), tokens, self.sampling)
    return Emission(tokens=tokens, logprobs=logprobs, count=count, done=s.done | finished)

  def _commit(self, tree: DraftTree, s: DecodeState, cache: KVCache,
              ver: VerifyResult) -> KVCache:
    """Move the accepted path's keys/values (root + a drafts) to contiguous slots."""
    base = s.cache.lengths[:, None]
    if not tree.is_chain():  # in a chain the accepted path is already contiguous
      cache = cache.gather_slots(base + ver.path, base + jnp.arange(tree.depth + 1))
    return cache.advance(jnp.where(s.done, 0, ver.num_accepted + 1))

  def _update_drafter(self, params: Params, s: DecodeState, drafter_state: Any,
                      node_tokens: jax.Array, out: ForwardOutput, ver: VerifyResult,
                      emission: Emission) -> Any:
    """The drafter sees every round's accepted path, plain rounds of a menu included."""
    if not self.speculative:
      return drafter_state
    # The path repeats its last accepted node, so features past `count` are harmless.
    features = TargetFeatures(hidden=take_path(out.hidden, ver.path),
                              layers=tuple(take_path(x, ver.path) for x in out.intermediates))
    result = RoundResult(path_tokens=take_path(node_tokens, ver.path),
                         next_tokens=emission.tokens, features=features,
                         start=s.seq_len - 1,
                         count=jnp.where(s.done, 0, ver.num_accepted + 1))
    return self.drafter.update(params, self.config, drafter_state, result)

  def _count(self, entry: int, s: DecodeState, proposal: Proposal, ver: VerifyResult,
             emission: Emission, keep_drafter: bool = True) -> DecodeState:
    """Round statistics: drafts cut by EOS or max_new_tokens are not counted as accepted
    (the policy's acceptance counts, which estimate the drafter, count them). The counts
    decay every round the drafter is kept (`Adaptive.decay`), not once it is off."""
    active = ~s.done
    drafts = (proposal.tokens.shape[1] if proposal.drafted is None
              else proposal.drafted.sum(1, dtype=jnp.int32))
    emitted_drafts = jnp.minimum(ver.num_accepted, emission.count)
    depth_hits = (emitted_drafts[:, None] > jnp.arange(s.accepted_at_depth.shape[0])[None, :])
    # Rounds with the drafter off (for the rest of the call) leave the counts as they are.
    decay = self.speculation.decay if self.speculation is not None and keep_drafter else 1.0
    acceptance = s.acceptance.observe(entry, self.menu[entry].depth, ver.num_accepted, active,
                                      decay)
    return s.replace(rounds=s.rounds + 1, row_rounds=s.row_rounds + active,
                     accepted_at_depth=s.accepted_at_depth + (depth_hits & active[:, None]).sum(0),
                     emitted=s.emitted + emission.count.sum(),
                     drafts=s.drafts + jnp.where(active, drafts, 0).sum(),
                     tree_rounds=s.tree_rounds.at[entry].add(1), acceptance=acceptance)

  def _result(self, s: DecodeState, out: RowOutputs,
              prompt_lengths: jax.Array) -> GenerationResult:
    """The result from every row's outputs `out` and the loop-wide counters of `s`."""
    j = jnp.arange(self.max_new_tokens)[None, :]
    idx = jnp.minimum(prompt_lengths[:, None] + j, out.seq.shape[1] - 1)
    valid = j < out.generated[:, None]
    denom = jnp.maximum(out.row_rounds.sum(), 1).astype(jnp.float32)
    stats = GenerationStats(
        rounds=s.rounds, row_rounds=out.row_rounds,
        accepted_per_depth=s.accepted_at_depth.astype(jnp.float32) / denom,
        tokens_per_round=s.emitted.astype(jnp.float32) / denom,
        drafts_per_round=s.drafts.astype(jnp.float32) / denom, tree_rounds=s.tree_rounds,
        segments=s.segments, acceptance=s.acceptance,
        drafter=self.drafter.stats(s.drafter_state) if self.speculative else {})
    return GenerationResult(
        tokens=jnp.where(valid, jnp.take_along_axis(out.seq, idx, axis=1), self.pad_id),
        lengths=out.generated,
        logprobs=jnp.where(valid, jnp.take_along_axis(out.logp, idx, 1), 0.0),
        done=out.done, stats=stats)
