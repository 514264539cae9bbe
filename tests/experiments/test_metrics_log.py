"""Metrics backends: a run logs each step to W&B when asked, and a resumed run continues the
same W&B run (a stand-in `wandb` module records the calls)."""

import dataclasses
import importlib.util
import json
import sys

import pytest

from specjax.errors import ConfigError
from specjax.experiments import run
from specjax.experiments.metrics_log import WANDB_ID_FILE, Logging
from support import TASK

FAKE_WANDB = '''
calls = []


class Run:
  def __init__(self, **kwargs):
    calls.append(("init", kwargs))

  def log(self, values, step):
    calls.append(("log", step, dict(values)))

  def finish(self):
    calls.append(("finish",))


def init(**kwargs):
  return Run(**kwargs)


class Html:
  def __init__(self, data):
    self.data = data
'''


@pytest.fixture
def fake_wandb(tmp_path, monkeypatch):
  package = tmp_path / "fake" / "wandb"
  package.mkdir(parents=True)
  (package / "__init__.py").write_text(FAKE_WANDB)
  monkeypatch.syspath_prepend(str(tmp_path / "fake"))
  real = sys.modules.pop("wandb", None)
  import wandb
  yield wandb
  sys.modules.pop("wandb", None)
  if real is not None:
    sys.modules["wandb"] = real


def _config(run_dir, steps):
  from specjax.experiments import ExperimentConfig, RolloutEvaluation, RolloutSettings, WarmStart
  from specjax.rl import GRPOConfig
  from support import MODEL
  return ExperimentConfig(
      run_dir=str(run_dir), task=TASK, model=MODEL, grpo=GRPOConfig(group_size=2), steps=steps,
      rollout=RolloutSettings(prompts_per_step=2, max_new_tokens=3, tree_widths=(1,)),
      warm_start=WarmStart(steps=5), eval=RolloutEvaluation(prompts=2, speedup_repeats=1,
                                                           speedup_seconds=0),
      log=Logging(wandb_project="specjax-test", wandb_mode="offline", samples_every=2))


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_a_run_logs_every_step_to_wandb_and_a_resume_continues_its_run(fake_wandb, tmp_path):
  run(_config(tmp_path / "run", 2), log=lambda _: None)
  run(_config(tmp_path / "run", 3), log=lambda _: None)  # resumed
  inits = [c[1] for c in fake_wandb.calls if c[0] == "init"]
  run_id = (tmp_path / "run" / WANDB_ID_FILE).read_text().strip()
  assert [i["id"] for i in inits] == [run_id, run_id]
  assert all(i["resume"] == "allow" and i["project"] == "specjax-test" for i in inits)
  assert inits[0]["config"]["grpo"]["group_size"] == 2  # the run's config
  logged = [c for c in fake_wandb.calls if c[0] == "log"]
  # Step 2's sample completions (every 2 steps) go to W&B as an HTML panel beside its scalars.
  samples = [c for c in logged if "samples" in c[2]]
  assert [c[1] for c in samples] == [2] and "**completion**" in samples[0][2]["samples"].data
  logged = [c for c in logged if "samples" not in c[2]]
  assert [c[1] for c in logged] == [1, 2, 3]
  assert {"reward/mean", "spec/acceptance_length", "train/learning_rate"} <= logged[0][2].keys()
  assert [c[0] for c in fake_wandb.calls].count("finish") == 2
  metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in metrics] == [1, 2, 3]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_without_the_package_fails_when_configured():
  with pytest.raises(ConfigError, match=r"needs the wandb package: pip install 'specjax\[wandb\]'"):
    Logging(wandb_project="p")
  with pytest.raises(ConfigError, match="log.wandb_mode='sometimes' is invalid"):
    dataclasses.replace(Logging(), wandb_mode="sometimes")
