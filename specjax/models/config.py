"""Model configuration: a frozen, hashable dataclass validated at construction.

`ModelConfig` is the static argument of every model function, so it must be hashable and
immutable; everything about the architecture that changes shapes or control flow lives here.

Shape letters: see `specjax` (V vocab, E d_model, Q query heads, K kv heads, R = Q / K,
H head_dim, F MLP width, Z experts).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Literal

import jax.numpy as jnp

from specjax.checks import is_plain_int
from specjax.errors import ConfigError

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
# How an MoE layer runs its experts (`ModelConfig.moe_impl`, `specjax.models.moe`).
MOE_IMPLS = ("auto", "loop", "ragged")
ATTENTION_IMPLS = ("auto", "dense", "blocked", "pallas", "pallas_interpret")
# Per-layer rematerialisation of a training forward (`ModelConfig.remat`).
REMAT_POLICIES = ("none", "dots", "full")
# How a run is executed rather than what the model is: not part of an HF checkpoint's config.
RUNTIME_FIELDS = ("attention_impl", "attention_block", "remat", "moe_impl")
# "auto" attention turns blocked from this cache size on, except on a GPU (see
# `ModelConfig.attention_impl`).
AUTO_BLOCKED_MIN_SLOTS = 2048
# Platforms (`jax.lax.platform_dependent` names) where "auto" attention stays dense: blocked
# attention's loop has a data-dependent trip count, and XLA:GPU brings each iteration's
# predicate back to the host. Measured on an H200 (`benchmarks/accelerator.py --sections
# attention`, 2048 slots, 1024 live): the decode step of a 1.1B model took 2.0 / 1.4 / 2.5 ms
# dense against 5.2 / 4.9 / 7.1 ms blocked at batch 1 / 16 / 64.
AUTO_DENSE_PLATFORMS = ("cuda", "rocm")
DTYPES = ("float32", "bfloat16", "float16")


def _require(ok: bool, field: str, value, allowed: str) -> None:
  if not ok:
    raise ConfigError(f"{field}={value!r} is invalid: {allowed}")


def _is_real(value) -> bool:
  """A finite real number (not a bool, a string or NaN / inf)."""
  return (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value))


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
  """Llama 3 frequency-dependent RoPE scaling (HF `rope_type="llama3"`)."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192

  def __post_init__(self):
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
      _require(_is_real(getattr(self, name)), f"rope_scaling.{name}", getattr(self, name),
               "must be a finite number")
    _require(self.factor >= 1.0, "rope_scaling.factor", self.factor, "must be >= 1")
    _require(
        0 < self.low_freq_factor < self.high_freq_factor,
        "rope_scaling.low_freq_factor",
        self.low_freq_factor,
        "must be > 0 and < high_freq_factor",
    )
    _require(
        is_plain_int(self.original_max_position) and self.original_max_position > 0,
        "rope_scaling.original_max_position",
        self.original_max_position,
        "must be a positive int",
    )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a decoder-only transformer of the Llama 3 / Qwen2 / Qwen3 / Qwen3-MoE
  families.

  Attributes:
    vocab_size: V, number of token ids.
    d_model: E, width of the embedding and the residual stream.
    n_layers: number of transformer blocks.
    n_heads: Q, query heads.
    n_kv_heads: K, key/value heads (grouped-query attention when K < Q; Q % K == 0).
    head_dim: H, per-head width; independent of E / Q (Qwen3 uses 128 with E=1024, Q=16).
    mlp_dim: F, hidden width of the SwiGLU MLP (of an MoE checkpoint: its dense width,
      `intermediate_size`, kept for the round trip; every layer of it is sparse).
    rope_theta: RoPE base.
    rope_scaling: None, or Llama 3 style frequency scaling.
    rms_norm_eps: epsilon of every RMSNorm.
    qkv_bias: biases on the q/k/v projections (Qwen2).
    qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3).
    tie_embeddings: the output head reuses the input embedding.
    max_position: largest position the model is meant to see; caches may not exceed it.
    dtype: activation / compute dtype.
    param_dtype: dtype parameters are created and stored in.
    num_mtp_modules: DeepSeek-V3 style multi-token-prediction modules (0 = none).
    num_medusa_heads: Medusa residual-MLP heads (0 = none).
    medusa_layers: residual blocks per Medusa head.
    family: checkpoint family written by `save_hf` ("llama", "qwen2", "qwen3", "qwen3_moe").
    n_experts: Z, routed experts of every layer's mixture-of-experts MLP (0: a dense SwiGLU
      MLP). Each expert is a SwiGLU MLP of width `expert_dim`; a router picks
      `experts_per_token` of them per token (`specjax.models.moe`). Qwen3-MoE has no shared
      expert and, as specjax supports it, no dense layers among the sparse ones.
    experts_per_token: k, the experts each token is routed to (top-k of the router's softmax).
    expert_dim: hidden width of one expert (HF `moe_intermediate_size`).
    normalize_top_k: the k routing weights are renormalised to sum to one (HF
      `norm_topk_prob`; Qwen3-MoE checkpoints set it).
    attention_impl: how a forward with a cache attends (`specjax.models.attention`):
      "dense" scores every slot of the buffer, "blocked" only the blocks of
      `attention_block` slots below the longest live row; "auto" picks blocked for caches
      of at least `AUTO_BLOCKED_MIN_SLOTS` slots, except on a GPU (`AUTO_DENSE_PLATFORMS`),
      where it stays dense; the choice is made per platform when the program is lowered.
      "pallas" runs JAX's Pallas GPU decode kernel for decode steps on a GPU
      ("pallas_interpret": interpreted, any backend) and what "auto" would where it does not
      apply. Forwards without a cache are dense.
    attention_block: slots per block of blocked attention.
    remat: what a forward without a cache (training, the update's log-prob pass) keeps of
      each layer for the backward pass (`jax.checkpoint` per layer): "none" keeps every
      activation; "dots" keeps the projections' outputs and recomputes the rest (attention
      scores and probabilities, norms, the MLP's product); "full" keeps only each layer's
      input and recomputes the layer in the backward pass (about a third more FLOPs).
      Decoding (a forward with a cache) never rematerialises. Results are identical.
    moe_impl: how an MoE layer runs its experts (`specjax.models.moe`): "loop" visits, per
      forward, only the experts its tokens were routed to (reads only their weights: decode
      steps), "ragged" sorts the (token, expert) pairs by expert and runs grouped matmuls
      (`jax.lax.ragged_dot`: prefill and training on TPU / GPU); "auto" picks "loop" on a
      CPU, and elsewhere when a forward has at most as many (token, expert) pairs as
      experts, else "ragged". Both are dropless (no capacity: every token reaches its k
      experts); results agree to rounding.
  """

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 10_000.0
  rope_scaling: Llama3RopeScaling | None = None
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False
  qk_norm: bool = False
  tie_embeddings: bool = False
  max_position: int = 2048
  dtype: Literal["float32", "bfloat16", "float16"] = "float32"
  param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
  num_mtp_modules: int = 0
  num_medusa_heads: int = 0
  medusa_layers: int = 1
  family: Literal["llama", "qwen2", "qwen3", "qwen3_moe"] = "llama"
  attention_impl: Literal["auto", "dense", "blocked", "pallas", "pallas_interpret"] = "auto"
  attention_block: int = 256
  remat: Literal["none", "dots", "full"] = "none"
  n_experts: int = 0
  experts_per_token: int = 0
  expert_dim: int = 0
  normalize_top_k: bool = True
  moe_impl: Literal["auto", "loop", "ragged"] = "auto"

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                 "mlp_dim", "max_position", "medusa_layers", "attention_block"):
      value = getattr(self, name)
      _require(is_plain_int(value) and value > 0, name, value, "must be a positive int")
    for name in ("num_mtp_modules", "num_medusa_heads"):
      value = getattr(self, name)
      _require(is_plain_int(value) and value >= 0, name, value, "must be an int >= 0")
    _require(
        self.n_heads % self.n_kv_heads == 0,
        "n_kv_heads",
        self.n_kv_heads,
        f"must divide n_heads={self.n_heads} (grouped-query attention)",
    )
    _require(self.head_dim % 2 == 0, "head_dim", self.head_dim, "must be even (RoPE pairs)")
    _require(_is_real(self.rope_theta) and self.rope_theta > 0, "rope_theta", self.rope_theta,
             "must be a finite number > 0")
    _require(_is_real(self.rms_norm_eps) and self.rms_norm_eps > 0, "rms_norm_eps",
             self.rms_norm_eps, "must be a finite number > 0")
    for name in ("n_experts", "experts_per_token", "expert_dim"):
      value = getattr(self, name)
      _require(is_plain_int(value) and value >= 0, name, value, "must be an int >= 0")
    if self.n_experts:
      _require(1 <= self.experts_per_token <= self.n_experts, "experts_per_token",
               self.experts_per_token,
               f"must be between 1 and n_experts={self.n_experts} (the top-k experts each "
               "token is routed to)")
      _require(self.expert_dim > 0, "expert_dim", self.expert_dim,
               "must be a positive int for an MoE model (n_experts > 0): one expert's width")
    else:
      for name in ("experts_per_token", "expert_dim"):
        _require(getattr(self, name) == 0, name, getattr(self, name),
                 "a dense model (n_experts=0) has 0 (set n_experts for a mixture of experts)")
    _require(self.moe_impl in MOE_IMPLS, "moe_impl", self.moe_impl, f"one of {MOE_IMPLS}")
    for name in ("qkv_bias", "qk_norm", "tie_embeddings", "normalize_top_k"):
      _require(isinstance(getattr(self, name), bool), name, getattr(self, name),
               "must be True or False")
    _require(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
    _require(self.param_dtype in DTYPES, "param_dtype", self.param_dtype, f"one of {DTYPES}")
    _require(self.family in FAMILIES, "family", self.family, f"one of {FAMILIES}")
    _require(self.attention_impl in ATTENTION_IMPLS, "attention_impl", self.attention_impl,
             f"one of {ATTENTION_IMPLS}")
    _require(self.remat in REMAT_POLICIES, "remat", self.remat, f"one of {REMAT_POLICIES}")
    _require(
        self.rope_scaling is None or isinstance(self.rope_scaling, Llama3RopeScaling),
        "rope_scaling",
        self.rope_scaling,
        "None or a Llama3RopeScaling",
    )
    if self.family == "qwen2":
      _require(self.qkv_bias and not self.qk_norm, "family", self.family,
               "qwen2 checkpoints have qkv_bias=True and qk_norm=False")
    if self.family in ("qwen3", "qwen3_moe"):
      _require(self.qk_norm, "family", self.family,
               f"{self.family} checkpoints have qk_norm=True")
    _require((self.family == "qwen3_moe") == (self.n_experts > 0), "family", self.family,
             "qwen3_moe checkpoints (and only they) have experts: n_experts > 0 exactly when "
             "family='qwen3_moe'")
    if self.family == "llama":
      _require(not self.qk_norm, "family", self.family,
               "llama checkpoints have no qk_norm; use family='qwen3'")

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def weight_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.param_dtype)

  def blocked_attention(self, max_len: int, platform: str) -> bool:
    """Whether a forward over a cache of `max_len` slots uses blocked attention on `platform`.

    `platform` is a lowering platform ("cpu", "cuda", "rocm", "tpu"); "pallas" counts as
    "auto" here (where its kernel does not apply, it attends as "auto" would).
    """
    if self.attention_impl in ("dense", "blocked"):
      return self.attention_impl == "blocked"
    return max_len >= AUTO_BLOCKED_MIN_SLOTS and platform not in AUTO_DENSE_PLATFORMS

  @property
  def is_moe(self) -> bool:
    """Every layer's MLP is a mixture of experts (`n_experts` > 0)."""
    return self.n_experts > 0

  @property
  def group_size(self) -> int:
    """R, query heads per key/value head (Q / K)."""
    return self.n_heads // self.n_kv_heads

  def replace(self, **changes) -> ModelConfig:
    return dataclasses.replace(self, **changes)
