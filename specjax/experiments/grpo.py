"""A whole GRPO run on a built-in JAX-reward task: warm start, RL, evaluation, resume.

`run(config)` executes an `ExperimentConfig` (`specjax.experiments.grpo_config`, re-exported
here). It does, in order: restore the latest checkpoint of `config.run_dir` or else a
supervised warm start of the policy and its MTP heads (and, for EAGLE-3 rollouts, a head
loaded from `drafter.eagle3_dir` or distilled from the warm-started policy, kept as a frozen
copy); held-out accuracy before RL; GRPO steps with speculative rollouts (checkpointing the
whole `TrainState` and the data position, logging metrics to JSONL and TensorBoard); held-out
accuracy after RL; the rollout speedup of speculative over plain decoding measured in the same
run (and, on a CPU, what the simulator predicts for the same rollout on an H200); for EAGLE-3,
the acceptance of the online-trained head against its frozen starting copy on the final policy;
a PNG plot.

A killed run resumes from its last checkpoint and reproduces the metrics of an uninterrupted
run exactly: every step is a pure function of the checkpointed state and the data position.

Several devices and processes: the train state lives on the mesh `config.mesh` (over every
device of every process; `specjax.rl.distributed`), each process feeds its own rows of the
prompts, and orbax checkpoints the state shard by shard. The warm start, evaluations and
measurements run on every process alone (on its first device, from a gathered copy of the
parameters); process 0's warm start and measured speculation costs are the ones used
everywhere, and only process 0 logs and writes files besides the checkpoints.

Disaggregated async (`pipeline.rollout_devices` >= 1, one process): the first devices roll
out, the mesh over the others trains (`specjax.rl.DisaggregatedAsync`); checkpoints hold the
same `TrainState` as the fused async step's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

from specjax.checkpoint import Checkpointer
from specjax.decoding import CostTable, Eagle3Weights, SamplingConfig
from specjax.decoding.drafters.history import history_drafter
from specjax.errors import ConfigError, StorageError
from specjax.experiments.device_profile import memory_capacity
from specjax.experiments.grpo_config import LEGACY_NAMES, RESUMABLE_FIELDS, ExperimentConfig
from specjax.experiments.measure import (acceptance_arms, arm_acceptance, evaluate,
                                         probe_acceptance, probe_room, rollout_arm_seconds,
                                         rollout_arms, rollout_costs, rollout_speedup,
                                         simulated_speedup)
from specjax.experiments.metrics_log import MetricsLog
from specjax.experiments.run_metrics import (arm_summary, jsonable, part_acceptance,
                                             plot_curves, tensorboard_scalars)
from specjax.experiments.run_inputs import check_inputs
from specjax.experiments.run_record import check_resume, config_record, kept_metrics, record_config
from specjax.experiments.warm_start import warm_start_policy
from specjax.files import DirectoryLock, storage
from specjax.models.config import RUNTIME_FIELDS
from specjax.models.eagle3_io import load_eagle3, save_eagle3
from specjax.models.hf import load_hf, save_hf
from specjax.models.lora import adapted_targets, merged_policy
from specjax.models.params import count_params, init_params
from specjax.rl.data import PromptReader
from specjax.rl.datasets import host_scores
from specjax.rl.reward_workers import RewardPool
from specjax.rl.disaggregated import DisaggregatedAsync
from specjax.rl.distributed import (broadcast_json, distribute, global_batch, local_copy,
                                    process_prompts, prompt_batch_shardings, sharded_prime_fn,
                                    sharded_train_step, train_state_shardings)
from specjax.rl.state import TrainConfig, TrainState, init_train_state
from specjax.rl.tasks import Task, decode_completions, task_prompt_ids
from specjax.rl.trainer import SplitStep, make_prime_fn, make_split_step
from specjax.rl.updates import all_finite
from specjax.sharding import make_mesh

__all__ = ["ExperimentConfig", "abstract_state", "draft_model_params", "host_reward",
           "initial_eagle3_head", "initial_policy", "run", "task_records", "with_shardings"]


def task_records(task: Task, split: str) -> list[dict]:
  """The prompt records of `task`'s `split` (`PromptReader`'s source); a task rewarded in
  Python keeps each record's `Example` under "example", which its rewards read."""
  keep = not task.reward_in_jax
  records = [{"prompt": task_prompt_ids(task, e.prompt), "reference": e.reference,
              "answer": e.answer, **({"example": e} if keep else {})}
             for e in task.examples(split)]
  if not records:
    raise ConfigError(f"task {task.name!r} has no {split} prompts (its {split} split is "
                      "empty): a run trains on the train split and evaluates on the test split "
                      "before and after RL; give it both (GSM8K: a test_file or test_fraction "
                      "> 0; a dataset: test_fraction > 0 or a test source)")
  return records


