"""Seconds of one forward pass and of one decoding round on a replica of m devices.

    forward = matmul + attention + communication + n_layers * layer_overhead_s

  matmul         `hardware.matmul_seconds` of (matmul FLOP / m, weight bytes / m)
  attention      `hardware.attention_seconds` of (attention FLOP, KV bytes) / min(m, heads):
                 kv heads split over devices, replicated beyond K
  communication  two all-reduces of the activations per layer when m > 1 (after attention,
                 after the MLP; experts-parallel MoE combines with the same all-reduce)

A decoding round of a menu entry with N nodes and widths w_d, over b live rows at context c:

    round = forward(b rows, N + 1 tokens, c) + sum_d forward_drafter(b rows, M_d tokens, c)
            + logits(b (N + 1) V + sum_d b M_d V_draft)
            + round_overhead_s (+ spec_round_overhead_s when N > 0)

M_d = w_1 * ... * w_d is the number of nodes at depth d (a chain: 1 per depth). logits:
`hardware.logits_seconds`, the sampler's passes over the vocabulary V of every verified
position (and V_draft of every drafted node, when the drafter is a model), per live row: with
a large vocabulary this grows with the live batch like the KV reads, and at temperature > 0
it includes the random draw. The prefill samples each row's first token the same way.

Every function takes numbers or NumPy arrays (of live rows and contexts, one per round).

Shape letters: see `specjax` (N tree nodes, M nodes at one depth).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from specjax.sim.hardware import (DeviceProfile, attention_seconds, logits_seconds,
                                  matmul_seconds)
from specjax.sim.model import ModelSpec
from specjax.sim.parallel import all_reduce_seconds
from specjax.sim.speculation import MenuEntry


@dataclasses.dataclass(frozen=True)
class ForwardTime:
  """Seconds of a forward, by operation class (numbers or arrays)."""

  matmul: Any
  attention: Any
  communication: Any
  overhead: Any

  @property
  def total(self):
    return self.matmul + self.attention + self.communication + self.overhead


def forward_time(model: ModelSpec, profile: DeviceProfile, rows, tokens_per_row, context,
                 replica: int = 1, head_tokens=None) -> ForwardTime:
  """One forward over `rows` x `tokens_per_row` new tokens against `context` committed
  tokens per row, on a replica of `replica` devices."""
  work = model.forward_work(rows, tokens_per_row, context, head_tokens)
  matmul = matmul_seconds(profile, work.matmul_flops / replica, work.weight_bytes / replica)
  split = min(replica, model.n_kv_heads)
  attention = attention_seconds(profile, work.attention_flops / split, work.kv_bytes / split)
  comm = 2 * model.n_layers * all_reduce_seconds(profile, work.activation_bytes, replica)
  overhead = model.n_layers * profile.layer_overhead_s + 0.0 * matmul
  return ForwardTime(matmul, attention, comm + 0.0 * matmul, overhead)


def prefill_seconds(model: ModelSpec, profile: DeviceProfile, rows: int, prompt_len: int,
                    replica: int = 1, greedy: bool = False, samples: bool = True):
  """The prompt's forward (logits for the last token of each row only), and with `samples`
  (the target's prefill; a drafter's only reads the prompt) drawing each row's first token."""
  forward = forward_time(model, profile, rows, prompt_len, 0, replica, head_tokens=rows).total
  return forward + (logits_seconds(profile, rows * model.vocab, greedy) if samples else 0.0)


@dataclasses.dataclass(frozen=True)
class RoundTime:
  """Seconds of a decoding round, split: verification forward, drafting, the sampler's
  passes over the logits, fixed."""

  verify: Any
  draft: Any
  overhead: Any
  sampling: Any = 0.0

  @property
  def total(self):
    return self.verify + self.draft + self.sampling + self.overhead


def round_time(model: ModelSpec, profile: DeviceProfile, entry: MenuEntry, rows, context,
               drafter: ModelSpec | None = None, replica: int = 1,
               greedy: bool = False) -> RoundTime:
  """One round of `entry` over `rows` live rows at `context` tokens per row. `drafter`: the
  spec one drafting depth runs (`Speculation.drafter_spec`; None: free drafting). `greedy`:
  tokens are argmaxes, not draws (the sampler skips the random draw)."""
  rows = np.asarray(rows, float)
  verify = forward_time(model, profile, rows, entry.verify_tokens, context, replica).total
  draft = 0.0 * verify
  logits = rows * entry.verify_tokens * model.vocab
  if drafter is not None:
    for width in entry.nodes_per_depth:
      draft = draft + forward_time(drafter, profile, rows, width, context, replica).total
      logits = logits + rows * width * drafter.vocab
  overhead = profile.round_overhead_s + (profile.spec_round_overhead_s if entry.depth else 0.0)
  return RoundTime(verify, draft, overhead + 0.0 * verify,
                   logits_seconds(profile, logits, greedy) + 0.0 * verify)
