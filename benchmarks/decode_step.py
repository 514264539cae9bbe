"""Cached decode step vs the memory floor, verify cost per row, and in-place cache updates.

    python benchmarks/decode_step.py            # full run (several minutes on 2 CPU cores)
    python benchmarks/decode_step.py --quick    # small config, batch 1 and 4, fewer repeats

What it measures, all in one process so the ratios are side by side:

1. Memory bandwidth of this machine, three ways on one large float32 array:
   - `copy`: a jitted `x + 1` whose input is donated, so the output reuses the input buffer.
     Bytes counted = bytes read + bytes written (2 x array size, the STREAM convention).
     This is the bandwidth the floor uses.
   - `read`: a jitted `jnp.sum(x)`; bytes counted = array size (read only).
   - `copy, fresh output`: `x + 1` without donation, so every call writes a newly allocated
     buffer. Counted like `copy`. It is far slower on Linux because the first touch of every
     fresh page faults; it is printed because a step that does not update its cache in place
     pays exactly this cost.
2. For each model config and batch B: one cached decode step (T=1) of a jitted function whose
   cache argument is donated, with `max_len` slots of which `committed` hold (random) entries.
   The step passes `advance=0`, so the lengths do not grow across repeats and every repeat
   does the same work. It returns the greedy next tokens (argmax computed in the graph, as a
   decoding engine would) and the cache.
   Memory floor = (weight bytes read + live KV bytes read) / copy bandwidth, where
   - weight bytes read = all parameters except an untied input-embedding table, of which a
     step only gathers B*T rows (a tied table is counted: the output head reads all of it);
   - live KV bytes read = layers x 2 (K and V) x B x (committed + T) x kv_heads x head_dim x
     itemsize: what attention must read. The implementation may read the whole `max_len`
     buffer (masked); that excess is part of what the ratio exposes.
3. Verification of T = 2, 4, 8, 16 new tokens per row (one forward, causal mask, advance=0),
   reported as multiples of the T=1 step. Speculative decoding pays this per round.
4. In-place checks: the donated input cache buffers are deleted after the call, the compiled
   executable aliases every cache buffer to an output, and the decode step time grows with
   `max_len` only by about the extra attention read; a non-donated step (positive control)
   shows what a per-step full-cache copy costs.

Timing: each function is compiled and warmed up first; repeats are interleaved round-robin
over T so machine noise hits every column alike; medians are reported, with the interquartile
range of the T=1 step as a percentage (`iqr%`) to show how noisy the machine was.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models import KVCache, ModelConfig, count_params, forward, init_params

# Llama-style GQA decoders in float32. "180m" follows the shape; it has 200.8M
# parameters in all, of which 168.1M (everything but the untied input embedding) are read by
# each decode step. The exact counts are printed.
CONFIGS: dict[str, ModelConfig] = {
    "25m": ModelConfig(vocab_size=8192, d_model=384, n_layers=12, n_heads=6, n_kv_heads=2,
                       head_dim=64, mlp_dim=1024, max_position=4096),
    "180m": ModelConfig(vocab_size=32000, d_model=1024, n_layers=12, n_heads=16, n_kv_heads=4,
                        head_dim=64, mlp_dim=2816, max_position=4096),
}


@dataclasses.dataclass(frozen=True)
class Bandwidth:
  """Measured bandwidths in bytes per second."""

  copy: float
  read: float
  copy_fresh: float


@dataclasses.dataclass
class Row:
  """One (config, batch) line of the main table."""

  config: str
  params: int
  weight_bytes: int
  batch: int
  kv_bytes: int
  step_s: float
  step_iqr: float
  floor_s: float
  verify_s: dict[int, float]


# ----------------------------------------------------------------------------- timing


def _median_iqr(samples: Sequence[float]) -> tuple[float, float]:
  q1, med, q3 = np.percentile(np.asarray(samples), [25, 50, 75])
  return float(med), float((q3 - q1) / med) if med > 0 else 0.0


def _timed(fn: Callable, *args):
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - start


# ----------------------------------------------------------------------------- bandwidth


def measure_bandwidth(megabytes: int, repeats: int) -> Bandwidth:
  """Copy (in place), read-only and copy-to-fresh-buffer bandwidth on a `megabytes` array."""
  n = megabytes * 2**20 // 4
  nbytes = n * 4
  # Donated: the output reuses the input buffer, so no page is touched for the first time.
  add_inplace = jax.jit(lambda x: x + 1.0, donate_argnums=0)
  add_fresh = jax.jit(lambda x: x + 1.0)
  total = jax.jit(jnp.sum)

  x = jnp.ones((n,), jnp.float32)
  for _ in range(2):
    x = jax.block_until_ready(add_inplace(x))
  copy_t = []
  for _ in range(repeats):
    x, dt = _timed(add_inplace, x)
    copy_t.append(dt)

  jax.block_until_ready(total(x))
  read_t = [_timed(total, x)[1] for _ in range(repeats)]

  jax.block_until_ready(add_fresh(x))
  fresh_t = []
  for _ in range(max(3, repeats // 2)):
    y, dt = _timed(add_fresh, x)
    fresh_t.append(dt)
    del y
  del x
  return Bandwidth(copy=2 * nbytes / statistics.median(copy_t),
                   read=nbytes / statistics.median(read_t),
                   copy_fresh=2 * nbytes / statistics.median(fresh_t))


# ----------------------------------------------------------------------------- model setup


def weight_bytes_read(config: ModelConfig, params) -> int:
  """Parameter bytes one step must read (an untied input embedding is only gathered)."""
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  if not config.tie_embeddings:
    total -= params["embed"].size * params["embed"].dtype.itemsize
  return total


def live_kv_bytes(config: ModelConfig, batch: int, live_slots: int) -> int:
  """K and V bytes attention has to read for `live_slots` visible slots per row."""
  itemsize = jnp.dtype(config.compute_dtype).itemsize
  return (config.n_layers * 2 * batch * live_slots * config.n_kv_heads * config.head_dim
          * itemsize)


def filled_cache(config: ModelConfig, batch: int, max_len: int, committed: int,
                 key: jax.Array) -> KVCache:
  """A cache whose buffers hold random entries and whose rows have `committed` slots."""
  cache = KVCache.create(config, batch, max_len)
  keys = jax.random.split(key, 2 * config.n_layers)
  rand = lambda kk, buf: jax.random.normal(kk, buf.shape, buf.dtype)
  return cache.replace(
      keys=tuple(rand(kk, b) for kk, b in zip(keys[::2], cache.keys)),
      values=tuple(rand(kk, b) for kk, b in zip(keys[1::2], cache.values)),
  ).set_lengths(jnp.full((batch,), committed, jnp.int32))


def make_step(config: ModelConfig, donate: bool = True) -> Callable:
  """`step(params, cache, tokens [B,T], positions [B,T]) -> (next tokens [B,T], cache)`."""

  def step(params, cache, tokens, positions):
    # advance=0: the written slots stay uncommitted, so repeats do identical work.
    out = forward(params, config, tokens, positions, cache, advance=0)
    return jnp.argmax(out.logits, axis=-1).astype(jnp.int32), out.cache

  # The cache is donated so XLA writes the new K/V into the caller's buffers in place.
  return jax.jit(step, donate_argnums=(1,) if donate else ())


def step_inputs(batch: int, num_new: int, committed: int, vocab: int):
  tokens = (jnp.arange(batch * num_new, dtype=jnp.int32).reshape(batch, num_new) * 7919) % vocab
  positions = jnp.broadcast_to(committed + jnp.arange(num_new, dtype=jnp.int32),
                               (batch, num_new))
  return tokens, positions


def run_interleaved(step: Callable, params, cache: KVCache, inputs: dict[int, tuple],
                    warmup: int, repeats: int) -> tuple[dict[int, list[float]], KVCache]:
  """Time `step` for every T in `inputs`, round-robin; the cache is threaded through."""
  for _ in range(warmup):
    for tokens, positions in inputs.values():
      (_, cache), _ = _timed(step, params, cache, tokens, positions)
  times: dict[int, list[float]] = {t: [] for t in inputs}
  for _ in range(repeats):
    for t, (tokens, positions) in inputs.items():
      (_, cache), dt = _timed(step, params, cache, tokens, positions)
      times[t].append(dt)
  return times, cache


# ----------------------------------------------------------------------------- in-place checks


def aliased_outputs(step: Callable, *args) -> int:
  """How many outputs the compiled executable aliases to (donated) inputs."""
  text = step.lower(*args).compile().as_text()
  header = text.split("\n", 1)[0]
  match = re.search(r"input_output_alias=\{(.*?)\}\s*(,|$)", header)
  return 0 if match is None else len(re.findall(r"alias\)", match.group(1)))


def check_donation(config: ModelConfig, params, committed: int, max_len: int,
                   key: jax.Array) -> dict:
  """Call the donated step once; report whether the input cache buffers were consumed."""
  step = make_step(config)
  cache = filled_cache(config, 1, max_len, committed, key)
  tokens, positions = step_inputs(1, 1, committed, config.vocab_size)
  n_alias = aliased_outputs(step, params, cache, tokens, positions)
  before = np.asarray(cache.keys[0])
  _, new_cache = jax.block_until_ready(step(params, cache, tokens, positions))
  buffers = cache.keys + cache.values
  deleted = sum(b.is_deleted() for b in buffers)
  # The step must have written exactly one slot (K entries of one token) and kept the rest;
  # counting changed elements does not depend on the buffer layout.
  changed = int(np.sum(np.asarray(new_cache.keys[0]) != before))
  return {"deleted": deleted, "buffers": len(buffers), "aliased": n_alias,
          "changed": changed, "expected_changed": config.n_kv_heads * config.head_dim}


def maxlen_scaling(config: ModelConfig, params, committed: int, max_lens: Sequence[int],
                   warmup: int, repeats: int, bw: Bandwidth, key: jax.Array) -> list[dict]:
  """Batch-1 decode step time vs max_len, donated and (positive control) not donated."""
  tokens, positions = step_inputs(1, 1, committed, config.vocab_size)
  donated, copied = make_step(config, donate=True), make_step(config, donate=False)
  caches = {s: filled_cache(config, 1, s, committed, key) for s in max_lens}
  for _ in range(warmup):
    for s in max_lens:
      _, caches[s] = jax.block_until_ready(donated(params, caches[s], tokens, positions))
      _, caches[s] = jax.block_until_ready(copied(params, caches[s], tokens, positions))
  times = {(s, d): [] for s in max_lens for d in (True, False)}
  for _ in range(repeats):
    for s in max_lens:
      for d, fn in ((True, donated), (False, copied)):
        (_, caches[s]), dt = _timed(fn, params, caches[s], tokens, positions)
        times[(s, d)].append(dt)
  base = min(max_lens)
  rows = []
  for s in max_lens:
    extra_read = live_kv_bytes(config, 1, s) - live_kv_bytes(config, 1, base)
    rows.append({
        "max_len": s,
        "donated_s": statistics.median(times[(s, True)]),
        "not_donated_s": statistics.median(times[(s, False)]),
        "cache_bytes": live_kv_bytes(config, 1, s),
        "expected_extra_s": extra_read / bw.copy,
    })
  return rows


# ----------------------------------------------------------------------------- main


def bench_config(name: str, config: ModelConfig, batches: Sequence[int],
                 verify: Sequence[int], max_len: int, committed: int, warmup: int,
                 repeats: int, bw: Bandwidth, key: jax.Array) -> list[Row]:
  params = init_params(config, key)
  n_params = count_params(params)
  w_bytes = weight_bytes_read(config, params)
  step = make_step(config)
  rows = []
  for batch in batches:
    t0 = time.perf_counter()
    cache = filled_cache(config, batch, max_len, committed, jax.random.fold_in(key, batch))
    inputs = {t: step_inputs(batch, t, committed, config.vocab_size) for t in (1, *verify)}
    times, cache = run_interleaved(step, params, cache, inputs, warmup, repeats)
    del cache
    step_s, iqr = _median_iqr(times[1])
    kv = live_kv_bytes(config, batch, committed + 1)
    rows.append(Row(config=name, params=n_params, weight_bytes=w_bytes, batch=batch,
                    kv_bytes=kv, step_s=step_s, step_iqr=iqr,
                    floor_s=(w_bytes + kv) / bw.copy,
                    verify_s={t: statistics.median(times[t]) for t in verify}))
    print(f"  [{name} B={batch}: step {step_s * 1e3:.2f} ms, "
          f"{time.perf_counter() - t0:.0f} s incl. compile]", file=sys.stderr, flush=True)
  return rows


def print_report(bw: Bandwidth, rows: list[Row], verify: Sequence[int], max_len: int,
                 committed: int, donation: dict | None, scaling: list[dict] | None,
                 scaling_config: str) -> None:
  gb = 1e9
  print()
  print(f"memory bandwidth (same run): copy in place {bw.copy / gb:.1f} GB/s (read+written), "
        f"read-only sum {bw.read / gb:.1f} GB/s, copy to fresh buffer {bw.copy_fresh / gb:.1f} "
        f"GB/s (page faults)")
  print(f"floor = (weight bytes read + live KV bytes) / {bw.copy / gb:.1f} GB/s; "
        f"cache max_len {max_len}, {committed} committed slots, float32, devices: "
        f"{jax.devices()[0].platform} x{jax.device_count()}")
  print()
  vcols = "".join(f"{'T=' + str(t):>7}" for t in verify)
  header = (f"{'config':>7} {'params':>8} {'read/step':>10} {'B':>3} {'step ms':>9} {'iqr%':>5} "
            f"{'floor ms':>9} {'x floor':>8}  verify T new tokens, x step:{vcols}")
  print(header)
  print("-" * len(header))
  for r in rows:
    vals = "".join(f"{r.verify_s[t] / r.step_s:7.2f}" for t in verify)
    print(f"{r.config:>7} {r.params / 1e6:7.1f}M {(r.weight_bytes + r.kv_bytes) / 2**20:8.0f}MB "
          f"{r.batch:>3} {r.step_s * 1e3:9.2f} {100 * r.step_iqr:5.0f} {r.floor_s * 1e3:9.2f} "
          f"{r.step_s / r.floor_s:8.2f}  {'':27}{vals}")
  print()
  if donation is not None:
    ok = donation["deleted"] == donation["buffers"]
    print(f"in-place check: {donation['deleted']}/{donation['buffers']} donated cache buffers "
          f"deleted after the call, {donation['aliased']} outputs aliased to inputs in the "
          f"compiled executable -> {'donation OK' if ok else 'DONATION NOT HONOURED'}; "
          f"{donation['changed']} key elements changed in layer 0 "
          f"(one slot = {donation['expected_changed']})")
  if scaling:
    base = scaling[0]
    print(f"decode step vs max_len ({scaling_config}, batch 1, {committed} committed; "
          f"'expected' = extra attention read of the larger buffer at copy bandwidth):")
    print(f"  {'max_len':>7} {'cache MB':>9} {'donated ms':>11} {'extra ms':>9} "
          f"{'expected':>9} {'not donated ms':>15} {'copy cost ms':>13}")
    for s in scaling:
      print(f"  {s['max_len']:>7} {s['cache_bytes'] / 2**20:9.1f} {s['donated_s'] * 1e3:11.2f} "
            f"{(s['donated_s'] - base['donated_s']) * 1e3:9.2f} "
            f"{s['expected_extra_s'] * 1e3:9.2f} {s['not_donated_s'] * 1e3:15.2f} "
            f"{(s['not_donated_s'] - s['donated_s']) * 1e3:13.2f}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--quick", action="store_true",
                      help="25m config, batch 1 and 4, T up to 8, 3 repeats, 256 MB bandwidth "
                           "array (unless overridden)")
  parser.add_argument("--configs", default=None,
                      help=f"comma-separated subset of {','.join(CONFIGS)}")
  parser.add_argument("--batches", default=None, help="comma-separated batch sizes (1,4,16)")
  parser.add_argument("--verify", default=None, help="comma-separated T values (2,4,8,16)")
  parser.add_argument("--repeats", type=int, default=None, help="timed repeats (7; quick 3)")
  parser.add_argument("--warmup", type=int, default=2, help="untimed calls after compiling")
  parser.add_argument("--max-len", type=int, default=256, help="cache slots per row")
  parser.add_argument("--committed", type=int, default=128, help="committed slots per row")
  parser.add_argument("--bandwidth-mb", type=int, default=None,
                      help="array size for the bandwidth measurement (512; quick 256)")
  parser.add_argument("--scaling-max-lens", default="256,1024",
                      help="max_len values for the in-place scaling check ('' to skip)")
  parser.add_argument("--scaling-config", default="25m", help="config for the scaling check")
  parser.add_argument("--json", default=None, help="also write the results to this file")
  args = parser.parse_args(argv)
  ints = lambda s: [int(v) for v in s.split(",") if v]
  args.configs = (args.configs or ("25m" if args.quick else "25m,180m")).split(",")
  for name in args.configs + [args.scaling_config]:
    if name not in CONFIGS:
      parser.error(f"unknown config {name!r}; allowed: {', '.join(CONFIGS)}")
  args.batches = ints(args.batches or ("1,4" if args.quick else "1,4,16"))
  args.verify = ints(args.verify or ("2,4,8" if args.quick else "2,4,8,16"))
  args.repeats = args.repeats or (3 if args.quick else 7)
  args.bandwidth_mb = args.bandwidth_mb or (256 if args.quick else 512)
  args.scaling_max_lens = ints(args.scaling_max_lens)
  if args.committed + max(args.verify) > args.max_len:
    parser.error(f"--committed {args.committed} + largest T {max(args.verify)} must fit in "
                 f"--max-len {args.max_len}")
  return args


def main(argv: Sequence[str] | None = None) -> None:
  args = parse_args(argv)
  key = jax.random.key(0)
  print(f"[bandwidth on a {args.bandwidth_mb} MB array]", file=sys.stderr, flush=True)
  bw = measure_bandwidth(args.bandwidth_mb, max(5, args.repeats))

  rows: list[Row] = []
  for name in args.configs:
    rows += bench_config(name, CONFIGS[name], args.batches, args.verify, args.max_len,
                         args.committed, args.warmup, args.repeats, bw,
                         jax.random.fold_in(key, len(rows)))

  donation = scaling = None
  if args.scaling_max_lens:
    config = CONFIGS[args.scaling_config]
    params = init_params(config, key)
    print(f"[in-place checks on {args.scaling_config}]", file=sys.stderr, flush=True)
    donation = check_donation(config, params, args.committed, min(args.scaling_max_lens), key)
    scaling = maxlen_scaling(config, params, args.committed, args.scaling_max_lens,
                             args.warmup, args.repeats, bw, key)

  print_report(bw, rows, args.verify, args.max_len, args.committed, donation, scaling,
               args.scaling_config)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"bandwidth": dataclasses.asdict(bw),
                 "rows": [dataclasses.asdict(r) for r in rows],
                 "donation": donation, "scaling": scaling,
                 "args": {k: v for k, v in vars(args).items()}}, f, indent=1)


if __name__ == "__main__":
  main()
