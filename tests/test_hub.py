"""Checkpoints by Hugging Face Hub id (`specjax.hub`), resolved from a local Hub cache the test
writes, with the Hub offline: no test ever reaches the network."""

import json
import subprocess
import sys

import pytest
from support import child_env, write_tiny_checkpoint

from specjax.hub import HUB_FILES, is_hub_id, local_checkpoint

REPO = "tiny-org/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"

# Run in a child: huggingface_hub reads HF_HUB_OFFLINE and HF_HUB_CACHE when it is imported.
CHILD = """
import json, sys
from specjax.errors import ConfigError
from specjax.experiments import Drafting, ExperimentConfig, WarmStart
from specjax.models import load_hf
from specjax.rl.datasets import DatasetTask
from specjax.tokenizer import HFTokenizer

out = {}
params, config = load_hf(sys.argv[1])
out["layers"] = config.n_layers
tok = HFTokenizer.from_dir(sys.argv[1])
out["tokenizer_source"] = tok.source
def zero(completions, **_):
  return [0.0] * len(completions)
task = DatasetTask([{"prompt": f"{x} {y}"} for x in "abcde" for y in "abcde"], tok, [zero],
                   test_fraction=0.25)
run = ExperimentConfig(task=task, policy_dir=sys.argv[1], drafter=Drafting(name="ngram"),
                       warm_start=WarmStart(steps=0))
out["policy_dir"] = run.policy_dir
try:
  load_hf("tiny-org/not-cached")
except ConfigError as err:
  out["error"] = str(err)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
  """A Hub cache holding REPO at REVISION, laid out as huggingface_hub keeps it."""
  cache = tmp_path_factory.mktemp("hub")
  repo = cache / ("models--" + REPO.replace("/", "--"))
  snapshot = repo / "snapshots" / REVISION
  snapshot.mkdir(parents=True)
  write_tiny_checkpoint(snapshot)
  (repo / "refs").mkdir()
  (repo / "refs" / "main").write_text(REVISION)
  return cache, snapshot


def test_a_hub_id_resolves_to_its_cached_snapshot_everywhere_a_checkpoint_is_taken(hub_cache):
  cache, snapshot = hub_cache
  env = child_env(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(cache))
  done = subprocess.run([sys.executable, "-c", CHILD, REPO], env=env, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  out = json.loads(done.stdout.splitlines()[-1])
  assert out["layers"] == 1
  assert out["tokenizer_source"] == str(snapshot) == out["policy_dir"]
  assert "'tiny-org/not-cached' is neither a local directory nor a Hugging Face Hub" in out[
      "error"]
  assert "HF_HUB_OFFLINE is set and the model is not in the local Hub cache" in out["error"]


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_the_generate_command_takes_a_hub_id(hub_cache):
  cache, _ = hub_cache
  env = child_env(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(cache))
  done = subprocess.run([sys.executable, "-m", "specjax.cli", "generate", "--checkpoint", REPO,
                         "--prompt", "a b", "--max-new-tokens", "3"], env=env,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("source, hub", [
    ("Qwen/Qwen3-0.6B", True), ("meta-llama/Llama-3.2-1B-Instruct", True),
    ("./Qwen/Qwen3", False), ("/models/Qwen3", False), ("a/b/c", False), ("Qwen3-0.6B", False),
    ("org/..", False), ("org/a--b", False), ("-org/name", False), ("", False),
])
def test_what_counts_as_a_hub_id(source, hub):
  assert is_hub_id(source) == hub


def test_a_local_path_is_taken_as_it_is(tmp_path):
  assert local_checkpoint(tmp_path) == tmp_path
  missing = tmp_path / "nowhere"  # not a Hub id: the caller names the missing directory
  assert local_checkpoint(missing) == missing
  assert "*.safetensors" in HUB_FILES and "*.json" in HUB_FILES
