"""The `specjax` command.

  specjax train --config configs/arithmetic_tiny.py [--steps 300 --grpo.group-size 8 ...]
  specjax train --config FILE --mesh.fsdp 2 --coordinator-address HOST:PORT --num-processes 2 \
                --process-id I     # one of several processes (GPU / CPU clusters)
  specjax train-drafter --config configs/eagle3_arithmetic.py [--steps 600 --ttt-steps 4 ...]
  specjax train-drafter --target-dir HF_DIR --gsm8k-file train.jsonl --run-dir runs/head
  specjax generate --demo                      # train the built-in tiny model, then decode
  specjax generate --checkpoint DIR --prompt "Hello" --drafter mtp --widths 2 1
  specjax generate --demo --adaptive --widths 1 1 1  # each round picks plain / chain 1-3
  specjax simulate --model qwen3-8b --devices 32xGB200 --draft-length 3 --acceptance 3.3
  specjax sim calibrate --out profile.json     # measure this machine for --profile-json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import runpy
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import tyro

from specjax.checks import is_int
from specjax.decoding import (Adaptive, DraftSource, DraftTree, SamplingConfig, build_drafter,
                              calibrate, check_draft_source, default_drafter, generate)
from specjax.decoding.policy import describe
from specjax.errors import CheckpointError, ConfigError, SpecjaxError
from specjax.hub import local_checkpoint
from specjax.timing import interleaved
from specjax.sharding import MESH_AXES
from specjax.tokenizer import with_bos

DEMO_PROMPTS = ("7,10,13,", "100,125,150,", "3,4,5,", "988,990,992,")


def generate_command(
    checkpoint: str | None = None,
    prompt: tuple[str, ...] = (),
    demo: bool = False,
    drafter: str | None = None,
    draft_checkpoint: str | None = None,
    widths: tuple[int, ...] = (1, 1, 1),
    adaptive: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    max_new_tokens: int = 64,
    seed: int = 0,
    compare: bool = True,
    repeats: int = 3,
    demo_steps: int = 400,
) -> None:
  """Generate text, speculatively, and print it with acceptance statistics.

  Args:
    checkpoint: a HuggingFace model directory (config.json, *.safetensors, tokenizer.json).
      Prompts start with the tokenizer's BOS when it has one; a row stops at any end id of
      the tokenizer, generation_config.json or config.json (`eos_token_id`, an id or a list).
    prompt: prompts to continue (one batch row each), all after one --prompt: --prompt 'a' 'b'.
    demo: train the built-in tiny counting model (about a minute on CPU) and use it.
    drafter: where drafts come from, a registered name (`specjax.decoding.drafter_names`:
      none, draft-model, eagle3, group, group+mtp, group+eagle3, group+draft-model, history,
      history+mtp, medusa, mtp, ngram, and any `register_drafter` added);
      "none" is plain autoregressive decoding. Default: what the model supports with no
      weights of its own (`default_drafter`: its MTP modules, its Medusa heads, else n-gram
      lookup, which any checkpoint can use).
    draft_checkpoint: the drafter's own weights: an HF draft model's directory
      (--drafter draft-model, group+draft-model) or an EAGLE-3 head's (--drafter eagle3,
      group+eagle3).
    widths: draft tree, children per node at each depth; (1, 1, 1) is a chain of 3.
    adaptive: each round runs plain decoding, a chain of 1 .. depth drafts or the widths
      tree, whichever is expected to be fastest (costs measured first, cached on disk).
    temperature: 0 for greedy.
    top_k: keep the k most likely tokens (0 = off).
    top_p: nucleus mass (1 = off).
    max_new_tokens: tokens to generate per prompt.
    seed: PRNG seed.
    compare: also run plain decoding in the same engine and print the speedup.
    repeats: timed runs of each (after a first run that compiles), more until each has run
      for a second; speculative and plain runs take turns, and the figures are medians.
    demo_steps: training steps of the demo model.
  """
  if not demo and checkpoint is None:
    raise SystemExit("pass --checkpoint DIR or --demo")
  if not demo and not prompt:
    raise SystemExit("pass at least one --prompt")
  if draft_checkpoint is not None:  # a Hub id: its snapshot (specjax.hub)
    draft_checkpoint = str(local_checkpoint(draft_checkpoint, "--draft-checkpoint"))
  if drafter is None and draft_checkpoint is not None:
    raise ConfigError(f"--draft-checkpoint={draft_checkpoint!r} needs --drafter to say what it "
                      "holds: draft-model (an HF draft model) or eagle3 (an EAGLE-3 head)")
  if drafter is not None:
    check_draft_source(drafter, draft_checkpoint, "--drafter", "--draft-checkpoint")
  # Checked before a checkpoint is loaded or the demo model trained (a minute on CPU), so a
  # bad flag fails in a second rather than after the slow part.
  sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
  tree = DraftTree.from_widths(widths) if drafter != "none" else None
  if adaptive and drafter == "none":  # a default drafter is never "none"
    raise ConfigError("--adaptive is invalid with --drafter none: the policy chooses among a "
                      "drafter's trees and plain decoding, and there is no drafter; name one, "
                      "or drop --adaptive")
  if not is_int(max_new_tokens) or max_new_tokens < 1:
    raise ConfigError(f"max_new_tokens={max_new_tokens!r} is invalid: must be an int >= 1")
  if not is_int(repeats) or repeats < 1:
    raise ConfigError(f"repeats={repeats!r} is invalid: must be an int >= 1")
  if demo:
    from specjax.experiments import demo as demo_lib
    print("training the built-in demo model (counting text, 3 MTP heads)...")
    params, config = demo_lib.train_demo_model(demo_lib.DemoTraining(steps=demo_steps))
    tokenizer = demo_lib.TOKENIZER
    prompt = prompt or DEMO_PROMPTS
    bos_id, eos_id = None, tokenizer.eos_id  # the demo model is trained without BOS
  elif checkpoint is not None:
    checkpoint = str(local_checkpoint(checkpoint, "--checkpoint"))  # a Hub id: its snapshot
    _check_hf_checkpoint(checkpoint)
    from specjax.models.hf import eos_token_ids, load_hf
    from specjax.tokenizer import HFTokenizer, check_vocab_fits
    tokenizer = HFTokenizer.from_dir(checkpoint)
    params, config = load_hf(checkpoint)
    check_vocab_fits(tokenizer, config.vocab_size)
    # Not config.json's bos_token_id: Qwen's names <|endoftext|> there, yet its prompts
    # start without one (its tokenizer_config.json says bos_token null).
    bos_id = tokenizer.bos_id
    # Chat checkpoints end a turn on one id and a document on another (Llama 3: <|eot_id|>,
    # <|end_of_text|>); stopping on the tokenizer's EOS alone runs past the turn's end.
    eos_id = tuple(dict.fromkeys(tokenizer.eos_ids + eos_token_ids(checkpoint)))
    for guess in tokenizer.guesses:  # what the checkpoint's files did not say
      print(f"tokenizer: {guess}")

  if drafter is None:
    drafter = default_drafter(config)
    print(f"drafter {drafter}: the default for this model (--drafter to choose another)")
  encoded = [with_bos(tokenizer.encode(p), bos_id) for p in prompt]
  for p, e in zip(prompt, encoded):
    if not e:  # decoding continues a prompt's last token: it needs one
      raise ConfigError(f"prompt={p!r} is invalid: it encodes to no tokens (and the tokenizer "
                        "has no BOS to start it); allowed a prompt of at least one token")
  width = max(len(e) for e in encoded)
  tokens = np.full((len(encoded), width), tokenizer.pad_id, np.int32)
  for i, e in enumerate(encoded):
    tokens[i, :len(e)] = e
  lengths = np.array([len(e) for e in encoded], np.int32)
  draft, draft_params = build_drafter(drafter, DraftSource(config, draft_checkpoint))
  speculation = None
  if adaptive:
    speculation = Adaptive.up_to(tree)
    speculation = speculation.with_costs(calibrate(
        params, config, draft, speculation, batch_sizes=(len(encoded),), prompt_len=width,
        max_new_tokens=max_new_tokens, drafter_params=draft_params, sampling=sampling,
        verbose=True))
    tree = None
  key = jax.random.key(seed)
  run = lambda d, t, spec=None: generate(
      params, config, jnp.asarray(tokens), jnp.asarray(lengths), key,
      max_new_tokens=max_new_tokens, sampling=sampling, drafter=d, tree=t, speculation=spec,
      eos_id=eos_id, drafter_params=draft_params)

  # Compiling the loop takes seconds on a CPU (the adaptive one most): say so, never go quiet.
  print(f"compiling {'plain' if draft is None else 'speculative'} decoding for "
        f"{len(encoded)} prompt(s)...")
  spec = jax.block_until_ready(run(draft, tree, speculation))
  tokens_of = lambda result: int(np.asarray(result.lengths).sum())  # waits for the result
  arms = [lambda r: tokens_of(run(draft, tree, speculation))]
  compare = compare and draft is not None
  if compare:
    print("compiling plain decoding in the same engine...")
    jax.block_until_ready(run(None, None))
    arms.append(lambda r: tokens_of(run(None, None)))
  print(f"timing {'both in turn, ' if compare else ''}{repeats}+ runs "
        f"{'each ' if compare else ''}(medians)...")
  seconds, generated = interleaved(arms, repeats, seconds=1.0)
  rates = [np.asarray(n) / s for n, s in zip(generated, seconds)]
  for p, row, n in zip(prompt, np.asarray(spec.tokens), np.asarray(spec.lengths)):
    print(f"{p!r} -> {tokenizer.decode(row[:n].tolist())!r}")
  stats = spec.stats
  print(f"drafter {drafter}, tree widths {widths if tree else ()}: {generated[0][-1]} tokens in "
        f"{np.median(seconds[0]):.4f}s ({np.median(rates[0]):.0f} tok/s, median of "
        f"{len(seconds[0])}), {int(stats.rounds)} rounds, "
        f"{float(stats.tokens_per_round):.2f} tokens per row-round, acceptance per depth "
        f"{np.round(np.asarray(stats.accepted_per_depth), 2).tolist()}")
  if speculation is not None:
    print("rounds per tree: " + ", ".join(
        f"{describe(t)} {n}" for t, n in zip(speculation.menu, np.asarray(stats.tree_rounds)))
        + f" (in {int(stats.segments)} runs of one tree)")
    if speculation.plain_throughout((len(encoded),), max_new_tokens):
      print("no tree is expected to pay at these costs even at the prior acceptance, so the "
            "policy decodes plainly without the drafter (the same program as plain decoding)")
  if compare:
    print(f"plain decoding, same engine: {generated[1][-1]} tokens in "
          f"{np.median(seconds[1]):.4f}s ({np.median(rates[1]):.0f} tok/s); speculative / "
          f"plain throughput = {np.median(rates[0] / rates[1]):.2f}x (median of the runs' "
          "ratios)")


def _check_hf_checkpoint(path: str) -> None:
  """Refuse a directory that is not an HF checkpoint before its files are read one by one: a
  `specjax train` run directory (its config.json is the run's), or one without config.json."""
  from specjax.models.hf import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE
  directory = Path(path)
  weights = (directory / WEIGHTS_FILE).is_file() or (directory / INDEX_FILE).is_file()
  if (directory / "checkpoints").is_dir() and not weights:
    raise CheckpointError(f"--checkpoint {path}: a specjax train run directory, not an HF "
                          f"checkpoint; export its policy first: specjax export {path} OUT, "
                          "then --checkpoint OUT")
  if not (directory / CONFIG_FILE).is_file():
    raise CheckpointError(f"--checkpoint {path}: no config.json there: not an HF checkpoint "
                          "directory (config.json, *.safetensors, tokenizer.json)")


def load_experiment(path: str):
  """`get_config()` of a config file (a small Python file, see configs/).

  Raises:
    ConfigError: the file does not run (a syntax error, a failed import, an exception in
      `get_config`), naming the file, the line and the error, which it chains (the traceback
      with SPECJAX_TRACEBACK=1). A `SpecjaxError` of the config itself passes unchanged.
  """
  if not Path(path).is_file():
    raise SystemExit(f"--config {path}: no such file; pass a config file such as "
                     "configs/arithmetic_tiny.py")
  try:
    namespace = runpy.run_path(path)
    if "get_config" not in namespace:
      raise SystemExit(f"{path} defines no get_config(); see configs/arithmetic_tiny.py")
    return namespace["get_config"]()
  except SpecjaxError:
    raise
  except Exception as err:
    what = err.msg if isinstance(err, SyntaxError) else err  # its str repeats file and line
    raise ConfigError(f"--config {path}{_config_line(path, err)}: {type(err).__name__}: "
                      f"{what}") from err


def _config_line(path: str, err: Exception) -> str:
  """", line N": where in config file `path` `err` was raised (its syntax error's line, or
  the file's last frame in the traceback); "" when none is in the file."""
  same = lambda file: os.path.abspath(file or "") == os.path.abspath(path)
  if isinstance(err, SyntaxError) and same(err.filename) and err.lineno:
    return f", line {err.lineno}"
  lines = [f.lineno for f in traceback.extract_tb(err.__traceback__) if same(f.filename)]
  return f", line {lines[-1]}" if lines else ""


# Where the acceptance a CPU run's simulated speedup drafts at was measured.
_SIM_SOURCES = {"probe": "the probe's", "arm": "the training prompts' (acceptance arm, mean)"}


def train_command(argv: list[str]) -> dict:
  """`specjax train --config FILE [--field value ...]`: any config field can be overridden.

  On several processes every process runs the same command line (with its own
  `--process-id`, or the cluster's environment): `jax.distributed` is joined first
  (`specjax.rl.join_cluster`), then the run shards its train state over the mesh of all
  processes' devices (`--mesh.data/fsdp/tensor/expert`). Only process 0 prints.
  """
  from specjax.rl.distributed import DEFAULT_CLUSTER_TIMEOUT_S, check_same_config, join_cluster
  parser = argparse.ArgumentParser(
      prog="specjax train", add_help=False,
      usage="specjax train --config FILE [--field value ...] (--config FILE --help lists the "
            "fields)")
  parser.add_argument("--config", help="a config file, e.g. configs/arithmetic_tiny.py")
  parser.add_argument("--coordinator-address", default=None,
                      help="HOST:PORT of process 0 (default: $JAX_COORDINATOR_ADDRESS)")
  parser.add_argument("--num-processes", type=int, default=None,
                      help="processes of the run (default: $JAX_NUM_PROCESSES)")
  parser.add_argument("--process-id", type=int, default=None,
                      help="this process, 0 .. N - 1 (default: $JAX_PROCESS_ID)")
  parser.add_argument("--cluster-timeout", type=int, default=DEFAULT_CLUSTER_TIMEOUT_S,
                      help="seconds to wait for process 0 and for all processes to join "
                           f"(default {DEFAULT_CLUSTER_TIMEOUT_S})")
  known, rest = parser.parse_known_args(argv)
  if known.config is None:
    if "-h" in rest or "--help" in rest:  # the fields are the config file's: listed with it
      print(parser.format_help())
      return {}
    parser.error("the following arguments are required: --config")
  try:
    # Before anything touches a device: jax.distributed must come first.
    join_cluster(known.coordinator_address, known.num_processes, known.process_id,
                 timeout_s=known.cluster_timeout)
  except ConfigError as err:
    raise SystemExit(f"specjax train: {err}") from None
  from specjax.experiments.grpo import ExperimentConfig, run
  from specjax.experiments.measure import speedup_text
  from specjax.experiments.run_record import config_record
  default = load_experiment(known.config)
  if not isinstance(default, ExperimentConfig):
    # tyro would ignore a default of another type and run ExperimentConfig's own defaults.
    raise SystemExit(f"{known.config}: get_config() returns a {type(default).__name__}; "
                     "train needs an ExperimentConfig (see configs/arithmetic_tiny.py)")
  config = tyro.cli(ExperimentConfig, default=default, args=rest,
                    prog=f"specjax train --config {known.config}")
  try:  # before the run's first collective: different programs would stall in it
    check_same_config(config_record(config))
  except ConfigError as err:
    raise SystemExit(f"specjax train: {err}") from None
  # Flushed: a run piped into a file or `tee` says what it is doing when it does it.
  summary = run(config, log=functools.partial(print, flush=True))
  if jax.process_index() != 0:
    return summary
  print(summary_table(summary))
  print(f"(every figure in {Path(config.run_dir) / 'summary.json'})")
  print(f"held-out accuracy, greedy: {summary['accuracy_before']:.3f} before RL -> "
        f"{summary['accuracy_after']:.3f} after; at the rollout temperature (8 samples per "
        f"prompt): {summary['sampled_accuracy_before']:.3f} -> "
        f"{summary['sampled_accuracy_after']:.3f}")
  print(f"drafter acceptance length on a fixed 16-token probe: "
        f"{summary['probe_acceptance_before']:.2f} before RL -> "
        f"{summary['probe_acceptance_after']:.2f} after (online drafter training)")
  acceptance = (f"acceptance length {summary['acceptance_length']:.2f}"
                if summary["acceptance_length"] > 0 else "no tokens generated")
  line = (f"rollout speedup, speculative / plain in the same engine and run"
          f"{' (both compacted)' if 'compaction_speedup' in summary else ''}: "
          f"{speedup_text(summary)} at {acceptance}")
  if summary.get("plain_share", 0.0) == 1.0:
    line += (" (the speculation policy ran plain decoding in every round: at this batch size "
             "no draft tree's measured cost is paid back by its expected tokens)")
  elif "plain_share" in summary:
    line += f" (plain decoding in {100 * summary['plain_share']:.0f}% of rounds)"
  print(line)
  if "compaction_speedup" in summary and summary.get("speedup_measured", True):
    print(f"rollout arms from the same run: plain without compaction "
          f"{summary['uncompacted_tokens_per_s']:.0f} tokens/s, plain with compaction "
          f"{summary['plain_tokens_per_s']:.0f} ({speedup_text(summary, 'compaction_speedup')}), "
          f"speculative with compaction {summary['spec_tokens_per_s']:.0f} "
          f"({speedup_text(summary, 'total_speedup')}); {100 * summary['tail_share']:.0f}% of "
          "plain decoding's rounds ran with at most a quarter of the rows live")
  if "simulated_generation_speedup" in summary:
    print(f"simulated on one {summary['simulated_device']} (specjax.sim, a prediction, not a "
          f"measurement): speculative / plain rollout "
          f"{summary['simulated_generation_speedup']:.2f}x for this run's shapes and lengths at "
          f"{_SIM_SOURCES[summary.get('simulated_acceptance_source', 'probe')]} acceptance length "
          f"{summary['simulated_acceptance']:.2f} (other devices: "
          f"specjax simulate --response-lengths {Path(config.run_dir) / 'summary.json'} ...)")
  return summary


def summary_table(summary: dict) -> str:
  """A GRPO run's summary as a short table: what RL changed, then the rollout's speed."""
  rows = [("held-out accuracy, greedy", "accuracy_before", "accuracy_after"),
          ("held-out accuracy, sampled", "sampled_accuracy_before", "sampled_accuracy_after"),
          ("drafter acceptance (probe)", "probe_acceptance_before", "probe_acceptance_after"),
          ("acceptance in rollouts, first / last 5 steps", "acceptance_first",
           "acceptance_last")]
  rows += [(f"  in rounds {key.removeprefix('acceptance_').removesuffix('_first')} drafted", key,
            key.removesuffix("_first") + "_last")
           for key in sorted(summary) if key.startswith("acceptance_") and key.endswith("_first")
           and key != "acceptance_first"]
  width = max(len(r[0]) for r in rows)
  lines = [f"{'':<{width}}  {'before':>8}  {'after':>8}"]
  lines += [f"{name:<{width}}  {summary[a]:>8.3f}  {summary[b]:>8.3f}" for name, a, b in rows
            if a in summary and b in summary]
  if "probe_acceptance_after_frozen" in summary:
    lines.append(f"{'  the EAGLE-3 head kept frozen':<{width}}  {'':>8}  "
                 f"{summary['probe_acceptance_after_frozen']:>8.3f}")
  lines.append(f"rollout tokens/s: plain {summary['plain_tokens_per_s']:.0f}, speculative "
               f"{summary['spec_tokens_per_s']:.0f}")
  return "\n".join(lines)


def train_drafter_command(argv: list[str]) -> dict:
  """`specjax train-drafter [--config FILE] [--field value ...]`: offline EAGLE-3 training
  (`specjax.experiments.drafter`); without --config the fields start at their defaults."""
  from specjax.experiments.drafter import DrafterTrainConfig, run_drafter_training
  parser = argparse.ArgumentParser(prog="specjax train-drafter", add_help=False)
  parser.add_argument("--config", help="a config file, e.g. configs/eagle3_arithmetic.py")
  known, rest = parser.parse_known_args(argv)
  default = DrafterTrainConfig()
  prog = "specjax train-drafter"
  if known.config is not None:
    default = load_experiment(known.config)
    prog += f" --config {known.config}"
    if not isinstance(default, DrafterTrainConfig):
      raise SystemExit(f"{known.config}: get_config() returns a {type(default).__name__}; "
                       "train-drafter needs a DrafterTrainConfig (see "
                       "configs/eagle3_arithmetic.py)")
  config = tyro.cli(DrafterTrainConfig, default=default, args=rest, prog=prog)
  summary = run_drafter_training(config)  # logs its results as it goes
  print(f"(every figure in {Path(config.run_dir) / 'summary.json'})")
  return summary


def export_command(argv: list[str]) -> None:
  """`specjax export RUN_DIR OUT`: the run's latest policy as an HF checkpoint directory
  (weights, config.json, tokenizer; `OUT/eagle3` for a run's final EAGLE-3 head)."""
  parser = argparse.ArgumentParser(prog="specjax export", description=export_command.__doc__)
  parser.add_argument("run_dir", help="a specjax train run directory")
  parser.add_argument("out", help="the HF checkpoint directory to write (replaced if it exists)")
  args = parser.parse_args(argv)
  from specjax.experiments.export import export_run
  export_run(args.run_dir, args.out)


COMMANDS = {
    "train": "GRPO with speculative rollouts from a config file: specjax train --config "
             "configs/arithmetic_tiny.py [--field value ...] (--help lists the fields); on "
             "several processes add --coordinator-address HOST:PORT --num-processes N "
             "--process-id I (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID; "
             "none on a TPU pod slice)",
    "train-drafter": "train an EAGLE-3 draft head offline: specjax train-drafter [--config "
                     "FILE] [--field value ...]",
    "export": "write a specjax train run's latest policy as an HF checkpoint with its tokenizer "
              "(and its EAGLE-3 head): specjax export RUN_DIR OUT",
    "generate": "generate text (speculatively) from a checkpoint and print acceptance "
                "statistics: specjax generate --help",
    "plan": "per-device memory and FLOPs of a config's train step, compiled for N fake "
            "devices beside an analytical estimate: specjax plan --config FILE --devices N "
            "[--hbm-gib G --mesh.fsdp S ...]",
    "simulate": "project an RL step's time with plain and speculative rollouts on given "
                "accelerators (specjax.sim): specjax simulate --help",
    "sim": "simulator tools: specjax sim calibrate [--out FILE] measures this machine's "
           "device profile (for specjax simulate --profile-json)",
}
# `specjax sim SUBCOMMAND`: what each does (the performance simulator's tools).
SIM_COMMANDS = {
    "calibrate": "measure this machine (matmuls, bandwidth, a decode step) and write its "
                 "DeviceProfile as JSON: specjax sim calibrate --help",
}


def plan_command(argv: list[str]) -> int:
  """`specjax plan --config FILE --devices N [--hbm-gib G] [--mesh.data/fsdp/tensor/expert S]
  [--model.remat POLICY] [--lora.rank R]`: print the plan; the mesh flags override the config's
  mesh axis by axis, `--model.remat` its rematerialisation, `--lora.rank` its LoRA rank (0:
  full-parameter training). Returns the exit status (0 fits, 1 does not fit)."""
  parser = argparse.ArgumentParser(
      prog="specjax plan",
      description="Compile a config's GRPO train step for N fake CPU devices with abstract "
                  "parameters and print per-device memory (compiled and analytical), FLOPs and "
                  "whether it fits.")
  parser.add_argument("--config", required=True, help="a config file, e.g. "
                      "configs/qwen3_1p7b_grpo.py")
  parser.add_argument("--devices", type=int, required=True,
                      help="accelerators to plan for (compiled on as many fake CPU devices)")
  parser.add_argument("--hbm-gib", type=float, default=80.0,
                      help="memory per accelerator in GiB (default 80: H100 / A100 80GB)")
  for axis in MESH_AXES:
    parser.add_argument(f"--mesh.{axis}", type=int, default=None, dest=axis,
                        help=f"mesh {axis} size (-1: the devices the other axes leave); "
                             "default the config's")
  parser.add_argument("--model.remat", default=None, dest="remat",
                      choices=("none", "dots", "full"),
                      help="per-layer rematerialisation of the update (default the config's)")
  parser.add_argument("--lora.rank", type=int, default=None, dest="lora_rank",
                      help="train LoRA adapters of this rank on the frozen policy (0: every "
                           "parameter); default the config's")
  args = parser.parse_args(argv)
  from specjax.experiments.grpo_config import ExperimentConfig
  from specjax.experiments.plan import fake_devices, plan

  # Before anything touches a device: the fake device count is fixed when JAX starts.
  try:
    jax.config.update("jax_platforms", "cpu")
    devices = fake_devices(args.devices)
  except ConfigError as err:
    raise SystemExit(f"specjax plan: {err}") from None
  config = load_experiment(args.config)
  overrides = {a: getattr(args, a) for a in MESH_AXES if getattr(args, a) is not None}
  try:
    mesh = None
    if overrides and isinstance(config, ExperimentConfig):
      mesh = dataclasses.replace(config.mesh, **overrides)
    if args.remat is not None and isinstance(config, ExperimentConfig):
      config = dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                     remat=args.remat))
    if args.lora_rank is not None and isinstance(config, ExperimentConfig):
      config = dataclasses.replace(config, lora=dataclasses.replace(config.lora,
                                                                    rank=args.lora_rank))
    print(f"compiling {args.config}'s train step for {args.devices} fake CPU device(s), with "
          "abstract parameters (a minute or two for a billion-parameter model)", flush=True)
    result = plan(config, devices, mesh, args.hbm_gib, name=args.config)
  except ConfigError as err:
    raise SystemExit(f"specjax plan --config {args.config}: {err}") from None
  print(result.format())
  sys.stdout.flush()
  return 0 if result.fits else 1


