"""`specjax train` on a user's own HF checkpoint (a tiny Qwen3 or Llama written by
transformers, with a byte-level BPE tokenizer and a chat template), JSONL data with extra
columns, two Python reward functions and a JAX one, from the command line: per-reward metrics,
resume (also after kill -9), export that transformers loads and decodes as specjax does; bad
inputs fail before any model is loaded."""

import dataclasses
import json
import random
import runpy
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

from specjax.checkpoint import Checkpointer
from specjax.cli import main as cli_main
from specjax.decoding import SamplingConfig, generate
from specjax.errors import ConfigError, RewardError
from specjax.experiments import (Checkpointing, Drafting, ExperimentConfig, Logging, Pipeline,
                                 RolloutEvaluation, RolloutSettings, WarmStart, run)
from specjax.experiments.export import load_policy
from specjax.sharding import MeshConfig
from specjax.models import LoraConfig, ModelConfig
from specjax.models.hf import load_hf
from specjax.optimizers import MasterState
from specjax.rl import GRPOConfig
from specjax.rl.datasets import DatasetTask
from specjax.rl.reward_workers import RewardWorkers
from specjax.rl.rewards import JaxReward, RewardFunction
from specjax.tokenizer import CharTokenizer, HFTokenizer
from support import ROOT, child_env, write_hf_checkpoint

FAMILIES = ("llama", "qwen3", "qwen3_moe")
CONFIG = """
from specjax.experiments import (Checkpointing, Drafting, ExperimentConfig, RolloutEvaluation,
                                 RolloutSettings, WarmStart)
from specjax.rl import GRPOConfig
from specjax.rl.datasets import DatasetTask
from specjax.rl.rewards import JaxReward, RewardFunction
from specjax.tokenizer import HFTokenizer


def has_target(prompts, completions, target):
  return [float(t in c.split()) for c, t in zip(completions, target)]


def brevity(completions, difficulty, **_):
  return [None if d == 0 else -0.1 * len(c.split()) for c, d in zip(completions, difficulty)]


def parity(tokens, lengths, answers):  # in JAX, on the generated ids: differs within groups
  return (tokens[:, 0] % 2).astype("float32")


def get_config():
  task = DatasetTask("{data}", HFTokenizer.from_dir("{ckpt}"),
                     [has_target, RewardFunction(brevity, weight=0.5),
                      JaxReward(parity, weight=0.25)], test_fraction=0.25)
  return ExperimentConfig(
      run_dir="{run}", task=task, policy_dir="{ckpt}", grpo=GRPOConfig(group_size=2), steps=2,
      rollout=RolloutSettings(prompts_per_step=2, max_new_tokens=4),
      drafter=Drafting(name="ngram"), warm_start=WarmStart(steps=0),
      eval=RolloutEvaluation(prompts=4, speedup_repeats=1, speedup_seconds=0),
      checkpoint=Checkpointing(every=1))
"""


