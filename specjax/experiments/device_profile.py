"""Measure this machine's `DeviceProfile` with short JAX micro-benchmarks.

1. Matmuls `[n, d] x [d, d]` at a few row counts n (arithmetic intensity ~ n / itemsize
   FLOP/byte): `peak_flops` is the best rate reached, and `matmul_eff` holds each shape's
   rate / peak at its intensity, so the roofline reproduces these matmuls.
2. Copy bandwidth: a jitted in-place `x + 1` on a large array (bytes read + written, the
   STREAM convention, as `benchmarks/decode_step.py`): `hbm_bw`.
3. A decode step (T = 1) of two small two-layer `specjax.models` decoders of different widths
   (so that the per-byte and per-layer costs can be told apart) and a verify forward (T = 4,
   batch 8), against a mostly full cache: `mem_eff` and `layer_overhead_s` are fitted to
   them with `fit_efficiency`; `kv_eff` is set to the fitted `mem_eff`.
4. The sampler: rounds of `specjax.decoding`'s per-round passes over `[rows, vocab]` float32
   logits (the processed log-probabilities, the token, its reported log-probability), greedy
   and drawn: `logit_s` and `sample_logit_s` per logit. On a CPU they are far from free
   (tens of ns per logit with the draw), so at temperature 1 a round of 16 rows over an
   8k vocabulary spends about as long sampling as a small model's forward.

The matmul shapes, and the decoders, are timed with their repeats interleaved (medians), so
that load from other work on a shared machine does not bend the efficiency curve. On a CPU,
pass `matmul_dim` large enough that the weights do not fit in its caches (4096 float32: 64 MB),
as a model's weights do not; `benchmarks/sim_validation.py` does.

Not measured, and set so that they do not pretend to be: `round_overhead_s` and
`spec_round_overhead_s` (0; fit them to `specjax.decoding.calibrate` tables), `attn_flops_eff`
and `train_mfu` (half the best matmul efficiency), links (a single device: the copy
bandwidth, efficiency 1, no latency). On a 2-core CPU the whole run takes ~10-15 s, most of
it compiling. JAX is imported only when this runs.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Sequence

import numpy as np

from specjax.sim.fit import Measurement, fit_efficiency
from specjax.sim.hardware import Curve, DeviceProfile
from specjax.sim.model import ModelSpec
from specjax.timing import interleaved


def _seconds(fn: Callable) -> float:
  import jax
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def _median_seconds(fn: Callable, repeats: int) -> float:
  import jax
  jax.block_until_ready(fn())  # compile and warm up
  return statistics.median(_seconds(fn) for _ in range(repeats))


def _interleaved_medians(fns: Sequence[Callable], repeats: int) -> list[float]:
  """Median seconds of each of `fns` (compiled and warmed up first), their repeats taken in
  turn (`specjax.timing.interleaved`), so that a burst of load from other work on a shared
  machine hits them alike rather than bending the shape of what is measured."""
  for fn in fns:
    _seconds(fn)
  seconds, _ = interleaved([lambda r, fn=fn: _seconds(fn) for fn in fns], repeats)
  return [float(np.median(s)) for s in seconds]


def memory_capacity(device) -> float:
  """Bytes of memory `device` offers: its allocator's limit, or a CPU's physical memory."""
  stats = getattr(device, "memory_stats", lambda: None)() or {}
  if stats.get("bytes_limit"):
    return float(stats["bytes_limit"])
  return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _matmul_curve(dtype: str, dim: int, rows: Sequence[int], repeats: int):
  import jax
  import jax.numpy as jnp
  rng = np.random.default_rng(0)  # NumPy: drawing with JAX would compile per shape
  w = jnp.asarray(rng.standard_normal((dim, dim)), dtype)
  itemsize = jnp.dtype(dtype).itemsize
  product = jax.jit(lambda x, w: x @ w)
  rows = sorted(set(rows))
  xs = [jnp.asarray(rng.standard_normal((n, dim)), dtype) for n in rows]
  seconds = _interleaved_medians([lambda x=x: product(x, w) for x in xs], repeats)
  points = []
  for n, s in zip(rows, seconds):
    flops = 2.0 * n * dim * dim
    intensity = flops / ((2 * n * dim + dim * dim) * itemsize)
    points.append((intensity, flops / s))
  peak = max(rate for _, rate in points)
  return peak, Curve(tuple((i, rate / peak) for i, rate in points))


def _copy_bandwidth(megabytes: int, repeats: int) -> float:
  import jax
  import jax.numpy as jnp
  size = megabytes * 2**20 // 4
  add = jax.jit(lambda x: x + 1.0, donate_argnums=0)
  state = {"x": jnp.ones((size,), jnp.float32)}

  def step():
    state["x"] = add(state["x"])
    return state["x"]

  return 2.0 * size * 4 / _median_seconds(step, repeats)


def _decode_model(dtype: str, width: int):
  """A two-layer decoder of d_model `width` with random weights, and its spec."""
  import jax
  import jax.numpy as jnp
  from specjax.models import ModelConfig, init_params
  # Two layers: each one compiles separately (per-layer cache buffers), and compiling is
  # most of what this calibration costs.
  config = ModelConfig(vocab_size=4096, d_model=width, n_layers=2, n_heads=width // 64,
                       n_kv_heads=2, head_dim=64, mlp_dim=3 * width, max_position=512,
                       dtype=dtype, param_dtype=dtype)
  # Random weights from NumPy in the shapes init_params would give: drawing them with JAX
  # compiles one program per shape, which on a CPU takes longer than the whole measurement.
  rng = np.random.default_rng(width)
  params = jax.tree.map(
      lambda x: jnp.asarray(0.02 * rng.standard_normal(x.shape), x.dtype),
      jax.eval_shape(lambda: init_params(config, jax.random.key(1))))
  return config, params, ModelSpec.from_model_config(config, f"calibration d{width}")


def _decode_measurements(dtype: str, cases: Sequence[tuple[int, int, int]],
                         repeats: int) -> list[Measurement]:
  """One timed forward per (d_model, rows, tokens per row) against a mostly full cache."""
  import jax
  import jax.numpy as jnp
  from specjax.models import KVCache, forward
  committed, max_len = 192, 256
  runs, specs = [], []
  for width, b, t in cases:
    config, params, spec = _decode_model(dtype, width)

    def step(params, cache, tokens, positions, config=config):
      out = forward(params, config, tokens, positions, cache, advance=0)
      return jnp.argmax(out.logits, axis=-1), out.cache

    # The cache is donated so the step writes its K/V in place, as a decoding loop does.
    jitted = jax.jit(step, donate_argnums=(1,))
    cache = KVCache.create(config, b, max_len).set_lengths(jnp.full((b,), committed, jnp.int32))
    state = {"cache": cache}
    toks = jnp.zeros((b, t), jnp.int32)
    positions = jnp.broadcast_to(committed + jnp.arange(t, dtype=jnp.int32), (b, t))

    def run(jitted=jitted, params=params, toks=toks, positions=positions, state=state):
      out, state["cache"] = jitted(params, state["cache"], toks, positions)
      return out

    runs.append(run)
    specs.append((spec, b, t))
  seconds = _interleaved_medians(runs, repeats)
  return [Measurement("forward", spec, s, rows=b, tokens=t, context=committed)
          for (spec, b, t), s in zip(specs, seconds)]


def _logit_costs(rows: int, vocab: int, rounds: int, repeats: int) -> tuple[float, float]:
  """Seconds per logit of the sampler's passes over `[rows, vocab]` logits, greedy and the
  extra of a random draw: `rounds` rounds inside one compiled loop (as in the decode loop,
  where no dispatch separates them), each round's logits shifted by the last round's result
  so that nothing is hoisted out of the loop."""
  import jax
  import jax.numpy as jnp
  from specjax.decoding.sampling import (SamplingConfig, processed_logprobs,
                                         reported_logprobs, sample_tokens)
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((rows, vocab)), jnp.float32)

  def loop(sampling: SamplingConfig):
    def body(i, carry):
      x = logits + carry[:, None]
      token = sample_tokens(jax.random.fold_in(jax.random.key(0), i),
                            processed_logprobs(x, sampling), sampling)
      return carry + 1e-6 * reported_logprobs(x, token, sampling)

    run = jax.jit(lambda: jax.lax.fori_loop(0, rounds, body, jnp.zeros((rows,), jnp.float32)))
    return run

  greedy, drawn = _interleaved_medians([loop(SamplingConfig(0.0)), loop(SamplingConfig(1.0))],
                                       repeats)
  per = float(rounds * rows * vocab)
  return greedy / per, max(drawn - greedy, 0.0) / per


def calibrate_profile(*, dtype: str | None = None, matmul_dim: int = 1024,
                      matmul_rows: Sequence[int] = (1, 32, 256), copy_megabytes: int = 128,
                      decode_cases: Sequence[tuple[int, int, int]] = (
                          (256, 1, 1), (1024, 1, 1), (1024, 8, 4)),
                      sampler_shape: tuple[int, int, int] = (8, 16384, 8),
                      repeats: int = 5, name: str | None = None) -> DeviceProfile:
  """Measure the default JAX device and return its profile (see the module docstring).

  Args:
    dtype: of the matmuls and the decode model; None: float32 on CPU, bfloat16 elsewhere.
    matmul_dim, matmul_rows: the matmul shapes `[n, d] x [d, d]`.
    copy_megabytes: size of the bandwidth probe's array.
    decode_cases: (d_model, rows, tokens per row) of the decode (T = 1) and verify forwards
      that `mem_eff` and `layer_overhead_s` are fitted to (each compiles once). Two widths
      tell the per-byte cost from the per-layer one.
    sampler_shape: (rows, vocab, rounds) of the sampler's timed loop.
    repeats: timed calls per measurement (median).
    name: the profile's name (default: "measured: <device kind>").
  """
  import jax
  device = jax.devices()[0]
  if dtype is None:
    dtype = "float32" if device.platform == "cpu" else "bfloat16"
  peak, curve = _matmul_curve(dtype, matmul_dim, matmul_rows, repeats)
  bandwidth = _copy_bandwidth(copy_megabytes, repeats)
  best = max(v for _, v in curve.knots)
  profile = DeviceProfile(
      name=name or f"measured: {device.device_kind} ({dtype})", peak_flops=peak,
      hbm_bw=bandwidth, hbm_bytes=memory_capacity(device), link_bw=bandwidth,
      scaleout_bw=bandwidth, domain=1, matmul_eff=curve, mem_eff=1.0,
      kv_eff=Curve.constant(1.0), attn_flops_eff=0.5 * best, layer_overhead_s=1e-5,
      round_overhead_s=0.0, spec_round_overhead_s=0.0, train_mfu=0.5 * best,
      collective_eff=1.0, collective_latency_s=0.0,
      source=f"calibrate_profile on {device.platform}, jax {jax.__version__}")
  measured = _decode_measurements(dtype, decode_cases, repeats)
  fitted = fit_efficiency(measured, profile, ("mem_eff", "layer_overhead_s"))
  logit_s, sample_logit_s = _logit_costs(*sampler_shape, repeats)
  # The calibration model's KV cache is too small to tell its reads apart from the weights':
  # attention reads at the weights' rate.
  return fitted.replace(name=profile.name, kv_eff=Curve.constant(fitted.mem_eff),
                        logit_s=logit_s, sample_logit_s=sample_logit_s)
