"""Where an offline EAGLE-3 run's target and data come from.

The target is an HF checkpoint directory, the latest policy of a `specjax train` run, or the
built-in arithmetic policy warm-started on the spot; its prompts come from the arithmetic
task's splits or a GSM8K-format JSONL; the training data are its own responses to them
(`make_data`). `specjax.experiments.drafter` runs the training around these.

Shape letters: see `specjax` (B rows, L sequence buffer, W draft vocab).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from specjax.checkpoint import Checkpointer
from specjax.decoding import SamplingConfig
from specjax.errors import ConfigError
from specjax.experiments.drafter_config import DrafterTrainConfig
from specjax.experiments.export import load_policy
from specjax.experiments.warm_start import warm_start_policy
from specjax.files import read_object
from specjax.models import ModelConfig, init_params
from specjax.models.params import Params
from specjax.rl.gsm8k import GSM8KTask
from specjax.rl.tasks import encode_prompt
from specjax.supervised.eagle3 import draft_vocab_from_data, self_distillation_data
from specjax.tokenizer import Tokenizer, check_vocab_fits


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
  """The frozen model a head is trained for.

  Attributes:
    params: its parameters.
    config: its architecture.
    tokenizer: its tokenizer (EOS, padding and prompt encoding).
  """

  params: Params
  config: ModelConfig
  tokenizer: Tokenizer


# ---------------------------------------------------------------------------------------------
# Target


def target_spec(config: DrafterTrainConfig) -> tuple[Tokenizer, ModelConfig]:
  """The target's tokenizer and architecture, without loading its weights (cheap checks)."""
  if config.target_dir is None:
    if config.target_rl_run is not None and not Path(config.target_rl_run).is_dir():
      raise ConfigError(f"target_rl_run={config.target_rl_run!r} is invalid: no such directory")
    return config.task.tokenizer, config.model
  from specjax.models import config_from_hf
  from specjax.tokenizer import HFTokenizer
  path = Path(config.target_dir)
  if not (path / "config.json").is_file():
    raise ConfigError(f"target_dir={config.target_dir!r} is invalid: no config.json there "
                      "(expected an HF checkpoint directory)")
  tokenizer = HFTokenizer.from_dir(path)
  record = read_object(path / "config.json", ConfigError,
                       f"target_dir={config.target_dir!r} needs an HF checkpoint's config.json")
  model = config_from_hf(record)
  check_vocab_fits(tokenizer, model.vocab_size)
  return tokenizer, model


def load_target(config: DrafterTrainConfig, log: Callable[[str], None] = print) -> Target:
  """The target of `config`: loaded from `target_dir` or `target_rl_run`, or the built-in
  policy (restored from `run_dir/target`, else warm-started and saved there)."""
  if config.target_dir is not None:
    from specjax.models import load_hf

    # A clear error for a directory that is not a checkpoint, or a tokenizer the model's
    # vocabulary cannot hold, before the weights are read.
    tokenizer, _ = target_spec(config)
    params, model = load_hf(config.target_dir)
    check_vocab_fits(tokenizer, model.vocab_size)
    # Committed to the device like restored checkpoints, so every target source of one shape
    # shares the compiled programs (jit tells committed and uncommitted inputs apart).
    params = jax.device_put(params, jax.devices()[0])
    return Target(params, model, tokenizer)
  tokenizer = config.task.tokenizer
  if config.target_rl_run is not None:
    return Target(load_policy(config.target_rl_run, config.model, field="target_rl_run")[0],
                  config.model,
                  tokenizer)
  ckpt = Checkpointer(Path(config.run_dir) / "target", max_to_keep=1)
  try:
    abstract = jax.eval_shape(lambda: init_params(config.model, jax.random.key(0)))
    if ckpt.latest_step() is None:
      # No drafter is trained here, so any target architecture fits.
      params = warm_start_policy(config.task, config.model, config.warm_start, config.seed, log)
      ckpt.save(0, params, {"sft_steps": config.warm_start.steps})
    else:
      log(f"target: the warm-started policy saved in {ckpt.directory}")
    # Always the saved copy, so a first run and its reruns see the very same arrays.
    params = ckpt.restore(abstract)[0]
  finally:
    ckpt.close()
  return Target(params, config.model, tokenizer)


