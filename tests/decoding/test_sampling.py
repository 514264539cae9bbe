"""The processed target distribution: temperature, top-k, top-p against a NumPy reference,
and top-k / top-p without sorting the vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decoding import SamplingConfig, processed_logprobs
from specjax.decoding.sampling import _TOP_P_CANDIDATES


def _reference_kept(logits: np.ndarray, s: SamplingConfig) -> np.ndarray:
  """Kept tokens of one row, float64: top-k with ties, then top-p over a stable sort."""
  z = logits.astype(np.float64) / s.temperature
  if 0 < s.top_k < z.size:
    z = np.where(z >= np.sort(z)[-s.top_k], z, -np.inf)
  keep = np.isfinite(z)
  if s.top_p < 1:
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-z, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(keep)
    keep[order[before < s.top_p]] = True
  return keep


def _logits(vocab: int, rows: int, seed: int) -> np.ndarray:
  """Rows from flat to peaked, with groups of equal logits (at the k-th value too)."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, vocab)) * np.geomspace(0.3, 12.0, rows)[:, None]
  for row in x:
    order = np.argsort(-row)
    row[order[2:5]] = row[order[2]]  # ties inside a small top-k and around its cut
    row[rng.choice(vocab, vocab // 4, replace=False)] = row[order[vocab // 3]]
  return x.astype(np.float32)


@pytest.mark.parametrize("vocab", [7, 64, 3 * _TOP_P_CANDIDATES])
@pytest.mark.parametrize("sampling", [
    SamplingConfig(1.0, top_k=3), SamplingConfig(0.7, top_k=5, top_p=0.9),
    SamplingConfig(1.0, top_p=0.5), SamplingConfig(1.3, top_p=0.97),
    SamplingConfig(0.5, top_k=40, top_p=0.3), SamplingConfig(1.0)])
def test_processed_distribution_equals_a_sorting_reference(vocab, sampling):
  """Every row keeps the reference's tokens, renormalised; for top-p alone over more than
  the candidates, flat rows (whose nucleus lies past them) and peaked rows share a batch."""
  logits = _logits(vocab, 12, seed=vocab)
  got = np.asarray(processed_logprobs(jnp.asarray(logits), sampling))
  for row, out in zip(logits, got):
    keep = _reference_kept(row, sampling)
    np.testing.assert_array_equal(out > -1e29, keep)
    z = row.astype(np.float64)[keep] / sampling.temperature
    np.testing.assert_allclose(out[keep], z - np.logaddexp.reduce(z), atol=2e-5)


@pytest.mark.parametrize("sampling", [SamplingConfig(0.7, top_k=50),
                                      SamplingConfig(0.7, top_k=50, top_p=0.9)])
def test_top_k_and_top_p_do_not_sort_the_vocabulary(sampling):
  """XLA:CPU turned `top_k(x)[0][..., -1:]` into a sort of the whole vocabulary (100x its
  top-k at 152k ids): with top-k on, the compiled program has no sort."""
  x = jax.ShapeDtypeStruct((4, 4096), jnp.float32)
  hlo = jax.jit(lambda y: processed_logprobs(y, sampling)).lower(x).compile().as_text()
  assert " sort(" not in hlo
