"""Mixed precision for optimizers: low-precision parameters, float32 optimizer arithmetic.

A bfloat16 parameter has 8 bits of mantissa: near 1.0 its neighbours are 2^-7 apart, so an
Adam step of 1e-4 added to it rounds back to the same number, and training stops moving the
weights while its loss still says it should. `float32_master(inner)` keeps a float32 copy of
the parameters (the master weights) in the optimizer state: the gradient is cast to float32,
`inner` (Adam, its moments then in float32 too) updates the master copy, and the parameters
become the master rounded to their own dtype. Small steps accumulate in the master until
they move the low-precision weight, as in every mixed-precision recipe; the cost is 4 bytes
per parameter on top of the moments.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class MasterState(NamedTuple):
  """`float32_master`'s state: the float32 master parameters and the inner optimizer's."""

  master: optax.Params
  inner: optax.OptState


def float32_master(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """`inner` run on float32 master weights (module docstring).

  `update(grads, state, params)` needs `params`; its updates, added by `optax.apply_updates`
  (which adds in float32 and rounds to the parameter's dtype), turn each parameter into its
  master value rounded to the parameter's dtype. Float32 parameters behave exactly as under
  `inner` alone, with a redundant copy.
  """

  def f32(tree):
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)

  def init(params):
    master = f32(params)
    return MasterState(master=master, inner=inner.init(master))

  def update(grads, state, params=None):
    if params is None:
      raise ValueError("float32_master needs update(grads, state, params): the parameters "
                       "its updates move to their master values")
    steps, inner_state = inner.update(f32(grads), state.inner, state.master)
    master = optax.apply_updates(state.master, steps)
    updates = jax.tree.map(lambda m, p: m - jnp.asarray(p, jnp.float32), master, params)
    return updates, MasterState(master=master, inner=inner_state)

  return optax.GradientTransformation(init, update)