def initial_policy(config: ExperimentConfig, log=print):
  """The parameters RL starts from: `config.policy_dir`'s checkpoint, or random ones, after
  the supervised warm start (`config.warm_start`; `warm_start_policy`)."""
  params = None
  if config.policy_dir is not None:
    params, model = load_hf(config.policy_dir, param_dtype=config.policy_dtype)
    model = dataclasses.replace(model, **{f: getattr(config.model, f) for f in RUNTIME_FIELDS})
    if model != config.model:
      raise ConfigError(f"policy_dir={config.policy_dir!r} loads as {model}, which differs from "
                        f"the run's model {config.model} (config.json changed since the run "
                        "was configured?)")
    log(f"policy from {config.policy_dir} ({model.param_dtype}"
        + (", the checkpoint's dtype: policy_dtype auto)" if config.policy_dtype == "auto"
           else ")"))
  return warm_start_policy(config.task, config.model, config.warm_start, config.seed, log,
                           progress=jax.process_index() == 0, params=params)


def host_reward(config: ExperimentConfig, records: list[dict], pool: RewardPool | None = None):
  """The split step's reward (`make_split_step`) of a task rewarded in Python: the rollout's
  responses (this process's rows) decoded, each scored against its prompt's record
  (`records`, the reader's source) over `pool`'s workers, with each function's values, which
  the step averages over every process's rows (`reward_<name>`)."""
  tok, group = config.task.tokenizer, config.grpo.group_size

  def reward(responses, lengths, batch):
    examples = [records[int(i)]["example"] for i in np.repeat(np.asarray(batch.index), group)]
    completions = decode_completions(tok, responses, lengths)
    rewards, values = host_scores(config.task, examples, completions, responses, lengths,
                                  pool, per_row=True)
    reward.samples = [(e.prompt, c, float(r)) for e, c, r in
                      zip(examples[:SAMPLES], completions, rewards)]
    return rewards, values

  reward.samples = []  # the last batch's first (prompt, completion, reward), for the log
  return reward


SAMPLES = 4  # rows of a step written to the log as text


def _decoded_samples(samples: dict | None, tok) -> list[tuple[str, str, float]]:
  """A fused step's `metrics["samples"]` as (prompt, completion, reward) texts."""
  if samples is None:
    return []
  out = []
  for tokens, mask, reward in zip(samples["tokens"], samples["response_mask"],
                                  samples["rewards"]):
    response = np.flatnonzero(mask)
    start = response[0] if len(response) else len(tokens)
    prompt = [int(t) for t in tokens[:start] if t != tok.pad_id]
    out.append((tok.decode(prompt), tok.decode([int(t) for t in tokens[response]]),
                float(reward)))
  return out


def _samples_text(samples) -> str:
  return "\n\n".join(f"**prompt** {p!r}\n\n**completion** {c!r}\n\n**reward** {r:.3f}"
                       for p, c, r in samples)


def initial_eagle3_head(params, config: ExperimentConfig, log=print) -> Eagle3Weights:
  """The EAGLE-3 head RL starts from: `config.drafter.eagle3_dir`'s, or one distilled from the
  policy `params` on its own answers (at `config.rollout.temperature`) to the train
  prompts."""
  from specjax.supervised.eagle3 import draft_vocab_from_data, self_distillation_data, train_eagle3
  eagle = config.eagle3_config()
  if config.drafter.eagle3_dir is not None:
    _, head, d2t = load_eagle3(config.drafter.eagle3_dir, config.model)
    log(f"EAGLE-3 head from {config.drafter.eagle3_dir}")
    return Eagle3Weights(params=head, d2t=jnp.asarray(d2t, jnp.int32))
  tok = config.task.tokenizer
  records = task_records(config.drafter.distill_task or config.task, "train")
  wanted = config.drafter.distill_prompts
  if wanted is not None and wanted < len(records):
    picked = np.random.default_rng(config.seed + 5).choice(len(records), wanted, replace=False)
    records = [records[i] for i in np.sort(picked)]
  batch = PromptReader(records, batch_size=len(records), pad_id=tok.pad_id,
                       shuffle=False).batch_at(0)
  # A fixed-length continuation (no EOS) gives the head whole answers and what follows.
  tokens, mask = self_distillation_data(
      params, config.model, batch.tokens, batch.lengths, jax.random.key(config.seed + 3),
      max_new_tokens=config.rollout.max_new_tokens,
      sampling=SamplingConfig(config.rollout.temperature),
      pad_id=tok.pad_id)
  # Prompts are text the head drafts from too; they add context at no sampling cost.
  mask = np.asarray(tokens != tok.pad_id, np.int32)
  d2t = draft_vocab_from_data(tokens, mask, config.model.vocab_size, eagle.draft_vocab_size)
  rng = np.random.default_rng(config.seed + 3)
  batches = ((tokens[idx], mask[idx]) for idx in
             (rng.integers(0, len(tokens), config.warm_start.batch)
              for _ in range(config.drafter.distill_steps)))
  head, history = train_eagle3(params, config.model, eagle, batches,
                               optimizer=optax.adam(3e-3), d2t=d2t,
                               key=jax.random.key(config.seed + 4))
  log(f"EAGLE-3 head distilled: {config.drafter.distill_steps} steps, training-time-test accuracy "
      f"{np.round(history[-1]['accuracy'], 2).tolist()}")
  return head


