"""What a GRPO run measures besides training: held-out accuracy, the drafter's acceptance,
the cost of each speculation menu entry at the rollout's shapes, and the rollout speedup of
speculative over plain decoding in the same engine and run.

Each takes the run's `ExperimentConfig` and the policy's parameters; `grpo.run` calls
them before and after RL, and a user can call them on any checkpoint of a run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.decoding import (AcceptanceCounts, CostTable, Eagle3Weights, SamplingConfig, calibrate,
                              generate)
from specjax.decoding.calibrate import default_cache_dir
from specjax.decoding.drafters.group import with_group_size
from specjax.decoding.drafters.history import history_drafter
from specjax.decoding.inputs import check_prompt_values
from specjax.decoding.loop_state import compaction_buckets
from specjax.errors import ConfigError
from specjax.experiments.grpo_config import ExperimentConfig
from specjax.files import write_text_atomic
from specjax.rl.data import PromptReader
from specjax.rl.datasets import host_scores
from specjax.rl.reward_workers import RewardPool
from specjax.rl.tasks import decode_completions
from specjax.sim.devices import device_profile
from specjax.sim.model import ModelSpec
from specjax.sim.parallel import Cluster
from specjax.sim.speculation import Speculation
from specjax.sim.step import Schedule, compare
from specjax.sim.workload import Empirical, Workload
from specjax.timing import interleaved

# The simulator's drafter for each drafter a run can name (None: it has no model of it).
# Group drafting is a lookup in text, free like n-gram drafting; with MTP behind it a round
# costs MTP's drafting.
_SIM_DRAFTERS = {"mtp": "mtp", "eagle3": "eagle3", "draft-model": "draft-model",
                 "group+eagle3": "eagle3", "group+draft-model": "draft-model",
                 "history+eagle3": "eagle3", "history+draft-model": "draft-model",
                 "ngram": "ngram", "group": "ngram", "group+mtp": "mtp", "history": "ngram",
                 "history+mtp": "mtp"}


def evaluate(params, config: ExperimentConfig, records: list[dict], *, sampled: bool = False,
             samples: int = 8, pool: RewardPool | None = None) -> float:
  """Held-out accuracy (fraction of responses with reward at least the task's
  `success_reward`, 1 for the built-in tasks): greedy, or the mean over `samples` responses
  per prompt drawn at the rollout temperature. A Python-reward task's `records` carry their
  `Example`s (`grpo.task_records`); its functions are called over `pool`'s workers."""
  tok = config.task.tokenizer
  reader = PromptReader(records, batch_size=len(records), pad_id=tok.pad_id, shuffle=False)
  batch = reader.batch_at(0)
  k = samples if sampled else 1
  sampling = SamplingConfig(config.rollout.temperature) if sampled else SamplingConfig(0.0)
  out = generate(params, config.model, np.repeat(batch.tokens, k, 0),
                 np.repeat(batch.lengths, k, 0), jax.random.key(config.seed + 1),
                 max_new_tokens=config.rollout.max_new_tokens, sampling=sampling,
                 eos_id=config.eos_ids,
                 pad_id=tok.pad_id)
  task = config.task
  if task.reward_in_jax:
    rewards = task.reward(out.tokens, out.lengths, np.repeat(batch.answers, k, 0))
    rewards = rewards[0] if isinstance(rewards, tuple) else rewards  # (total, parts)
  else:
    completions = decode_completions(tok, out.tokens, out.lengths)
    rewards, _ = host_scores(task, [r["example"] for r in records for _ in range(k)],
                             completions, out.tokens, out.lengths, pool)
  return float((np.asarray(rewards) >= getattr(task, "success_reward", 1.0)).mean())


def probe_room(max_position: int, width: int, nodes: int) -> int:
  """The tokens `probe_acceptance` can generate after prompts of `width` tokens with a tree of
  `nodes` nodes; a `ConfigError` when not even one fits."""
  room = max_position - width - nodes - 1
  if room < 1:
    raise ConfigError(f"model.max_position={max_position} is invalid: the acceptance probe "
                      f"(probe_acceptance) decodes prompts of {width} tokens with a {nodes}-node "
                      f"draft tree, which needs at least {width + nodes + 2} positions; allowed "
                      "a larger max_position, a smaller tree or shorter prompts")
  return room