@pytest.fixture(scope="module")
def own(tmp_path_factory):
  root = tmp_path_factory.mktemp("own")
  rng = random.Random(0)
  rows = [{"prompt": [{"role": "user", "content": " ".join(rng.choice("abcde")
                                                            for _ in range(3))}],
           "target": rng.choice("abcde"), "difficulty": i % 3} for i in range(40)]
  (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  texts = [r["prompt"][0]["content"] for r in rows] + ["a b c d e"] * 20
  for family in FAMILIES:  # two layers: EAGLE-3 reads two inner layers
    write_hf_checkpoint(root / family, texts, family=family)
    (root / f"config-{family}.py").write_text(
        CONFIG.replace("{data}", str(root / "data.jsonl")).replace("{ckpt}", str(root / family))
        .replace("{run}", str(root / "run")))
  # A second, smaller checkpoint of the same tokenizer, drafting for the policy.
  write_hf_checkpoint(root / "draft", texts, family="llama", seed=1, n_layers=1,
                      tokenizer_from=root / "llama")
  return root


# The draft model is distilled from the policy online; the EAGLE-3 head distilled, then trained.
DRAFTERS = {"draft-model": ["--drafter.name", "draft-model", "--drafter.checkpoint", "{draft}",
                            "--drafter.draft-model-learning-rate", "1e-3"],
            "eagle3": ["--drafter.name", "eagle3", "--drafter.distill-steps", "20"]}


@pytest.mark.parametrize("family, drafter, lora", [
    # All slow: a minute each on 2 cores; the fast tier's own-model run is the JAX-rewards one.
    pytest.param("llama", "draft-model", 0, marks=pytest.mark.slow),
    pytest.param("qwen3", "eagle3", 0, marks=pytest.mark.slow),
    pytest.param("qwen3", "eagle3", 4, marks=pytest.mark.slow),
    # A mixture-of-experts policy (8 experts, top 2), LoRA on its attention projections.
    pytest.param("qwen3_moe", "eagle3", 4, marks=pytest.mark.slow)])
def test_train_resume_and_export_on_an_hf_checkpoint_with_python_rewards(own, capsys, family,
                                                                         drafter, lora):
  run_dir = own / f"run-{family}-lora{lora}"
  flags = [f.replace("{draft}", str(own / "draft")) for f in DRAFTERS[drafter]]
  flags += ["--run-dir", str(run_dir), "--log.samples-every", "1"]
  if lora:  # adapters on the frozen checkpoint, at a rate that moves them in three steps
    flags += ["--lora.rank", str(lora), "--optim.learning-rate", "0.05"]
  config = str(own / f"config-{family}.py")
  cli_main(["train", "--config", config, *flags])
  lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in lines] == [1, 2]
  for record in lines:  # one metric per reward function, beside the total
    assert {"reward_has_target", "reward_brevity", "reward_parity",
            "reward_mean"} <= record.keys()
    assert ("draft_model_kl" in record) == (drafter == "draft-model")
  events = [f.read_bytes() for f in (run_dir / "tensorboard").rglob("*") if f.is_file()]
  assert any(b"**completion**" in e for e in events)  # sample completions as text
  recorded = json.loads((run_dir / "config.json").read_text())
  assert [r["name"] for r in recorded["task"]["rewards"]] == ["has_target", "brevity",
                                                              "parity"]
  assert recorded["task"]["tokenizer"]["source"] == str(own / family)

  cli_main(["train", "--config", config, *flags, "--steps", "3"])  # resumes, drafter and all
  out = capsys.readouterr().out
  assert "resumed from" in out
  lines = (run_dir / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]

  export = own / f"export-{family}"
  cli_main(["export", str(run_dir), str(export)])
  assert (export / "eagle3").is_dir() == (drafter == "eagle3")
  if drafter == "draft-model":  # distilled during the run: exported beside the policy
    trained, _ = load_hf(export / "draft_model")
    original, _ = load_hf(own / "draft")
    assert not np.array_equal(trained["embed"], original["embed"])
    assert (export / "draft_model" / "tokenizer.json").is_file()
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer
  hf_tok = AutoTokenizer.from_pretrained(export)
  messages = [{"role": "user", "content": "a b c"}]
  ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)[
      "input_ids"]
  tok = HFTokenizer.from_dir(own / family)
  assert ids == tok.encode(tok.render_chat(messages))
  model = AutoModelForCausalLM.from_pretrained(export)
  theirs = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                          eos_token_id=tok.eos_id)[0, len(ids):].tolist()
  params, config = load_policy(run_dir)
  ours = generate(params, config, np.array([ids]), np.array([len(ids)]), jax.random.key(0),
                  max_new_tokens=6, sampling=SamplingConfig(0.0), eos_id=tok.eos_id,
                  pad_id=tok.pad_id)
  assert ours.lengths[0] > 0
  assert ours.tokens[0, :ours.lengths[0]].tolist() == theirs[:ours.lengths[0]]
  if lora:  # the export is the checkpoint with the adapters merged into its projections
    base, _ = load_hf(own / family)
    assert recorded["lora"]["rank"] == lora
    assert np.array_equal(params["embed"], base["embed"])
    assert np.array_equal(params["layers"][0]["attn_norm"], base["layers"][0]["attn_norm"])
    adapted = [n for n in recorded["lora"]["targets"] if n in base["layers"][0]]  # MoE: no MLP
    assert adapted == (["wq", "wk", "wv", "wo"] if family == "qwen3_moe"
                       else recorded["lora"]["targets"])
    moved = [float(np.abs(params["layers"][i][n] - base["layers"][i][n]).max())
             for i in range(2) for n in adapted]
    assert min(moved) > 0, moved