# Where a run that distilled its draft model online keeps it (an HF checkpoint directory).
DRAFT_MODEL_DIR = "draft_model"


def draft_model_params(config: ExperimentConfig, log=print):
  """The draft model's parameters as `config.drafter.checkpoint` holds them (`log=None`:
  silently)."""
  params, model = load_hf(config.drafter.checkpoint)
  expected = config.draft_model_config()
  if model != expected:
    raise ConfigError(f"drafter.checkpoint={config.drafter.checkpoint!r} loads as {model}, "
                      f"not the {expected} its config.json describes")
  if log is not None:
    log(f"draft model from {config.drafter.checkpoint}: {count_params(params):,} parameters")
  return params


def abstract_state(config: ExperimentConfig, tc: TrainConfig, optimizer, batch) -> TrainState:
  """The state's structure and shapes, for restoring and planning (no weights are
  materialised); in async mode with the pending rollout of `batch`'s shapes."""

  def make():
    head = None
    if tc.eagle3 is not None:
      from specjax.models.eagle3 import init_eagle3
      eagle = tc.eagle3.config
      head = Eagle3Weights(params=init_eagle3(eagle, jax.random.key(0)),
                           d2t=jnp.zeros((eagle.draft_vocab_size,), jnp.int32))
    elif tc.draft_model is not None:
      head = init_params(tc.draft_model.config, jax.random.key(0))
    state = init_train_state(tc, init_params(config.model, jax.random.key(0)), optimizer, 0,
                             drafter_params=head)
    return state.replace(acceptance=config.initial_acceptance())

  abstract = jax.eval_shape(make)
  if not config.pipeline.async_mode:
    return abstract
  # The pending rollout's shapes do not depend on how trees are chosen, so `tc` may be the
  # fixed-tree step; that step has no policy to update the adaptive counts, so it primes a
  # state without them and they are put back.
  # A task rewarded in Python scores on the host: its pending rollout is shaped as by a JAX
  # reward of one value a row (`SplitStep.prime`).
  reward = (config.task.reward if config.task.reward_in_jax else
            lambda responses, lengths, answers: jnp.zeros(responses.shape[:1], jnp.float32))
  prime = make_prime_fn(tc, reward, pad_id=config.task.tokenizer.pad_id)
  primed = jax.eval_shape(prime, abstract.replace(acceptance=None), batch)
  return primed.replace(acceptance=abstract.acceptance)


# What a diverging step shows first: NaN rewards poison the advantages, then the loss and its
# gradient, then the parameters.
_FINITE_METRICS = ("reward_mean", "reward_std", "loss", "grad_norm")


_all_finite = jax.jit(all_finite)  # one fused reduction, a scalar to the host


_merge = jax.jit(merged_policy)


def _policy(state: TrainState):
  """The state's policy parameters: with LoRA the adapters merged into the trunk (one
  program), else its parameters themselves (no copy)."""
  return state.params if state.adapters is None else _merge(state.params, state.adapters)


PENDING_METRICS = "pending_metrics"  # a checkpoint's meta: see `_pending_metrics`


def _pending_metrics(stepper) -> dict[str, dict]:
  """For a checkpoint's meta: what the settled pending rollout's host rewards add to the
  metrics of the step that trains on it (its `reward_<name>` means and reward time), so that
  a resumed run logs that step as an uninterrupted one does. Empty for other steps."""
  metrics = getattr(stepper, "pending_metrics", None)
  return {PENDING_METRICS: jsonable(metrics)} if metrics else {}


