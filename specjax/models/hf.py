"""Hugging Face checkpoints: read and write `config.json` + safetensors for Llama / Qwen2 / Qwen3 /
Qwen3-MoE.

`load_hf(path)` returns `(params, config)` in specjax's layout; `save_hf(params, config, path)`
writes a directory that `transformers.AutoModelForCausalLM.from_pretrained` loads as the same
model. A load -> save -> load round trip is bitwise exact.

Layout. HF stores a `Linear` weight as `[out, in]`; specjax stores `[in, ...]` with the head
axes split out, so each weight is transposed and reshaped:

  q_proj.weight  [Q*H, E]  <->  wq [E, Q, H]        o_proj.weight  [E, Q*H]  <->  wo [Q, H, E]
  k/v_proj.weight [K*H, E] <->  wk/wv [E, K, H]     gate/up_proj.weight [F, E] <-> [E, F]
  down_proj.weight [E, F]  <->  w_down [F, E]       lm_head.weight [V, E]    <->  unembed [E, V]
  q_proj.bias [Q*H] <-> bq [Q, H]                   k/v_proj.bias [K*H] <-> bk/bv [K, H]

A Qwen3-MoE layer stores its router and each expert apart; specjax stacks the experts:

  mlp.gate.weight [Z, E]  <->  router [E, Z]
  mlp.experts.{z}.gate_proj / up_proj.weight [F, E]  <->  experts_gate / experts_up[z] [E, F]
  mlp.experts.{z}.down_proj.weight [E, F]  <->  experts_down[z] [F, E]

Draft heads (MTP modules, Medusa heads) have no HF equivalent. They go to a separate
`specjax_heads.safetensors` in specjax's own layout, with their counts under a "specjax" key
of `config.json`; transformers ignores both, so the directory still loads there as the trunk.

Both the transformers v5 (`rope_parameters`, `dtype`) and v4 (`rope_theta` + `rope_scaling`,
`torch_dtype`) spellings are read, and both are written (`config_from_hf` / `config_to_hf`,
defined in `specjax.models.hf_config` and re-exported here).

Saves are atomic: the export is written and fsynced in a temporary sibling directory that then
replaces `path`, so a crash or a full disk never leaves a half-written export (see `save_hf`).
Loading refuses what it cannot represent exactly (an active sliding window, an unsupported
`model_type`, non-integral sizes, non-float weights, shards outside the directory) and names
the file of any malformed JSON or unreadable safetensors.

Shape letters: see `specjax` (V vocab, E d_model, Q query heads, K kv heads, H head_dim,
F MLP width, Z experts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path, PurePosixPath
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from specjax.checks import is_int
from specjax.errors import CheckpointError, ConfigError
from specjax.files import existing, fsync, read_object, replace_directory
from specjax.hub import local_checkpoint
from specjax.models.config import ModelConfig
# config.json translation lives in hf_config; its public names are re-exported from here,
# where callers have always imported them.
from specjax.models.hf_config import ARCHITECTURES, config_from_hf, config_to_hf
from specjax.models.params import Params

__all__ = ["ARCHITECTURES", "CONFIG_FILE", "DEFAULT_MAX_SHARD_BYTES",
           "GENERATION_CONFIG_FILE", "HEADS_FILE", "INDEX_FILE", "WEIGHTS_FILE",
           "config_from_hf", "config_to_hf", "eos_token_ids", "load_hf", "save_hf"]


CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HEADS_FILE = "specjax_heads.safetensors"
# transformers' own default shard size in v4; small enough for any host to map one shard.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9

# Tensors some checkpoints carry that the model recomputes rather than reads.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# safetensors dtype codes that load exactly into a float parameter.
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


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
    part, of: the tensor is entry `part` of `of` along the param's leading axis (one expert
      of an MoE layer's stacked weights; `shape` is the entry's); None: the whole param.
    about: what the tensor is, for messages ("the router of layer 0's experts").
  """

  name: str
  key: tuple[str | int, ...]
  shape: tuple[int, ...]
  stored_shape: tuple[int, ...]
  transposed: bool = False
  part: int | None = None
  of: int = 1
  about: str = ""

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
      ]
  if config.is_moe:
    z, fe = config.n_experts, config.expert_dim
    out.append(_Tensor(prefix + "mlp.gate.weight", key + ("router",), (e, z), (z, e), True,
                       about=f"the router of {prefix.removesuffix('.') or 'the block'}'s "
                       "experts"))
    for x in range(z):
      expert = lambda name, leaf, shape, stored: _Tensor(
          f"{prefix}mlp.experts.{x}.{name}", key + (leaf,), shape, stored, True, part=x, of=z)
      out += [expert("gate_proj.weight", "experts_gate", (e, fe), (fe, e)),
              expert("up_proj.weight", "experts_up", (e, fe), (fe, e)),
              expert("down_proj.weight", "experts_down", (fe, e), (e, fe))]
  else:
    out += [t("mlp.gate_proj.weight", "w_gate", (e, f), (f, e), True),
            t("mlp.up_proj.weight", "w_up", (e, f), (f, e), True),
            t("mlp.down_proj.weight", "w_down", (f, e), (e, f), True)]
  if config.qkv_bias:
    out += [t("self_attn.q_proj.bias", "bq", (q, h), (q * h,)),
            t("self_attn.k_proj.bias", "bk", (k, h), (k * h,)),
            t("self_attn.v_proj.bias", "bv", (k, h), (k * h,))]
  if config.qk_norm:
    out += [t("self_attn.q_norm.weight", "q_norm", (h,), (h,)),
            t("self_attn.k_norm.weight", "k_norm", (h,), (h,))]
  return out


