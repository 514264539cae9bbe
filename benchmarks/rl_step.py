"""GRPO training-step time with plain and speculative rollouts, interleaved in one run.

  python benchmarks/rl_step.py                  # full (trains/caches the models on first use)
  python benchmarks/rl_step.py --quick          # smoke test
  python benchmarks/rl_step.py --stop-name --compaction 3   # a long tail, three arms
  python benchmarks/rl_step.py --stop-name --compaction 3 --repeat-every 2 --adaptive-menu ''
      # prompts that come back: the history arm drafts from the earlier answers

The policy is `spec_decode.py`'s >= 25M-parameter target (trained on the phrase language,
with MTP heads and an EAGLE-3 head trained on its own samples; cached in benchmarks/.cache).
Each arm is the fused program of `specjax.rl.trainer.make_train_step`: rollout of G responses
per prompt at temperature 1 -> JAX reward -> group advantages -> update -> online drafter
update. The arms differ only in the rollout: plain autoregressive, MTP chain, EAGLE-3 chain
(its head trained online, detached), or EAGLE-3 with adaptive speculation (each round runs
plain decoding or one of the menu's chains, by costs `calibrate` measured on this machine
before the run and acceptance counted during the rollout; in the "carry" arm, counted from
the earlier rollouts too: `RolloutConfig.acceptance_carry`) — in the same engine, from the
same state, on the same prompts.

With `--stop-name` the language's commonest name word ends a response (about one token in
80), so response lengths spread geometrically up to T, a few rows much longer than the median,
as in reasoning RL. With `--compaction N` the rollouts gather their live rows into up to N
halvings of the batch as rows finish (`RolloutConfig.compaction`), and the plain arm is run
twice, without and with compaction: `x compact` is each arm against plain decoding with the
same compaction (speculation's own gain), `rollout x` against plain without it.

Arms are interleaved step by step (step i of every arm, then step i + 1), so a burst of load
hits all arms alike. Each step is also timed as its two halves, each its own compiled
program: the rollout alone and the update alone (on that rollout). The update is the same
work in the plain and MTP arms (the EAGLE-3 arm's also trains its head), so the spread of
their median update times, (max - min) / median, measures how noisy the run was; above 10%
the run is marked too noisy to quote.

The history arm (`--history-depth`, 0: none) drafts a chain from the bank of earlier answers
the train state keeps (`HistoryDrafter`: the prompt's own earlier answers first, then its
siblings', then recent answers to other prompts), recorded by each fused step. With
`--repeat-every K` the steps cycle over K batches of prompts, so a prompt comes back every K
steps, as epochs over a finite training set do; without it every step's prompts are new and
the bank holds other prompts' answers only.

The reward is a toy preference computed in JAX (the fraction of response tokens that are
"number" words of the language); its only role is to give non-zero advantages so the update
does real work. Printed per arm: median fused step, rollout and update times, the rollout
share of the plain step, acceptance length, and the step and rollout ratios against plain.
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

from specjax.decoding import (Adaptive, DraftTree, Eagle3Drafter, HistoryDrafter,  # noqa: E402
                              MTPDrafter, SamplingConfig, calibrate)
from specjax.decoding.loop_state import compaction_buckets  # noqa: E402
from specjax.experiments.measure import tail_round_share  # noqa: E402
from specjax.rl.data import PromptBatch  # noqa: E402
from specjax.rl.losses import GRPOConfig  # noqa: E402
from specjax.rl.rollouts import rollout, score
from specjax.rl.state import RolloutConfig, TrainConfig, init_train_state
from specjax.rl.trainer import make_train_step
from specjax.rl.updates import update

NOISY = 0.10  # update-time spread above which a run is too noisy to quote


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


class Arm:
  """One rollout configuration: its fused step, and its rollout and update as two programs
  (to time the halves), each with its own state."""

  def __init__(self, name, config, state, reward_fn, optimizer):
    self.name, self.config, self.state = name, config, state
    self.step_fn = make_train_step(config, reward_fn, optimizer)
    def roll_fn(st, batch, key):  # the drafter reads its head, or the history bank
      roll, responses, lengths, _ = rollout(st.params, config, batch.tokens, batch.lengths,
                                            key, drafter_params=st.rollout_drafter_params,
                                            acceptance=st.acceptance)
      return score(config, roll, reward_fn(responses, lengths, batch.answers))

    self.roll_fn = jax.jit(roll_fn)
    self.update_fn = jax.jit(lambda st, roll, key: update(st, config, optimizer, roll, key)[0])
    self.times = {"step": [], "rollout": [], "update": []}
    self.metrics, self.tails = None, []

  def run(self, batch, i: int, timed: bool) -> None:
    key = jax.random.key(i)
    start = time.perf_counter()
    roll = jax.block_until_ready(self.roll_fn(self.state, batch, key))
    mid = time.perf_counter()
    # The update program's output is dropped: the arm's state advances by the fused step.
    jax.block_until_ready(self.update_fn(self.state, roll, key))
    end = time.perf_counter()
    state, metrics = self.step_fn(self.state, batch)
    jax.block_until_ready((state, metrics))
    done = time.perf_counter()
    self.state, self.metrics = state, jax.device_get(metrics)
    if timed:
      self.tails.append(tail_round_share(np.asarray(roll.lengths)))
      self.times["rollout"].append(mid - start)
      self.times["update"].append(end - mid)
      self.times["step"].append(done - end)

  def median(self, what: str) -> float:
    return float(np.median(self.times[what]))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--prompts", type=int, default=2, help="prompts per step (B / G)")
  parser.add_argument("--group-size", type=int, default=4, help="G")
  parser.add_argument("--max-new", type=int, default=128, help="response tokens T")
  parser.add_argument("--mtp-depth", type=int, default=3, help="MTP chain length")
  parser.add_argument("--eagle-depth", type=int, default=4, help="EAGLE-3 chain length")
  parser.add_argument("--adaptive-menu", default="1,2,3,4,6",
                      help="chain lengths of the adaptive EAGLE-3 arm's menu ('' : no such arm)")
  parser.add_argument("--acceptance-carry", type=float, default=0.5,
                      help="an adaptive arm that carries this weight of each rollout's "
                           "acceptance counts into the next (0: no such arm)")
  parser.add_argument("--stop-name", action="store_true",
                      help="the commonest name word ends a response (a long tail of lengths)")
  parser.add_argument("--compaction", type=int, default=0,
                      help="halvings of the rollout batch as rows finish (0: none); adds a "
                           "plain arm with compaction")
  parser.add_argument("--history-depth", type=int, default=8,
                      help="the history arm's chain length (0: no such arm)")
  parser.add_argument("--repeat-every", type=int, default=0,
                      help="cycle over this many batches of prompts, so each comes back (0: "
                           "new prompts every step)")
  parser.add_argument("--steps", type=int, default=5, help="timed steps per arm")
  parser.add_argument("--cache-dir", type=Path,
                      default=Path(__file__).resolve().parent / ".cache")
  args = parser.parse_args(argv)
  if args.quick:
    args.steps, args.max_new = 2, 32
  lang_spec = M.LanguageSpec()
  full = M.is_cached(args.cache_dir, lang_spec, M.TrainSpec()) or not args.quick
  spec = M.TrainSpec() if full else M.QUICK_TRAIN
  eagle_spec = M.EagleSpec() if full else M.QUICK_EAGLE
  target, _, _ = M.load_or_train(args.cache_dir, lang_spec, spec)
  head, _ = M.load_or_train_eagle3(args.cache_dir, lang_spec, spec, eagle_spec, target)
  lang = M.PhraseLanguage(lang_spec)
  counts = M.param_counts(target)
  print(f"policy: {counts['trunk'] / 1e6:.1f}M trunk parameters + {counts['mtp'] / 1e6:.1f}M "
        f"MTP, EAGLE-3 head {M.count_params(head.params) / 1e6:.1f}M; {args.prompts} prompts x "
        f"G={args.group_size}, T={args.max_new} response tokens, temperature 1, "
        f"jax {jax.__version__} on {jax.devices()[0].platform}")

  grpo = GRPOConfig(group_size=args.group_size)
  reward_fn = number_reward(lang)
  sampling = SamplingConfig(1.0)
  setups = [("plain", None, None, None)]
  if args.compaction:
    setups.append(("plain compact", None, None, None))
  setups += [
            (f"mtp chain{args.mtp_depth}", MTPDrafter(), DraftTree.chain(args.mtp_depth), None),
            (f"eagle3 chain{args.eagle_depth}", Eagle3Drafter(M.EAGLE3),
             DraftTree.chain(args.eagle_depth), None)]
  if args.history_depth:
    setups.append((f"history chain{args.history_depth}", HistoryDrafter(
        group_size=args.group_size), DraftTree.chain(args.history_depth), None))
  if args.adaptive_menu:
    policy = Adaptive(tuple(DraftTree.chain(int(k)) for k in args.adaptive_menu.split(",")))
    costs = calibrate(target, M.TARGET, Eagle3Drafter(M.EAGLE3), policy,
                      batch_sizes=compaction_buckets(args.prompts * args.group_size,
                                                     args.compaction), prompt_len=32,
                      max_new_tokens=args.max_new, drafter_params=head, sampling=sampling,
                      cache_dir=args.cache_dir / "calibration")
    print("adaptive arm's costs per round:\n" + costs.format(policy.menu))
    setups.append(("eagle3 adaptive", Eagle3Drafter(M.EAGLE3), None, policy.with_costs(costs)))
    if args.acceptance_carry:
      setups.append(("eagle3 adapt+carry", Eagle3Drafter(M.EAGLE3), None,
                     policy.with_costs(costs)))
  arms = []
  for name, drafter, tree, speculation in setups:
    carry = args.acceptance_carry if name.endswith("carry") else 0.0
    config = TrainConfig(model=M.TARGET, grpo=grpo, rollout=RolloutConfig(
        max_new_tokens=args.max_new, eos_id=lang.name_lo if args.stop_name else None,
        sampling=sampling, drafter=drafter, tree=tree, speculation=speculation,
        acceptance_carry=carry, compaction=0 if name == "plain" else args.compaction))
    optimizer = optax.adam(1e-5)
    state = init_train_state(
        config, jax.tree.map(jnp.array, target), optimizer, seed=0,
        drafter_params=jax.tree.map(jnp.array, head) if config.eagle3 else None)
    arms.append(Arm(name, config, state, reward_fn, optimizer))

  cycle = args.repeat_every or args.steps + 1
  batches = [prompts(lang, args.prompts, i % cycle) for i in range(args.steps + 1)]
  for i, batch in enumerate(batches):  # step 0 compiles every program
    for arm in arms:
      arm.run(batch, i, timed=i > 0)

  plain, compact = arms[0], arms[1 if args.compaction else 0]
  print(f"{'rollout':<20}{'step s':>8}{'rollout s':>11}{'update s':>10}{'rollout %':>11}"
        f"{'accept':>8}{'tokens':>8}{'step x':>8}{'rollout x':>11}"
        + (f"{'x compact':>11}" if args.compaction else ""))
  for arm in arms:
    print(f"{arm.name:<20}{arm.median('step'):>8.3f}{arm.median('rollout'):>11.3f}"
          f"{arm.median('update'):>10.3f}"
          f"{100 * arm.median('rollout') / arm.median('step'):>10.0f}%"
          f"{float(arm.metrics['acceptance_length']):>8.2f}"
          f"{float(arm.metrics['rollout_tokens']):>8.0f}"
          f"{plain.median('step') / arm.median('step'):>8.2f}"
          f"{plain.median('rollout') / arm.median('rollout'):>11.2f}"
          + (f"{compact.median('rollout') / arm.median('rollout'):>11.2f}"
             if args.compaction else ""))
  # The EAGLE-3 arm's update also trains its head; the others do identical work.
  updates = [arm.median("update") for arm in arms if arm.config.eagle3 is None]
  spread = (max(updates) - min(updates)) / float(np.median(updates))
  verdict = "too noisy to quote" if spread > NOISY else "quotable"
  print(f"update-time spread across the arms with identical update work (plain, mtp): "
        f"{100 * spread:.0f}% -> {verdict} "
        f"(threshold {100 * NOISY:.0f}%); plain rollout share of the plain step "
        f"{100 * plain.median('rollout') / plain.median('step'):.0f}%; plain rounds with at "
        f"most a quarter of the rows live {100 * float(np.median(plain.tails)):.0f}% "
        "(median over steps)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
