"""What a speculative round costs in a rollout's tail: each compaction bucket, each drafter.

  python benchmarks/tail_costs.py                       # long-tail config, group and MTP
  python benchmarks/tail_costs.py --config MY_CONFIG.py --drafters medusa
  python benchmarks/tail_costs.py --buckets 2,8 --drafters group     # a quick look

For a GRPO config (default `configs/arithmetic_long_tail.py`; its policy with random weights:
the costs do not depend on them) this measures, with `specjax.decoding.calibrate`, the
seconds per round of plain decoding without a drafter, plain decoding with the drafter kept in
step, and chains of 1 .. depth drafts, at each batch size a compacted rollout runs. Printed
per drafter: the table, then per bucket the two ratios issue 33 bounds — `upkeep` = plain
with the drafter kept / plain alone (<= 1.15 is lean) — and each chain's `ceiling`: (k + 1)
plain rounds / one chain-k round, the speedup a chain would reach if every draft were
accepted. Where every ceiling is below 1, no drafter can make speculation pay at that batch
on this machine, whatever its acceptance. Then where each chain's round goes
(`specjax.decoding.round_parts`): the whole round, the drafter's share of it, the verify
forward alone, the rest (the engine's own work: acceptance, emit, commit, counts) and `lean`
= round / (drafting + verify), which issue 33 bounds at 1.3.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import jax

from specjax.decoding import (Adaptive, DraftSource, DraftTree, SamplingConfig, build_drafter,
                              calibrate, round_parts)
from specjax.decoding.drafters.group import with_group_size
from specjax.models import init_params

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", type=Path, default=ROOT / "configs" / "arithmetic_long_tail.py")
  parser.add_argument("--buckets", default="2,4,8,16,32,64,128",
                      help="comma-separated increasing batch sizes")
  parser.add_argument("--drafters", default=None, help="registered drafter names (default: "
                      "the config's drafter and group)")
  parser.add_argument("--depth", type=int, default=3, help="longest chain (MTP, Medusa: at "
                      "most the model's modules / heads)")
  parser.add_argument("--repeats", type=int, default=5, help="measurements per entry (median)")
  args = parser.parse_args(argv)
  config = runpy.run_path(str(args.config))["get_config"]()
  buckets = tuple(int(b) for b in args.buckets.split(","))
  params = init_params(config.model, jax.random.key(0))
  # The longest prompt the config's cache leaves room for beside its response budget.
  prompt_len = config.model.max_position - config.rollout.max_new_tokens - args.depth - 1
  print(f"{args.config.name}: {config.model.d_model}-wide, {config.model.n_layers} layers, "
        f"prompt {prompt_len} + {config.rollout.max_new_tokens} tokens, "
        f"jax {jax.__version__} on {jax.devices()[0].platform}")
  names = args.drafters.split(",") if args.drafters else ["group", config.drafter.name]
  heads = {"mtp": config.model.num_mtp_modules, "medusa": config.model.num_medusa_heads}
  for name in dict.fromkeys(names):
    drafter = with_group_size(build_drafter(name, DraftSource(config.model))[0],
                              config.grpo.group_size)
    depth = min(args.depth, heads[name]) if name in heads else args.depth
    menu = Adaptive.up_to(DraftTree.chain(depth))
    costs = calibrate(params, config.model, drafter, menu, batch_sizes=buckets,
                      prompt_len=prompt_len, max_new_tokens=config.rollout.max_new_tokens,
                      sampling=SamplingConfig(config.rollout.temperature), cache_dir=None,
                      repeats=args.repeats)
    print(f"\n{name}: ms per round\n{costs.format(menu.menu)}")
    print(f"{'B':>5} {'upkeep':>7} " + " ".join(f"{f'ceiling{k}':>9}"
                                                  for k in range(1, depth + 1)))
    for j, b in enumerate(buckets):
      alone = costs.alone[j] if costs.alone else costs.seconds[0][j]
      ceilings = [(k + 1) * alone / costs.seconds[k][j] for k in range(1, depth + 1)]
      print(f"{b:>5} {costs.seconds[0][j] / alone:>7.2f} "
            + " ".join(f"{c:>9.2f}" for c in ceilings))
    parts = round_parts(params, config.model, drafter, menu.menu[1:], batch_sizes=buckets,
                        prompt_len=prompt_len, max_new_tokens=config.rollout.max_new_tokens,
                        sampling=SamplingConfig(config.rollout.temperature),
                        repeats=args.repeats)
    print(f"\n{name}: where a round goes (median of {args.repeats})\n{parts.format()}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
