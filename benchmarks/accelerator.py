"""One prepared run for a machine with an accelerator (one GPU, or a TPU host) for a few minutes.

    python benchmarks/accelerator.py --json out.json          # ~1.1B bf16 model, < 8 min (H200)
    python benchmarks/accelerator.py --smoke --json out.json  # tiny model on CPU, < 60 s (CI)
    python benchmarks/accelerator.py --sections spec,rl       # only some sections

It downloads nothing: every model has random weights built here. Seven sections, each a table
of ratios measured side by side in this run (see "Performance doctrine" in DESIGN.md):

1. `decode`: one cached decode step (T=1, cache donated, written in place) at batch 1, 4, 16,
   64 against the HBM floor, (weight bytes + live KV bytes) / copy bandwidth measured alongside
   (the conventions of `decode_step.py`), plus an in-place check of the compiled step.
2. `verify`: one forward over T = 2, 4, 8, 16 new tokens per row against the same cache, as a
   multiple of the decode step, at batch 1 and 16: what a speculative round's verification
   costs in plain steps.
3. `spec`: speculative vs plain decoding in the same engine (`specjax.decoding.generate`,
   greedy, a chain of `--chain` drafts) at batch 1, 16, 64. Random weights accept nothing,
   so this section uses CONTROLLED ACCEPTANCE: the target's weights are random except that
   its layers' output projections (`wo`, `w_down`) are scaled by `LAYER_OUT_SCALE` and its
   output head is a permutation of its input embedding, so its greedy next token is a fixed
   map of the current token (checked on every plain run: column `map`). `ControlledDrafter`
   proposes that map's continuation, each draft token replaced by another with probability
   1 - `keep`: a depth-d draft is accepted with probability keep**d, whatever the numerics.
   Its drafting is a table lookup, so `draft+` measures the engine's own work per round
   (acceptance, commit, loop), not a real drafter's. Dense matmul costs do not depend on
   weight values, so sections 1 and 2 use the same weights.
4. `rl`: one GRPO step (`specjax.rl.trainer`) split into its rollout (plain decoding,
   temperature 1), a log-prob recompute (one forward over prompt + response, no gradient:
   what several epochs, minibatches or a KL reference add per pass) and the update (gradient
   + Adam), each its own program, beside the fused step (`make_train_step`). The policy has
   plain random weights; `--rl-layers` shrinks it when the full model does not fit the budget,
   and the table says which model ran.
5. `attention`: the decode step of section 1 at batch 1, 16 and 64 under each attention
   implementation (`ModelConfig.attention_impl`: auto, dense, blocked, pallas), timed side by
   side, beside the step's weight products alone (`decode_step.make_matmuls_only`): what the
   attention and its loop cost on top of the matmuls. Blocked attention loops over the live
   blocks of each layer with a data-dependent trip count ("auto" picks it from 2048 slots).
6. `memory`: the one-device GRPO presets (`configs/qwen3_0p6b_grpo.py`, `qwen3_1p7b_one_device.py`,
   `arithmetic_tiny.py` for `--smoke`) planned for THIS device (`specjax.experiments.plan`:
   the fused step compiled on abstract inputs, nothing allocated): the device compiler's
   per-device bytes beside the analytical estimate in the model's compute dtype, under
   `model.remat` full and none and with LoRA, and the saving full remat buys in both. On a
   CPU the compiled column is XLA:CPU's (see the README's Plans); on a GPU or TPU it is the
   figure the planner's accelerator column predicts.
7. `rl_spec` (run before `memory`, the dearest): GRPO steps at 16, 64 and 256 rows with
   long-tail response lengths and compaction, plain vs speculative rollouts in the same run:
   the controlled drafter at the reference system's acceptance (3 tokens per round) and the
   history drafter (`HistoryDrafter`, its bank in the train state). The policy is section
   3's controlled target (`--rl-layers` layers); prompts are placed along its map so that
   every arm's responses have the same designed lengths. Rollout and fused-step ratios, beside
   `specjax.sim`'s prediction for the same shapes and measured acceptance.

Timing: programs are compiled and warmed up first; repeats are interleaved across the columns
of a row so that noise hits them alike; medians, with the interquartile range (`iqr%`) of the
main time. Short programs (a step, a forward, the bandwidth copy) are timed as `inner` calls
dispatched back to back and synchronised once, so the host's dispatch and synchronisation
latency is spread over them rather than added to each.

Budget: `--budget-s` (420 by default, so that a section started just before it still ends
within 8 minutes) is checked before each section and before each batch or program inside
one; what is left is skipped with a message, and the JSON (written after every section) says
so. A section that raises is reported as failed and the next one runs. The model config of
every section but `memory` comes from `model_config`, whose keyword overrides are where a
flag that changes the model (an attention implementation, say) goes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import runpy
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode_step as ds  # noqa: E402
from specjax import sim  # noqa: E402
from specjax.decoding import (DecodeLoop, DraftTree, Drafter, HistoryDrafter, Proposal,  # noqa: E402
                              SamplingConfig, generate)
from specjax.errors import ConfigError  # noqa: E402
from specjax.experiments.plan import GIB  # noqa: E402
from specjax.experiments.plan import plan as compile_plan  # noqa: E402
from specjax.models import ModelConfig, count_params, init_params  # noqa: E402
from specjax.models.config import ATTENTION_IMPLS  # noqa: E402
from specjax.models.lora import LoraConfig  # noqa: E402
from specjax.rl.data import PromptBatch  # noqa: E402
from specjax.rl.losses import GRPOConfig  # noqa: E402
from specjax.rl.rollouts import rollout, score
from specjax.rl.state import RolloutConfig, TrainConfig, init_train_state
from specjax.rl.trainer import make_train_step
from specjax.rl.updates import sequence_logprobs, update
from specjax.sharding import MeshConfig

SECTIONS = ("decode", "verify", "spec", "attention", "rl", "rl_spec", "memory")  # memory last: the dearest
LAYER_OUT_SCALE = 1e-3  # keeps the residual stream the current token's embedding (section 3)
# JSON fields that may be zero or negative; every other number a section writes is > 0.
SIGNED_FIELDS = ("draft", "changed", "same_lengths", "extra_cache_sized_ops", "cache_sized_ops", "iqr",
                 "plain_iqr", "spec_iqr", "spread", "lora", "savings")


@dataclasses.dataclass(frozen=True)
class Plan:
  """Sizes and repeats of a run (`FULL` for an accelerator, `SMOKE` for CI on a CPU)."""

  decode_batches: tuple[int, ...] = (1, 4, 16, 64)
  verify_batches: tuple[int, ...] = (1, 16)
  verify_tokens: tuple[int, ...] = (2, 4, 8, 16)
  spec_batches: tuple[int, ...] = (1, 16, 64)
  keep: tuple[float, ...] = (0.6, 0.9)
  chain: int = 4
  max_len: int = 2048        # cache slots of sections 1 and 2
  committed: int = 1024      # committed slots per row in sections 1 and 2
  prompt_len: int = 64       # sections 3 and 4
  max_new: int = 128         # new tokens per row in sections 3 and 4
  rl_prompts: int = 2
  rl_group: int = 8
  rl_spec_rows: tuple[int, ...] = (16, 64, 256)  # section 7
  rl_spec_group: int = 4
  rl_spec_new: int = 256
  rl_spec_acceptance: float = 3.0  # the reference system's 2.8-3.3 tokens per round
  rl_spec_repeats: int = 3
  repeats: int = 7           # timed samples of a step or forward
  inner: int = 10            # back-to-back calls per sample of a short program
  spec_repeats: int = 5      # timed generate calls per arm
  bandwidth_mb: int = 512
  attention_batches: tuple[int, ...] = (1, 16, 64)
  attention_impls: tuple[str, ...] = ("auto", "dense", "blocked", "pallas")
  # Section 6: (config file under configs/, model.remat, LoRA rank or 0), in the order run.
  memory: tuple[tuple[str, str, int], ...] = (
      ("qwen3_0p6b_grpo.py", "full", 0), ("qwen3_0p6b_grpo.py", "none", 0),
      ("qwen3_1p7b_one_device.py", "full", 0), ("qwen3_0p6b_grpo.py", "full", 16),
      ("qwen3_1p7b_one_device.py", "none", 0), ("qwen3_1p7b_one_device.py", "full", 16))


FULL = Plan()
# One batch size for sections 2 and 3: a CPU compiles each program for seconds. Section 3
# derives a round's time from a call less its prefill: 48 new tokens and the median of 5
# paired repeats keep that difference above a busy 2-core machine's hiccups (with 16 tokens
# and 2 repeats, 1.7 ms of rounds, it once came out negative in CI).
SMOKE = Plan(decode_batches=(1, 2), verify_batches=(2,), verify_tokens=(2, 4),
             spec_batches=(2,), attention_batches=(2,),
             attention_impls=("auto", "dense", "blocked"), chain=3, max_len=64, committed=32,
             prompt_len=8, max_new=48,
             rl_prompts=1, rl_group=2, rl_spec_rows=(4,), rl_spec_group=2, rl_spec_new=24,
             rl_spec_repeats=2, repeats=3, inner=2, spec_repeats=5, bandwidth_mb=16,
             memory=(("arithmetic_tiny.py", "full", 0), ("arithmetic_tiny.py", "none", 0),
                     ("arithmetic_tiny.py", "full", 4)))
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
ONE_DEVICE = MeshConfig(data=1, fsdp=1, tensor=1)


def model_config(smoke: bool, **overrides) -> ModelConfig:
  """The model of every section: a Llama-style GQA decoder in bfloat16 with ~1.1B parameters
  (d_model 2048, 16 layers, 32 heads / 8 kv heads of 64, MLP 8192, vocab 32000), or a tiny
  one for `--smoke`. A flag that changes the model is one more entry in `overrides`."""
  fields = dict(vocab_size=32000, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                head_dim=64, mlp_dim=8192, max_position=4096, dtype="bfloat16",
                param_dtype="bfloat16")
  if smoke:
    fields |= dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                   head_dim=16, mlp_dim=128, max_position=256)
  return ModelConfig(**(fields | overrides))


def describe_model(config: ModelConfig, n_params: int) -> str:
  attention = config.attention_impl
  return (f"{n_params:,} parameters ({n_params / 1e9:.2f}B): d_model {config.d_model}, "
          f"{config.n_layers} layers, {config.n_heads} heads / {config.n_kv_heads} kv heads of "
          f"{config.head_dim}, mlp {config.mlp_dim}, vocab {config.vocab_size}; dtype "
          f"{config.dtype}, params {config.param_dtype}, attention {attention}")


# ----------------------------------------------------------------------------- timing


class Clock:
  """Wall time since the start of the run, against the budget."""

  def __init__(self, budget_s: float):
    self.start, self.budget_s = time.perf_counter(), budget_s

  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  def over(self) -> bool:
    return self.elapsed() > self.budget_s


# One program per shape rather than a dispatch per layer and buffer (a 1B model has 32).
filled_cache = jax.jit(ds.filled_cache, static_argnums=(0, 1, 2, 3))


def _wall(fn: Callable[[], Any]) -> tuple[Any, float]:
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - start


def _median_iqr(samples: Sequence[float]) -> tuple[float, float]:
  return ds._median_iqr(samples)


def time_steps(step: Callable, params, cache, tokens, positions, n: int):
  """`n` calls of a cache-donating step dispatched back to back; (cache, seconds per call)."""
  start = time.perf_counter()
  for _ in range(n):
    _, cache = step(params, cache, tokens, positions)
  jax.block_until_ready(cache)
  return cache, (time.perf_counter() - start) / n


class CopyProbe:
  """In-place copy (`x + 1`, `x` donated) of a float32 array; bytes = read + written."""

  def __init__(self, megabytes: int, inner: int):
    self.inner = inner
    self.bytes_moved = 2 * (megabytes * 2**20 // 4) * 4
    # Donated: the output reuses the input buffer, as a decode step's cache write must.
    self._add = jax.jit(lambda x: x + 1.0, donate_argnums=0)
    self.x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
    for _ in range(2):
      self()

  def __call__(self) -> float:
    """Seconds per copy, over `inner` copies dispatched back to back."""
    start = time.perf_counter()
    for _ in range(self.inner):
      self.x = self._add(self.x)
    jax.block_until_ready(self.x)
    return (time.perf_counter() - start) / self.inner


# ----------------------------------------------------------------------------- controlled model


@functools.partial(jax.jit, static_argnums=0)
def cycle_map(vocab: int) -> tuple[np.ndarray, int, int]:
  """`(next_of [V], a, c)`: next_of[t] = (a t + c) mod V with a, c chosen (Hull-Dobell) so
  that the map is ONE cycle through the whole vocabulary: from any token, following it reaches
  any other, in a known number of steps (section 7 places each prompt that many steps before
  EOS, so response lengths are set by design)."""
  primes, n = [], vocab
  for p in range(2, vocab + 1):
    if n % p == 0:
      primes.append(p)
      while n % p == 0:
        n //= p
    if n == 1:
      break
  m = math.lcm(math.prod(primes), 4 if vocab % 4 == 0 else 1)
  a = 1 + m * max(1, vocab // m // 3) if m < vocab else 1  # a - 1: every prime of V, 4 | V
  c = next(x for x in range(vocab // 2 + 1, vocab + 1) if math.gcd(x, vocab) == 1)
  next_of = (a * np.arange(vocab, dtype=np.int64) + c) % vocab
  return next_of.astype(np.int32), a, c


def controlled_target(config: ModelConfig, key: jax.Array) -> tuple[dict, jax.Array]:
  """Random parameters whose greedy next token is `next_of[current token]`, and `next_of [V]`
  (`cycle_map`'s permutation).

  The layers' output projections are scaled by `LAYER_OUT_SCALE`, so the final hidden state
  is (nearly) the current token's embedding e_t, and the output head's column v is the
  embedding of `next_of`'s preimage of v: the logit of v = next_of[t] is |e_t|^2 / std, every
  other one a product of two independent random vectors, smaller by a factor ~sqrt(d_model).
  Shapes, dtypes and so every cost are those of `init_params`.
  """
  if config.tie_embeddings:
    raise ConfigError("controlled_target needs an untied output head (tie_embeddings=False)")
  params = init_params(config, key)
  next_of = jnp.asarray(cycle_map(config.vocab_size)[0])
  embed = params["embed"].astype(jnp.float32)
  head = embed[jnp.argsort(next_of)].T / jnp.std(embed)  # [E, V]
  params["unembed"] = head.astype(params["unembed"].dtype)
  params["layers"] = [
      layer | {name: (layer[name] * LAYER_OUT_SCALE).astype(layer[name].dtype)
               for name in ("wo", "w_down")}
      for layer in params["layers"]]
  return params, next_of


@struct.dataclass
class ControlledState:
  """`ControlledDrafter`'s state: next_of `[V]` the target's greedy map, keep (scalar) the
  probability that a draft token is the map's."""

  next_of: jax.Array
  keep: jax.Array

  UNBATCHED: ClassVar[tuple[str, ...]] = ("next_of", "keep")


@dataclasses.dataclass(frozen=True)
class ControlledDrafter(Drafter):
  """Benchmark-only drafter with controlled acceptance (deterministic drafts, a chain).

  Proposes the target's greedy continuation from the root, read from the `next_of` table
  (`drafter_params={"next_of": [V] int32, "keep": scalar}`), and replaces each draft token by
  a different random token with probability 1 - keep, so under greedy verification depth d
  is reached with probability keep**d. `keep` is an argument, not a static field, so one
  compiled loop serves every acceptance level.
  """

  def validate(self, config: ModelConfig, tree: DraftTree) -> None:
    if not tree.is_chain():
      raise ConfigError("ControlledDrafter drafts one continuation: use DraftTree.chain(k)")

  def init(self, params, config, drafter_params, ctx, tree, max_len, prompt, *,
           plain_rounds=False) -> ControlledState:
    return ControlledState(next_of=jnp.asarray(drafter_params["next_of"], jnp.int32),
                           keep=jnp.asarray(drafter_params["keep"], jnp.float32))

  def propose(self, params, config, state: ControlledState, ctx, tree: DraftTree,
              sampling: SamplingConfig, key: jax.Array) -> tuple[Proposal, ControlledState]:
    b, k = ctx.seq.shape[0], tree.num_nodes
    token, truth = ctx.root, []
    for _ in range(k):
      token = state.next_of[token]
      truth.append(token)
    truth = jnp.stack(truth, axis=1)  # [B, k]
    k_keep, k_other = jax.random.split(key)
    kept = jax.random.uniform(k_keep, (b, k)) < state.keep
    other = (truth + jax.random.randint(k_other, (b, k), 1, config.vocab_size)) % config.vocab_size
    return Proposal(tokens=jnp.where(kept, truth, other)), state


@dataclasses.dataclass(frozen=True)
class MapDrafter(ControlledDrafter):
  """`ControlledDrafter` with its map and keep probability fixed in the drafter (static), so it
  drafts inside a train step, whose rollout drafter reads no parameters of its own:
  `cycle_map(V)`'s continuation, each draft token kept with probability `keep`."""

  vocab: int = 0
  keep: float = 1.0

  def init(self, params, config, drafter_params, ctx, tree, max_len, prompt, *,
           plain_rounds=False) -> ControlledState:
    return ControlledState(next_of=jnp.asarray(cycle_map(self.vocab)[0]),
                           keep=jnp.float32(self.keep))


def keep_for(acceptance: float, k: int) -> float:
  """The keep probability p whose chain of k drafts accepts `acceptance` tokens per round
  (sum of p^d, d = 0 .. k): `specjax.sim`'s constant per-depth acceptance."""
  return sim.per_depth_from_mean(k, min(acceptance, k + 1.0))[0]


def map_agreement(tokens: np.ndarray, prompts: np.ndarray, lengths: np.ndarray,
                  next_of: np.ndarray, response_lengths: np.ndarray | None = None) -> float:
  """Fraction of generated tokens `[B, T]` (the first `response_lengths [B]` of each row, or
  all) that are `next_of` of the token before them."""
  last = prompts[np.arange(len(prompts)), lengths - 1]
  previous = np.concatenate([last[:, None], tokens[:, :-1]], axis=1)
  valid = (np.ones(tokens.shape, bool) if response_lengths is None
           else np.arange(tokens.shape[1])[None, :] < response_lengths[:, None])
  return float(np.sum((tokens == next_of[previous]) & valid) / np.sum(valid))


# ----------------------------------------------------------------------------- sections


@dataclasses.dataclass
class Context:
  """What the sections share."""

  plan: Plan
  smoke: bool
  config: ModelConfig
  params: dict
  next_of: jax.Array
  step: Callable  # `decode_step.make_step`: one jit, so sections share its compiled programs
  weight_bytes: int
  probe: CopyProbe
  clock: Clock
  key: jax.Array
  rl_layers: int | None
  log: Callable[[str], None]


def in_place_check(ctx: Context) -> dict:
  """Batch 1, T=1: the donated cache buffers are consumed, the compiled step aliases them to
  its outputs, writes exactly one slot, and materialises no cache-sized buffer beyond the
  2L writes (a copy or transpose of the cache would show up there). One compile."""
  c, plan = ctx.config, ctx.plan
  cache = filled_cache(c, 1, plan.max_len, plan.committed, ctx.key)
  tokens, positions = ds.step_inputs(1, 1, plan.committed, c.vocab_size)
  compiled = ctx.step.lower(ctx.params, cache, tokens, positions).compile()
  hlo = compiled.as_text()
  ops = ds.cache_sized_ops(hlo, math.prod(cache.keys[0].shape))
  before = np.asarray(jnp.copy(cache.keys[0]))  # a device copy: a NumPy view would pin it
  _, new_cache = jax.block_until_ready(compiled(ctx.params, cache, tokens, positions))
  buffers = cache.keys + cache.values
  return {"buffers": len(buffers), "deleted": sum(b.is_deleted() for b in buffers),
          "aliased": ds.aliased_outputs(hlo), "writes": 2 * c.n_layers,
          "extra_cache_sized_ops": sum(ops.values()) - 2 * c.n_layers,
          "cache_sized_ops": dict(ops),
          "changed": int(np.sum(np.asarray(new_cache.keys[0]) != before)),
          "one_slot": c.n_kv_heads * c.head_dim}


def section_decode(ctx: Context) -> dict:
  c, plan, step = ctx.config, ctx.plan, ctx.step
  out: dict[str, Any] = {"rows": []}
  for b in plan.decode_batches:
    if ctx.clock.over():
      out["partial"] = f"budget exceeded before batch {b}"
      break
    t0 = time.perf_counter()
    cache = filled_cache(c, b, plan.max_len, plan.committed, jax.random.fold_in(ctx.key, b))
    tokens, positions = ds.step_inputs(b, 1, plan.committed, c.vocab_size)
    for _ in range(2):  # compile, warm up
      cache, _ = time_steps(step, ctx.params, cache, tokens, positions, 1)
    steps, copies = [], []
    for _ in range(plan.repeats):
      copies.append(ctx.probe())
      cache, dt = time_steps(step, ctx.params, cache, tokens, positions, plan.inner)
      steps.append(dt)
    del cache
    step_s, iqr = _median_iqr(steps)
    bandwidth = ctx.probe.bytes_moved / statistics.median(copies)
    kv = ds.live_kv_bytes(c, b, plan.committed + 1)
    floor = (ctx.weight_bytes + kv) / bandwidth
    out["rows"].append({"batch": b, "step_ms": 1e3 * step_s, "best_ms": 1e3 * min(steps),
                        "iqr": iqr, "bandwidth_gbs": bandwidth / 1e9, "kv_bytes": kv,
                        "weight_bytes": ctx.weight_bytes, "floor_ms": 1e3 * floor,
                        "x_floor": step_s / floor, "tokens_per_s": b / step_s})
    ctx.log(f"  decode B={b}: {1e3 * step_s:.3f} ms ({time.perf_counter() - t0:.0f}s)")
  if not ctx.clock.over():
    out["in_place"] = in_place_check(ctx)
  return out


def section_verify(ctx: Context) -> dict:
  c, plan, step = ctx.config, ctx.plan, ctx.step
  out: dict[str, Any] = {"rows": []}
  for b in plan.verify_batches:
    if ctx.clock.over():
      out["partial"] = f"budget exceeded before batch {b}"
      break
    t0 = time.perf_counter()
    cache = filled_cache(c, b, plan.max_len, plan.committed, jax.random.fold_in(ctx.key, b))
    inputs = {t: ds.step_inputs(b, t, plan.committed, c.vocab_size)
              for t in (1, *plan.verify_tokens)}
    for tokens, positions in inputs.values():  # compile, warm up
      for _ in range(2):
        cache, _ = time_steps(step, ctx.params, cache, tokens, positions, 1)
    times: dict[int, list[float]] = {t: [] for t in inputs}
    for _ in range(plan.repeats):
      for t, (tokens, positions) in inputs.items():
        cache, dt = time_steps(step, ctx.params, cache, tokens, positions, plan.inner)
        times[t].append(dt)
    del cache
    step_s, iqr = _median_iqr(times[1])
    out["rows"].append({
        "batch": b, "step_ms": 1e3 * step_s, "iqr": iqr,
        "forward_ms": {t: 1e3 * statistics.median(times[t]) for t in plan.verify_tokens},
        "ratio": {t: statistics.median(times[t]) / step_s for t in plan.verify_tokens}})
    ctx.log(f"  verify B={b}: ({time.perf_counter() - t0:.0f}s)")
  return out


def section_spec(ctx: Context) -> dict:
  c, plan, step = ctx.config, ctx.plan, ctx.step
  k = plan.chain
  tree, drafter, sampling = DraftTree.chain(k), ControlledDrafter(), SamplingConfig(0.0)
  next_np = np.asarray(ctx.next_of)
  out: dict[str, Any] = {"rows": [], "chain": k, "keep": list(plan.keep)}
  for b in plan.spec_batches:
    if ctx.clock.over():
      out["partial"] = f"budget exceeded before batch {b}"
      break
    t0 = time.perf_counter()
    rng = np.random.default_rng(b)
    prompts = rng.integers(0, c.vocab_size, (b, plan.prompt_len)).astype(np.int32)
    lengths = np.full((b,), plan.prompt_len, np.int32)
    # Both arms get the speculative arm's cache, so they differ only by the tree.
    max_len = plan.prompt_len + plan.max_new + k + 1
    key = jax.random.key(1)  # the same every call: every repeat does the same work
    common = dict(max_new_tokens=plan.max_new, sampling=sampling, max_len=max_len)
    arms: dict[float | None, Callable[[], Any]] = {
        None: lambda: generate(ctx.params, c, prompts, lengths, key, **common)}
    for p in plan.keep:
      dp = {"next_of": ctx.next_of, "keep": jnp.float32(p)}
      arms[p] = (lambda dp=dp: generate(ctx.params, c, prompts, lengths, key, drafter=drafter,
                                        tree=tree, drafter_params=dp, **common))
    loop = DecodeLoop(config=c, max_new_tokens=plan.max_new, max_len=max_len,
                      sampling=sampling)
    prefill = jax.jit(loop.prefill)
    prefill_args = (ctx.params, jnp.asarray(prompts), jnp.asarray(lengths), key, None)
    # The round's forwards alone, against a cache of the run's size holding the state halfway.
    committed = plan.prompt_len + plan.max_new // 2
    cache = filled_cache(c, b, max_len, committed, jax.random.fold_in(ctx.key, b))
    forwards = {t: ds.step_inputs(b, t, committed, c.vocab_size) for t in (1, k + 1)}
    results = {p: _wall(arm)[0] for p, arm in arms.items()}  # compile
    for p, arm in arms.items():
      results[p] = _wall(arm)[0]
    jax.block_until_ready(prefill(*prefill_args))
    for tokens, positions in forwards.values():
      for _ in range(2):
        cache, _ = time_steps(step, ctx.params, cache, tokens, positions, 1)
    compile_s = time.perf_counter() - t0
    times: dict[Any, list[float]] = {p: [] for p in arms} | {"prefill": [], 1: [], k + 1: []}
    for _ in range(plan.spec_repeats):
      for p, arm in arms.items():
        times[p].append(_wall(arm)[1])
      times["prefill"].append(_wall(lambda: prefill(*prefill_args))[1])
      for t, (tokens, positions) in forwards.items():
        for _ in range(plan.repeats):
          cache, dt = time_steps(step, ctx.params, cache, tokens, positions, plan.inner)
          times[t].append(dt)
    del cache
    plain = results[None]
    plain_tokens = np.asarray(plain.tokens)
    plain_rounds = int(plain.stats.rounds)
    plain_s, plain_iqr = _median_iqr(times[None])
    prefill_s = statistics.median(times["prefill"])
    # A round's time is the call's less its prefill, paired within each repetition (so that a
    # burst of load between repetitions cancels; a difference of medians once came out
    # negative at the smoke test's tiny shapes on a busy 2-core machine).
    less_prefill = lambda ts: statistics.median(t - f for t, f in zip(ts, times["prefill"]))
    plain_round = less_prefill(times[None]) / plain_rounds
    f1, fk = statistics.median(times[1]), statistics.median(times[k + 1])
    agreement = map_agreement(plain_tokens, prompts, lengths, next_np)
    for p in plan.keep:
      res = results[p]
      rounds = int(res.stats.rounds)
      spec_s, iqr = _median_iqr(times[p])
      spec_round = less_prefill(times[p]) / rounds
      per_rep = [a / s for a, s in zip(times[None], times[p])]
      cost, verify = spec_round / plain_round, fk / plain_round
      acc = float(res.stats.tokens_per_round)
      out["rows"].append({
          "batch": b, "keep": p, "expected_acc_len": sum(p**d for d in range(k + 1)),
          "acc_len": acc, "rounds": rounds, "plain_rounds": plain_rounds,
          "tail": float(np.mean(np.asarray(res.stats.row_rounds))) / rounds,
          "plain_ms": 1e3 * plain_s, "spec_ms": 1e3 * spec_s, "plain_iqr": plain_iqr,
          "spec_iqr": iqr, "speedup": plain_s / spec_s,
          "spread": (max(per_rep) - min(per_rep)) / statistics.median(per_rep),
          "prefill_ms": 1e3 * prefill_s, "plain_round_ms": 1e3 * plain_round,
          "spec_round_ms": 1e3 * spec_round, "forward1_ms": 1e3 * f1,
          "forward_verify_ms": 1e3 * fk, "cost": cost, "verify": verify, "draft": cost - verify,
          "forward_share": f1 / plain_round, "ideal": acc * f1 / fk,
          "map_agreement": agreement,
          "same_as_plain": float(np.mean(np.all(np.asarray(res.tokens) == plain_tokens, 1)))})
    ctx.log(f"  spec B={b}: plain {1e3 * plain_s:.1f} ms, map agreement {agreement:.3f} "
            f"({compile_s:.0f}s compile, {time.perf_counter() - t0:.0f}s in all)")
  return out


def even_reward(tokens: jax.Array, lengths: jax.Array, answers: jax.Array) -> jax.Array:
  """Toy JAX reward (fraction of even token ids): non-zero advantages, so the update works."""
  del answers
  valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
  return ((tokens % 2 == 0) & valid).sum(1) / jnp.maximum(lengths, 1)


def section_rl(ctx: Context) -> dict:
  plan = ctx.plan
  model = ctx.config if ctx.rl_layers is None else ctx.config.replace(n_layers=ctx.rl_layers)
  params = jax.jit(init_params, static_argnums=0)(model, jax.random.fold_in(ctx.key, 4))
  n_params = count_params(params)
  same = model == ctx.config
  config = TrainConfig(model=model, grpo=GRPOConfig(group_size=plan.rl_group),
                       rollout=RolloutConfig(max_new_tokens=plan.max_new, eos_id=None,
                                             sampling=SamplingConfig(1.0)))
  optimizer = optax.adam(1e-6)
  state = init_train_state(config, params, optimizer, seed=0)
  del params
  rng = np.random.default_rng(4)
  batch = PromptBatch(
      tokens=rng.integers(0, model.vocab_size, (plan.rl_prompts, plan.prompt_len)).astype(np.int32),
      lengths=np.full((plan.rl_prompts,), plan.prompt_len, np.int32),
      answers=np.zeros((plan.rl_prompts,), np.int32),
      index=np.arange(plan.rl_prompts, dtype=np.int32))
  rows = plan.rl_prompts * plan.rl_group
  temperature = config.rollout.sampling.logprob_temperature

  @jax.jit
  def rollout_fn(params, batch, key):
    roll, responses, lengths, _ = rollout(params, config, batch.tokens, batch.lengths, key)
    return score(config, roll, even_reward(responses, lengths, batch.answers))

  logprob_fn = jax.jit(lambda params, tokens: sequence_logprobs(params, model, tokens,
                                                                temperature)[0])
  # The state is donated: parameters and Adam moments are replaced, as in the fused step.
  update_fn = jax.jit(lambda st, roll, key: update(st, config, optimizer, roll, key),
                      donate_argnums=0)
  step_fn = make_train_step(config, even_reward, optimizer)
  out: dict[str, Any] = {"model": describe_model(model, n_params), "params": n_params,
                         "same_model": same, "rows_per_step": rows,
                         "tokens_per_row": plan.prompt_len + plan.max_new}
  key = jax.random.key(2)
  programs = ("rollout", "logprobs", "update", "step")
  times: dict[str, list[float]] = {}
  holder = {"state": state}

  def run(name: str) -> float:
    if name == "rollout":
      holder["roll"], dt = _wall(lambda: rollout_fn(holder["state"].params, batch, key))
    elif name == "logprobs":
      _, dt = _wall(lambda: logprob_fn(holder["state"].params, holder["roll"].tokens))
    elif name == "update":
      (holder["state"], _), dt = _wall(lambda: update_fn(holder["state"], holder["roll"], key))
    else:
      (holder["state"], _), dt = _wall(lambda: step_fn(holder["state"], batch))
    return dt

  compile_s = {}
  for name in programs:  # compile each program in turn, while the budget lasts
    if ctx.clock.over():
      out["partial"] = f"budget exceeded before compiling {name}"
      break
    compile_s[name] = run(name)
    run(name)
    times[name] = []
    ctx.log(f"  rl {name}: compiled in {compile_s[name]:.0f}s")
  for _ in range(plan.repeats):
    for name in times:
      times[name].append(run(name))
  out["compile_s"] = compile_s
  out["rows"] = []
  medians = {name: _median_iqr(ts) for name, ts in times.items()}
  split = medians["rollout"][0] + medians["update"][0] if "update" in medians else None
  for name, (med, iqr) in medians.items():
    row = {"program": name, "ms": 1e3 * med, "iqr": iqr}
    if split is not None and name != "step":
      row["share"] = med / split
    if name == "rollout":
      row["tokens_per_s"] = rows * plan.max_new / med
    if name in ("logprobs", "update", "step"):
      row["tokens_per_s"] = rows * (plan.prompt_len + plan.max_new) / med
    if name == "step" and split is not None:
      row["vs_split"] = med / split
    out["rows"].append(row)
  return out


def long_tail_lengths(prompts: int, max_new: int) -> np.ndarray:
  """Response lengths `[prompts]`, ascending: lognormal quantiles (median max_new / 6, sigma
  0.8), the longest at max_new, so a few rows hold the rollout up while the rest are done."""
  lengths = np.sort(sim.Lognormal(max_new / 6, 0.8, max_new).lengths(prompts))
  lengths[-1] = max_new
  return lengths.astype(np.int32)


def prompts_ending_after(next_of: np.ndarray, eos: int, lengths: np.ndarray, prompt_len: int,
                         rng: np.random.Generator) -> np.ndarray:
  """`[P, prompt_len]` random prompts whose last token is `lengths[p]` steps of the map
  before `eos`: the controlled target (greedy, or sampled: it is that peaked) answers prompt p
  with exactly `lengths[p]` tokens, the last one EOS."""
  before = np.argsort(next_of)  # the inverse map
  last = np.full(len(lengths), eos)
  for step in range(int(lengths.max())):
    last = np.where(step < lengths, before[last], last)
  prompts = rng.integers(0, len(next_of), (len(lengths), prompt_len))
  prompts[:, -1] = last
  return prompts.astype(np.int32)


def sim_device() -> tuple[sim.DeviceProfile, str]:
  """`specjax.sim`'s spec-sheet profile of this device, or the H200's where it has none."""
  kind = jax.devices()[0].device_kind
  for name in ("GB200", "B200", "H200", "H100"):
    if name.lower() in kind.lower():
      return sim.device_profile(name), name
  return sim.device_profile("H200"), f"H200 (spec sheet; this device, {kind}, has no profile)"


def section_rl_spec(ctx: Context) -> dict:
  """GRPO steps with long-tail responses and compaction: plain vs speculative rollouts.

  The policy is the controlled target (section 3) with `--rl-layers` layers. Each prompt's
  last token sits a chosen number of map steps before EOS, so its G responses have a length
  set by design (`long_tail_lengths`), identical in every arm: the arms differ only in how
  the rollout decodes. Arms: plain; `controlled`, a chain of k whose tokens are the map's
  with probability keep (set for `Plan.rl_spec_acceptance` tokens per round, the reference
  system's acceptance); `history`, the history drafter on the train state's bank, which the
  first (compiling) step fills: the same prompts come back every step, and this policy
  answers them as before, so it is an upper bound of what a converging policy gives. Each
  arm's rollout alone and its fused step (rollout + reward + update, one program) are timed,
  interleaved across arms; beside them `specjax.sim`'s prediction for the same shapes from
  the arm's measured acceptance and the measured lengths.
  """
  plan, c = ctx.plan, ctx.config
  model = c if ctx.rl_layers is None else c.replace(n_layers=ctx.rl_layers)
  params = ctx.params if model == c else controlled_target(model, ctx.key)[0]
  next_of = np.asarray(ctx.next_of)
  g, k, n = plan.rl_spec_group, plan.chain, plan.rl_spec_new
  eos = 1
  keep = keep_for(plan.rl_spec_acceptance, k)
  profile, device_name = sim_device()
  spec_model = sim.ModelSpec.from_model_config(model)
  arms: dict[str, tuple[Any, Any]] = {
      "plain": (None, None),
      "controlled": (MapDrafter(vocab=model.vocab_size, keep=keep), DraftTree.chain(k)),
      "history": (HistoryDrafter(group_size=g), DraftTree.chain(k))}
  out: dict[str, Any] = {"model": describe_model(model, count_params(params)), "chain": k,
                         "keep": keep, "group": g, "max_new": n, "sim_device": device_name,
                         "rows": []}
  optimizer = optax.adam(1e-6)
  for rows in plan.rl_spec_rows:
    if ctx.clock.over():
      out["partial"] = f"budget exceeded before {rows} rows"
      break
    t0 = time.perf_counter()
    prompts_n = rows // g
    lengths = long_tail_lengths(prompts_n, n)
    rng = np.random.default_rng(rows)
    batch = PromptBatch(
        tokens=prompts_ending_after(next_of, eos, lengths, plan.prompt_len, rng),
        lengths=np.full((prompts_n,), plan.prompt_len, np.int32),
        answers=np.zeros((prompts_n,), np.int32), index=np.arange(prompts_n, dtype=np.int32))
    compaction = max(1, min(3, rows.bit_length() - 3))  # down to rows / 8, at least 2 rows
    configs = {name: TrainConfig(
        model=model, grpo=GRPOConfig(group_size=g),
        rollout=RolloutConfig(max_new_tokens=n, eos_id=eos, sampling=SamplingConfig(1.0),
                              drafter=drafter, tree=tree, compaction=compaction))
        for name, (drafter, tree) in arms.items()}
    state = init_train_state(configs["plain"], jax.tree.map(jnp.copy, params), optimizer, 0)
    holder = {"state": state, "bank": configs["history"].rollout.drafter.new_bank(n)}
    steps = {name: make_train_step(cfg, even_reward, optimizer) for name, cfg in configs.items()}
    rollouts = {name: jax.jit(functools.partial(_rollout_lengths, cfg))
                for name, cfg in configs.items()}
    key = jax.random.key(3)
    results: dict[str, Any] = {}

    def run(name: str, program: str) -> float:
      bank = holder["bank"] if name == "history" else None
      if program == "rollout":
        results[name], dt = _wall(lambda: rollouts[name](holder["state"].params, bank,
                                                         batch.tokens, batch.lengths, key))
        return dt
      given = holder["state"].replace(history=bank)
      (state, _), dt = _wall(lambda: steps[name](given, batch))
      if bank is not None:
        holder["bank"] = state.history
      holder["state"] = state.replace(history=None)
      return dt

    for name in arms:  # compile; the history arm's first step fills its bank
      for program in ("step", "rollout"):
        run(name, program)
    compile_s = time.perf_counter() - t0
    times = {(name, program): [] for name in arms for program in ("rollout", "step")}
    for _ in range(plan.rl_spec_repeats):
      for name, program in times:
        times[name, program].append(run(name, program))
    plain_lengths = np.asarray(results["plain"][0])
    workload = sim.Workload(prompts_n, g, plan.prompt_len,
                            sim.Empirical(tuple(int(x) for x in plain_lengths)))
    medians = {key_: _median_iqr(ts) for key_, ts in times.items()}
    for name in arms:
      lengths_arm, acc, tokens = (np.asarray(x) for x in results[name])
      row = {"rows": rows, "arm": name, "compaction": compaction, "acc_len": float(acc),
             "rollout_ms": 1e3 * medians[name, "rollout"][0],
             "step_ms": 1e3 * medians[name, "step"][0],
             "rollout_iqr": medians[name, "rollout"][1], "iqr": medians[name, "step"][1],
             "length_mean": float(lengths_arm.mean()), "length_max": int(lengths_arm.max()),
             "same_lengths": bool(np.array_equal(lengths_arm, plain_lengths)),
             "map_agreement": map_agreement(tokens, np.repeat(batch.tokens, g, 0),
                                            np.repeat(batch.lengths, g, 0), next_of, lengths_arm)}
      if name != "plain":
        row["rollout_speedup"] = row_ratio(times, name, "rollout")
        row["step_speedup"] = row_ratio(times, name, "step")
        spec = sim.Speculation.chain("ngram", k, acceptance=min(max(float(acc), 1.0), k + 1.0))
        predicted = sim.compare(spec_model, sim.Cluster(profile, 1), workload, spec)
        row["sim_rollout_speedup"] = predicted.speedup("fixed", "generation")
        row["sim_step_speedup"] = predicted.speedup("fixed")
      out["rows"].append(row)
    out.setdefault("compile_s", {})[str(rows)] = compile_s
    ctx.log(f"  rl_spec {rows} rows: plain step {1e3 * medians['plain', 'step'][0]:.1f} ms "
            f"({compile_s:.0f}s compile, {time.perf_counter() - t0:.0f}s in all)")
    holder.clear()  # the arms' state and bank, before the next size allocates its own
  return out


def _rollout_lengths(config: TrainConfig, params, drafter_params, tokens, lengths, key):
  """A rollout's response lengths `[B]`, tokens per round and responses `[B, T]`."""
  roll, responses, response_lengths, _ = rollout(params, config, tokens, lengths, key,
                                                 drafter_params=drafter_params,
                                                 check_values=False)
  return response_lengths, roll.tokens_per_round, responses


def row_ratio(times: dict, name: str, program: str) -> float:
  """Plain's time over the arm's, the median of the ratios paired within each repetition."""
  return statistics.median(p / s for p, s in zip(times["plain", program], times[name, program]))


def memory_config(name: str, remat: str, lora_rank: int):
  """`configs/<name>`'s experiment with `model.remat` and a LoRA rank (0: none) set, as
  `specjax plan --config configs/<name> --model.remat R --lora.rank N` plans it (with LoRA,
  a model's own MTP / Medusa heads draft as they are, as `ExperimentConfig` requires)."""
  config = runpy.run_path(str(CONFIGS / name))["get_config"]()
  config = dataclasses.replace(config, model=dataclasses.replace(config.model, remat=remat))
  if lora_rank:
    heads = config.model.num_mtp_modules or config.model.num_medusa_heads
    drafter = dataclasses.replace(config.drafter, loss_weight=0.0) if heads else config.drafter
    config = dataclasses.replace(config, lora=LoraConfig(rank=lora_rank), drafter=drafter)
  return config


def section_attention(ctx: Context) -> dict:
  c, plan = ctx.config, ctx.plan
  steps = {impl: ctx.step if impl == c.attention_impl
           else ds.make_step(c.replace(attention_impl=impl)) for impl in plan.attention_impls}
  matmuls = ds.make_matmuls_only(c)
  out: dict[str, Any] = {"rows": [], "impls": list(plan.attention_impls), "failed": {}}
  for b in plan.attention_batches:
    if ctx.clock.over():
      out["partial"] = f"budget exceeded before batch {b}"
      break
    t0 = time.perf_counter()
    tokens, positions = ds.step_inputs(b, 1, plan.committed, c.vocab_size)
    x = jnp.zeros((b, 1, c.d_model), c.compute_dtype)
    # One cache per implementation: each step donates the one it is given.
    caches = {impl: filled_cache(c, b, plan.max_len, plan.committed,
                                 jax.random.fold_in(ctx.key, b)) for impl in steps}
    for impl, step in list(steps.items()):  # compile, warm up
      try:
        for _ in range(2):
          caches[impl], _ = time_steps(step, ctx.params, caches[impl], tokens, positions, 1)
      except Exception as e:  # noqa: BLE001 - one implementation failing must not cost the rest
        out["failed"][impl] = f"B={b}: {type(e).__name__}: {e}"
        ctx.log(f"  attention {impl} FAILED at B={b}: {type(e).__name__}: {e}")
        del steps[impl], caches[impl]
    jax.block_until_ready(matmuls(ctx.params, x))

    def time_matmuls() -> float:
      start = time.perf_counter()
      for _ in range(plan.inner):
        y = matmuls(ctx.params, x)
      jax.block_until_ready(y)
      return (time.perf_counter() - start) / plan.inner

    times: dict[str, list[float]] = {name: [] for name in (*steps, "matmuls")}
    for _ in range(plan.repeats):
      for impl, step in steps.items():
        caches[impl], dt = time_steps(step, ctx.params, caches[impl], tokens, positions,
                                      plan.inner)
        times[impl].append(dt)
      times["matmuls"].append(time_matmuls())
    del caches
    medians = {name: _median_iqr(ts) for name, ts in times.items()}
    row = {"batch": b, "matmuls_ms": 1e3 * medians["matmuls"][0],
           "ms": {impl: 1e3 * medians[impl][0] for impl in steps},
           "iqr": {impl: medians[impl][1] for impl in steps}}
    out["rows"].append(row)
    shown = ", ".join(f"{impl} {ms:.3f}" for impl, ms in row["ms"].items())
    ctx.log(f"  attention B={b}: {shown} ms; matmuls {row['matmuls_ms']:.3f} ms "
            f"({time.perf_counter() - t0:.0f}s)")
  return out


def gib(n: float) -> float:
  return n / GIB


def device_gib() -> float | None:
  """The device's memory as JAX's allocator reports it (None where it does not)."""
  stats = jax.devices()[0].memory_stats() or {}
  limit = stats.get("bytes_limit")
  return gib(limit) if limit else None


def section_memory(ctx: Context) -> dict:
  device = jax.devices()[0]
  hbm = device_gib() or 80.0
  out: dict[str, Any] = {"rows": [], "platform": device.platform,
                         "device_kind": device.device_kind, "hbm_gib": hbm}
  for name, remat, rank in ctx.plan.memory:
    label = f"{name} remat={remat}" + (f" lora={rank}" if rank else "")
    if ctx.clock.over():
      out["partial"] = f"budget exceeded before {label}"
      break
    ctx.log(f"  memory {label}")
    p = compile_plan(memory_config(name, remat, rank), [device], mesh=ONE_DEVICE, hbm_gib=hbm,
             name=name)
    c, e = p.compiled, p.estimate
    out["rows"].append({
        "config": name, "remat": remat, "lora": rank, "parameters": p.shapes["parameters"],
        "compiled_gib": gib(c.total), "arguments_gib": gib(c.arguments),
        "temporaries_gib": gib(c.temporaries), "estimate_gib": gib(e.total),
        "estimate_f32_gib": gib(p.estimate_here.total), "estimate_arguments_gib": gib(e.arguments),
        "x_estimate": c.total / max(e.total, 1), "fits": p.fits, "compile_s": p.compile_s,
        "lower_s": p.lower_s, "largest": [[shape, gib(size)] for shape, size in p.largest]})
  # What full remat saves, compiled and predicted, for each (config, lora) run both ways.
  by = {(r["config"], r["lora"], r["remat"]): r for r in out["rows"]}
  out["savings"] = []
  for (config, rank, remat), none in by.items():
    full = by.get((config, rank, "full"))
    if remat != "none" or full is None:
      continue
    compiled = none["compiled_gib"] - full["compiled_gib"]
    predicted = none["estimate_gib"] - full["estimate_gib"]
    out["savings"].append({"config": config, "lora": rank, "compiled_gib": compiled,
                           "predicted_gib": predicted,
                           "saving_error": compiled / predicted - 1 if predicted else 0.0})
  return out


# ----------------------------------------------------------------------------- report


def print_header(ctx: Context, n_params: int, budget_s: float) -> dict:
  devices = jax.devices()
  header = {"jax": jax.__version__, "devices": [str(d) for d in devices],
            "device_kind": devices[0].device_kind, "platform": devices[0].platform,
            "model": describe_model(ctx.config, n_params), "params": n_params,
            "dtype": ctx.config.dtype, "smoke": ctx.smoke, "budget_s": budget_s,
            "plan": dataclasses.asdict(ctx.plan)}
  shown = ", ".join(header["devices"][:4]) + (" ..." if len(devices) > 4 else "")
  print(f"specjax accelerator benchmark: jax {jax.__version__}, {len(devices)} device(s) "
        f"[{shown}], kind {header['device_kind']}; dtype {ctx.config.dtype}")
  print(f"model: {header['model']}")
  print(f"budget {budget_s:.0f}s; copy bandwidth probe on a {ctx.plan.bandwidth_mb} MB float32 "
        f"array; {ctx.plan.repeats} repeats x {ctx.plan.inner} back-to-back calls per sample")
  return header


def print_decode(out: dict, plan: Plan) -> None:
  print(f"\n(1) decode step (T=1, cache donated, in place) vs the HBM floor = (weight bytes + "
        f"live KV bytes) / copy bandwidth; cache {plan.max_len} slots, {plan.committed} "
        f"committed")
  print(f"{'B':>4} {'step ms':>9} {'best ms':>9} {'iqr%':>5} {'GB/s':>7} {'read MB':>8} "
        f"{'floor ms':>9} {'x floor':>8} {'floor%':>7} {'tok/s':>9}")
  for r in out["rows"]:
    print(f"{r['batch']:>4} {r['step_ms']:9.3f} {r['best_ms']:9.3f} {100 * r['iqr']:5.0f} "
          f"{r['bandwidth_gbs']:7.1f} {(r['weight_bytes'] + r['kv_bytes']) / 2**20:8.0f} "
          f"{r['floor_ms']:9.3f} {r['x_floor']:8.2f} {100 / r['x_floor']:6.0f}% "
          f"{r['tokens_per_s']:9.0f}")
  ip = out.get("in_place")
  if ip:
    donated = ip["deleted"] == ip["buffers"]
    kinds = ", ".join(f"{n} x{c}" for n, c in sorted(ip["cache_sized_ops"].items()))
    print(f"in place (B=1): {ip['deleted']}/{ip['buffers']} donated cache buffers consumed, "
          f"{ip['aliased']} outputs aliased -> {'donation OK' if donated else 'NOT DONATED'}; "
          f"{ip['extra_cache_sized_ops']} cache-sized ops per step beyond the {ip['writes']} "
          f"writes (copies, transposes or dtype conversions of a whole cache buffer"
          f"{': ' + kinds if ip['extra_cache_sized_ops'] else ''}); {ip['changed']} key "
          f"elements changed (one slot = {ip['one_slot']})")


def print_verify(out: dict, plan: Plan) -> None:
  ts = plan.verify_tokens
  print(f"\n(2) verify cost: one forward over T new tokens per row / the decode step, same "
        f"cache ({plan.committed} committed)")
  print(f"{'B':>4} {'step ms':>9} {'iqr%':>5} |" + "".join(f"{'T=' + str(t):>7}" for t in ts)
        + f" | {'B*T max':>8}")
  for r in out["rows"]:
    print(f"{r['batch']:>4} {r['step_ms']:9.3f} {100 * r['iqr']:5.0f} |"
          + "".join(f"{r['ratio'][t]:7.2f}" for t in ts) + f" | {r['batch'] * ts[-1]:>8}")


def print_spec(out: dict, plan: Plan) -> None:
  k = out["chain"]
  print(f"\n(3) speculative vs plain decoding, same engine, greedy, chain of {k} drafts, "
        f"{plan.prompt_len}-token prompts, {plan.max_new} new tokens. CONTROLLED ACCEPTANCE: "
        f"a benchmark drafter proposes the target's known greedy map, each draft kept with "
        f"probability `keep` (not a real drafter; its drafting is a table lookup)")
  print(f"{'B':>4} {'keep':>5} {'E[acc]':>7} {'acc':>6} {'rounds':>7} {'tail':>5} "
        f"{'plain ms':>9} {'spec ms':>9} {'speedup':>8} {'spread':>7} | {'cost':>6} "
        f"{'verify':>7} {'draft+':>7} {'fwd/rnd':>8} {'ideal':>6} | {'map':>5} {'same':>5}")
  for r in out["rows"]:
    print(f"{r['batch']:>4} {r['keep']:5.2f} {r['expected_acc_len']:7.2f} {r['acc_len']:6.2f} "
          f"{r['rounds']:>7} {r['tail']:5.2f} {r['plain_ms']:9.1f} {r['spec_ms']:9.1f} "
          f"{r['speedup']:8.2f} {100 * r['spread']:6.0f}% | {r['cost']:6.2f} "
          f"{r['verify']:7.2f} {r['draft']:7.2f} {r['forward_share']:8.2f} {r['ideal']:6.2f} | "
          f"{r['map_agreement']:5.3f} {r['same_as_plain']:5.2f}")
  print("speedup = plain time / spec time (whole generate calls, medians). cost = spec round / "
        "plain round (prefill subtracted) = verify + draft+, in plain rounds: verify = the "
        "round's forward over k+1 tokens alone, draft+ = the rest (drafting, acceptance, "
        "commit, loop). fwd/rnd = T=1 forward / plain round. ideal = acc x F1 / F(k+1). map: "
        "plain tokens that follow the target's designed map (must be ~1). same: rows whose "
        "speculative tokens equal the plain ones (lossless greedy)")


def print_rl(out: dict, plan: Plan) -> None:
  which = ("the same model as sections 1-3, plain random weights" if out["same_model"]
           else "a SMALLER model than sections 1-3 (--rl-layers)")
  print(f"\n(4) GRPO step split: {plan.rl_prompts} prompts x G={plan.rl_group} = "
        f"{out['rows_per_step']} rows, {plan.prompt_len} + {plan.max_new} tokens, plain "
        f"rollout at temperature 1, Adam; policy: {which}: {out['model']}")
  print(f"{'program':<10} {'ms':>9} {'iqr%':>5} {'share':>6} {'tok/s':>10} {'compile s':>10}")
  for r in out["rows"]:
    share = f"{100 * r['share']:5.0f}%" if "share" in r else f"{'':>6}"
    print(f"{r['program']:<10} {r['ms']:9.2f} {100 * r['iqr']:5.0f} {share} "
          f"{r.get('tokens_per_s', float('nan')):10.0f} {out['compile_s'][r['program']]:10.1f}")
  step = next((r for r in out["rows"] if r["program"] == "step"), None)
  print("share: of rollout + update. logprobs: one no-gradient forward over the rollout, not "
        "part of this update (1 epoch, 1 minibatch, no KL reference)"
        + (f"; fused step / (rollout + update) = {step['vs_split']:.2f}"
           if step and "vs_split" in step else ""))


def print_rl_spec(out: dict, plan: Plan) -> None:
  print(f"\n(7) GRPO steps, plain vs speculative rollouts: G={out['group']}, {plan.prompt_len} "
        f"+ up to {out['max_new']} tokens (long tail by design, the same lengths in every arm), "
        f"compaction, temperature 1, chains of {out['chain']}; controlled keep "
        f"{out['keep']:.3f}; policy: the controlled target, {out['model']}")
  print(f"{'rows':>5} {'arm':<11} {'acc':>5} {'len':>6} {'rollout ms':>11} {'step ms':>9} "
        f"{'iqr%':>5} {'rollout x':>9} {'step x':>7} {'sim roll x':>10} {'sim step x':>10} "
        f"{'same':>5}")
  for r in out["rows"]:
    ratios = "".join(f"{r[f]:{w}.2f}" if f in r else f"{'':>{w}}" for f, w in (
        ("rollout_speedup", 10), ("step_speedup", 8), ("sim_rollout_speedup", 11),
        ("sim_step_speedup", 11)))
    print(f"{r['rows']:5d} {r['arm']:<11} {r['acc_len']:5.2f} {r['length_mean']:6.1f} "
          f"{r['rollout_ms']:11.1f} {r['step_ms']:9.1f} {100 * r['iqr']:5.0f}{ratios} "
          f"{'yes' if r['same_lengths'] else 'NO':>5}")
  print(f"x: plain's time over the arm's (median of paired repeats). sim: specjax.sim on "
        f"{out['sim_device']} from the arm's measured acceptance and lengths. same: every "
        "response as long as plain's (lossless on this designed policy)")


def print_attention(out: dict, plan: Plan) -> None:
  impls = [impl for impl in out["impls"] if impl not in out["failed"]]
  print(f"\n(5) decode step (T=1, {plan.committed} of {plan.max_len} slots committed) by "
        f"attention implementation, ms, beside the step's weight products alone (matmuls)")
  print(f"{'B':>4} {'matmuls':>8} |" + "".join(f"{impl:>9}" for impl in impls)
        + " | " + "".join(f"{'x ' + impl:>10}" for impl in impls))
  for r in out["rows"]:
    print(f"{r['batch']:>4} {r['matmuls_ms']:8.3f} |"
          + "".join(f"{r['ms'][impl]:9.3f}" for impl in impls) + " | "
          + "".join(f"{r['ms'][impl] / r['matmuls_ms']:10.2f}" for impl in impls))
  for impl, error in out["failed"].items():
    print(f"{impl} FAILED ({error}): left out from there on")
  print("x impl = the step / its matmuls: what attention, norms, the cache write and (blocked) "
        "the per-layer loop over live blocks add. auto is dense on a GPU and blocked elsewhere from "
        "2048 slots; pallas attends as auto where its GPU kernel does not apply (a warning "
        "says so)")


def print_memory(out: dict, plan: Plan) -> None:
  where = f"{out['device_kind']} ({out['platform']}), {out['hbm_gib']:.1f} GiB"
  print(f"\n(6) GRPO presets planned for this device, {where}: the fused step compiled by "
        f"this backend on abstract inputs (nothing allocated), GiB per device, beside the "
        f"analytical estimate (accelerator: activations in the compute dtype; f32: in float32)")
  print(f"{'config':<26} {'remat':<5} {'lora':>4} {'params':>7} {'compiled':>9} "
        f"{'args':>7} {'temps':>7} | {'estimate':>9} {'f32':>7} {'x est':>6} {'fits':>5} "
        f"{'compile s':>9}")
  for r in out["rows"]:
    print(f"{r['config']:<26} {r['remat']:<5} {r['lora'] or '-':>4} "
          f"{r['parameters'] / 1e9:6.2f}B {r['compiled_gib']:9.2f} {r['arguments_gib']:7.2f} "
          f"{r['temporaries_gib']:7.2f} | {r['estimate_gib']:9.2f} "
          f"{r['estimate_f32_gib']:7.2f} {r['x_estimate']:6.2f} {str(r['fits']):>5} "
          f"{r['compile_s']:9.1f}")
  for r in out["savings"]:
    print(f"full remat saves on {r['config']}" + (f" (LoRA {r['lora']})" if r["lora"] else "")
          + f": compiled {r['compiled_gib']:.2f} GiB, predicted {r['predicted_gib']:.2f} GiB "
          f"({100 * r['saving_error']:+.0f}%)")
  print("x est = compiled / estimate. args: the state and batch (exact on every backend); "
        "temps: the largest phase's buffers as this backend's scheduler keeps them")


PRINTERS = {"decode": print_decode, "verify": print_verify, "spec": print_spec,
            "attention": print_attention, "memory": print_memory, "rl": print_rl,
            "rl_spec": print_rl_spec}
RUNNERS = {"decode": section_decode, "verify": section_verify, "spec": section_spec,
           "attention": section_attention, "memory": section_memory, "rl": section_rl,
           "rl_spec": section_rl_spec}


# ----------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--smoke", action="store_true",
                      help="tiny model and sizes, the same code paths (CPU, < 60 s)")
  parser.add_argument("--json", default=None, help="write the results here (after each section)")
  parser.add_argument("--attention", default="auto", choices=ATTENTION_IMPLS,
                      help="ModelConfig.attention_impl of every section (auto; on a GPU try "
                           "pallas, the Pallas decode kernel)")
  parser.add_argument("--budget-s", type=float, default=420.0,
                      help="skip what is left once the run has taken this long (420)")
  parser.add_argument("--sections", default=",".join(SECTIONS),
                      help=f"comma-separated subset of {','.join(SECTIONS)}")
  parser.add_argument("--rl-layers", type=int, default=None,
                      help="layers of the policy of sections 4 and 7 (default: the full "
                           "model's)")
  parser.add_argument("--chain", type=int, default=None, help="draft chain length (4)")
  parser.add_argument("--keep", default=None,
                      help="comma-separated draft keep probabilities (0.6,0.9)")
  args = parser.parse_args(argv)
  args.sections = [s for s in args.sections.split(",") if s]
  unknown = set(args.sections) - set(SECTIONS)
  if unknown:
    parser.error(f"unknown sections {sorted(unknown)}; allowed: {', '.join(SECTIONS)}")
  plan = SMOKE if args.smoke else FULL
  if args.chain is not None:
    if args.chain < 1:
      parser.error("--chain must be >= 1")
    plan = dataclasses.replace(plan, chain=args.chain)
  if args.keep is not None:
    keep = tuple(float(x) for x in args.keep.split(",") if x)
    if not keep or not all(0.0 <= x <= 1.0 for x in keep):
      parser.error("--keep must be probabilities in [0, 1]")
    plan = dataclasses.replace(plan, keep=keep)
  if args.rl_layers is not None and args.rl_layers < 1:
    parser.error("--rl-layers must be >= 1")
  args.plan = plan
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  # On a CPU every program that draws threefry bits takes seconds to compile; RngBitGenerator
  # ("rbg") programs a fraction of that. The full run keeps JAX's default for every key the
  # engine and the train step see.
  with jax.default_prng_impl("rbg") if args.smoke else contextlib.nullcontext():
    return _run(args)


