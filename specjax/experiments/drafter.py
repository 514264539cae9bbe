"""Offline EAGLE-3 training as one run: target, self-distillation data, head, export, evaluation.

    specjax train-drafter --config configs/eagle3_arithmetic.py [--steps 600 --head.ttt-steps 4]

    from specjax.experiments import DistillData, DrafterTrainConfig, run_drafter_training
    summary = run_drafter_training(DrafterTrainConfig(
        run_dir="runs/qwen3-eagle3", target_dir="Qwen3-0.6B",
        data=DistillData(gsm8k_file="gsm8k_train.jsonl")))

`run_drafter_training(config)` does, in order:

1. The target: an HF checkpoint directory (`target_dir`), the latest policy of a `specjax train`
   run (`target_rl_run`), or else the built-in arithmetic policy warm-started with the
   supervised recipe of `specjax.experiments.warm_start` (`config.warm_start`).
2. Self-distillation data: the target's own responses to training prompts (the arithmetic
   task's train split, or a GSM8K-format JSONL), and the draft vocabulary from their tokens.
3. Training with the training-time test (`specjax.supervised.eagle3.make_eagle3_step`), one
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

import json
import time
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from specjax.checkpoint import Checkpointer
from specjax.decoding import DraftTree, Eagle3Drafter, Eagle3Weights, SamplingConfig, generate
from specjax.errors import CheckpointError
from specjax.experiments.drafter_config import LEGACY_NAMES, RESUMABLE_FIELDS, DrafterTrainConfig
from specjax.experiments.drafter_data import (Target, check_length, load_target, make_data,
                                              target_spec, task_prompts)
from specjax.experiments.run_metrics import jsonable
from specjax.experiments.run_record import check_resume, kept_metrics, record_config
from specjax.files import DirectoryLock, write_atomic, write_text_atomic
from specjax.models import Eagle3Config, count_params, load_eagle3, save_eagle3
from specjax.supervised.eagle3 import Eagle3TrainState, init_eagle3_state, make_eagle3_step

# ---------------------------------------------------------------------------------------------
# Training


@lru_cache(maxsize=4)
def _epoch_order(num: int, seed: int, epoch: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(num)


def _read_data(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """`(tokens [B, L], loss_mask [B, L], d2t [W])` of a run's `data.npz`, or CheckpointError
  naming the file when it is truncated, foreign or inconsistent."""
  try:
    with np.load(path, allow_pickle=False) as data:
      tokens, mask, d2t = data["tokens"], data["loss_mask"], data["d2t"]
  except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
    raise CheckpointError(f"{path} cannot be read as this run's data ({type(err).__name__}: "
                          f"{err}); delete it to generate the data again") from None
  ints = all(np.issubdtype(a.dtype, np.integer) for a in (tokens, mask, d2t))
  if not ints or tokens.ndim != 2 or mask.shape != tokens.shape or d2t.ndim != 1:
    raise CheckpointError(f"{path} holds tokens {tokens.shape} {tokens.dtype}, loss_mask "
                          f"{mask.shape} {mask.dtype}, d2t {d2t.shape} {d2t.dtype}: expected "
                          "integer [B, L], [B, L] and [W]; delete it to generate the data again")
  return tokens, mask, d2t


def batch_indices(num: int, batch_size: int, step: int, seed: int) -> np.ndarray:
  """Rows `[B]` of step `step` (0-based): positions `step * B ..` of epochs of seeded
  permutations of `num` rows, so every row is seen once per epoch and any step is
  reproducible alone (what resuming needs)."""
  positions = step * batch_size + np.arange(batch_size)
  epochs, offsets = np.divmod(positions, num)
  return np.array([_epoch_order(num, seed, int(e))[o] for e, o in zip(epochs, offsets)])


def _train(config: DrafterTrainConfig, target: Target, eagle_config: Eagle3Config,
           tokens: np.ndarray, mask: np.ndarray, d2t: np.ndarray, run_dir: Path,
           log) -> tuple[Eagle3TrainState, int]:
  """Train (or continue training) the head; returns its final state and the steps run now."""
  optimizer = config.optimizer()
  schedule = config.optim.schedule(config.steps)
  key = jax.random.fold_in(jax.random.key(config.seed), 1)
  abstract = jax.eval_shape(lambda: init_eagle3_state(eagle_config, optimizer, key))
  ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=config.checkpoint.keep)
  metrics_file = run_dir / "metrics.jsonl"
  restored = ckpt.restore(abstract)
  if restored is None:
    state, start = init_eagle3_state(eagle_config, optimizer, key), 0
    metrics_file.write_text("")
  else:
    state, meta, start = restored
    log(f"resumed from {ckpt.directory} at step {start}")
    # Steps logged after the checkpoint run again, identically: drop their lines (and a
    # line a kill cut short).
    kept = kept_metrics(metrics_file, start, log)
    metrics_file.write_text("".join(line + "\n" for line in kept))
  step_fn = make_eagle3_step(target.config, eagle_config, optimizer,
                             ttt_steps=config.head.ttt_steps,
                             soft_labels=config.head.soft_labels, step_decay=config.head.step_decay)
  d2t_dev = jnp.asarray(d2t, jnp.int32)
  with open(metrics_file, "a") as out, tqdm.trange(start, config.steps, desc="eagle3",
                                                   initial=start, total=config.steps) as bar:
    for step in bar:
      begin = time.perf_counter()
      rows = batch_indices(len(tokens), config.batch_size, step, config.seed)
      state, metrics = step_fn(state, target.params, d2t_dev, jnp.asarray(tokens[rows]),
                               jnp.asarray(mask[rows]))
      metrics = jsonable(jax.device_get(metrics))
      record = {"step": step + 1, **metrics, "learning_rate": float(schedule(step)),
                "step_time_s": time.perf_counter() - begin}
      if not np.isfinite(record["loss"]):
        raise FloatingPointError(f"EAGLE-3 training diverged at step {step + 1}: loss "
                                 f"{record['loss']}; lower learning_rate")
      out.write(json.dumps(record) + "\n")
      out.flush()
      bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['accuracy'][0]:.2f}")
      if (step + 1) % config.checkpoint.every == 0 or step + 1 == config.steps:
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
  """Run (or resume) offline EAGLE-3 training; returns the summary (also in summary.json).

  Raises:
    RunDirectoryInUse: another live run owns `config.run_dir` (a killed run's lock is taken
      over).
  """
  with DirectoryLock(config.run_dir, "drafter training run") as lock:
    if lock.previous:
      log(f"{config.run_dir}: taking over the lock of a run that no longer runs "
          f"({lock.previous})")
    return _run_drafter_training(config, log)


def _run_drafter_training(config: DrafterTrainConfig, log: Callable[[str], None]
                          ) -> dict[str, Any]:
  begin = time.perf_counter()
  run_dir = Path(config.run_dir)
  run_dir.mkdir(parents=True, exist_ok=True)
  reused = ((run_dir / "data.npz").is_file()
            or any(any((run_dir / d).glob("*")) for d in ("target", "checkpoints")))
  check_resume(run_dir, config, RESUMABLE_FIELDS, started=reused,
               defines="the target, the data or the head", log=log, renamed=LEGACY_NAMES)
  timings = {}

  # Everything that can be checked without the target's weights, before the slow parts.
  tokenizer, target_config = target_spec(config)
  eagle_config = Eagle3Config.for_target(target_config, aux_layers=config.head.aux_layers,
                                         draft_vocab_size=config.head.draft_vocab_size)
  data_file = run_dir / "data.npz"
  if not data_file.is_file():
    train_tokens, train_lengths = task_prompts(config, tokenizer, "train",
                                               config.data.num_prompts)
    check_length("data.max_new_tokens", config.data.max_new_tokens,
                  train_tokens.shape[1] + config.data.max_new_tokens, target_config,
                  f"training prompts of {train_tokens.shape[1]} tokens and these responses")
  eval_new = config.eval_max_new_tokens
  eval_tokens, eval_lengths = task_prompts(config, tokenizer, "test", config.eval.prompts)
  check_length("data.max_new_tokens" if config.eval.max_new_tokens is None
                else "eval.max_new_tokens", eval_new,
                eval_tokens.shape[1] + eval_new + config.eval.depth + 1, target_config,
                f"held-out prompts of {eval_tokens.shape[1]} tokens, these responses and a "
                f"chain of eval.depth={config.eval.depth}")

  # Recorded once the checks passed, so a config that failed them can be fixed and rerun.
  record_config(run_dir, config)

  t = time.perf_counter()
  target = load_target(config, log)
  timings["target_s"] = time.perf_counter() - t
  log(f"target: {count_params(target.params):,} parameters, {target.config.n_layers} layers, "
      f"vocab {target.config.vocab_size}")

  t = time.perf_counter()
  if data_file.is_file():
    tokens, mask, d2t = _read_data(data_file)
    log(f"data: reusing {data_file}")
  else:
    tokens, mask, d2t = make_data(config, target, train_tokens, train_lengths)

    def write(path: Path) -> None:
      with open(path, "wb") as f:  # a file object: np.savez would append ".npz" to a name
        np.savez(f, tokens=tokens, loss_mask=mask, d2t=d2t)

    write_atomic(data_file, write)
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
                             depth=config.eval.depth, repeats=config.eval.speedup_repeats,
                             seed=config.seed)
  timings["eval_s"] = time.perf_counter() - t
  timings["total_s"] = time.perf_counter() - begin

  summary = {
      "eagle3_dir": str(head_dir), "steps": int(state.step), "steps_this_run": trained,
      "sequences": len(tokens), "response_tokens": int(response.sum()),
      "draft_vocab_size": len(d2t), "draft_vocab_coverage": coverage,
      "aux_layers": list(eagle_config.aux_layers), "ttt_steps": config.head.ttt_steps,
      "final_loss": float(np.mean([h["loss"] for h in last])),
      "final_ce": np.mean([h["ce"] for h in last], axis=0).tolist(),
      "final_accuracy": np.mean([h["accuracy"] for h in last], axis=0).tolist(),
      "eval_prompts": len(eval_tokens), "eval_depth": config.eval.depth,
      "eval_temperature": config.eval_sampling_temperature,
      **evaluation, **{k: round(v, 2) for k, v in timings.items()}}
  write_text_atomic(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")

  log(f"trained {summary['steps']} steps ({trained} now, {timings['train_s']:.1f}s); last "
      f"{len(last)} steps: loss {summary['final_loss']:.3f}, accuracy per TTT step "
      f"{np.round(summary['final_accuracy'], 3).tolist()}")
  log(f"EAGLE-3 head saved to {head_dir} (public layout: vLLM, SGLang, load_eagle3)")
  sampled = (f"; sampled (T={config.eval_sampling_temperature:g}) "
             f"{summary['acceptance_sampled']:.2f} at {summary['speedup_sampled']:.2f}x"
             if "acceptance_sampled" in summary else "")
  log(f"held-out acceptance length, chain of {config.eval.depth} on {len(eval_tokens)} prompts: "
      f"greedy {summary['acceptance_greedy']:.2f} at {summary['speedup_greedy']:.2f}x plain "
      f"tokens/s{sampled}; greedy output equals plain decoding: "
      f"{summary['greedy_equals_plain']}")
  log(f"time: target {timings['target_s']:.1f}s, data {timings['data_s']:.1f}s, train "
      f"{timings['train_s']:.1f}s, eval {timings['eval_s']:.1f}s, total "
      f"{timings['total_s']:.1f}s")
  return summary
