"""Which drafter a trained policy accepts most of: tokens per row-round on its own rollouts.

  specjax train --config configs/arithmetic_worked.py --run-dir runs/demo   # ~7 min on 2 cores
  python benchmarks/drafter_acceptance.py runs/demo                         # ~1 min
  python benchmarks/drafter_acceptance.py runs/demo --arms "mtp chain2,group6+mtp chain2"

Rolls out the latest checkpoint of a `specjax train` run (`--config`: the config it ran,
default the README demo's) on `--batches` training batches of the run's shape (prompts x
group size, the run's temperature and response budget), with each drafter on a fixed chain,
the same prompts and keys for every arm. Printed per arm: the mean tokens per row-round
(`stats.tokens_per_round`; 1 is plain decoding, a chain of k emits at most k + 1) and, for a
drafter of two parts (`FallbackDrafter`), each part's tokens per row-round where it drafted
and its row-rounds (`Drafter.stats`). Acceptance only, no timing: which drafter pays at a
given cost is `tail_costs.py`'s and `calibrate`'s question.

Arms (NAME chainK): `mtp` the policy's MTP modules; `groupN` group drafting from matches of
N+ tokens (up to 12) in the row's group (`GroupDrafter`); `batchN` the same over every row of
the batch; `groupN+mtp`, `batchN+mtp` those in front of MTP (`FallbackDrafter`).
"""

from __future__ import annotations

import argparse
import re
import runpy
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decoding import (DraftTree, FallbackDrafter, GroupDrafter, MTPDrafter, SamplingConfig,
                              generate)
from specjax.errors import ConfigError
from specjax.experiments.export import load_policy
from specjax.experiments.grpo import task_records
from specjax.rl import PromptReader

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("mtp chain2,group6+mtp chain2,batch6+mtp chain2,batch4+mtp chain2,group2 chain3,"
        "batch2 chain3")
MAX_NGRAM = 12


def build_arm(name: str, group_size: int, batch: int):
  """`(drafter, depth)` for an arm name such as "group6+mtp chain2" (module docstring)."""
  m = re.fullmatch(r"(mtp|(group|batch)(\d+)(\+mtp)?) chain(\d+)", name.strip())
  if not m:
    raise ConfigError(f"arm {name!r} is invalid: use 'mtp chainK', 'groupN chainK', "
                      "'batchN chainK', 'groupN+mtp chainK' or 'batchN+mtp chainK'")
  if m[1] == "mtp":
    return MTPDrafter(), int(m[5])
  n = int(m[3])
  if not 1 <= n <= MAX_NGRAM:
    raise ConfigError(f"arm {name!r}: matches of {n}+ tokens; allowed 1 .. {MAX_NGRAM}")
  drafter = GroupDrafter(group_size if m[2] == "group" else batch, MAX_NGRAM, n)
  if m[4]:
    drafter = FallbackDrafter(drafter, MTPDrafter())
  return drafter, int(m[5])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("run_dir", type=Path, help="a `specjax train` run directory")
  parser.add_argument("--config", type=Path, default=ROOT / "configs" / "arithmetic_worked.py",
                      help="the config the run trained with")
  parser.add_argument("--arms", default=ARMS, help="comma-separated arms (module docstring)")
  parser.add_argument("--batches", type=int, default=4, help="rollout batches per arm")
  parser.add_argument("--first-batch", type=int, default=50, help="the first training batch")
  args = parser.parse_args(argv)
  config = runpy.run_path(str(args.config))["get_config"]()
  params, model = load_policy(args.run_dir, config.model)
  g, tok = config.grpo.group_size, config.task.tokenizer
  reader = PromptReader(task_records(config.task, "train"),
                        batch_size=config.rollout.prompts_per_step,
                        pad_id=tok.pad_id)
  rows = config.rollout.prompts_per_step * g
  arms = {name.strip(): build_arm(name, g, rows) for name in args.arms.split(",")}
  print(f"{args.run_dir}: {config.rollout.prompts_per_step} prompts x {g}, temperature "
        f"{config.rollout.temperature}, {args.batches} batches from batch {args.first_batch}")
  for name, (drafter, depth) in arms.items():
    per_round, parts = [], {}
    for i in range(args.batches):
      batch = reader.batch_at(args.first_batch + i)
      out = generate(params, model, jnp.repeat(batch.tokens, g, 0),
                     jnp.repeat(batch.lengths, g, 0), jax.random.key(i),
                     max_new_tokens=config.rollout.max_new_tokens,
                     sampling=SamplingConfig(config.rollout.temperature), drafter=drafter,
                     tree=DraftTree.chain(depth), eos_id=tok.eos_id, pad_id=tok.pad_id)
      per_round.append(float(out.stats.tokens_per_round))
      for key, value in out.stats.drafter.items():
        parts[key] = parts.get(key, 0) + int(value)
    split = "  ".join(
        f"{part}: {parts[f'{part}_tokens'] / max(parts[f'{part}_rounds'], 1):.2f} in "
        f"{parts[f'{part}_rounds']} row-rounds"
        for part in dict.fromkeys(key.rsplit("_", 1)[0] for key in parts))
    print(f"{name:<22} {np.mean(per_round):5.2f} tokens / row-round  {split}", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
