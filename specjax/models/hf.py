"""Hugging Face checkpoints: read and write `config.json` + safetensors for Llama / Qwen2 / Qwen3.

`load_hf(path)` returns `(params, config)` in specjax's layout; `save_hf(params, config, path)`
writes a directory that `transformers.AutoModelForCausalLM.from_pretrained` loads as the same
model. A load -> save -> load round trip is bitwise exact.

Layout. HF stores a `Linear` weight as `[out, in]`; specjax stores `[in, ...]` with the head
axes split out, so each weight is transposed and reshaped:

  q_proj.weight  [Q*H, E]  <->  wq [E, Q, H]        o_proj.weight  [E, Q*H]  <->  wo [Q, H, E]
  k/v_proj.weight [K*H, E] <->  wk/wv [E, K, H]     gate/up_proj.weight [F, E] <-> [E, F]
  down_proj.weight [E, F]  <->  w_down [F, E]       lm_head.weight [V, E]    <->  unembed [E, V]
  q_proj.bias [Q*H] <-> bq [Q, H]                   k/v_proj.bias [K*H] <-> bk/bv [K, H]

Draft heads (MTP modules, Medusa heads) have no HF equivalent. They go to a separate
`specjax_heads.safetensors` in specjax's own layout, with their counts under a "specjax" key
of `config.json`; transformers ignores both, so the directory still loads there as the trunk.

Both the transformers v5 (`rope_parameters`, `dtype`) and v4 (`rope_theta` + `rope_scaling`,
`torch_dtype`) spellings are read, and both are written.

Shape letters: see `specjax` (V vocab, E d_model, Q query heads, K kv heads, H head_dim,
F MLP width).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from specjax.errors import CheckpointError, ConfigError
from specjax.models.config import DTYPES, Llama3RopeScaling, ModelConfig

Params = dict[str, Any]

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3"}
_FAMILY_ARCH = {family: arch for arch, family in ARCHITECTURES.items()}

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HEADS_FILE = "specjax_heads.safetensors"
# transformers' own default shard size in v4; small enough for any host to map one shard.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

# Tensors some checkpoints carry that the model recomputes rather than reads.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """One stored tensor and where it lives in the specjax params tree.

  Attributes:
    name: the name in the safetensors file.
    key: path into the params tree, e.g. `("layers", 0, "wq")`.
    shape: the specjax shape.
    stored_shape: the shape in the file.
    transposed: the file holds an HF `Linear` weight `[out, in]`, so
      `param = stored.T.reshape(shape)` and `stored = param.reshape(stored_shape[::-1]).T`.
  """

  name: str
  key: tuple[str | int, ...]
  shape: tuple[int, ...]
  stored_shape: tuple[int, ...]
  transposed: bool = False

  def to_param(self, stored: np.ndarray) -> np.ndarray:
    return stored.T.reshape(self.shape) if self.transposed else stored.reshape(self.shape)

  def to_stored(self, param: np.ndarray) -> np.ndarray:
    if self.transposed:
      return np.ascontiguousarray(param.reshape(self.stored_shape[::-1]).T)
    return np.ascontiguousarray(param.reshape(self.stored_shape))


def _block_tensors(config: ModelConfig, prefix: str, key: tuple) -> list[_Tensor]:
  """HF tensors of one transformer block whose names start with `prefix`."""
  e, q, k, h, f = (config.d_model, config.n_heads, config.n_kv_heads, config.head_dim,
                   config.mlp_dim)
  t = lambda name, leaf, shape, stored, tr=False: _Tensor(prefix + name, key + (leaf,), shape,
                                                          stored, tr)
  out = [
      t("input_layernorm.weight", "attn_norm", (e,), (e,)),
      t("self_attn.q_proj.weight", "wq", (e, q, h), (q * h, e), True),
      t("self_attn.k_proj.weight", "wk", (e, k, h), (k * h, e), True),
      t("self_attn.v_proj.weight", "wv", (e, k, h), (k * h, e), True),
      t("self_attn.o_proj.weight", "wo", (q, h, e), (e, q * h), True),
      t("post_attention_layernorm.weight", "mlp_norm", (e,), (e,)),
      t("mlp.gate_proj.weight", "w_gate", (e, f), (f, e), True),
      t("mlp.up_proj.weight", "w_up", (e, f), (f, e), True),
      t("mlp.down_proj.weight", "w_down", (f, e), (e, f), True),
  ]
  if config.qkv_bias:
    out += [t("self_attn.q_proj.bias", "bq", (q, h), (q * h,)),
            t("self_attn.k_proj.bias", "bk", (k, h), (k * h,)),
            t("self_attn.v_proj.bias", "bv", (k, h), (k * h,))]
  if config.qk_norm:
    out += [t("self_attn.q_norm.weight", "q_norm", (h,), (h,)),
            t("self_attn.k_norm.weight", "k_norm", (h,), (h,))]
  return out


def _trunk_tensors(config: ModelConfig) -> list[_Tensor]:
  """Every tensor of `model.safetensors`, in the order transformers writes them."""
  e, v = config.d_model, config.vocab_size
  out = [_Tensor("model.embed_tokens.weight", ("embed",), (v, e), (v, e))]
  for i in range(config.n_layers):
    out += _block_tensors(config, f"model.layers.{i}.", ("layers", i))
  out.append(_Tensor("model.norm.weight", ("final_norm",), (e,), (e,)))
  if not config.tie_embeddings:
    out.append(_Tensor("lm_head.weight", ("unembed",), (e, v), (v, e), True))
  return out


def _head_tensors(config: ModelConfig) -> list[_Tensor]:
  """Every tensor of `specjax_heads.safetensors`, stored in specjax's layout (no transposes)."""
  e = config.d_model
  plain = lambda name, key, shape: _Tensor(name, key, shape, shape)
  out = []
  for m in range(config.num_mtp_modules):
    key = ("mtp", m)
    out += [plain(f"mtp.{m}.h_norm", key + ("h_norm",), (e,)),
            plain(f"mtp.{m}.e_norm", key + ("e_norm",), (e,)),
            plain(f"mtp.{m}.proj", key + ("proj",), (2 * e, e))]
    out += [plain(f"mtp.{m}.block.{b.key[-1]}", key + ("block", b.key[-1]), b.shape)
            for b in _block_tensors(config, "", ())]
    out.append(plain(f"mtp.{m}.out_norm", key + ("out_norm",), (e,)))
  for k in range(config.num_medusa_heads):
    for j in range(config.medusa_layers):
      out += [plain(f"medusa.{k}.{j}.w", ("medusa", k, j, "w"), (e, e)),
              plain(f"medusa.{k}.{j}.b", ("medusa", k, j, "b"), (e,))]
  return out


