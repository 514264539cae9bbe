"""`ExperimentConfig`: everything a GRPO run on a built-in task is made of, validated up front.

The task, the policy's shape and GRPO's settings at the top, then one group per concern: how
rollouts sample (`RolloutSettings`), the drafter and its online training (`Drafting`), the
optimizer, the warm start, the evaluation, the mesh, how rollouts and updates overlap
(`Pipeline`) and checkpointing; the groups shared with the offline drafter run live in
`groups`. `specjax train` fills it from a config file and flags (`--rollout.temperature 0.7`).
Every field is checked when the config is built, so a run that cannot work fails before any
warm start or compilation. `specjax.experiments.grpo.run` executes it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Literal

import optax
import tyro

from specjax.checks import is_plain_int, is_real, require_field, require_ints, require_reals
from specjax.decoding import (AcceptanceCounts, Adaptive, CostTable, DraftModelDrafter, DraftSource,
                              DraftTree, Eagle3Drafter, SamplingConfig, build_drafter,
                              check_drafter_name, drafter_names, needs_checkpoint)
from specjax.decoding.drafters.group import with_group_size
from specjax.decoding.drafters.registry import group_in_front, history_in_front
from specjax.decoding.drafters.history import history_drafter, with_bank_sizes
from specjax.errors import ConfigError
from specjax.experiments.groups import Checkpointing, Evaluation, Optimization, WarmStart
from specjax.experiments.metrics_log import Logging
from specjax.files import read_object
from specjax.hub import local_checkpoint
from specjax.models.config import RUNTIME_FIELDS, ModelConfig
from specjax.models.eagle3 import Eagle3Config
from specjax.models.eagle3_io import eagle3_config_from_hf
from specjax.models.heads import DRAFT_HEAD_KEYS
from specjax.models.lora import LoraConfig
from specjax.optimizers import float32_master
from specjax.rl.datasets import DatasetTask, JaxReward
from specjax.rl.gsm8k import GSM8KTask
from specjax.rl.losses import GRPOConfig
from specjax.rl.reward_workers import RewardWorkers
from specjax.rl.state import DrafterTraining, RolloutConfig, TrainConfig
from specjax.rl.tasks import ArithmeticTask, CustomTask
from specjax.sharding import MeshConfig
from specjax.tokenizer import HFTokenizer, different_ids, read_table

# The drafter whose weights are a second HF checkpoint (`Drafting.checkpoint`), and the one
# whose head the run holds (`Drafting.eagle3_dir`, or distilled from the policy).
DRAFT_MODEL = "draft-model"
EAGLE3 = "eagle3"


# The drafter names whose weights the run holds, and which drafter with weights each is.
_WEIGHTS = {EAGLE3: EAGLE3, DRAFT_MODEL: DRAFT_MODEL} | {
    f"{front}+{weights}": weights for front in ("group", "history")
    for weights in (EAGLE3, DRAFT_MODEL)}


def names_with(weights: str) -> str:
  """The drafter names that draft with `weights` (EAGLE3 or DRAFT_MODEL), for messages."""
  names = [name for name, own in _WEIGHTS.items() if own == weights]
  return ", ".join(map(repr, names[:-1])) + f" or {names[-1]!r}"


def weights_of(name: str) -> str | None:
  """The drafter with weights of its own that drafter `name` drafts with, alone or behind
  group or history drafts ("group+eagle3" -> "eagle3"): EAGLE3, DRAFT_MODEL, or None."""
  return _WEIGHTS.get(name) if isinstance(name, str) else None

# Half of each rollout's acceptance counts start the next: the policy chooses its trees from
# the first round on, yet follows a drafter whose acceptance moves (docs/experiments.md).
DEFAULT_ACCEPTANCE_CARRY = 0.5


# Fields a resumed run may change (dotted: a group's field; a group's name: all of it): how
# long it runs, how often it checkpoints, how long it measures, the mesh (checkpoints
# restore onto any mesh) and how many reward workers of which kind call the same functions.
# Every other field defines the policy, its task or its training, and a change would
# silently alter the run.
RESUMABLE_FIELDS = frozenset({"run_dir", "steps", "checkpoint", "accept_changed_inputs",
                              "rewards.workers", "rewards.kind",
                              "eval.speedup_repeats",
                              "eval.speedup_seconds", "mesh", "log"})


# Where each field of the flat config that runs before the groups recorded now lives.
LEGACY_NAMES = {
    **{name: f"rollout.{name}" for name in (
        "prompts_per_step", "max_new_tokens", "temperature", "speculation", "tree_widths",
        "acceptance_carry")},
    "drafter": "drafter.name", "drafter_loss_weight": "drafter.loss_weight",
    "drafter_learning_rate": "drafter.learning_rate", "eagle3_ttt_steps": "drafter.ttt_steps",
    "clip_heads_separately": "drafter.clip_heads_separately",
    "eagle3_dir": "drafter.eagle3_dir", "eagle3_draft_vocab": "drafter.draft_vocab_size",
    "eagle3_steps": "drafter.distill_steps", "eagle3_distill_task": "drafter.distill_task",
    **{name: f"optim.{name}" for name in ("learning_rate", "warmup_steps", "max_grad_norm")},
    "sft_steps": "warm_start.steps", "sft_batch": "warm_start.batch",
    "sft_learning_rate": "warm_start.learning_rate",
    "sft_eos_fraction": "warm_start.eos_fraction",
    "eval_prompts": "eval.prompts", "speedup_repeats": "eval.speedup_repeats",
    "speedup_seconds": "eval.speedup_seconds",
    **{name: f"pipeline.{name}" for name in ("async_mode", "rollout_devices", "policy_lag")},
    "checkpoint_every": "checkpoint.every", "max_checkpoints": "checkpoint.keep"}

@dataclasses.dataclass(frozen=True)
class RolloutSettings:
  """How each step samples its responses.

  Attributes:
    prompts_per_step: prompts per step (each sampled `grpo.group_size` times).
    max_new_tokens: response budget T.
    temperature: sampling temperature.
    speculation: "fixed": every round drafts the `tree_widths` tree; "adaptive": each round
      runs plain decoding, a chain of 1 .. depth drafts, or that tree, whichever is expected
      to produce the most tokens per second (`specjax.decoding.Adaptive`), with costs that
      `calibrate` measures on this machine at the rollout's shapes before training (cached
      on disk). Speculation then never costs more than it brings.
    tree_widths: draft tree, children per node at each depth.
    acceptance_carry: with adaptive speculation, the weight in [0, 1] of one rollout's
      acceptance counts in the next (`RolloutConfig.acceptance_carry`; kept in the train
      state and its checkpoints). 0: each rollout starts from the policy's prior. None (the
      default): `DEFAULT_ACCEPTANCE_CARRY` with adaptive speculation and a drafter, else 0.
    compaction: halvings of the rollout batch as its rows finish (`RolloutConfig.compaction`;
      0: every round runs every row). The plain arm of the speedup measurement compacts
      alike, so the speedup is speculation's alone.
  """

  prompts_per_step: int = 16
  max_new_tokens: int = 6
  temperature: float = 1.0
  speculation: Literal["fixed", "adaptive"] = "fixed"
  tree_widths: tuple[int, ...] = (1, 1)
  acceptance_carry: float | None = None
  compaction: int = 0

  def __post_init__(self):
    if isinstance(self.tree_widths, list):  # JSON and tyro give lists
      object.__setattr__(self, "tree_widths", tuple(self.tree_widths))
    require_ints(self, ("prompts_per_step", "max_new_tokens"), 1, "rollout.")
    require_ints(self, ("compaction",), 0, "rollout.")
    require_reals(self, ("temperature",), positive=False, prefix="rollout.")
    require_field(self, "speculation", self.speculation in ("fixed", "adaptive"),
                  "allowed 'fixed' or 'adaptive'", "rollout.")
    carry = self.acceptance_carry
    require_field(self, "acceptance_carry", carry is None or (is_real(carry) and 0 <= carry <= 1),
                  "must be a number in [0, 1] or None (the default for the speculation "
                  "chosen)", "rollout.")
    DraftTree.from_widths(self.tree_widths)  # a malformed tree fails here, with its message


@dataclasses.dataclass(frozen=True)
class Drafting:
  """The rollout's drafter, and how it is trained alongside the policy.

  Attributes:
    name: a registered drafter (`specjax.decoding.drafter_names`; "none": plain decoding;
      "draft-model": the HF checkpoint `checkpoint`; "eagle3": the run's own head, below;
      "group+draft-model", "group+eagle3", "history+draft-model", "history+eagle3": group or
      history drafts from confident matches (6+ tokens, `registry.CONFIDENT_NGRAM`), those
      elsewhere; not another drafter whose weights come from a checkpoint).
    loss_weight: weight of the detached drafter loss on each step's rollouts (0: the drafter
      is not trained online).
    learning_rate: learning rate of an EAGLE-3 head trained online (MTP and Medusa heads
      share the policy's optimizer).
    ttt_steps: training-time-test steps of the online EAGLE-3 loss: how many of its own
      drafts deep the head learns to draft on.
    clip_heads_separately: clip the trunk's gradient and the MTP / Medusa heads' gradient to
      `optim.max_grad_norm` each by a norm of its own. The heads share the policy's optimizer
      and their loss is detached from the trunk, but under one global norm a large head
      gradient would still shrink the policy's step whenever clipping is active (and a large
      policy gradient the heads'). False: one norm over all parameters. The optimizer state
      is the same either way, so a run resumes under both.
    eagle3_dir: with an EAGLE-3 head ("eagle3", "group+eagle3", "history+eagle3"), one in
      the public layout to start from (`specjax train-drafter` writes one); None distils one
      from the warm-started policy.
    draft_vocab_size: draft vocabulary of a distilled EAGLE-3 head (None: the whole
      vocabulary).
    distill_steps: training steps of a distilled EAGLE-3 head.
    distill_prompts: how many train prompts the policy answers for a distilled head (a seeded
      sample of them when the task has more); None: every one. A real dataset (GSM8K's 7,473
      questions) needs no more than the steps x batch sequences the head trains on, and each
      answer costs a rollout's decoding.
    distill_task: distil the head on this task's prompts instead of the run's (same
      tokenizer): a head that starts on another text distribution than the RL task, to
      measure what online training recovers.
    checkpoint: with a draft model ("draft-model", "group+draft-model",
      "history+draft-model"), its HF checkpoint directory (a smaller model of the policy's
      tokenizer, e.g. a 0.6B drafting for a 4-8B).
    draft_model_learning_rate: with a draft model (the names above), distil it from the
      policy online at this Adam rate (a fine-tuning rate: 1e-5 .. 1e-6; its loss is the KL
      divergence from the policy's next-token distributions, times `loss_weight`); 0 keeps
      it frozen. The trained draft model is saved as
      `run_dir/draft_model` at the end.
    history_slots, history_per_prompt, history_recent: with a history drafter ("history",
      "history+mtp"), the bank the train state keeps: prompts (a hashed slot each; a prompt
      evicts the one its slot held), the latest answers kept per prompt, and the latest
      answers of any prompt (`specjax.decoding.HistoryBank`). Set slots to at least the
      training prompts, or prompts that come back may find their slot taken.
  """

  name: str = "mtp"
  loss_weight: float = 1.0
  learning_rate: float = 1e-3
  ttt_steps: int = 3
  clip_heads_separately: bool = True
  eagle3_dir: str | None = None
  draft_vocab_size: int | None = None
  distill_steps: int = 300
  distill_prompts: int | None = None
  distill_task: ArithmeticTask | None = None
  checkpoint: str | None = None
  draft_model_learning_rate: float = 0.0
  history_slots: int = 4096
  history_per_prompt: int = 8
  history_recent: int = 8

  def __post_init__(self):
    check_drafter_name(self.name)
    require_ints(self, ("history_slots", "history_per_prompt"), 1, "drafter.")
    require_ints(self, ("history_recent",), 0, "drafter.")
    usable = [n for n in drafter_names() if weights_of(n) or not needs_checkpoint(n)]
    require_field(self, "name", self.name in usable,
                  f"allowed one of {', '.join(usable)} (a GRPO run loads no other drafter's "
                  "checkpoint)", "drafter.")
    require_field(self, "checkpoint",
                  (self.checkpoint is not None) == (self.weights == DRAFT_MODEL),
                  f"give it exactly with name {names_with(DRAFT_MODEL)} (the draft model's HF "
                  "checkpoint directory)", "drafter.")
    require_reals(self, ("loss_weight", "draft_model_learning_rate"), positive=False,
                  prefix="drafter.")
    require_field(self, "draft_model_learning_rate",
                  not self.draft_model_learning_rate or self.weights == DRAFT_MODEL,
                  f"trains an external draft model: needs name {names_with(DRAFT_MODEL)} (an "
                  "EAGLE-3 head trains at drafter.learning_rate)",
                  "drafter.")
    require_reals(self, ("learning_rate",), positive=True, prefix="drafter.")
    require_ints(self, ("ttt_steps", "distill_steps"), 1, "drafter.")
    require_field(self, "clip_heads_separately", isinstance(self.clip_heads_separately, bool),
                  "must be True or False", "drafter.")
    prompts = self.distill_prompts
    require_field(self, "distill_prompts", prompts is None or (is_plain_int(prompts)
                                                                and prompts >= 1),
                  "must be None (every train prompt) or an int >= 1", "drafter.")
    vocab = self.draft_vocab_size
    require_field(self, "draft_vocab_size", vocab is None or (is_plain_int(vocab) and vocab >= 1),
                  "must be None (the whole vocabulary) or an int >= 1", "drafter.")

  @property
  def weights(self) -> str | None:
    """The drafter with weights of its own this one drafts with: "eagle3", "draft-model"
    (alone or behind group or history drafts), or None."""
    return weights_of(self.name)


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """How rollouts and updates overlap: on-policy, one step off-policy, or on devices of their
  own.

  Attributes:
    async_mode: one-step off-policy GRPO: each step's update trains on the rollouts of the
      step before, which the fused step generates beside it.
    rollout_devices: 0: rollouts and updates share every device, one fused program per
      step. N >= 1 (with `async_mode`, one process): disaggregated async
      (`specjax.rl.DisaggregatedAsync`): the first N devices roll out, the others (the
      `mesh`) train, and the two programs run side by side.
    policy_lag: with `rollout_devices`, how many updates behind the weights that generated a
      batch are when it is trained on (1: one-step off-policy, as the fused async step; k:
      the weight transfer hides behind k - 1 steps; the rollout devices hold k + 1 copies
      of the weights at the peak). A run resumed from a checkpoint rolls out its first k - 1
      steps with the checkpoint's weights: the versions in flight are not saved.
  """

  async_mode: bool = False
  rollout_devices: int = 0
  policy_lag: int = 1

  def __post_init__(self):
    require_field(self, "async_mode", isinstance(self.async_mode, bool),
                  "must be True or False", "pipeline.")
    require_ints(self, ("rollout_devices",), 0, "pipeline.")
    require_ints(self, ("policy_lag",), 1, "pipeline.")
    require_field(self, "rollout_devices", not self.rollout_devices or self.async_mode,
                  "needs async_mode=True (disaggregated rollouts train one step or more "
                  "behind; 0 runs rollouts and updates on the same devices)", "pipeline.")
    require_field(self, "policy_lag", self.policy_lag == 1 or self.rollout_devices > 0,
                  "needs rollout_devices >= 1 (the fused async step is one step off-policy)",
                  "pipeline.")


@dataclasses.dataclass(frozen=True)
class RolloutEvaluation(Evaluation):
  """The held-out greedy evaluation before and after RL, and the rollout speedup measurement.

  Attributes:
    speedup_seconds: each arm of the rollout speedup measurement is timed for at least this
      long in all (more calls than `speedup_repeats` when calls are short, whose median
      moves on a shared machine); 0: exactly `speedup_repeats` calls.
    arms_every: every this many steps, also time one call of each rollout arm (plain,
      speculative, and plain without compaction when the rollout compacts) on the current
      policy and the first batch, logged as `rollout_s_<arm>` and plotted in `curves.png`:
      what speculation and compaction buy as the policy trains. 0: only after training.
    arm_drafters: drafters whose acceptance is measured along training, every `arms_every`
      steps: each drafts a fixed chain of the rollout's depth on the first batch, sampled as
      the rollout is, from the train state (the policy's heads, the history bank), logged as
      `arm_acceptance_<name>` (tokens per row-round, all rounds) and
      `arm_tail_acceptance_<name>` (the longest quarter of the rows: those the tail rounds
      run). Whether speculation would pay, and with which drafter, even where the adaptive
      policy decodes plainly. Drafters with weights of their own are not measured here; a
      history drafter needs the run's own drafter to keep a bank (`drafter.name` history or
      history+mtp).
  """

  speedup_seconds: float = 2.0
  arms_every: int = 0
  arm_drafters: tuple[str, ...] = ()

  def __post_init__(self):
    super().__post_init__()
    require_reals(self, ("speedup_seconds",), positive=False, prefix="eval.")
    require_ints(self, ("arms_every",), 0, "eval.")
    if isinstance(self.arm_drafters, (list, str)):  # JSON and tyro give lists; one name
      names = [self.arm_drafters] if isinstance(self.arm_drafters, str) else self.arm_drafters
      object.__setattr__(self, "arm_drafters", tuple(names))
    require_field(self, "arm_drafters", isinstance(self.arm_drafters, tuple)
                  and len(set(self.arm_drafters)) == len(self.arm_drafters),
                  "must be a tuple of distinct drafter names", "eval.")
    for name in self.arm_drafters:
      check_drafter_name(name, "eval.arm_drafters")
      require_field(self, "arm_drafters", name != "none" and not needs_checkpoint(name),
                    f"{name!r} cannot be measured along training: allowed drafters without "
                    "weights of their own, e.g. mtp, group, history, history+mtp", "eval.")


# The built-in arithmetic policy (what a run trains from scratch without `policy_dir`).
DEFAULT_MODEL = ModelConfig(vocab_size=17, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                            head_dim=32, mlp_dim=256, num_mtp_modules=2, max_position=64)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Everything of one run; every field can be overridden on the command line
  (`--steps 60`, `--rollout.speculation adaptive`, `--drafter.name eagle3`).

  Attributes:
    run_dir: checkpoints, metrics.jsonl, TensorBoard events and plots go here.
    seed: seeds initialisation, data order and sampling.
    task: prompts, held-out split and reward: the built-in `ArithmeticTask` (its reward in JAX,
      inside the fused step), or a task rewarded in Python — `DatasetTask` (the user's data
      and reward functions), `GSM8KTask`, `CustomTask` —, whose step runs the rollout and
      the update as programs with the rewards on the host (each process scoring the rows of
      its own prompts; in async mode in the background while the devices run the update and
      the next rollout; disaggregated, between the meshes while both run).
    model: the policy's architecture (vocab_size at least the task tokenizer's); with
      `policy_dir`, read from the checkpoint (leave it at its default).
    policy_dir: an HF checkpoint directory (Llama 3 / Qwen2 / Qwen3 `config.json` and
      safetensors) the policy starts from instead of random weights; the warm start, if
      `warm_start.steps` > 0, continues from it. None: a policy of `model`'s shape trained
      from scratch by the warm start.
    policy_dtype: the dtype `policy_dir`'s parameters are loaded and trained in: "float32",
      "bfloat16" (half the memory; the optimizer then keeps float32 master weights,
      `optim.master_weights`) or "auto" (the checkpoint's own).
    grpo: GRPO hyper-parameters.
    steps: GRPO steps.
    rollout: how each step samples (`RolloutSettings`).
    drafter: the rollout's drafter and its online training (`Drafting`).
    optim: the GRPO optimizer (`Optimization`; the trunk and the heads clipped apart with
      `drafter.clip_heads_separately`).
    warm_start: the supervised warm start before RL (`WarmStart`).
    eval: the held-out evaluation and the speedup measurement (`RolloutEvaluation`).
    mesh: the device mesh of the train state and step (`data`, `fsdp`, `tensor`, `expert`;
      one of them -1 for all the devices the others leave). The default splits the prompts
      of each step over every device of every process (data parallelism); `fsdp` also splits
      parameters and optimizer moments, `tensor` heads, MLP units and vocabulary, `expert`
      a mixture-of-experts policy's experts (and the prompts). A prompt batch that the
      batch axes do not divide is replicated instead.
    pipeline: async (off-policy) and disaggregated rollouts (`Pipeline`).
    checkpoint: checkpoint frequency and retention (`Checkpointing`).
    log: metrics backends beside metrics.jsonl and TensorBoard (`Logging`: Weights & Biases).
    lora: low-rank adapters on the policy's projections (`LoraConfig`: `--lora.rank 16`),
      trained with the trunk frozen, which is also the KL reference: a few per cent of the
      optimizer memory of full-parameter training. Rank 0 (the default) trains every
      parameter. Rollouts, evaluations and exports use the merged policy.
    rewards: how a `DatasetTask`'s Python reward functions are called (`RewardWorkers`:
      `--rewards.workers 8 --rewards.kind process --rewards.timeout-s 10`): over worker
      threads or processes, with a timeout per call and what a timed-out row gets.
    accept_changed_inputs: resume although the task's data or rewards changed since the run
      started (`run_inputs`: refused by default, naming the change); the new ones are then
      recorded.
  """

  run_dir: str = "runs/arithmetic"
  seed: int = 0
  # One parser per task kind, from the config's own task (no subcommands): a DatasetTask's
  # rewards and tokenizer come from the config file, its columns from flags.
  task: Annotated[ArithmeticTask | DatasetTask | GSM8KTask | CustomTask,
                  tyro.conf.AvoidSubcommands] = ArithmeticTask()
  model: ModelConfig = DEFAULT_MODEL
  policy_dir: str | None = None
  policy_dtype: Literal["float32", "bfloat16", "auto"] = "float32"
  grpo: GRPOConfig = GRPOConfig(group_size=8)
  steps: int = 100
  rollout: RolloutSettings = RolloutSettings()
  drafter: Drafting = Drafting()
  optim: Optimization = Optimization()
  warm_start: WarmStart = WarmStart()
  eval: RolloutEvaluation = RolloutEvaluation()
  mesh: MeshConfig = MeshConfig()
  pipeline: Pipeline = Pipeline()
  checkpoint: Checkpointing = Checkpointing()
  log: Logging = Logging()
  lora: LoraConfig = LoraConfig()
  rewards: RewardWorkers = RewardWorkers()
  accept_changed_inputs: bool = False

  def __post_init__(self):
    for name, kind in _GROUPS.items():
      require_field(self, name, isinstance(getattr(self, name), kind),
                    f"must be a {kind.__name__}(...)")
    require_ints(self, ("steps",), 1)
    require_ints(self, ("seed",), 0)
    require_field(self, "accept_changed_inputs", isinstance(self.accept_changed_inputs, bool),
                  "must be True or False")
    rows = self.rollout.prompts_per_step * self.grpo.group_size
    require_field(self.grpo, "num_minibatches", rows % self.grpo.num_minibatches == 0,
                  f"must divide a step's rollout rows, rollout.prompts_per_step x "
                  f"grpo.group_size = {self.rollout.prompts_per_step} x "
                  f"{self.grpo.group_size} = {rows}", "grpo.")
    if self.policy_dir is not None:  # a Hub id becomes its local snapshot (specjax.hub)
      object.__setattr__(self, "policy_dir", str(local_checkpoint(self.policy_dir,
                                                                  "policy_dir")))
      self._take_policy_model()
      self._check_policy_tokenizer()
    if self.drafter.weights == DRAFT_MODEL and self.drafter.checkpoint is not None:
      local = str(local_checkpoint(self.drafter.checkpoint, "drafter.checkpoint"))
      object.__setattr__(self, "drafter", dataclasses.replace(self.drafter, checkpoint=local))
    self._check_reward_workers()
    if isinstance(self.task, DatasetTask) and self.task.reference_column is None:
      require_field(self.warm_start, "steps", self.warm_start.steps == 0,
                    f"the supervised warm start learns references, and task {self.task.name!r} "
                    "has none (set task.reference_column, or warm_start.steps=0 to start RL "
                    "from policy_dir's weights)", "warm_start.")
    expert = self.mesh.expert
    require_field(self.mesh, "expert", expert == 1 or (self.model.is_moe and (
        expert == -1 or self.model.n_experts % expert == 0)),
                  f"splits a mixture-of-experts model's experts, and the model has "
                  f"{self.model.n_experts} (allowed: 1, or a divisor of model.n_experts = "
                  f"{self.model.n_experts})" if self.model.is_moe else
                  "splits a mixture-of-experts model's experts, and this model is dense "
                  "(n_experts=0): allowed only mesh.expert=1", "mesh.")
    vocab = self.task.tokenizer.vocab_size
    require_field(self.model, "vocab_size", self.model.vocab_size >= vocab,
                  f"the task's tokenizer has {vocab} ids, which the model must embed "
                  f"(allowed: vocab_size >= {vocab})", "model.")
    distill = self.drafter.distill_task
    if distill is not None:
      require_field(self.drafter, "distill_task", distill.tokenizer.vocab_size == vocab,
                    f"its tokenizer has {distill.tokenizer.vocab_size} ids; it must share the "
                    f"task's ({vocab})", "drafter.")
    carry = self.rollout.acceptance_carry
    require_field(self.rollout, "acceptance_carry", not carry or self._adaptive_with_drafter,
                  "needs rollout.speculation='adaptive' and a drafter (only the adaptive "
                  "policy keeps acceptance counts); leave it None or 0 otherwise", "rollout.")
    heads = self.model.num_mtp_modules or self.model.num_medusa_heads
    require_field(self.lora, "rank", not (self.lora.enabled and heads
                                          and self.drafter.loss_weight),
                  "with adapters the policy's own parameters are frozen, its MTP / Medusa "
                  "heads too, so they cannot be trained online: set drafter.loss_weight=0 (the "
                  "heads draft as they are), or draft with drafter.name='eagle3' or "
                  f"'{DRAFT_MODEL}' on a model without heads", "lora.")
    require_field(self.rollout, "tree_widths",
                  bool(self.rollout.tree_widths) or self.drafter.name == "none",
                  f"drafter {self.drafter.name!r} drafts a tree of at least one depth, e.g. "
                  "(1, 1): a chain of 2 (for plain rollouts set drafter.name 'none')",
                  "rollout.")
    if self.eval.arm_drafters:
      self._check_arm_drafters()
    # A tree the drafter cannot draft fails here, not at the first rollout after warm start.
    if self.drafter.weights == DRAFT_MODEL:
      self._check_draft_model()
    elif self.drafter.weights == EAGLE3:
      self.eagle3_config().check_target(self.model)
    elif self.drafter.name != "none":
      try:
        build_drafter(self.drafter.name, DraftSource(self.model))[0].validate(self.model,
                                                                               self.tree)
      except ConfigError as err:
        if self.policy_dir is None:
          raise
        raise ConfigError(f"drafter.name={self.drafter.name!r} is invalid with policy_dir="
                          f"{self.policy_dir!r}: {err}. A checkpoint without draft heads "
                          "drafts with 'ngram', 'eagle3' (a head distilled from the policy, "
                          "or drafter.eagle3_dir) or 'none'") from None

  def _check_arm_drafters(self) -> None:
    require_field(self.eval, "arm_drafters", self.eval.arms_every > 0,
                  "are measured every eval.arms_every steps: set eval.arms_every >= 1",
                  "eval.")
    own = self.drafter.name
    keeps_bank = own.startswith("history") if weights_of(own) else (
        own != "none" and history_drafter(build_drafter(own, DraftSource(self.model))[0])
        is not None)
    for name in self.eval.arm_drafters:
      drafter = build_drafter(name, DraftSource(self.model))[0]
      require_field(self.eval, "arm_drafters",
                    history_drafter(drafter) is None or keeps_bank,
                    f"{name!r} drafts from the run's history bank, which only a run whose "
                    "own drafter reads it keeps: set drafter.name 'history' or 'history+mtp'",
                    "eval.")
      try:
        drafter.validate(self.model, self.tree)
      except ConfigError as err:
        raise ConfigError(f"eval.arm_drafters: {name!r} cannot draft this run's tree: "
                          f"{err}") from None

  def _take_policy_model(self) -> None:
    """`model` from `policy_dir`'s config.json (the default `model` replaced; another one is
    a conflict)."""
    from specjax.models.hf_config import config_from_hf
    path = Path(self.policy_dir) / "config.json"
    require_field(self, "policy_dir", path.is_file(),
                  "no config.json there (expected an HF checkpoint directory: config.json and "
                  "safetensors)")
    record = read_object(path, ConfigError, f"policy_dir={self.policy_dir!r} needs an HF "
                         "checkpoint's config.json")
    require_field(self, "policy_dtype", self.policy_dtype in ("float32", "bfloat16", "auto"),
                  "allowed 'float32', 'bfloat16' or 'auto' (the checkpoint's)")
    model = config_from_hf(record, param_dtype=self.policy_dtype)
    # A config read back (a resume, flags over a config file) already holds the checkpoint's
    # model, perhaps at another policy_dtype; how it runs (remat, attention) stays the user's.
    runtime = {f: getattr(self.model, f) for f in RUNTIME_FIELDS}
    model = dataclasses.replace(model, **runtime)
    same = dataclasses.replace(self.model, dtype=model.dtype, param_dtype=model.param_dtype)
    default = dataclasses.replace(DEFAULT_MODEL, **runtime)
    require_field(self, "model", self.model == default or same == model,
                  f"differs from policy_dir's model ({path}); leave model at its default "
                  "(but for how it runs: " + ", ".join(RUNTIME_FIELDS) + ") when the policy "
                  "comes from a checkpoint")
    object.__setattr__(self, "model", model)

  def draft_model_config(self) -> ModelConfig:
    """The architecture of `drafter.checkpoint`'s draft model (its config.json)."""
    from specjax.models.hf_config import config_from_hf
    path = Path(self.drafter.checkpoint) / "config.json"
    require_field(self.drafter, "checkpoint", path.is_file(), "no config.json there (expected "
                  "the draft model's HF checkpoint directory)", "drafter.")
    record = read_object(path, ConfigError, f"drafter.checkpoint={self.drafter.checkpoint!r} "
                         "needs the draft model's HF config.json")
    try:
      return config_from_hf(record)
    except ValueError as err:
      raise ConfigError(f"drafter.checkpoint={self.drafter.checkpoint!r}: {path} is not a "
                        f"usable config ({err})") from None

  def _check_draft_model(self) -> None:
    """The draft model drafts for this policy: same vocabulary, and the same tokenizer where
    both directories hold one."""
    drafter = DraftModelDrafter(self.draft_model_config())
    try:
      drafter.validate(self.model, self.tree)
    except ConfigError as err:
      raise ConfigError(f"drafter.checkpoint={self.drafter.checkpoint!r} is invalid: {err}") \
          from None
    theirs = Path(self.drafter.checkpoint) / "tokenizer.json"
    if isinstance(self.task.tokenizer, HFTokenizer) and theirs.is_file():
      vocabulary = read_table(theirs).get_vocab(with_added_tokens=True)
      if vocabulary != self.task.tokenizer.tokenizer.get_vocab(with_added_tokens=True):
        raise ConfigError(f"drafter.checkpoint={self.drafter.checkpoint!r} is invalid: its "
                          "tokenizer differs from the policy's (another vocabulary or other "
                          "ids); a draft model must share the policy's tokenizer")

  def _check_policy_tokenizer(self) -> None:
    """Where `policy_dir` holds a tokenizer, every id of the task's must mean the same token
    there (`different_ids`): the policy reads the ids it was trained on."""
    ours = self.task.tokenizer
    path = Path(self.policy_dir) / "tokenizer.json"
    if not path.is_file() or Path(getattr(ours, "source", None) or "") == Path(self.policy_dir):
      return
    why = different_ids(ours, path)
    if why is not None:
      raise ConfigError(f"policy_dir={self.policy_dir!r} is invalid for this task: its "
                        f"tokenizer and the task's {type(ours).__name__} differ ({why}); the "
                        "policy reads the ids it was trained on: build the task with "
                        "HFTokenizer.from_dir(policy_dir)")

  def eagle3_config(self) -> Eagle3Config:
    """The EAGLE-3 head's architecture: `drafter.eagle3_dir`'s, or one sized for `model`."""
    if self.drafter.eagle3_dir is not None:
      path = Path(self.drafter.eagle3_dir) / "config.json"
      require_field(self.drafter, "eagle3_dir", path.is_file(), "no config.json there "
                    "(expected an EAGLE-3 head saved by save_eagle3 / train-drafter)", "drafter.")
      record = read_object(path, ConfigError, f"drafter.eagle3_dir={self.drafter.eagle3_dir!r} "
                           "needs the head's config.json (save_eagle3, train-drafter)")
      try:
        return eagle3_config_from_hf(record, self.model)
      except ConfigError as err:
        raise ConfigError(f"drafter.eagle3_dir={self.drafter.eagle3_dir!r}: {path}: "
                          f"{err}") from None
    return Eagle3Config.for_target(self.model, draft_vocab_size=self.drafter.draft_vocab_size)

  def _check_reward_workers(self) -> None:
    """`rewards` applies to a `DatasetTask`'s Python functions (picklable for processes)."""
    default = RewardWorkers()
    changed = ", ".join(f"rewards.{f.name}={getattr(self.rewards, f.name)!r}"
                        for f in dataclasses.fields(default)
                        if getattr(self.rewards, f.name) != getattr(default, f.name))
    if not changed:
      return
    if self.task.reward_in_jax:
      raise ConfigError(f"{changed} is invalid: task {self.task.name!r} is "
                        "rewarded in JAX, inside the compiled step; reward workers call Python "
                        "reward functions (leave rewards at its defaults)")
    if not isinstance(self.task, DatasetTask):
      raise ConfigError(f"{changed} is invalid: task {self.task.name!r} "
                        f"({type(self.task).__name__}) scores with its own reward, called "
                        "directly; reward workers call a DatasetTask's reward functions "
                        "(e.g. DatasetTask with math_answer_reward())")
    self.rewards.check_functions([r for r in self.task.rewards if not isinstance(r, JaxReward)])

  @property
  def _adaptive_with_drafter(self) -> bool:
    return self.rollout.speculation == "adaptive" and self.drafter.name != "none"

  @property
  def carry(self) -> float:
    """`rollout.acceptance_carry` as the rollouts use it (None resolved)."""
    if self.rollout.acceptance_carry is not None:
      return float(self.rollout.acceptance_carry)
    return DEFAULT_ACCEPTANCE_CARRY if self._adaptive_with_drafter else 0.0

  @property
  def tree(self) -> DraftTree:
    return DraftTree.from_widths(self.rollout.tree_widths)

  def adaptive(self, costs: CostTable | None = None) -> Adaptive:
    """The adaptive menu: plain decoding, chains of 1 .. depth drafts, and the tree."""
    return Adaptive.up_to(self.tree, costs)

  def train_config(self, drafter: str | None = None,
                   costs: CostTable | None = None) -> TrainConfig:
    """The train step's configuration; adaptive speculation needs its `costs`
    (`rollout_costs`)."""
    drafter = self.drafter.name if drafter is None else drafter
    weights = weights_of(drafter)
    if weights is not None:
      # An EAGLE-3 head comes from the run (eagle3_dir or distilled), a draft model's weights
      # are loaded when the run starts: neither from the registry's checkpoint.
      draft = (Eagle3Drafter(self.eagle3_config()) if weights == EAGLE3 else
               DraftModelDrafter(self.draft_model_config()))
      if drafter != weights:  # "group+eagle3", "history+draft-model", ...
        front = drafter.split("+")[0]
        draft = group_in_front(draft) if front == "group" else history_in_front(draft)
    else:
      draft = build_drafter(drafter, DraftSource(self.model))[0]
    draft = with_bank_sizes(with_group_size(draft, self.grpo.group_size),
                            slots=self.drafter.history_slots,
                            per_prompt=self.drafter.history_per_prompt,
                            recent=self.drafter.history_recent)
    tree, speculation = None, None
    if draft is not None and self.rollout.speculation == "adaptive":
      speculation = self.adaptive(costs)
    elif draft is not None:
      tree = self.tree
    rollout = RolloutConfig(max_new_tokens=self.rollout.max_new_tokens, eos_id=self.eos_ids,
                            sampling=SamplingConfig(self.rollout.temperature), drafter=draft,
                            tree=tree, speculation=speculation,
                            acceptance_carry=self.carry if speculation else 0.0,
                            compaction=self.rollout.compaction,
                            success_reward=getattr(self.task, "success_reward", 1.0))
    return TrainConfig(model=self.model, grpo=self.grpo, rollout=rollout,
                       drafter_training=DrafterTraining(
                           self.drafter.loss_weight, self.drafter.learning_rate,
                           self.drafter.ttt_steps, self.drafter.draft_model_learning_rate),
                       async_mode=self.pipeline.async_mode,
                       lora=self.lora if self.lora.enabled else None)

  @property
  def eos_ids(self) -> int | tuple[int, ...]:
    """Every id that ends a response: a chat tokenizer lists several (`HFTokenizer.eos_ids`),
    and rollouts and evaluations stop on any of them."""
    ends = tuple(getattr(self.task.tokenizer, "eos_ids", ()) or ())
    return ends if len(ends) > 1 else self.task.tokenizer.eos_id

  def initial_acceptance(self) -> AcceptanceCounts | None:
    """The train state's acceptance counts before the first rollout (None: not carried)."""
    if not self.carry:
      return None
    menu = self.adaptive()
    return AcceptanceCounts.zeros(len(menu.menu), max(menu.depth, 1))

  def fixed_tree(self) -> ExperimentConfig:
    """This config with every round drafting `rollout.tree_widths` (the train state's
    structure, acceptance probes)."""
    return dataclasses.replace(self, rollout=dataclasses.replace(self.rollout,
                                                                 speculation="fixed"))

  def optimizer(self) -> optax.GradientTransformation:
    """The GRPO optimizer of the policy and its MTP / Medusa heads: gradient clipping to
    `optim.max_grad_norm`, then Adam on `optim`'s schedule over `steps`.

    With `drafter.clip_heads_separately` the trunk and the heads are clipped apart
    (`_clip_trunk_and_heads`), so the drafter loss, which reaches only the heads, cannot
    scale the policy's step; otherwise one global norm covers every parameter. Parameters
    below float32 get float32 master weights (`optim.master_weights`). With LoRA the optimizer
    trains the adapters (float32, no heads): one global norm, no master copy.
    """
    norm = self.optim.max_grad_norm
    clip = (_clip_trunk_and_heads(norm)
            if self.drafter.clip_heads_separately and not self.lora.enabled
            else optax.clip_by_global_norm(norm))
    optimizer = optax.chain(clip, self.optim.adam(self.steps))
    if (self.optim.master_weights and self.model.param_dtype != "float32"
        and not self.lora.enabled):
      return float32_master(optimizer)
    return optimizer


def _clip_trunk_and_heads(max_norm: float) -> optax.GradientTransformation:
  """`optax.clip_by_global_norm(max_norm)` applied to the trunk and to the draft heads
  (`DRAFT_HEAD_KEYS`) apart: each part is scaled by `max_norm / its own norm` when that norm is
  larger, so neither part's gradient changes the other's update.

  Stateless (`EmptyState`) like the shared clip, rather than an `optax.multi_transform`,
  whose state has another structure: a checkpoint of a run started with either clipping
  restores into an optimizer with the other.
  """
  clip = optax.clip_by_global_norm(max_norm)

  def update(updates, params=None):
    del params  # clipping reads the gradients only
    parts = ({k: v for k, v in updates.items() if k not in DRAFT_HEAD_KEYS},
             {k: v for k, v in updates.items() if k in DRAFT_HEAD_KEYS})
    clipped = {}
    for part in parts:
      clipped |= clip.update(part, clip.init(part))[0]
    return {k: clipped[k] for k in updates}

  return optax.stateless(update)


_GROUPS = {"rollout": RolloutSettings, "drafter": Drafting, "optim": Optimization,
           "warm_start": WarmStart, "eval": RolloutEvaluation, "mesh": MeshConfig,
           "pipeline": Pipeline, "rewards": RewardWorkers,
           "checkpoint": Checkpointing, "log": Logging, "lora": LoraConfig}
