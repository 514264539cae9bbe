"""Float32 master weights for low-precision parameters (`specjax.optimizers`)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from specjax.optimizers import MasterState, float32_master


def _train(optimizer, params, steps, grad=lambda p, i: jax.tree.map(jnp.ones_like, p)):
  state = optimizer.init(params)
  for i in range(steps):
    updates, state = optimizer.update(grad(params, i), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def test_bfloat16_parameters_move_with_float32_master_weights_and_not_without():
  # Adam steps of 1e-4 on weights of 1.0, whose bfloat16 neighbours are 2^-7 away.
  params = {"w": jnp.ones((8,), jnp.bfloat16)}
  plain, plain_state = _train(optax.adam(1e-4), params, 60)
  assert plain_state[0].mu["w"].dtype == jnp.bfloat16  # optax keeps moments in the params' dtype
  np.testing.assert_array_equal(plain["w"], params["w"])  # every step rounded away
  mixed, state = _train(float32_master(optax.adam(1e-4)), params, 60)
  assert isinstance(state, MasterState) and state.master["w"].dtype == jnp.float32
  assert state.inner[0].mu["w"].dtype == jnp.float32
  assert mixed["w"].dtype == jnp.bfloat16
  np.testing.assert_allclose(state.master["w"], 1 - 60e-4, rtol=1e-4)  # every step kept
  np.testing.assert_array_equal(mixed["w"], state.master["w"].astype(jnp.bfloat16))
  assert float(mixed["w"][0]) < 1.0


def test_float32_parameters_train_exactly_as_without_the_wrapper():
  params = {"a": jnp.linspace(-1.0, 1.0, 7), "b": jnp.ones((2, 3))}
  grad = lambda p, i: jax.tree.map(lambda x: jnp.sin(x * (i + 1)), p)
  inner, _ = _train(optax.adamw(1e-2, weight_decay=0.1), params, 12, grad)
  wrapped, _ = _train(float32_master(optax.adamw(1e-2, weight_decay=0.1)), params, 12, grad)
  for k in params:
    np.testing.assert_array_equal(inner[k], wrapped[k])


def test_the_update_needs_the_parameters():
  optimizer = float32_master(optax.adam(1e-3))
  params = {"w": jnp.ones((2,), jnp.bfloat16)}
  with pytest.raises(ValueError, match="needs update\\(grads, state, params\\)"):
    optimizer.update(params, optimizer.init(params))
