"""`benchmarks/reward_overlap.py --quick` runs its four arms and states what it measured: a
slow reward adds its sleep to a sync step, and an async step whose device work is shorter than
the reward cannot hide it (said, not passed off as overlap)."""

import json

from support import load_benchmark


def test_quick_run_prints_every_arm_and_says_when_the_reward_cannot_hide(tmp_path, capsys):
  bench = load_benchmark("reward_overlap")
  assert bench.main(["--quick", "--reward-s", "0.3", "--json", str(tmp_path / "out.json")]) == 0
  out = capsys.readouterr().out
  rows = {(r["mode"], r["reward"]): r for r in json.loads((tmp_path / "out.json").read_text())[
      "rows"]}
  assert set(rows) == {(m, r) for m in ("sync", "async") for r in ("instant", "slow")}
  assert rows["sync", "slow"]["step_s"] >= 0.3  # the update waits for the sleep
  assert rows["sync", "slow"]["overlap"] == 0.0
  assert rows["async", "slow"]["reward_s"] >= 0.3
  assert 0.0 <= rows["async", "slow"]["overlap"] <= 1.0
  # The note comes exactly when the device work is shorter than the reward.
  assert ("cannot then be hidden" in out) == (rows["async", "instant"]["step_s"] <= 0.3)