def _expert_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
  """`(leaf, one expert's shape)` of an MoE block's stacked expert weights (none if dense)."""
  if not config.is_moe:
    return []
  e, fe = config.d_model, config.expert_dim
  return [("experts_gate", (e, fe)), ("experts_up", (e, fe)), ("experts_down", (fe, e))]


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
            for b in _block_tensors(config, "", ()) if b.part is None]
    # An MoE block's experts: each stacked weight as one tensor.
    out += [plain(f"mtp.{m}.block.{leaf}", key + ("block", leaf), (config.n_experts,) + shape)
            for leaf, shape in _expert_shapes(config)]
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
# Loading


def _read_json(file: Path) -> dict[str, Any]:
  """The JSON object in `file`, or a `CheckpointError` naming the file and the bad position."""
  return read_object(file, CheckpointError, "re-download or re-export the checkpoint")


def _corrupt(file: Path, err: Exception) -> CheckpointError:
  return CheckpointError(f"{file}: unreadable safetensors file ({err}); it is corrupt or "
                         "truncated: re-download or re-export the checkpoint")


@contextlib.contextmanager
def open_safetensors(file: Path) -> Iterator[Any]:
  """`safe_open(file)`, turning safetensors' parse errors into a `CheckpointError`."""
  try:
    handle = safe_open(file, framework="np")
  except SafetensorError as err:
    raise _corrupt(file, err) from None
  with handle:
    try:
      yield handle
    except SafetensorError as err:
      raise _corrupt(file, err) from None


def _shard_file(path: Path, index: Path, name: Any, file: Any) -> Path:
  """The shard `file` the index lists for tensor `name`; it must lie inside `path`."""
  if not isinstance(file, str) or not file:
    raise CheckpointError(f"{index}: weight_map[{name!r}]={file!r} is invalid: allowed a "
                          "file name inside the checkpoint directory")
  # Checked lexically, not with resolve(): the HF hub cache links shards to blobs elsewhere.
  parts = PurePosixPath(file.replace("\\", "/")).parts
  if os.path.isabs(file) or file.startswith(("/", "\\")) or ".." in parts:
    raise CheckpointError(f"{index}: weight_map[{name!r}]={file!r} points outside {path}: "
                          "allowed a relative path without '..' inside the checkpoint directory")
  return path / file