def probe_acceptance(params, config: ExperimentConfig, records: list[dict],
                     tokens: int = 16, drafter_params: Eagle3Weights | None = None) -> float:
  """Mean acceptance length of the speculative rollout's tree (`rollout.tree_widths`, also with
  adaptive speculation) on held-out prompts, generating a fixed `tokens` per row (no EOS):
  it compares drafters on equal work even when the policy's response lengths change during
  training. `tokens` is clipped to what the model's `max_position` leaves after the longest
  prompt and the tree (the same for every call on the same records and config).

  Raises:
    ConfigError: not even one token fits.
  """
  rc = config.fixed_tree().train_config().rollout
  if rc.drafter is None:
    return 1.0
  drafter = with_group_size(rc.drafter, 1)  # one row per held-out prompt: no siblings
  tok = config.task.tokenizer
  batch = PromptReader(records, batch_size=len(records), pad_id=tok.pad_id,
                       shuffle=False).batch_at(0)
  tokens = min(tokens, probe_room(config.model.max_position, batch.tokens.shape[1],
                                  rc.tree.num_nodes))
  out = generate(params, config.model, batch.tokens, batch.lengths,
                 jax.random.key(config.seed + 2), max_new_tokens=tokens,
                 sampling=rc.sampling, drafter=drafter, tree=rc.tree, pad_id=tok.pad_id,
                 drafter_params=drafter_params)
  return float(out.stats.tokens_per_round)


def rollout_costs(params, config: ExperimentConfig, batch, drafter_params: Any = None,
                  log=print) -> CostTable | None:
  """With adaptive speculation: the seconds per round of each menu entry at the rollout's
  shapes (`batch` prompts x G rows).

  Measured once per run (or read from the calibration cache) and kept in the run directory
  (`speculation_costs.json`): a resumed run chooses its trees from the same table, so it
  reproduces the uninterrupted run.
  """
  if config.rollout.speculation != "adaptive" or config.drafter.name == "none":
    return None
  kept = Path(config.run_dir) / "speculation_costs.json"
  menu = config.adaptive().menu
  rows = batch.tokens.shape[0] * config.grpo.group_size
  if kept.exists():
    costs, why = _kept_costs(kept, len(menu),
                             compaction_buckets(rows, config.rollout.compaction))
    if costs is not None:
      log(f"speculation costs per round, as measured when this run started ({kept}):\n"
          f"{costs.format(menu)}")
      return costs
    log(f"{kept}: {why}; measuring the costs again (the resumed run may choose other trees "
        "than the uninterrupted one would have)")
  rc = config.fixed_tree().train_config().rollout
  log(f"measuring what a round of each of the {len(menu)} speculation menu entries costs at "
      f"{rows} rows{' and each compacted batch' if config.rollout.compaction else ''} (about "
      "a minute per batch size on a CPU; cached for the next run)")
  start = time.perf_counter()
  costs = calibrate(params, config.model, rc.drafter, config.adaptive(),
                    batch_sizes=compaction_buckets(rows, config.rollout.compaction),
                    prompt_len=batch.tokens.shape[1], max_new_tokens=config.rollout.max_new_tokens,
                    drafter_params=drafter_params, sampling=rc.sampling)
  write_text_atomic(kept, json.dumps(dataclasses.asdict(costs)))
  log(f"speculation costs per round ({time.perf_counter() - start:.0f}s; also cached in "
      f"{default_cache_dir()}):\n{costs.format(menu)}")
  return costs


def _kept_costs(path: Path, entries: int, rows: tuple[int, ...]
                ) -> tuple[CostTable | None, str]:
  """The run's kept cost table, or None and why it cannot be used: damaged, or measured
  for another menu or batch (a table is never rescaled to other shapes)."""
  try:
    costs = CostTable(**json.loads(path.read_text()))
  except (OSError, ValueError, TypeError) as err:  # ConfigError is a ValueError
    return None, f"unreadable or damaged ({type(err).__name__}: {err})"
  if len(costs.seconds) != entries or tuple(costs.batches) != tuple(rows):
    return None, (f"measured for {len(costs.seconds)} menu entries at batch "
                  f"{tuple(costs.batches)}, this run has {entries} at {tuple(rows)}")
  return costs, ""


def tail_round_share(row_rounds, live_fraction: float = 0.25) -> float:
  """The fraction of a call's rounds run with at most `live_fraction` of its rows still
  generating, from each row's rounds (`GenerationStats.row_rounds` of a plain call: every row
  is live from round 0 until its last)."""
  rounds = np.sort(np.asarray(row_rounds))[::-1]
  if not rounds.size or rounds[0] <= 0:
    return 0.0
  few = int(np.floor(live_fraction * rounds.size))  # round t has few or fewer live rows
  if few >= rounds.size:  # once rounds[few] rows, counted from the longest, have finished
    return 1.0
  return float((rounds[0] - rounds[few]) / rounds[0])


