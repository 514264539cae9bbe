"""`benchmarks/accelerator.py --smoke` runs every section's code path and writes its JSON.

The full run needs an accelerator and minutes; the smoke run takes the same code paths at a
tiny size on the CPU, so a change to the library that breaks the prepared script fails here
rather than on the borrowed machine.
"""

import json
import math

import pytest
from support import load_benchmark


def _numbers(tree, path=()):
  """(key path, value) of every number in a JSON tree (booleans are not numbers here)."""
  if isinstance(tree, dict):
    for key, value in tree.items():
      yield from _numbers(value, path + (str(key),))
  elif isinstance(tree, list):
    for value in tree:
      yield from _numbers(value, path)
  elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
    yield path, tree


@pytest.mark.slow
def test_smoke_run_writes_every_section_with_finite_positive_numbers(tmp_path):
  bench = load_benchmark("accelerator")
  out = tmp_path / "accelerator.json"
  assert bench.main(["--smoke", "--json", str(out)]) == 0
  report = json.loads(out.read_text())

  assert report["skipped"] == []
  assert report["header"]["smoke"] is True and report["header"]["dtype"] == "bfloat16"
  assert report["header"]["jax"] and report["header"]["devices"]
  assert set(report["sections"]) == set(bench.SECTIONS)
  for name, section in report["sections"].items():
    assert not {"skipped", "partial", "error"} & set(section), (name, section)
    assert section["rows"], name
    checked = 0
    for path, value in _numbers(section):
      assert math.isfinite(value), (name, path, value)
      if not set(path) & set(bench.SIGNED_FIELDS):
        assert value > 0, (name, path, value)
        checked += 1
    assert checked >= 5, name  # the walk found the section's timings

  plan = bench.SMOKE
  decode = report["sections"]["decode"]
  assert [r["batch"] for r in decode["rows"]] == list(plan.decode_batches)
  assert decode["in_place"]["deleted"] == decode["in_place"]["buffers"]  # donation honoured
  verify = report["sections"]["verify"]["rows"]
  assert all(set(r["ratio"]) == {str(t) for t in plan.verify_tokens} for r in verify)
  spec = report["sections"]["spec"]["rows"]
  assert len(spec) == len(plan.spec_batches) * len(plan.keep)
  for row in spec:
    # The controlled target follows its designed greedy map, and greedy speculation is
    # lossless, so every speculative row reproduces the plain tokens.
    assert row["map_agreement"] == 1.0 and row["same_as_plain"] == 1.0, row
    assert 1.0 < row["acc_len"] <= plan.chain + 1
  rl = {r["program"] for r in report["sections"]["rl"]["rows"]}
  assert rl == {"rollout", "logprobs", "update", "step"}
  rl_spec = report["sections"]["rl_spec"]["rows"]
  assert [(r["rows"], r["arm"]) for r in rl_spec] == [
      (rows, arm) for rows in plan.rl_spec_rows for arm in ("plain", "controlled", "history")]
  for row in rl_spec:
    # Every arm samples the designed policy at temperature 1 (it is that peaked) and is
    # lossless, so every response follows the map to EOS at its designed length.
    assert row["map_agreement"] == 1.0 and row["same_lengths"] is True, row
    assert row["length_max"] == plan.rl_spec_new, row
    assert (row["acc_len"] == 1.0) == (row["arm"] == "plain"), row
    assert row["acc_len"] <= plan.chain + 1, row
  attention = report["sections"]["attention"]["rows"]
  assert [r["batch"] for r in attention] == list(plan.attention_batches)
  assert all(set(r["ms"]) == set(plan.attention_impls) for r in attention)
  # Every preset row compiled, and each (config, LoRA) planned both ways has its saving.
  memory = report["sections"]["memory"]
  assert [(r["config"], r["remat"], r["lora"]) for r in memory["rows"]] == list(plan.memory)
  assert [(r["config"], r["lora"]) for r in memory["savings"]] == [("arithmetic_tiny.py", 0)]
  for r in memory["rows"]:
    assert r["arguments_gib"] == r["estimate_arguments_gib"], r  # the state, exact anywhere
