"""Blocked attention: the dense reference's outputs, reading only the live blocks."""

import importlib.util
import math
import pathlib
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import progression_batch
from specjax.decoding import DraftModelDrafter, DraftTree, MTPDrafter, SamplingConfig, generate
from specjax.models import ConfigError, KVCache, ModelConfig, forward, init_params
from specjax.models import attention
from specjax.models.attention import (Visibility, _kernel_tiling, blocked_attention,
                                     dense_attention)
from specjax.models.config import AUTO_BLOCKED_MIN_SLOTS

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=8, mlp_dim=64, max_position=512)
TREE_MASK = jnp.array([[1, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0],
                       [1, 0, 1, 0, 0],
                       [1, 1, 0, 1, 0],
                       [1, 0, 1, 0, 1]], bool)
TREE_DEPTHS = jnp.array([0, 1, 1, 2, 2])


def _benchmark_module(name: str):
  path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def _prefilled(config: ModelConfig, params, max_len: int, lengths):
  """A cache with ragged committed lengths (rows written to 70 slots, `lengths` committed)."""
  b, t = len(lengths), 70
  tokens = jax.random.randint(jax.random.key(1), (b, t), 0, config.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  out = forward(params, config, tokens, positions, KVCache.create(config, b, max_len),
                advance=jnp.asarray(lengths))
  return out


# S a multiple of the block, not one, smaller than one block, and a block of 7 slots.
@pytest.mark.parametrize("family,max_len,block", [
    pytest.param("llama", 256, 64, marks=pytest.mark.slow),
    pytest.param("llama", 300, 64, marks=pytest.mark.slow),
    pytest.param("llama", 100, 256, marks=pytest.mark.slow), ("qwen2", 200, 7), ("qwen3", 300, 64)])
def test_blocked_forward_matches_dense_for_chains_and_trees(family, max_len, block):
  """Prefill, a decode step and a tree verify give the dense logits and cache at 1e-5."""
  extra = {"qwen2": {"qkv_bias": True}, "qwen3": {"qk_norm": True}}.get(family, {})
  base = CONFIG.replace(family=family, **extra)
  params = init_params(base, jax.random.key(0))
  results = {}
  for impl in ("dense", "blocked"):
    config = base.replace(attention_impl=impl, attention_block=block)
    first = _prefilled(config, params, max_len, [70, 50, 10])
    cache = first.cache
    step = forward(params, config, jnp.array([[5], [6], [7]]), cache.lengths[:, None], cache)
    tree_tokens = jax.random.randint(jax.random.key(2), (3, 5), 0, config.vocab_size)
    verify = forward(params, config, tree_tokens, step.cache.lengths[:, None] + TREE_DEPTHS,
                     step.cache, new_mask=TREE_MASK[None], advance=0)
    results[impl] = (first.logits, step.logits, verify.logits, verify.cache.keys[1])
  for dense, blocked in zip(results["dense"], results["blocked"]):
    np.testing.assert_allclose(blocked, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("max_len", [256, 304])
def test_pallas_decode_kernel_matches_dense_and_falls_back_for_verify(max_len):
  """Interpreted on CPU, the Pallas GPU decode kernel gives the dense decode step at 1e-5;
  forwards over several tokens (prefill, tree verify) say so and attend as "auto" would."""
  attention._say_fallback.cache_clear()  # the message is said once per process
  base = CONFIG.replace(n_kv_heads=1)  # R = 4 query heads per kv head
  params = init_params(base, jax.random.key(0))
  results = {}
  for impl in ("dense", "pallas_interpret"):
    config = base.replace(attention_impl=impl)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      first = _prefilled(config, params, max_len, [70, 31, 1])
      step = forward(params, config, jnp.array([[5], [6], [7]]), first.cache.lengths[:, None],
                     first.cache)
      tree_tokens = jax.random.randint(jax.random.key(2), (3, 5), 0, config.vocab_size)
      verify = forward(params, config, tree_tokens, step.cache.lengths[:, None] + TREE_DEPTHS,
                       step.cache, new_mask=TREE_MASK[None], advance=0)
    said = " ".join(str(w.message) for w in caught)
    if impl == "dense":
      assert not said
    else:
      assert "one new token per row" in said and "attending as 'auto' would" in said
    results[impl] = (step.logits, verify.logits, step.cache.values[0])
  for dense, kernel in zip(results["dense"], results["pallas_interpret"]):
    np.testing.assert_allclose(kernel, dense, atol=1e-5, rtol=1e-5)


def test_pallas_on_a_backend_without_the_kernel_falls_back_with_a_message():
  attention._say_fallback.cache_clear()
  config = CONFIG.replace(attention_impl="pallas")
  params = init_params(config, jax.random.key(0))
  cache = KVCache.create(config, 1, 64)
  with pytest.warns(UserWarning, match="GPU kernel and the backend is 'cpu'.*pallas_interpret"):
    got = forward(params, config, jnp.array([[3]]), jnp.array([[0]]), cache).logits
  want = forward(params, CONFIG, jnp.array([[3]]), jnp.array([[0]]), cache).logits
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_kernel_tiling_covers_what_the_kernel_accepts():
  assert _kernel_tiling(2048) == (16, 128)
  assert _kernel_tiling(256) == (16, 16)
  assert _kernel_tiling(304) == (1, 16)  # 304 = 19 x 16: one split of 19 tiles
  assert _kernel_tiling(100) is None  # no split into parts of 16 slots
  assert _kernel_tiling(8) is None


def test_blocked_attention_reads_no_slot_above_the_longest_live_row():
  """Slots above the last block holding a live entry hold NaN: dense sees them (NaN x 0 is
  NaN), blocked never reads them; below them, where both read, they agree."""
  b, k, r, t, s, h, block = 2, 2, 2, 3, 64, 8, 8
  keys = jax.random.normal(jax.random.key(0), (b, k, s, h))
  values = jax.random.normal(jax.random.key(1), (b, k, s, h))
  q = jax.random.normal(jax.random.key(2), (b, k, r * t, h))
  lengths = jnp.array([20, 5])  # the longest row's new slots end at 23: blocks 0-2 are live
  vis = Visibility(lengths=lengths, new_mask=jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)),
                                                              (b, t, t)))
  want = dense_attention(q, keys, values, vis, r)
  poisoned = lambda x: x.at[:, :, 24:].set(jnp.nan)
  got = blocked_attention(q, poisoned(keys), poisoned(values), vis, r, block)
  assert np.isnan(np.asarray(dense_attention(q, poisoned(keys), poisoned(values), vis, r))).any()
  np.testing.assert_allclose(got, want, atol=1e-6)
  # One slot lower and the blocked path must read the poison too (the control).
  leaky = lambda x: x.at[:, :, 23:].set(jnp.nan)
  assert np.isnan(np.asarray(blocked_attention(q, leaky(keys), leaky(values), vis, r,
                                               block))).any()


