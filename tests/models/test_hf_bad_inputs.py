"""HF checkpoint I/O under bad inputs: atomic saves, refused configs, clear errors.

Each test states the failure it protects against: a save that loses the previous export, a
config that cannot be represented exactly, or an unreadable file reported without its name.
References: transformers' own config classes and logits where they define the behaviour.
"""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from specjax.models import (CheckpointError, ConfigError, ModelConfig, forward, init_params,
                            load_hf, save_hf)
from specjax.models import hf as hf_io
from support import edit_config, edit_tensors

VOCAB = 64
REPO = Path(__file__).resolve().parents[2]


def _config(family: str = "llama", **changes) -> ModelConfig:
  base = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
              mlp_dim=48, family=family, qk_norm=family == "qwen3", qkv_bias=family == "qwen2")
  return ModelConfig(**(base | changes))


def _assert_trees_bitwise_equal(a, b) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def _siblings(path: Path) -> list[str]:
  return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


@pytest.fixture
def saved(tmp_path):
  """A complete two-layer Llama export at tmp_path / "ckpt" and the params it holds."""
  config = _config()
  params = init_params(config, jax.random.key(1))
  path = tmp_path / "ckpt"
  save_hf(params, config, path, max_shard_bytes=10_000)
  (path / "tokenizer.json").write_text("{}")  # not part of an export; must survive a resave
  return path, params, config


# --- 1. atomic save -----------------------------------------------------------------------------

# The child re-saves different weights over `path` and pauses at `point` until it is killed.
_CHILD = textwrap.dedent("""
    import os, sys, time
    import jax
    from specjax.models import ModelConfig, init_params, save_hf
    from specjax.models import hf
    path, point, ready = sys.argv[1:]
    config = ModelConfig(**{config!r})

    def pause():
      open(ready, "w").close()
      time.sleep(120)

    if point == "mid_write":
      real_write = hf._write_safetensors
      def write(arrays, file, metadata):
        real_write(arrays, file, metadata)
        pause()  # after the first shard of the new export
      hf._write_safetensors = write
    else:
      real_rename = os.rename
      def rename(src, dst):
        real_rename(src, dst)
        if ".old-" in str(dst):
          pause()  # the old export is moved aside, the new one not yet in place
      hf.os.rename = rename
    save_hf(init_params(config, jax.random.key(2)), config, path, max_shard_bytes=10_000)
    """)


@pytest.mark.parametrize("point", ["mid_write", "between_renames"])
def test_save_killed_over_existing_export_leaves_previous_export_loadable(saved, point):
  path, params, config = saved
  ready = path.parent / "ready"
  fields = {f: getattr(config, f) for f in ("vocab_size", "d_model", "n_layers", "n_heads",
                                             "n_kv_heads", "head_dim", "mlp_dim", "family")}
  child = subprocess.Popen(
      [sys.executable, "-c", _CHILD.format(config=fields), str(path), point, str(ready)],
      cwd=REPO, env=os.environ | {"JAX_PLATFORMS": "cpu"}, stderr=subprocess.PIPE)
  try:
    deadline = time.monotonic() + 60
    while not ready.exists():
      assert child.poll() is None, child.stderr.read().decode()
      assert time.monotonic() < deadline, "the child never reached the pause"
      time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
  finally:
    if child.poll() is None:
      child.kill()
      child.wait()
    child.stderr.close()
  assert child.returncode == -signal.SIGKILL
  assert path.exists() == (point == "mid_write")

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loaded, loaded_config = load_hf(path)
  moved_aside = [w for w in caught if "interrupted write" in str(w.message)]
  assert len(moved_aside) == (point == "between_renames")
  assert loaded_config == config
  _assert_trees_bitwise_equal(loaded, params)

  # The next save cleans up what the killed one left and keeps the non-export file.
  new = init_params(config, jax.random.key(3))
  save_hf(new, config, path)
  _assert_trees_bitwise_equal(load_hf(path)[0], new)
  assert (path / "tokenizer.json").read_text() == "{}"
  assert _siblings(path) == []


