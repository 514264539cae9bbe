"""`DrafterTrainConfig`: everything of one offline EAGLE-3 run (`specjax.experiments.drafter`),
validated when it is built, and which of its fields a rerun may change.
"""

from __future__ import annotations

import dataclasses

import optax

from specjax.checks import is_int, is_real, require_field, require_ints, require_reals
from specjax.experiments.groups import Checkpointing, Evaluation, Optimization, WarmStart
from specjax.hub import local_checkpoint
from specjax.models import Eagle3Config, ModelConfig
from specjax.rl.tasks import ArithmeticTask

# Fields a rerun may change (dotted: a group's field; a group's name: all of it); every other
# field defines the target, the data or the head.
RESUMABLE_FIELDS = frozenset({"run_dir", "steps", "batch_size", "optim", "head.step_decay",
                              "head.soft_labels", "checkpoint", "eval"})

# Where each field of the flat config that runs before the groups recorded now lives.
LEGACY_NAMES = {
    "sft_steps": "warm_start.steps", "sft_batch": "warm_start.batch",
    "sft_learning_rate": "warm_start.learning_rate",
    "sft_eos_fraction": "warm_start.eos_fraction",
    **{name: f"data.{name}" for name in (
        "gsm8k_file", "gsm8k_test_file", "gsm8k_test_fraction", "prompt_template",
        "num_prompts", "responses_per_prompt", "max_new_tokens", "temperature",
        "generation_batch")},
    **{name: f"head.{name}" for name in (
        "draft_vocab_size", "aux_layers", "ttt_steps", "step_decay", "soft_labels")},
    **{name: f"optim.{name}" for name in (
        "learning_rate", "warmup_steps", "final_lr_fraction", "weight_decay",
        "max_grad_norm")},
    "checkpoint_every": "checkpoint.every", "max_checkpoints": "checkpoint.keep",
    "eval_prompts": "eval.prompts", "eval_max_new_tokens": "eval.max_new_tokens",
    "eval_temperature": "eval.temperature", "eval_depth": "eval.depth",
    "speedup_repeats": "eval.speedup_repeats"}

_DEFAULT_MODEL = ModelConfig(vocab_size=17, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                             head_dim=32, mlp_dim=256, num_mtp_modules=2, max_position=64)


@dataclasses.dataclass(frozen=True)
class DistillData:
  """The self-distillation data: prompts, and the target's responses to them.

  Attributes:
    gsm8k_file: prompts from this GSM8K-format JSONL ("question", "answer") instead of the
      arithmetic task.
    gsm8k_test_file: held-out prompts of `gsm8k_file`; None holds out `gsm8k_test_fraction`.
    gsm8k_test_fraction: share of `gsm8k_file`'s questions held out, in (0, 1).
    prompt_template: GSM8K prompt, with "{question}" replaced by the question.
    num_prompts: training prompts the target answers.
    responses_per_prompt: responses sampled per training prompt.
    max_new_tokens: response budget (sequence length L = P + max_new_tokens).
    temperature: sampling temperature of the responses (0: greedy).
    generation_batch: prompts per `generate` call while making the data.
  """

  gsm8k_file: str | None = None
  gsm8k_test_file: str | None = None
  gsm8k_test_fraction: float = 0.05
  prompt_template: str = "Question: {question}\nAnswer:"
  num_prompts: int = 1024
  responses_per_prompt: int = 1
  max_new_tokens: int = 32
  temperature: float = 1.0
  generation_batch: int = 128

  def __post_init__(self):
    require_ints(self, ("num_prompts", "responses_per_prompt", "max_new_tokens",
                        "generation_batch"), 1, "data.")
    require_reals(self, ("temperature",), positive=False, prefix="data.")
    require_field(self, "prompt_template", isinstance(self.prompt_template, str)
                  and "{question}" in self.prompt_template, "must contain '{question}'",
                  "data.")
    if self.gsm8k_file is not None and self.gsm8k_test_file is None:
      require_field(self, "gsm8k_test_fraction", is_real(self.gsm8k_test_fraction)
                    and 0 < self.gsm8k_test_fraction < 1, "must be in (0, 1) without "
                    "gsm8k_test_file (held-out prompts are needed)", "data.")