def test_blocked_attention_bf16_stays_close_to_dense():
  b, k, r, t, s, h = 2, 2, 2, 4, 96, 16
  keys, values, q = (jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) for i, shape in
                     enumerate([(b, k, s, h), (b, k, s, h), (b, k, r * t, h)]))
  vis = Visibility(lengths=jnp.array([60, 30]),
                   new_mask=jnp.broadcast_to(TREE_MASK[:t, :t], (b, t, t)))
  got = blocked_attention(q, keys, values, vis, r, 16)
  want = dense_attention(q, keys, values, vis, r)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=2e-2)


@pytest.mark.parametrize("name", [pytest.param("mtp_tree", marks=pytest.mark.slow),
                                  "draft_model_chain", "plain_pallas"])
def test_greedy_generation_is_identical_with_blocked_attention(progression_models, name):
  """The whole engine (prefill, MTP / draft-model caches, tree verify) on blocked attention,
  and plain decoding on the (interpreted) Pallas kernel, emit what dense decoding emits."""
  m = progression_models
  rng = np.random.default_rng(5)
  prompts, lengths = jnp.asarray(progression_batch(rng, 3, 12)), jnp.array([12, 7, 4])
  greedy = SamplingConfig(temperature=0.0)
  plain = generate(m["params"], m["config"].replace(attention_impl="dense"), prompts, lengths,
                   jax.random.key(0), max_new_tokens=20, sampling=greedy)
  blocked = m["config"].replace(attention_impl="blocked", attention_block=8)
  if name == "plain_pallas":
    attention._say_fallback.cache_clear()
    with pytest.warns(UserWarning, match="one new token per row"):
      kernel = generate(m["params"], m["config"].replace(attention_impl="pallas_interpret"),
                        prompts, lengths, jax.random.key(0), max_new_tokens=20, sampling=greedy)
    np.testing.assert_array_equal(kernel.tokens, plain.tokens)
    np.testing.assert_allclose(kernel.logprobs, plain.logprobs, atol=1e-5)
    return
  if name == "mtp_tree":
    kwargs = {"drafter": MTPDrafter(), "tree": DraftTree.from_widths((2, 2, 1))}
  else:
    kwargs = {"drafter": DraftModelDrafter(m["draft_config"].replace(
        attention_impl="blocked", attention_block=8)), "tree": DraftTree.chain(3),
        "drafter_params": m["draft_params"]}
  spec = generate(m["params"], blocked, prompts, lengths, jax.random.key(0),
                  max_new_tokens=20, sampling=greedy, **kwargs)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  np.testing.assert_allclose(spec.logprobs, plain.logprobs, atol=1e-5)
  assert float(spec.stats.tokens_per_round) > 1.5