def _empty_tree(config: ModelConfig) -> Params:
  """The params tree's containers (dicts and lists) with no leaves, ready to be filled."""
  tree: Params = {"layers": [{} for _ in range(config.n_layers)]}
  if config.num_mtp_modules:
    tree["mtp"] = [{"block": {}} for _ in range(config.num_mtp_modules)]
  if config.num_medusa_heads:
    tree["medusa"] = [[{} for _ in range(config.medusa_layers)]
                      for _ in range(config.num_medusa_heads)]
  return tree


def _set(tree: Any, key: tuple, value: Any) -> None:
  for part in key[:-1]:
    tree = tree[part]
  tree[key[-1]] = value


def _get(tree: Any, key: tuple) -> Any:
  for part in key:
    tree = tree[part]
  return tree


# ---------------------------------------------------------------------------------------------
# config.json


def _hf_dtype(hf: Mapping[str, Any]) -> str | None:
  value = hf.get("dtype", hf.get("torch_dtype"))
  return None if value is None else str(value).removeprefix("torch.")


def _param_dtype(hf: Mapping[str, Any], param_dtype: str) -> str:
  """The parameter dtype to load as: config.json's when `param_dtype` is "auto"."""
  if param_dtype == "auto":
    param_dtype = _hf_dtype(hf) or "float32"
    if param_dtype not in DTYPES:
      raise ConfigError(f"config.json: dtype={param_dtype!r} is unsupported: allowed one of "
                        f"{DTYPES}")
  elif param_dtype not in DTYPES:
    raise ConfigError(f"param_dtype={param_dtype!r} is invalid: allowed 'auto' or one of "
                      f"{DTYPES}")
  return param_dtype


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
  """`(rope_theta, rope_scaling)` from either spelling.

  Precedence follows transformers v5: a non-empty legacy `rope_scaling` wins over
  `rope_parameters`, and a `rope_theta` inside the chosen dict wins over the top-level one.
  """
  params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  theta = float(params.get("rope_theta", hf.get("rope_theta", 10_000.0)))
  rope_type = params.get("rope_type", params.get("type", "default"))
  partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial != 1.0:
    raise ConfigError(f"config.json: partial_rotary_factor={partial!r} is unsupported: "
                      "allowed 1.0 (RoPE over the whole head)")
  if rope_type == "default":
    return theta, None
  if rope_type != "llama3":
    raise ConfigError(f"config.json: rope type {rope_type!r} is unsupported: allowed "
                      "'default' (no scaling) or 'llama3'")
  original = params.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
  missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
  if missing or original is None:
    missing += [] if original is not None else ["original_max_position_embeddings"]
    raise ConfigError(f"config.json: llama3 rope scaling is missing {missing}")
  return theta, Llama3RopeScaling(
      factor=float(params["factor"]),
      low_freq_factor=float(params["low_freq_factor"]),
      high_freq_factor=float(params["high_freq_factor"]),
      original_max_position=int(original),
  )


