"""GRPO losses: every option against numbers computed by hand on a 2-row batch.

The shared batch (T = 3, row 1's last token is padding):

  ratio r = exp(logp - old):  row 0: 1.5, 0.5, 1.0     advantage +1
                              row 1: 1.1, 0.7, [2.0]   advantage -2
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.models import ConfigError
from specjax.rl import (GRPOConfig, aggregate_tokens, group_advantages, grpo_loss, kl_estimate,
                        token_entropy)

OLD = jnp.array([[-1.0, -2.0, -0.5], [-1.5, -0.3, -2.0]])
RATIO = jnp.array([[1.5, 0.5, 1.0], [1.1, 0.7, 2.0]])
LOGP = OLD + jnp.log(RATIO)
MASK = jnp.array([[1, 1, 1], [1, 1, 0]])
ADV = jnp.array([1.0, -2.0])


def _config(**kw):
  return GRPOConfig(**{"group_size": 2, "eps_low": 0.2, "eps_high": 0.3, **kw})


def _loss(config, **kw):
  return jax.jit(grpo_loss, static_argnums=0)(config, LOGP, OLD, ADV, MASK, **kw)


def test_group_advantages_match_hand_computed_mean_and_unbiased_std():
  # Group [1, 0, 0]: mean 1/3, centred [2/3, -1/3, -1/3],
  #   unbiased std = sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3) = 0.577350,
  #   advantages [0.666667 / 0.577350, -0.333333 / 0.577350, ...] = [1.154701, -0.577350, ...].
  # Group [1, 1, 1]: all equal -> 0 (not 0/0).
  rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
  adv = group_advantages(rewards, 3, eps=0.0)
  np.testing.assert_allclose(adv, [1.154701, -0.577350, -0.577350, 0, 0, 0], atol=1e-5)
  # Same rewards as [B/G, G].
  np.testing.assert_allclose(group_advantages(rewards.reshape(2, 3), 3, eps=0.0),
                             np.asarray(adv).reshape(2, 3), atol=1e-6)
  # Dr. GRPO: centring only.
  np.testing.assert_allclose(group_advantages(rewards, 3, normalize_std=False),
                             [2 / 3, -1 / 3, -1 / 3, 0, 0, 0], atol=1e-6)
  # G = 2, rewards [0, 2]: centred [-1, 1], std = sqrt((1 + 1) / 1) = 1.414214, plus eps 0.1.
  np.testing.assert_allclose(group_advantages(jnp.array([0.0, 2.0]), 2, eps=0.1),
                             [-1 / 1.514214, 1 / 1.514214], atol=1e-5)


def test_group_advantages_reject_group_size_below_two_and_misfit_shapes():
  with pytest.raises(ConfigError, match=r"group_size=1 is invalid: must be an int >= 2"):
    group_advantages(jnp.zeros(4), 1)
  with pytest.raises(ValueError, match=r"shape \(5,\) do not fit group_size=2"):
    group_advantages(jnp.zeros(5), 2)
  with pytest.raises(ValueError, match=r"shape \(2, 3\) do not fit group_size=2"):
    group_advantages(jnp.zeros((2, 3)), 2)


# Token losses -min(r A, clip(r, 0.8, 1.3) A) with eps_low 0.2, eps_high 0.3:
#   row 0 (A = +1): r 1.5 -> min(1.5, 1.3) = 1.3 -> -1.3   (clipped high)
#                   r 0.5 -> min(0.5, 0.8) = 0.5 -> -0.5
#                   r 1.0 ->                        -1.0
#   row 1 (A = -2): r 1.1 -> min(-2.2, -2.2)     -> +2.2
#                   r 0.7 -> min(-1.4, -1.6) = -1.6 -> +1.6 (clipped low)
#   sums: row 0 -2.8, row 1 3.8, total 1.0 over 5 tokens.
@pytest.mark.parametrize("aggregation,max_length,expected", [
    ("token_mean", None, 1.0 / 5),                     # 0.2
    ("sequence_mean", None, (-2.8 / 3 + 3.8 / 2) / 2),  # (-0.933333 + 1.9) / 2 = 0.483333
    ("fixed_length", 4, 1.0 / (2 * 4)),                # 0.125
])
def test_clipped_objective_matches_hand_computed_value_per_aggregation(aggregation, max_length,
                                                                       expected):
  loss, m = _loss(_config(aggregation=aggregation, max_length=max_length))
  np.testing.assert_allclose(loss, expected, atol=1e-6)
  np.testing.assert_allclose(m.pg_loss, expected, atol=1e-6)
  assert float(m.kl_loss) == 0.0 and m.entropy is None
  np.testing.assert_allclose(m.clip_frac_low, 1 / 5, atol=1e-7)
  np.testing.assert_allclose(m.clip_frac_high, 1 / 5, atol=1e-7)
  # (1.5 + 0.5 + 1.0 + 1.1 + 0.7) / 5 = 0.96; padding's r = 2.0 is ignored.
  np.testing.assert_allclose(m.ratio_mean, 0.96, atol=1e-6)
  # (r - 1) - ln r: 0.094535, 0.193147, 0, 0.004690, 0.056675 -> sum 0.349047, mean 0.069809.
  np.testing.assert_allclose(m.approx_kl, 0.069809, atol=1e-5)


def test_clipped_tokens_give_no_gradient_and_others_give_minus_ratio_times_advantage():
  # d/dlogp of -r A / 5 is -r A / 5 where unclipped: row 0: r 0.5 -> -0.1, r 1.0 -> -0.2;
  # row 1: r 1.1 -> +0.44. The clipped tokens (r 1.5 with A > 0, r 0.7 with A < 0) and the
  # padding get 0.
  grad = jax.grad(lambda lp: grpo_loss(_config(), lp, OLD, ADV, MASK)[0])(LOGP)
  np.testing.assert_allclose(grad, [[0.0, -0.1, -0.2], [0.44, 0.0, 0.0]], atol=1e-6)


def test_clip_higher_leaves_high_ratio_unclipped():
  # eps_high 0.6: r 1.5 < 1.6, so row 0's first token is -1.5 instead of -1.3:
  # total -3.0 + 3.8 = 0.8 over 5 tokens = 0.16; nothing clipped high any more.
  loss, m = _loss(_config(eps_high=0.6))
  np.testing.assert_allclose(loss, 0.16, atol=1e-6)
  assert float(m.clip_frac_high) == 0.0
  np.testing.assert_allclose(m.clip_frac_low, 0.2, atol=1e-7)


# d = ref - logp per token: row 0: 0.0, 0.5, -0.25; row 1: 1.0, -1.0, [3.0 padding]
#   k1 = -d:            0, -0.5, 0.25, -1, 1                   sum -0.25, token mean -0.05
#   k3 = e^d - d - 1:   0, 0.148721, 0.028801, 0.718282, 0.367879
#                       sum 1.263683, token mean 0.252737
#   k3 row means: (0 + 0.148721 + 0.028801) / 3 = 0.059174, (0.718282 + 0.367879) / 2 =
#   0.543081; sequence mean 0.301127.
REF_MINUS_LOGP = jnp.array([[0.0, 0.5, -0.25], [1.0, -1.0, 3.0]])


@pytest.mark.parametrize("estimator,aggregation,kl_mean,aggregated", [
    ("k1", "token_mean", -0.05, -0.05),
    ("k3", "token_mean", 0.252737, 0.252737),
    ("k3", "sequence_mean", 0.252737, 0.301127),
])
def test_kl_penalty_matches_hand_computed_k1_and_k3(estimator, aggregation, kl_mean, aggregated):
  config = _config(beta=0.1, kl_estimator=estimator, aggregation=aggregation)
  zero_adv = jnp.zeros(2)  # isolates the KL term: the policy-gradient part is 0
  loss, m = grpo_loss(config, LOGP, OLD, zero_adv, MASK, ref_logprobs=LOGP + REF_MINUS_LOGP)
  np.testing.assert_allclose(m.kl, kl_mean, atol=1e-5)
  np.testing.assert_allclose(loss, 0.1 * aggregated, atol=1e-6)
  np.testing.assert_allclose(m.kl_loss, 0.1 * aggregated, atol=1e-6)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_garbage_in_the_padding_gives_finite_gradients(estimator):
  config = _config(beta=0.1, kl_estimator=estimator)
  padding = MASK == 0
  assert bool(padding.any())
  ref = jnp.where(padding, 1e4, LOGP + REF_MINUS_LOGP)  # exp(1e4) overflows to inf
  logp_in = jnp.where(padding, -1e4, LOGP)
  grad = jax.grad(lambda lp: grpo_loss(config, lp, OLD, jnp.ones(2), MASK,
                                       ref_logprobs=ref)[0])(logp_in)
  assert bool(jnp.isfinite(grad).all()), grad
  assert float(jnp.abs(jnp.where(padding, grad, 0.0)).max()) == 0.0
  clean = jax.grad(lambda lp: grpo_loss(config, lp, OLD, jnp.ones(2), MASK,
                                        ref_logprobs=LOGP + REF_MINUS_LOGP)[0])(LOGP)
  np.testing.assert_allclose(jnp.where(padding, 0.0, grad), jnp.where(padding, 0.0, clean),
                             atol=1e-6)


def test_kl_estimate_per_token_values():
  lp = jnp.zeros((1, 2))
  ref = jnp.array([[math.log(2.0), -math.log(2.0)]])
  # k1 = -(ref - lp) = [-ln 2, ln 2]; k3 = e^d - d - 1 = [2 - 0.693147 - 1, 0.5 + 0.693147 - 1]
  np.testing.assert_allclose(kl_estimate(lp, ref, "k1"), [[-0.693147, 0.693147]], atol=1e-6)
  np.testing.assert_allclose(kl_estimate(lp, ref, "k3"), [[0.306853, 0.193147]], atol=1e-6)
  with pytest.raises(ConfigError, match="kl_estimator='k2' is invalid"):
    kl_estimate(lp, ref, "k2")


def test_beta_without_reference_logprobs_is_an_error():
  with pytest.raises(ValueError, match=r"beta=0.1 needs ref_logprobs"):
    grpo_loss(_config(beta=0.1), LOGP, OLD, ADV, MASK)


# Truncated IS with r = 1 everywhere (logp = old), so every token's loss is -w A:
#   old - rollout: row 0: ln 1.5, ln 3, 0 -> w = 1.5, min(3, 2) = 2, 1
#                  row 1: ln 0.5, ln 2.5   -> w = 0.5, min(2.5, 2) = 2
#   token losses: -1.5, -2, -1 | +1, +4  -> sum 0.5, token mean 0.1
#   mean weight (1.5 + 2 + 1 + 0.5 + 2) / 5 = 1.4; capped 2 of 5 = 0.4.
ROLLOUT = OLD - jnp.log(jnp.array([[1.5, 3.0, 1.0], [0.5, 2.5, 9.0]]))


def test_truncated_importance_weights_match_hand_computed_values():
  loss, m = grpo_loss(_config(tis_cap=2.0), OLD, OLD, ADV, MASK, rollout_logprobs=ROLLOUT)
  np.testing.assert_allclose(loss, 0.1, atol=1e-6)
  np.testing.assert_allclose(m.tis_weight_mean, 1.4, atol=1e-6)
  np.testing.assert_allclose(m.tis_clip_frac, 0.4, atol=1e-7)
  # Without the correction every weight is 1: -1 -1 -1 +2 +2 = 1 over 5 tokens.
  loss, m = grpo_loss(_config(tis_cap=None), OLD, OLD, ADV, MASK, rollout_logprobs=ROLLOUT)
  np.testing.assert_allclose(loss, 0.2, atol=1e-6)
  assert float(m.tis_weight_mean) == 1.0 and float(m.tis_clip_frac) == 0.0


def test_entropy_metric_matches_hand_computed_value_and_ignores_padding():
  # p = [0.5, 0.25, 0.25]: H = 0.5 ln 2 + 2 * 0.25 ln 4 = 0.346574 + 0.693147 = 1.039721.
  # The padding token has uniform logits (H = ln 3 = 1.098612); it must not count.
  logits = jnp.tile(jnp.log(jnp.array([0.5, 0.25, 0.25])), (2, 3, 1))
  logits = logits.at[1, 2].set(0.0)
  _, m = grpo_loss(_config(), LOGP, OLD, ADV, MASK, logits=logits)
  np.testing.assert_allclose(m.entropy, 1.039721, atol=1e-5)
  np.testing.assert_allclose(token_entropy(logits)[1, 2], math.log(3), atol=1e-6)


def test_aggregate_tokens_on_values_with_empty_row():
  values = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
  mask = jnp.array([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
  # token_mean: (1 + 2 + 4 + 5 + 6) / 5 = 3.6
  # sequence_mean: (3 / 2 + 15 / 3 + 0) / 3 = (1.5 + 5 + 0) / 3 = 2.166667
  # fixed_length 10: 18 / (3 * 10) = 0.6
  np.testing.assert_allclose(aggregate_tokens(values, mask, "token_mean"), 3.6, atol=1e-6)
  np.testing.assert_allclose(aggregate_tokens(values, mask, "sequence_mean"), 6.5 / 3, atol=1e-6)
  np.testing.assert_allclose(aggregate_tokens(values, mask, "fixed_length", 10), 0.6, atol=1e-6)


@pytest.mark.parametrize("kwargs,message", [
    ({"group_size": 1}, r"group_size=1 is invalid: must be an int >= 2"),
    ({"group_size": 0}, r"group_size=0 is invalid"),
    ({"eps_low": 1.0}, r"eps_low=1.0 is invalid: must be in \[0, 1\)"),
    ({"eps_high": -0.1}, r"eps_high=-0.1 is invalid: must be >= 0"),
    ({"beta": -1.0}, r"beta=-1.0 is invalid"),
    ({"kl_estimator": "k2"}, r"kl_estimator='k2' is invalid: allowed: \('k1', 'k3'\)"),
    ({"aggregation": "mean"}, r"aggregation='mean' is invalid: allowed: \('token_mean'"),
    ({"aggregation": "fixed_length"}, r"max_length=None is invalid: aggregation='fixed_length'"),
    ({"max_length": 16}, r"max_length=16 is invalid: only used by aggregation='fixed_length'"),
    ({"tis_cap": 0.0}, r"tis_cap=0.0 is invalid: must be > 0, or None"),
    ({"num_epochs": 0}, r"num_epochs=0 is invalid"),
    ({"num_minibatches": 0}, r"num_minibatches=0 is invalid"),
])
def test_grpo_config_rejects_bad_fields_naming_them(kwargs, message):
  with pytest.raises(ConfigError, match=message):
    GRPOConfig(**kwargs)


def test_grpo_config_is_hashable_and_loss_compiles_once():
  config = _config()
  assert hash(config) == hash(_config())
  traces = []

  @jax.jit
  def f(lp):
    traces.append(1)
    return grpo_loss(config, lp, OLD, ADV, MASK)[0]

  f(LOGP)
  f(LOGP + 0.01)
  assert len(traces) == 1
