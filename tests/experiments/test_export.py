"""A `specjax train` run read back and exported: `load_policy` restores the latest
checkpoint's policy from the run directory alone, `specjax export` writes it as an HF
checkpoint with its tokenizer that transformers loads and decodes greedily token for token
as specjax does, and the run directory records what ran it."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from support import TASK, TOK, tiny_experiment

from specjax.cli import main
from specjax.decoding import SamplingConfig, generate
from specjax.errors import ConfigError
from specjax.experiments import load_policy
from specjax.experiments.export import export_run
from specjax.experiments.grpo import run
from specjax.models import load_hf
from specjax.rl import encode_prompt
from specjax.tokenizer import HFTokenizer


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("run")
  run(tiny_experiment(run_dir, steps=1), log=lambda _: None)
  return run_dir


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_load_policy_reads_the_latest_checkpoint_and_the_recorded_architecture(trained_run):
  params, model = load_policy(trained_run)
  assert model == tiny_experiment(trained_run).model
  again, _ = load_policy(trained_run / "checkpoints", model)
  jax.tree.map(np.testing.assert_array_equal, params, again)
  environment = json.loads((trained_run / "environment.json").read_text())
  assert environment["versions"]["jax"] == jax.__version__
  assert environment["versions"]["specjax"] and environment["processes"] == 1


def test_load_policy_refuses_a_directory_that_is_not_a_run(tmp_path):
  with pytest.raises(ConfigError, match=r"run_dir=.* is invalid: no such directory"):
    load_policy(tmp_path / "missing")
  (tmp_path / "checkpoints").mkdir()
  with pytest.raises(ConfigError, match=r"run_dir=.* is invalid: no config.json there"):
    load_policy(tmp_path)


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_export_loads_in_transformers_and_decodes_greedily_as_specjax(trained_run, tmp_path):
  out = tmp_path / "hf"
  main(["export", str(trained_run), str(out)])
  params, model = load_policy(trained_run)
  loaded, loaded_model = load_hf(out)
  assert loaded_model.num_mtp_modules == model.num_mtp_modules
  jax.tree.map(np.testing.assert_array_equal, loaded, params)

  tokenizer = HFTokenizer.from_dir(out)
  prompt = TASK.examples("test")[0].prompt
  ids = encode_prompt(TOK, prompt)
  assert encode_prompt(tokenizer, prompt) == ids
  assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (TOK.bos_id, TOK.eos_id,
                                                                    TOK.pad_id)
  new = 6
  ours = generate(params, model, jnp.asarray([ids]), jnp.asarray([len(ids)]),
                  jax.random.key(0), max_new_tokens=new, sampling=SamplingConfig(0.0),
                  eos_id=None)
  ours = np.asarray(ours.tokens)[0, :new].tolist()
  hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                        dtype=torch.float32)
  theirs = list(ids)
  with torch.no_grad():  # greedy by hand: no generation config or EOS rule in between
    for _ in range(new):
      theirs.append(int(hf(torch.tensor([theirs])).logits[0, -1].argmax()))
  assert theirs[len(ids):] == ours
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  assert hf_tokenizer(prompt, add_special_tokens=False)["input_ids"] == TOK.encode(prompt)
  assert hf_tokenizer(prompt)["input_ids"] == ids  # BOS first, as the run's prompts had it
  assert hf_tokenizer.decode(ours, skip_special_tokens=True) == TOK.decode(ours)


@pytest.mark.parametrize("out", [".", "export", ".."])
def test_export_refuses_an_out_that_would_replace_the_run(tmp_path, out):
  """`out` is replaced whole: the run directory, a folder inside it or one above it would
  take the run's record and checkpoints with it."""
  run_dir = tmp_path / "runs" / "mine"
  run_dir.mkdir(parents=True)
  (run_dir / "config.json").write_text("{}")
  with pytest.raises(ConfigError, match="export replaces out whole"):
    export_run(run_dir, run_dir / out)
  assert (run_dir / "config.json").read_text() == "{}"


def test_export_refuses_an_out_that_would_replace_the_runs_base_checkpoint(tmp_path):
  """A resume (and LoRA, whose frozen base it is) reads the run's policy_dir again."""
  base, run_dir = tmp_path / "base", tmp_path / "run"
  base.mkdir()
  run_dir.mkdir()
  (run_dir / "config.json").write_text(json.dumps({"policy_dir": str(base), "model": {}}))
  with pytest.raises(ConfigError, match="it is the run's policy_dir"):
    export_run(run_dir, base)
