"""`benchmarks/drafter_acceptance.py`: its arms, and a run of it on a trained run's policy."""

import re

import pytest
from support import Killed, kill_after_first_checkpoint, load_benchmark, tiny_experiment

from specjax.decoding import FallbackDrafter, GroupDrafter, MTPDrafter
from specjax.errors import ConfigError
from specjax.experiments.grpo import run


def test_arms_name_a_drafter_and_a_chain():
  build = load_benchmark("drafter_acceptance").build_arm
  assert build("mtp chain2", 8, 128) == (MTPDrafter(), 2)
  assert build(" group6+mtp chain2", 8, 128) == (
      FallbackDrafter(GroupDrafter(8, 12, 6), MTPDrafter()), 2)
  assert build("batch2 chain3", 8, 128) == (GroupDrafter(128, 12, 2), 3)
  for bad in ("mtp", "group chain2", "mtp+group6 chain2", "group0 chain2", "group13 chain1",
              "eagle3 chain2"):
    with pytest.raises(ConfigError, match=re.escape(repr(bad.strip()))):
      build(bad, 8, 128)


@pytest.mark.slow
def test_a_runs_policy_is_rolled_out_with_each_arm_and_a_combined_drafter_split(tmp_path,
                                                                                capsys):
  run_dir = tmp_path / "run"
  with pytest.raises(Killed):  # stopped once step 0 is saved: a policy to read
    run(tiny_experiment(run_dir), log=kill_after_first_checkpoint)
  config = tmp_path / "config.py"
  config.write_text("from support import tiny_experiment\n\n\ndef get_config():\n"
                    f"  return tiny_experiment({str(run_dir)!r})\n")
  bench = load_benchmark("drafter_acceptance")
  assert bench.main([str(run_dir), "--config", str(config), "--batches", "1",
                     "--first-batch", "0", "--arms", "mtp chain1,group1+mtp chain1"]) == 0
  out = capsys.readouterr().out
  mtp = re.search(r"^mtp chain1 +([\d.]+) tokens / row-round", out, re.M)
  both = re.search(r"^group1\+mtp chain1 +([\d.]+) tokens / row-round +group: ([\d.]+) in "
                   r"(\d+) row-rounds +mtp: ([\d.]+) in (\d+) row-rounds", out, re.M)
  assert mtp and both, out
  assert 1.0 <= float(mtp[1]) <= 2.0 and 1.0 <= float(both[1]) <= 2.0  # chain1: 2 at most
  assert int(both[3]) + int(both[5]) > 0
