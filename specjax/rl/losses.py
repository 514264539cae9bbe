"""GRPO: group-relative advantages and the token-level clipped policy loss, in pure JAX.

Rows are laid out prompt-major: the G samples of prompt i are rows `i * G .. i * G + G - 1`.

The loss per response token t of row b is

    loss[b, t] = -w[b, t] * min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta * kl[b, t]

with `r = exp(logp - old_logp)` the ratio to the policy at the start of the update, `A` the
row's advantage, `w = min(exp(old_logp - rollout_logp), tis_cap)` the truncated importance
weight between the trainer and the rollout engine (1 when no rollout log-probs are given),
and `kl` a k1 or k3 estimate of KL(pi_theta || pi_ref) on the sampled token. The token losses
are then aggregated over the batch (see `aggregate_tokens`).

Shape letters: see `specjax` (B rows, B / G prompts, G group size, T response tokens, V vocab).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specjax.checks import is_int
from specjax.errors import ConfigError

AGGREGATIONS = ("token_mean", "sequence_mean", "fixed_length")
KL_ESTIMATORS = ("k1", "k3")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """Hyper-parameters of GRPO and its DAPO / Dr. GRPO variants.

  Attributes:
    group_size: G samples per prompt; at least 2, or no group has a baseline.
    eps_low: lower clip, the ratio is clipped at `1 - eps_low`; in [0, 1).
    eps_high: upper clip, the ratio is clipped at `1 + eps_high`; DAPO's clip-higher uses
      e.g. 0.28 with eps_low 0.2.
    beta: coefficient of the KL penalty to the frozen reference (0 = no reference needed).
    kl_estimator: "k1" (`logp - ref_logp`) or "k3" (`exp(ref - logp) - (ref - logp) - 1`,
      unbiased and never negative).
    aggregation: "token_mean" (DAPO: every token of the batch weighs the same),
      "sequence_mean" (original GRPO: mean over each row, then over rows), or "fixed_length"
      (Dr. GRPO: token sum divided by B * `max_length`, so length carries no bias).
    max_length: the constant normaliser of "fixed_length" (usually max_new_tokens); must be
      None for the other aggregations.
    normalize_std: divide advantages by the group std (False: Dr. GRPO, centring only).
    adv_eps: added to the group std before dividing.
    tis_cap: cap of the truncated importance weight between trainer and rollout log-probs;
      None disables the correction.
    num_epochs: passes (mu) over each rollout batch.
    num_minibatches: minibatches each rollout batch is split into per pass.
    objective: the policy loss by name (`objectives()`; "grpo" is `grpo_loss`, whose settings
      above also give Dr. GRPO and DAPO); `register_objective` adds one.
    router_aux_weight: weight of a mixture-of-experts policy's load-balancing loss
      (`specjax.models.moe.load_balancing_loss`, over every token of the minibatch) added to
      the objective. 0 (default): routing moves only with the policy loss, as RL recipes for
      Qwen3-MoE run it (slime's Qwen3-30B-A3B script sets Megatron's --moe-aux-loss-coeff
      0); transformers adds its router_aux_loss_coef (0.001) only when asked for router
      logits, as pre-training does. The metric `router_balance` (k when balanced) is logged
      for MoE policies either way.
  """

  group_size: int = 8
  eps_low: float = 0.2
  eps_high: float = 0.2
  beta: float = 0.0
  kl_estimator: str = "k3"
  aggregation: str = "token_mean"
  max_length: int | None = None
  normalize_std: bool = True
  adv_eps: float = 1e-6
  tis_cap: float | None = 2.0
  num_epochs: int = 1
  num_minibatches: int = 1
  objective: str = "grpo"
  router_aux_weight: float = 0.0

  def __post_init__(self):
    def require(ok: bool, field: str, allowed: str):
      if not ok:
        raise ConfigError(f"{field}={getattr(self, field)!r} is invalid: {allowed}")

    # A string fails the comparisons below with a bare TypeError, and a bool passes them.
    for field in ("eps_low", "eps_high", "beta", "adv_eps", "router_aux_weight") + (
        ("tis_cap",) if self.tis_cap is not None else ()):
      value = getattr(self, field)
      require(isinstance(value, numbers.Real) and not isinstance(value, bool), field,
              "must be a number")
    _check_group_size(self.group_size)
    require(0 <= self.eps_low < 1, "eps_low", "must be in [0, 1) so that 1 - eps_low > 0")
    require(self.eps_high >= 0, "eps_high", "must be >= 0 (inf: no upper clip)")
    require(0 <= self.beta < math.inf, "beta", "must be a finite number >= 0")
    require(self.kl_estimator in KL_ESTIMATORS, "kl_estimator", f"allowed: {KL_ESTIMATORS}")
    require(self.aggregation in AGGREGATIONS, "aggregation", f"allowed: {AGGREGATIONS}")
    if self.aggregation == "fixed_length":
      require(isinstance(self.max_length, int) and self.max_length > 0, "max_length",
              "aggregation='fixed_length' needs a positive int normaliser (e.g. "
              "max_new_tokens)")
    else:
      require(self.max_length is None, "max_length",
              f"only used by aggregation='fixed_length', got {self.aggregation!r}; leave None")
    require(isinstance(self.normalize_std, bool), "normalize_std", "must be a bool")
    require(0 <= self.adv_eps < math.inf, "adv_eps", "must be a finite number >= 0")
    require(0 <= self.router_aux_weight < math.inf, "router_aux_weight",
            "must be a finite number >= 0 (0: no load-balancing loss)")
    require(self.tis_cap is None or self.tis_cap > 0, "tis_cap", "must be > 0, or None to "
            "disable truncated importance sampling")
    for field in ("num_epochs", "num_minibatches"):
      value = getattr(self, field)
      require(is_int(value) and value >= 1, field, "must be an int >= 1")
    require(self.objective in _OBJECTIVES, "objective",
            f"allowed one of {', '.join(objectives())} (register_objective adds one)")


def _check_group_size(group_size) -> None:
  if not is_int(group_size) or group_size < 2:
    raise ConfigError(f"group_size={group_size!r} is invalid: must be an int >= 2 (GRPO's "
                      "baseline is the mean of the other samples of the same prompt)")


@struct.dataclass
class GRPOMetrics:
  """Scalars describing one loss evaluation; token statistics are means over response tokens.

  Attributes:
    loss: the aggregated loss (what is differentiated).
    pg_loss: the policy-gradient part of `loss`.
    kl_loss: `beta` times the aggregated KL estimate (0 when beta is 0).
    kl: token mean of the configured KL estimate to the reference (0 without one).
    approx_kl: token mean of k3 between the update-start policy and the current one,
      `(r - 1) - log r`; 0 on the first minibatch of the first epoch.
    ratio_mean: token mean of `r`.
    clip_frac_low: fraction of tokens whose objective is clipped below (A < 0 and
      r < 1 - eps_low; these tokens give no gradient).
    clip_frac_high: fraction clipped above (A > 0 and r > 1 + eps_high).
    tis_weight_mean: token mean of the truncated importance weight (1 without correction).
    tis_clip_frac: fraction of tokens whose importance weight hit the cap.
    entropy: token mean of the policy entropy when logits were given, else None.
  """

  loss: jax.Array
  pg_loss: jax.Array
  kl_loss: jax.Array
  kl: jax.Array
  approx_kl: jax.Array
  ratio_mean: jax.Array
  clip_frac_low: jax.Array
  clip_frac_high: jax.Array
  tis_weight_mean: jax.Array
  tis_clip_frac: jax.Array
  entropy: jax.Array | None = None


def group_advantages(rewards: jax.Array, group_size: int, *, normalize_std: bool = True,
                     eps: float = 1e-6) -> jax.Array:
  """Group-relative advantages `(r - mean_group) / (std_group + eps)`.

  The std is the unbiased one (ddof 1, as TRL and verl compute it). A group whose rewards
  are all equal gets advantage 0.

  Args:
    rewards: `[B]` rewards, prompt-major (B a multiple of G), or `[B / G, G]`.
    group_size: G, >= 2.
    normalize_std: divide by the group std; False centres only (Dr. GRPO).
    eps: added to the std.

  Returns:
    Advantages with the shape of `rewards`, float32. A non-finite reward is an error when
    `rewards` are concrete; under `jit` it makes its group's advantages NaN (never 0), so a
    finiteness check of the loss or metrics sees it.
  """
  _check_group_size(group_size)
  if not isinstance(rewards, jax.core.Tracer):
    values = np.asarray(rewards, np.float32)
    bad = ~np.isfinite(values)
    if bad.any():
      where = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(f"rewards{list(where)} = {values[where]} is not finite ({int(bad.sum())} "
                       "non-finite rewards): a reward must be a finite number")
  rewards = jnp.asarray(rewards, jnp.float32)
  if rewards.ndim == 1 and rewards.shape[0] % group_size == 0:
    grouped = rewards.reshape(-1, group_size)
  elif rewards.ndim == 2 and rewards.shape[1] == group_size:
    grouped = rewards
  else:
    raise ValueError(f"rewards of shape {rewards.shape} do not fit group_size={group_size}: "
                     "allowed [B] with B a multiple of G, or [B / G, G]")
  centred = grouped - grouped.mean(axis=1, keepdims=True)
  if normalize_std:
    std = jnp.sqrt(jnp.sum(centred**2, axis=1, keepdims=True) / (group_size - 1))
    denom = std + eps
    # A constant group has centred == 0 (up to rounding); with eps = 0 that would be 0/0.
    # Tested as `== 0`, not `> 0`: a NaN denominator must stay NaN, not become advantage 0.
    centred = jnp.where(denom == 0, 0.0, centred / jnp.where(denom == 0, 1.0, denom))
  return centred.reshape(rewards.shape)


def kl_estimate(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str) -> jax.Array:
  """Per-token estimate of KL(pi_theta || pi_ref) from tokens sampled from pi_theta.

  Args:
    logprobs: `[B, T]` log pi_theta of the sampled tokens.
    ref_logprobs: `[B, T]` log pi_ref of the same tokens.
    estimator: "k1" (`logp - ref`) or "k3" (`exp(ref - logp) - (ref - logp) - 1`).

  Returns:
    `[B, T]` estimates.
  """
  log_ratio = ref_logprobs - logprobs
  if estimator == "k1":
    return -log_ratio
  if estimator == "k3":
    return jnp.exp(log_ratio) - log_ratio - 1.0
  raise ConfigError(f"kl_estimator={estimator!r} is invalid: allowed: {KL_ESTIMATORS}")


def token_entropy(logits: jax.Array) -> jax.Array:
  """`[B, T, V]` logits -> `[B, T]` entropy of softmax(logits), in nats."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def aggregate_tokens(values: jax.Array, mask: jax.Array, aggregation: str,
                     max_length: int | None = None) -> jax.Array:
  """Reduce per-token values to a scalar the way the loss is normalised.

  Args:
    values: `[B, T]` per-token values.
    mask: `[B, T]` 1 on response tokens, 0 on padding.
    aggregation: "token_mean": sum / number of response tokens in the batch;
      "sequence_mean": mean over rows of (row sum / row tokens), a row with no token counts 0;
      "fixed_length": sum / (B * max_length).
    max_length: the normaliser of "fixed_length".

  Returns:
    A scalar.
  """
  mask = mask.astype(jnp.float32)
  masked = values * mask
  if aggregation == "token_mean":
    return masked.sum() / jnp.maximum(mask.sum(), 1.0)
  if aggregation == "sequence_mean":
    return jnp.mean(masked.sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0))
  if aggregation == "fixed_length":
    if max_length is None:
      raise ConfigError("max_length=None is invalid: aggregation='fixed_length' needs it")
    return masked.sum() / (values.shape[0] * max_length)
  raise ConfigError(f"aggregation={aggregation!r} is invalid: allowed: {AGGREGATIONS}")


