"""Cached decode step vs the memory floor, verify cost per row, and in-place cache updates.

    python benchmarks/decode_step.py            # full run (several minutes on 2 CPU cores)
    python benchmarks/decode_step.py --quick    # small config, batch 1 and 4, fewer repeats

What it measures, all in one process so the ratios are side by side:

1. Memory bandwidth of this machine, three ways on one large float32 array:
   - `copy`: a jitted `x + 1` whose input is donated, so the output reuses the input buffer.
     Bytes counted = bytes read + bytes written (2 x array size, the STREAM convention).
     This is the bandwidth the floor uses. Because other work on a shared machine changes it
     by up to 2x within minutes, the same copy is also timed once per repeat inside every
     (config, batch) measurement, and that row's floor uses the bandwidth measured alongside
     it (column `GB/s`).
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
   Memory floor = (weight bytes read + live KV bytes read) / copy bandwidth (that row's), where
   - weight bytes read = all parameters except an untied input-embedding table, of which a
     step only gathers B*T rows (a tied table is counted: the output head reads all of it);
   - live KV bytes read = layers x 2 (K and V) x B x (committed + T) x kv_heads x head_dim x
     itemsize: what attention must read. The implementation may read the whole `max_len`
     buffer (masked); that excess is part of what the ratio exposes.
   Next to it, `mm ms` times the step's matrix products alone: the same weights multiplied
   by B rows in the same order (q, k, v, o, gate, up, down per layer, then the output head)
   with nothing else, the best this XLA build does with these weights. `x mm` = step / mm:
   what the model code adds on top of its matmuls (attention, norms, RoPE, copies).
3. Verification of T = 2, 4, 8, 16 new tokens per row (one forward, causal mask, advance=0),
   reported as multiples of the T=1 step. Speculative decoding pays this per round.
4. In-place checks: the donated input cache buffers are deleted after the call, the compiled
   executable aliases every cache buffer to an output, the compiled HLO materialises no
   cache-sized buffer besides the one write per buffer (a copy or transpose of the cache
   would show up there), and the decode step time grows with `max_len` only by about the
   extra attention read; a non-donated step (positive control) shows what a per-step
   full-cache copy costs.

Timing: each function is compiled and warmed up first; repeats are interleaved round-robin
over T and the bandwidth probe so machine noise hits every column alike; medians are
reported, with the fastest T=1 step (`best ms`) and the interquartile range of the T=1 step
as a percentage (`iqr%`) to show how noisy the machine was.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
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
  copy_bandwidth: float
  step_s: float
  step_best_s: float
  step_iqr: float
  floor_s: float
  matmul_s: float
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


class CopyProbe:
  """In-place copy of a large float32 array; each call returns the seconds it took."""

  def __init__(self, megabytes: int):
    self.bytes_moved = 2 * (megabytes * 2**20 // 4) * 4  # read + written
    # Donated: the output reuses the input buffer, so no page is touched for the first time.
    self._add = jax.jit(lambda x: x + 1.0, donate_argnums=0)
    self.x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
    for _ in range(2):
      self()

  def __call__(self) -> float:
    self.x, dt = _timed(self._add, self.x)
    return dt


def measure_bandwidth(probe: CopyProbe, repeats: int) -> Bandwidth:
  """Copy (in place), read-only and copy-to-fresh-buffer bandwidth on the probe's array."""
  copy_t = [probe() for _ in range(repeats)]
  nbytes = probe.bytes_moved // 2
  total = jax.jit(jnp.sum)
  jax.block_until_ready(total(probe.x))
  read_t = [_timed(total, probe.x)[1] for _ in range(repeats)]
  add_fresh = jax.jit(lambda x: x + 1.0)
  jax.block_until_ready(add_fresh(probe.x))
  fresh_t = []
  for _ in range(max(3, repeats // 2)):
    y, dt = _timed(add_fresh, probe.x)
    fresh_t.append(dt)
    del y
  return Bandwidth(copy=probe.bytes_moved / statistics.median(copy_t),
                   read=nbytes / statistics.median(read_t),
                   copy_fresh=probe.bytes_moved / statistics.median(fresh_t))


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


def make_matmuls_only(config: ModelConfig) -> Callable:
  """`f(params, x [B, 1, D]) -> [B, 1]`: the decode step's weight products and nothing else.

  Same operand shapes and einsums as the model's projections, so XLA picks the same kernels.
  """
  d, e = config.d_model, config.n_heads * config.head_dim

  def matmuls(params, x):
    for layer in params["layers"]:
      q = jnp.einsum("BTD,DNH->BTNH", x, layer["wq"]).reshape(*x.shape[:2], e)
      k = jnp.einsum("BTD,DKH->BTKH", x, layer["wk"])
      v = jnp.einsum("BTD,DKH->BTKH", x, layer["wv"])
      # k and v fold into the o input so that nothing is dead code.
      a = q + jnp.sum(k + v, axis=(-2, -1))[..., None]
      x = x + jnp.einsum("BTE,ED->BTD", a, layer["wo"].reshape(e, d))
      gate = jnp.einsum("BTD,DF->BTF", x, layer["w_gate"])
      up = jnp.einsum("BTD,DF->BTF", x, layer["w_up"])
      x = x + jnp.einsum("BTF,FD->BTD", jax.nn.silu(gate) * up, layer["w_down"])
    if config.tie_embeddings:
      logits = jnp.einsum("BTD,VD->BTV", x, params["embed"])
    else:
      logits = jnp.einsum("BTD,DV->BTV", x, params["unembed"])
    return jnp.argmax(logits, axis=-1)

  return jax.jit(matmuls)


def step_inputs(batch: int, num_new: int, committed: int, vocab: int):
  tokens = (jnp.arange(batch * num_new, dtype=jnp.int32).reshape(batch, num_new) * 7919) % vocab
  positions = jnp.broadcast_to(committed + jnp.arange(num_new, dtype=jnp.int32),
                               (batch, num_new))
  return tokens, positions


def run_interleaved(step: Callable, params, cache: KVCache, inputs: dict[int, tuple],
                    extras: dict[str, Callable[[], float]], warmup: int, repeats: int
                    ) -> tuple[dict, KVCache]:
  """Time `step` for every T in `inputs` and each of `extras`, round-robin.

  The cache is threaded through the calls; each extra returns the seconds one call took.
  Returns the times keyed by T and by the extras' names, and the last cache.
  """
  for _ in range(warmup):
    for tokens, positions in inputs.values():
      (_, cache), _ = _timed(step, params, cache, tokens, positions)
    for extra in extras.values():
      extra()
  times: dict = {name: [] for name in (*extras, *inputs)}
  for _ in range(repeats):
    for name, extra in extras.items():
      times[name].append(extra())
    for t, (tokens, positions) in inputs.items():
      (_, cache), dt = _timed(step, params, cache, tokens, positions)
      times[t].append(dt)
  return times, cache


# ----------------------------------------------------------------------------- in-place checks


def aliased_outputs(hlo: str) -> int:
  """How many outputs the compiled executable aliases to (donated) inputs."""
  # The first line reads `HloModule ..., input_output_alias={ {i}: (p, {}, may-alias), ...}`.
  header = hlo.split("\n", 1)[0]
  return len(re.findall(r"(?:may|must)-alias\)", header))


def cache_sized_ops(hlo: str, buffer_elems: int) -> collections.Counter:
  """Ops of the compiled entry computation with as many output elements as one cache buffer.

  A step that updates the cache in place needs exactly one such op per buffer (the write);
  anything more is a full copy or transpose of a cache buffer, paid every step. Keys are
  the op's name without its numeric suffix (XLA names fusions after what they contain).
  """
  entry = hlo[hlo.index("\nENTRY"):]
  found = collections.Counter()
  for line in entry.splitlines():
    m = re.match(r"\s*(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]\S* ([\w-]+)\(", line)
    if m is None or m.group(3) in ("parameter", "bitcast", "get-tuple-element", "tuple"):
      continue
    if math.prod(int(d) for d in m.group(2).split(",") if d) == buffer_elems:
      found[re.sub(r"[._]\d+$", "", m.group(1))] += 1
  return found


def check_in_place(config: ModelConfig, params, committed: int, max_len: int,
                   verify: Sequence[int], key: jax.Array) -> dict:
  """Call the donated step once; report whether the input cache buffers were consumed.

  Also counts, in the compiled HLO of the batch-1 step for T=1 and each T in `verify`, the
  ops that materialise a whole cache buffer beyond the 2L in-place writes.
  """
  step = make_step(config)
  cache = filled_cache(config, 1, max_len, committed, key)
  buffer_elems = math.prod(cache.keys[0].shape)
  extra = {}
  for t in (1, *verify):
    if config.group_size * t == config.head_dim:
      continue  # the [B, K, G, T, S] attention scores would have a buffer's element count
    hlo = step.lower(params, cache, *step_inputs(1, t, committed, config.vocab_size)
                     ).compile().as_text()
    ops = cache_sized_ops(hlo, buffer_elems)
    extra[t] = {"count": sum(ops.values()) - 2 * config.n_layers, "ops": dict(ops)}
  tokens, positions = step_inputs(1, 1, committed, config.vocab_size)
  n_alias = aliased_outputs(step.lower(params, cache, tokens, positions).compile().as_text())
  # A NumPy view of a donated buffer would pin it (JAX then copies instead of donating), so
  # snapshot a device-side copy.
  before = np.asarray(jnp.copy(cache.keys[0]))
  _, new_cache = jax.block_until_ready(step(params, cache, tokens, positions))
  buffers = cache.keys + cache.values
  deleted = sum(b.is_deleted() for b in buffers)
  # The step must have written exactly one slot (K entries of one token) and kept the rest;
  # counting changed elements does not depend on the buffer layout.
  changed = int(np.sum(np.asarray(new_cache.keys[0]) != before))
  return {"deleted": deleted, "buffers": len(buffers), "aliased": n_alias,
          "changed": changed, "expected_changed": config.n_kv_heads * config.head_dim,
          "max_len": max_len, "writes": 2 * config.n_layers, "extra_cache_sized_ops": extra}


def maxlen_scaling(config: ModelConfig, params, committed: int, max_lens: Sequence[int],
                   warmup: int, repeats: int, probe: CopyProbe, key: jax.Array) -> list[dict]:
  """Batch-1 decode step time vs max_len, donated and (positive control) not donated."""
  tokens, positions = step_inputs(1, 1, committed, config.vocab_size)
  donated, copied = make_step(config, donate=True), make_step(config, donate=False)
  caches = {s: filled_cache(config, 1, s, committed, key) for s in max_lens}
  for _ in range(warmup):
    for s in max_lens:
      _, caches[s] = jax.block_until_ready(donated(params, caches[s], tokens, positions))
      _, caches[s] = jax.block_until_ready(copied(params, caches[s], tokens, positions))
  times = {(s, d): [] for s in max_lens for d in (True, False)}
  probe_times = []
  for _ in range(repeats):
    probe_times.append(probe())
    for s in max_lens:
      for d, fn in ((True, donated), (False, copied)):
        (_, caches[s]), dt = _timed(fn, params, caches[s], tokens, positions)
        times[(s, d)].append(dt)
  base = min(max_lens)
  bandwidth = probe.bytes_moved / statistics.median(probe_times)
  rows = []
  for s in max_lens:
    extra_read = live_kv_bytes(config, 1, s) - live_kv_bytes(config, 1, base)
    rows.append({
        "max_len": s,
        "donated_s": statistics.median(times[(s, True)]),
        "not_donated_s": statistics.median(times[(s, False)]),
        "cache_bytes": live_kv_bytes(config, 1, s),
        "expected_extra_s": extra_read / bandwidth,
    })
  return rows


# ----------------------------------------------------------------------------- main


def bench_config(name: str, config: ModelConfig, batches: Sequence[int],
                 verify: Sequence[int], max_len: int, committed: int, warmup: int,
                 repeats: int, probe: CopyProbe, key: jax.Array) -> list[Row]:
  params = init_params(config, key)
  n_params = count_params(params)
  w_bytes = weight_bytes_read(config, params)
  step, matmuls = make_step(config), make_matmuls_only(config)
  rows = []
  for batch in batches:
    t0 = time.perf_counter()
    cache = filled_cache(config, batch, max_len, committed, jax.random.fold_in(key, batch))
    inputs = {t: step_inputs(batch, t, committed, config.vocab_size) for t in (1, *verify)}
    x = jax.random.normal(key, (batch, 1, config.d_model), config.compute_dtype)
    extras = {"probe": probe, "matmuls": lambda: _timed(matmuls, params, x)[1]}
    times, cache = run_interleaved(step, params, cache, inputs, extras, warmup, repeats)
    del cache
    step_s, iqr = _median_iqr(times[1])
    kv = live_kv_bytes(config, batch, committed + 1)
    bandwidth = probe.bytes_moved / statistics.median(times["probe"])
    rows.append(Row(config=name, params=n_params, weight_bytes=w_bytes, batch=batch,
                    kv_bytes=kv, copy_bandwidth=bandwidth, step_s=step_s,
                    step_best_s=min(times[1]), step_iqr=iqr,
                    floor_s=(w_bytes + kv) / bandwidth,
                    matmul_s=statistics.median(times["matmuls"]),
                    verify_s={t: statistics.median(times[t]) for t in verify}))
    print(f"  [{name} B={batch}: step {step_s * 1e3:.2f} ms, "
          f"{time.perf_counter() - t0:.0f} s incl. compile]", file=sys.stderr, flush=True)
  return rows


def print_report(bw: Bandwidth, rows: list[Row], verify: Sequence[int], max_len: int,
                 committed: int, in_place: dict | None, scaling: list[dict] | None,
                 scaling_config: str) -> None:
  gb = 1e9
  print()
  print(f"memory bandwidth (same run, before the models): copy in place {bw.copy / gb:.1f} "
        f"GB/s (read+written), read-only sum {bw.read / gb:.1f} GB/s, copy to fresh buffer "
        f"{bw.copy_fresh / gb:.1f} GB/s (page faults)")
  print(f"floor = (weight bytes read + live KV bytes) / copy bandwidth timed alongside each row "
        f"(GB/s); cache max_len {max_len}, {committed} committed slots, float32, "
        f"{jax.devices()[0].platform} x{jax.device_count()}")
  print()
  vcols = "".join(f"{'T=' + str(t):>7}" for t in verify)
  header = (f"{'config':>7} {'params':>8} {'read/step':>10} {'B':>3} {'step ms':>8} "
            f"{'best ms':>8} {'iqr%':>5} {'GB/s':>5} {'floor ms':>9} {'x floor':>8} "
            f"{'mm ms':>7} {'x mm':>5} |{vcols}")
  print(header)
  print("-" * len(header))
  for r in rows:
    vals = "".join(f"{r.verify_s[t] / r.step_s:7.2f}" for t in verify)
    print(f"{r.config:>7} {r.params / 1e6:7.1f}M {(r.weight_bytes + r.kv_bytes) / 2**20:8.0f}MB "
          f"{r.batch:>3} {r.step_s * 1e3:8.2f} {r.step_best_s * 1e3:8.2f} "
          f"{100 * r.step_iqr:5.0f} {r.copy_bandwidth / gb:5.1f} {r.floor_s * 1e3:9.2f} "
          f"{r.step_s / r.floor_s:8.2f} {r.matmul_s * 1e3:7.2f} {r.step_s / r.matmul_s:5.2f} "
          f"|{vals}")
  print("x floor: step / floor (medians). mm: the step's weight matmuls alone; x mm: step / mm. "
        "T=k: one forward verifying k new tokens per row, as a multiple of the decode step")
  print()
  if in_place is not None:
    ok = in_place["deleted"] == in_place["buffers"]
    print(f"in-place check: {in_place['deleted']}/{in_place['buffers']} donated cache buffers "
          f"deleted after the call, {in_place['aliased']} outputs aliased to inputs in the "
          f"compiled executable -> {'donation OK' if ok else 'DONATION NOT HONOURED'}; "
          f"{in_place['changed']} key elements changed in layer 0 "
          f"(one slot = {in_place['expected_changed']})")
    for t, found in in_place["extra_cache_sized_ops"].items():
      kinds = ", ".join(f"{n} x{c}" for n, c in sorted(found["ops"].items()))
      print(f"  compiled step, T={t}, max_len {in_place['max_len']}: {found['count']} "
            f"whole-cache copies/transposes per step beyond the {in_place['writes']} in-place "
            f"writes "
            f"[cache-sized ops: {kinds}]")
  if scaling:
    base = scaling[0]
    print(f"decode step vs max_len ({scaling_config}, batch 1, {committed} committed; "
          f"'expected' = extra attention read of the larger buffer at the copy bandwidth "
          f"timed alongside):")
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
  parser.add_argument("--scaling-max-lens", default="256,1024,4096",
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
  probe = CopyProbe(args.bandwidth_mb)
  bw = measure_bandwidth(probe, max(5, args.repeats))

  rows: list[Row] = []
  for name in args.configs:
    rows += bench_config(name, CONFIGS[name], args.batches, args.verify, args.max_len,
                         args.committed, args.warmup, args.repeats, probe,
                         jax.random.fold_in(key, len(rows)))

  in_place = scaling = None
  if args.scaling_max_lens:
    # The reference (dense) attention, whose read grows with max_len: the 'expected' column
    # models it. benchmarks/attention.py measures the blocked path, whose read does not.
    config = CONFIGS[args.scaling_config].replace(attention_impl="dense")
    params = init_params(config, key)
    print(f"[in-place checks on {args.scaling_config}]", file=sys.stderr, flush=True)
    in_place = check_in_place(config, params, args.committed, max(args.scaling_max_lens),
                              args.verify[-1:], key)
    # These steps are short and the differences small: three times the repeats.
    scaling = maxlen_scaling(config, params, args.committed, args.scaling_max_lens,
                             args.warmup, 3 * args.repeats, probe, key)

  print_report(bw, rows, args.verify, args.max_len, args.committed, in_place, scaling,
               args.scaling_config)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"bandwidth": dataclasses.asdict(bw),
                 "rows": [dataclasses.asdict(r) for r in rows],
                 "in_place": in_place, "scaling": scaling,
                 "args": {k: v for k, v in vars(args).items()}}, f, indent=1)


if __name__ == "__main__":
  main()