def _weight_files(path: Path) -> dict[str, Path]:
  """Tensor name -> file holding it, from the index of a sharded checkpoint or the one file."""
  index = path / INDEX_FILE
  if index.is_file():
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{index}: no \"weight_map\" object; re-download or re-export the "
                            "checkpoint")
    return {name: _shard_file(path, index, name, file) for name, file in weight_map.items()}
  single = path / WEIGHTS_FILE
  if single.is_file():
    with open_safetensors(single) as f:
      return {name: single for name in f.keys()}
  raise CheckpointError(f"{path}: no {WEIGHTS_FILE} or {INDEX_FILE} (a sharded checkpoint); "
                        "only safetensors checkpoints are supported")


def _read(tensors: list[_Tensor], files: dict[str, Path], dtype: np.dtype,
          tree: Params) -> None:
  """Read `tensors` from `files` into `tree`, checking each one's presence, dtype and shape."""
  stacks: dict[tuple, dict[int, np.ndarray]] = {}  # an MoE layer's experts, until complete
  with ExitStack() as stack:
    handles: dict[Path, Any] = {}
    for t in tensors:
      if t.name not in files:
        about = f", {t.about}" if t.about else ""
        raise CheckpointError(f"missing tensor {t.name!r} (expected shape {t.stored_shape}"
                              f"{about})")
      file = files[t.name]
      if file not in handles:
        if not file.is_file():
          raise CheckpointError(f"{file}: file listed in the index for {t.name!r} is missing")
        handles[file] = stack.enter_context(open_safetensors(file))
      handle = handles[file]
      try:
        tensor_slice = handle.get_slice(t.name)
      except SafetensorError as err:  # the index names a tensor the shard lacks
        raise CheckpointError(f"{file}: tensor {t.name!r} listed in the index is absent "
                              f"({err}); re-download or re-export the checkpoint") from None
      stored_dtype = tensor_slice.get_dtype()
      if stored_dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"tensor {t.name!r} in {file.name} has dtype {stored_dtype}: "
                              f"allowed a float dtype, one of {FLOAT_DTYPES}")
      shape = tuple(tensor_slice.get_shape())
      if shape != t.stored_shape:
        raise CheckpointError(f"tensor {t.name!r} in {file.name} has shape {shape}, expected "
                              f"{t.stored_shape}")
      stored = handle.get_tensor(t.name)
      check_finite(stored, f"tensor {t.name!r} in {file}", "the checkpoint is damaged or was "
                    "saved from a diverged run; re-export it from a healthy state")
      value = t.to_param(stored).astype(dtype)
      if t.part is None:
        _set(tree, t.key, jnp.asarray(value))
        continue
      parts = stacks.setdefault(t.key, {})
      parts[t.part] = value
      if len(parts) == t.of:  # every expert read: one stacked array (host memory freed)
        _set(tree, t.key, jnp.asarray(np.stack([parts[i] for i in range(t.of)])))
        del stacks[t.key]


def check_finite(array: np.ndarray, what: str, remedy: str) -> None:
  """Refuse NaN / inf weights: they would load (or save) as a model that emits garbage."""
  bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
  if bad:
    raise CheckpointError(f"{what} holds {bad} non-finite values (NaN or inf) of "
                          f"{np.size(array)}; {remedy}")


def _get_tensor(files: dict[str, Path], name: str) -> np.ndarray:
  with open_safetensors(files[name]) as f:
    return f.get_tensor(name)


def _check_o_proj_bias(config: ModelConfig, files: dict[str, Path]) -> set[str]:
  """Names of zero o_proj biases, which the model can drop; a non-zero one is an error.

  Llama and Qwen3 with attention_bias=True also put a bias on o_proj. The specjax block has
  none, so only checkpoints where it is zero (as `save_hf` writes it) load exactly.
  """
  names = {f"model.layers.{i}.self_attn.o_proj.bias" for i in range(config.n_layers)}
  for name in sorted(names & files.keys()):
    if np.any(_get_tensor(files, name)):
      raise ConfigError(f"tensor {name!r} is non-zero: an output-projection bias is "
                        "unsupported (allowed: attention_bias with a zero o_proj bias)")
  return names