def _check_loss_shapes(logprobs: jax.Array, *, advantages: jax.Array, logits: jax.Array | None,
                       **same: jax.Array | None) -> None:
  """Raise a `ValueError` naming the input whose shape does not fit `logprobs [B, T]`
  (broadcasting would otherwise fail deep in JAX, or silently pair the wrong tokens)."""
  shape = tuple(jnp.shape(logprobs))
  if len(shape) != 2:
    raise ValueError(f"logprobs has shape {shape}: allowed [B, T] (rows, response tokens)")
  problems = [f"{name} has shape {tuple(jnp.shape(x))}, logprobs {shape}: allowed the same "
              "[B, T]" for name, x in same.items()
              if x is not None and tuple(jnp.shape(x)) != shape]
  adv = tuple(jnp.shape(advantages))
  if adv not in (shape[:1], shape):
    problems.append(f"advantages has shape {adv}: allowed [B]={shape[:1]} per row or "
                    f"[B, T]={shape} per token")
  if logits is not None and tuple(jnp.shape(logits))[:2] != shape:
    problems.append(f"logits has shape {tuple(jnp.shape(logits))}: allowed [B, T, V] with "
                    f"[B, T]={shape}")
  if problems:
    raise ValueError("grpo_loss: " + "; ".join(problems))


