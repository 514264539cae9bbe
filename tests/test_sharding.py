"""Sharding: mesh construction, logical-axis rules, and sharded == single-device numerics.

The reference for every sharded computation is the same function run unsharded on one
device; conftest.py provides 8 fake CPU devices and full-precision float32 matmuls.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from specjax import sharding
from specjax.models import KVCache, ModelConfig, forward, init_params
from specjax.supervised import init_supervised_state, make_supervised_step

ATOL = 1e-5
B, T = 4, 8

CONFIG = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=16, mlp_dim=128, num_mtp_modules=1, num_medusa_heads=1)


@pytest.fixture(scope="module")
def mesh():
  return sharding.make_mesh(data=2, fsdp=2, tensor=2)


@pytest.fixture(scope="module")
def tokens():
  return jax.random.randint(jax.random.key(1), (B, T), 0, CONFIG.vocab_size)


def _positions(batch, length, start=0):
  return jnp.broadcast_to(start + jnp.arange(length), (batch, length))


def _assert_trees_close(actual, expected, atol=ATOL):
  jax.tree.map(lambda a, e: np.testing.assert_allclose(np.asarray(a), np.asarray(e),
                                                       rtol=0, atol=atol),
               actual, expected)


def _assert_same_shardings(arrays, shardings):
  flat_arrays, flat_shardings = jax.tree.leaves(arrays), jax.tree.leaves(shardings)
  assert len(flat_arrays) == len(flat_shardings)
  for array, expected in zip(flat_arrays, flat_shardings):
    assert array.sharding == expected, (array.shape, array.sharding, expected)


# --- mesh -----------------------------------------------------------------------------------


def test_make_mesh_has_named_axes_and_fills_minus_one_with_remaining_devices():
  mesh = sharding.make_mesh(data=-1, tensor=2)
  assert mesh.axis_names == ("data", "fsdp", "tensor", "expert")
  assert dict(mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2, "expert": 1}
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


@pytest.mark.parametrize("kwargs, message", [
    (dict(data=3), r"= 3 devices is invalid: there are 8 devices"),
    (dict(data=2, fsdp=2, tensor=4), r"= 16 devices is invalid: there are 8 devices"),
    (dict(data=-1, tensor=3), r"data=-1 is invalid: the other axes multiply to 3"),
    (dict(data=-1, fsdp=-1), r"at most one axis may be -1"),
    (dict(tensor=0), r"tensor=0 is invalid: must be an int >= 1, or -1"),
])
def test_make_mesh_rejects_bad_shape_naming_the_counts(kwargs, message):
  with pytest.raises(ValueError, match=message):
    sharding.make_mesh(**kwargs)


# --- rules ----------------------------------------------------------------------------------


def test_rules_replicate_a_dimension_the_mesh_axis_does_not_divide():
  mesh = sharding.make_mesh(fsdp=2, tensor=4)
  # kv_heads=2 cannot split over tensor=4; heads=4 can.
  assert sharding.logical_to_mesh(P("embed", "kv_heads", "head_dim"), mesh, (64, 2, 16)) == \
      P("fsdp", None, None)
  assert sharding.logical_to_mesh(P("embed", "heads", "head_dim"), mesh, (64, 4, 16)) == \
      P("fsdp", "tensor", None)
  shardings = sharding.param_shardings(CONFIG, mesh)
  assert shardings["layers"][0]["wk"].spec == P("fsdp", None, None)
  assert shardings["layers"][0]["wq"].spec == P("fsdp", "tensor", None)


def test_rules_keep_the_divisible_prefix_of_a_multi_axis_rule():
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  assert sharding.logical_to_mesh(P("batch"), mesh, (4,)) == P(("data", "fsdp", "expert"))
  assert sharding.logical_to_mesh(P("batch"), mesh, (2,)) == P("data")
  assert sharding.logical_to_mesh(P("batch"), mesh, (3,)) == P(None)


def test_rules_never_use_one_mesh_axis_twice_in_a_spec():
  mesh = sharding.make_mesh(fsdp=2, tensor=4)
  rules = (("embed", "tensor"), ("heads", "tensor"), ("head_dim", None))
  assert sharding.logical_to_mesh(P("embed", "heads", "head_dim"), mesh, (64, 4, 16),
                                  rules) == P("tensor", None, None)
  # A later rule for the same name is the fallback when the first one's axis is taken.
  rules += (("heads", "fsdp"),)
  assert sharding.logical_to_mesh(P("embed", "heads", "head_dim"), mesh, (64, 4, 16),
                                  rules) == P("tensor", "fsdp", None)


def test_rules_reject_unknown_logical_names_and_missing_mesh_axes():
  mesh = sharding.make_mesh(data=8)
  with pytest.raises(ValueError, match=r"logical axis 'embedd' has no rule"):
    sharding.logical_to_mesh(P("embedd"), mesh, (64,))
  with pytest.raises(ValueError, match=r"names a mesh axis the mesh lacks"):
    sharding.logical_to_mesh(P("embed"), mesh, (64,), (("embed", "model"),))
  with pytest.raises(ValueError, match=r"at most one entry per dimension"):
    sharding.logical_to_mesh(P("embed", None), mesh, (64,))


@pytest.mark.parametrize("shape", [(8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 2, 2), (1, 2, 4)])
def test_param_shardings_are_valid_for_every_leaf_on_any_mesh(shape):
  mesh = sharding.make_mesh(*shape)
  shapes = sharding.param_shapes(CONFIG)
  shardings = sharding.param_shardings(CONFIG, mesh)
  assert jax.tree.structure(shardings) == jax.tree.structure(shapes)
  for leaf, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)):
    sh.shard_shape(leaf.shape)  # raises when a dimension is not divisible
    axes = [a for entry in sh.spec if entry for a in ((entry,) if isinstance(entry, str)
                                                      else entry)]
    assert len(axes) == len(set(axes)), sh.spec


# --- parameters -----------------------------------------------------------------------------


def test_init_sharded_params_has_requested_shardings_and_single_device_values(mesh):
  key = jax.random.key(0)
  shardings = sharding.param_shardings(CONFIG, mesh)
  params = sharding.init_sharded_params(CONFIG, key, mesh)
  _assert_same_shardings(params, shardings)
  # Negative control: the big matrices really are split, not replicated.
  assert params["layers"][0]["wq"].addressable_shards[0].data.shape == (32, 2, 16)
  assert params["embed"].addressable_shards[0].data.shape == (64, 32)
  # Bit-equal to the same program on one device; eager init differs only by an ulp, because
  # XLA fuses the float ops of the normal sampler differently from op-by-op execution.
  _assert_trees_close(params, jax.jit(init_params, static_argnums=0)(CONFIG, key), atol=0)
  _assert_trees_close(params, init_params(CONFIG, key), atol=1e-7)


def test_opt_state_shardings_mirror_params_and_replicate_the_rest(mesh):
  optimizer = optax.adam(1e-3)
  shapes = sharding.param_shapes(CONFIG)
  shardings = sharding.param_shardings(CONFIG, mesh)
  state = sharding.opt_state_shardings(jax.eval_shape(optimizer.init, shapes), shapes,
                                       shardings)
  assert state[0].mu == shardings and state[0].nu == shardings
  assert state[0].count == sharding.replicated(mesh)
  # Adafactor keeps factored moments with the params' tree but other shapes: replicate them.
  factored = jax.eval_shape(optax.adafactor(1e-3, min_dim_size_to_factor=32).init, shapes)
  out = sharding.opt_state_shardings(factored, shapes, shardings)
  for leaf, sh in zip(jax.tree.leaves(factored), jax.tree.leaves(out)):
    sh.shard_shape(leaf.shape)


# --- sharded == single device ---------------------------------------------------------------


def test_sharded_forward_logits_equal_single_device(mesh, tokens):
  params = init_params(CONFIG, jax.random.key(0))
  positions = _positions(B, T)
  logits_fn = lambda p, tok, pos: forward(p, CONFIG, tok, pos).logits
  expected = jax.jit(logits_fn)(params, tokens, positions)

  shardings = sharding.param_shardings(CONFIG, mesh)
  batch = sharding.batch_sharding(mesh, 2)
  sharded_fn = jax.jit(logits_fn, in_shardings=(shardings, batch, batch),
                       out_shardings=sharding.batch_sharding(mesh, 3))
  actual = sharded_fn(sharding.shard_params(params, shardings), tokens, positions)
  assert actual.sharding == sharding.batch_sharding(mesh, 3)
  _assert_trees_close(actual, expected)


def test_sharded_kv_cache_decode_equals_unsharded(mesh, tokens):
  params = init_params(CONFIG, jax.random.key(0))
  max_len, prompt = 16, T - 2

  def step(p, tok, pos, cache):
    out = forward(p, CONFIG, tok, pos, cache)
    return out.logits, out.cache

  def run(step_fn, p, cache):
    prefill, cache = step_fn(p, tokens[:, :prompt], _positions(B, prompt), cache)
    decoded = []
    for t in range(prompt, T):
      logits, cache = step_fn(p, tokens[:, t:t + 1], _positions(B, 1, t), cache)
      decoded.append(logits)
    return prefill, decoded, cache

  expected = run(jax.jit(step), params, KVCache.create(CONFIG, B, max_len))

  param_sh = sharding.param_shardings(CONFIG, mesh)
  cache = KVCache.create(CONFIG, B, max_len)
  cache_sh = sharding.kv_cache_shardings(cache, mesh)
  assert cache_sh.keys[0].spec == P(("data", "fsdp", "expert"), "tensor", None, None)
  batch = sharding.batch_sharding(mesh, 2)
  # Donate the cache: the previous buffers are dead once the new entries are written.
  sharded_step = jax.jit(step, in_shardings=(param_sh, batch, batch, cache_sh),
                         out_shardings=(sharding.batch_sharding(mesh, 3), cache_sh),
                         donate_argnums=3)
  actual = run(sharded_step, sharding.shard_params(params, param_sh),
               jax.device_put(cache, cache_sh))
  _assert_same_shardings(actual[2], cache_sh)
  _assert_trees_close(actual, expected)


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_sharded_supervised_steps_equal_single_device(mesh, tokens):
  # Adam's update is about lr * g / (|g| + eps): for |g| near eps it turns float32
  # reduction-order noise in g (~1e-10 here) into up to lr * noise / eps. With the default
  # eps=1e-8 that is ~1e-5, right at ATOL; eps=1e-6 keeps such noise near 1e-7, so a real
  # sharding bug (differences the size of the updates, ~1e-3) still fails loudly.
  optimizer = optax.adam(1e-3, eps=1e-6)
  loss_mask = (jax.random.uniform(jax.random.key(2), (B, T)) > 0.2).astype(jnp.float32)
  key = jax.random.key(0)

  reference_step = make_supervised_step(CONFIG, optimizer)
  state = init_supervised_state(init_params(CONFIG, key), optimizer)
  expected_metrics = []
  for _ in range(3):
    state, metrics = reference_step(state, tokens, loss_mask)
    expected_metrics.append(metrics)
  expected_params = state.params

  param_sh = sharding.param_shardings(CONFIG, mesh)
  params = sharding.init_sharded_params(CONFIG, key, mesh)
  sharded_state = init_supervised_state(params, optimizer)
  state_sh = sharded_state.replace(
      params=param_sh,
      opt_state=sharding.opt_state_shardings(sharded_state.opt_state, params, param_sh),
      step=sharding.replicated(mesh))
  sharded_state = jax.device_put(sharded_state, state_sh)
  batch = sharding.batch_sharding(mesh, 2)
  # Donate the state: parameters and moments are dead after the update.
  sharded_step = jax.jit(make_supervised_step(CONFIG, optimizer, jit=False),
                         in_shardings=(state_sh, batch, batch),
                         out_shardings=(state_sh, sharding.replicated(mesh)),
                         donate_argnums=0)
  actual_metrics = []
  for _ in range(3):
    sharded_state, metrics = sharded_step(sharded_state, tokens, loss_mask)
    actual_metrics.append(metrics)

  _assert_same_shardings(sharded_state, state_sh)
  assert set(actual_metrics[0]) == set(expected_metrics[0])
  _assert_trees_close(actual_metrics, expected_metrics)
  _assert_trees_close(sharded_state.params, expected_params)
  assert int(sharded_state.step) == 3
  # Negative control: the steps moved the weights far beyond ATOL, so equality is not vacuous.
  moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), expected_params,
                       init_params(CONFIG, key))
  assert max(jax.tree.leaves(moved)) > 100 * ATOL