@pytest.mark.slow  # four short runs, a minute each on 2 cores
@pytest.mark.parametrize("family, drafter, pipeline", [
    ("llama", "group+draft-model", "sync"), ("qwen3", "group+eagle3", "sync"),
    ("qwen3", "group+eagle3", "disaggregated"), ("qwen3", "history+eagle3", "sync")])
def test_group_drafts_in_front_of_a_draft_model_or_an_eagle3_head_train_by_name(own, family,
                                                                                drafter,
                                                                                pipeline):
  """Issue 57: the registry names of group (and history, issue 54) drafting in front of a
  model with weights of its own: the model's weights live in the train state and train online
  (the draft model distilled, the EAGLE-3 head on its loss), and each part's acceptance is
  logged; also async with rollouts on 4 devices and updates on the other 4 (the head moved
  between them)."""
  front, weights = drafter.split("+")
  run_dir = own / f"run-{drafter}-{pipeline}"
  flags = [f.replace("{draft}", str(own / "draft")) for f in DRAFTERS[weights]]
  flags[flags.index(weights)] = drafter
  if pipeline == "disaggregated":
    flags += ["--pipeline.async-mode", "--grpo.tis-cap", "2", "--pipeline.rollout-devices", "4"]
  cli_main(["train", "--config", str(own / f"config-{family}.py"), *flags, "--run-dir",
            str(run_dir), "--rollout.speculation", "fixed"])
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2]
  part = {"draft-model": "draftmodel", "eagle3": "eagle3"}[weights]
  trained = {"draft-model": "draft_model_kl", "eagle3": "eagle3_ce"}[weights]
  for record in records:
    assert {f"drafted_by_{part}", f"drafted_by_{front}", trained} <= record.keys(), record.keys()
    assert record[f"drafted_by_{part}"] + record[f"drafted_by_{front}"] == pytest.approx(1.0)
  assert json.loads((run_dir / "config.json").read_text())["drafter"]["name"] == drafter


def test_a_draft_model_of_another_tokenizer_is_refused_when_configured(own, tmp_path):
  other = write_hf_checkpoint(tmp_path / "other", [], family="llama", n_layers=1,
                              tokenizer_from=own / "llama")
  vocab = json.loads((other / "tokenizer.json").read_text())
  words = vocab["model"]["vocab"]
  words["a"], words["b"] = words["b"], words["a"]  # the same size, other ids
  (other / "tokenizer.json").write_text(json.dumps(vocab))
  config = runpy.run_path(str(own / "config-llama.py"))["get_config"]()
  with pytest.raises(ConfigError, match="its tokenizer differs from the policy's"):
    dataclasses.replace(config, drafter=Drafting(name="draft-model", checkpoint=str(other)))
  with pytest.raises(ConfigError, match="drafter.checkpoint=None is invalid"):
    dataclasses.replace(config, drafter=Drafting(name="draft-model"))


@pytest.mark.parametrize("change, message", [
    (dict(policy_dir="/nowhere"), "policy_dir='/nowhere' is invalid: no config.json"),
    (dict(drafter=Drafting(name="mtp")), "drafter.name='mtp' is invalid with policy_dir"),
    (dict(warm_start=WarmStart(steps=10)), "warm_start.steps=10 is invalid: .* has none"),
])
def test_a_run_that_cannot_work_fails_when_it_is_configured(own, change, message):
  config = runpy.run_path(str(own / "config-llama.py"))["get_config"]()
  with pytest.raises(ConfigError, match=message):
    dataclasses.replace(config, **change)


def test_an_expert_mesh_axis_must_divide_the_policys_experts(own):
  moe = runpy.run_path(str(own / "config-qwen3_moe.py"))["get_config"]()
  assert moe.model.family == "qwen3_moe" and moe.model.n_experts == 8  # read from the checkpoint
  dataclasses.replace(moe, mesh=MeshConfig(expert=4))
  with pytest.raises(ConfigError, match=r"mesh.expert=3 is invalid: splits a mixture-of-experts "
                                        r"model's experts, and the model has 8 \(allowed: 1, "
                                        r"or a divisor of model.n_experts = 8\)"):
    dataclasses.replace(moe, mesh=MeshConfig(expert=3))
  dense = runpy.run_path(str(own / "config-llama.py"))["get_config"]()
  with pytest.raises(ConfigError, match=r"mesh.expert=2 is invalid: .* this model is dense "
                                        r"\(n_experts=0\): allowed only mesh.expert=1"):
    dataclasses.replace(dense, mesh=MeshConfig(expert=2))


