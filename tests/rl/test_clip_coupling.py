"""Gradient clipping of the GRPO optimizer does not couple the trunk to the draft heads.

The MTP / Medusa heads are trained on rollouts by a drafter loss detached from the trunk, and
share the policy's optimizer. Under one global clipping norm a huge head gradient would
still shrink the trunk's step; `ExperimentConfig.drafter.clip_heads_separately` (the default) clips
each part by its own norm. Each test of the separation has a negative control showing that
the old shared clipping does couple them, so the property is not met by accident.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from specjax.checkpoint import Checkpointer
from specjax.errors import ConfigError
from specjax.experiments import Drafting, ExperimentConfig, Optimization, RolloutSettings
from specjax.experiments.grpo_config import _clip_trunk_and_heads
from specjax.models import ModelConfig, init_params
from specjax.models.heads import DRAFT_HEAD_KEYS
from specjax.models.transformer import forward
from specjax.rl import ArithmeticTask
from specjax.supervised import draft_head_loss

TASK = ArithmeticTask(max_digits=1, num_train=64, num_test=16)
MODEL = ModelConfig(vocab_size=TASK.tokenizer.vocab_size, d_model=32, n_layers=1, n_heads=2,
                    n_kv_heads=2, head_dim=16, mlp_dim=64, num_mtp_modules=1,
                    num_medusa_heads=1, max_position=32)
HEADS = ("mtp", "medusa")
HUGE = 1e6


def _config(clip_heads_separately=True) -> ExperimentConfig:
  # warmup_steps=0 still starts the schedule at 0: the first update has learning rate 0.
  return ExperimentConfig(task=TASK, model=MODEL,
                          optim=Optimization(learning_rate=1e-2, warmup_steps=0,
                                             max_grad_norm=1.0),
                          rollout=RolloutSettings(tree_widths=(1,)),
                          drafter=Drafting(clip_heads_separately=clip_heads_separately))


def _params():
  return init_params(MODEL, jax.random.key(0))


def _grads(params, head_scale: float, trunk_scale: float = 1e-3):
  """A deterministic gradient: `trunk_scale` on every trunk element (the trunk's global norm
  stays below max_grad_norm = 1), `head_scale` on every head element."""
  return {k: jax.tree.map(lambda x, s=(head_scale if k in HEADS else trunk_scale):
                          jnp.full(x.shape, s, jnp.float32), v)
          for k, v in params.items()}


def _split(tree):
  return ({k: v for k, v in tree.items() if k not in HEADS},
          {k: v for k, v in tree.items() if k in HEADS})


def _updates(optimizer, params, head_scales):
  """The optimizer's updates over consecutive steps, one per head gradient scale."""
  state = optimizer.init(params)
  out = []
  for scale in head_scales:
    updates, state = optimizer.update(_grads(params, scale), state, params)
    out.append(updates)
  return out


def _max_abs_difference(a, b) -> float:
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                             jax.tree.leaves(b)))


def _reached(grads) -> set[str]:
  """The top-level parameter keys with a nonzero gradient."""
  return {k for k, v in grads.items() if any(bool(jnp.any(x != 0)) for x in jax.tree.leaves(v))}


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_the_heads_clipped_apart_are_exactly_what_the_detached_drafter_loss_reaches():
  """The partition is the one the losses make: the drafter loss (as the GRPO step computes
  it, detached) reaches the head keys and nothing else, the policy's logits only the rest."""
  params = _params()
  tokens = jnp.arange(16).reshape(2, 8) % MODEL.vocab_size
  positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
  mask = jnp.ones((2, 8), jnp.float32)

  def drafter_loss(p):
    out = forward(p, MODEL, tokens, positions)
    return draft_head_loss(p, MODEL, out.hidden, tokens, mask, 1.0, 1.0, detach=True)[0]

  def policy_loss(p):
    return jax.nn.logsumexp(forward(p, MODEL, tokens, positions).logits, -1).mean()

  assert _reached(jax.grad(drafter_loss)(params)) == set(DRAFT_HEAD_KEYS) == set(HEADS)
  assert _reached(jax.grad(policy_loss)(params)) == set(params) - set(HEADS)


