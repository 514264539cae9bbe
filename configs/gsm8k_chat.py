"""GRPO on GSM8K with a chat checkpoint: math-verify rewards in worker processes, async mode.

  pip install 'specjax[hub,chat,math]'
  SPECJAX_POLICY=Qwen/Qwen3-0.6B SPECJAX_GSM8K=data/gsm8k \\
      specjax train --config configs/gsm8k_chat.py

A run for one accelerator, not for a CPU (on a CPU, tests/experiments/test_gsm8k_config.py
runs it for 2 steps on a tiny random chat checkpoint). `SPECJAX_POLICY` is a Hub id or an HF checkpoint
directory of a chat model (its tokenizer must have a chat template); `SPECJAX_GSM8K` a
directory with GSM8K's `train.jsonl` (and `test.jsonl`, else 5% of the training questions are
held out), as github.com/openai/grade-school-math publishes them. Nothing is downloaded but
the checkpoint by Hub id.

Each question is one user turn rendered by the checkpoint's chat template (Qwen3's thinking
off), asking for the answer in \\boxed{}; `math_answer_reward` (math-verify) compares the
completion's final answer with the reference's number, in 4 worker processes (math-verify's
sympy holds the GIL, and its own 5 s limit works in a worker's main thread), each call under
60 s, a timed-out call's rows left unscored. Async mode scores each rollout in the background
while the device runs the update on the previous one and the next rollout. The policy trains
LoRA adapters (rank 16) on its frozen bfloat16 weights; an EAGLE-3 head, distilled from the
policy's own samples before RL and trained online, drafts for the adaptive policy with
compaction. Every field can be overridden from the command line (`--steps 50`,
`--rollout.max-new-tokens 256`, `--drafter.name none`, ...).
"""

import os
from pathlib import Path

from specjax.errors import ConfigError
from specjax.experiments import (Checkpointing, Drafting, ExperimentConfig, Optimization,
                                 Pipeline, RolloutEvaluation, RolloutSettings, WarmStart)
from specjax.hub import local_checkpoint
from specjax.models import LoraConfig
from specjax.rl import GRPOConfig
from specjax.rl.gsm8k import gsm8k_dataset
from specjax.rl.reward_workers import RewardWorkers
from specjax.rl.rewards import math_answer_reward
from specjax.tokenizer import HFTokenizer

PROMPT = "{question}\nPlease reason step by step, and put your final answer within \\boxed{}."


def gsm8k_files() -> tuple[Path, Path | None]:
  """`$SPECJAX_GSM8K`'s train.jsonl and test.jsonl (None when it has none)."""
  given = os.environ.get("SPECJAX_GSM8K")
  folder = Path(given or "data/gsm8k")
  train, test = folder / "train.jsonl", folder / "test.jsonl"
  if not train.is_file():
    unset = "" if given else " (unset: the default)"
    raise ConfigError(
        f"SPECJAX_GSM8K={str(folder)!r}{unset} is invalid: it has no train.jsonl (allowed: a "
        "directory with GSM8K's train.jsonl and, optionally, test.jsonl, from "
        "github.com/openai/grade-school-math's grade_school_math/data)")
  return train, test if test.is_file() else None


def get_config() -> ExperimentConfig:
  policy = os.environ.get("SPECJAX_POLICY", "Qwen/Qwen3-0.6B")
  train, test = gsm8k_files()
  # A Hub id becomes its local snapshot; a missing directory is named by the variable.
  policy = str(local_checkpoint(policy, "SPECJAX_POLICY"))
  if not (Path(policy) / "tokenizer.json").is_file():
    raise ConfigError(f"SPECJAX_POLICY={policy!r} is invalid: no tokenizer.json there "
                      "(allowed: a Hub id or an HF checkpoint directory of a chat model)")
  tokenizer = HFTokenizer.from_dir(policy)
  if tokenizer.chat_template is None:
    raise ConfigError(f"SPECJAX_POLICY={policy!r} is invalid: its tokenizer has no chat "
                      "template, and this config renders each question as a user turn (allowed: "
                      "a chat or instruct checkpoint)")
  thinking = "enable_thinking" in tokenizer.chat_template
  task = gsm8k_dataset(train, tokenizer, test_file=test, test_fraction=0.05, chat=True,
                       chat_variables={"enable_thinking": False} if thinking else None,
                       template=PROMPT, rewards=[math_answer_reward(timeout_s=5)])
  return ExperimentConfig(
      run_dir="runs/gsm8k_chat",
      task=task,
      policy_dir=policy,
      policy_dtype="bfloat16",
      lora=LoraConfig(rank=16, alpha=32.0),
      grpo=GRPOConfig(group_size=8, num_minibatches=8, tis_cap=2.0),
      steps=200,
      rollout=RolloutSettings(prompts_per_step=16, max_new_tokens=512, temperature=1.0,
                              speculation="adaptive", tree_widths=(1, 1, 1), compaction=2),
      drafter=Drafting(name="eagle3", distill_steps=300, distill_prompts=256),
      optim=Optimization(learning_rate=2e-5, warmup_steps=10),
      warm_start=WarmStart(steps=0),  # RL starts from the checkpoint's own weights
      pipeline=Pipeline(async_mode=True),
      rewards=RewardWorkers(workers=4, kind="process", timeout_s=60, on_timeout="unscored"),
      eval=RolloutEvaluation(prompts=128, speedup_repeats=3, speedup_seconds=2.0),
      checkpoint=Checkpointing(every=25),
  )