def _usage() -> str:
  width = max(map(len, COMMANDS))
  lines = [f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()]
  return "\n".join(["usage: specjax {" + ",".join(COMMANDS) + "} ...", "", "commands:"] + lines)


def _sim_usage() -> str:
  width = max(map(len, SIM_COMMANDS))
  lines = [f"  {name:<{width}}  {text}" for name, text in SIM_COMMANDS.items()]
  return "\n".join(["usage: specjax sim {" + ",".join(SIM_COMMANDS) + "} ...", "",
                    "commands:"] + lines)


# `specjax sim calibrate --quick`: the smallest shapes that still fit both efficiency curves.
_QUICK_CALIBRATION = dict(matmul_dim=256, matmul_rows=(1, 64), copy_megabytes=16,
                          decode_cases=((128, 1, 1), (512, 1, 1)), repeats=2)


def sim_calibrate_command(argv: list[str]) -> int:
  """Measure this machine (`calibrate_profile`) and write the profile as JSON."""
  parser = argparse.ArgumentParser(prog="specjax sim calibrate",
                                   description=sim_calibrate_command.__doc__)
  parser.add_argument("--out", default="device_profile.json")
  parser.add_argument("--dtype", default=None, help="float32 / bfloat16 (default by platform)")
  parser.add_argument("--quick", action="store_true",
                      help="small shapes, 2 repeats: a rough profile in a few seconds (to try "
                           "the command; its small matmuls run from the caches on a CPU)")
  args = parser.parse_args(argv)
  out = Path(args.out).absolute()
  if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
    # Checked before measuring (a minute), not when the profile is written.
    parser.error(f"--out {args.out}: its directory {out.parent} does not exist or is not "
                 "writable; allowed a file in an existing, writable directory")
  from specjax.experiments.device_profile import calibrate_profile  # starts JAX
  profile = calibrate_profile(dtype=args.dtype, **(_QUICK_CALIBRATION if args.quick else {}))
  Path(args.out).write_text(profile.to_json())
  print(f"{profile.name}: {profile.peak_flops / 1e9:.1f} GFLOP/s, "
        f"{profile.hbm_bw / 1e9:.1f} GB/s copy, mem_eff {profile.mem_eff:.2f}, "
        f"layer overhead {profile.layer_overhead_s * 1e6:.0f} us -> {args.out}")
  return 0