def _check_finite(step: int, metrics: dict, state: TrainState, config: ExperimentConfig,
                  last_checkpoint: int | None) -> None:
  """Raises FloatingPointError unless `metrics`' rewards, loss and gradient norm and the
  trained weights of `state` are finite, so that a diverged state is never checkpointed."""
  bad = [f"{k}={np.asarray(metrics[k]).tolist()}" for k in _FINITE_METRICS
         if k in metrics and not np.all(np.isfinite(metrics[k]))]
  weights = {"params": state.params, "adapters": state.adapters,
             "drafter": state.drafter_weights}
  if not bool(_all_finite(weights)):
    bad.append("parameters")
  if np.asarray(metrics.get("update_skipped", 0.0)).any():
    bad.append("update (the step did not apply it: weights or moments would be non-finite)")
  if bad:
    if step == 0:
      where, rate = "the warm start", f"sft_learning_rate={config.warm_start.learning_rate}"
    else:
      where, rate = f"GRPO step {step}", f"learning_rate={config.optim.learning_rate}"
    kept = ("no checkpoint was written" if last_checkpoint is None else
            f"the last checkpoint is step {last_checkpoint} in {config.run_dir}")
    raise FloatingPointError(
        f"training diverged at {where}: non-finite {', '.join(bad)}. Nothing of this step was "
        f"checkpointed ({kept}). Lower {rate}, or check that the task's reward is finite.")


def _shared_costs(measure) -> CostTable | None:
  """`measure()` (`rollout_costs`) on process 0, its table on every process.

  The costs choose each round's tree, which is compiled into the step, so every process must
  hold the same table; timings differ from host to host, and process 0 alone writes the
  table into the run directory.
  """
  if jax.process_count() == 1:
    return measure()
  costs = measure() if jax.process_index() == 0 else None
  shared = broadcast_json(None if costs is None else dataclasses.asdict(costs))
  return None if shared is None else CostTable(**shared)


def with_shardings(abstract, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shardings)


def _meshes(config: ExperimentConfig) -> tuple[jax.sharding.Mesh, jax.sharding.Mesh | None]:
  """The train state's mesh, and with `pipeline.rollout_devices` the rollout mesh: the first
  `rollout_devices` devices, split by rows, and `config.mesh` over the others."""
  if not config.pipeline.rollout_devices:
    return config.mesh.make(), None
  devices, n = jax.devices(), config.pipeline.rollout_devices
  if jax.process_count() > 1:
    raise ConfigError(f"pipeline.rollout_devices={n} is invalid with {jax.process_count()} "
                      "processes: disaggregated async runs in one process (0 runs the fused "
                      "step on every process's devices)")
  if n >= len(devices):
    raise ConfigError(f"pipeline.rollout_devices={n} is invalid: there are {len(devices)} "
                      f"devices and the updates need at least one (allowed: 0 .. "
                      f"{len(devices) - 1})")
  try:
    train = config.mesh.make(devices[n:])
  except ConfigError as err:
    raise ConfigError(f"with pipeline.rollout_devices={n} the mesh covers the {len(devices) - n} "
                      f"devices the rollouts leave, of {len(devices)}: {err}") from err
  return train, make_mesh(data=-1, devices=devices[:n])


def _check_not_past(run_dir: Path, steps: int) -> None:
  """Refuse to "resume" a run whose latest checkpoint is past `steps`: it would run no step,
  yet record `steps` as the run's length over the files of the longer run."""
  saved = [int(p.name) for p in (run_dir / "checkpoints").glob("[0-9]*") if p.name.isdigit()]
  if saved and max(saved) > steps:
    raise ConfigError(f"steps={steps} is invalid: {run_dir} holds a checkpoint at step "
                      f"{max(saved)}, past it; allowed steps >= {max(saved)} to continue the "
                      "run (or another run_dir for a new one)")


def _check_lengths(config: ExperimentConfig, tc: TrainConfig, train_width: int,
                   test_width: int) -> None:
  """Refuse, before the warm start, a run whose rollouts, held-out evaluation or acceptance
  probe would not fit the model's `max_position`: each decodes into a cache of prompt width
  + new tokens + draft tree nodes + 1 slots, which `generate` checks only when it runs."""
  limit = config.model.max_position
  trees = (tc.rollout.speculation.menu if tc.rollout.speculation is not None
           else () if tc.rollout.tree is None else (tc.rollout.tree,))
  nodes = max((t.num_nodes for t in trees), default=0)
  new = config.rollout.max_new_tokens
  for what, width, n in (("rollouts: the longest train prompt", train_width, nodes),
                         ("the held-out evaluation: the longest held-out prompt", test_width, 0)):
    room = limit - width - n - 1
    if new > room:
      allowed = (f"allowed rollout.max_new_tokens <= {room}" if room >= 1 else
                 "no rollout.max_new_tokens fits")
      raise ConfigError(
          f"rollout.max_new_tokens={new} is invalid: {what} ({width} tokens) + {new} new "
          f"tokens + {n} draft tree nodes + 1 = {width + new + n + 1} > model.max_position="
          f"{limit}; {allowed} (or a larger model.max_position, a smaller rollout.tree_widths "
          "tree, shorter prompts)")
  probe_room(limit, test_width, nodes)


