"""`DrafterTrainConfig`: everything of one offline EAGLE-3 run (`specjax.experiments.drafter`),
validated when it is built, and which of its fields a rerun may change.
"""

from __future__ import annotations

import dataclasses

import optax

from specjax.checks import is_int
from specjax.errors import ConfigError
from specjax.models import Eagle3Config, ModelConfig
from specjax.rl.tasks import ArithmeticTask

# Fields a rerun may change; every other field defines the target, the data or the head.
RESUMABLE_FIELDS = frozenset({
    "run_dir", "steps", "batch_size", "learning_rate", "warmup_steps", "final_lr_fraction",
    "weight_decay", "max_grad_norm", "step_decay", "soft_labels",
    "checkpoint_every", "max_checkpoints", "eval_prompts", "eval_max_new_tokens",
    "eval_temperature", "eval_depth", "speedup_repeats"})

_DEFAULT_MODEL = ModelConfig(vocab_size=17, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                             head_dim=32, mlp_dim=256, num_mtp_modules=2, max_position=64)


@dataclasses.dataclass(frozen=True)
class DrafterTrainConfig:
  """Everything of one offline EAGLE-3 run; every field can be overridden on the command line.

  Attributes:
    run_dir: data, checkpoints, metrics, the exported head and the summary go here.
    seed: seeds the warm start, the data, the head's initialisation and the batch order.
    target_dir: an HF checkpoint directory (config.json, safetensors, tokenizer.json) to
      train a head for; None for the built-in arithmetic policy.
    target_rl_run: a `specjax train` run directory (or its checkpoints/) whose latest policy
      is the target; `model` must be that run's architecture. None: warm-start a policy.
    task: the arithmetic task (the built-in policy's training data, and the prompts unless
      `gsm8k_file` is set).
    model: the built-in policy's architecture (vocab_size must equal the task tokenizer's).
    sft_steps: warm-start steps of the built-in policy.
    sft_batch: warm-start batch size.
    sft_learning_rate: warm-start learning rate.
    sft_eos_fraction: share of warm-start answers that end with EOS; the others run on into
      the next problem (see `ExperimentConfig.sft_eos_fraction`), which gives the policy
      responses long enough to draft.
    gsm8k_file: prompts from this GSM8K-format JSONL ("question", "answer") instead of the
      arithmetic task.
    gsm8k_test_file: held-out prompts of `gsm8k_file`; None holds out `gsm8k_test_fraction`.
    gsm8k_test_fraction: share of `gsm8k_file`'s questions held out, in (0, 1).
    prompt_template: GSM8K prompt, with "{question}" replaced by the question.
    num_prompts: training prompts the target answers.
    responses_per_prompt: responses sampled per training prompt.
    max_new_tokens: response budget of the self-distillation data (L = P + max_new_tokens).
    temperature: sampling temperature of the data (0: greedy).
    generation_batch: prompts per `generate` call while making the data.
    draft_vocab_size: W, the head's vocabulary (the W most frequent response tokens); None
      for the whole target vocabulary.
    aux_layers: the target layers the head reads (vLLM ids); None for
      `Eagle3Config.for_target`'s default.
    ttt_steps: J, training-time-test steps (draft depths trained).
    step_decay: weight ratio of consecutive TTT steps in the loss.
    soft_labels: learn the target's distributions (True) or its sampled tokens (False).
    steps: optimizer steps in total (a rerun with more steps continues; the cosine decay
      then stretches to the new total).
    batch_size: sequences per step.
    learning_rate: peak AdamW learning rate.
    warmup_steps: linear warmup from 0, then cosine decay to the end of `steps`.
    final_lr_fraction: the cosine decay ends at `learning_rate * final_lr_fraction`.
    weight_decay: AdamW weight decay.
    max_grad_norm: global gradient clipping.
    checkpoint_every: steps between checkpoints (the last step is always saved).
    max_checkpoints: checkpoints kept.
    eval_prompts: held-out prompts of the evaluation.
    eval_max_new_tokens: tokens generated per held-out prompt; None for `max_new_tokens`.
    eval_temperature: temperature of the sampled evaluation; None for `temperature` (the
      greedy evaluation always runs too).
    eval_depth: the evaluation drafts a chain of this many tokens per round.
    speedup_repeats: timed repeats of each throughput measurement (median).
  """

  run_dir: str = "runs/eagle3"
  seed: int = 0
  target_dir: str | None = None
  target_rl_run: str | None = None
  task: ArithmeticTask = ArithmeticTask()
  model: ModelConfig = _DEFAULT_MODEL
  sft_steps: int = 400
  sft_batch: int = 64
  sft_learning_rate: float = 3e-3
  sft_eos_fraction: float = 0.0
  gsm8k_file: str | None = None
  gsm8k_test_file: str | None = None
  gsm8k_test_fraction: float = 0.05
  prompt_template: str = "Question: {question}\nAnswer:"
  num_prompts: int = 1024
  responses_per_prompt: int = 1
  max_new_tokens: int = 32
  temperature: float = 1.0
  generation_batch: int = 128
  draft_vocab_size: int | None = None
  aux_layers: tuple[int, int, int] | None = None
  ttt_steps: int = 3
  step_decay: float = 1.0
  soft_labels: bool = True
  steps: int = 1000
  batch_size: int = 32
  learning_rate: float = 1e-3
  warmup_steps: int = 50
  final_lr_fraction: float = 0.1
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  checkpoint_every: int = 100
  max_checkpoints: int = 2
  eval_prompts: int = 64
  eval_max_new_tokens: int | None = None
  eval_temperature: float | None = None
  eval_depth: int = 3
  speedup_repeats: int = 3

  def __post_init__(self):
    def require(ok: bool, field: str, allowed: str):
      if not ok:
        raise ConfigError(f"{field}={getattr(self, field)!r} is invalid: {allowed}")

    require(isinstance(self.run_dir, str) and bool(self.run_dir), "run_dir",
            "must be a non-empty path")
    require(is_int(self.seed), "seed", "must be an int")
    for name in ("num_prompts", "responses_per_prompt", "max_new_tokens", "generation_batch",
                 "ttt_steps", "steps", "batch_size", "checkpoint_every", "max_checkpoints",
                 "eval_prompts", "eval_depth", "speedup_repeats", "sft_batch"):
      require(is_int(getattr(self, name)) and getattr(self, name) >= 1, name,
              "must be an int >= 1")
    for name in ("sft_steps", "warmup_steps"):
      require(is_int(getattr(self, name)) and getattr(self, name) >= 0, name,
              "must be an int >= 0")
    require(self.warmup_steps < self.steps, "warmup_steps",
            f"must be below steps={self.steps} (warmup, then cosine decay)")
    require(self.eval_max_new_tokens is None or (is_int(self.eval_max_new_tokens)
                                                 and self.eval_max_new_tokens >= 1),
            "eval_max_new_tokens", "must be None or an int >= 1")
    require(self.temperature >= 0, "temperature", "must be >= 0 (0: greedy)")
    require(self.eval_temperature is None or self.eval_temperature >= 0, "eval_temperature",
            "must be None or >= 0")
    for name in ("learning_rate", "max_grad_norm", "step_decay", "sft_learning_rate"):
      require(getattr(self, name) > 0, name, "must be > 0")
    require(0 <= self.final_lr_fraction <= 1, "final_lr_fraction", "must be in [0, 1]")
    require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
    require(0 <= self.sft_eos_fraction <= 1, "sft_eos_fraction", "must be in [0, 1]")
    require(self.target_dir is None or self.target_rl_run is None, "target_rl_run",
            f"must be None with target_dir={self.target_dir!r}: the target is one or the other")
    require(self.draft_vocab_size is None or (is_int(self.draft_vocab_size)
                                              and self.draft_vocab_size >= 1),
            "draft_vocab_size", "must be None (the whole vocabulary) or an int >= 1")
    aux = self.aux_layers
    if isinstance(aux, list):
      object.__setattr__(self, "aux_layers", tuple(aux))
    require(self.aux_layers is None or (len(self.aux_layers) == 3
                                        and all(is_int(i) for i in self.aux_layers)),
            "aux_layers", "must be None or 3 target layer ids (low, mid, high)")
    require("{question}" in self.prompt_template, "prompt_template",
            "must contain '{question}'")
    if self.gsm8k_file is not None and self.gsm8k_test_file is None:
      require(0 < self.gsm8k_test_fraction < 1, "gsm8k_test_fraction",
              "must be in (0, 1) without gsm8k_test_file (held-out prompts are needed)")
    if self.target_dir is None:  # the built-in policy: its shapes are known now
      vocab = self.task.tokenizer.vocab_size
      require(self.model.vocab_size == vocab, "model",
              f"has vocab_size={self.model.vocab_size}; the task's tokenizer has {vocab} ids")
      if self.draft_vocab_size is not None:
        require(self.draft_vocab_size <= vocab, "draft_vocab_size",
                f"must be at most the target's vocab_size={vocab}")
      if self.aux_layers is not None:
        Eagle3Config.for_target(self.model, aux_layers=self.aux_layers)

  @property
  def eval_sampling_temperature(self) -> float:
    return self.temperature if self.eval_temperature is None else self.eval_temperature

  def schedule(self) -> optax.Schedule:
    """Linear warmup to `learning_rate`, cosine decay to `final_lr_fraction` of it."""
    return optax.warmup_cosine_decay_schedule(
        0.0, self.learning_rate, self.warmup_steps, self.steps,
        end_value=self.learning_rate * self.final_lr_fraction)

  def optimizer(self) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(self.max_grad_norm),
                       optax.adamw(self.schedule(), weight_decay=self.weight_decay))
