"""Sampling configuration and the processed target distribution.

Losslessness needs one distribution used everywhere: the processed log-probabilities from
`processed_logprobs` are what tokens are sampled from, what draft tokens are accepted
against, and what rejection residuals are built from.

Shape letters: see `specjax` (V vocab; `...` is any leading shape, e.g. `[B]` or `[B, N + 1]`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from specjax.checks import is_int, is_number
from specjax.errors import ConfigError

_NEG = -1e30  # masked logit; finite so that 0 * _NEG is 0, not nan
_MIN_TEMPERATURE = 1e-30  # float32 normals reach 1.2e-38; logits / 1e-30 stay finite
_TOP_P_CANDIDATES = 256  # top-p alone looks for its cut among this many largest logits first


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How tokens are drawn from the target.

  Attributes:
    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens (0 = all).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1 = all).
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    # bool is an int to Python: True would sample at temperature 1 or keep the top-1 token.
    if not (is_number(self.temperature) and 0 <= self.temperature < math.inf):
      raise ConfigError(f"temperature={self.temperature!r} is invalid: must be a finite number "
                        ">= 0 (0 means greedy)")
    if 0 < self.temperature < _MIN_TEMPERATURE:
      raise ConfigError(f"temperature={self.temperature!r} is too small to divide float32 "
                        f"logits by: use 0 for greedy decoding or a temperature >= "
                        f"{_MIN_TEMPERATURE:g}")
    if not (is_int(self.top_k) and self.top_k >= 0):
      raise ConfigError(f"top_k={self.top_k!r} is invalid: must be an int >= 0 (0 = off)")
    object.__setattr__(self, "top_k", int(self.top_k))  # a NumPy int would not go to JSON
    if not (is_number(self.top_p) and 0 < self.top_p <= 1):
      raise ConfigError(f"top_p={self.top_p!r} is invalid: must be a number in (0, 1] (1 = off)")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  @property
  def logprob_temperature(self) -> float:
    """Temperature of the reported log-probabilities (1 for greedy)."""
    return 1.0 if self.greedy else self.temperature


def processed_logprobs(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
  """Log-probabilities `[..., V]` of the distribution tokens are sampled from.

  Temperature, then top-k, then top-p (on the top-k-filtered distribution), renormalised.
  For greedy decoding this is the temperature-1 distribution (only its argmax is used).

  Top-k keeps every token whose logit reaches the k-th largest (ties included). Top-p keeps
  a token when the mass of the tokens before it, sorted by logit (equal logits by id), is
  below `top_p`. Neither sorts the vocabulary when top-k is on: the cut is found among the
  k largest logits; top-p alone looks among the `_TOP_P_CANDIDATES` largest first and sorts
  the whole vocabulary (of the batch's rows at once) only when some row's candidates and the
  tokens tied with the last of them hold less than `top_p` of its mass.
  """
  logits = _scaled(logits, sampling)
  vocab = logits.shape[-1]
  top_k = sampling.top_k if sampling.top_k < vocab else 0
  if not top_k and sampling.top_p >= 1.0:
    return jax.nn.log_softmax(logits, axis=-1)
  # Descending, equal logits lowest id first: the order of a stable sort.
  values, ids = jax.lax.top_k(logits, top_k or min(vocab, _TOP_P_CANDIDATES))
  # The k-th largest as a min: sliced out (`values[..., -1:]`), XLA:CPU sorts the whole
  # vocabulary instead of running its top-k (100x slower at V = 152k).
  last = values.min(-1, keepdims=True)
  if top_k:
    logits = jnp.where(logits >= last, logits, _NEG)
  if sampling.top_p < 1.0:
    keep, covered = _nucleus_among(logits, values, ids, last, sampling.top_p)
    if not top_k:  # tokens below the candidates may belong to the nucleus: sort those rows
      keep = jax.lax.cond(covered.all(), lambda: keep,
                          lambda: jnp.where(covered, keep, _nucleus_sorted(logits,
                                                                           sampling.top_p)))
    logits = jnp.where(keep, logits, _NEG)
  return jax.nn.log_softmax(logits, axis=-1)


def _nucleus_among(logits: jax.Array, values: jax.Array, ids: jax.Array, last: jax.Array,
                   top_p: float) -> tuple[jax.Array, jax.Array]:
  """Top-p over the largest logits `values [..., K]` (ids `ids`, smallest `last`): the kept
  tokens `[..., V]`, and `[..., 1]` whether that is the whole nucleus — the listed tokens and
  those tied with `last` (which a stable sort puts right after them, lowest id first) hold
  at least `top_p`, so no token after them is kept."""
  log_z = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  probs = jnp.exp(values - log_z)
  before = jnp.cumsum(probs, axis=-1) - probs
  where = tuple(jnp.indices(ids.shape)[:-1]) + (ids,)
  listed = jnp.zeros(logits.shape, bool).at[where].set(True)
  keep = jnp.zeros(logits.shape, bool).at[where].set(before < top_p)
  tied = (logits == last) & ~listed
  rank = jnp.cumsum(tied, axis=-1) - 1
  mass, p_tied = probs.sum(-1, keepdims=True), jnp.exp(last - log_z)
  keep = keep | (tied & (mass + rank * p_tied < top_p))
  return keep, mass + tied.sum(-1, keepdims=True) * p_tied >= top_p


def _nucleus_sorted(logits: jax.Array, top_p: float) -> jax.Array:
  """Top-p by sorting the whole vocabulary: the kept tokens `[..., V]`."""
  order = jnp.argsort(-logits, axis=-1)
  probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
  # Keep a token when the mass strictly before it is below top_p (always keeps the best).
  keep_sorted = jnp.cumsum(probs, axis=-1) - probs < top_p
  return jnp.zeros_like(keep_sorted).at[
      tuple(jnp.indices(order.shape)[:-1]) + (order,)].set(keep_sorted)


def reported_logprobs(logits: jax.Array, tokens: jax.Array,
                      sampling: SamplingConfig) -> jax.Array:
  """log softmax(logits / temperature) at `tokens` (what a policy-gradient ratio needs).

  Args:
    logits: `[..., V]`.
    tokens: `[...]` int.
  """
  logp = jax.nn.log_softmax(_scaled(logits, sampling), -1)
  return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def _scaled(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
  """float32 logits / temperature, shifted so that the largest is 0 first and floored at a
  finite value: any temperature > 0, however small, gives log-probabilities <= 0 and finite
  (the shift leaves the distribution unchanged)."""
  logits = logits.astype(jnp.float32)
  logits = logits - jax.lax.stop_gradient(logits.max(-1, keepdims=True))
  return jnp.maximum(logits / sampling.logprob_temperature, _NEG)


def sample_tokens(key: jax.Array, logprobs: jax.Array, sampling: SamplingConfig) -> jax.Array:
  """One token per row from processed log-probabilities `[..., V]` (argmax when greedy)."""
  if sampling.greedy:
    return jnp.argmax(logprobs, axis=-1)
  return jax.random.categorical(key, logprobs, axis=-1)


def top_w(key: jax.Array | None, logprobs: jax.Array, width: int) -> jax.Array:
  """`width` distinct tokens per row `[..., width]`: the most likely ones when `key` is None,
  otherwise a sample without replacement (Gumbel top-k) from `logprobs`."""
  scores = logprobs
  if key is not None:
    scores = logprobs + jax.random.gumbel(key, logprobs.shape)
  return jax.lax.top_k(scores, width)[1]