def run(config: ExperimentConfig, log=print) -> dict:
  """Run (or resume) the experiment; returns the final summary.

  With several processes every process calls this with the same config (`specjax train`
  does after joining the cluster); only process 0 calls `log` and writes files other than
  checkpoints, and only its summary has the entries read from them (`acceptance_first`,
  `acceptance_last`, `probe_acceptance_after_frozen`, the acceptance arms', a CPU run's
  `simulated_*`).

  Raises:
    RunDirectoryInUse: another live run owns `config.run_dir` (process 0 holds its lock for
      the whole run; a killed run's lock is taken over).
  """
  lead = jax.process_index() == 0
  with RewardPool(config.rewards) as pool:  # its workers stop with the run
    if not lead:
      return _run(config, lambda _: None, pool)  # one process reports; the others are silent
    with DirectoryLock(config.run_dir) as lock:
      if lock.previous:
        log(f"{config.run_dir}: taking over the lock of a run that no longer runs "
            f"({lock.previous})")
      return _run(config, log, pool)


def _check_bank_fits(config: ExperimentConfig, tc: TrainConfig) -> None:
  """Refuse a history bank over half of a device's memory: every device holds all of it,
  beside the policy, its optimizer state and the rollout's cache."""
  drafter = history_drafter(tc.rollout.drafter)
  if drafter is None:
    return
  need = drafter.bank_bytes(config.rollout.max_new_tokens)
  have = memory_capacity(jax.local_devices()[0])
  if need > have / 2:
    raise ConfigError(
        f"drafter.history_slots={drafter.slots} x history_per_prompt={drafter.per_prompt} "
        f"answers of rollout.max_new_tokens={config.rollout.max_new_tokens} tokens make a "
        f"history bank of {need / 2**30:.1f} GiB on every device, more than half of this "
        f"device's {have / 2**30:.1f} GiB; allowed: a bank of at most {have / 2**31:.1f} GiB "
        "(4 bytes a token): lower drafter.history_slots or drafter.history_per_prompt")


