"""`benchmarks/sim_validation.py`: every category runs and reports finite predictions.

Issue 12's error targets are not asserted here: CI machines are shared and noisy, so the
script itself says whether a run met them; these tests keep it from rotting and check that
only the held-out rows, fixed by the plan, enter its summary.
"""

import json
import math

import pytest
from support import load_benchmark


def test_summary_counts_only_held_out_rows_against_the_issue_target():
  bench = load_benchmark("sim_validation")
  row = lambda role, measured, predicted: bench.Row("decode", "x", role, "ms", measured,
                                                    predicted)
  rows = [row("fit", 1.0, 3.0),            # +200%: fitted, so not counted
          row("held out", 1.0, 1.05), row("held out", 1.0, 0.9), row("held out", 2.0, 2.4)]
  summary = bench.summarize(rows)
  assert summary["held_out"] == 3 and summary["fitted"] == 1
  assert summary["median_abs_error"] == pytest.approx(0.10)
  assert summary["max_abs_error"] == pytest.approx(0.20)
  assert summary["within_target"] is True
  rows.append(row("held out", 1.0, 1.3))  # one held-out row past the 25% worst case
  assert bench.summarize(rows)["within_target"] is False


def test_unknown_category_is_refused_naming_the_allowed_ones(capsys):
  bench = load_benchmark("sim_validation")
  with pytest.raises(SystemExit):
    bench.parse_args(["--categories", "decode,latency"])
  assert "decode, spec, rl" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_run_reports_every_category_with_finite_predictions(tmp_path):
  bench = load_benchmark("sim_validation")
  out = tmp_path / "sim_validation.json"
  assert bench.main(["--quick", "--json", str(out)]) == 0
  report = json.loads(out.read_text())

  assert report["header"]["quick"] is True
  assert set(report["categories"]) == set(bench.CATEGORIES)
  assert set(report["profiles"]) == {"calibrated", *bench.CATEGORIES}
  for name, category in report["categories"].items():
    rows = category["rows"]
    assert {r["role"] for r in rows} == {"fit", "held out"}, name
    for r in rows:
      assert all(math.isfinite(r[f]) for f in ("measured", "predicted", "error")), (name, r)
      assert r["measured"] > 0 and r["predicted"] > 0, (name, r)
    summary = category["summary"]
    assert summary["held_out"] == sum(r["role"] == "held out" for r in rows) > 0
    assert math.isfinite(summary["median_abs_error"]) and math.isfinite(summary["max_abs_error"])
    assert isinstance(summary["within_target"], bool)

  plan = bench.QUICK
  decode = report["categories"]["decode"]["rows"]
  assert len(decode) == len(plan.shapes) * len(plan.batches) * len(plan.tokens)
  # The fitted rows are the plan's: its fit shapes at its fit batches, nothing else.
  fitted = {r["config"] for r in decode if r["role"] == "fit"}
  assert fitted == {f"{shape} B={b} T={t}" for shape in plan.fit_shapes
                    for b in plan.fit_batches for t in plan.tokens}
  spec = report["categories"]["spec"]["rows"]
  assert len(spec) == len(plan.spec_batches) * len(plan.keep)
  for r in spec:
    # The controlled target follows its designed greedy map and greedy speculation is
    # lossless, so the designed acceptance holds and every row reproduces plain decoding.
    assert r["extra"]["map_agreement"] == 1.0 and r["extra"]["same_as_plain"] == 1.0, r
    assert 1.0 < r["extra"]["acc_len"] <= plan.chain + 1
  rl = report["categories"]["rl"]["rows"]
  assert len(rl) == 4 * len(plan.rl_configs)
