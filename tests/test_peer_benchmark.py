"""`benchmarks/peer.py`: specjax and transformers on one checkpoint, side by side."""

import dataclasses
import json

import numpy as np
import pytest
from support import load_benchmark


def test_rows_that_differ_are_counted_from_the_first_position_any_row_differs():
  first_difference = load_benchmark("peer").first_difference
  reference = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
  assert first_difference(reference.copy(), reference) == (2, None)
  other = reference.copy()
  other[1, 2:] = 0
  assert first_difference(other, reference) == (1, 2)


def test_the_forward_counter_counts_every_call_of_the_module():
  import torch
  counter_class = load_benchmark("peer").ForwardCounter
  layer = torch.nn.Linear(2, 2)
  counter = counter_class(layer)
  for _ in range(3):
    layer(torch.ones(1, 2))
  assert counter.calls == 3


@pytest.mark.slow
def test_both_libraries_decode_one_checkpoint_and_specjax_speculation_stays_lossless(
    tmp_path, monkeypatch, capsys):
  bench = load_benchmark("peer")
  models = bench.M
  # A few steps: the pipeline, not the models' quality, is under test.
  monkeypatch.setattr(models, "QUICK_TRAIN", dataclasses.replace(
      models.QUICK_TRAIN, target_steps=2, draft_steps=2, distill_docs=4,
      distill_target_steps=2, distill_draft_steps=2))
  out_json = tmp_path / "rows.json"
  bench.main(["--quick", "--cache-dir", str(tmp_path / "cache"), "--max-new", "6",
              "--repeats", "1", "--batches", "1,2", "--json", str(out_json)])
  out = capsys.readouterr().out
  assert "max |logit difference|" in out
  gap = float(out.split("max |logit difference| ")[1].split()[0])
  assert gap < 1e-3, out
  rows = json.loads(out_json.read_text())
  methods = {(r["mode"], r["batch"], r["library"], r["method"]) for r in rows}
  for mode in ("greedy", "sampled"):
    assert {(mode, 1, "specjax", "plain"), (mode, 1, "specjax", "n-gram chain3"),
            (mode, 1, "specjax", "draft model chain3"),
            (mode, 1, "specjax", "draft model chain16 conf"), (mode, 1, "transformers", "plain"),
            (mode, 1, "transformers", "prompt lookup 3"), (mode, 1, "transformers", "assisted 3"),
            (mode, 1, "transformers", "assisted (defaults)")} <= methods
    # transformers drafts for one sequence at a time: batch 2 has its plain decoding only
    assert {m for m in methods if m[:3] == (mode, 2, "transformers")} == {
        (mode, 2, "transformers", "plain")}
  for r in rows:
    assert r["tok_s"] > 0 and r["tok_per_forward"] >= 1.0 - 1e-6, r
    paired = r["library"] == "specjax" and (r["batch"] == 1 or r["method"] == "plain")
    assert (r["x_peer"] is not None) == paired, r
    if r["mode"] == "greedy" and r["library"] == "specjax":  # lossless, or main() would exit
      assert r["same"] == r["batch"], r


def test_own_prompts_repeat_a_segment_of_ids_inside_the_vocabulary():
  own_prompts = load_benchmark("peer").own_prompts
  prompts = own_prompts(np.random.default_rng(0), 50, 3, 20)
  assert prompts.shape == (3, 20) and prompts.dtype == np.int32
  assert prompts.min() >= 0 and prompts.max() < 50
  np.testing.assert_array_equal(prompts[:, 8:16], prompts[:, :8])


@pytest.mark.slow
def test_a_users_own_checkpoint_is_compared_without_a_draft_model(tmp_path, capsys):
  """`--checkpoint DIR`: a Qwen3 checkpoint written by transformers itself, no draft model:
  plain and n-gram rows in both libraries, logits that agree, no draft-model rows."""
  import torch
  import transformers
  torch.manual_seed(0)
  model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
      vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True))
  model.save_pretrained(tmp_path / "mine")
  out_json = tmp_path / "rows.json"
  load_benchmark("peer").main(["--checkpoint", str(tmp_path / "mine"), "--max-new", "6",
                               "--repeats", "1", "--batches", "1", "--modes", "greedy",
                               "--json", str(out_json)])
  out = capsys.readouterr().out
  assert float(out.split("max |logit difference| ")[1].split()[0]) < 1e-4, out
  rows = json.loads(out_json.read_text())
  assert {(r["library"], r["method"]) for r in rows} == {
      ("specjax", "plain"), ("specjax", "n-gram chain3"), ("transformers", "plain"),
      ("transformers", "prompt lookup 3")}
  assert all(r["same"] == 1 for r in rows if r["library"] == "specjax"), rows