def _resolve_tied_lm_head(config: ModelConfig, files: dict[str, Path], path: Path
                          ) -> tuple[ModelConfig, list[_Tensor], set[str]]:
  """`(config, tensors, ignored names)` of a tie_word_embeddings checkpoint, as transformers
  (v5, `PreTrainedModel.tie_weights`) loads it.

  With both `model.embed_tokens.weight` and `lm_head.weight` stored, transformers ties them
  only when they are equal; otherwise it warns and keeps both, so the model is untied. With
  only `lm_head.weight` stored, the embedding is tied to it.
  """
  tensors = _trunk_tensors(config)
  if not config.tie_embeddings or "lm_head.weight" not in files:
    return config, tensors, set()
  embed = "model.embed_tokens.weight"
  if embed not in files:
    tensors[0] = dataclasses.replace(tensors[0], name="lm_head.weight")
    return config, tensors, set()
  a, b = _get_tensor(files, embed), _get_tensor(files, "lm_head.weight")
  if a.shape == b.shape and np.array_equal(a.astype(np.float32), b.astype(np.float32)):
    return config, tensors, {"lm_head.weight"}
  warnings.warn(f"{path}: tie_word_embeddings=True but lm_head.weight differs from "
                f"{embed}; loading them untied, as transformers does (set "
                "tie_word_embeddings=False in config.json to silence this)", stacklevel=3)
  config = config.replace(tie_embeddings=False)
  return config, _trunk_tensors(config), set()


def load_hf(path: str | os.PathLike, *, param_dtype: str = "float32",
            dtype: str | None = None) -> tuple[Params, ModelConfig]:
  """Load an HF Llama / Qwen2 / Qwen3 / Qwen3-MoE checkpoint directory.

  Args:
    path: directory (or Hugging Face Hub id: `specjax.hub`) with `config.json` and
      `model.safetensors` or sharded
      `model-XXXXX-of-YYYYY.safetensors` + `model.safetensors.index.json`; an optional
      `specjax_heads.safetensors` holds draft heads written by `save_hf`. If `path` is missing
      because a `save_hf` over it was killed mid-swap, the previous export it moved aside is
      read (with a warning).
    param_dtype: dtype of the returned parameters, or "auto" for the checkpoint's own.
    dtype: compute dtype of the returned config; defaults to the parameter dtype.

  Returns:
    `(params, config)`: the params tree of `init_params(config, key)`'s structure. A
    tie_word_embeddings checkpoint whose stored lm_head differs from the embedding loads
    untied (`config.tie_embeddings` False), as in transformers v5.

  Raises:
    CheckpointError: missing `config.json` or weights file; malformed JSON; a corrupt or
      truncated safetensors file; a shard outside `path`; a missing, misshapen, non-float or
      unexpected tensor, or one holding NaN / inf.
    ConfigError: an unsupported architecture or option in `config.json`.
  """
  path = existing(local_checkpoint(path, "path"), CONFIG_FILE)
  config_file = path / CONFIG_FILE
  if not config_file.is_file():
    raise CheckpointError(f"{path}: missing {CONFIG_FILE}; expected an HF checkpoint directory")
  config = config_from_hf(_read_json(config_file), param_dtype=param_dtype, dtype=dtype)
  files = _weight_files(path)
  config, tensors, ignored = _resolve_tied_lm_head(config, files, path)
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
  heads_file = path / HEADS_FILE
  if heads:
    if not heads_file.is_file():
      raise CheckpointError(f"{path}: config.json lists draft heads but {HEADS_FILE} is "
                            "missing")
    _read(heads, {t.name: heads_file for t in heads}, weight_dtype, params)
  elif heads_file.is_file():
    # `save_hf` writes the file and config.json's "specjax" counts together and drops a stale
    # file, so one without the other is a config.json rewritten by another tool.
    warnings.warn(f"{heads_file} holds draft heads, but {config_file} has no \"specjax\" "
                  "entry that counts them (num_mtp_modules, num_medusa_heads); loading the "
                  "model without its heads: restore the entry to load them, or delete the "
                  "file", stacklevel=2)
  return params, config