def rollout_arms(config: ExperimentConfig, batch, costs: CostTable | None = None
                 ) -> dict[str, Any]:
  """The rollout's arms on `batch` (B = prompts x G rows), each `(params, drafter_params, key,
  acceptance=None) -> GenerationResult`: plain decoding with the rollout's compaction
  (`plain`), the run's speculative decoding with it (`spec`; `costs` for adaptive
  speculation) and, when the rollout compacts, plain decoding without compaction
  (`uncompacted`). With drafter "none" plain and spec are both plain decoding.

  `acceptance`: the train state's counts (`TrainState.acceptance`, None where the run does
  not carry them). The speculative arm starts from them as the run's next rollout would,
  scaled by the rollout's carry: what a GRPO step's rollout costs, not a first call's that
  spends its first rounds finding out what the drafter accepts. The plain arms ignore them.
  """
  g = config.grpo.group_size
  tokens = jnp.repeat(batch.tokens, g, 0)
  lengths = jnp.repeat(batch.lengths, g, 0)
  # Checked once here: the compiled arms do not check them call by call.
  check_prompt_values(batch.tokens, batch.lengths, vocab_size=config.model.vocab_size,
                      shortest=1)
  names = ("plain", "spec") + (("uncompacted",) if config.rollout.compaction else ())
  arms = {}
  for name in names:
    rc = config.train_config("none" if name != "spec" else None, costs).rollout

    def arm(params, drafter_params, key, acceptance=None, rc=rc, name=name):
      # The speculative arm starts where the step's rollout would; plain arms have no policy.
      carried = rc.carried(acceptance) if rc.speculation is not None else None
      return generate(params, config.model, tokens, lengths, key,
                      max_new_tokens=rc.max_new_tokens, sampling=rc.sampling,
                      drafter=rc.drafter, tree=rc.tree, speculation=rc.speculation,
                      eos_id=rc.eos_id, compaction=0 if name == "uncompacted" else rc.compaction,
                      drafter_params=drafter_params if rc.drafter else None, acceptance=carried,
                      check_values=False)
    # Compiled whole, as the train step runs its rollout: no arm pays `generate`'s host-side
    # checks per call (milliseconds, and more for the speculative arm's) in its timing.
    arms[name] = jax.jit(arm)
  return arms