def _end_ids(tokenizer: Tokenizer) -> int | tuple[int, ...]:
  """Every id that ends a response of `tokenizer`'s model: its `eos_ids` when it lists
  several (chat checkpoints end a turn on one and a document on another, e.g. Llama 3's
  <|eot_id|> and <|end_of_text|>), else its `eos_id`."""
  ids = tuple(getattr(tokenizer, "eos_ids", ()) or ())
  return ids if len(ids) > 1 else tokenizer.eos_id


# ---------------------------------------------------------------------------------------------
# Prompts and data


def _source_name(config: DrafterTrainConfig) -> str:
  data = config.data
  return f"data.gsm8k_file={data.gsm8k_file!r}" if data.gsm8k_file else "the arithmetic task"


def task_prompts(config: DrafterTrainConfig, tokenizer: Tokenizer, split: str,
            count: int) -> tuple[np.ndarray, np.ndarray]:
  """`count` prompts of `split`, encoded by `tokenizer`: `(tokens [count, P], lengths
  [count])`. Training prompts are a seeded shuffle of the split; held-out ones its first
  `count`."""
  from specjax.rl.data import PromptReader
  if config.data.gsm8k_file is not None:
    task = GSM8KTask(config.data.gsm8k_file, tokenizer, test_file=config.data.gsm8k_test_file,
                     test_fraction=(0.0 if config.data.gsm8k_test_file
                                    else config.data.gsm8k_test_fraction),
                     template=config.data.prompt_template, seed=config.seed)
  else:
    task = config.task
  examples = task.examples(split)
  field = "data.num_prompts" if split == "train" else "eval.prompts"
  if count > len(examples):
    raise ConfigError(f"{field}={count} is invalid: the {split} split of "
                      f"{_source_name(config)} has {len(examples)} prompts")
  records = [{"prompt": encode_prompt(tokenizer, e.prompt), "reference": e.reference,
              "answer": 0} for e in examples]
  reader = PromptReader(records, batch_size=count, pad_id=tokenizer.pad_id,
                        shuffle=split == "train", seed=config.seed)
  batch = reader.batch_at(0)
  return batch.tokens, batch.lengths


def check_length(field: str, value: int, needed: int, target: ModelConfig,
                  detail: str) -> None:
  if needed > target.max_position:
    raise ConfigError(f"{field}={value} is invalid: {detail} need {needed} positions, more "
                      f"than the target's max_position={target.max_position}")


def make_data(config: DrafterTrainConfig, target: Target, tokens: np.ndarray,
              lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Self-distillation data of training prompts `tokens [num_prompts, P]` and its draft
  vocabulary: `(tokens [B, L], loss_mask [B, L], d2t [W])`, B = num_prompts *
  responses_per_prompt."""
  tokens = np.repeat(tokens, config.data.responses_per_prompt, axis=0)
  lengths = np.repeat(lengths, config.data.responses_per_prompt, axis=0)
  rows = len(tokens)
  # Pad to whole generation batches: one compiled program instead of one more for the rest.
  batch = min(config.data.generation_batch, rows)
  extra = -rows % batch
  tokens = np.concatenate([tokens, np.repeat(tokens[-1:], extra, 0)])
  lengths = np.concatenate([lengths, np.repeat(lengths[-1:], extra, 0)])
  seqs, mask = self_distillation_data(
      target.params, target.config, tokens, lengths, jax.random.key(config.seed),
      max_new_tokens=config.data.max_new_tokens, sampling=SamplingConfig(config.data.temperature),
      eos_id=_end_ids(target.tokenizer), pad_id=target.tokenizer.pad_id, batch_size=batch)
  seqs, mask = seqs[:rows], mask[:rows]
  w = config.head.draft_vocab_size
  w = target.config.vocab_size if w is None else w
  return seqs, mask, draft_vocab_from_data(seqs, mask, target.config.vocab_size, w)