def eos_token_ids(path: str | os.PathLike) -> tuple[int, ...]:
  """The ids a checkpoint's generation stops on: `eos_token_id` (an id or a list, e.g. Llama
  3's `<|end_of_text|>`, `<|eom_id|>`, `<|eot_id|>`) of `generation_config.json` when it sets
  one, else of `config.json`, as in transformers; () when neither does.

  Raises:
    CheckpointError: malformed JSON.
    ConfigError: an `eos_token_id` that is neither an id nor a list of ids.
  """
  path = local_checkpoint(path, "path")
  for name in (GENERATION_CONFIG_FILE, CONFIG_FILE):
    file = Path(path) / name
    value = _read_json(file).get("eos_token_id") if file.is_file() else None
    if value is None or value == []:
      continue
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
      raise ConfigError(f"{file}: eos_token_id={value!r} is invalid: allowed a token id (an "
                        "int >= 0) or a list of them")
    return tuple(ids)
  return ()


# ---------------------------------------------------------------------------------------------
# Saving


def _gather(params: Params, tensors: list[_Tensor]) -> dict[str, np.ndarray]:
  """Stored-layout arrays of `tensors`, checking each param's presence, shape and dtype."""
  out = {}
  for t in tensors:
    try:
      value = _get(params, t.key)
    except (KeyError, IndexError, TypeError):
      want = t.shape if t.part is None else (t.of,) + t.shape
      raise ConfigError(f"params is missing {'/'.join(map(str, t.key))} (expected shape "
                        f"{want}) required by the config") from None
    shape = tuple(value.shape) if t.part is None else tuple(value.shape)[1:]
    if (shape != t.shape) or (t.part is not None and value.shape[0] != t.of):
      want = t.shape if t.part is None else (t.of,) + t.shape
      raise ConfigError(f"params {'/'.join(map(str, t.key))} has shape {tuple(value.shape)}, "
                        f"expected {want} from the config")
    if t.part is not None:
      value = value[t.part]
    if not jnp.issubdtype(value.dtype, jnp.floating):
      raise ConfigError(f"params {'/'.join(map(str, t.key))} has dtype {value.dtype}: allowed "
                        "a float dtype (float16, bfloat16, float32 or float64)")
    value = np.asarray(value)
    check_finite(value, f"params {'/'.join(map(str, t.key))}", "refusing to save it; train "
                  "from the last good checkpoint (a NaN learning rate or reward, say)")
    out[t.name] = t.to_stored(value)
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


def _is_export_file(name: str) -> bool:
  """Whether `save_hf` writes (or an earlier save wrote) a file of this name."""
  return (name in (CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE, HEADS_FILE)
          or (name.startswith("model-") and "-of-" in name and name.endswith(".safetensors")))


def _write_safetensors(arrays: dict[str, np.ndarray], file: Path,
                       metadata: dict[str, str]) -> None:
  save_file(arrays, file, metadata=metadata)
  fsync(file)


def _write_json(value: Any, file: Path, **kwargs: Any) -> None:
  with open(file, "w", encoding="utf-8") as f:
    f.write(json.dumps(value, indent=2, **kwargs) + "\n")
    f.flush()
    os.fsync(f.fileno())


def _write_export(out: Path, trunk: dict[str, np.ndarray], heads: dict[str, np.ndarray],
                  hf: dict[str, Any], max_shard_bytes: int) -> None:
  """Write the weights, index, heads and `config.json` into the empty directory `out`."""
  metadata = {"format": "pt"}  # transformers refuses safetensors files without it
  shards = _shards(trunk, max_shard_bytes)
  if len(shards) == 1:
    _write_safetensors(shards[0], out / WEIGHTS_FILE, metadata)
  else:
    width = max(5, len(str(len(shards))))
    weight_map = {}
    for i, shard in enumerate(shards):
      file = f"model-{i + 1:0{width}d}-of-{len(shards):0{width}d}.safetensors"
      _write_safetensors(shard, out / file, metadata)
      weight_map |= {name: file for name in shard}
    total = sum(a.nbytes for a in trunk.values())
    _write_json({"metadata": {"total_size": total}, "weight_map": weight_map}, out / INDEX_FILE)
  if heads:
    _write_safetensors(heads, out / HEADS_FILE, {"format": "specjax"})
  _write_json(hf, out / CONFIG_FILE, sort_keys=True)


