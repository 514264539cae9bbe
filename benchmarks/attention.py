"""Attention whose cost follows the live context: decode and verify vs the cache size.

    python benchmarks/attention.py            # 30M config, batch 1 and 4, T 1 and 8 (~5 min)
    python benchmarks/attention.py --quick    # batch 1, max_len 1k and 8k, 3 repeats

An RL rollout with an 8k-32k token budget spends most of its steps with a cache that is
mostly empty. This script holds the text fixed (`--committed` live entries per row, 512) and
grows the buffer (`--max-lens`, 1k/4k/32k slots), timing one jitted forward over T new
tokens per row (T=1: a decode step; T>1: a speculative verify pass, causal mask) with the
cache donated and `advance=0` so every repeat does the same work. For each max_len it runs
the same step three ways:

- `dense`: the reference path, scoring every slot of the buffer;
- `blocked`: `specjax.models.attention.blocked_attention`, visiting only the blocks of
  `--block` slots below the longest live row;
- `auto`: what `ModelConfig(attention_impl="auto")` (the default) picks for that buffer.

Columns: median ms per step for each path, and `auto / base`: the default path's step
divided by the default path's step in the smallest buffer (the first `--max-lens` value):
1.0 means the step costs what the text costs, whatever the budget. `same` is the largest
absolute difference between dense and blocked logits (the outputs must agree at 1e-5), and
`copies` counts cache-sized ops beyond the in-place writes in the compiled blocked step
(0: the loop reads the buffer where it lies). Repeats are interleaved round-robin over every
(max_len, path) so machine noise hits every column alike; the table reports medians.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np

from decode_step import cache_sized_ops, filled_cache, make_step, step_inputs
from specjax.models import ModelConfig, forward, init_params

# The shape the issue measured: 8 layers, d_model 512, GQA 8/2 (about 30M parameters).
CONFIG = ModelConfig(vocab_size=32000, d_model=512, n_layers=8, n_heads=8, n_kv_heads=2,
                     head_dim=64, mlp_dim=1536, max_position=65536)
PATHS = ("dense", "blocked", "auto")


def _logits_fn(config: ModelConfig):
  """Jitted logits of the same forward as the timed step (cache not donated)."""
  return jax.jit(lambda params, cache, tokens, positions: forward(
      params, config, tokens, positions, cache, advance=0).logits)


def _extra_copies(config: ModelConfig, params, cache, tokens, positions) -> int:
  """Cache-sized ops in the compiled step beyond its 2L in-place writes."""
  hlo = make_step(config).lower(params, cache, tokens, positions).compile().as_text()
  return sum(cache_sized_ops(hlo, math.prod(cache.keys[0].shape)).values()) - 2 * config.n_layers


def measure(config: ModelConfig, params, batch: int, num_new: int, committed: int,
            max_lens: Sequence[int], warmup: int, repeats: int, key: jax.Array) -> list[dict]:
  """Time one (batch, T) point for every max_len and path; check dense == blocked."""
  tokens, positions = step_inputs(batch, num_new, committed, config.vocab_size)
  configs = {p: config.replace(attention_impl=p) for p in PATHS}
  steps = {p: make_step(configs[p]) for p in PATHS}
  caches = {(s, p): filled_cache(config, batch, s, committed, key)
            for s in max_lens for p in PATHS}
  rows = {s: {"batch": batch, "T": num_new, "max_len": s,
              "auto_is": ("blocked" if config.blocked_attention(s, jax.default_backend())
                          else "dense")}
          for s in max_lens}
  for s in max_lens:
    logits = {}
    for p in ("dense", "blocked"):
      logits[p] = np.asarray(_logits_fn(configs[p])(params, caches[(s, p)], tokens, positions))
    rows[s]["max_abs_diff"] = float(np.max(np.abs(logits["dense"] - logits["blocked"])))
    rows[s]["blocked_extra_copies"] = _extra_copies(configs["blocked"], params,
                                                    caches[(s, "blocked")], tokens, positions)
  for _ in range(warmup):
    for (s, p), cache in caches.items():
      caches[(s, p)] = jax.block_until_ready(steps[p](params, cache, tokens, positions))[1]
  times = {k: [] for k in caches}
  for _ in range(repeats):
    for (s, p), cache in caches.items():
      t0 = time.perf_counter()
      caches[(s, p)] = jax.block_until_ready(steps[p](params, cache, tokens, positions))[1]
      times[(s, p)].append(time.perf_counter() - t0)
  for (s, p), ts in times.items():
    rows[s][f"{p}_s"] = statistics.median(ts)
  base = rows[max_lens[0]]["auto_s"]
  for s in max_lens:
    rows[s]["auto_over_base"] = rows[s]["auto_s"] / base
  return [rows[s] for s in max_lens]


def print_table(rows: list[dict], committed: int, block: int) -> None:
  print(f"\nattention vs cache size: {committed} live entries per row, blocks of {block} "
        f"slots, float32, {jax.devices()[0].platform} x{jax.device_count()} "
        f"(jax {jax.__version__})")
  header = (f"{'B':>3} {'T':>3} {'max_len':>8} {'dense ms':>9} {'blocked ms':>11} "
            f"{'auto':>8} {'auto ms':>8} {'auto / base':>12} {'same':>9} {'copies':>7}")
  print(header)
  print("-" * len(header))
  for r in rows:
    print(f"{r['batch']:>3} {r['T']:>3} {r['max_len']:>8} {r['dense_s'] * 1e3:9.2f} "
          f"{r['blocked_s'] * 1e3:11.2f} {r['auto_is']:>8} {r['auto_s'] * 1e3:8.2f} "
          f"{r['auto_over_base']:12.2f} {r['max_abs_diff']:9.1e} {r['blocked_extra_copies']:>7}")
  print("auto / base: the default path's step over the default path's step in the smallest "
        "buffer of the same (B, T). same: max |dense - blocked| logits. copies: cache-sized "
        "ops beyond the in-place writes in the compiled blocked step.")


def main(argv: Sequence[str] | None = None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  ap.add_argument("--quick", action="store_true", help="batch 1, T 1 and 4, 1k and 8k, 3 repeats")
  ap.add_argument("--batches", default=None, help="comma-separated batch sizes (1,4)")
  ap.add_argument("--verify", default=None, help="comma-separated T values (1,8)")
  ap.add_argument("--max-lens", default=None, help="cache sizes (1024,4096,32768)")
  ap.add_argument("--committed", type=int, default=512, help="live entries per row")
  ap.add_argument("--block", type=int, default=CONFIG.attention_block,
                  help="slots per block of blocked attention")
  ap.add_argument("--repeats", type=int, default=None, help="timed repeats (7; quick 3)")
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--json", default=None, help="also write the rows to this file")
  args = ap.parse_args(argv)
  ints = lambda s: [int(v) for v in s.split(",") if v]
  batches = ints(args.batches or ("1" if args.quick else "1,4"))
  verify = ints(args.verify or ("1,4" if args.quick else "1,8"))
  max_lens = ints(args.max_lens or ("1024,8192" if args.quick else "1024,4096,32768"))
  repeats = args.repeats or (3 if args.quick else 7)
  if args.committed + max(verify) > min(max_lens):
    ap.error(f"--committed {args.committed} + largest T {max(verify)} must fit in the "
             f"smallest --max-lens {min(max_lens)}")
  config = CONFIG.replace(attention_block=args.block,
                          max_position=max(CONFIG.max_position, max(max_lens)))
  key = jax.random.key(0)
  params = init_params(config, key)
  rows = []
  for batch in batches:
    for t in verify:
      t0 = time.perf_counter()
      rows += measure(config, params, batch, t, args.committed, max_lens, args.warmup,
                      repeats, jax.random.fold_in(key, batch))
      print(f"  [B={batch} T={t}: {time.perf_counter() - t0:.0f} s incl. compile]",
            file=sys.stderr, flush=True)
  print_table(rows, args.committed, args.block)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"rows": rows, "args": vars(args)}, f, indent=1)
  return rows


if __name__ == "__main__":
  main()