def grpo_loss(config: GRPOConfig, logprobs: jax.Array, old_logprobs: jax.Array,
              advantages: jax.Array, mask: jax.Array, *,
              ref_logprobs: jax.Array | None = None,
              rollout_logprobs: jax.Array | None = None,
              logits: jax.Array | None = None) -> tuple[jax.Array, GRPOMetrics]:
  """The GRPO loss of one minibatch and its metrics.

  Args:
    config: the GRPO hyper-parameters.
    logprobs: `[B, T]` log-probabilities of the response tokens under the current policy
      (the only differentiated input).
    old_logprobs: `[B, T]` the same under the policy at the start of this update (the
      trainer's view; equal to `logprobs` on the first minibatch of the first epoch).
    advantages: `[B]` per-row or `[B, T]` per-token advantages.
    mask: `[B, T]` 1 on response tokens, 0 on padding.
    ref_logprobs: `[B, T]` under the frozen reference; required when `config.beta > 0`.
    rollout_logprobs: `[B, T]` reported by the rollout engine (the behaviour policy). With
      `config.tis_cap`, tokens are weighted by `min(exp(old - rollout), tis_cap)`.
    logits: `[B, T, V]` current-policy logits (as sampled from: after temperature), only for
      the entropy metric.

  Returns:
    The scalar loss and `GRPOMetrics`.
  """
  if config.beta > 0 and ref_logprobs is None:
    raise ValueError(f"beta={config.beta} needs ref_logprobs (log-probs under the frozen "
                     "reference); pass them or set beta=0")
  _check_loss_shapes(logprobs, old_logprobs=old_logprobs, mask=mask,
                     ref_logprobs=ref_logprobs, rollout_logprobs=rollout_logprobs,
                     advantages=advantages, logits=logits)
  mask = mask.astype(jnp.float32)
  logprobs = logprobs.astype(jnp.float32)
  old_logprobs = jax.lax.stop_gradient(old_logprobs.astype(jnp.float32))
  advantages = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))
  if advantages.ndim == 1:
    advantages = advantages[:, None]

  def agg(values):
    return aggregate_tokens(values, mask, config.aggregation, config.max_length)

  def token_mean(values):
    return aggregate_tokens(values, mask, "token_mean")

  # Padding can hold arbitrary log-probs; zero the difference there so exp cannot overflow.
  log_ratio = jnp.where(mask > 0, logprobs - old_logprobs, 0.0)
  ratio = jnp.exp(log_ratio)
  clipped = jnp.clip(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
  objective = jnp.minimum(ratio * advantages, clipped * advantages)

  if rollout_logprobs is not None and config.tis_cap is not None:
    tis_log = jnp.where(mask > 0, old_logprobs - rollout_logprobs.astype(jnp.float32), 0.0)
    raw = jax.lax.stop_gradient(jnp.exp(tis_log))
    weight = jnp.minimum(raw, config.tis_cap)
    tis_clip = (raw > config.tis_cap).astype(jnp.float32)
  else:
    weight = jnp.ones_like(ratio)
    tis_clip = jnp.zeros_like(ratio)

  pg_loss = agg(-weight * objective)
  if ref_logprobs is not None:
    # Mask the inputs, not only the output: k3 exponentiates ref - logp, and garbage in the
    # padding (inf there) would make the gradient NaN even though the masked loss is finite.
    live = mask > 0
    kl_tokens = kl_estimate(jnp.where(live, logprobs, 0.0),
                            jnp.where(live, ref_logprobs.astype(jnp.float32), 0.0),
                            config.kl_estimator)
    kl_tokens = jnp.where(live, kl_tokens, 0.0)
    kl_loss = config.beta * agg(kl_tokens)
    kl = token_mean(kl_tokens)
  else:
    kl_loss = jnp.zeros((), jnp.float32)
    kl = jnp.zeros((), jnp.float32)
  loss = pg_loss + kl_loss

  stats = jax.lax.stop_gradient
  low = (ratio < 1.0 - config.eps_low) & (advantages < 0)
  high = (ratio > 1.0 + config.eps_high) & (advantages > 0)
  metrics = GRPOMetrics(
      loss=stats(loss),
      pg_loss=stats(pg_loss),
      kl_loss=stats(kl_loss),
      kl=stats(kl),
      approx_kl=stats(token_mean(ratio - 1.0 - log_ratio)),
      ratio_mean=stats(token_mean(ratio)),
      clip_frac_low=token_mean(low.astype(jnp.float32)),
      clip_frac_high=token_mean(high.astype(jnp.float32)),
      tis_weight_mean=token_mean(weight),
      tis_clip_frac=token_mean(tis_clip),
      entropy=None if logits is None else stats(token_mean(token_entropy(logits))),
  )
  return loss, metrics


# Policy objectives by name. An objective has `grpo_loss`'s signature and returns its
# `(loss, GRPOMetrics)`; the train step calls the one `GRPOConfig.objective` names.
Objective = Callable[..., "tuple[jax.Array, GRPOMetrics]"]
_OBJECTIVES: dict[str, Objective] = {"grpo": grpo_loss}


def register_objective(name: str, loss: Objective, *, replace: bool = False) -> None:
  """Make `GRPOConfig(objective=name)` train with `loss` (same signature as `grpo_loss`).

  Raises:
    ConfigError: `name` is not a non-empty string or is taken (unless `replace`), or `loss`
      is not callable.
  """
  if not isinstance(name, str) or not name:
    raise ConfigError(f"objective name {name!r} is invalid: must be a non-empty string")
  if not callable(loss):
    raise ConfigError(f"register_objective({name!r}, {loss!r}): the loss must be callable")
  if name in _OBJECTIVES and not replace:
    raise ConfigError(f"objective {name!r} is registered already; pass replace=True to "
                      "replace it")
  _OBJECTIVES[name] = loss


def objectives() -> tuple[str, ...]:
  """The registered objective names."""
  return tuple(sorted(_OBJECTIVES))


def objective_loss(name: str) -> Objective:
  """The loss registered as `name` (`GRPOConfig` checks the name when it is built)."""
  if name not in _OBJECTIVES:
    raise ConfigError(f"objective={name!r} is invalid: allowed one of {', '.join(objectives())}")
  return _OBJECTIVES[name]
