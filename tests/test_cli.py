"""The `specjax` command runs end to end on the built-in demo model."""

import pytest

from specjax.cli import COMMANDS, generate_command, main


def test_generate_demo_prints_text_acceptance_and_speedup(capsys):
  generate_command(demo=True, demo_steps=30, max_new_tokens=8, widths=(2, 1))
  out = capsys.readouterr().out
  assert "'7,10,13,' -> '" in out
  assert "acceptance per depth" in out
  assert "speculative / plain throughput" in out


def test_generate_demo_with_adaptive_speculation_prints_costs_and_rounds_per_tree(
    capsys, tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
  generate_command(demo=True, demo_steps=30, max_new_tokens=8, widths=(1, 1), adaptive=True)
  out = capsys.readouterr().out
  assert "calibration" in out and "chain2" in out
  assert "rounds per tree: plain" in out
  assert "speculative / plain throughput" in out


def test_generate_without_a_model_explains_what_to_pass():
  with pytest.raises(SystemExit, match="--checkpoint DIR or --demo"):
    generate_command()


def test_help_lists_every_command_and_a_missing_or_unknown_one_exits_2(capsys):
  main(["--help"])
  out = capsys.readouterr().out
  assert all(name in out for name in ("train", "train-drafter", "generate")), out
  assert set(COMMANDS) == {"train", "train-drafter", "generate"}
  for argv in ([], ["trian"]):
    with pytest.raises(SystemExit) as exit_info:
      main(argv)
    assert exit_info.value.code == 2
  assert "unknown command 'trian'" in capsys.readouterr().err