@dataclasses.dataclass(frozen=True)
class Eagle3Head:
  """The EAGLE-3 head trained, and its loss.

  Attributes:
    draft_vocab_size: W, the head's vocabulary (the W most frequent response tokens); None
      for the whole target vocabulary.
    aux_layers: the target layers the head reads (vLLM ids); None for
      `Eagle3Config.for_target`'s default.
    ttt_steps: J, training-time-test steps (draft depths trained).
    step_decay: weight ratio of consecutive TTT steps in the loss.
    soft_labels: learn the target's distributions (True) or its sampled tokens (False).
  """

  draft_vocab_size: int | None = None
  aux_layers: tuple[int, int, int] | None = None
  ttt_steps: int = 3
  step_decay: float = 1.0
  soft_labels: bool = True

  def __post_init__(self):
    if isinstance(self.aux_layers, list):  # JSON and tyro give lists
      object.__setattr__(self, "aux_layers", tuple(self.aux_layers))
    vocab = self.draft_vocab_size
    require_field(self, "draft_vocab_size", vocab is None or (is_int(vocab) and vocab >= 1),
                  "must be None (the whole vocabulary) or an int >= 1", "head.")
    aux = self.aux_layers
    require_field(self, "aux_layers", aux is None or (len(aux) == 3
                                                      and all(is_int(i) for i in aux)),
                  "must be None or 3 target layer ids (low, mid, high)", "head.")
    require_ints(self, ("ttt_steps",), 1, "head.")
    require_reals(self, ("step_decay",), positive=True, prefix="head.")
    require_field(self, "soft_labels", isinstance(self.soft_labels, bool),
                  "must be True or False", "head.")


@dataclasses.dataclass(frozen=True)
class HeadEvaluation(Evaluation):
  """The held-out evaluation of the trained head: acceptance and speedup, greedy and sampled.

  Attributes:
    max_new_tokens: tokens generated per held-out prompt; None for `data.max_new_tokens`.
    temperature: temperature of the sampled evaluation; None for `data.temperature` (the
      greedy evaluation always runs too).
    depth: the evaluation drafts a chain of this many tokens per round.
  """

  prompts: int = 64
  speedup_repeats: int = 3
  max_new_tokens: int | None = None
  temperature: float | None = None
  depth: int = 3

  def __post_init__(self):
    super().__post_init__()
    require_field(self, "max_new_tokens", self.max_new_tokens is None
                  or (is_int(self.max_new_tokens) and self.max_new_tokens >= 1),
                  "must be None or an int >= 1", "eval.")
    require_field(self, "temperature", self.temperature is None
                  or (is_real(self.temperature) and self.temperature >= 0),
                  "must be None or a finite number >= 0", "eval.")
    require_ints(self, ("depth",), 1, "eval.")