def test_reward_workers_are_configured_for_python_rewards_only(own, capsys):
  config = runpy.run_path(str(own / "config-llama.py"))["get_config"]()
  with pytest.raises(SystemExit):
    cli_main(["train", "--config", str(own / "config-llama.py"), "--rewards.workers", "0"])
  assert "rewards.workers=0 is invalid: must be an int >= 1" in " ".join(
      capsys.readouterr().err.split())
  lock = threading.Lock()

  def locked(prompts, completions, **_):
    with lock:
      return [0.0] * len(completions)

  task = dataclasses.replace(config.task, rewards=(RewardFunction(locked),))
  dataclasses.replace(config, task=task, rewards=RewardWorkers(workers=2))  # threads share it
  with pytest.raises(ConfigError, match=r"reward function 'locked' cannot be sent to a worker "
                                        "process"):
    dataclasses.replace(config, task=task, rewards=RewardWorkers(kind="process"))
  with pytest.raises(ConfigError, match=r"rewards.workers=2 is invalid: task 'arithmetic' is "
                                        "rewarded in JAX"):
    ExperimentConfig(rewards=RewardWorkers(workers=2))


SUMS = CharTokenizer("0123456789+=")
SUM_ROWS = [{"prompt": f"{a}+{b}=", "sum": a + b, "text": str(a + b)} for a in range(10)
            for b in range(10)]


def short(tokens, lengths, answers):
  return (lengths <= 2).astype(jnp.float32)


def exact(prompts, completions, text):
  return [float(c == t) for c, t in zip(completions, text)]


def sums_experiment(run_dir, rewards, **fields) -> ExperimentConfig:
  """A run of seconds on the sums task (`SUM_ROWS`) rewarded by `rewards`; `fields` override
  the config's."""
  task = DatasetTask(SUM_ROWS, SUMS, rewards, reference_column="text", answer_column="sum",
                     test_fraction=0.2, success_reward=0.5)
  return dataclasses.replace(ExperimentConfig(
      run_dir=str(run_dir), task=task,
      model=ModelConfig(vocab_size=SUMS.vocab_size, d_model=32, n_layers=1, n_heads=2,
                        n_kv_heads=1, head_dim=16, mlp_dim=64, num_mtp_modules=1,
                        max_position=32),
      grpo=GRPOConfig(group_size=2), steps=2,
      rollout=RolloutSettings(prompts_per_step=2, max_new_tokens=4, tree_widths=(1,)),
      warm_start=WarmStart(steps=20),
      eval=RolloutEvaluation(prompts=4, speedup_repeats=1, speedup_seconds=0)), **fields)


