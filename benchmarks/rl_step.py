"""GRPO training-step time with and without speculative rollouts, side by side in one run.

  python benchmarks/rl_step.py                  # full (trains/caches the models on first use)
  python benchmarks/rl_step.py --quick          # smoke test

The policy is `spec_decode.py`'s >= 25M-parameter target (trained on the phrase language,
with MTP heads trained on its own samples; cached in benchmarks/.cache). Each step is the
fused program of `specjax.rl.trainer.make_train_step`: rollout of G responses per prompt at
temperature 1 -> JAX reward -> group advantages -> update -> online MTP update. The only
difference between the two programs is the rollout: plain autoregressive or speculative
(MTP drafter) — in the same engine. Both start from the same state and see the same prompts;
medians over `--steps` timed steps after a compile step.

The reward is a toy preference computed in JAX (the fraction of response tokens that are
"number" words of the language); its only role is to give non-zero advantages so the update
does real work. Printed: step time plain vs speculative and their ratio, the rollout share of
the plain step (rollout-only programs timed the same way), and the acceptance length.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _spec_models as M  # noqa: E402

from specjax.decoding import DraftTree, MTPDrafter, SamplingConfig  # noqa: E402
from specjax.rl.data import PromptBatch  # noqa: E402
from specjax.rl.losses import GRPOConfig  # noqa: E402
from specjax.rl.trainer import (RolloutConfig, TrainConfig, init_train_state,  # noqa: E402
                                make_train_step, rollout)


def number_reward(lang: M.PhraseLanguage):
  """Fraction of response tokens that are number words (ids num_lo .. name_lo - 1)."""

  def reward(tokens, lengths, answers):
    valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    is_number = (tokens >= lang.num_lo) & (tokens < lang.name_lo) & valid
    return is_number.sum(1) / jnp.maximum(lengths, 1)

  return reward


def prompts(lang: M.PhraseLanguage, batch: int, step: int, prompt_len: int = 32):
  rng = np.random.default_rng(20_000 + step)
  docs, _ = lang.batch(rng, batch, prompt_len)
  return PromptBatch(tokens=docs.astype(np.int32), lengths=np.full(batch, prompt_len, np.int32),
                     answers=np.zeros(batch, np.int32), index=np.arange(batch, dtype=np.int32))


def time_steps(step_fn, state, batches):
  state, _ = step_fn(state, batches[0])  # compile
  jax.block_until_ready(state)
  times, metrics = [], None
  for b in batches[1:]:
    start = time.perf_counter()
    state, metrics = step_fn(state, b)
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - start)
  return float(np.median(times)), jax.device_get(metrics), state


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--prompts", type=int, default=2, help="prompts per step (B)")
  parser.add_argument("--group-size", type=int, default=4, help="G")
  parser.add_argument("--max-new", type=int, default=128, help="response tokens N")
  parser.add_argument("--depth", type=int, default=3, help="MTP chain length")
  parser.add_argument("--steps", type=int, default=5, help="timed steps per program")
  parser.add_argument("--cache-dir", type=Path,
                      default=Path(__file__).resolve().parent / ".cache")
  args = parser.parse_args(argv)
  if args.quick:
    args.steps, args.max_new = 2, 32
  lang_spec = M.LanguageSpec()
  spec = M.QUICK_TRAIN if args.quick and not M.is_cached(args.cache_dir, lang_spec,
                                                          M.TrainSpec()) else M.TrainSpec()
  target, _, info = M.load_or_train(args.cache_dir, lang_spec, spec)
  lang = M.PhraseLanguage(lang_spec)
  counts = M.param_counts(target)
  print(f"policy: {counts['trunk'] / 1e6:.1f}M trunk parameters + {counts['mtp'] / 1e6:.1f}M "
        f"MTP; B={args.prompts} prompts x G={args.group_size}, N={args.max_new} response "
        f"tokens, temperature 1, jax {jax.__version__} on {jax.devices()[0].platform}")

  grpo = GRPOConfig(group_size=args.group_size)
  rows = []
  for name, drafter, tree in (("plain", None, None),
                              (f"mtp chain{args.depth}", MTPDrafter(),
                               DraftTree.chain(args.depth))):
    config = TrainConfig(model=M.TARGET, grpo=grpo, rollout=RolloutConfig(
        max_new_tokens=args.max_new, eos_id=-1, sampling=SamplingConfig(1.0), drafter=drafter,
        tree=tree))
    optimizer = optax.adam(1e-5)
    state = init_train_state(config, jax.tree.map(jnp.array, target), optimizer, seed=0)
    batches = [prompts(lang, args.prompts, i) for i in range(args.steps + 1)]
    step_time, metrics, state = time_steps(
        make_train_step(config, number_reward(lang), optimizer), state, batches)
    roll = jax.jit(lambda p, t, l, k, c=config: rollout(p, c, t, l, k)[0].lengths)
    roll_times = []
    for i, b in enumerate(batches):
      start = time.perf_counter()
      jax.block_until_ready(roll(state.params, b.tokens, b.lengths, jax.random.key(i)))
      roll_times.append(time.perf_counter() - start)
    rows.append((name, step_time, float(np.median(roll_times[1:])),
                 float(metrics["acceptance_length"]), float(metrics["rollout_tokens"])))

  print(f"{'rollout':<14}{'step s':>9}{'rollout s':>11}{'rollout %':>11}{'accept':>8}"
        f"{'tokens':>8}")
  for name, step_s, roll_s, accept, tokens in rows:
    print(f"{name:<14}{step_s:>9.3f}{roll_s:>11.3f}{100 * roll_s / step_s:>10.0f}%"
          f"{accept:>8.2f}{tokens:>8.0f}")
  plain, spec_row = rows
  print(f"step-time ratio plain / speculative: {plain[1] / spec_row[1]:.2f}x "
        f"(rollout alone: {plain[2] / spec_row[2]:.2f}x)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