def test_disk_full_during_save_keeps_previous_export_and_raises_enospc(saved, monkeypatch):
  path, params, config = saved
  calls = []

  def save_file_then_fill_disk(arrays, file, metadata=None):
    calls.append(file)
    if len(calls) == 2:  # the first shard is complete, the second is cut short
      Path(file).write_bytes(b"\0" * 100)
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
    save_file(arrays, file, metadata=metadata)

  monkeypatch.setattr(hf_io, "save_file", save_file_then_fill_disk)
  with pytest.raises(OSError, match="No space left on device") as err:
    save_hf(init_params(config, jax.random.key(2)), config, path, max_shard_bytes=10_000)
  assert err.value.errno == errno.ENOSPC
  assert any(f"{path} is unchanged" in note for note in err.value.__notes__)
  assert _siblings(path) == []  # the half-written temporary is gone
  loaded, loaded_config = load_hf(path)
  assert loaded_config == config
  _assert_trees_bitwise_equal(loaded, params)


# --- 2. special token ids -----------------------------------------------------------------------


def test_save_hf_writes_token_ids_over_extra_config(tmp_path):
  config = _config()
  save_hf(init_params(config, jax.random.key(0)), config, tmp_path,
          extra_config={"eos_token_id": 9, "bos_token_id": 8},
          bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0)
  hf = json.loads((tmp_path / "config.json").read_text())
  assert (hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"]) == (1, [2, 3], 0)


def test_save_hf_rejects_token_id_outside_vocab(tmp_path):
  config = _config()
  with pytest.raises(ConfigError, match=rf"eos_token_id={VOCAB}.*\[0, {VOCAB}\)"):
    save_hf(init_params(config, jax.random.key(0)), config, tmp_path, eos_token_id=VOCAB)
  assert not tmp_path.joinpath("config.json").exists()


# --- 3. configs and tensors that cannot be represented exactly ---------------------------------


@pytest.fixture
def saved_qwen3(tmp_path):
  config = _config("qwen3", max_position=128)
  save_hf(init_params(config, jax.random.key(4)), config, tmp_path)
  return tmp_path


def _transformers_layer_types(path: Path) -> list[str]:
  transformers = pytest.importorskip("transformers")
  return transformers.AutoConfig.from_pretrained(path).layer_types


def test_active_qwen3_sliding_window_is_refused(saved_qwen3):
  edit_config(saved_qwen3, use_sliding_window=True, sliding_window=16, max_window_layers=1)
  assert "sliding_attention" in _transformers_layer_types(saved_qwen3)
  with pytest.raises(ConfigError, match=r"use_sliding_window=True with sliding_window=16 on "
                                        r"layers 1\.\.1.*allowed"):
    load_hf(saved_qwen3)


@pytest.mark.parametrize("changes", [
    {"use_sliding_window": True, "sliding_window": 128, "max_window_layers": 0},
    {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2},
    {"use_sliding_window": False, "sliding_window": 16, "max_window_layers": 0},
], ids=["window_covers_max_position", "no_layer_past_max_window_layers", "disabled"])
def test_inactive_sliding_window_loads_negative_control(saved_qwen3, changes):
  edit_config(saved_qwen3, **changes)
  # transformers agrees the window never masks: either no sliding layer, or one whose window
  # covers every position up to max_position_embeddings.
  types = _transformers_layer_types(saved_qwen3)
  assert "sliding_attention" not in types or changes["sliding_window"] >= 128
  load_hf(saved_qwen3)


@pytest.mark.parametrize("model_type,match", [
    ("mistral", r"model_type='mistral'.*allowed model_type one of "
                r"\['llama', 'qwen2', 'qwen3', 'qwen3_moe'\]"),
    ("qwen2", r"model_type='qwen2' disagrees with architectures=\['LlamaForCausalLM'\]"),
])
def test_model_type_other_than_the_llama_architecture_is_refused(saved, model_type, match):
  path, _, _ = saved
  edit_config(path, model_type=model_type)
  with pytest.raises(ConfigError, match=match):
    load_hf(path)


def test_non_integral_float_int_field_is_refused_integral_float_is_accepted(saved):
  path, params, config = saved
  edit_config(path, hidden_size=32.0, num_hidden_layers=2.0)
  loaded, loaded_config = load_hf(path)
  assert loaded_config == config
  edit_config(path, hidden_size=32.5)
  with pytest.raises(ConfigError, match=r"hidden_size=32\.5 is invalid: allowed an integer"):
    load_hf(path)


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("factor, match", [
    (None, r"llama3 rope scaling is missing \['factor'\]"),
    ([8.0], r"rope_scaling: factor=\[8\.0\] is invalid: allowed a finite number"),
    ("8.0", r"rope_scaling: factor='8\.0' is invalid: allowed a finite number"),
])
def test_a_llama3_rope_factor_that_is_not_a_number_is_refused_naming_it(factor, match):
  """null or a list used to raise a bare TypeError, and "8.0" was taken as 8.0."""
  hf = hf_io.config_to_hf(_config()) | {"rope_scaling": _LLAMA3 | {"factor": factor}}
  with pytest.raises(ConfigError, match=match):
    hf_io.config_from_hf(hf)
  assert hf_io.config_from_hf(hf | {"rope_scaling": _LLAMA3}).rope_scaling.factor == 8.0


def test_layer_types_given_as_a_string_is_refused_as_not_a_list():
  hf = hf_io.config_to_hf(_config()) | {"layer_types": "full_attention"}
  with pytest.raises(ConfigError, match=r"layer_types='full_attention' is invalid: allowed a "
                                        r"list of layer type names"):
    hf_io.config_from_hf(hf)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_a_config_without_head_dim_takes_transformers_default_for_the_family(family):
  """Qwen3Config defaults head_dim to 128; Llama and Qwen2 derive it from the width."""
  transformers = pytest.importorskip("transformers")
  hf = hf_io.config_to_hf(_config(family, head_dim=8))
  del hf["head_dim"]
  reference = transformers.AutoConfig.for_model(**hf)
  expected = getattr(reference, "head_dim", None) or hf["hidden_size"] // hf[
      "num_attention_heads"]
  assert hf_io.config_from_hf(hf).head_dim == expected
  assert expected == (128 if family == "qwen3" else 8)