def _run(config: ExperimentConfig, log, pool: RewardPool) -> dict:
  lead = jax.process_index() == 0
  mesh, rollout_mesh = _meshes(config)
  run_dir = Path(config.run_dir)
  run_dir.mkdir(parents=True, exist_ok=True)
  check_resume(run_dir, config, RESUMABLE_FIELDS,
               started=any((run_dir / "checkpoints").glob("[0-9]*")),
               defines="the policy, its task and its training", log=log,
               renamed=LEGACY_NAMES)
  _check_not_past(run_dir, config.steps)
  check_inputs(run_dir, config.task, started=any((run_dir / "checkpoints").glob("[0-9]*")),
               accept=config.accept_changed_inputs, write=lead, log=log)
  if lead:
    record_config(run_dir, config)
  # The state's structure does not depend on how each round's tree is chosen (but for the
  # acceptance counts it may carry, `initial_acceptance`); adaptive speculation gets its
  # measured costs once the parameters exist.
  tc = config.fixed_tree().train_config()
  optimizer = config.optimizer()
  optimizer_schedule = config.optim.schedule(config.steps)  # what the optimizer steps with
  tok = config.task.tokenizer
  for guess in getattr(tok, "guesses", ()):  # what the tokenizer's files did not say
    log(f"tokenizer {tok.source}: {guess}")
  train_records = task_records(config.task, "train")
  in_jax = config.task.reward_in_jax
  reward = config.task.reward if in_jax else host_reward(config, train_records, pool)
  test_records = task_records(config.task, "test")
  test_records = test_records[:config.eval.prompts]
  prompts = config.rollout.prompts_per_step
  # Whole batches (shapes, measurements), and the rows this process's devices hold.
  reader = PromptReader(train_records, batch_size=prompts, pad_id=tok.pad_id,
                        seed=config.seed)
  _check_lengths(config, tc, reader.padded_len,
                 max((len(r["prompt"]) for r in test_records), default=0))
  mine = process_prompts(reader, mesh)
  batch_shardings = prompt_batch_shardings(reader.batch_at(0), mesh)
  feed = lambda position: global_batch(mine(position), batch_shardings, prompts)
  ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=config.checkpoint.keep)
  _check_bank_fits(config, tc)
  abstract = abstract_state(config, tc, optimizer, reader.batch_at(0))
  shardings = train_state_shardings(abstract, mesh, tc)
  restored = ckpt.restore(with_shardings(abstract, shardings))
  metrics_file = run_dir / "metrics.jsonl"
  disaggregated = split = None
  if rollout_mesh is not None:
    log(f"disaggregated async: rollouts on {rollout_mesh.size} device(s), updates on "
        f"{mesh.size}, policy lag {config.pipeline.policy_lag}")
  if restored is None:
    trained = ("" if abstract.adapters is None else
               f", {count_params(abstract.adapters):,} of them trained (LoRA rank "
               f"{config.lora.rank} on {', '.join(adapted_targets(config.model, config.lora))})")
    log(f"policy: {count_params(abstract.params):,} parameters{trained}")
    params = initial_policy(config, log)
    head = None
    if tc.eagle3 is not None:
      head = initial_eagle3_head(params, config, log)
      if lead:
        save_eagle3(run_dir / "eagle3_initial", head.params, tc.eagle3.config,
                    np.asarray(head.d2t))
    elif tc.draft_model is not None:
      head = draft_model_params(config, log)
    state = init_train_state(tc, params, optimizer, config.seed, drafter_params=head)
    state = state.replace(acceptance=config.initial_acceptance())
    # Evaluated and measured placed as after RL (`local_copy`): those programs compile once.
    local = local_copy({"params": params, "drafter": head})
    params, head = local["params"], local["drafter"]
    costs = _shared_costs(lambda: rollout_costs(params, config, reader.batch_at(0), head, log))
    tc = config.train_config(costs=costs)
    position = 0
    if rollout_mesh is not None:
      disaggregated = DisaggregatedAsync(tc, reward, optimizer, rollout_mesh, mesh,
                                         policy_lag=config.pipeline.policy_lag,
                                         pad_id=tok.pad_id, host_reward=not in_jax)
      disaggregated.start(state, reader.batch_at(position))
      state = disaggregated.state()
      position = reader.next_position(position)
    elif config.pipeline.async_mode:
      state = distribute(state, shardings.replace(pending=None))
      if in_jax:
        prime = sharded_prime_fn(tc, reward, shardings, batch_shardings, pad_id=tok.pad_id)
      else:  # the step that primes holds the pending rollout's reward means for the next
        split = make_split_step(tc, reward, optimizer, pad_id=tok.pad_id,
                                state_sharding=shardings)
        prime = split.prime
      state = prime(state, feed(position))
      position = reader.next_position(position)
    else:
      state = distribute(state, shardings)
    log(f"evaluating the warm-started policy on {len(test_records)} held-out prompts (greedy "
        "and sampled) and its drafter's acceptance")
    meta = {"step": 0, "position": position,
            "accuracy_before": evaluate(params, config, test_records, pool=pool),
            "sampled_accuracy_before": evaluate(params, config, test_records, sampled=True,
                                                pool=pool),
            "probe_acceptance_before": probe_acceptance(params, config, test_records,
                                                        drafter_params=head)}
    _check_finite(0, {}, state, config, last_checkpoint=None)
    if split is not None:  # its first rollout's rewards, scored in the background
      state = split.settled(state)
    elif disaggregated is not None:
      state = disaggregated.settled()
    ckpt.save(0, state, meta | _pending_metrics(split or disaggregated))
    if lead:
      with storage(metrics_file, "metrics file"):
        metrics_file.write_text("")
  else:
    state, meta, step = restored
    log(f"resumed from {ckpt.directory} at step {step}")
    local = local_copy({"params": _policy(state), "drafter": state.rollout_drafter_params})
    costs = _shared_costs(lambda: rollout_costs(local["params"], config, reader.batch_at(0),
                                                local["drafter"], log))
    tc = config.train_config(costs=costs)
    if rollout_mesh is not None:
      disaggregated = DisaggregatedAsync(tc, reward, optimizer, rollout_mesh, mesh,
                                         policy_lag=config.pipeline.policy_lag,
                                         pad_id=tok.pad_id, host_reward=not in_jax)
      disaggregated.start(state)
    if lead:
      # Drop metrics logged after the checkpoint: those steps run again, identically (but
      # for a disaggregated run at policy_lag > 1: see ExperimentConfig.policy_lag).
      kept = kept_metrics(metrics_file, meta["step"], log)
      with storage(metrics_file, "metrics file"):
        metrics_file.write_text("".join(line + "\n" for line in kept))
  log(f"held-out accuracy before RL: greedy {meta['accuracy_before']:.3f}, sampled "
      f"{meta['sampled_accuracy_before']:.3f}")

  writer = None
  if lead:
    writer = MetricsLog(run_dir, config.log, config_record(config))
  if disaggregated is None and in_jax:
    train_step = sharded_train_step(tc, reward, optimizer, shardings, batch_shardings,
                                    pad_id=tok.pad_id,
                                    samples=SAMPLES if config.log.samples_every else 0)
  elif disaggregated is None:
    train_step = split if split is not None else make_split_step(
        tc, reward, optimizer, pad_id=tok.pad_id, state_sharding=shardings)
  stepper = train_step if disaggregated is None else disaggregated
  if restored is not None and isinstance(stepper, (SplitStep, DisaggregatedAsync)):
    # What the pending rollout's host rewards add to the metrics of the next step.
    stepper.pending_metrics = dict(meta.get(PENDING_METRICS, {}))
  if meta["step"] < config.steps:
    log("compiling the GRPO step (the first step's time includes it)")
  # One set of rollout arms for the timings along training and the final measurement.
  arms = rollout_arms(config, reader.batch_at(0), costs)
  unseen = (PromptReader(test_records, batch_size=prompts, pad_id=tok.pad_id).batch_at(0)
            if len(test_records) >= prompts else None)
  time_arms = _arm_timer(config, arms, reader.batch_at(0), unseen)
  position, last_checkpoint = meta["position"], meta["step"]
  try:
    with contextlib.ExitStack() as files:
      # Unbuffered: each record reaches the file in one write, so a kill leaves at most a
      # truncated last line (which resuming drops).
      if lead:
        with storage(metrics_file, "metrics file"):
          out = files.enter_context(open(metrics_file, "ab", buffering=0))
      bar = files.enter_context(tqdm.trange(meta["step"], config.steps, desc="grpo",
                                            initial=meta["step"], total=config.steps,
                                            disable=not lead))
      for step in bar:
        start = time.perf_counter()
        if disaggregated is None:
          state, metrics = train_step(state, feed(position))
        else:
          metrics = disaggregated.step(reader.batch_at(position))
          state = disaggregated.state()
        metrics = jax.device_get(metrics)
        elapsed = time.perf_counter() - start
        samples = metrics.pop("samples", None)  # a fused step's first rows, for the log
        _check_finite(step + 1, metrics, state, config, last_checkpoint)
        position = reader.next_position(position)
        record = {"step": step + 1, "position": position, **jsonable(metrics),
                  "step_time_s": elapsed,
                  "rollout_tokens_per_s": float(metrics["rollout_tokens"]) / elapsed}
        if time_arms is not None and (step + 1) % config.eval.arms_every == 0:
          record |= time_arms(state, step + 1)
        if lead:
          with storage(metrics_file, "metrics file"):
            out.write((json.dumps(record) + "\n").encode())
          lr = float(optimizer_schedule(step))
          writer.scalars(step + 1, tensorboard_scalars(record, learning_rate=lr))
          every = config.log.samples_every
          if every and (step + 1) % every == 0:
            shown = (reward.samples if getattr(reward, "samples", None)
                     else _decoded_samples(samples, tok))
            if shown:
              writer.text(step + 1, "samples", _samples_text(shown))
        bar.set_postfix(reward=f"{record['reward_mean']:.2f}",
                        accept=f"{record['acceptance_length']:.2f}")
        if (step + 1) % config.checkpoint.every == 0 or step + 1 == config.steps:
          # Async with host rewards: the pending rollout's rewards, waited for.
          if disaggregated is not None:
            state = disaggregated.settled()
          elif isinstance(train_step, SplitStep):
            state = train_step.settled(state)
          ckpt.save(step + 1, state, {**meta, "step": step + 1, "position": position,
                                      **_pending_metrics(stepper)})
          last_checkpoint = step + 1
  except BaseException as err:
    if writer is not None:
      writer.abandon()
    if isinstance(err, StorageError):
      raise StorageError(f"{err}. The run stopped; its checkpoint step {last_checkpoint} in "
                         f"{ckpt.directory} is intact: free space (or fix the directory) and "
                         "rerun the same command to resume from it") from err
    raise
  if lead:
    writer.close()

  log(f"evaluating the trained policy on {len(test_records)} held-out prompts, then timing "
      "its rollouts speculative vs plain")
  # `drafter`: what the rollout's drafter reads (a history bank, its own weights, or both);
  # `weights`: its own weights alone, to save.
  final = local_copy({"params": _policy(state), "drafter": state.rollout_drafter_params,
                      "weights": state.drafter_weights, "acceptance": state.acceptance})
  params, head, weights = final["params"], final["drafter"], final["weights"]
  summary = {"accuracy_before": meta["accuracy_before"],
             "accuracy_after": evaluate(params, config, test_records, pool=pool),
             "sampled_accuracy_before": meta["sampled_accuracy_before"],
             "sampled_accuracy_after": evaluate(params, config, test_records, sampled=True,
                                               pool=pool),
             "probe_acceptance_before": meta["probe_acceptance_before"],
             "probe_acceptance_after": probe_acceptance(params, config, test_records,
                                                        drafter_params=head)}
  if tc.eagle3 is not None and lead:
    # The head RL started from, frozen, on the final policy: what online training bought.
    _, frozen, d2t = load_eagle3(run_dir / "eagle3_initial", config.model)
    summary["probe_acceptance_after_frozen"] = probe_acceptance(
        params, config, test_records,
        drafter_params=Eagle3Weights(params=frozen, d2t=jnp.asarray(d2t, jnp.int32)))
    save_eagle3(run_dir / "eagle3", weights.params, tc.eagle3.config, np.asarray(weights.d2t))
  if tc.trains_draft_model and lead:
    # The draft model as it came, on the final policy; the distilled one kept for export.
    summary["probe_acceptance_after_frozen"] = probe_acceptance(
        params, config, test_records, drafter_params=draft_model_params(config, log=None))
    save_hf(weights, tc.draft_model.config, run_dir / DRAFT_MODEL_DIR)
  summary |= rollout_speedup(params, config, reader.batch_at(0), head, costs,
                             final["acceptance"], arms=arms)
  # The simulator drafts at the acceptance measured for the run's own drafter on training
  # prompts (its acceptance arm) where there is one: the held-out probe's prompts were never
  # answered before, so a history drafter's probe says nothing about its rollouts.
  sim_acceptance, sim_source = summary["probe_acceptance_after"], "probe"
  if lead:
    history = [json.loads(line) for line in metrics_file.read_text().splitlines() if line]
    summary["acceptance_first"] = float(np.mean([h["acceptance_length"]
                                                 for h in history[:5]]))
    summary["acceptance_last"] = float(np.mean([h["acceptance_length"] for h in history[-5:]]))
    summary |= part_acceptance(history) | arm_summary(history)
    own = f"arm_acceptance_{config.drafter.name}_mean"
    if own in summary:
      sim_acceptance, sim_source = summary[own], "arm"
  if jax.default_backend() == "cpu" and lead:  # what an accelerator makes of this rollout
    try:
      summary |= simulated_speedup(config, summary["prompt_length"],
                                   summary["response_lengths"], sim_acceptance)
      summary["simulated_acceptance_source"] = sim_source
    except ConfigError as err:  # e.g. a policy too large for one device: the run still ends
      log(f"no simulated speedup for this run: {err}")
  if lead:
    with storage(run_dir / "summary.json", "summary"):
      (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    with storage(run_dir / "curves.png", "plot"):
      plot_curves(history, run_dir / "curves.png")
  ckpt.close()
  return summary


def _arm_timer(config: ExperimentConfig, arms: dict[str, Any], batch, unseen=None):
  """With `eval.arms_every`, a `(state, step) -> {rollout_s_<arm>: seconds, ...}` that times
  one call of each of `arms` (`rollout_arms`) on the state's policy (every process calls it:
  the policy is gathered), the first call compiling the arms untimed, and measures the
  acceptance of each of `eval.arm_drafters` on `batch` (`arm_acceptance`). The history arms
  are measured on `unseen` too (held-out prompts, a batch of them, or None): prompts the bank
  has never seen, so they draft from other prompts' answers (`arm_acceptance_<name>_unseen`).
  None without `eval.arms_every`."""
  if not config.eval.arms_every:
    return None
  compiled = []
  probes = acceptance_arms(config, batch) if config.eval.arm_drafters else {}
  first_seen = tuple(n for n in config.eval.arm_drafters if n.startswith("history"))
  unseen_probes = ({} if unseen is None or not first_seen else acceptance_arms(
      dataclasses.replace(config, eval=dataclasses.replace(config.eval,
                                                           arm_drafters=first_seen)), unseen))

  def time_arms(state: TrainState, step: int) -> dict[str, float]:
    local = local_copy({"params": _policy(state), "drafter": state.rollout_drafter_params,
                        "acceptance": state.acceptance, "history": state.history})
    args = (arms, local["params"], local["drafter"], jax.random.key(step), local["acceptance"])
    if not compiled:
      compiled.append(rollout_arm_seconds(*args))
    key = jax.random.fold_in(jax.random.key(step), 1)
    held_out = arm_acceptance(unseen_probes, local["params"], local["history"], key)
    return (rollout_arm_seconds(*args)
            | arm_acceptance(probes, local["params"], local["history"], key)
            | {f"{name}_unseen": value for name, value in held_out.items()})
  return time_arms