def _token_id(name: str, value: Any, vocab_size: int) -> int | list[int]:
  """A validated special-token id (`eos_token_id` may also be a non-empty list of ids)."""
  is_list = name == "eos_token_id" and isinstance(value, (list, tuple)) and len(value) > 0
  for i in value if is_list else [value]:
    if not is_int(i) or not 0 <= i < vocab_size:
      raise ConfigError(f"{name}={value!r} is invalid: allowed an int in [0, {vocab_size})"
                        + (" or a non-empty list of them" if name == "eos_token_id" else ""))
  return [int(i) for i in value] if is_list else int(value)


def save_hf(params: Params, config: ModelConfig, path: str | os.PathLike, *,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            extra_config: Mapping[str, Any] | None = None,
            bos_token_id: int | None = None,
            eos_token_id: int | Sequence[int] | None = None,
            pad_token_id: int | None = None) -> None:
  """Write `params` as an HF checkpoint directory that transformers and `load_hf` read.

  Tensors keep the params' dtype. The save is atomic: every file is written and fsynced in a
  temporary sibling `.<name>.tmp-<pid>`, which then replaces `path`, so `path` holds either
  the earlier export or the new one, each complete, even if the process dies or the disk
  fills. Files in an earlier `path` that are not part of an export (tokenizer files, say) are
  carried over; its weights, index, heads and `config.json` are replaced. Two concurrent
  saves to one path are not supported.

  Args:
    params: parameters of `config` (trunk, plus draft heads when the config has them).
    config: the model configuration; `family` picks the HF architecture.
    path: output directory (created if needed; a symlink's target is replaced).
    max_shard_bytes: weights larger than this are split into `model-XXXXX-of-YYYYY`
      shards with a `model.safetensors.index.json`.
    extra_config: keys added to `config.json` where `config_to_hf` does not set them, e.g.
      the source checkpoint's whole `config.json` (its `layer_types` is dropped: every
      specjax layer is full attention).
    bos_token_id: written to `config.json` when given (overriding `extra_config`).
    eos_token_id: an id or a list of ids, likewise. A `ModelConfig` does not hold the
      tokenizer's special ids, so without these (or `extra_config`) transformers falls back
      to its defaults (None: `generate` then never stops on EOS).
    pad_token_id: likewise.

  Raises:
    ConfigError: a param missing or of the wrong shape or a non-float dtype for `config`, a
      bad shard size, or a token id outside the vocabulary.
    CheckpointError: a param holds NaN / inf (nothing is written), or `path` exists and is
      not a directory, or cannot be replaced.
    OSError: writing failed (e.g. ENOSPC); `path` is unchanged and the temporary is removed.
  """
  if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
    raise ConfigError(f"max_shard_bytes={max_shard_bytes!r} is invalid: must be a positive int")
  trunk = _stored_trunk(params, config)
  heads = _gather(params, _head_tensors(config))
  hf = dict(extra_config or {}) | config_to_hf(config)
  if not (config.num_mtp_modules or config.num_medusa_heads):
    hf.pop("specjax", None)  # a stale entry from extra_config would promise absent heads
  hf.pop("layer_types", None)  # a source's sliding layers would contradict the model
  tokens = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id}
  hf |= {name: _token_id(name, value, config.vocab_size) for name, value in tokens.items()
         if value is not None}

  path = Path(path).resolve() if Path(path).is_symlink() else Path(path)
  replace_directory(path, lambda tmp: _write_export(tmp, trunk, heads, hf, max_shard_bytes),
                    _is_export_file)
