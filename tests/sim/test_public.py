"""The simulator beside accelerator figures it was not built from (`specjax.sim.public`)."""

import dataclasses

import pytest

from specjax.errors import ConfigError
from specjax.sim import public
from specjax.sim.devices import device_profile


def _rows(source_name):
  return [r for r in public.table() if r.source == source_name]


def test_each_source_fits_its_named_factors_on_its_fit_figures_and_nothing_else():
  for source in public.SOURCES:
    profile, datasheet = source.profile(), device_profile(source.device)
    changed = {f.name for f in dataclasses.fields(profile)
               if getattr(profile, f.name) != getattr(datasheet, f.name)} - {"name", "source"}
    curves = {"kv_scale": "kv_eff", "matmul_scale": "matmul_eff"}
    assert changed <= {curves.get(f, f) for f in source.fitted}, (source.name, changed)
    assert any(f.fit for f in source.figures) and any(not f.fit for f in source.figures)


def test_public_llama_decode_on_an_h200_is_predicted_within_20_percent():
  """Issue 36: every public figure within +-20%; batch 64 is held out (fit: batch 1)."""
  rows = _rows("llama3.1-8b, 1 x H200")
  assert abs(next(r for r in rows if r.fit).error) < 0.01  # one factor, one figure
  for row in rows:
    assert abs(row.error) <= 0.2, row


def test_this_projects_h200_engine_is_predicted_within_15_percent_but_for_batch_1():
  """Fitted to three figures (decode at batch 4 and 64, a verify forward over 256 tokens),
  the simulator predicts the other verify forwards and decode at batch 16 within 15%. Decode
  at batch 1 (2.04 ms) costs more than at batch 4 (1.10) and than a forward over 2 tokens of
  one row (1.05): XLA:GPU's kernels for [1, d] products, which no roofline follows. The
  datasheet profile prices a leaner engine than this one at every figure."""
  rows = _rows("specjax, 1 x H200")
  assert all(r.datasheet_error < -0.3 for r in rows), rows
  held = {r.label: r for r in rows if not r.fit}
  assert len(held) == 9, held
  assert held.pop("decode B=1").error < -0.4
  assert all(abs(r.error) <= 0.15 for r in held.values()), held


def test_the_table_names_what_was_fitted_and_the_worst_held_out_error():
  text = public.format_table()
  assert "held out" in text and "fitted" in text
  for source in public.SOURCES:
    assert f"{source.name}: {source.note}" in text and "worst held-out error" in text


def test_a_source_that_fits_nothing_it_names_is_refused():
  source = dataclasses.replace(public.SOURCES[0], fitted=("no_such_factor",))
  with pytest.raises(ConfigError, match="no_such_factor"):
    source.profile()
