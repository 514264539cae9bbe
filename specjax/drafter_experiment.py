"""Offline EAGLE-3 training as one run: target, self-distillation data, head, export, evaluation.

    specjax train-drafter --config configs/eagle3_arithmetic.py [--steps 600 --ttt-steps 4 ...]

    from specjax.drafter_experiment import DrafterTrainConfig, run_drafter_training
    summary = run_drafter_training(DrafterTrainConfig(run_dir="runs/qwen3-eagle3",
                                                      target_dir="Qwen3-0.6B",
                                                      gsm8k_file="gsm8k_train.jsonl"))

`run_drafter_training(config)` does, in order:

1. The target: an HF checkpoint directory (`target_dir`), the latest policy of a `specjax train`
   run (`target_rl_run`), or else the built-in arithmetic policy warm-started with the
   supervised recipe of `specjax.rl.experiment.warm_start`.
2. Self-distillation data: the target's own responses to training prompts (the arithmetic
   task's train split, or a GSM8K-format JSONL), and the draft vocabulary from their tokens.
3. Training with the training-time test (`specjax.drafter_training.make_eagle3_step`), one
   JSON line of metrics per step, orbax checkpoints of the `Eagle3TrainState`.
4. Export of the head in the public layout (`save_eagle3`), then evaluation *of the exported
   files* on held-out prompts: acceptance length of `Eagle3Drafter` on a chain, and the
   speculative / plain tokens-per-second ratio in the same engine, greedy and sampled.

Resuming: a rerun with the same `run_dir` continues from the latest checkpoint. The data, the
draft vocabulary and the warm-started target are saved to the run directory rather than
regenerated: with a real target, generation is the expensive part of the run, and
regenerating it bit for bit would need the same hardware and batch layout. The batch of step
s is a pure function of `(seed, s)`, so a resumed run takes the steps an uninterrupted one
would. Fields that define the data, the target or the head may not change on a rerun (a
`ConfigError` names them); the others (steps, learning rate, evaluation, ...) may.

Run directory:

    config.json       the config of the latest (re)run
    target/           the warm-started built-in policy (orbax; absent for other targets)
    data.npz          tokens [B, L], loss_mask [B, L], d2t [W]
    checkpoints/      orbax `Eagle3TrainState` by step
    metrics.jsonl     per step: loss, ce [J], accuracy [J], grad_norm, learning_rate, time
    eagle3/           the trained head (config.json + model.safetensors, vLLM / SGLang layout)
    summary.json      what `run_drafter_training` returns

Shape letters: see `specjax` (B rows: sequences of the data, prompts x responses, or one
step's batch; P prompt buffer width; L = P + max_new_tokens; V vocabulary; W draft
vocabulary; J training-time-test steps).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

from specjax.checkpoint import Checkpointer
from specjax.decoding import DraftTree, Eagle3Drafter, Eagle3Weights, SamplingConfig, generate
from specjax.drafter_data import (Target, check_length, load_target, make_data,
                                  target_spec, task_prompts)
from specjax.drafter_training import Eagle3TrainState, init_eagle3_state, make_eagle3_step
from specjax.errors import ConfigError
from specjax.models import Eagle3Config, ModelConfig, count_params, load_eagle3, save_eagle3
from specjax.rl.tasks import ArithmeticTask

Params = dict[str, Any]

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

    def is_int(value) -> bool:
      return isinstance(value, int) and not isinstance(value, bool)

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


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
  """Write through a temporary file and rename it: a killed run leaves no half file."""
  tmp = path.with_name(path.name + ".tmp")
  write(tmp)
  os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Config record


def _config_record(config: DrafterTrainConfig) -> dict[str, Any]:
  return json.loads(json.dumps(dataclasses.asdict(config), default=str))


def _check_rerun(run_dir: Path, config: DrafterTrainConfig, log) -> None:
  """Refuse a rerun that changes the target, the data or the head of what it would reuse."""
  path = run_dir / "config.json"
  new = _config_record(config)
  reused = ((run_dir / "data.npz").is_file()
            or any(any((run_dir / d).glob("*")) for d in ("target", "checkpoints")))
  if path.is_file() and reused:
    old = json.loads(path.read_text())
    changed = sorted(k for k in new if k in old and old[k] != new[k])
    frozen = [k for k in changed if k not in RESUMABLE_FIELDS]
    if frozen:
      detail = "; ".join(f"{k}: {old[k]!r} -> {new[k]!r}" for k in frozen)
      raise ConfigError(
          f"{', '.join(frozen)} changed since {run_dir} was started ({detail}); these define "
          "the target, the data or the head, so the run cannot continue with them. Use a new "
          "run_dir, or the old values.")
    if changed:
      log(f"rerun with changed {', '.join(changed)}")


# ---------------------------------------------------------------------------------------------
# Training


@lru_cache(maxsize=4)
def _epoch_order(num: int, seed: int, epoch: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(num)


def batch_indices(num: int, batch_size: int, step: int, seed: int) -> np.ndarray:
  """Rows `[B]` of step `step` (0-based): positions `step * B ..` of epochs of seeded
  permutations of `num` rows, so every row is seen once per epoch and any step is
  reproducible alone (what resuming needs)."""
  positions = step * batch_size + np.arange(batch_size)
  epochs, offsets = np.divmod(positions, num)
  return np.array([_epoch_order(num, seed, int(e))[o] for e, o in zip(epochs, offsets)])


def _jsonable(metrics: dict) -> dict:
  return {k: np.asarray(v).tolist() for k, v in metrics.items()}


def _train(config: DrafterTrainConfig, target: Target, eagle_config: Eagle3Config,
           tokens: np.ndarray, mask: np.ndarray, d2t: np.ndarray, run_dir: Path,
           log) -> tuple[Eagle3TrainState, int]:
  """Train (or continue training) the head; returns its final state and the steps run now."""
  optimizer = config.optimizer()
  schedule = config.schedule()
  key = jax.random.fold_in(jax.random.key(config.seed), 1)
  abstract = jax.eval_shape(lambda: init_eagle3_state(eagle_config, optimizer, key))
  ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=config.max_checkpoints)
  metrics_file = run_dir / "metrics.jsonl"
  restored = ckpt.restore(abstract)
  if restored is None:
    state, start = init_eagle3_state(eagle_config, optimizer, key), 0
    metrics_file.write_text("")
  else:
    state, meta, start = restored
    log(f"resumed from {ckpt.directory} at step {start}")
    # Steps logged after the checkpoint run again, identically: drop their lines.
    lines = metrics_file.read_text().splitlines() if metrics_file.exists() else []
    kept = [line for line in lines if line and json.loads(line)["step"] <= start]
    metrics_file.write_text("".join(line + "\n" for line in kept))
  step_fn = make_eagle3_step(target.config, eagle_config, optimizer, ttt_steps=config.ttt_steps,
                             soft_labels=config.soft_labels, step_decay=config.step_decay)
  d2t_dev = jnp.asarray(d2t, jnp.int32)
  with open(metrics_file, "a") as out, tqdm.trange(start, config.steps, desc="eagle3",
                                                   initial=start, total=config.steps) as bar:
    for step in bar:
      begin = time.perf_counter()
      rows = batch_indices(len(tokens), config.batch_size, step, config.seed)
      state, metrics = step_fn(state, target.params, d2t_dev, jnp.asarray(tokens[rows]),
                               jnp.asarray(mask[rows]))
      metrics = _jsonable(jax.device_get(metrics))
      record = {"step": step + 1, **metrics, "learning_rate": float(schedule(step)),
                "step_time_s": time.perf_counter() - begin}
      if not np.isfinite(record["loss"]):
        raise FloatingPointError(f"EAGLE-3 training diverged at step {step + 1}: loss "
                                 f"{record['loss']}; lower learning_rate")
      out.write(json.dumps(record) + "\n")
      out.flush()
      bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['accuracy'][0]:.2f}")
      if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps:
        ckpt.save(step + 1, state, {"step": step + 1})
  ckpt.close()
  return state, max(config.steps - start, 0)


# ---------------------------------------------------------------------------------------------
# Evaluation


def _throughput(run: Callable[[int], Any], repeats: int) -> tuple[Any, float]:
  """Compile, then the median generated tokens per second over `repeats` timed runs."""
  jax.block_until_ready(run(0))
  rates = []
  for r in range(repeats):
    begin = time.perf_counter()
    out = jax.block_until_ready(run(r + 1))
    rates.append(float(np.asarray(out.lengths).sum()) / (time.perf_counter() - begin))
  return out, float(np.median(rates))


def evaluate_head(target: Target, eagle_config: Eagle3Config, weights: Eagle3Weights,
                  prompt_tokens: np.ndarray, prompt_lengths: np.ndarray, *,
                  max_new_tokens: int, temperature: float, depth: int = 3,
                  repeats: int = 3, seed: int = 0) -> dict[str, Any]:
  """Acceptance length and speculative / plain throughput of an EAGLE-3 head on a chain of
  `depth`, greedy and (when `temperature > 0`) sampled, in the same engine on the same
  prompts `[B, P]`. Greedy speculative output is also compared with plain decoding."""
  tree = DraftTree.chain(depth)
  out: dict[str, Any] = {}
  modes = {"greedy": 0.0} | ({"sampled": temperature} if temperature > 0 else {})
  for mode, temp in modes.items():
    sampling = SamplingConfig(temp)
    drafter = Eagle3Drafter(eagle_config, sampled=temp > 0)

    def run(r, speculative):
      return generate(target.params, target.config, prompt_tokens, prompt_lengths,
                      jax.random.key(seed + r), max_new_tokens=max_new_tokens,
                      sampling=sampling, drafter=drafter if speculative else None,
                      tree=tree if speculative else None, eos_id=target.tokenizer.eos_id,
                      drafter_params=weights if speculative else None,
                      pad_id=target.tokenizer.pad_id)

    plain, plain_rate = _throughput(lambda r: run(r, False), repeats)
    spec, spec_rate = _throughput(lambda r: run(r, True), repeats)
    out |= {f"acceptance_{mode}": float(spec.stats.tokens_per_round),
            f"accepted_per_depth_{mode}": np.asarray(spec.stats.accepted_per_depth).tolist(),
            f"plain_tokens_per_s_{mode}": plain_rate, f"spec_tokens_per_s_{mode}": spec_rate,
            f"speedup_{mode}": spec_rate / plain_rate}
    if mode == "greedy":
      out["greedy_equals_plain"] = bool(
          np.array_equal(np.asarray(spec.tokens), np.asarray(plain.tokens))
          and np.array_equal(np.asarray(spec.lengths), np.asarray(plain.lengths)))
  return out


# ---------------------------------------------------------------------------------------------
# The run


def run_drafter_training(config: DrafterTrainConfig,
                         log: Callable[[str], None] = print) -> dict[str, Any]:
  """Run (or resume) offline EAGLE-3 training; returns the summary (also in summary.json)."""
  begin = time.perf_counter()
  run_dir = Path(config.run_dir)
  run_dir.mkdir(parents=True, exist_ok=True)
  _check_rerun(run_dir, config, log)
  timings = {}

  # Everything that can be checked without the target's weights, before the slow parts.
  tokenizer, target_config = target_spec(config)
  eagle_config = Eagle3Config.for_target(target_config, aux_layers=config.aux_layers,
                                         draft_vocab_size=config.draft_vocab_size)
  data_file = run_dir / "data.npz"
  if not data_file.is_file():
    train_tokens, train_lengths = task_prompts(config, tokenizer, "train", config.num_prompts)
    check_length("max_new_tokens", config.max_new_tokens,
                  train_tokens.shape[1] + config.max_new_tokens, target_config,
                  f"training prompts of {train_tokens.shape[1]} tokens and these responses")
  eval_new = config.eval_max_new_tokens or config.max_new_tokens
  eval_tokens, eval_lengths = task_prompts(config, tokenizer, "test", config.eval_prompts)
  check_length("max_new_tokens" if config.eval_max_new_tokens is None
                else "eval_max_new_tokens", eval_new,
                eval_tokens.shape[1] + eval_new + config.eval_depth + 1, target_config,
                f"held-out prompts of {eval_tokens.shape[1]} tokens, these responses and a "
                f"chain of eval_depth={config.eval_depth}")

  # Recorded once the checks passed, so a config that failed them can be fixed and rerun.
  _write_atomic(run_dir / "config.json",
                lambda p: p.write_text(json.dumps(_config_record(config), indent=2) + "\n"))

  t = time.perf_counter()
  target = load_target(config, log)
  timings["target_s"] = time.perf_counter() - t
  log(f"target: {count_params(target.params):,} parameters, {target.config.n_layers} layers, "
      f"vocab {target.config.vocab_size}")

  t = time.perf_counter()
  if data_file.is_file():
    with np.load(data_file) as data:
      tokens, mask, d2t = data["tokens"], data["loss_mask"], data["d2t"]
    log(f"data: reusing {data_file}")
  else:
    tokens, mask, d2t = make_data(config, target, train_tokens, train_lengths)

    def write(path: Path) -> None:
      with open(path, "wb") as f:  # a file object: np.savez would append ".npz" to a name
        np.savez(f, tokens=tokens, loss_mask=mask, d2t=d2t)

    _write_atomic(data_file, write)
  timings["data_s"] = time.perf_counter() - t
  response = mask.astype(bool)
  coverage = float(np.isin(tokens[response], d2t).mean()) if response.any() else 0.0
  log(f"data: {len(tokens)} sequences of {tokens.shape[1]} tokens, {int(response.sum()):,} "
      f"response tokens ({response.sum(1).mean():.1f} per sequence); draft vocabulary "
      f"{len(d2t)} of {target.config.vocab_size} ids covers {coverage:.1%} of them")

  t = time.perf_counter()
  state, trained = _train(config, target, eagle_config, tokens, mask, d2t, run_dir, log)
  timings["train_s"] = time.perf_counter() - t
  history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if line]
  last = history[-min(len(history), 10):]

  head_dir = run_dir / "eagle3"
  save_eagle3(head_dir, state.params, eagle_config, np.asarray(d2t))
  t = time.perf_counter()
  loaded_config, loaded_params, loaded_d2t = load_eagle3(head_dir, target.config)
  evaluation = evaluate_head(target, loaded_config, Eagle3Weights(loaded_params, loaded_d2t),
                             eval_tokens, eval_lengths, max_new_tokens=eval_new,
                             temperature=config.eval_sampling_temperature,
                             depth=config.eval_depth, repeats=config.speedup_repeats,
                             seed=config.seed)
  timings["eval_s"] = time.perf_counter() - t
  timings["total_s"] = time.perf_counter() - begin

  summary = {
      "eagle3_dir": str(head_dir), "steps": int(state.step), "steps_this_run": trained,
      "sequences": len(tokens), "response_tokens": int(response.sum()),
      "draft_vocab_size": len(d2t), "draft_vocab_coverage": coverage,
      "aux_layers": list(eagle_config.aux_layers), "ttt_steps": config.ttt_steps,
      "final_loss": float(np.mean([h["loss"] for h in last])),
      "final_ce": np.mean([h["ce"] for h in last], axis=0).tolist(),
      "final_accuracy": np.mean([h["accuracy"] for h in last], axis=0).tolist(),
      "eval_prompts": len(eval_tokens), "eval_depth": config.eval_depth,
      "eval_temperature": config.eval_sampling_temperature,
      **evaluation, **{k: round(v, 2) for k, v in timings.items()}}
  _write_atomic(run_dir / "summary.json",
                lambda p: p.write_text(json.dumps(summary, indent=2) + "\n"))

  log(f"trained {summary['steps']} steps ({trained} now, {timings['train_s']:.1f}s); last "
      f"{len(last)} steps: loss {summary['final_loss']:.3f}, accuracy per TTT step "
      f"{np.round(summary['final_accuracy'], 3).tolist()}")
  log(f"EAGLE-3 head saved to {head_dir} (public layout: vLLM, SGLang, load_eagle3)")
  sampled = (f"; sampled (T={config.eval_sampling_temperature:g}) "
             f"{summary['acceptance_sampled']:.2f} at {summary['speedup_sampled']:.2f}x"
             if "acceptance_sampled" in summary else "")
  log(f"held-out acceptance length, chain of {config.eval_depth} on {len(eval_tokens)} prompts: "
      f"greedy {summary['acceptance_greedy']:.2f} at {summary['speedup_greedy']:.2f}x plain "
      f"tokens/s{sampled}; greedy output equals plain decoding: "
      f"{summary['greedy_equals_plain']}")
  log(f"time: target {timings['target_s']:.1f}s, data {timings['data_s']:.1f}s, train "
      f"{timings['train_s']:.1f}s, eval {timings['eval_s']:.1f}s, total "
      f"{timings['total_s']:.1f}s")
  return summary