def test_separate_clipping_leaves_the_trunk_gradient_unscaled_by_a_huge_head_gradient():
  params = _params()
  grads = _grads(params, HUGE)
  trunk, heads = _split(grads)
  assert float(optax.global_norm(trunk)) < 1.0  # the trunk alone needs no clipping

  clipped, _ = _clip_trunk_and_heads(1.0).update(grads, optax.EmptyState())
  clipped_trunk, clipped_heads = _split(clipped)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), clipped_trunk, trunk)
  # The heads are still clipped to max_grad_norm, in their own direction.
  np.testing.assert_allclose(float(optax.global_norm(clipped_heads)), 1.0, rtol=1e-5)
  scale = 1.0 / float(optax.global_norm(heads))
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y * scale, rtol=1e-5),
               clipped_heads, heads)

  # Negative control: one global norm shrinks the trunk's gradient by the head's norm.
  shared, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
  shared_trunk, _ = _split(shared)
  ratio = float(optax.global_norm(shared_trunk) / optax.global_norm(trunk))
  assert ratio < 1e-6, ratio


def test_separate_clipping_clips_a_large_trunk_gradient_by_the_trunk_norm_alone():
  params = _params()
  grads = _grads(params, HUGE, trunk_scale=1.0)
  trunk, _ = _split(grads)
  norm = float(optax.global_norm(trunk))
  assert norm > 1.0
  clipped, _ = _clip_trunk_and_heads(1.0).update(grads, optax.EmptyState())
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y / norm, rtol=1e-5),
               _split(clipped)[0], trunk)


def test_default_optimizer_gives_the_trunk_the_update_it_gets_with_no_head_gradient():
  """Over two Adam steps (the first at learning rate 0), a huge head gradient on the second
  leaves the trunk's updates exactly those of a run whose heads have no gradient."""
  params = _params()
  optimizer = _config().optimizer()
  reference = _updates(optimizer, params, [0.0, 0.0])
  coupled = _updates(optimizer, params, [0.0, HUGE])
  for ref, got in zip(reference, coupled):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), _split(got)[0],
                 _split(ref)[0])
  assert _max_abs_difference(_split(reference[1])[0], jax.tree.map(
      jnp.zeros_like, _split(reference[1])[0])) > 0  # the compared update is not all zero


def test_shared_clipping_lets_a_huge_head_gradient_change_the_trunk_update():
  """Negative control: with one global norm (the old behaviour) the same head gradient
  shrinks the trunk's second-step gradient ~1e-6-fold, which Adam's moments turn into an
  update about a third smaller than the reference's."""
  params = _params()
  optimizer = _config(clip_heads_separately=False).optimizer()
  reference = _updates(optimizer, params, [0.0, 0.0])
  coupled = _updates(optimizer, params, [0.0, HUGE])
  ref_trunk, got_trunk = _split(reference[1])[0], _split(coupled[1])[0]
  difference = _max_abs_difference(ref_trunk, got_trunk)
  assert difference > 0.1 * _max_abs_difference(ref_trunk, jax.tree.map(jnp.zeros_like,
                                                                        ref_trunk))


def test_without_heads_the_separate_clipping_is_the_shared_one():
  params = {k: v for k, v in _params().items() if k not in HEADS}
  grads = jax.tree.map(lambda x: jnp.full(x.shape, 3.0, jnp.float32), params)
  separate, _ = _clip_trunk_and_heads(1.0).update(grads, optax.EmptyState())
  shared, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), separate, shared)


def test_a_checkpoint_saved_with_shared_clipping_restores_into_separate_clipping(tmp_path):
  """Runs started before the field existed resume: the optimizer state has one structure."""
  params = _params()
  old = _config(clip_heads_separately=False).optimizer().init(params)
  new = _config().optimizer().init(params)
  assert jax.tree.structure(old) == jax.tree.structure(new)

  ckpt = Checkpointer(tmp_path / "ckpt")
  ckpt.save(0, {"params": params, "opt_state": old}, {"step": 0})
  ckpt.close()
  abstract = jax.eval_shape(lambda: {"params": params, "opt_state": new})
  ckpt = Checkpointer(tmp_path / "ckpt")
  state, meta, step = ckpt.restore(abstract)
  ckpt.close()
  assert step == 0 and meta["step"] == 0
  assert jax.tree.structure(state["opt_state"]) == jax.tree.structure(new)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_clip_heads_separately_must_be_a_bool(value):
  with pytest.raises(ConfigError, match=rf"^drafter.clip_heads_separately={value!r} is invalid: "
                                        "must be True or False"):
    _config(clip_heads_separately=value)