def test_blocked_step_updates_the_cache_in_place():
  """The compiled decode step holds no copy of a cache buffer besides its writes: the loop
  slices the donated buffers where they lie."""
  helpers = _benchmark_module("decode_step")
  config = CONFIG.replace(attention_impl="blocked", attention_block=16)
  params = init_params(config, jax.random.key(0))
  cache = KVCache.create(config, 1, 128).set_lengths(jnp.array([40]))
  step = jax.jit(lambda p, c, tok, pos: forward(p, config, tok, pos, c, advance=0).cache,
                 donate_argnums=(1,))
  hlo = step.lower(params, cache, jnp.array([[3]]), jnp.array([[40]])).compile().as_text()
  ops = helpers.cache_sized_ops(hlo, math.prod(cache.keys[0].shape))
  assert sum(ops.values()) == 2 * config.n_layers, ops


def test_auto_picks_blocked_for_large_caches_off_gpus_only():
  for platform in ("cpu", "tpu"):
    assert not CONFIG.blocked_attention(AUTO_BLOCKED_MIN_SLOTS - 1, platform)
    assert CONFIG.blocked_attention(AUTO_BLOCKED_MIN_SLOTS, platform)
  for platform in ("cuda", "rocm"):
    assert not CONFIG.blocked_attention(1 << 20, platform)
    assert not CONFIG.replace(attention_impl="pallas").blocked_attention(1 << 20, platform)
  assert CONFIG.replace(attention_impl="blocked").blocked_attention(8, "cuda")
  assert not CONFIG.replace(attention_impl="dense").blocked_attention(1 << 20, "cpu")


@pytest.mark.parametrize("platform,loops", [("cpu", True), ("tpu", True), ("cuda", False)])
def test_auto_attention_is_lowered_per_platform(platform, loops):
  """A long cache's decode step holds blocked attention's loop only where "auto" wants it."""
  config = CONFIG.replace(attention_impl="auto", attention_block=512,
                          max_position=AUTO_BLOCKED_MIN_SLOTS)
  params = init_params(config, jax.random.key(0))
  cache = KVCache.create(config, 1, AUTO_BLOCKED_MIN_SLOTS).set_lengths(jnp.array([40]))
  step = jax.jit(lambda p, c, tok, pos: forward(p, config, tok, pos, c).logits)
  text = step.trace(params, cache, jnp.array([[3]]), jnp.array([[40]])).lower(
      lowering_platforms=(platform,)).as_text()
  assert ("stablehlo.while" in text) == loops


@pytest.mark.parametrize("change,match", [
    ({"attention_impl": "flash"}, "attention_impl='flash' is invalid: one of.*pallas"),
    ({"attention_block": 0}, "attention_block=0 is invalid: must be a positive int"),
    ({"attention_block": 2.5}, "attention_block=2.5 is invalid"),
])
def test_bad_attention_settings_are_rejected(change, match):
  with pytest.raises(ConfigError, match=match):
    CONFIG.replace(**change)
