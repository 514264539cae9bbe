"""A built-in tiny model that trains in about a minute on CPU, for demos and smoke runs.

The corpus is counting text — "7,10,13,16,..." with a random start and step — read by a
character tokenizer. It has real structure (carries, digit lengths) that a small model
learns quickly, so its MTP heads draft well and speculative decoding has something to do.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.models.config import ModelConfig
from specjax.models.params import init_params
from specjax.supervised import init_supervised_state, make_supervised_step
from specjax.tokenizer import CharTokenizer

TOKENIZER = CharTokenizer("0123456789,")


def demo_config(vocab_size: int = TOKENIZER.vocab_size) -> ModelConfig:
  """~0.9M parameters, 3 MTP modules."""
  return ModelConfig(vocab_size=vocab_size, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                     head_dim=32, mlp_dim=384, num_mtp_modules=3, max_position=512)


def counting_text(rng: np.random.Generator, length: int) -> str:
  """Comma-separated arithmetic progression of at least `length` characters."""
  value, step = int(rng.integers(0, 500)), int(rng.integers(1, 13))
  parts = []
  while sum(len(p) + 1 for p in parts) < length:
    parts.append(str(value))
    value += step
  return ",".join(parts) + ","


def counting_batch(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
  return np.array([TOKENIZER.encode(counting_text(rng, length)[:length])
                   for _ in range(batch)], np.int32)


@dataclasses.dataclass(frozen=True)
class DemoTraining:
  steps: int = 400
  batch: int = 24
  length: int = 64
  learning_rate: float = 3e-3
  seed: int = 0


def train_demo_model(spec: DemoTraining = DemoTraining(), log=print):
  """Train the demo model (trunk + MTP heads). Returns (params, config)."""
  config = demo_config()
  rng = np.random.default_rng(spec.seed)
  warmup = min(50, spec.steps // 2)
  optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(
      0.0, spec.learning_rate, warmup, max(spec.steps, warmup + 1), spec.learning_rate / 10))
  state = init_supervised_state(init_params(config, jax.random.key(spec.seed)), optimizer)
  step = make_supervised_step(config, optimizer)
  mask = jnp.ones((spec.batch, spec.length), jnp.int32)
  start = time.perf_counter()
  for i in range(spec.steps):
    state, metrics = step(state, counting_batch(rng, spec.batch, spec.length), mask)
    if (i + 1) % max(spec.steps // 4, 1) == 0:
      mtp = ", ".join(f"{x:.3f}" for x in np.asarray(metrics["mtp_ce"]))
      log(f"  step {i + 1}/{spec.steps}: ce {float(metrics['ce']):.3f}, mtp ce [{mtp}], "
          f"{time.perf_counter() - start:.0f}s")
  return state.params, config