def acceptance_arms(config: ExperimentConfig, batch) -> dict[str, Any]:
  """For each drafter of `config.eval.arm_drafters`, a compiled `(params, bank, key) ->
  (all [], tail [])` that drafts a fixed chain of the rollout's tree on `batch` (B = prompts x
  G rows, sampled as the rollout is, the rollout's compaction): its tokens per row-round over
  all rounds, and over the longest quarter of the rows (the rows the tail rounds run; their
  own rounds, all of them). `bank` is the train state's `HistoryBank` (None without): the
  history drafters read it, the others ignore it."""
  g = config.grpo.group_size
  tokens = jnp.repeat(batch.tokens, g, 0)
  lengths = jnp.repeat(batch.lengths, g, 0)
  check_prompt_values(batch.tokens, batch.lengths, vocab_size=config.model.vocab_size,
                      shortest=1)
  fixed = config.fixed_tree()
  arms = {}
  for name in config.eval.arm_drafters:
    rc = fixed.train_config(name).rollout

    def arm(params, bank, key, rc=rc):
      reads = history_drafter(rc.drafter) is not None
      out = generate(params, config.model, tokens, lengths, key,
                     max_new_tokens=rc.max_new_tokens, sampling=rc.sampling,
                     drafter=rc.drafter, tree=rc.tree, eos_id=rc.eos_id,
                     compaction=rc.compaction, drafter_params=bank if reads else None,
                     check_values=False)
      rounds, emitted = out.stats.row_rounds, jnp.maximum(out.lengths - 1, 0)
      longest = jnp.argsort(-rounds)[:max(rounds.shape[0] // 4, 1)]
      tail = emitted[longest].sum() / jnp.maximum(rounds[longest].sum(), 1)
      return out.stats.tokens_per_round, tail.astype(jnp.float32)
    arms[name] = jax.jit(arm)
  return arms


def arm_acceptance(arms: dict[str, Any], params, bank, key: jax.Array) -> dict[str, float]:
  """One call of each of `acceptance_arms` on the current policy (and history `bank`, or
  None): `arm_acceptance_<name>` and `arm_tail_acceptance_<name>`."""
  out = {}
  for name, arm in arms.items():
    every, tail = jax.device_get(arm(params, bank, key))
    out[f"arm_acceptance_{name}"] = float(every)
    out[f"arm_tail_acceptance_{name}"] = float(tail)
  return out


def rollout_arm_seconds(arms: dict[str, Any], params, drafter_params, key: jax.Array,
                        acceptance: AcceptanceCounts | None = None) -> dict[str, float]:
  """One call of each of `rollout_arms` on the current policy, back to back, the same key
  (and the state's `acceptance` counts): `rollout_s_<arm>`, the seconds each took. Along
  training (`eval.arms_every`) this shows what speculation and compaction buy as the policy
  moves; the arms are compiled by their first call, so call this once untimed first."""
  out = {}
  for name, arm in arms.items():
    start = time.perf_counter()
    jax.block_until_ready(arm(params, drafter_params, key, acceptance))
    out[f"rollout_s_{name}"] = time.perf_counter() - start
  return out


def rollout_speedup(params, config: ExperimentConfig, batch,
                    drafter_params: Eagle3Weights | None = None,
                    costs: CostTable | None = None,
                    acceptance: AcceptanceCounts | None = None,
                    arms: dict[str, Any] | None = None) -> dict[str, Any]:
  """Rollout tokens per second of plain and speculative decoding, same engine, same prompts
  (B = prompts x G rows); `costs` for adaptive speculation (`rollout_costs`); `acceptance`,
  the train state's counts, which the speculative arm starts from as the run's rollouts do.

  The arms are `rollout_arms`: `plain` and `spec` with the rollout's compaction, and
  `uncompacted` plain decoding when it compacts (`arms`: `rollout_arms(config, batch, costs)`
  built earlier, e.g. for timings along training, so they are not compiled again). Each
  repeat runs every arm back to back, first in turn
  (`eval.speedup_repeats` repeats, or more until each arm has run `eval.speedup_seconds`), so
  that a slow spell of a shared machine hits all alike. `*_tokens_per_s` are medians over
  the repeats; each ratio is the median of the repeats' own ratios, which a machine whose
  speed drifts between repeats disturbs less (docs/experiments.md):
  `speedup` = spec / plain, speculation's own gain; with compaction, `compaction_speedup` =
  plain / uncompacted and `total_speedup` = spec / uncompacted. `tail_share`: the fraction of
  the uncompacted plain call's rounds with at most a quarter of its rows live. With adaptive
  speculation, `plain_share` is the fraction of speculative rounds that ran plain decoding.
  `response_lengths` (the plain arm's last call, row by row) and `prompt_length` (mean) are
  the shape `simulated_speedup` takes.
  """
  compaction = config.rollout.compaction
  wanted = ("plain", "spec") + (("uncompacted",) if compaction else ())
  if arms is not None and (not isinstance(arms, dict) or set(arms) != set(wanted)):
    raise ConfigError(f"arms={arms!r} is invalid: must be rollout_arms(config, batch, costs) "
                      f"for this config, a dict of the arms {', '.join(wanted)}")
  named = arms if arms is not None else rollout_arms(config, batch, costs)
  names = wanted  # in this order whatever the dict's: the statistics below are read by place
  calls = [functools.partial(named[name], params, drafter_params, acceptance=acceptance)
           for name in names]
  for call in calls:
    jax.block_until_ready(call(jax.random.key(0)))  # compile

  def run(arm, r: int):
    """One timed call (key r + 1: each repeat draws its own responses; the compile used key
    0): its statistics and response lengths, kept for every repeat, not its `[B, T]` outputs.
    Nothing else runs inside the timing: a reduction here would compile on its first use and
    charge that to whichever arm ran first."""
    out = jax.block_until_ready(arm(jax.random.key(r + 1)))
    return out.stats, out.lengths

  seconds, runs = interleaved([functools.partial(run, call) for call in calls],
                              config.eval.speedup_repeats, config.eval.speedup_seconds)
  tokens = [np.array([np.asarray(call[1]).sum() for call in calls]) for calls in runs]
  rates = dict(zip(names, (n / s for n, s in zip(tokens, seconds))))
  last = [calls[-1][0] for calls in runs]  # each arm's last call's statistics
  stats = last[1]  # the speculative arm's
  summary = {"plain_tokens_per_s": float(np.median(rates["plain"])),
             "spec_tokens_per_s": float(np.median(rates["spec"])),
             **_ratio("speedup", rates["spec"], rates["plain"]),
             "acceptance_length": float(stats.tokens_per_round),
             "speedup_repeats": len(seconds[0]),
             "arm_call_s": float(min(np.median(s) for s in seconds))}
  # A ratio of a few millisecond calls on a shared machine is noise: too few repeats, or too
  # little time in an arm, and the run says so instead of printing it as a speedup.
  summary["speedup_measured"] = bool(
      summary["speedup_repeats"] >= MIN_SPEEDUP_REPEATS
      and min(float(np.sum(s)) for s in seconds) >= MIN_ARM_SECONDS)
  if compaction:
    summary |= {"uncompacted_tokens_per_s": float(np.median(rates["uncompacted"])),
                **_ratio("compaction_speedup", rates["plain"], rates["uncompacted"]),
                **_ratio("total_speedup", rates["spec"], rates["uncompacted"]),
                "tail_share": tail_round_share(last[2].row_rounds)}
  rounds = np.asarray(stats.tree_rounds, np.float64)
  if len(rounds) > 1:
    summary["plain_share"] = float(rounds[0] / max(rounds.sum(), 1.0))
  summary["response_lengths"] = [int(n) for n in np.asarray(runs[0][-1][1])]  # plain's last
  summary["prompt_length"] = float(np.mean(np.asarray(batch.lengths)))
  return summary


# What a rollout speedup needs before it is reported as one (`rollout_speedup`).
MIN_SPEEDUP_REPEATS = 3
MIN_ARM_SECONDS = 0.2


def _ratio(name: str, a: np.ndarray, b: np.ndarray) -> dict[str, float]:
  """`name`: the median over repeats of a / b (rates of two arms, repeat by repeat), with
  `name_low` and `name_high`, the smallest and largest repeat's: its spread."""
  per_repeat = a / b
  return {name: float(np.median(per_repeat)), f"{name}_low": float(per_repeat.min()),
          f"{name}_high": float(per_repeat.max())}


def speedup_text(summary: dict[str, Any], name: str = "speedup") -> str:
  """How a run states `rollout_speedup`'s ratio `name`: with its spread over the repeats, as
  1.0 within that spread when speculation never drafted or the spread holds 1, and as too
  short to measure when the arms ran too few repeats or too little time."""
  if not summary.get("speedup_measured", True):
    return (f"too short to measure ({summary['speedup_repeats']} repeat(s), "
            f"{1e3 * summary['arm_call_s']:.1f} ms a call; a ratio needs >= "
            f"{MIN_SPEEDUP_REPEATS} repeats and >= {MIN_ARM_SECONDS:g} s in each arm: raise "
            f"eval.speedup_repeats or eval.speedup_seconds)")
  value, low, high = (summary[name], summary.get(f"{name}_low", summary[name]),
                      summary.get(f"{name}_high", summary[name]))
  text = f"{value:.2f}x (repeats {low:.2f}-{high:.2f})"
  if low <= 1.0 <= high:
    text += ", 1.0 within its spread"
  return text


def simulated_speedup(config: ExperimentConfig, prompt_length: float,
                      response_lengths: list[int], acceptance: float,
                      device: str = "H200") -> dict[str, Any]:
  """What `specjax.sim` predicts for this run's rollout on one `device`: the policy's
  architecture, its step's prompts x G rows, the measured `prompt_length` (mean) and
  `response_lengths`, and the drafter as a chain of the rollout tree's depth at mean
  acceptance length `acceptance` (e.g. the probe's), chosen round by round like the run's
  policy (adaptive) or every round (fixed). A prediction, not a measurement: for a CPU run
  it says whether the speedup the run could not show here would appear on an accelerator.

  Returns `{}` where the simulator has no model of the drafter (Medusa, a registered one) or
  the run has none, else `simulated_device`, `simulated_acceptance` and
  `simulated_generation_speedup` (speculative / plain rollout time).

  Raises:
    ConfigError: the rollout does not fit one `device` (the simulator's memory check).
  """
  name = _SIM_DRAFTERS.get(config.drafter.name)
  if name is None or not response_lengths:
    return {}
  depth = len(config.rollout.tree_widths)
  acceptance = float(min(max(acceptance, 1.0), depth + 1.0))
  target = ModelSpec.from_model_config(config.model, "policy")
  draft = (ModelSpec.from_model_config(config.draft_model_config(), "draft model")
           if name == "draft-model" else None)
  workload = Workload(config.rollout.prompts_per_step, config.grpo.group_size,
                      max(int(round(prompt_length)), 1),
                      Empirical(tuple(max(int(n), 1) for n in response_lengths)))
  result = compare(target, Cluster(device_profile(device), 1), workload,
                   Speculation.chain(name, depth, acceptance=acceptance, draft_model=draft),
                   Schedule())
  which = "adaptive" if config.rollout.speculation == "adaptive" else "fixed"
  return {"simulated_device": device, "simulated_acceptance": acceptance,
          "simulated_generation_speedup": result.speedup(which, "generation")}
