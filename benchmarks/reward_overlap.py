"""How much a slow Python reward adds to a GRPO step, synchronous vs async, in one run.

  python benchmarks/reward_overlap.py                   # reward of 0.2 s a batch (a minute)
  python benchmarks/reward_overlap.py --reward-s 0.5 --steps 9 --json out.json
  python benchmarks/reward_overlap.py --quick           # smoke test

Four arms of `specjax.rl.trainer.SplitStep` (the step a task rewarded in Python trains with),
from the same random policy on the same prompts: sync and async, each with an instant reward
and with one that sleeps `--reward-s` per batch (a stand-in for a verifier that waits: code
run in a subprocess, a judge called over the network) before returning the same values.

In sync mode the update waits for the rewards, so the sleep adds to every step. In async mode
the host scores rollout t in a background thread while the device runs the update on rollout
t - 1 and then rollout t + 1: the sleep is hidden as long as those take longer. Arms are
interleaved in blocks of `--block` steps, so a burst of load hits all alike; a block's first
step is not timed (its background scoring ran while the other arms did), nor the first round
(it compiles).

Printed per arm: the median step time, the ratio to the same mode with the instant reward
(the reward's cost: 1.00 hides it entirely), and the step's own `perf_reward_s` and
`perf_reward_overlap` (the share of the scoring during which the device had work). The policy
is sized with `--d-model`/`--layers` so that a step's device work exceeds the reward's sleep
on the machine at hand; the header prints the instant async step beside the sleep.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.models import ModelConfig, init_params
from specjax.rl.data import PromptBatch
from specjax.rl.losses import GRPOConfig
from specjax.rl.state import RolloutConfig, TrainConfig, init_train_state
from specjax.rl.trainer import make_split_step


def toy_reward(sleep_s: float):
  """The share of even ids in each response, after sleeping `sleep_s`: the same values for
  every arm, so the updates do the same work."""

  def reward(responses, lengths, batch):
    if sleep_s:
      time.sleep(sleep_s)
    valid = np.arange(responses.shape[1])[None, :] < lengths[:, None]
    return ((responses % 2 == 0) & valid).sum(1) / np.maximum(lengths, 1)

  return reward


def prompts(vocab: int, batch: int, step: int, prompt_len: int) -> PromptBatch:
  rng = np.random.default_rng(7_000 + step)
  return PromptBatch(tokens=rng.integers(2, vocab, (batch, prompt_len), dtype=np.int32),
                     lengths=np.full(batch, prompt_len, np.int32),
                     answers=np.zeros(batch, np.int32), index=np.arange(batch, dtype=np.int32))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--reward-s", type=float, default=0.2, help="the slow reward's sleep")
  parser.add_argument("--steps", type=int, default=8, help="timed steps per arm (at least)")
  parser.add_argument("--block", type=int, default=3, help="steps of one arm in a row")
  parser.add_argument("--prompts", type=int, default=8, help="prompts per step (B / G)")
  parser.add_argument("--group-size", type=int, default=4, help="G")
  parser.add_argument("--max-new", type=int, default=48, help="response tokens T")
  parser.add_argument("--d-model", type=int, default=192)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--json", type=Path, help="also write the table here")
  args = parser.parse_args(argv)
  if args.quick:
    args.steps, args.block, args.max_new, args.d_model, args.layers = 2, 2, 8, 64, 1
  model = ModelConfig(vocab_size=512, d_model=args.d_model, n_layers=args.layers,
                      n_heads=max(1, args.d_model // 64), n_kv_heads=max(1, args.d_model // 128),
                      head_dim=64, mlp_dim=4 * args.d_model, max_position=32 + args.max_new + 8)
  params = init_params(model, jax.random.key(0))
  print(f"policy: {args.layers} layers x d_model {args.d_model}; {args.prompts} prompts x "
        f"G={args.group_size}, T={args.max_new} tokens (no EOS: every row runs T), slow "
        f"reward {args.reward_s:g} s a batch; jax {jax.__version__} on "
        f"{jax.devices()[0].platform}")

  arms = {}
  for mode in ("sync", "async"):
    config = TrainConfig(model=model, grpo=GRPOConfig(group_size=args.group_size),
                         rollout=RolloutConfig(max_new_tokens=args.max_new, eos_id=None),
                         async_mode=mode == "async")
    for reward in ("instant", "slow"):
      optimizer = optax.adam(1e-5)
      step = make_split_step(config, toy_reward(args.reward_s if reward == "slow" else 0.0),
                             optimizer)
      # Each arm's own copy: the steps donate their state's buffers.
      state = init_train_state(config, jax.tree.map(jnp.copy, params), optimizer, seed=0)
      if config.async_mode:
        state = step.prime(state, prompts(model.vocab_size, args.prompts, 0, 32))
      arms[mode, reward] = {"step": step, "state": state, "times": [], "perf": []}

  # Rounds of blocks: each arm runs `--block` steps in a row, of which all but the first are
  # timed (a block's first step finds its background scoring done while the other arms ran).
  # The first round compiles and is not timed.
  i = 0
  for round_ in range(-(-args.steps // (args.block - 1)) + 1):
    for arm in arms.values():
      for j in range(args.block):
        i += 1
        batch = prompts(model.vocab_size, args.prompts, i, 32)
        begin = time.perf_counter()
        arm["state"], metrics = arm["step"](arm["state"], batch)
        metrics = jax.device_get(metrics)  # as a run's loop does, every step
        if round_ and j:
          arm["times"].append(time.perf_counter() - begin)
          arm["perf"].append((metrics["perf_reward_s"], metrics["perf_reward_overlap"]))

  rows = []
  print(f"\n{'mode':6} {'reward':8} {'step s':>8} {'x instant':>10} {'reward s':>9} "
        f"{'overlap':>8}")
  for (mode, reward), arm in arms.items():
    step_s = float(np.median(arm["times"]))
    base = float(np.median(arms[mode, "instant"]["times"]))
    reward_s, overlap = np.median(np.asarray(arm["perf"]), axis=0)
    rows.append({"mode": mode, "reward": reward, "step_s": step_s, "x_instant": step_s / base,
                 "reward_s": float(reward_s), "overlap": float(overlap),
                 "steps": len(arm["times"])})
    print(f"{mode:6} {reward:8} {step_s:8.3f} {step_s / base:10.2f} {reward_s:9.3f} "
          f"{overlap:8.2f}")
  instant = float(np.median(arms["async", "instant"]["times"]))
  if instant <= args.reward_s:
    print(f"\nnote: the async step's device work ({instant:.3f} s) is shorter than the "
          f"reward ({args.reward_s:g} s), which cannot then be hidden; use a larger policy")
  if args.json:
    args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                     "rows": rows}, indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
