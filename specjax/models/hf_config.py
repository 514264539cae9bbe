"""HF `config.json` <-> `ModelConfig` translation for Llama / Qwen2 / Qwen3 / Qwen3-MoE.

`config_from_hf` reads a parsed `config.json` dict (both the transformers v5 `rope_parameters`
/ `dtype` and v4 `rope_theta` + `rope_scaling` / `torch_dtype` spellings) and refuses what the
specjax model cannot represent exactly (an unsupported `model_type` or architecture, rope type
or activation, an active sliding window, non-integral sizes); `config_to_hf` writes both
spellings. It is kept apart from `specjax.models.hf`, which reads and writes the checkpoint
files, because it is pure dict <-> dataclass translation with no file I/O: the EAGLE-3 config
code (`eagle3_io`) reuses its rope and dtype readers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from specjax.errors import ConfigError
from specjax.models.config import DTYPES, Llama3RopeScaling, ModelConfig


ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
_FAMILY_ARCH = {family: arch for arch, family in ARCHITECTURES.items()}

# transformers' Qwen2 / Qwen3 config defaults, used where config.json omits the key.
_HF_SLIDING_WINDOW = 4096
_HF_MAX_WINDOW_LAYERS = 28
# transformers' Qwen3Config head_dim when config.json omits it (Llama and Qwen2 derive it,
# hidden_size // num_attention_heads).
_HF_QWEN3_HEAD_DIM = 128
_REQUIRED = object()


def _int_field(hf: Mapping[str, Any], name: str, default: Any = _REQUIRED, *,
               where: str = "config.json") -> int:
  """`hf[name]` as an int; an integral float (64.0) is accepted, 64.5 or "64" is not."""
  value = hf[name] if default is _REQUIRED else hf.get(name, default)
  integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
  if isinstance(value, bool) or not integral:
    raise ConfigError(f"{where}: {name}={value!r} is invalid: allowed an integer (an "
                      "integral float such as 64.0 is accepted)")
  return int(value)


def _float_field(hf: Mapping[str, Any], name: str, default: float, *,
                 where: str = "config.json") -> float:
  """`hf[name]` (absent or null: `default`) as a finite float; a string, a bool or NaN is
  refused."""
  value = hf.get(name)
  value = default if value is None else value
  ok = isinstance(value, (int, float)) and not isinstance(value, bool)
  if not ok or not math.isfinite(value):
    raise ConfigError(f"{where}: {name}={value!r} is invalid: allowed a finite number")
  return float(value)


def _mapping(value: Any, name: str, *, where: str = "config.json") -> Mapping[str, Any]:
  """`value` (a JSON object, or absent: {}), refusing any other JSON type by name."""
  if value is None:
    return {}
  if not isinstance(value, Mapping):
    raise ConfigError(f"{where}: {name}={value!r} is invalid: allowed a JSON object")
  return value


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
  legacy = _mapping(hf.get("rope_scaling"), "rope_scaling")
  source = "rope_scaling" if legacy else "rope_parameters"
  params = legacy or _mapping(hf.get("rope_parameters"), "rope_parameters")
  theta = _float_field(params, "rope_theta", _float_field(hf, "rope_theta", 10_000.0))
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
  # A null factor is as missing as an absent one (transformers fails on it too).
  missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor")
             if params.get(k) is None]
  if missing or original is None:
    missing += [] if original is not None else ["original_max_position_embeddings"]
    raise ConfigError(f"config.json: llama3 rope scaling is missing {missing}")
  number = lambda name: _float_field(params, name, 0.0, where=f"config.json {source}")
  return theta, Llama3RopeScaling(
      factor=number("factor"),
      low_freq_factor=number("low_freq_factor"),
      high_freq_factor=number("high_freq_factor"),
      original_max_position=_int_field({"original_max_position_embeddings": original},
                                       "original_max_position_embeddings"),
  )


def _check_supported(hf: Mapping[str, Any], family: str, n_layers: int,
                     max_position: int) -> None:
  """Reject HF options that change the math in ways the specjax model does not implement."""
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ConfigError(f"config.json: hidden_act={act!r} is unsupported: allowed 'silu' (SwiGLU)")
  if hf.get("mlp_bias", False):
    raise ConfigError("config.json: mlp_bias=True is unsupported: allowed False (the MLP has "
                      "no biases)")
  layer_types = hf.get("layer_types")
  if layer_types is not None and not (isinstance(layer_types, list)
                                      and all(isinstance(t, str) for t in layer_types)):
    raise ConfigError(f"config.json: layer_types={layer_types!r:.80} is invalid: allowed a "
                      "list of layer type names, one per layer, such as ['full_attention', "
                      "...]")
  if layer_types is not None:
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
      raise ConfigError(f"config.json: layer_types contains {other}: allowed only "
                        "'full_attention'")
  elif family in ("qwen2", "qwen3", "qwen3_moe") and hf.get("use_sliding_window", False):
    _check_no_sliding_window(hf, n_layers, max_position)


# transformers' Qwen3MoeConfig defaults, used where config.json omits the key.
_HF_MOE_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                    "intermediate_size": 6144}


def _moe_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
  """The MoE fields of a Qwen3-MoE `config.json`, refusing layouts specjax does not run:
  dense layers among the sparse ones, shared experts, no experts."""
  only = hf.get("mlp_only_layers") or []
  step = _int_field(hf, "decoder_sparse_step", 1)
  if not isinstance(only, list) or only or step != 1:
    raise ConfigError(f"config.json: mlp_only_layers={hf.get('mlp_only_layers')!r} with "
                      f"decoder_sparse_step={hf.get('decoder_sparse_step')!r} puts dense MLP "
                      "layers among the sparse ones, which is unsupported: allowed "
                      "mlp_only_layers=[] and decoder_sparse_step=1 (every layer a mixture of "
                      "experts, as Qwen3-30B-A3B and Qwen3-235B-A22B are)")
  if hf.get("shared_expert_intermediate_size"):
    raise ConfigError(f"config.json: shared_expert_intermediate_size="
                      f"{hf['shared_expert_intermediate_size']!r} (a shared expert, as in "
                      "Qwen2-MoE) is unsupported: allowed Qwen3-MoE's routed experts only")
  name = "num_local_experts" if hf.get("num_local_experts") is not None else "num_experts"
  experts = _int_field(hf, name, _HF_MOE_DEFAULTS["num_experts"])
  top_k = _int_field(hf, "num_experts_per_tok", _HF_MOE_DEFAULTS["num_experts_per_tok"])
  if experts < 1:
    raise ConfigError(f"config.json: {name}={experts} is invalid for qwen3_moe: allowed >= 1 "
                      "(a model without experts is a qwen3 checkpoint)")
  if not 1 <= top_k <= experts:
    raise ConfigError(f"config.json: num_experts_per_tok={top_k} is invalid: allowed 1 .. "
                      f"{name}={experts} (the top-k experts each token is routed to)")
  normalize = hf.get("norm_topk_prob", False)
  if not isinstance(normalize, bool):
    raise ConfigError(f"config.json: norm_topk_prob={normalize!r} is invalid: allowed true or "
                      "false")
  return dict(n_experts=experts, experts_per_token=top_k,
              expert_dim=_int_field(hf, "moe_intermediate_size",
                                    _HF_MOE_DEFAULTS["moe_intermediate_size"]),
              normalize_top_k=normalize)


def _check_no_sliding_window(hf: Mapping[str, Any], n_layers: int, max_position: int) -> None:
  """Reject a Qwen2 / Qwen3 sliding window that transformers would apply.

  transformers (Qwen2Config / Qwen3Config) keeps `sliding_window` only when
  `use_sliding_window` is set, and then makes layers `max_window_layers..` sliding. A window
  of at least `max_position_embeddings` never masks a key (`q - k < window` always holds), so
  it is the same model. Llama has no sliding window in transformers, which ignores the keys.
  """
  window = hf.get("sliding_window", _HF_SLIDING_WINDOW)
  if window is None:
    return
  window = _int_field({"sliding_window": window}, "sliding_window")
  first = _int_field(hf, "max_window_layers", _HF_MAX_WINDOW_LAYERS)
  if first < n_layers and window < max_position:
    raise ConfigError(
        f"config.json: use_sliding_window=True with sliding_window={window} on layers "
        f"{first}..{n_layers - 1} (max_window_layers={first}) is unsupported: allowed "
        "use_sliding_window=False, sliding_window=null or >= max_position_embeddings "
        f"({max_position}), or max_window_layers >= num_hidden_layers ({n_layers}); every "
        "specjax layer attends to the whole prefix")


def _family(hf: Mapping[str, Any]) -> str:
  """The checkpoint family, from `model_type` (what transformers' Auto classes dispatch on)
  checked against `architectures`, or from `architectures` alone when `model_type` is absent."""
  archs = hf.get("architectures") or []
  model_type = hf.get("model_type")
  allowed = (f"allowed model_type one of {sorted(_FAMILY_ARCH)} with architectures one of "
             f"{sorted(ARCHITECTURES)}")
  if not isinstance(archs, list):
    raise ConfigError(f"config.json: architectures={archs!r} is invalid: allowed a list such "
                      "as ['LlamaForCausalLM']")
  families = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
  if (model_type is not None and model_type not in _FAMILY_ARCH) or (archs and not families):
    raise ConfigError(f"config.json: architectures={archs!r} (model_type={model_type!r}) is "
                      f"unsupported: {allowed}")
  if model_type is None:
    if not families:  # neither key names the model
      raise ConfigError(f"config.json: has neither model_type nor architectures: {allowed}")
    return families[0]
  if families and model_type not in families:
    raise ConfigError(f"config.json: model_type={model_type!r} disagrees with "
                      f"architectures={archs!r}: allowed matching pairs "
                      f"{sorted(ARCHITECTURES.items(), key=lambda kv: kv[1])}")
  return model_type


def _head_dim(hf: Mapping[str, Any], family: str, d_model: int, n_heads: int) -> int:
  """`head_dim`, or where config.json omits it transformers' default for the family."""
  if hf.get("head_dim") is not None:
    return _int_field(hf, "head_dim")
  return _HF_QWEN3_HEAD_DIM if family == "qwen3" else d_model // n_heads


def config_from_hf(hf: Mapping[str, Any], *, param_dtype: str = "float32",
                   dtype: str | None = None) -> ModelConfig:
  """The `ModelConfig` of an HF `config.json` dict.

  Args:
    hf: the parsed `config.json` (a "specjax" entry sets the draft-head counts).
    param_dtype: dtype to hold parameters in, one of `DTYPES`, or "auto" for the checkpoint's
      `dtype` / `torch_dtype` (float32 when it names none).
    dtype: compute dtype; defaults to the parameter dtype.

  Raises:
    ConfigError: an unsupported architecture or model_type, rope type, activation or option
      (such as an active sliding window), or a non-integral integer field.
  """
  if not isinstance(hf, Mapping):
    raise ConfigError(f"config.json holds a {type(hf).__name__}: allowed a JSON object of "
                      "model settings")
  family = _family(hf)
  # An all-sparse Qwen3-MoE never uses its dense width: transformers' default stands in.
  dense_width = () if family == "qwen3_moe" else ("intermediate_size",)
  missing = [f for f in ("vocab_size", "hidden_size", *dense_width, "num_hidden_layers",
                         "num_attention_heads") if f not in hf]
  if missing:
    raise ConfigError(f"config.json: missing required fields {missing} for "
                      f"{_FAMILY_ARCH[family]}")
  n_layers = _int_field(hf, "num_hidden_layers")
  max_position = _int_field(hf, "max_position_embeddings", 2048)
  _check_supported(hf, family, n_layers, max_position)

  param_dtype = _param_dtype(hf, param_dtype)

  d_model = _int_field(hf, "hidden_size")
  n_heads = _int_field(hf, "num_attention_heads")
  theta, scaling = _rope_from_hf(hf)
  heads = _mapping(hf.get("specjax"), "specjax")
  int_head = lambda name, default: _int_field(heads, name, default, where="config.json specjax")
  return ModelConfig(
      vocab_size=_int_field(hf, "vocab_size"),
      d_model=d_model,
      n_layers=n_layers,
      n_heads=n_heads,
      n_kv_heads=(_int_field(hf, "num_key_value_heads")
                  if hf.get("num_key_value_heads") is not None else n_heads),
      head_dim=_head_dim(hf, family, d_model, n_heads),
      mlp_dim=_int_field(hf, "intermediate_size", _HF_MOE_DEFAULTS["intermediate_size"]
                         if family == "qwen3_moe" else _REQUIRED),
      rope_theta=theta,
      rope_scaling=scaling,
      rms_norm_eps=_float_field(hf, "rms_norm_eps", 1e-6),
      # Qwen2 always has q/k/v biases; Llama and Qwen3 have them (and an o_proj bias, which
      # `load_hf` checks is zero) when attention_bias is set.
      qkv_bias=True if family == "qwen2" else bool(hf.get("attention_bias", False)),
      qk_norm=family in ("qwen3", "qwen3_moe"),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_position=max_position,
      dtype=dtype or param_dtype,
      param_dtype=param_dtype,
      num_mtp_modules=int_head("num_mtp_modules", 0),
      num_medusa_heads=int_head("num_medusa_heads", 0),
      medusa_layers=int_head("medusa_layers", 1),
      family=family,
      **(_moe_fields(hf) if family == "qwen3_moe" else {}),
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
  elif config.family in ("qwen3", "qwen3_moe"):
    hf |= {"attention_bias": config.qkv_bias, "use_sliding_window": False}
  else:
    hf |= {"use_sliding_window": False}
  if config.is_moe:
    hf |= {"num_experts": config.n_experts, "num_experts_per_tok": config.experts_per_token,
           "moe_intermediate_size": config.expert_dim, "norm_topk_prob": config.normalize_top_k,
           "decoder_sparse_step": 1, "mlp_only_layers": []}
  if config.num_mtp_modules or config.num_medusa_heads:
    hf["specjax"] = {"num_mtp_modules": config.num_mtp_modules,
                     "num_medusa_heads": config.num_medusa_heads,
                     "medusa_layers": config.medusa_layers}
  return hf
