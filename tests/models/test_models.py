"""Model core: cache consistency, tree masks, draft-head training, configuration errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from specjax.models import (ConfigError, KVCache, Llama3RopeScaling, ModelConfig,
                            init_params, medusa_logits, mtp_forward, mtp_logits_all)
from specjax.models import forward as _forward

# Compiled once per shape: op-by-op dispatch of these tiny models dominates test time.
forward = jax.jit(_forward, static_argnums=1, static_argnames=("hidden_layers",
                                                               "compute_logits"))
from specjax.supervised import init_supervised_state, make_supervised_step

CONFIGS = {
    "llama_gqa_rope_scaling": ModelConfig(
        vocab_size=61, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
        mlp_dim=96, rope_scaling=Llama3RopeScaling(factor=8.0, original_max_position=16)),
    "qwen2_bias_tied": ModelConfig(
        vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=8,
        mlp_dim=64, qkv_bias=True, tie_embeddings=True, family="qwen2"),
    "qwen3_qk_norm": ModelConfig(
        vocab_size=61, d_model=32, n_layers=3, n_heads=2, n_kv_heads=2, head_dim=24,
        mlp_dim=64, qk_norm=True, family="qwen3"),
}


def _randomize_biases(params, key):
  """Zero-initialised biases would hide a bias bug; make them random."""
  for i, layer in enumerate(params["layers"]):
    for name in ("bq", "bk", "bv"):
      if name in layer:
        layer[name] = 0.1 * jax.random.normal(jax.random.fold_in(key, i), layer[name].shape)
  return params


@pytest.fixture(params=sorted(CONFIGS))
def model(request):
  config = CONFIGS[request.param]
  params = _randomize_biases(init_params(config, jax.random.key(0)), jax.random.key(1))
  return config, params


def _arange_positions(b, t, start=0):
  return jnp.broadcast_to(jnp.arange(start, start + t), (b, t))


def test_cached_token_by_token_decoding_equals_teacher_forced_forward(model):
  config, params = model
  b, t = 3, 12
  tokens = jax.random.randint(jax.random.key(2), (b, t), 0, config.vocab_size)
  full = forward(params, config, tokens, _arange_positions(b, t)).logits
  cache = KVCache.create(config, b, 16)
  step = jax.jit(lambda c, tok, pos: _forward(params, config, tok, pos, c), donate_argnums=0)
  outs = []
  for i in range(t):
    out = step(cache, tokens[:, i:i + 1], _arange_positions(b, 1, i))
    cache = out.cache
    outs.append(out.logits)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=1e-5, rtol=0)
  np.testing.assert_array_equal(cache.lengths, [t] * b)


def test_chunked_prefill_equals_one_shot_prefill_with_ragged_rows(model):
  config, params = model
  b, t = 3, 10
  tokens = jax.random.randint(jax.random.key(3), (b, t), 0, config.vocab_size)
  lengths = jnp.array([10, 6, 3])
  one_shot = forward(params, config, tokens, _arange_positions(b, t),
                     KVCache.create(config, b, 16), advance=lengths)
  # Chunks of 4: rows advance by how many of the chunk's tokens are real.
  cache = KVCache.create(config, b, 16)
  logits = []
  for start in range(0, t, 4):
    chunk = tokens[:, start:start + 4]
    n = chunk.shape[1]
    advance = jnp.clip(lengths - start, 0, n)
    out = forward(params, config, chunk, _arange_positions(b, n, start), cache, advance=advance)
    cache = out.cache
    logits.append(out.logits)
  logits = jnp.concatenate(logits, 1)
  valid = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
  np.testing.assert_allclose(np.asarray(logits)[valid], np.asarray(one_shot.logits)[valid],
                             atol=1e-5, rtol=0)
  np.testing.assert_array_equal(cache.lengths, lengths)
  # The next token decodes identically from either cache.
  nxt = jnp.array([[5], [7], [9]])
  a = forward(params, config, nxt, lengths[:, None], cache).logits
  b_ = forward(params, config, nxt, lengths[:, None], one_shot.cache).logits
  np.testing.assert_allclose(a, b_, atol=1e-5, rtol=0)


def test_tree_mask_gives_each_node_the_logits_of_its_path_decoded_as_a_chain(model):
  config, params = model
  b, prefix = 2, 5
  parents = [-1, 0, 0, 1, 1, 2, 3]  # node 0 is the root (last committed token)
  depth = [0, 1, 1, 2, 2, 2, 3]
  n = len(parents)
  anc = np.zeros((n, n), bool)
  for i in range(n):
    j = i
    while j >= 0:
      anc[i, j] = True
      j = parents[j]
  key = jax.random.key(4)
  prompt = jax.random.randint(key, (b, prefix), 0, config.vocab_size)
  nodes = jax.random.randint(jax.random.fold_in(key, 1), (b, n), 0, config.vocab_size)
  cache = forward(params, config, prompt, _arange_positions(b, prefix),
                  KVCache.create(config, b, 24)).cache
  positions = prefix + jnp.broadcast_to(jnp.array(depth), (b, n))
  tree = forward(params, config, nodes, positions, cache, new_mask=jnp.asarray(anc), advance=0)
  np.testing.assert_array_equal(tree.cache.lengths, [prefix] * b)
  for i in range(n):
    path = [j for j in range(n) if anc[i, j]]  # ancestors in index order == depth order
    seq = jnp.concatenate([prompt, nodes[:, path]], 1)
    chain = forward(params, config, seq, _arange_positions(b, seq.shape[1])).logits[:, -1]
    np.testing.assert_allclose(tree.logits[:, i], chain, atol=1e-5, rtol=0)


def test_mtp_cached_drafting_equals_teacher_forced_module_outputs():
  config = CONFIGS["qwen3_qk_norm"].replace(num_mtp_modules=2)
  params = init_params(config, jax.random.key(5))
  b, t = 2, 9
  tokens = jax.random.randint(jax.random.key(6), (b, t), 0, config.vocab_size)
  positions = _arange_positions(b, t)
  trunk = forward(params, config, tokens, positions)
  teacher = mtp_logits_all(params, config, trunk.hidden, tokens, positions)
  # Module 0, one position at a time with its own cache, must match the teacher-forced pass.
  cache = KVCache.create(config, b, 16, n_layers=1)
  for i in range(t - 1):
    out = mtp_forward(params, config, 0, trunk.hidden[:, i:i + 1], tokens[:, i + 1:i + 2],
                      positions[:, i:i + 1], cache)
    cache = out.cache
    np.testing.assert_allclose(out.logits[:, 0], teacher[0][:, i], atol=1e-5, rtol=0)


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_draft_head_losses_fall_and_train_step_compiles_once():
  config = ModelConfig(vocab_size=32, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=16, mlp_dim=128, num_mtp_modules=2, num_medusa_heads=2)
  params = init_params(config, jax.random.key(7))
  # A deterministic periodic language: every head can learn it exactly.
  base = jnp.arange(24) * 5 % 31
  tokens = jnp.stack([jnp.roll(base, s) for s in range(8)])
  mask = jnp.ones_like(tokens)
  optimizer = optax.adam(3e-3)
  state = init_supervised_state(params, optimizer)
  step = jax.jit(chex.assert_max_traces(make_supervised_step(config, optimizer, jit=False),
                                        n=1), donate_argnums=0)
  first = None
  for _ in range(300):
    state, metrics = step(state, tokens, mask)
    first = first or jax.tree.map(np.asarray, metrics)
  last = jax.tree.map(np.asarray, metrics)
  assert last["ce"] < 0.1 * first["ce"]
  assert np.all(last["mtp_ce"] < 0.1 * first["mtp_ce"]), (first["mtp_ce"], last["mtp_ce"])
  assert np.all(last["medusa_ce"] < 0.1 * first["medusa_ce"])
  assert int(state.step) == 300


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_detached_head_loss_leaves_trunk_weights_unchanged():
  config = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                       head_dim=16, mlp_dim=64, num_mtp_modules=1, num_medusa_heads=1)
  params = init_params(config, jax.random.key(8))
  tokens = jax.random.randint(jax.random.key(9), (2, 10), 0, 32)
  from specjax.supervised import lm_loss

  def head_only(p):
    _, metrics = lm_loss(p, config, tokens, jnp.ones_like(tokens), detach_heads=True)
    return metrics["mtp_ce"].sum() + metrics["medusa_ce"].sum()

  grads = jax.grad(head_only)(params)
  for name in ("embed", "unembed", "final_norm"):
    assert not np.any(grads[name]), name
  assert not any(np.any(g) for g in jax.tree.leaves(grads["layers"]))
  assert any(np.any(g) for g in jax.tree.leaves(grads["mtp"]))
  assert np.any(medusa_logits(params, config, jnp.ones((1, 32))))


@pytest.mark.parametrize("field,value,needle", [
    ("n_kv_heads", 3, "must divide n_heads"),
    ("head_dim", 15, "must be even"),
    ("vocab_size", 0, "positive int"),
    ("dtype", "float64", "one of"),
    ("family", "gpt2", "one of"),
    ("num_mtp_modules", -1, ">= 0"),
])
def test_invalid_config_value_raises_error_naming_field_and_allowed(field, value, needle):
  kwargs = dict(vocab_size=32, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
                mlp_dim=64)
  kwargs[field] = value
  with pytest.raises(ConfigError, match=field) as err:
    ModelConfig(**kwargs)
  assert needle in str(err.value)


def test_cache_longer_than_max_position_is_rejected():
  config = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                       head_dim=8, mlp_dim=64, max_position=64)
  with pytest.raises(ConfigError, match="max_position"):
    KVCache.create(config, 1, 65)
