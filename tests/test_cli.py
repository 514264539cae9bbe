"""The `specjax` command runs end to end on the built-in demo model and on a tiny HF
checkpoint directory (config.json + safetensors + tokenizer.json)."""

import json

import jax
import numpy as np
import pytest
from support import write_tiny_checkpoint

from specjax import cli
from specjax.cli import COMMANDS, generate_command, main
from specjax.decoding import SamplingConfig, generate
from specjax.errors import ConfigError
from specjax.models.hf import eos_token_ids

MAX_NEW = 8


@pytest.mark.slow
def test_generate_demo_prints_text_acceptance_and_speedup(capsys):
  generate_command(demo=True, demo_steps=30, max_new_tokens=8, widths=(2, 1))
  out = capsys.readouterr().out
  assert "'7,10,13,' -> '" in out
  assert "acceptance per depth" in out
  assert "speculative / plain throughput" in out


@pytest.mark.slow
def test_generate_demo_with_adaptive_speculation_prints_costs_and_rounds_per_tree(
    capsys, tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
  generate_command(demo=True, demo_steps=30, max_new_tokens=8, widths=(1, 1), adaptive=True)
  out = capsys.readouterr().out
  assert "calibration" in out and "chain2" in out
  assert "rounds per tree: plain" in out and "runs of one tree)" in out
  assert "speculative / plain throughput" in out


def test_generate_without_a_model_explains_what_to_pass():
  with pytest.raises(SystemExit, match="--checkpoint DIR or --demo"):
    generate_command()


def test_help_lists_every_command_and_a_missing_or_unknown_one_exits_2(capsys):
  main(["--help"])
  out = capsys.readouterr().out
  commands = {"train", "train-drafter", "export", "generate", "plan", "simulate", "sim"}
  assert all(name in out for name in commands), out
  assert set(COMMANDS) == commands
  for argv in ([], ["trian"]):
    with pytest.raises(SystemExit) as exit_info:
      main(argv)
    assert exit_info.value.code == 2
  assert "unknown command 'trian'" in capsys.readouterr().err


def _edit_json(file, **changes) -> None:
  value = json.loads(file.read_text()) if file.is_file() else {}
  file.write_text(json.dumps(value | changes))


@pytest.fixture
def generate_calls(monkeypatch):
  """`(args, kwargs, result)` of every `generate` the CLI runs."""
  calls = []

  def spy(*args, **kwargs):
    calls.append((args, kwargs, generate(*args, **kwargs)))
    return calls[-1][2]

  monkeypatch.setattr(cli, "generate", spy)
  return calls


# BOS once: "c" gets one prepended; "<s> a b" spells it already (as chat templates do).
PROMPTS = ("<s> a b", "c")
PROMPT_TOKENS = np.array([[1, 4, 5], [1, 6, 0]])
PROMPT_LENGTHS = np.array([3, 2])


@pytest.mark.parametrize("source", ["config.json", "generation_config.json"])
def test_generate_on_a_checkpoint_prepends_bos_once_and_stops_at_every_listed_end_id(
    tmp_path, generate_calls, capsys, source):
  params, config = write_tiny_checkpoint(tmp_path)
  unstopped = np.asarray(generate(params, config, PROMPT_TOKENS, PROMPT_LENGTHS,
                                  jax.random.key(0), max_new_tokens=MAX_NEW,
                                  sampling=SamplingConfig(temperature=0.0)).tokens)
  # The tokenizer's own EOS (</s> = 2) plus an id row 0 emits third: the list must end it.
  ends = (2, int(unstopped[0, 2]))
  assert ends[1] != 2, unstopped  # else the list would add nothing to the tokenizer's EOS
  if source == "config.json":
    _edit_json(tmp_path / "config.json", eos_token_id=list(ends))
  else:  # it overrides config.json's, as in transformers
    _edit_json(tmp_path / "config.json", eos_token_id=[2, 9])
    _edit_json(tmp_path / "generation_config.json", eos_token_id=list(ends))

  generate_command(checkpoint=str(tmp_path), prompt=PROMPTS, drafter="none", temperature=0.0,
                   max_new_tokens=MAX_NEW)
  args, kwargs, out = generate_calls[-1]
  np.testing.assert_array_equal(args[2], PROMPT_TOKENS)
  np.testing.assert_array_equal(args[3], PROMPT_LENGTHS)
  assert kwargs["eos_id"] == ends
  for row, tokens, n in zip(unstopped, np.asarray(out.tokens), np.asarray(out.lengths)):
    hits = np.flatnonzero(np.isin(row, ends))
    want = hits[0] + 1 if hits.size else MAX_NEW
    assert n == want and (tokens[:n] == row[:n]).all(), (row, tokens, n)
  assert int(out.lengths[0]) <= 3
  assert "'<s> a b' -> '" in capsys.readouterr().out


def test_generate_on_a_checkpoint_without_listed_end_ids_stops_at_the_tokenizers_eos(
    tmp_path, generate_calls):
  write_tiny_checkpoint(tmp_path)
  generate_command(checkpoint=str(tmp_path), prompt=("a",), drafter="none", temperature=0.0,
                   max_new_tokens=2)
  assert generate_calls[-1][1]["eos_id"] == (2,)


def test_a_tokenizer_larger_than_the_model_is_refused_before_generating(tmp_path,
                                                                        generate_calls):
  write_tiny_checkpoint(tmp_path, vocab_size=8)
  with pytest.raises(ConfigError, match=r"tokenizer vocab 10 > model vocab_size 8"):
    generate_command(checkpoint=str(tmp_path), prompt=("a",), drafter="none")
  assert not generate_calls


def test_eos_token_ids_prefers_generation_config_and_names_a_bad_value(tmp_path):
  assert eos_token_ids(tmp_path) == ()
  _edit_json(tmp_path / "config.json", eos_token_id=7)
  assert eos_token_ids(tmp_path) == (7,)
  _edit_json(tmp_path / "generation_config.json", eos_token_id=[5, 6])
  assert eos_token_ids(tmp_path) == (5, 6)
  _edit_json(tmp_path / "generation_config.json", eos_token_id=[5, "6"])
  with pytest.raises(ConfigError, match=r"generation_config\.json: eos_token_id=\[5, '6'\] is "
                                        r"invalid: allowed a token id"):
    eos_token_ids(tmp_path)


def test_the_specjax_command_prints_a_diagnosed_failure_as_one_line(tmp_path):
  """`specjax` (the console script, `cli.run`) ends a SpecjaxError with one line naming the
  command, the error and its message, and exit status 1; SPECJAX_TRACEBACK=1 shows the
  traceback. A failure specjax did not diagnose keeps its traceback."""
  import subprocess
  import sys

  from support import ROOT, child_env
  args = [sys.executable, "-m", "specjax.cli", "train-drafter", "--target-dir",
          str(tmp_path / "missing"), "--run-dir", str(tmp_path / "run")]
  proc = subprocess.run(args, env=child_env(), cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 1, proc.stderr
  assert "Traceback" not in proc.stderr
  assert (f"specjax train-drafter: ConfigError: target_dir='{tmp_path / 'missing'}' is invalid: "
          "no config.json there") in proc.stderr
  traced = subprocess.run(args, env=child_env(SPECJAX_TRACEBACK="1"), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
  assert traced.returncode == 1 and "Traceback" in traced.stderr


def test_main_in_process_still_raises_the_error_itself(tmp_path):
  """Research code calling `main` gets the exception to catch, not a SystemExit."""
  with pytest.raises(ConfigError, match="target_dir=.* is invalid"):
    main(["train-drafter", "--target-dir", str(tmp_path / "missing"),
          "--run-dir", str(tmp_path / "run")])


def test_generate_defaults_to_a_drafter_the_checkpoint_supports(tmp_path, generate_calls,
                                                                capsys):
  """A public export has no MTP modules: the default is n-gram lookup, not a traceback from
  the MTP drafter; the output equals plain decoding (greedy). A model with MTP modules
  defaults to them."""
  from specjax.decoding import default_drafter
  params, config = write_tiny_checkpoint(tmp_path)
  generate_command(checkpoint=str(tmp_path), prompt=PROMPTS, temperature=0.0,
                   max_new_tokens=MAX_NEW)
  out = capsys.readouterr().out
  assert "drafter ngram: the default for this model" in out
  assert "speculative / plain throughput" in out
  plain = np.asarray(generate(params, config, PROMPT_TOKENS, PROMPT_LENGTHS, jax.random.key(0),
                              max_new_tokens=MAX_NEW,
                              sampling=SamplingConfig(temperature=0.0)).tokens)
  # The speculative and plain runs take turns (compiled first, speculative first).
  (_, spec_kwargs, spec), (_, plain_kwargs, _) = generate_calls[0], generate_calls[1]
  assert type(spec_kwargs["drafter"]).__name__ == "NGramDrafter"
  assert plain_kwargs["drafter"] is None
  np.testing.assert_array_equal(np.asarray(spec.tokens), plain)
  assert default_drafter(config) == "ngram"
  assert default_drafter(config.replace(num_mtp_modules=1)) == "mtp"
  assert default_drafter(config.replace(num_medusa_heads=2)) == "medusa"
  with pytest.raises(ConfigError, match=r"--draft-checkpoint='d' needs --drafter to say what "
                                        r"it holds: draft-model .* or eagle3"):
    generate_command(checkpoint=str(tmp_path), prompt=PROMPTS, draft_checkpoint="d")
  with pytest.raises(ConfigError, match="--adaptive is invalid with --drafter none"):
    generate_command(checkpoint=str(tmp_path), prompt=PROMPTS, drafter="none", adaptive=True)


def test_train_prints_a_short_table_not_the_json_summary():
  summary = {"accuracy_before": 0.01, "accuracy_after": 0.98, "sampled_accuracy_before": 0.0,
             "sampled_accuracy_after": 0.9, "probe_acceptance_before": 1.5,
             "probe_acceptance_after": 2.125, "plain_tokens_per_s": 1000.4,
             "spec_tokens_per_s": 1300.2, "speedup": 1.3, "acceptance_length": 1.8}
  table = cli.summary_table(summary).splitlines()
  assert table[0].split() == ["before", "after"]
  assert table[1].split()[-2:] == ["0.010", "0.980"]
  assert table[3].startswith("drafter acceptance (probe)") and table[3].endswith("2.125")
  assert table[-1] == "rollout tokens/s: plain 1000, speculative 1300"
  assert len(table) == 5  # rows whose figures the summary lacks are left out


def test_a_repeated_prompt_flag_is_refused_rather_than_keeping_the_last(tmp_path):
  """tyro keeps only the last --prompt's values; one --prompt takes them all."""
  with pytest.raises(SystemExit, match=r"--prompt given 2 times; give every prompt after one "
                                       r"--prompt"):
    main(["generate", "--checkpoint", str(tmp_path), "--prompt", "a", "--prompt=b"])


def test_a_prompt_that_encodes_to_no_tokens_is_refused_before_generating(tmp_path,
                                                                          generate_calls):
  write_tiny_checkpoint(tmp_path)
  # Qwen's: no BOS named, none added by the post-processor (what a prompt starts with)
  _edit_json(tmp_path / "tokenizer_config.json", bos_token=None)
  _edit_json(tmp_path / "tokenizer.json", post_processor=None)
  with pytest.raises(ConfigError, match=r"prompt='' is invalid: it encodes to no tokens"):
    generate_command(checkpoint=str(tmp_path), prompt=("a", ""), drafter="none")
  assert not generate_calls


def test_generate_on_a_directory_that_is_not_a_checkpoint_says_what_it_is(tmp_path):
  """An empty directory lacks config.json; a train run directory has one (the run's), and
  the fix is to export it."""
  from specjax.errors import CheckpointError
  with pytest.raises(CheckpointError, match=r"no config\.json there: not an HF checkpoint"):
    generate_command(checkpoint=str(tmp_path), prompt=("a",))
  (tmp_path / "checkpoints").mkdir()
  (tmp_path / "config.json").write_text(json.dumps({"run_dir": str(tmp_path)}))
  with pytest.raises(CheckpointError, match=rf"a specjax train run directory, not an HF "
                                            rf"checkpoint; .*specjax export {tmp_path} OUT"):
    generate_command(checkpoint=str(tmp_path), prompt=("a",))


@pytest.mark.parametrize("source, error, line", [
    ("def get_config(:\n  return 1\n", "SyntaxError: invalid syntax", 1),
    ("import os\nimport nonexistent_module_xyz\n", "ModuleNotFoundError: No module named", 2),
    ("def get_config():\n  raise ValueError('boom')\n", "ValueError: boom", 2),
])
def test_a_config_file_that_fails_is_one_line_naming_file_line_and_error(tmp_path, source,
                                                                         error, line):
  """Not a traceback through runpy's frames: the file, the line and the error, which stays
  chained for SPECJAX_TRACEBACK=1."""
  path = tmp_path / "bad.py"
  path.write_text(source)
  with pytest.raises(ConfigError, match=rf"^--config {path}, line {line}: {error}") as info:
    cli.load_experiment(str(path))
  assert info.value.__cause__ is not None


def test_train_help_without_a_config_prints_the_usage(capsys):
  main(["train", "--help"])
  out = capsys.readouterr().out
  assert "usage: specjax train --config FILE" in out and "--config FILE --help lists" in out
  with pytest.raises(SystemExit) as exit_info:
    main(["train"])
  assert exit_info.value.code == 2
  assert "required: --config" in capsys.readouterr().err
