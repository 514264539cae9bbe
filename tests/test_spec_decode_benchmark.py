"""`benchmarks/spec_decode.py` states a ratio with its repeats' range, or as too short to
measure: `--quick` runs 2 repeats, and a smoke run must not read as a speedup."""

import dataclasses

from support import load_benchmark


def _row(bench, per_repeat):
  return bench.Row(drafter="mtp", tree="chain3", batch=1, plain_tps=100.0, spec_tps=170.0,
                   ratio=1.7, spread=0.1, acc_len=2.0, drafts=3.0, eff=0.85, acc_depth=[0.6],
                   compile_s=1.0, spec_ms=1.0, plain_ms=1.7, rounds=10.0, tail=1.0, cost=1.2,
                   verify=1.1, draft=0.1, ideal=1.8, engine_eff=0.94, verify_ms=1.1,
                   step_ms=1.0, per_repeat=per_repeat)


def test_a_ratio_from_too_few_repeats_is_not_stated_as_a_speedup(capsys):
  bench = load_benchmark("spec_decode")
  quick = _row(bench, [1.6, 1.8])  # --quick: 2 repeats
  assert bench.ratio_text(quick) == "1.70 (too short to measure: 2 repeat(s))"
  bench.print_table([quick])
  out = capsys.readouterr().out
  assert " 1.70* " in out and "fewer than 3 repeats: too short to measure" in out
  measured = dataclasses.replace(quick, per_repeat=[0.9, 1.7, 1.8])
  assert bench.ratio_text(measured) == "1.70 (repeats 0.90-1.80, 1.0 within)"
  assert bench.ratio_text(dataclasses.replace(quick, per_repeat=[1.5, 1.7, 1.8])) == (
      "1.70 (repeats 1.50-1.80)")
