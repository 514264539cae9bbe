"""`benchmarks/moe_decode.py` runs (`--quick`): its table has every arm and the ratios, and
the MoE step routes each token of the batch to its k experts."""

import re

import pytest
from support import load_benchmark


@pytest.mark.slow  # two dozen compiles: 40 s on 2 cores
def test_the_quick_run_prints_a_row_per_batch_with_every_arm(capsys):
  bench = load_benchmark("moe_decode")
  assert bench.main(["--quick", "--batches", "1,2", "--repeats", "1"]) == 0
  out = capsys.readouterr().out
  assert "32 experts, top 4" in out and "moe/dense" in out and "ragged/loop" in out
  assert "verify of 1 + k tokens per row" in out and "k=7 moe" in out
  rows = re.findall(r"^\s+(\d+)\s+(loop|ragged)\s+(\d+)((?:\s+[\d.]+){4})\s+([\d.]+)x\s+"
                    r"([\d.]+)x$", out, re.M)
  assert [int(r[0]) for r in rows] == [1, 2], out
  assert [r[1] for r in rows] == ["loop", "loop"]  # on a CPU, the loop
  assert int(rows[0][2]) == 4 and 4 <= int(rows[1][2]) <= 8  # k experts a token, distinct
