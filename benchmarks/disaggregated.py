"""Disaggregated async GRPO: each side's time, the weight transfer, and what overlap would buy.

  python benchmarks/disaggregated.py            # 8 fake CPU devices: 4 roll out, 4 train
  python benchmarks/disaggregated.py --quick    # smoke test

Runs one configuration (a random policy with an MTP head on the arithmetic task, responses of
fixed length, a parity reward so the update has real gradients) three ways from the same
state, on the same prompts, interleaved step by step:

- fused: async mode's one-program step (`sharded_train_step`) on the 4 train devices;
- disaggregated, timed: `DisaggregatedAsync` (lag 1) waiting after each part, which gives
  the rollout program's seconds (rollout mesh), the update program's (train mesh) and the
  transfers' (the rollout to the train mesh, the new weights back);
- disaggregated, untimed: the same, nothing waited for until the step's end: the wall time a
  user gets.

It prints medians and the step time the simulator's schedule (`specjax.sim.overall_seconds`)
gives those measured sides with overlap: max(rollout, update) + transfer at lag 1,
max(rollout, update, transfer) at lag >= 2. On CPU, XLA runs one multi-device program at a
time, so the untimed step is the sum of its sides (no speedup; the check below says whether
that holds); the bound is what disjoint accelerators would reach.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "jax" not in sys.modules:  # fake devices must be set before JAX starts
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from specjax.decoding import DraftTree, MTPDrafter, SamplingConfig  # noqa: E402
from specjax.models import ModelConfig, init_params  # noqa: E402
from specjax.rl import (ArithmeticTask, DisaggregatedAsync, GRPOConfig, PromptReader,  # noqa: E402
                        encode_prompt, prompt_batch_shardings, sharded_prime_fn,
                        sharded_train_step, train_state_shardings)
from specjax.rl.state import RolloutConfig, TrainConfig, init_train_state
from specjax.rl.trainer import make_prime_fn
from specjax.sharding import make_mesh  # noqa: E402
from specjax.sim import Schedule, overall_seconds  # noqa: E402


def parity_reward(tokens, lengths, answers):
  """1 for an even first response token: random responses differ within a group, so the
  update has non-zero advantages to work on."""
  del lengths, answers
  return (tokens[:, 0] % 2 == 0).astype(jnp.float32)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--d-model", type=int, default=256)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
  parser.add_argument("--group-size", type=int, default=4)
  parser.add_argument("--max-new", type=int, default=32, help="response tokens (all rows)")
  parser.add_argument("--steps", type=int, default=5, help="measured steps per arm")
  parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 steps")
  args = parser.parse_args(argv)
  if args.quick:
    args.d_model, args.layers, args.prompts, args.max_new, args.steps = 64, 1, 4, 8, 2
  devices = jax.devices()
  if len(devices) < 2 or len(devices) % 2:
    raise SystemExit(f"needs an even number of devices >= 2, found {len(devices)} (on CPU "
                     "set XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  half = len(devices) // 2
  rollout_mesh = make_mesh(data=-1, devices=devices[:half])
  train_mesh = make_mesh(fsdp=-1, devices=devices[half:])

  task = ArithmeticTask(max_digits=2, num_train=256, num_test=16)
  tok = task.tokenizer
  records = [{"prompt": encode_prompt(tok, e.prompt), "reference": e.reference,
              "answer": e.answer} for e in task.examples("train")]
  reader = PromptReader(records, batch_size=args.prompts, pad_id=tok.pad_id)
  prompt_len = reader.batch_at(0).tokens.shape[1]
  heads = max(args.d_model // 64, 1)
  model = ModelConfig(vocab_size=tok.vocab_size, d_model=args.d_model, n_layers=args.layers,
                      n_heads=heads, n_kv_heads=heads, head_dim=args.d_model // heads,
                      mlp_dim=4 * args.d_model, num_mtp_modules=1,
                      max_position=prompt_len + args.max_new + 8)
  rollout = RolloutConfig(max_new_tokens=args.max_new, eos_id=None,
                          sampling=SamplingConfig(1.0), drafter=MTPDrafter(),
                          tree=DraftTree.chain(1))
  config = TrainConfig(model=model, grpo=GRPOConfig(group_size=args.group_size,
                                                    num_minibatches=2, tis_cap=2.0),
                       rollout=rollout, async_mode=True)
  optimizer = optax.adam(1e-4)
  fresh = lambda: init_train_state(config, init_params(model, jax.random.key(0)), optimizer,
                                   seed=1)
  batches = [reader.batch_at(args.prompts * i) for i in range(args.steps + 2)]
  params = sum(x.size for x in jax.tree.leaves(init_params(model, jax.random.key(0))))
  print(f"policy {params / 1e6:.1f}M parameters, {args.prompts} prompts x G="
        f"{args.group_size}, {args.max_new} response tokens, MTP chain 1; rollout on "
        f"{half} devices (data), updates on {half} (fsdp); {jax.devices()[0].platform}",
        flush=True)

  # The fused async step on the train mesh.
  shapes = jax.eval_shape(fresh)
  batch_sh = prompt_batch_shardings(batches[0], train_mesh)
  primed_sh = train_state_shardings(jax.eval_shape(
      make_prime_fn(config, parity_reward, pad_id=tok.pad_id), shapes, batches[0]),
      train_mesh, config)
  prime = sharded_prime_fn(config, parity_reward, primed_sh, batch_sh, pad_id=tok.pad_id)
  fused_step = sharded_train_step(config, parity_reward, optimizer, primed_sh, batch_sh,
                                  pad_id=tok.pad_id)
  fused_state = prime(jax.device_put(fresh(), primed_sh.replace(pending=None)),
                      jax.device_put(batches[0], batch_sh))

  timed = DisaggregatedAsync(config, parity_reward, optimizer, rollout_mesh, train_mesh,
                             pad_id=tok.pad_id)
  untimed = DisaggregatedAsync(config, parity_reward, optimizer, rollout_mesh, train_mesh,
                               pad_id=tok.pad_id)
  timed.start(fresh(), batches[0])
  untimed.start(fresh(), batches[0])

  fused_s, untimed_s = [], []
  for i, batch in enumerate(batches[1:]):
    start = time.perf_counter()
    fused_state, metrics = fused_step(fused_state, jax.device_put(batch, batch_sh))
    jax.block_until_ready((fused_state, metrics))
    fused_s.append(time.perf_counter() - start)
    timed.step(batch, timed=True)
    start = time.perf_counter()
    metrics = untimed.step(batch)
    jax.block_until_ready((metrics, untimed.state()))
    untimed_s.append(time.perf_counter() - start)
    print(f"  step {i}: fused {fused_s[-1]:.3f} s, disaggregated {untimed_s[-1]:.3f} s "
          f"({'compile, not counted' if i == 0 else 'measured'})", flush=True)

  median = lambda xs: float(np.median(xs[1:]))  # the first step compiles
  sides = {k: median([t[k] for t in timed.times]) for k in timed.times[0]}
  serial = sum(sides.values())
  bound = {lag: overall_seconds(sides["rollout_s"], sides["update_s"], sides["transfer_s"],
                                Schedule(asynchronous=True, policy_lag=lag), colocated=False)
           for lag in (1, 2)}
  result = {"fused_s": median(fused_s), "untimed_s": median(untimed_s), **sides,
            "serial_s": serial, "bound_lag1_s": bound[1], "bound_lag2_s": bound[2]}
  print(f"\nmedians over {args.steps} steps (first step excluded: compilation)")
  print("| what | seconds | x fused |")
  print("|---|---|---|")
  rows = [("fused async step (one program, train devices)", result["fused_s"]),
          ("disaggregated step, untimed (what a user gets here)", result["untimed_s"]),
          ("  rollout program (rollout mesh)", sides["rollout_s"]),
          ("  update program (train mesh)", sides["update_s"]),
          ("  transfers (rollout -> train, weights -> rollout)", sides["transfer_s"]),
          ("  sum of the sides", serial),
          ("overlap bound, lag 1: max(rollout, update) + transfer*", bound[1]),
          ("overlap bound, lag 2: max(rollout, update, transfer)", bound[2])]
  for name, seconds in rows:
    print(f"| {name} | {seconds:.3f} | {result['fused_s'] / seconds:.2f} |")
  print("* both transfers counted as the weight sync the next rollout waits for (an upper "
        "bound: the rollout's own move to the train mesh overlaps the next rollout)")
  share = sides["transfer_s"] / serial
  print(f"\ntransfers: {100 * share:.1f}% of the serial step")
  if jax.devices()[0].platform == "cpu":
    overlap = serial / result["untimed_s"]
    print(f"CPU: sum of sides / untimed step = {overlap:.2f} (1.0 = no overlap, as expected: "
          "XLA:CPU runs one multi-device program at a time)")
  return result


if __name__ == "__main__":
  main()