def test_a_heads_file_that_config_json_does_not_count_warns_naming_it(tmp_path):
  """`save_hf` writes the two together; a config.json rewritten without its "specjax" entry
  would otherwise drop the heads without a word."""
  config = _config(num_mtp_modules=1)
  save_hf(init_params(config, jax.random.key(2)), config, tmp_path)
  hf = json.loads((tmp_path / "config.json").read_text())
  del hf["specjax"]
  (tmp_path / "config.json").write_text(json.dumps(hf))
  with pytest.warns(UserWarning, match=r"specjax_heads\.safetensors holds draft heads, but "
                                       r".*config\.json has no \"specjax\" entry"):
    params, loaded = load_hf(tmp_path)
  assert loaded.num_mtp_modules == 0 and "mtp" not in params
  with warnings.catch_warnings():  # the negative control: an export as save_hf wrote it
    warnings.simplefilter("error")
    save_hf(init_params(config, jax.random.key(2)), config, tmp_path)
    assert load_hf(tmp_path)[1].num_mtp_modules == 1


@pytest.mark.parametrize("dtype", [np.int32, np.bool_])
def test_integer_or_bool_weight_is_refused(tmp_path, dtype):
  config = _config(n_layers=1)
  save_hf(init_params(config, jax.random.key(5)), config, tmp_path)
  name = "model.layers.0.mlp.up_proj.weight"
  edit_tensors(tmp_path, lambda t: t.update({name: t[name].astype(dtype)}))
  with pytest.raises(CheckpointError,
                     match=rf"{re.escape(name)}.*dtype (I32|BOOL): allowed a float"):
    load_hf(tmp_path)


