"""Offline EAGLE-3 training for the arithmetic_tiny policy, sized for a 2-core CPU (~2 min).

  specjax train-drafter --config configs/eagle3_arithmetic.py [--steps 600 --head.ttt-steps 4 ...]

The target is the policy of configs/arithmetic_tiny.py after its supervised warm start (same
task, architecture and recipe). Its answers are one or two tokens, too few to learn drafting
from; but that recipe ends only 10% of the answers with EOS, so the policy runs on into a new
problem and its answer ("7" then "+3-5=5" ...), which gives each response a dozen tokens or
more to draft: operators and "=" that follow from the format, digits the target is unsure of
(the head learns those distributions, which is what sampled acceptance needs), and answers.

The head reads the 2-layer target's only inner residual stream (aux layers (1, 1, 1)), drafts
over the 15 ids the responses use (of 17), and is trained for 3 training-time-test steps on
the target's responses to 512 training prompts. The summary reports its acceptance length on
a chain of 3 over held-out prompts, greedy and at temperature 1 (about 2.0 and 2.5 tokens per
round), and the speculative / plain throughput of the same engine. That ratio is below 1
here: with a 0.7M-parameter target on a CPU, a round's fixed costs (three draft-layer
passes, a 4-token verify pass and the tree bookkeeping) weigh several plain decode steps, so
the acceptance length is the number that carries over to real targets.

To draft for the policy after GRPO instead of after its warm start, add
`--target-rl-run runs/arithmetic_tiny` (a finished `specjax train --config
configs/arithmetic_tiny.py`). The other way round, GRPO with EAGLE-3 rollouts can start from
this head: `specjax train --config configs/arithmetic_eagle3.py --drafter.eagle3-dir
runs/eagle3_arithmetic/eagle3` (the same policy: same task, warm-start recipe and seed).
"""

import runpy
from pathlib import Path

from specjax.experiments import (Checkpointing, DistillData, DrafterTrainConfig, Eagle3Head,
                                 HeadEvaluation, Optimization)


def get_config() -> DrafterTrainConfig:
  policy = runpy.run_path(str(Path(__file__).with_name("arithmetic_tiny.py")))["get_config"]()
  return DrafterTrainConfig(
      run_dir="runs/eagle3_arithmetic",
      task=policy.task,
      model=policy.model,
      warm_start=policy.warm_start,
      data=DistillData(num_prompts=512, responses_per_prompt=1, max_new_tokens=20,
                       temperature=1.0, generation_batch=128),
      head=Eagle3Head(draft_vocab_size=15, ttt_steps=3),
      steps=300,
      batch_size=32,
      optim=Optimization(learning_rate=3e-3, warmup_steps=20, final_lr_fraction=0.1),
      checkpoint=Checkpointing(every=100),
      eval=HeadEvaluation(prompts=64, depth=3, speedup_repeats=3),
  )