def _check_supported(hf: Mapping[str, Any], family: str, n_layers: int) -> None:
  """Reject HF options that change the math in ways the specjax model does not implement."""
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ConfigError(f"config.json: hidden_act={act!r} is unsupported: allowed 'silu' (SwiGLU)")
  if hf.get("mlp_bias", False):
    raise ConfigError("config.json: mlp_bias=True is unsupported: allowed False (the MLP has "
                      "no biases)")
  layer_types = hf.get("layer_types")
  if layer_types is not None:
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
      raise ConfigError(f"config.json: layer_types contains {other}: allowed only "
                        "'full_attention'")
  elif family == "qwen2" and hf.get("use_sliding_window", False):
    if hf.get("sliding_window") is not None and hf.get("max_window_layers", 28) < n_layers:
      raise ConfigError("config.json: use_sliding_window=True is unsupported: allowed False "
                        "(every layer attends to the whole prefix)")


def config_from_hf(hf: Mapping[str, Any], *, param_dtype: str = "float32",
                   dtype: str | None = None) -> ModelConfig:
  """The `ModelConfig` of an HF `config.json` dict.

  Args:
    hf: the parsed `config.json` (a "specjax" entry sets the draft-head counts).
    param_dtype: dtype to hold parameters in, one of `DTYPES`, or "auto" for the checkpoint's
      `dtype` / `torch_dtype` (float32 when it names none).
    dtype: compute dtype; defaults to the parameter dtype.

  Raises:
    ConfigError: an unsupported architecture, rope type, activation or option.
  """
  archs = hf.get("architectures") or []
  arch = next((a for a in archs if a in ARCHITECTURES), None)
  if not archs:  # some hand-written configs name only the model_type
    arch = _FAMILY_ARCH.get(hf.get("model_type"))
  if arch is None:
    raise ConfigError(f"config.json: architectures={archs!r} (model_type="
                      f"{hf.get('model_type')!r}) is unsupported: allowed one of "
                      f"{sorted(ARCHITECTURES)}")
  family = ARCHITECTURES[arch]
  missing = [f for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                         "num_attention_heads") if f not in hf]
  if missing:
    raise ConfigError(f"config.json: missing required fields {missing} for {arch}")
  n_layers = int(hf["num_hidden_layers"])
  _check_supported(hf, family, n_layers)

  param_dtype = _param_dtype(hf, param_dtype)

  n_heads = int(hf["num_attention_heads"])
  theta, scaling = _rope_from_hf(hf)
  heads = hf.get("specjax") or {}
  return ModelConfig(
      vocab_size=int(hf["vocab_size"]),
      d_model=int(hf["hidden_size"]),
      n_layers=n_layers,
      n_heads=n_heads,
      n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
      head_dim=int(hf.get("head_dim") or hf["hidden_size"] // n_heads),
      mlp_dim=int(hf["intermediate_size"]),
      rope_theta=theta,
      rope_scaling=scaling,
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      # Qwen2 always has q/k/v biases; Llama and Qwen3 have them (and an o_proj bias, which
      # `load_hf` checks is zero) when attention_bias is set.
      qkv_bias=True if family == "qwen2" else bool(hf.get("attention_bias", False)),
      qk_norm=family == "qwen3",
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_position=int(hf.get("max_position_embeddings", 2048)),
      dtype=dtype or param_dtype,
      param_dtype=param_dtype,
      num_mtp_modules=int(heads.get("num_mtp_modules", 0)),
      num_medusa_heads=int(heads.get("num_medusa_heads", 0)),
      medusa_layers=int(heads.get("medusa_layers", 1)),
      family=family,
  )


def _rope_to_hf(theta: float, scaling: Llama3RopeScaling | None
                ) -> tuple[dict[str, Any], dict[str, Any] | None]:
  """`(rope_parameters, rope_scaling)` of config.json: the transformers v5 and v4 spellings."""
  if scaling is None:
    return {"rope_type": "default", "rope_theta": theta}, None
  legacy = {"rope_type": "llama3", "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position}
  return legacy | {"rope_theta": theta}, legacy


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
  """The HF `config.json` dict of `config`, readable by transformers v4 and v5.

  Draft-head counts go under "specjax" only when the config has draft heads.
  """
  rope, legacy_scaling = _rope_to_hf(config.rope_theta, config.rope_scaling)
  hf: dict[str, Any] = {
      "architectures": [_FAMILY_ARCH[config.family]],
      "model_type": config.family,
      "vocab_size": config.vocab_size,
      "hidden_size": config.d_model,
      "intermediate_size": config.mlp_dim,
      "num_hidden_layers": config.n_layers,
      "num_attention_heads": config.n_heads,
      "num_key_value_heads": config.n_kv_heads,
      "head_dim": config.head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": config.max_position,
      "rms_norm_eps": config.rms_norm_eps,
      "rope_parameters": rope,
      "rope_theta": config.rope_theta,
      "rope_scaling": legacy_scaling,
      "tie_word_embeddings": config.tie_embeddings,
      "attention_dropout": 0.0,
      "use_cache": True,
      "dtype": config.param_dtype,
      "torch_dtype": config.param_dtype,
  }
  if config.family == "llama":
    hf |= {"attention_bias": config.qkv_bias, "mlp_bias": False}
  elif config.family == "qwen3":
    hf |= {"attention_bias": config.qkv_bias, "use_sliding_window": False}
  else:
    hf |= {"use_sliding_window": False}
  if config.num_mtp_modules or config.num_medusa_heads:
    hf["specjax"] = {"num_mtp_modules": config.num_mtp_modules,
                     "num_medusa_heads": config.num_medusa_heads,
                     "medusa_layers": config.medusa_layers}
  return hf


# ---------------------------------------------------------------------------------------------
# Loading


def _weight_files(path: Path) -> dict[str, Path]:
  """Tensor name -> file holding it, from the index of a sharded checkpoint or the one file."""
  index = path / INDEX_FILE
  if index.is_file():
    weight_map = json.loads(index.read_text())["weight_map"]
    return {name: path / file for name, file in weight_map.items()}
  single = path / WEIGHTS_FILE
  if single.is_file():
    with safe_open(single, framework="np") as f:
      return {name: single for name in f.keys()}
  raise CheckpointError(f"{path}: no {WEIGHTS_FILE} or {INDEX_FILE} (a sharded checkpoint); "
                        "only safetensors checkpoints are supported")


def _read(tensors: list[_Tensor], files: dict[str, Path], dtype: np.dtype,
          tree: Params) -> None:
  """Read `tensors` from `files` into `tree`, checking each one's presence and shape."""
  with ExitStack() as stack:
    handles: dict[Path, Any] = {}
    for t in tensors:
      if t.name not in files:
        raise CheckpointError(f"missing tensor {t.name!r} (expected shape {t.stored_shape})")
      file = files[t.name]
      if file not in handles:
        if not file.is_file():
          raise CheckpointError(f"{file}: file listed in the index for {t.name!r} is missing")
        handles[file] = stack.enter_context(safe_open(file, framework="np"))
      handle = handles[file]
      shape = tuple(handle.get_slice(t.name).get_shape())
      if shape != t.stored_shape:
        raise CheckpointError(f"tensor {t.name!r} in {file.name} has shape {shape}, expected "
                              f"{t.stored_shape}")
      _set(tree, t.key, jnp.asarray(t.to_param(handle.get_tensor(t.name)).astype(dtype)))


def _check_o_proj_bias(config: ModelConfig, files: dict[str, Path]) -> set[str]:
  """Names of zero o_proj biases, which the model can drop; a non-zero one is an error.

  Llama and Qwen3 with attention_bias=True also put a bias on o_proj. The specjax block has
  none, so only checkpoints where it is zero (as `save_hf` writes it) load exactly.
  """
  names = {f"model.layers.{i}.self_attn.o_proj.bias" for i in range(config.n_layers)}
  for name in sorted(names & files.keys()):
    with safe_open(files[name], framework="np") as f:
      if np.any(f.get_tensor(name)):
        raise ConfigError(f"tensor {name!r} is non-zero: an output-projection bias is "
                          "unsupported (allowed: attention_bias with a zero o_proj bias)")
  return names


def load_hf(path: str | os.PathLike, *, param_dtype: str = "float32",
            dtype: str | None = None) -> tuple[Params, ModelConfig]:
  """Load an HF Llama / Qwen2 / Qwen3 checkpoint directory.

  Args:
    path: directory with `config.json` and `model.safetensors` or sharded
      `model-XXXXX-of-YYYYY.safetensors` + `model.safetensors.index.json`; an optional
      `specjax_heads.safetensors` holds draft heads written by `save_hf`.
    param_dtype: dtype of the returned parameters, or "auto" for the checkpoint's own.
    dtype: compute dtype of the returned config; defaults to the parameter dtype.

  Returns:
    `(params, config)`: the params tree of `init_params(config, key)`'s structure.

  Raises:
    CheckpointError: missing `config.json` or weights file, missing, misshapen or unexpected
      tensor.
    ConfigError: an unsupported architecture or option in `config.json`.
  """
  path = Path(path)
  config_file = path / CONFIG_FILE
  if not config_file.is_file():
    raise CheckpointError(f"{path}: missing {CONFIG_FILE}; expected an HF checkpoint directory")
  config = config_from_hf(json.loads(config_file.read_text()), param_dtype=param_dtype,
                          dtype=dtype)
  files = _weight_files(path)
  tensors = _trunk_tensors(config)
  # transformers ties lm_head to the embedding when tie_word_embeddings is set, whatever the
  # file holds, so a stored lm_head.weight is ignored.
  ignored = {"lm_head.weight"} if config.tie_embeddings else set()
  ignored |= _check_o_proj_bias(config, files)
  unexpected = sorted(name for name in files.keys() - {t.name for t in tensors} - ignored
                      if not name.endswith(_IGNORED_SUFFIXES))
  if unexpected:
    raise CheckpointError(f"{path}: unexpected tensors for a {config.n_layers}-layer "
                          f"{config.family} model: {unexpected[:8]}"
                          + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""))

  params = _empty_tree(config)
  weight_dtype = np.dtype(config.weight_dtype)
  _read(tensors, files, weight_dtype, params)
  heads = _head_tensors(config)
  if heads:
    heads_file = path / HEADS_FILE
    if not heads_file.is_file():
      raise CheckpointError(f"{path}: config.json lists draft heads but {HEADS_FILE} is "
                            "missing")
    _read(heads, {t.name: heads_file for t in heads}, weight_dtype, params)
  return params, config


# ---------------------------------------------------------------------------------------------
# Saving


def _gather(params: Params, tensors: list[_Tensor]) -> dict[str, np.ndarray]:
  """Stored-layout arrays of `tensors`, checking each param's presence and shape."""
  out = {}
  for t in tensors:
    try:
      value = _get(params, t.key)
    except (KeyError, IndexError, TypeError):
      raise ConfigError(f"params is missing {'/'.join(map(str, t.key))} (expected shape "
                        f"{t.shape}) required by the config") from None
    if tuple(value.shape) != t.shape:
      raise ConfigError(f"params {'/'.join(map(str, t.key))} has shape {tuple(value.shape)}, "
                        f"expected {t.shape} from the config")
    out[t.name] = t.to_stored(np.asarray(value))
  return out


def _stored_trunk(params: Params, config: ModelConfig) -> dict[str, np.ndarray]:
  """Every tensor of the HF checkpoint, in transformers' order."""
  arrays = _gather(params, _trunk_tensors(config))
  if not (config.qkv_bias and config.family != "qwen2"):
    return arrays
  # Llama / Qwen3 with attention_bias=True also expect an o_proj bias; specjax has none, so
  # it is zero (and `load_hf` accepts exactly that).
  out = {}
  for name, array in arrays.items():
    out[name] = array
    if name.endswith("self_attn.o_proj.weight"):
      out[name.removesuffix("weight") + "bias"] = np.zeros(array.shape[:1], array.dtype)
  return out


def _shards(arrays: dict[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
  """Split `arrays` in order into shards of at most `max_bytes` (one tensor may exceed it)."""
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, array in arrays.items():
    if shards[-1] and size + array.nbytes > max_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = array
    size += array.nbytes
  return shards


def _remove_stale(path: Path) -> None:
  """Delete weights of an earlier save: transformers prefers `model.safetensors` over an
  index, so a stale single file would shadow a new sharded checkpoint."""
  stale = [path / WEIGHTS_FILE, path / INDEX_FILE, path / HEADS_FILE]
  stale += path.glob("model-*-of-*.safetensors")
  for file in stale:
    file.unlink(missing_ok=True)


def save_hf(params: Params, config: ModelConfig, path: str | os.PathLike, *,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            extra_config: Mapping[str, Any] | None = None) -> None:
  """Write `params` as an HF checkpoint directory that transformers and `load_hf` read.

  Tensors keep the params' dtype. Weights of an earlier save in `path` are removed first.

  Args:
    params: parameters of `config` (trunk, plus draft heads when the config has them).
    config: the model configuration; `family` picks the HF architecture.
    path: output directory (created if needed).
    max_shard_bytes: weights larger than this are split into `model-XXXXX-of-YYYYY`
      shards with a `model.safetensors.index.json`.
    extra_config: keys added to `config.json` where `config_to_hf` does not set them, e.g.
      `bos_token_id` / `eos_token_id`, or the source checkpoint's whole `config.json`.

  Raises:
    ConfigError: a param missing or of the wrong shape for `config`, or a bad shard size.
  """
  if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
    raise ConfigError(f"max_shard_bytes={max_shard_bytes!r} is invalid: must be a positive int")
  trunk = _stored_trunk(params, config)
  heads = _gather(params, _head_tensors(config))
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  _remove_stale(path)

  metadata = {"format": "pt"}  # transformers refuses safetensors files without it
  shards = _shards(trunk, max_shard_bytes)
  if len(shards) == 1:
    save_file(shards[0], path / WEIGHTS_FILE, metadata=metadata)
  else:
    width = max(5, len(str(len(shards))))
    weight_map = {}
    for i, shard in enumerate(shards):
      file = f"model-{i + 1:0{width}d}-of-{len(shards):0{width}d}.safetensors"
      save_file(shard, path / file, metadata=metadata)
      weight_map |= {name: file for name in shard}
    total = sum(a.nbytes for a in trunk.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
  if heads:
    save_file(heads, path / HEADS_FILE, metadata={"format": "specjax"})

  hf = dict(extra_config or {}) | config_to_hf(config)
  if not (config.num_mtp_modules or config.num_medusa_heads):
    hf.pop("specjax", None)  # a stale entry from extra_config would promise absent heads
  (path / CONFIG_FILE).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")