def sim_command(argv: list[str]) -> int:
  """`specjax sim SUBCOMMAND ...`: the simulator's tools other than `simulate` itself."""
  if not argv or argv[0] in ("-h", "--help"):
    print(_sim_usage(), file=sys.stdout if argv else sys.stderr)
    return 0 if argv else 2
  if argv[0] not in SIM_COMMANDS:
    print(f"specjax sim: unknown command {argv[0]!r}\n\n{_sim_usage()}", file=sys.stderr)
    return 2
  return sim_calibrate_command(argv[1:])


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] in ("-h", "--help"):
    print(_usage(), file=sys.stdout if argv else sys.stderr)
    if not argv:
      raise SystemExit(2)
    return
  if argv[0] not in COMMANDS:
    print(f"specjax: unknown command {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
    raise SystemExit(2)
  if argv[0] == "train":
    train_command(argv[1:])
    return
  if argv[0] == "train-drafter":
    train_drafter_command(argv[1:])
    return
  if argv[0] == "export":
    export_command(argv[1:])
    return
  if argv[0] == "plan":
    status = plan_command(argv[1:])
    if status:
      raise SystemExit(status)
    return
  if argv[0] in ("simulate", "sim"):
    # Pure Python and NumPy (JAX only for calibrate): its own argparse, no tyro.
    from specjax.sim.cli import simulate_main
    status = simulate_main(argv[1:]) if argv[0] == "simulate" else sim_command(argv[1:])
    if status:
      raise SystemExit(status)
    return
  repeated = [a for a in argv if a == "--prompt" or a.startswith("--prompt=")]
  if argv[0] == "generate" and len(repeated) > 1:
    # tyro would keep the last one's prompts alone and drop the others without a word.
    raise SystemExit(f"specjax generate: --prompt given {len(repeated)} times; give every "
                     "prompt after one --prompt: --prompt 'first' 'second' ...")
  tyro.extras.subcommand_cli_from_dict(
      {"generate": generate_command}, args=argv,
      description="specjax train --config FILE | train-drafter [--config FILE] | generate")


def run() -> None:
  """The `specjax` command: `main`, with a failure specjax diagnosed (a `SpecjaxError`: bad
  input, an unusable checkpoint or directory, ...) printed as one line naming it, exit status
  1, instead of a traceback. SPECJAX_TRACEBACK=1 shows the traceback too."""
  try:
    main()
  except SpecjaxError as err:
    if os.environ.get("SPECJAX_TRACEBACK") == "1":
      raise
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    print(f"specjax {command}: {type(err).__name__}: {err}", file=sys.stderr)
    raise SystemExit(1) from None


if __name__ == "__main__":
  run()
