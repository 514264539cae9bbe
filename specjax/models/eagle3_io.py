"""EAGLE-3 checkpoints in the public layout that vLLM and SGLang load.

A directory holds `config.json` (architecture "LlamaForCausalLMEagle3", one hidden layer,
`draft_vocab_size`, and the aux layer ids under `eagle_aux_hidden_state_layer_ids`, the key
vLLM reads) and `model.safetensors` with the tensor names of the EAGLE-3 reference trainer.
HF `Linear` weights are `[out, in]`; specjax stores `[in, ...]` with head axes split out:

  fc.weight                              [E, 3E]      <->  fc       [3E, E]
  midlayer.self_attn.q_proj.weight       [Q*H, 2E]    <->  wq       [2E, Q, H]
  midlayer.self_attn.k/v_proj.weight     [K*H, 2E]    <->  wk / wv  [2E, K, H]
  midlayer.self_attn.o_proj.weight       [E, Q*H]     <->  wo       [Q, H, E]
  midlayer.mlp.gate/up_proj.weight       [F, E]       <->  w_gate / w_up [E, F]
  midlayer.mlp.down_proj.weight          [E, F]       <->  w_down   [F, E]
  midlayer.hidden_norm.weight            [E]          <->  hidden_norm
  midlayer.input_layernorm.weight        [E]          <->  input_norm (of the token embedding)
  midlayer.post_attention_layernorm.weight [E]        <->  mlp_norm
  norm.weight                            [E]          <->  norm
  lm_head.weight                         [W, E]       <->  lm_head  [E, W]
  d2t                                    int64 [W]    offsets: target id = draft id + d2t[id]
  t2d                                    bool [V]     whether each target id is in the draft

The attention input is `[input_layernorm(embedding); hidden_norm(hidden)]`, embedding first.
An `embed_tokens.weight` in the file is accepted and ignored: the target's embedding is used.

Shape letters: see `specjax` (V target vocab, W draft vocab, E d_model, Q query heads,
K kv heads, H head_dim, F MLP width).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from specjax.errors import CheckpointError, ConfigError
from specjax.files import existing, read_object, replace_directory
from specjax.models.config import DTYPES, ModelConfig
from specjax.models.eagle3 import Eagle3Config, check_d2t, default_aux_layers
from specjax.models.hf import FLOAT_DTYPES, check_finite, open_safetensors
from specjax.models.hf_config import (_float_field, _int_field, _param_dtype, _rope_from_hf,
                                      _rope_to_hf)
from specjax.models.params import Params

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"
# Names under which EAGLE-3 drafts are published; the EAGLE trainer's own config.json says
# plain "LlamaForCausalLM" (with one layer), so that is accepted too.
_ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM", "LlamaForCausalLM")
AUX_KEY = "eagle_aux_hidden_state_layer_ids"
_IGNORED = ("embed_tokens.weight",)

_CONVERT_HINT = (
    "convert it with: python -c \"import torch; from safetensors.torch import save_file; "
    "sd = torch.load('pytorch_model.bin', map_location='cpu'); "
    "save_file({k: v.contiguous() for k, v in sd.items()}, 'model.safetensors', "
    "metadata={'format': 'pt'})\"")


def _layout(config: Eagle3Config) -> list[tuple[str, tuple[str, ...], tuple[int, ...],
                                                tuple[int, ...], bool]]:
  """(file name, params key, specjax shape, stored shape, transposed) of every weight."""
  e, q, k, h, f, w = (config.d_model, config.n_heads, config.n_kv_heads, config.head_dim,
                      config.mlp_dim, config.draft_vocab_size)
  m = "midlayer."
  return [
      ("fc.weight", ("fc",), (3 * e, e), (e, 3 * e), True),
      (m + "hidden_norm.weight", ("layer", "hidden_norm"), (e,), (e,), False),
      (m + "input_layernorm.weight", ("layer", "input_norm"), (e,), (e,), False),
      (m + "self_attn.q_proj.weight", ("layer", "wq"), (2 * e, q, h), (q * h, 2 * e), True),
      (m + "self_attn.k_proj.weight", ("layer", "wk"), (2 * e, k, h), (k * h, 2 * e), True),
      (m + "self_attn.v_proj.weight", ("layer", "wv"), (2 * e, k, h), (k * h, 2 * e), True),
      (m + "self_attn.o_proj.weight", ("layer", "wo"), (q, h, e), (e, q * h), True),
      (m + "post_attention_layernorm.weight", ("layer", "mlp_norm"), (e,), (e,), False),
      (m + "mlp.gate_proj.weight", ("layer", "w_gate"), (e, f), (f, e), True),
      (m + "mlp.up_proj.weight", ("layer", "w_up"), (e, f), (f, e), True),
      (m + "mlp.down_proj.weight", ("layer", "w_down"), (f, e), (e, f), True),
      ("norm.weight", ("norm",), (e,), (e,), False),
      ("lm_head.weight", ("lm_head",), (e, w), (w, e), True),
  ]


# ---------------------------------------------------------------------------------------------
# config.json


def eagle3_config_to_hf(config: Eagle3Config, torch_dtype: str | None = None) -> dict[str, Any]:
  """The `config.json` dict of `config` (readable by vLLM, SGLang and transformers v4/v5)."""
  rope, legacy_scaling = _rope_to_hf(config.rope_theta, config.rope_scaling)
  dtype = torch_dtype or config.param_dtype
  aux = list(config.aux_layers)
  return {
      "architectures": [ARCHITECTURE],
      "model_type": "llama",
      "hidden_size": config.d_model,
      "num_attention_heads": config.n_heads,
      "num_key_value_heads": config.n_kv_heads,
      "head_dim": config.head_dim,
      "intermediate_size": config.mlp_dim,
      "num_hidden_layers": 1,
      "vocab_size": config.vocab_size,
      "draft_vocab_size": config.draft_vocab_size,
      "hidden_act": "silu",
      "rms_norm_eps": config.rms_norm_eps,
      "rope_theta": config.rope_theta,
      "rope_scaling": legacy_scaling,
      "rope_parameters": rope,
      "max_position_embeddings": config.max_position,
      "tie_word_embeddings": False,
      "attention_bias": False,
      "mlp_bias": False,
      "torch_dtype": dtype,
      "dtype": dtype,
      AUX_KEY: aux,
      "eagle_config": {AUX_KEY: aux, "use_aux_hidden_state": True},
  }


def eagle3_config_from_hf(hf: Mapping[str, Any], target: ModelConfig | None = None, *,
                          param_dtype: str = "auto", dtype: str | None = None) -> Eagle3Config:
  """The `Eagle3Config` of an EAGLE-3 `config.json` dict.

  Aux layer ids come from `eagle_aux_hidden_state_layer_ids` (top level, then under
  "eagle_config"); when absent, `target` supplies the default that vLLM would use.

  Raises:
    ConfigError: an unsupported architecture or option, missing fields, or aux layer ids
      that do not fit `target`.
  """
  archs = hf.get("architectures") or []
  if archs and not any(a in _ARCHITECTURES for a in archs):
    raise ConfigError(f"config.json: architectures={archs!r} is unsupported: allowed one of "
                      f"{list(_ARCHITECTURES)}")
  missing = [f for f in ("vocab_size", "hidden_size", "intermediate_size",
                         "num_attention_heads") if f not in hf]
  if missing:
    raise ConfigError(f"config.json: missing required fields {missing} for an EAGLE-3 draft")
  layers = _int_field(hf, "num_hidden_layers", 1)
  if layers != 1:
    raise ConfigError(f"config.json: num_hidden_layers={layers} is unsupported: allowed 1 "
                      "(one midlayer)")
  if hf.get("hidden_act", "silu") != "silu":
    raise ConfigError(f"config.json: hidden_act={hf['hidden_act']!r} is unsupported: allowed "
                      "'silu'")
  for flag in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
    if hf.get(flag, False):
      raise ConfigError(f"config.json: {flag}=True is unsupported: allowed False")
  d = _int_field(hf, "hidden_size")
  if hf.get("target_hidden_size") not in (None, d):
    raise ConfigError(f"config.json: target_hidden_size={hf['target_hidden_size']} is "
                      f"unsupported: allowed equal to hidden_size={d}")
  param_dtype = _param_dtype(hf, param_dtype)

  aux = hf.get(AUX_KEY) or (hf.get("eagle_config") or {}).get(AUX_KEY)
  if not aux:
    if target is None:
      raise ConfigError(f"config.json has no {AUX_KEY}: pass target= so the default aux "
                        "layers for that target can be used")
    aux = default_aux_layers(target.n_layers)
  if not (isinstance(aux, (list, tuple)) and len(aux) == 3):
    raise ConfigError(f"config.json: {AUX_KEY}={aux!r} is unsupported: allowed 3 layer ids")
  vocab = _int_field(hf, "vocab_size")
  n_heads = _int_field(hf, "num_attention_heads")
  if n_heads < 1:
    raise ConfigError(f"config.json: num_attention_heads={n_heads} is invalid: allowed >= 1")
  optional_int = lambda name, default: (default if hf.get(name) is None  # null: the default
                                        else _int_field(hf, name))
  theta, scaling = _rope_from_hf(hf)
  config = Eagle3Config(
      d_model=d,
      n_heads=n_heads,
      n_kv_heads=optional_int("num_key_value_heads", n_heads),
      head_dim=optional_int("head_dim", d // n_heads),
      mlp_dim=_int_field(hf, "intermediate_size"),
      vocab_size=vocab,
      draft_vocab_size=optional_int("draft_vocab_size", vocab),
      aux_layers=tuple(int(i) for i in aux),
      rms_norm_eps=_float_field(hf, "rms_norm_eps", 1e-6),
      rope_theta=theta,
      rope_scaling=scaling,
      max_position=_int_field(hf, "max_position_embeddings", 2048),
      dtype=dtype or param_dtype,
      param_dtype=param_dtype,
  )
  if target is not None:
    config.check_target(target)
  return config


# ---------------------------------------------------------------------------------------------
# Saving


def save_eagle3(directory: str | os.PathLike, params: Params, config: Eagle3Config,
                d2t: np.ndarray, *, dtype: str | None = None) -> None:
  """Write an EAGLE-3 checkpoint directory (`config.json` + `model.safetensors`) atomically.

  Args:
    directory: output directory; created, or replaced as a whole (other files kept).
    params: draft parameters of `config`.
    config: the draft configuration.
    d2t: `[W]` distinct target ids of the draft vocabulary.
    dtype: dtype of the stored float tensors (one of `DTYPES`); default the params' own.

  Raises:
    ConfigError: a param missing or misshapen, a bad `d2t` or `dtype`.
  """
  if dtype is not None and dtype not in DTYPES:
    raise ConfigError(f"dtype={dtype!r} is invalid: allowed None or one of {DTYPES}")
  d2t = np.asarray(d2t)
  check_d2t(d2t, config)
  tensors: dict[str, np.ndarray] = {}
  stored_dtype = None
  for name, key, shape, stored, transposed in _layout(config):
    try:
      value = params[key[0]] if len(key) == 1 else params[key[0]][key[1]]
    except (KeyError, TypeError):
      raise ConfigError(f"params is missing {'/'.join(key)} (expected shape {shape})") from None
    if tuple(value.shape) != shape:
      raise ConfigError(f"params {'/'.join(key)} has shape {tuple(value.shape)}, expected "
                        f"{shape} from the config")
    array = np.asarray(jnp.asarray(value).astype(dtype) if dtype else value)
    array = array.reshape(stored[::-1]).T if transposed else array.reshape(stored)
    tensors[name] = np.ascontiguousarray(array)
    stored_dtype = stored_dtype or str(array.dtype)
  w, v = config.draft_vocab_size, config.vocab_size
  tensors["d2t"] = d2t.astype(np.int64) - np.arange(w, dtype=np.int64)
  t2d = np.zeros((v,), bool)
  t2d[d2t] = True
  tensors["t2d"] = t2d
  hf = eagle3_config_to_hf(config, dtype or stored_dtype)

  def write_weights(path: Path) -> None:
    save_file(tensors, path, metadata={"format": "pt"})  # transformers requires "format"

  def write_config(path: Path) -> None:
    path.write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")

  writers = {WEIGHTS_FILE: write_weights, CONFIG_FILE: write_config}

  def write_all(tmp: Path) -> None:
    for name, write in writers.items():
      write(tmp / name)

  replace_directory(Path(directory), write_all, writers.__contains__)


# ---------------------------------------------------------------------------------------------
# Loading


def _read_d2t(handle: Any, names: set[str], config: Eagle3Config, path: Path) -> np.ndarray:
  """Absolute draft -> target ids `[W]` from the stored offsets, checked against `t2d`."""
  w, v = config.draft_vocab_size, config.vocab_size
  if "d2t" not in names:
    if w != v:
      raise CheckpointError(f"{path}: missing tensor 'd2t' (int64 [{w}]), required when "
                            f"draft_vocab_size={w} < vocab_size={v}")
    d2t = np.arange(w, dtype=np.int64)
  else:
    offsets = handle.get_tensor("d2t")
    if offsets.shape != (w,) or not np.issubdtype(offsets.dtype, np.integer):
      raise CheckpointError(f"{path}: tensor 'd2t' has shape {offsets.shape} and dtype "
                            f"{offsets.dtype}, expected integer offsets of shape ({w},)")
    d2t = offsets.astype(np.int64) + np.arange(w, dtype=np.int64)
    try:
      check_d2t(d2t, config)
    except ConfigError as e:
      raise CheckpointError(f"{path}: tensor 'd2t' (offsets, target id = draft id + d2t) is "
                            f"invalid: {e}") from None
  if "t2d" in names:
    t2d = handle.get_tensor("t2d")
    expected = np.zeros((v,), bool)
    expected[d2t] = True
    if t2d.shape != (v,) or not np.array_equal(t2d.astype(bool), expected):
      raise CheckpointError(f"{path}: tensor 't2d' (shape {t2d.shape}) is inconsistent with "
                            f"'d2t': expected a [{v}] mask set exactly at the {w} target ids "
                            "d2t maps to")
  return d2t.astype(np.int32)


def load_eagle3(directory: str | os.PathLike, target: ModelConfig | None = None, *,
                param_dtype: str = "auto", dtype: str | None = None
                ) -> tuple[Eagle3Config, Params, jnp.ndarray]:
  """Load an EAGLE-3 checkpoint directory in the public layout.

  Args:
    directory: holds `config.json` and `model.safetensors`.
    target: the target model's config; checks the draft fits it and supplies the default aux
      layers when `config.json` names none.
    param_dtype: dtype of the returned parameters, or "auto" for the checkpoint's own.
    dtype: compute dtype of the returned config; defaults to the parameter dtype.

  Returns:
    `(config, params, d2t)`: params of `init_eagle3(config, key)`'s structure and the int32
    draft -> target ids `[W]` (identity when the file has no `d2t` and W == V).

  Raises:
    CheckpointError: missing files; a missing, misshapen or unexpected tensor; a `d2t` that
      is out of range or not injective, or a `t2d` that disagrees with it.
    ConfigError: unsupported options, or a draft that does not fit `target`.
  """
  path = existing(Path(directory), CONFIG_FILE)  # or the version a killed save moved aside
  if not path.is_dir():
    raise CheckpointError(f"{path}: not a directory; expected an EAGLE-3 checkpoint directory")
  config_file = path / CONFIG_FILE
  if not config_file.is_file():
    raise CheckpointError(f"{path}: missing {CONFIG_FILE}; expected an EAGLE-3 checkpoint "
                          "directory")
  weights = path / WEIGHTS_FILE
  if not weights.is_file():
    if any(path.glob("pytorch_model*.bin")):
      raise CheckpointError(f"{path}: has pytorch_model.bin but no {WEIGHTS_FILE}; only "
                            f"safetensors are read (pickles can run code); {_CONVERT_HINT}")
    raise CheckpointError(f"{path}: missing {WEIGHTS_FILE}")
  record = read_object(config_file, CheckpointError,
                       "re-save the head (save_eagle3, specjax train-drafter)")
  config = eagle3_config_from_hf(record, target, param_dtype=param_dtype, dtype=dtype)
  layout = _layout(config)
  known = {entry[0] for entry in layout} | {"d2t", "t2d"} | set(_IGNORED)
  weight_dtype = np.dtype(config.weight_dtype)
  params: Params = {"layer": {}}
  with open_safetensors(weights) as handle:
    names = set(handle.keys())
    unexpected = sorted(names - known)
    if unexpected:
      raise CheckpointError(f"{path}: unexpected tensors for an EAGLE-3 draft: {unexpected[:8]}"
                            + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8
                               else ""))
    for name, key, shape, stored, transposed in layout:
      if name not in names:
        raise CheckpointError(f"{path}: missing tensor {name!r} (expected shape {stored})")
      tensor = handle.get_slice(name)
      got = tuple(tensor.get_shape())
      if got != stored:
        raise CheckpointError(f"{path}: tensor {name!r} has shape {got}, expected {stored}")
      if tensor.get_dtype() not in FLOAT_DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {tensor.get_dtype()}: "
                              f"allowed a float dtype, one of {FLOAT_DTYPES}")
      array = handle.get_tensor(name)
      check_finite(array, f"{path}: tensor {name!r}", "the head is damaged or was saved from "
                   "a diverged run; export it again from a healthy one")
      array = array.T.reshape(shape) if transposed else array.reshape(shape)
      value = jnp.asarray(array.astype(weight_dtype))
      if len(key) == 1:
        params[key[0]] = value
      else:
        params[key[0]][key[1]] = value
    d2t = _read_d2t(handle, names, config, path)
  return config, params, jnp.asarray(d2t)
