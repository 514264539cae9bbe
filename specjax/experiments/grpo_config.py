"""`ExperimentConfig`: everything a GRPO run on a built-in task is made of, validated up front.

The task, the policy's shape, GRPO's settings, the rollout's drafter and speculation policy,
the warm start, the optimizer (with the trunk and the draft heads clipped together or apart),
the mesh and the run directory; `specjax train` fills it from a config file and flags. Every
field is checked when the config is built, so a run that cannot work fails before any warm
start or compilation. `specjax.experiments.grpo.run` executes it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Literal

import optax

from specjax.checks import is_plain_int
from specjax.decoding import (AcceptanceCounts, Adaptive, CostTable, DraftSource, DraftTree,
                              Eagle3Drafter, SamplingConfig, build_drafter, check_drafter_name,
                              drafter_names, needs_checkpoint)
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.eagle3 import Eagle3Config
from specjax.models.eagle3_io import eagle3_config_from_hf
from specjax.models.heads import DRAFT_HEAD_KEYS
from specjax.rl.losses import GRPOConfig
from specjax.rl.tasks import ArithmeticTask
from specjax.rl.trainer import RolloutConfig, TrainConfig
from specjax.sharding import MeshConfig

# Half of each rollout's acceptance counts start the next: the policy then chooses its trees
# from the first round on instead of from its prior (benchmarks/rl_step.py, EAGLE-3, adaptive:
# rollout 1.16x plain without carrying, 1.39x with 0.5), yet still follows a drafter whose
# acceptance moves with the policy within a few rollouts.
DEFAULT_ACCEPTANCE_CARRY = 0.5


# Fields a resumed run may change: how long it runs, how often it checkpoints, how long it
# measures, and the mesh (checkpoints restore onto any mesh). Every other field defines the
# policy, its task or its training, and a change would silently alter the run.
RESUMABLE_FIELDS = frozenset({"run_dir", "steps", "checkpoint_every", "max_checkpoints",
                              "speedup_repeats", "speedup_seconds", "mesh"})


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Everything of one run; every field can be overridden on the command line.

  Attributes:
    run_dir: checkpoints, metrics.jsonl, TensorBoard events and plots go here.
    seed: seeds initialisation, data order and sampling.
    task: the arithmetic task (prompts, held-out split, JAX reward).
    model: the policy's architecture (vocab_size at least the task tokenizer's).
    grpo: GRPO hyper-parameters.
    max_new_tokens: response budget T.
    temperature: rollout sampling temperature.
    drafter: draft source of the speculative rollouts, a registered name
      (`specjax.decoding.drafter_names`; "none": plain decoding; not "draft-model", whose
      weights a run does not load).
    tree_widths: draft tree, children per node at each depth.
    speculation: "fixed": every round drafts the `tree_widths` tree; "adaptive": each round
      runs plain decoding, a chain of 1 .. depth drafts, or that tree, whichever is expected
      to produce the most tokens per second (`specjax.decoding.Adaptive`), with costs that
      `calibrate` measures on this machine at the rollout's shapes before training (cached
      on disk). Speculation then never costs more than it brings.
    acceptance_carry: with adaptive speculation, the weight in [0, 1] of one rollout's
      acceptance counts in the next (`RolloutConfig.acceptance_carry`; kept in the train
      state and its checkpoints). 0: each rollout starts from the policy's prior. None (the
      default): `DEFAULT_ACCEPTANCE_CARRY` with adaptive speculation and a drafter, else 0.
    eagle3_dir: with drafter "eagle3", an EAGLE-3 head in the public layout to start from
      (`specjax train-drafter` writes one); None distils one from the warm-started policy.
    eagle3_draft_vocab: draft vocabulary of a distilled head (None: the whole vocabulary).
    eagle3_steps: training steps of a distilled head.
    eagle3_distill_task: distil the head on this task's prompts instead of `task`'s (same
      tokenizer): a head that starts on a different text distribution than the RL task, to
      measure what online training recovers.
    drafter_learning_rate: learning rate of the EAGLE-3 head trained online.
    eagle3_ttt_steps: training-time-test steps of the online EAGLE-3 loss: how many of its
      own drafts deep the head learns to draft on (`TrainConfig.drafter_ttt_steps`).
    steps: GRPO steps.
    prompts_per_step: prompts per step (each sampled group_size times).
    learning_rate: GRPO learning rate (constant after warmup).
    warmup_steps: linear warmup of the GRPO learning rate.
    max_grad_norm: gradient clipping: the largest global norm of the gradient (of the
      trunk's and of the heads' each, with `clip_heads_separately`).
    clip_heads_separately: clip the trunk's gradient and the MTP / Medusa heads' gradient
      to `max_grad_norm` each by a norm of its own. The heads share the policy's optimizer
      and their drafter loss is detached from the trunk, but under one global norm a large
      head gradient would still shrink the policy's step whenever clipping is active (and a
      large policy gradient the heads'). False: one norm over all parameters, the clipping
      of runs before this field existed. The optimizer state is the same either way, so a
      run resumes under both.
    drafter_loss_weight: online drafter training on rollouts (0: off).
    async_mode: one-step off-policy GRPO.
    rollout_devices: 0: rollouts and updates share every device, one fused program per
      step. N >= 1 (with `async_mode`, one process): disaggregated async
      (`specjax.rl.DisaggregatedAsync`): the first N devices roll out, the others (the
      `mesh`) train, and the two programs run side by side.
    policy_lag: with `rollout_devices`, how many updates behind the weights that generated a
      batch are when it is trained on (1: one-step off-policy, as the fused async step; k:
      the weight transfer hides behind k - 1 steps; the rollout devices hold k + 1 copies
      of the weights at the peak). A run resumed from a checkpoint rolls out its first k - 1
      steps with the checkpoint's weights: the versions in flight are not saved.
    sft_steps: supervised warm-start steps (0: start RL from random weights).
    sft_batch: warm-start batch size.
    sft_learning_rate: warm-start learning rate.
    sft_eos_fraction: fraction of warm-start examples whose answer ends with EOS; the others
      run on into the next problem, as text concatenated without separators does. Below 1
      the warm-started policy often fails to stop, which the reward (answer, then EOS)
      penalises and GRPO fixes.
    checkpoint_every: steps between checkpoints.
    max_checkpoints: checkpoints kept (>= 1: the newest is what a resumed run starts from).
    eval_prompts: held-out prompts evaluated (greedy) before and after RL.
    speedup_repeats: timed calls of each arm of the rollout speedup measurement (median),
      at least.
    speedup_seconds: each arm of the rollout speedup measurement is timed for at least this
      long in all (more calls than `speedup_repeats` when calls are short: the median of a
      few 50 ms calls on a shared machine moves by 5%); 0: exactly `speedup_repeats` calls.
    mesh: the device mesh of the train state and step (`data`, `fsdp`, `tensor`; one of them
      -1 for all the devices the others leave). The default splits the prompts of each step
      over every device of every process (data parallelism); `fsdp` also splits parameters
      and optimizer moments, `tensor` heads, MLP units and vocabulary. A prompt batch that
      the batch axes do not divide is replicated instead.
  """

  run_dir: str = "runs/arithmetic"
  seed: int = 0
  task: ArithmeticTask = ArithmeticTask()
  model: ModelConfig = ModelConfig(vocab_size=17, d_model=128, n_layers=2, n_heads=4,
                                   n_kv_heads=2, head_dim=32, mlp_dim=256, num_mtp_modules=2,
                                   max_position=64)
  grpo: GRPOConfig = GRPOConfig(group_size=8)
  max_new_tokens: int = 6
  temperature: float = 1.0
  drafter: str = "mtp"
  tree_widths: tuple[int, ...] = (1, 1)
  speculation: Literal["fixed", "adaptive"] = "fixed"
  acceptance_carry: float | None = None
  eagle3_dir: str | None = None
  eagle3_draft_vocab: int | None = None
  eagle3_steps: int = 300
  eagle3_distill_task: ArithmeticTask | None = None
  drafter_learning_rate: float = 1e-3
  eagle3_ttt_steps: int = 3
  steps: int = 100
  prompts_per_step: int = 16
  learning_rate: float = 1e-4
  warmup_steps: int = 10
  max_grad_norm: float = 1.0
  clip_heads_separately: bool = True
  drafter_loss_weight: float = 1.0
  async_mode: bool = False
  rollout_devices: int = 0
  policy_lag: int = 1
  sft_steps: int = 200
  sft_batch: int = 64
  sft_learning_rate: float = 3e-3
  sft_eos_fraction: float = 1.0
  checkpoint_every: int = 25
  max_checkpoints: int = 2
  eval_prompts: int = 500
  speedup_repeats: int = 9
  speedup_seconds: float = 2.0
  mesh: MeshConfig = MeshConfig()

  def __post_init__(self):
    def require(ok: bool, field: str, allowed: str):
      if not ok:
        raise ConfigError(f"{field}={getattr(self, field)!r} is invalid: {allowed}")

    is_int = is_plain_int

    def is_real(value) -> bool:  # NaN fails `> 0` on its own; inf needs this check
      return is_int(value) or (isinstance(value, float) and math.isfinite(value))

    vocab = self.task.tokenizer.vocab_size
    if self.model.vocab_size < vocab:  # larger is fine: checkpoints pad their vocabularies
      raise ConfigError(f"model.vocab_size={self.model.vocab_size} is invalid: the task's "
                        f"tokenizer has {vocab} ids, which the model must embed (allowed: "
                        f"vocab_size >= {vocab})")
    for name in ("steps", "prompts_per_step", "checkpoint_every", "max_checkpoints",
                 "eval_prompts", "max_new_tokens", "speedup_repeats", "sft_batch",
                 "eagle3_steps", "eagle3_ttt_steps"):
      require(is_int(getattr(self, name)) and getattr(self, name) >= 1, name,
              "must be an int >= 1")
    for name in ("sft_steps", "warmup_steps", "rollout_devices"):
      require(is_int(getattr(self, name)) and getattr(self, name) >= 0, name,
              "must be an int >= 0")
    require(is_int(self.seed) and self.seed >= 0, "seed", "must be an int >= 0")
    require(is_int(self.policy_lag) and self.policy_lag >= 1, "policy_lag",
            "must be an int >= 1")
    require(not self.rollout_devices or self.async_mode, "rollout_devices",
            "needs async_mode=True (disaggregated rollouts train one step or more behind; "
            "0 runs rollouts and updates on the same devices)")
    require(self.policy_lag == 1 or self.rollout_devices > 0, "policy_lag",
            "needs rollout_devices >= 1 (the fused async step is one step off-policy)")
    require(isinstance(self.clip_heads_separately, bool), "clip_heads_separately",
            "must be True or False")
    require(isinstance(self.mesh, MeshConfig), "mesh", "must be a MeshConfig(data=, fsdp=, "
            "tensor=)")
    for name in ("learning_rate", "sft_learning_rate", "drafter_learning_rate",
                 "max_grad_norm"):
      require(is_real(getattr(self, name)) and getattr(self, name) > 0, name,
              "must be a finite number > 0")
    for name in ("temperature", "drafter_loss_weight", "speedup_seconds"):
      require(is_real(getattr(self, name)) and getattr(self, name) >= 0, name,
              "must be a finite number >= 0")
    distill = self.eagle3_distill_task
    if distill is not None and distill.tokenizer.vocab_size != vocab:
      raise ConfigError(f"eagle3_distill_task has a tokenizer of {distill.tokenizer.vocab_size} "
                        f"ids: it must share the task's ({vocab})")
    if not 0 <= self.sft_eos_fraction <= 1:
      raise ConfigError(f"sft_eos_fraction={self.sft_eos_fraction!r} is invalid: must be in "
                        "[0, 1]")
    check_drafter_name(self.drafter)
    usable = [n for n in drafter_names() if n == "eagle3" or not needs_checkpoint(n)]
    # EAGLE-3's head is the run's own (`eagle3_dir` or distilled, see `eagle3_config`); other
    # drafters with weights of their own would need a checkpoint a run does not load.
    require(self.drafter in usable, "drafter",
            f"allowed one of {', '.join(usable)} (a GRPO run loads no draft checkpoint)")
    require(self.speculation in ("fixed", "adaptive"), "speculation",
            "allowed 'fixed' or 'adaptive'")
    carry = self.acceptance_carry
    require(carry is None or (is_real(carry) and 0 <= carry <= 1), "acceptance_carry",
            "must be a number in [0, 1] or None (the default for the speculation chosen)")
    require(not carry or self._adaptive_with_drafter, "acceptance_carry",
            "needs speculation='adaptive' and a drafter (only the adaptive policy keeps "
            "acceptance counts); leave it None or 0 otherwise")
    # A tree the drafter cannot draft fails here, not at the first rollout after warm start.
    if self.drafter not in ("none", "eagle3"):
      build_drafter(self.drafter, DraftSource(self.model))[0].validate(self.model, self.tree)

  def eagle3_config(self) -> Eagle3Config:
    """The EAGLE-3 head's architecture: `eagle3_dir`'s, or one sized for `model`."""
    if self.eagle3_dir is not None:
      path = Path(self.eagle3_dir) / "config.json"
      if not path.is_file():
        raise ConfigError(f"eagle3_dir={self.eagle3_dir!r} is invalid: no config.json there "
                          "(expected an EAGLE-3 head saved by save_eagle3 / train-drafter)")
      return eagle3_config_from_hf(json.loads(path.read_text()), self.model)
    return Eagle3Config.for_target(self.model, draft_vocab_size=self.eagle3_draft_vocab)

  @property
  def _adaptive_with_drafter(self) -> bool:
    return self.speculation == "adaptive" and self.drafter != "none"

  @property
  def carry(self) -> float:
    """`acceptance_carry` as the rollouts use it (None resolved)."""
    if self.acceptance_carry is not None:
      return float(self.acceptance_carry)
    return DEFAULT_ACCEPTANCE_CARRY if self._adaptive_with_drafter else 0.0

  @property
  def tree(self) -> DraftTree:
    return DraftTree.from_widths(self.tree_widths)

  def adaptive(self, costs: CostTable | None = None) -> Adaptive:
    """The adaptive menu: plain decoding, chains of 1 .. depth drafts, and the tree."""
    return Adaptive.up_to(self.tree, costs)

  def train_config(self, drafter: str | None = None,
                   costs: CostTable | None = None) -> TrainConfig:
    """The train step's configuration; adaptive speculation needs its `costs`
    (`rollout_costs`)."""
    drafter = self.drafter if drafter is None else drafter
    if drafter == "eagle3":  # its head comes from the run (eagle3_dir or distilled), not a file
      draft = Eagle3Drafter(self.eagle3_config())
    else:
      draft = build_drafter(drafter, DraftSource(self.model))[0]
    tree, speculation = None, None
    if draft is not None and self.speculation == "adaptive":
      speculation = self.adaptive(costs)
    elif draft is not None:
      tree = self.tree
    rollout = RolloutConfig(max_new_tokens=self.max_new_tokens, eos_id=self.eos_ids,
                            sampling=SamplingConfig(self.temperature), drafter=draft,
                            tree=tree, speculation=speculation,
                            acceptance_carry=self.carry if speculation else 0.0)
    return TrainConfig(model=self.model, grpo=self.grpo, rollout=rollout,
                       drafter_loss_weight=self.drafter_loss_weight,
                       drafter_learning_rate=self.drafter_learning_rate,
                       drafter_ttt_steps=self.eagle3_ttt_steps,
                       async_mode=self.async_mode)

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
    """This config with every round drafting `tree_widths` (the train state's structure,
    acceptance probes)."""
    return dataclasses.replace(self, speculation="fixed")

  def optimizer(self) -> optax.GradientTransformation:
    """The GRPO optimizer of the policy and its MTP / Medusa heads: gradient clipping to
    `max_grad_norm`, then Adam at `learning_rate` after a linear warmup.

    With `clip_heads_separately` the trunk and the heads are clipped apart
    (`_clip_trunk_and_heads`), so the drafter loss, which reaches only the heads, cannot
    scale the policy's step; otherwise one global norm covers every parameter.
    """
    schedule = optax.linear_schedule(0.0, self.learning_rate, max(self.warmup_steps, 1))
    clip = (_clip_trunk_and_heads(self.max_grad_norm) if self.clip_heads_separately
            else optax.clip_by_global_norm(self.max_grad_norm))
    return optax.chain(clip, optax.adam(schedule))



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