@pytest.mark.slow  # four short runs: a minute on 2 cores
def test_python_rewards_in_the_disaggregated_pipeline_give_the_async_runs_steps_and_resume(
    tmp_path):
  """Issue 55: rollouts on 4 devices, updates on the 4 others, the rewards (Python, and JAX
  beside it) scored on the host between the meshes: the steps of async mode's split step on
  all 8 devices; each stopped after 2 steps resumes to the same third, with its metrics."""
  config = sums_experiment(
      tmp_path / "async", [exact, JaxReward(short, weight=0.5)], steps=3,
      rollout=RolloutSettings(prompts_per_step=4, max_new_tokens=4, tree_widths=(1,)),
      pipeline=Pipeline(async_mode=True), checkpoint=Checkpointing(every=1))
  logs = []
  run(dataclasses.replace(config, steps=2), log=logs.append)
  run(config, log=logs.append)
  apart = dataclasses.replace(config, run_dir=str(tmp_path / "apart"),
                              pipeline=Pipeline(async_mode=True, rollout_devices=4))
  run(dataclasses.replace(apart, steps=2), log=logs.append)
  run(apart, log=logs.append)
  assert any("rollouts on 4 device(s), updates on 4" in line for line in logs)
  assert any("resumed from" in line for line in logs)
  read = lambda name: [json.loads(line) for line in
                       (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
  split, disaggregated = read("async"), read("apart")
  assert [m["step"] for m in disaggregated] == [1, 2, 3] == [m["step"] for m in split]
  assert sum(m["grad_norm"] > 0 for m in split) >= 2, split  # something to compare
  for want, got in zip(split, disaggregated, strict=True):
    for key in ("reward_mean", "reward_exact", "reward_short", "loss", "kl", "grad_norm",
                "response_length_mean"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5,
                                 err_msg=f"step {want['step']}: {key}")
    # The resumed step too (the checkpoint keeps what its rollout's rewards add to it).
    assert set(got) == set(want), set(got) ^ set(want)
    assert got["perf_reward_s"] > 0 and 0 <= got["perf_reward_overlap"] <= 1


def test_a_policy_whose_tokenizer_is_not_the_tasks_is_refused_when_configured(own, tmp_path):
  """The policy reads the ids of the tokenizer it was trained with: a task encoding its
  prompts with another one trained on ids that mean other text, silently."""
  task = lambda tokenizer: DatasetTask(SUM_ROWS, tokenizer, [exact], test_fraction=0.2)
  configure = lambda task, policy_dir: ExperimentConfig(
      task=task, policy_dir=str(policy_dir), drafter=Drafting(name="ngram"),
      warm_start=WarmStart(steps=0))
  with pytest.raises(ConfigError, match=r"policy_dir=.* is invalid for this task: its tokenizer "
                                        r"and the task's CharTokenizer differ"):
    configure(task(SUMS), own / "llama")
  # A checkpoint of a character tokenizer (as `specjax export` writes a CharTokenizer run):
  # the same tokenizer is accepted, one with other ids for the same characters is not.
  chars = write_hf_checkpoint(tmp_path / "chars", [], family="llama", n_layers=1,
                              tokenizer_from=own / "llama")
  SUMS.save(chars)
  configure(task(SUMS), chars)
  with pytest.raises(ConfigError, match=r"its id 3 \(.9.\) means other text there"):
    configure(task(CharTokenizer("9876543210+=")), chars)
  swapped = write_hf_checkpoint(tmp_path / "swapped", [], family="llama", n_layers=1,
                                tokenizer_from=own / "llama")
  vocab = json.loads((swapped / "tokenizer.json").read_text())
  words = vocab["model"]["vocab"]
  words["a"], words["b"] = words["b"], words["a"]
  (swapped / "tokenizer.json").write_text(json.dumps(vocab))
  chat = DatasetTask(own / "data.jsonl", HFTokenizer.from_dir(own / "llama"), [zero],
                     test_fraction=0.25)
  with pytest.raises(ConfigError, match=r"token\(s\) with another id or none there"):
    configure(chat, swapped)
  # A checkpoint whose tokenizer adds a token (a fine-tune's [PAD]) reads every id the same.
  added = write_hf_checkpoint(tmp_path / "added", [], family="llama", n_layers=1,
                              tokenizer_from=own / "llama")
  table = tokenizers.Tokenizer.from_file(str(added / "tokenizer.json"))
  table.add_special_tokens(["[PAD]"])
  table.save(str(added / "tokenizer.json"))
  configure(chat, added)


def zero(prompts, completions, **_):
  return [0.0] * len(completions)


@pytest.mark.parametrize("mixed, async_mode", [pytest.param(False, False, marks=pytest.mark.slow),
                                               pytest.param(False, True, marks=pytest.mark.slow),
                                               pytest.param(True, False, marks=pytest.mark.slow),
                                               pytest.param(True, True, marks=pytest.mark.slow)],
                         ids=["jax-fused", "jax-async", "python-and-jax",
                              "python-and-jax-async"])
def test_jax_rewards_run_in_the_fused_step_or_beside_python_ones(tmp_path, mixed, async_mode):
  rewards = [JaxReward(short, weight=0.5)] + ([exact] if mixed else [])
  config = sums_experiment(tmp_path / "run", rewards, pipeline=Pipeline(async_mode=async_mode),
                           log=Logging(samples_every=1))
  task = config.task
  assert task.reward_in_jax == (not mixed)
  run(config, log=lambda _: None)
  # Sample completions in the log, from the fused step's rows or from the host rewards.
  events = [f.read_bytes() for f in (tmp_path / "run" / "tensorboard").rglob("*") if f.is_file()]
  assert any(b"**completion**" in e and b"**prompt** '" in e for e in events)
  for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
    record = json.loads(line)
    expected = 0.5 * record["reward_short"] + (record["reward_exact"] if mixed else 0.0)
    assert record["reward_mean"] == pytest.approx(expected, abs=1e-6)
    if not mixed:  # solved: total >= success_reward = 0.5, i.e. a short response
      assert record["accuracy"] == pytest.approx(record["reward_short"], abs=1e-6)


@pytest.mark.slow  # two short runs: a minute on 2 cores
def test_python_rewards_over_worker_processes_train_as_called_directly(tmp_path):
  """Async GRPO with a Python reward scored by two worker processes, a row per call under a
  timeout: the same rewards, losses and accuracy as the run that calls it directly, and each
  step reports its reward time and the share of it the device's update overlapped."""
  task = DatasetTask(SUM_ROWS, SUMS, [exact], reference_column="text", test_fraction=0.2)
  records = {}
  for name, workers in (("direct", RewardWorkers()),
                        ("processes", RewardWorkers(workers=2, kind="process", rows_per_call=1,
                                                    timeout_s=60))):
    config = ExperimentConfig(
        run_dir=str(tmp_path / name), task=task,
        model=ModelConfig(vocab_size=SUMS.vocab_size, d_model=32, n_layers=1, n_heads=2,
                          n_kv_heads=1, head_dim=16, mlp_dim=64, num_mtp_modules=1,
                          max_position=32),
        grpo=GRPOConfig(group_size=2), steps=3,
        rollout=RolloutSettings(prompts_per_step=2, max_new_tokens=4, tree_widths=(1,)),
        warm_start=WarmStart(steps=20), pipeline=Pipeline(async_mode=True), rewards=workers,
        eval=RolloutEvaluation(prompts=4, speedup_repeats=1, speedup_seconds=0))
    summary = run(config, log=lambda _: None)
    records[name] = [json.loads(line) for line in
                     (tmp_path / name / "metrics.jsonl").read_text().splitlines()], summary
  (direct, direct_summary), (pooled, pooled_summary) = records["direct"], records["processes"]
  assert [r["step"] for r in pooled] == [1, 2, 3]
  for a, b in zip(direct, pooled, strict=True):
    for key in ("reward_mean", "reward_exact", "loss", "kl"):
      assert a.get(key) == pytest.approx(b.get(key), abs=1e-6), key
    assert b["perf_reward_s"] > 0 and 0 <= b["perf_reward_overlap"] <= 1
  assert direct_summary["accuracy_after"] == pooled_summary["accuracy_after"]


FLAKY = {"held_out": set(), "calls": 0, "fail_at": None, "lock": threading.Lock()}


def flaky(prompts, completions, text):
  """`exact`, raising on its `fail_at`-th call on training prompts (evaluations score held-out
  ones, in an order that may interleave with the background scoring). Counted under a lock:
  two reward threads call it at once."""
  if prompts[0] not in FLAKY["held_out"]:
    with FLAKY["lock"]:
      FLAKY["calls"] += 1
      failing = FLAKY["calls"] == FLAKY["fail_at"]
    if failing:
      raise ValueError("the verifier crashed")
  return [float(c == t) for c, t in zip(completions, text)]


@pytest.mark.slow  # two short runs
def test_a_reward_that_raises_mid_run_stops_it_with_its_checkpoints_intact(tmp_path):
  """Async mode scores in the background: a reward that raises on the rollout of step 2 stops
  the run before step 2's checkpoint, naming the function and the row; the same command then
  resumes from step 1's checkpoint and finishes."""
  task = DatasetTask(SUM_ROWS, SUMS, [flaky], reference_column="text", test_fraction=0.2)
  config = ExperimentConfig(
      run_dir=str(tmp_path / "run"), task=task,
      model=ModelConfig(vocab_size=SUMS.vocab_size, d_model=32, n_layers=1, n_heads=2,
                        n_kv_heads=1, head_dim=16, mlp_dim=64, num_mtp_modules=0,
                        max_position=32),
      grpo=GRPOConfig(group_size=2), steps=4, drafter=Drafting(name="none"),
      rollout=RolloutSettings(prompts_per_step=2, max_new_tokens=4),
      warm_start=WarmStart(steps=0), pipeline=Pipeline(async_mode=True),
      rewards=RewardWorkers(workers=2, rows_per_call=1), checkpoint=Checkpointing(every=1),
      eval=RolloutEvaluation(prompts=4, speedup_repeats=1, speedup_seconds=0))
  # Rollouts of 2 prompts x G=2, a call a row: the prime's rollout is calls 1-4, step 1's
  # 5-8, step 2's from 9.
  FLAKY.update(held_out={e.columns["prompt"] for e in task.examples("test")}, calls=0,
               fail_at=9)
  with pytest.raises(RewardError, match=r"reward function 'flaky' raised ValueError: the "
                                        r"verifier crashed \(on row [0-3]\)"):
    run(config, log=lambda _: None)
  ckpt = Checkpointer(tmp_path / "run" / "checkpoints")
  assert ckpt.all_steps() == [0, 1]
  ckpt.close()
  FLAKY["fail_at"] = None
  run(config, log=lambda _: None)
  lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_a_bfloat16_policy_trains_on_float32_master_weights(own, tmp_path):
  config = runpy.run_path(str(own / "config-llama.py"))["get_config"]()
  config = dataclasses.replace(config, run_dir=str(tmp_path / "run"), policy_dtype="bfloat16")
  assert config.model.param_dtype == "bfloat16"
  assert isinstance(config.optimizer().init(load_policy_params(own / "llama")), MasterState)
  run(config, log=lambda _: None)
  params, model = load_policy(tmp_path / "run")
  assert model.param_dtype == "bfloat16"
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  plain = dataclasses.replace(config, optim=dataclasses.replace(config.optim,
                                                                master_weights=False))
  assert not isinstance(plain.optimizer().init(load_policy_params(own / "llama")), MasterState)


def _metric_steps(run_dir) -> list[int]:
  return [json.loads(line)["step"] for line in
          (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_run_killed_mid_step_resumes_from_its_last_checkpoint(own, tmp_path):
  """kill -9 during training, then the same command: it continues from the last checkpoint
  (every step is one), drafter and all, and its metrics run on without a gap or a repeat."""
  run_dir = tmp_path / "run"
  command = [sys.executable, "-m", "specjax.cli", "train", "--config",
             str(own / "config-llama.py"), "--run-dir", str(run_dir), "--steps", "6",
             *[f.replace("{draft}", str(own / "draft")) for f in DRAFTERS["draft-model"]]]
  run = subprocess.Popen(command, env=child_env(), cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 300
  while not ((run_dir / "metrics.jsonl").exists() and len(_metric_steps(run_dir)) >= 2):
    assert run.poll() is None, run.stdout.read()
    assert time.time() < deadline, "no second step in 300 s"
    time.sleep(0.02)
  run.send_signal(signal.SIGKILL)
  run.wait()
  killed_at = max(_metric_steps(run_dir))
  assert 2 <= killed_at < 6
  resumed = subprocess.run(command, env=child_env(), cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
  assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
  assert "resumed from" in resumed.stdout
  assert _metric_steps(run_dir) == [1, 2, 3, 4, 5, 6]


def load_policy_params(path):
  return load_hf(path, param_dtype="bfloat16")[0]


def test_lora_is_configured_from_flags_and_refuses_heads_it_would_freeze(own, capsys):
  with pytest.raises(ConfigError, match="lora.rank=4 is invalid: with adapters"):
    ExperimentConfig(lora=LoraConfig(rank=4))  # the default model trains its MTP heads online
  config = ExperimentConfig(lora=LoraConfig(rank=4, alpha=8.0),
                            drafter=Drafting(loss_weight=0.0))
  assert config.train_config().lora == LoraConfig(rank=4, alpha=8.0)
  assert ExperimentConfig().train_config().lora is None  # rank 0: full-parameter training
  with pytest.raises(SystemExit):
    cli_main(["train", "--config", str(own / "config-llama.py"), "--help"])
  assert "--lora.rank" in capsys.readouterr().out
