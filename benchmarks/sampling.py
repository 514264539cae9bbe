"""What top-k / top-p cost over a real vocabulary: specjax's processed distribution against
the same distribution by sorting the vocabulary.

    python benchmarks/sampling.py                  # V = 151,936 (Qwen), batch 1 and 8
    python benchmarks/sampling.py --vocab 128256 --batches 4

Every decoding round computes the processed target distribution
(`specjax.decoding.processed_logprobs`: temperature, top-k, top-p) for each row and position
it verifies. Per (batch, setting), timed interleaved in one process (median of the
repeat-by-repeat ratios):

- `ms`: specjax's processed distribution, jitted, of `[B, V]` float32 logits;
- `x temp`: that over temperature alone (a log-softmax): what top-k / top-p add;
- `x sort`: the same distribution computed by sorting the whole vocabulary (top-k as the
  k-th largest of a sort, top-p by an argsort and a scatter: the textbook way, and
  specjax's before it found the cut among the largest logits) over specjax's.

Two kinds of rows (random logits): `peaked`, where a few dozen tokens hold nearly all the
mass, as a language model's next token mostly is; `flat`, where top-p's nucleus reaches past
the 256 largest logits, so that specjax too sorts the vocabulary (for top-p without top-k; a
batch sorts when any of its rows needs it). The two computations agree (checked before
timing).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decoding import SamplingConfig, processed_logprobs
from specjax.decoding.sampling import _NEG, _nucleus_sorted, _scaled
from specjax.timing import interleaved

SETTINGS = {"top-k 50": SamplingConfig(0.7, top_k=50),
            "top-p 0.9": SamplingConfig(0.7, top_p=0.9),
            "top-k 50, top-p 0.9": SamplingConfig(0.7, top_k=50, top_p=0.9)}


def by_sorting(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
  """The processed distribution with full sorts (the reference)."""
  logits = _scaled(logits, sampling)
  if sampling.top_k:
    kth = jnp.sort(logits, axis=-1)[..., -sampling.top_k][..., None]
    logits = jnp.where(logits >= kth, logits, _NEG)
  if sampling.top_p < 1:
    logits = jnp.where(_nucleus_sorted(logits, sampling.top_p), logits, _NEG)
  return jax.nn.log_softmax(logits, axis=-1)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
  parser.add_argument("--repeats", type=int, default=9)
  args = parser.parse_args(argv)
  print(f"vocabulary {args.vocab}, jax {jax.__version__} on {jax.devices()[0].platform}")
  print(f"{'B':>3} {'rows':<7} {'setting':<22} {'ms':>8} {'x temp':>7} {'x sort':>7}")
  temp = jax.jit(lambda x: processed_logprobs(x, SamplingConfig(0.7)))
  for b, kind, name in itertools.product((int(x) for x in args.batches.split(",")),
                                         ("peaked", "flat"), SETTINGS):
    rng = np.random.default_rng(b)
    logits = rng.normal(size=(b, args.vocab)) * (1.0 if kind == "peaked" else 2.0)
    if kind == "peaked":  # 64 tokens of each row hold > 99% of its mass
      logits[np.arange(b)[:, None], rng.integers(0, args.vocab, (b, 64))] += 14.0
    logits = jnp.asarray(logits, jnp.float32)
    sampling = SETTINGS[name]
    ours = jax.jit(lambda x, s=sampling: processed_logprobs(x, s))
    sort = jax.jit(lambda x, s=sampling: by_sorting(x, s))
    same = np.asarray(ours(logits) > -1e29) == np.asarray(sort(logits) > -1e29)
    if not same.all():
      raise SystemExit(f"{name}: the two computations keep different tokens")
    temp(logits).block_until_ready()
    fns = [lambda r, f=f: f(logits).block_until_ready() for f in (ours, temp, sort)]
    (t_ours, t_temp, t_sort), _ = interleaved(fns, args.repeats)
    print(f"{b:>3} {kind:<7} {name:<22} {1e3 * np.median(t_ours):>8.2f} "
          f"{np.median(t_ours / t_temp):>7.2f} {np.median(t_sort / t_ours):>7.1f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