@dataclasses.dataclass(frozen=True)
class DrafterTrainConfig:
  """Everything of one offline EAGLE-3 run; every field can be overridden on the command line
  (`--steps 2000`, `--head.ttt-steps 4`, `--data.gsm8k-file FILE`).

  Attributes:
    run_dir: data, checkpoints, metrics, the exported head and the summary go here.
    seed: seeds the warm start, the data, the head's initialisation and the batch order.
    target_dir: an HF checkpoint directory (config.json, safetensors, tokenizer.json) to
      train a head for; None for the built-in arithmetic policy.
    target_rl_run: a `specjax train` run directory (or its checkpoints/) whose latest policy
      is the target; `model` must be that run's architecture. None: warm-start a policy.
    task: the arithmetic task (the built-in policy's training data, and the prompts unless
      `data.gsm8k_file` is set).
    model: the built-in policy's architecture (vocab_size must equal the task tokenizer's).
    warm_start: the built-in policy's warm start (`WarmStart`; by default only some answers
      end with EOS, which gives the policy responses long enough to draft).
    data: the self-distillation data (`DistillData`).
    head: the head and its loss (`Eagle3Head`).
    steps: optimizer steps in total (a rerun with more steps continues; the cosine decay
      then stretches to the new total).
    batch_size: sequences per step.
    optim: AdamW's schedule and clipping (`Optimization`: warmup, then cosine decay).
    checkpoint: checkpoint frequency and retention (`Checkpointing`).
    eval: the held-out evaluation (`HeadEvaluation`).
  """

  run_dir: str = "runs/eagle3"
  seed: int = 0
  target_dir: str | None = None
  target_rl_run: str | None = None
  task: ArithmeticTask = ArithmeticTask()
  model: ModelConfig = _DEFAULT_MODEL
  warm_start: WarmStart = WarmStart(steps=400, eos_fraction=0.0)
  data: DistillData = DistillData()
  head: Eagle3Head = Eagle3Head()
  steps: int = 1000
  batch_size: int = 32
  optim: Optimization = Optimization(learning_rate=1e-3, warmup_steps=50,
                                     final_lr_fraction=0.1)
  checkpoint: Checkpointing = Checkpointing(every=100, keep=2)
  eval: HeadEvaluation = HeadEvaluation()

  def __post_init__(self):
    for name, kind in _GROUPS.items():
      require_field(self, name, isinstance(getattr(self, name), kind),
                    f"must be a {kind.__name__}(...)")
    require_field(self, "run_dir", isinstance(self.run_dir, str) and bool(self.run_dir),
                  "must be a non-empty path")
    require_ints(self, ("seed",), 0)
    require_ints(self, ("steps", "batch_size"), 1)
    require_field(self.optim, "warmup_steps", self.optim.warmup_steps < self.steps,
                  f"must be below steps={self.steps} (warmup, then cosine decay)", "optim.")
    if self.target_dir is not None:  # a Hub id becomes its local snapshot (specjax.hub)
      object.__setattr__(self, "target_dir", str(local_checkpoint(self.target_dir,
                                                                  "target_dir")))
    require_field(self, "target_rl_run", self.target_dir is None or self.target_rl_run is None,
                  f"must be None with target_dir={self.target_dir!r}: the target is one or "
                  "the other")
    if self.target_dir is None:  # the built-in policy: its shapes are known now
      vocab = self.task.tokenizer.vocab_size
      require_field(self, "model", self.model.vocab_size == vocab,
                    f"has vocab_size={self.model.vocab_size}; the task's tokenizer has {vocab} "
                    "ids")
      if self.head.draft_vocab_size is not None:
        require_field(self.head, "draft_vocab_size", self.head.draft_vocab_size <= vocab,
                      f"must be at most the target's vocab_size={vocab}", "head.")
      if self.head.aux_layers is not None:
        Eagle3Config.for_target(self.model, aux_layers=self.head.aux_layers)

  @property
  def eval_max_new_tokens(self) -> int:
    """Tokens generated per held-out prompt (`eval.max_new_tokens`, None resolved)."""
    return (self.data.max_new_tokens if self.eval.max_new_tokens is None
            else self.eval.max_new_tokens)

  @property
  def eval_sampling_temperature(self) -> float:
    """Temperature of the sampled evaluation (`eval.temperature`, None resolved)."""
    return self.data.temperature if self.eval.temperature is None else self.eval.temperature

  def optimizer(self) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on `optim`'s schedule over `steps`."""
    return optax.chain(optax.clip_by_global_norm(self.optim.max_grad_norm),
                       optax.adamw(self.optim.schedule(self.steps),
                                   weight_decay=self.optim.weight_decay))


_GROUPS = {"warm_start": WarmStart, "data": DistillData, "head": Eagle3Head,
           "optim": Optimization, "checkpoint": Checkpointing, "eval": HeadEvaluation}