def test_save_hf_refuses_integer_params(tmp_path):
  config = _config(n_layers=1)
  params = init_params(config, jax.random.key(5))
  params["final_norm"] = jnp.ones_like(params["final_norm"], jnp.int32)
  with pytest.raises(ConfigError, match="final_norm has dtype int32: allowed a float"):
    save_hf(params, config, tmp_path)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/outside.safetensors",
                                   "sub/../../outside.safetensors"])
def test_index_shard_outside_checkpoint_is_refused(saved, shard):
  path, _, _ = saved
  index_file = path / "model.safetensors.index.json"
  index = json.loads(index_file.read_text())
  name = next(iter(index["weight_map"]))
  index["weight_map"][name] = shard
  index_file.write_text(json.dumps(index))
  with pytest.raises(CheckpointError,
                     match=re.escape(f"weight_map[{name!r}]={shard!r} points outside")):
    load_hf(path)


# --- 4. tie_word_embeddings with a stored lm_head ----------------------------------------------


@pytest.mark.parametrize("stored", ["differing_lm_head", "only_lm_head"])
def test_tied_config_with_stored_lm_head_matches_transformers_logits(tmp_path, stored):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  hf_config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                       num_hidden_layers=1, num_attention_heads=4,
                                       num_key_value_heads=2, tie_word_embeddings=True,
                                       initializer_range=0.2)
  transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path)
  rng = np.random.default_rng(0)

  def edit(t):
    t["lm_head.weight"] = rng.normal(0, 0.2, (VOCAB, 32)).astype(np.float32)
    if stored == "only_lm_head":
      del t["model.embed_tokens.weight"]
  edit_tensors(tmp_path, edit)

  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
  tokens = rng.integers(0, VOCAB, (1, 7))
  with torch.no_grad():
    expected = model.eval()(input_ids=torch.tensor(tokens)).logits.numpy()

  if stored == "differing_lm_head":
    with pytest.warns(UserWarning, match="loading them untied, as transformers does"):
      params, config = load_hf(tmp_path)
    assert not config.tie_embeddings
  else:
    params, config = load_hf(tmp_path)
    assert config.tie_embeddings
  positions = jnp.arange(tokens.shape[1])[None]
  logits = np.asarray(forward(params, config, jnp.asarray(tokens), positions).logits)
  np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)
  if stored == "differing_lm_head":  # negative control: tying (the old behaviour) differs
    tied = {k: v for k, v in params.items() if k != "unembed"}
    wrong = forward(tied, config.replace(tie_embeddings=True), jnp.asarray(tokens), positions)
    assert np.abs(np.asarray(wrong.logits) - expected).max() > 100 * 1e-4


# --- 5. malformed JSON and corrupt safetensors -------------------------------------------------


@pytest.mark.parametrize("file", ["config.json", "model.safetensors.index.json"])
def test_malformed_json_error_names_file_and_position(saved, file):
  path, _, _ = saved
  (path / file).write_text('{\n  "a": 1,,\n}')
  with pytest.raises(CheckpointError,
                     match=rf"{re.escape(file)}: malformed JSON at line 2 column 10"):
    load_hf(path)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_truncated_safetensors_error_names_file_and_suggests_redownload(tmp_path, sharded):
  config = _config()
  save_hf(init_params(config, jax.random.key(6)), config, tmp_path,
          max_shard_bytes=10_000 if sharded else hf_io.DEFAULT_MAX_SHARD_BYTES)
  file = sorted(tmp_path.glob("model*.safetensors"))[-1]
  file.write_bytes(file.read_bytes()[:-100])
  with pytest.raises(CheckpointError, match=rf"{re.escape(file.name)}: unreadable safetensors "
                                            r"file .*corrupt or truncated: re-download"):
    load_hf(tmp_path)
