"""`specjax simulate`: one RL step's breakdown with plain and speculative rollouts.

  simulate_main(["--model", "qwen3-8b", "--devices", "32xGB200", "--rollout-batch", "512",
                 "--group-size", "16", "--draft-length", "3", "--acceptance", "3.3"])
  ... --async --policy-lag 2 --rollout-devices 16 --train-devices 16
  ... --sweep draft-length-x-acceptance --out sweep.png
  ... --sweep devices-x-model --sweep-devices 8,16,32,64 --sweep-models qwen3-8b,qwen3-32b
  simulate_main(["--reference"])   # the reference system's 8B table reproduced, 235B projected
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import sys
from typing import Sequence

from specjax.checks import is_int
from specjax.errors import ConfigError
from specjax.sim.devices import DEVICE_NAMES, parse_devices
from specjax.sim.hardware import DeviceProfile
from specjax.sim.model import ModelSpec
from specjax.sim.parallel import Cluster
from specjax.sim.presets import MODELS, default_draft_model, model_spec
from specjax.sim.reference import reference_report
from specjax.sim.speculation import DRAFTERS, MenuEntry, Speculation
from specjax.sim.step import STAGES, Schedule, StepBreakdown, compare, simulate_step
from specjax.sim.sweep import (METRICS, SWEEPS, save_heatmap, sweep_devices_models,
                               sweep_draft_acceptance)
from specjax.sim.workload import Empirical, Fixed, Lognormal, Workload

_HEADERS = {"data": "data", "prepare": "prepare", "generation": "generation",
            "reward": "reward", "logprob": "log-prob", "training": "training", "sync": "sync"}


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="specjax simulate", description=__doc__.split("\n")[0])
  a = p.add_argument
  a("--model", default="qwen3-8b",
    help=f"one of {', '.join(MODELS)}, or a checkpoint directory (its config.json; "
         "./NAME for one named like a preset)")
  a("--devices", default="8xH200", help=f"COUNTxNAME, NAME one of {', '.join(DEVICE_NAMES)}")
  a("--profile-json",
    help="a DeviceProfile JSON (`specjax sim calibrate`) instead of the spec sheet")
  a("--rollout-devices", type=int, help="split sets: devices generating (with --train-devices)")
  a("--train-devices", type=int, help="split sets: devices training")
  a("--rollout-replica", type=int, help="devices per rollout replica (default: smallest fit)")
  a("--rollout-batch", type=int, default=128, help="prompts per step")
  a("--group-size", type=int, default=16, help="responses per prompt (G)")
  a("--prompt-len", type=int, default=256)
  a("--response-len", type=float, default=2048.0, help="median response length")
  a("--response-sigma", type=float, default=0.8,
    help="log-space spread of the lognormal lengths (0: every response --response-len long)")
  a("--max-response-len", type=int, default=8192, help="length cap (max new tokens)")
  a("--response-lengths", help="file of measured response lengths (JSON list, one per line, "
                                "or a `specjax train` run's summary.json)")
  a("--greedy", action="store_true", help="argmax decoding: the sampler makes no random draw")
  a("--drafter", default="eagle3", choices=DRAFTERS)
  a("--draft-model",
    help="preset or checkpoint directory of the draft model (--drafter draft-model)")
  a("--draft-length", type=int, help="draft tokens per round, k (default 3)")
  a("--acceptance", type=float, help="mean acceptance length (tokens per round, <= k + 1)")
  a("--acceptance-per-depth", type=float, nargs="+", help="acceptance probability per depth")
  a("--acceptance-from", metavar="SUMMARY[:ARM]",
    help="the mean acceptance a `specjax train` run measured: its summary.json's acceptance "
         "arm ARM (arm_acceptance_ARM_mean, e.g. history, history_unseen, group), else the "
         "acceptance its own simulation used; history and group drafting draft as --drafter "
         "ngram does (no model)")
  a("--tree", action="append", default=[],
    help="a tree for the adaptive menu, WIDTHS:E (children per node per depth, tokens/round), "
         "e.g. 3,1,1:3.6")
  a("--online-drafter-training", action="store_true")
  a("--async", dest="asynchronous", action="store_true",
    help="rollout of later steps overlaps training (split sets)")
  a("--policy-lag", type=int, default=1)
  a("--epochs", type=int, default=1)
  a("--reference-logprobs", action="store_true", help="a KL reference: a second log-prob pass")
  a("--data-s", type=float, default=0.0)
  a("--prepare-s", type=float, default=0.0)
  a("--reward-s", type=float, default=0.0)
  a("--reference", action="store_true",
    help="reproduce the reference system's Qwen3-8B step table (one fitted factor) and project "
         "its Qwen3-235B-A22B case; every other flag is ignored")
  a("--sweep", choices=SWEEPS, help="write a heatmap instead of one step's table")
  a("--out", default="sim_sweep.png", help="the sweep's PNG")
  a("--metric", choices=METRICS, default="overall", help="the sweep's speedup: step or rollout")
  a("--sweep-policy", choices=("fixed", "adaptive"), default="fixed")
  a("--draft-lengths", default="1,2,3,4,5,6,8")
  a("--rates", default="0.5,0.6,0.7,0.8,0.85,0.9,0.95")
  a("--sweep-devices", default="8,16,32,64,128")
  a("--sweep-models", default="llama3-8b,qwen3-8b,qwen3-32b,qwen3-235b-a22b")
  return p


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x.strip()]


def _profile(args) -> tuple[DeviceProfile, int]:
  if args.profile_json is None:
    return parse_devices(args.devices)
  count = re.match(r"\s*(\d+)", args.devices or "")
  try:
    profile = DeviceProfile.from_json(pathlib.Path(args.profile_json).read_text())
  except (OSError, UnicodeDecodeError) as error:
    raise ConfigError(f"--profile-json {args.profile_json}: cannot read it ({error})") from None
  except ConfigError as error:
    raise ConfigError(f"--profile-json {args.profile_json}: {error}") from None
  return profile, int(count.group(1)) if count else 1


def _workload(args) -> Workload:
  if args.response_lengths:
    responses = Empirical(_lengths(args.response_lengths))
  elif args.response_sigma == 0:
    responses = Fixed(min(int(round(args.response_len)), args.max_response_len))
  else:
    responses = Lognormal(args.response_len, args.response_sigma, args.max_response_len)
  return Workload(args.rollout_batch, args.group_size, args.prompt_len, responses,
                  greedy=args.greedy)


def _lengths(path: str) -> tuple[int, ...]:
  """Response lengths from a file: a JSON list, one per line, or a `specjax train` run's
  `summary.json` (its plain rollout's `response_lengths`)."""
  try:
    text = pathlib.Path(path).read_text()
    values = json.loads(text) if text.lstrip()[:1] in ("[", "{") else text.split()
  except (OSError, ValueError, OverflowError) as error:
    raise ConfigError(f"--response-lengths {path}: cannot read it ({error})") from None
  if isinstance(values, dict):
    if "response_lengths" not in values:
      raise ConfigError(f"--response-lengths {path}: a JSON object without "
                        "'response_lengths' (a run's summary.json has them)")
    values = values["response_lengths"]
  try:
    lengths = tuple(int(v) if isinstance(v, str) else v for v in values)
  except (TypeError, ValueError):
    lengths = ()
  if not lengths or not all(is_int(n) and n >= 1 for n in lengths):
    raise ConfigError(f"--response-lengths {path}: must hold response lengths, whole numbers "
                      f">= 1, got {str(values)[:60]}")
  return lengths


def _acceptance_from(text: str) -> float:
  """`--acceptance-from SUMMARY[:ARM]`: a run's measured mean acceptance length."""
  path, _, arm = text.partition(":") if not pathlib.Path(text).is_file() else (text, "", "")
  try:
    summary = json.loads(pathlib.Path(path).read_text())
  except (OSError, ValueError) as error:
    raise ConfigError(f"--acceptance-from {text}: cannot read {path} ({error})") from None
  if not isinstance(summary, dict):
    raise ConfigError(f"--acceptance-from {text}: {path} is not a run's summary.json (an "
                      "object)")
  arms = sorted(k.removeprefix("arm_acceptance_").removesuffix("_mean") for k in summary
                if k.startswith("arm_acceptance_") and k.endswith("_mean"))
  key = f"arm_acceptance_{arm}_mean" if arm else "simulated_acceptance"
  value = summary.get(key)
  if not (isinstance(value, (int, float)) and value >= 1):
    raise ConfigError(f"--acceptance-from {text}: {path} has no {key}; allowed arms: "
                      f"{', '.join(arms) or 'none (the run logged no acceptance arms)'}")
  return float(value)


def _tree(text: str) -> MenuEntry:
  match = re.fullmatch(r"\s*([\d,\s]+):\s*([\d.]+)\s*", text)
  if match is None:
    raise ConfigError(f"--tree {text!r} is invalid: write WIDTHS:E, e.g. 3,1,1:3.6")
  widths = tuple(_ints(match.group(1)))
  return MenuEntry(f"tree({','.join(map(str, widths))})", widths, float(match.group(2)))


def _speculation_for(args, model: ModelSpec, rates=None) -> Speculation:
  per_depth = rates if rates is not None else args.acceptance_per_depth
  k = args.draft_length if args.draft_length is not None else (
      len(per_depth) if per_depth else 3)
  if per_depth is None and args.acceptance is None:
    raise ConfigError("pass --acceptance (mean tokens per round) or --acceptance-per-depth")
  if per_depth is not None and args.acceptance is not None and rates is None:
    raise ConfigError("pass one of --acceptance or --acceptance-per-depth, not both")
  draft = None
  if args.drafter == "draft-model":
    draft = model_spec(args.draft_model) if args.draft_model else default_draft_model(model.name)
  return Speculation.chain(args.drafter, k, acceptance=None if per_depth else args.acceptance,
                           per_depth=per_depth, trees=tuple(_tree(t) for t in args.tree),
                           draft_model=draft, online_training=args.online_drafter_training)


def format_steps(steps: Sequence[StepBreakdown]) -> str:
  """The step table: one row per step, seconds per stage and overall."""
  width = max(14, *(len(s.label) for s in steps))
  head = f"{'stage (s)':<{width}}" + "".join(f"{_HEADERS[n]:>11}" for n in STAGES)
  lines = [head + f"{'overall':>11}"]
  for s in steps:
    cells = "".join(f"{v:11.2f}" for v in s.stages().values())
    lines.append(f"{s.label:<{width}}{cells}{s.overall:11.2f}")
  return "\n".join(lines)


def format_rollouts(steps: Sequence[StepBreakdown]) -> str:
  """What each rollout did: rounds, tokens per row-round, and where its seconds went."""
  width = max(14, *(len(s.label) for s in steps))
  lines = [f"{'rollout':<{width}}{'rounds':>8}{'tok/round':>10}{'prefill s':>10}"
           f"{'verify s':>10}{'draft s':>9}{'sample s':>9}{'fixed s':>9}{'tok/s':>11}  menu use"]
  for s in steps:
    r = s.rollout
    use = ", ".join(f"{k} {100 * v:.0f}%" for k, v in r.entry_share().items())
    if r.policy == "adaptive" and not r.drafter:
      use += " (drafter left out: it would not pay)"
    lines.append(f"{s.label:<{width}}{r.rounds:8d}{r.tokens_per_round:10.2f}{r.prefill:10.2f}"
                 f"{r.verify:10.2f}{r.draft:9.2f}{r.sampling:9.2f}{r.overhead:9.2f}"
                 f"{r.tokens_per_second:11.0f}"
                 f"  {use}")
  return "\n".join(lines)


def _run_sweep(args, model: ModelSpec, cluster: Cluster, workload: Workload,
               schedule: Schedule) -> None:
  if args.sweep == "draft-length-x-acceptance":
    draft = None
    if args.drafter == "draft-model":
      draft = model_spec(args.draft_model) if args.draft_model else default_draft_model(
          model.name)
    heatmap = sweep_draft_acceptance(
        model, cluster, workload, args.drafter, _ints(args.draft_lengths),
        [float(r) for r in args.rates.split(",")], schedule, args.sweep_policy, args.metric,
        draft_model=draft)
  else:
    profile = cluster.profile
    models = [model_spec(name.strip()) for name in args.sweep_models.split(",")]
    heatmap = sweep_devices_models(
        models, _ints(args.sweep_devices), lambda n: Cluster(profile, n), workload,
        lambda m: _speculation_for(args, m), schedule, args.sweep_policy, args.metric)
  print(heatmap.format())
  print(f"wrote {save_heatmap(heatmap, args.out)}")


def simulate_main(argv: Sequence[str] | None = None) -> int:
  """Parse `argv` (default: sys.argv[1:]), simulate, print; returns the exit status."""
  parser = _parser()
  args = parser.parse_args(argv)
  if args.acceptance_from is not None:
    if args.acceptance is not None or args.acceptance_per_depth is not None:
      parser.error("pass one of --acceptance, --acceptance-per-depth or --acceptance-from")
    try:
      args.acceptance = _acceptance_from(args.acceptance_from)
    except ConfigError as err:
      parser.error(str(err))
    print(f"acceptance {args.acceptance:.3f} tokens per round, from {args.acceptance_from}")
  if args.draft_length is not None and args.draft_length < 1:
    parser.error(f"--draft-length {args.draft_length} is invalid: must be an int >= 1 (draft "
                 "tokens per round; plain decoding is always simulated beside it)")
  if args.reference:
    print(reference_report())
    return 0
  try:
    model = model_spec(args.model)
    profile, count = _profile(args)
    cluster = Cluster(profile, count, args.rollout_devices, args.train_devices,
                      args.rollout_replica)
    workload = _workload(args)
    schedule = Schedule(asynchronous=args.asynchronous, policy_lag=args.policy_lag,
                        epochs=args.epochs, reference_logprobs=args.reference_logprobs,
                        data_s=args.data_s, prepare_s=args.prepare_s, reward_s=args.reward_s)
    print(f"model     {model.describe()}")
    print(f"devices   {cluster.describe()} [{profile.source or profile.name}]")
    print(f"workload  {workload.describe()}")
    print(f"schedule  {schedule.describe(cluster)}")
    if args.sweep:
      if args.acceptance is None and args.acceptance_per_depth is None:
        args.acceptance_per_depth = [0.8] * (3 if args.draft_length is None
                                             else args.draft_length)
      _run_sweep(args, model, cluster, workload, schedule)
      return 0
    speculation = _speculation_for(args, model)
    print(f"drafter   {speculation.describe()}")
    result = compare(model, cluster, workload, speculation, schedule)
  except ConfigError as error:
    parser.error(str(error))
  steps = [result.plain, result.fixed, result.adaptive]
  baseline = None
  if schedule.asynchronous:
    # What not bothering with async gives: the sync schedule, colocated on all the devices.
    sync = dataclasses.replace(schedule, asynchronous=False, policy_lag=1)
    baseline = simulate_step(model, Cluster(profile, count), workload, None, "plain", sync,
                             "plain sync, colocated")
    steps = [baseline] + steps
  r = result.plain.rollout
  print(f"rollout   {r.replicas} replicas of {r.replica} device(s); the slowest holds {r.rows} "
        f"rows; longest response {int(workload.row_lengths()[0])} tokens\n")
  print(format_steps(steps))
  print()
  print(format_rollouts(steps))
  print()
  for which in ("fixed", "adaptive"):
    label = getattr(result, which).label
    line = (f"{label}: generation {result.speedup(which, 'generation'):.2f}x, "
            f"step {result.speedup(which):.2f}x vs plain")
    if baseline is not None:
      line += f", {baseline.overall / getattr(result, which).overall:.2f}x vs plain sync colocated"
    print(line)
  return 0


if __name__ == "__main__":
  sys.exit(simulate_main())