def _run(args: argparse.Namespace) -> int:
  clock = Clock(args.budget_s)
  log = lambda msg: print(f"[{clock.elapsed():5.0f}s] {msg}", file=sys.stderr, flush=True)
  plan = args.plan
  config = model_config(args.smoke, attention_impl=args.attention)
  key = jax.random.key(0, impl="rbg")  # weights and cache contents only
  params, next_of = controlled_target(config, key)
  n_params = count_params(params)
  ctx = Context(plan=plan, smoke=args.smoke, config=config, params=params, next_of=next_of,
                step=ds.make_step(config),  # donates the cache
                weight_bytes=ds.weight_bytes_read(config, params),
                probe=CopyProbe(plan.bandwidth_mb, plan.inner), clock=clock, key=key,
                rl_layers=args.rl_layers, log=log)
  report: dict[str, Any] = {"header": print_header(ctx, n_params, args.budget_s),
                            "sections": {}, "skipped": []}
  report["header"]["copy_bandwidth_gbs"] = ctx.probe.bytes_moved / statistics.median(
      ctx.probe() for _ in range(5)) / 1e9
  print(f"copy bandwidth (in place, read + written): "
        f"{report['header']['copy_bandwidth_gbs']:.1f} GB/s; setup {clock.elapsed():.0f}s",
        flush=True)

  def write() -> None:
    report["total_s"] = clock.elapsed()
    if args.json:
      Path(args.json).write_text(json.dumps(report, indent=1, default=float))

  for name in SECTIONS:
    if name not in args.sections:
      report["sections"][name] = {"skipped": "not selected (--sections)"}
      continue
    if clock.over():
      reason = (f"budget of {args.budget_s:.0f}s exceeded ({clock.elapsed():.0f}s) before "
                f"this section")
      report["sections"][name] = {"skipped": reason}
      report["skipped"].append(name)
      print(f"\nSKIPPED section {name}: {reason}", flush=True)
      write()
      continue
    start = clock.elapsed()
    log(f"section {name}")
    try:
      out = RUNNERS[name](ctx)
    except Exception as e:  # noqa: BLE001 - one failing section must not cost the others
      traceback.print_exc()
      out = {"error": f"{type(e).__name__}: {e}"}
    out["elapsed_s"] = clock.elapsed() - start
    report["sections"][name] = out
    if "error" in out:
      print(f"\nFAILED section {name}: {out['error']}", flush=True)
    else:
      PRINTERS[name](out, plan)
    note = f"; PARTIAL: {out['partial']}" if "partial" in out else ""
    print(f"[section {name}: {out['elapsed_s']:.0f}s, total {clock.elapsed():.0f}s{note}]",
          flush=True)
    write()
  print(f"\ntotal {clock.elapsed():.0f}s" + (f"; skipped: {', '.join(report['skipped'])}"
                                             if report["skipped"] else ""))
  write()
  return 0


if __name__ == "__main__":
  sys.exit(main())
