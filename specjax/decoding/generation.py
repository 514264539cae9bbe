"""`generate`: one call from prompts to a `GenerationResult`, speculative or plain.

It checks the call's arguments, sizes the cache, builds the static `DecodeLoop` and runs it.
With `speculation=Adaptive(menu)` and no measured costs it calibrates first, in the open: the
one step of a call that times rounds and may write the calibration cache.

Shape letters: see `specjax` (B batch, P prompt buffer).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from specjax.checks import is_int
from specjax.decoding.calibrate import calibrate
from specjax.decoding.drafters.base import Drafter
from specjax.decoding.engine import DecodeLoop
from specjax.decoding.inputs import as_ids, check_key
from specjax.decoding.policy import AcceptanceCounts, Adaptive
from specjax.decoding.results import GenerationResult
from specjax.decoding.sampling import SamplingConfig
from specjax.decoding.tree import DraftTree
from specjax.decoding.verify import LosslessVerifier, Verifier
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.params import Params, check_params


def generate(params: Params, config: ModelConfig, prompt_tokens: jax.Array,
             prompt_lengths: jax.Array, key: jax.Array, *, max_new_tokens: int,
             sampling: SamplingConfig = SamplingConfig(), drafter: Drafter | None = None,
             tree: DraftTree | None = None, speculation: Adaptive | None = None,
             eos_id: int | tuple[int, ...] | list[int] | None = None,
             drafter_params: Any = None, max_len: int | None = None,
             pad_id: int = 0, verifier: Verifier = LosslessVerifier(),
             acceptance: AcceptanceCounts | None = None,
             compaction: int = 0, check_values: bool = True) -> GenerationResult:
  """Generate up to `max_new_tokens` per row, speculatively when a drafter is given.

  Args:
    params: target parameters (including its MTP / Medusa heads when those draft).
    config: target configuration.
    prompt_tokens: `[B, P]` right-padded prompts.
    prompt_lengths: `[B]` prompt lengths (1..P).
    key: one PRNG key (`jax.random.key(seed)`, or the raw data of `jax.random.PRNGKey(seed)`).
    max_new_tokens: exact upper bound of generated tokens per row.
    sampling: temperature / top-k / top-p (temperature 0 = greedy).
    drafter: a drafter (`specjax.decoding.drafters`), or None for plain decoding.
    tree: one draft tree for every round (default: empty, i.e. plain decoding).
    speculation: `Adaptive(menu=...)`: each round runs the menu's tree (plain decoding
      included) with the most expected tokens per second. Without `costs`, this call first
      measures them with `calibrate` at these shapes (a timing run, cached on disk; see
      `specjax.decoding.calibrate`), which needs concrete arguments (not under jit); pass
      `Adaptive(menu, costs=calibrate(...))` to measure once and reuse.
    eos_id: stop a row after it emits this token, or any of these tokens (a list or tuple).
    drafter_params: parameters owned by the drafter (a draft model's, an EAGLE-3 head's).
    max_len: cache slots (default: just enough: P + max_new_tokens + N + 1).
    pad_id: filler of `tokens` after each row's end.
    verifier: the verification rule (default lossless; tests inject others).
    acceptance: the policy's counts from an earlier call (`result.stats.acceptance`).
    compaction: halve the batch this many times as rows finish (`DecodeLoop.compaction`).
    check_values: check the prompts' ids and lengths (shapes are always checked); under a
      caller's `jit` that takes a host callback per call, which gathers the prompts to one
      device. False for prompts checked where they were made: the GRPO train step's batches,
      encoded by the task's tokenizer (`ExperimentConfig` checks that the model embeds it).

  Returns:
    A `GenerationResult`. One compiled program per (shapes, `DecodeLoop`).
  """
  tree = DraftTree.empty() if tree is None else tree
  if not isinstance(tree, DraftTree):
    raise ConfigError(f"tree={tree!r} is invalid: must be a specjax.decoding.DraftTree (e.g. "
                      "DraftTree.chain(3), DraftTree.from_widths((2, 1))) or None")
  check_key(key)
  prompt_tokens = as_ids(prompt_tokens, "prompt_tokens", 2)
  prompt_lengths = as_ids(prompt_lengths, "prompt_lengths", 1)
  if max_len is None and isinstance(config, ModelConfig):  # just enough; DecodeLoop reports
    new = int(max_new_tokens) if is_int(max_new_tokens) else 0  # a bad config or length
    nodes = max(t.num_nodes for t in (speculation.menu if isinstance(speculation, Adaptive)
                                      else (tree,)))
    max_len = min(prompt_tokens.shape[1] + new + nodes + 1, config.max_position)
  loop = DecodeLoop(config=config, max_new_tokens=max_new_tokens, max_len=max_len,
                    sampling=sampling, drafter=drafter, tree=tree, speculation=speculation,
                    compaction=compaction, eos_id=eos_id, pad_id=pad_id, verifier=verifier)
  loop.check_prompts(prompt_tokens, prompt_lengths, values=check_values)
  check_params(params, config)
  if loop.speculative:
    drafter.check_params(drafter_params)
  if isinstance(acceptance, AcceptanceCounts):  # its type and shapes: DecodeLoop's to check
    acceptance = acceptance.normalized()
    acceptance.check_values()
  if speculation is not None and speculation.costs is None:
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((params, prompt_tokens))):
      raise ConfigError("speculation=Adaptive(menu) without costs cannot be calibrated under "
                        "jit: measure them first, Adaptive(menu, costs=calibrate(...))")
    costs = calibrate(params, config, drafter, speculation,
                      batch_sizes=loop.buckets(prompt_tokens.shape[0]),
                      prompt_len=prompt_tokens.shape[1],
                      max_new_tokens=max_new_tokens, drafter_params=drafter_params,
                      sampling=sampling, max_len=max_len)
    loop = dataclasses.replace(loop, speculation=speculation.with_costs(costs))
  return loop(params, prompt_tokens, prompt_lengths, key, drafter_params, acceptance)
