"""A model as the simulator sees it: parameter counts, and the work of one forward pass.

Dense and mixture-of-experts decoders of the Llama 3 / Qwen families (SwiGLU MLPs, grouped-
query attention). For an MoE model the *active* parameters (those one token uses: attention,
router, top-k experts) set the FLOPs, and the experts the tokens of a forward *touch* set the
bytes read: with n tokens each routed to k of X experts uniformly, a layer touches
X * (1 - (1 - k/X)^n) experts on average, so a small decode batch reads a fraction of the
experts and a prefill reads them all. Norm weights and biases are left out (< 0.1%).

Work of a forward over B rows x T new tokens each, against `context` committed tokens per row
(n = B * T tokens; the output head runs on `head_tokens`, n unless said otherwise):

  matmul FLOP   2 n (layers * active layer params + extra) + 2 head_tokens V E
  weight bytes  weight_bytes * (layers * (attention + router + touched experts or MLP)
                + extra + V E)                      (the input embedding is only gathered)
  attention FLOP  4 layers Q H B T (context + (T + 1) / 2)     (scores and values, causal)
  KV bytes      layers * 2 K H kv_bytes * B (context + T)      (read, new entries included)
  activations   n E weight_bytes: what one tensor-parallel all-reduce moves

Shape letters: see `specjax` (B rows, T tokens per row, V vocab, E d_model, Q query heads,
K kv heads, H head_dim, F MLP width).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from specjax.checks import is_int
from specjax.errors import ConfigError
from specjax.sim import _checks as C

_DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}
# Hugging Face `model_type`s that `ModelSpec.from_hf_config` reads (SwiGLU, grouped-query
# attention).
_HF_DENSE, _HF_MOE = ("llama", "mistral", "qwen2", "qwen3"), ("qwen3_moe",)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Architecture numbers of a decoder (no weights).

  Attributes:
    name: preset name or description.
    n_layers, d_model (E), n_heads (Q), n_kv_heads (K), head_dim (H), vocab (V): as in
      `specjax.models.ModelConfig`.
    mlp_dim: F, the SwiGLU hidden width of a dense layer (0 for an MoE model).
    tied_embeddings: the output head is the input embedding table.
    n_experts: X, routed experts per layer (0: dense).
    experts_per_token: k, experts each token is routed to.
    expert_dim: hidden width of one (SwiGLU) expert.
    extra_params: per-token matmul parameters outside the layers and the head (an EAGLE-3
      head's fusion layer, an MTP module's projection).
    weight_bytes: bytes per parameter (2 for bf16).
    kv_bytes: bytes per cached K or V element.
  """

  name: str
  n_layers: int
  d_model: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  vocab: int
  mlp_dim: int = 0
  tied_embeddings: bool = False
  n_experts: int = 0
  experts_per_token: int = 0
  expert_dim: int = 0
  extra_params: int = 0
  weight_bytes: float = 2.0
  kv_bytes: float = 2.0

  def __post_init__(self):
    for field in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "vocab"):
      C.positive_int(f"ModelSpec.{field}", getattr(self, field))
    for field in ("mlp_dim", "n_experts", "experts_per_token", "expert_dim", "extra_params"):
      C.nonneg_int(f"ModelSpec.{field}", getattr(self, field))
    C.positive("ModelSpec.weight_bytes", self.weight_bytes)
    C.positive("ModelSpec.kv_bytes", self.kv_bytes)
    C.require(self.n_heads % self.n_kv_heads == 0, "ModelSpec.n_kv_heads", self.n_kv_heads,
              f"must divide n_heads={self.n_heads}")
    if self.n_experts:
      C.require(0 < self.experts_per_token <= self.n_experts and self.expert_dim > 0,
                "ModelSpec.experts_per_token", self.experts_per_token,
                f"an MoE model needs 1 <= experts_per_token <= n_experts={self.n_experts} and "
                "expert_dim > 0")
    else:
      C.require(self.mlp_dim > 0, "ModelSpec.mlp_dim", self.mlp_dim,
                "a dense model (n_experts=0) needs mlp_dim > 0")

  @classmethod
  def from_model_config(cls, config: Any, name: str = "model") -> ModelSpec:
    """The spec of a `specjax.models.ModelConfig` (read by attribute; no JAX needed); of an
    MoE one (`n_experts` > 0), its experts, and no dense width."""
    experts = getattr(config, "n_experts", 0)
    mlp = (dict(n_experts=experts, experts_per_token=config.experts_per_token,
                expert_dim=config.expert_dim) if experts else dict(mlp_dim=config.mlp_dim))
    return cls(name=name, n_layers=config.n_layers, d_model=config.d_model,
               n_heads=config.n_heads, n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
               vocab=config.vocab_size, tied_embeddings=config.tie_embeddings, **mlp,
               weight_bytes=_DTYPE_BYTES[config.param_dtype],
               kv_bytes=_DTYPE_BYTES[config.dtype])

  @classmethod
  def from_hf_config(cls, hf: Mapping[str, Any], name: str = "model") -> ModelSpec:
    """The spec of a Hugging Face `config.json` (parsed): Llama, Mistral, Qwen2, Qwen3 and
    Qwen3-MoE decoders, the MoE ones with every layer sparse.

    Raises:
      ConfigError: another `model_type`, a missing or malformed field, a quantized
        checkpoint, or an MoE layout the spec cannot hold (dense layers among sparse ones).
    """
    if not isinstance(hf, Mapping):
      raise ConfigError(f"config.json of {name!r} is invalid: must be a JSON object, not "
                        f"{type(hf).__name__}")
    kind = hf.get("model_type")
    if kind not in _HF_DENSE + _HF_MOE:
      raise ConfigError(f"config.json of {name!r}: model_type={kind!r} is unsupported by the "
                        f"simulator: allowed {', '.join(_HF_DENSE + _HF_MOE)}")

    def field(key: str) -> Any:
      if hf.get(key) is None:
        raise ConfigError(f"config.json of {name!r} lacks {key!r}, which a {kind} model needs")
      return hf[key]

    heads, d_model = field("num_attention_heads"), field("hidden_size")
    head_dim = hf.get("head_dim")
    if head_dim is None and kind == "qwen3":  # transformers' Qwen3Config default (the loader's)
      head_dim = 128
    elif head_dim is None:  # transformers' default: the model width split over the heads
      head_dim = d_model // heads if is_int(d_model) and is_int(heads) and heads > 0 else 0
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
    if not isinstance(dtype, str) or dtype not in _DTYPE_BYTES:
      raise ConfigError(f"config.json of {name!r}: torch_dtype={dtype!r} is unsupported: "
                        f"allowed {', '.join(_DTYPE_BYTES)}")
    if hf.get("quantization_config") is not None:
      raise ConfigError(f"config.json of {name!r}: a quantized checkpoint (quantization_config) "
                        "is unsupported: the simulator prices every weight at torch_dtype")
    tied = hf.get("tie_word_embeddings")
    tied = False if tied is None else tied  # transformers' default for these families
    if not isinstance(tied, bool):
      raise ConfigError(f"config.json of {name!r}: tie_word_embeddings={tied!r} is invalid: must "
                        "be true or false")
    if kind in _HF_MOE:
      step = hf.get("decoder_sparse_step")
      if hf.get("mlp_only_layers") or (step if step is not None else 1) != 1:
        raise ConfigError(f"config.json of {name!r}: dense layers among the sparse ones "
                          f"(mlp_only_layers={hf.get('mlp_only_layers')!r}, decoder_sparse_step="
                          f"{hf.get('decoder_sparse_step')!r}) are unsupported: the simulator "
                          "models every layer alike")
      experts = "num_local_experts" if "num_local_experts" in hf else "num_experts"  # 5.x: local
      mlp = dict(n_experts=field(experts), experts_per_token=field("num_experts_per_tok"),
                 expert_dim=field("moe_intermediate_size"))
    else:
      mlp = dict(mlp_dim=field("intermediate_size"))
    layers, vocab, kv_heads = (field("num_hidden_layers"), field("vocab_size"),
                               hf.get("num_key_value_heads"))
    try:
      return cls(name=name, n_layers=layers, d_model=d_model, n_heads=heads,
                 n_kv_heads=heads if kv_heads is None else kv_heads, head_dim=head_dim,
                 vocab=vocab, tied_embeddings=tied,
                 weight_bytes=_DTYPE_BYTES[dtype], kv_bytes=_DTYPE_BYTES[dtype], **mlp)
    except ConfigError as error:  # name the file, not only the spec's field
      raise ConfigError(f"config.json of {name!r}: {error}") from None

  # Parameter counts -----------------------------------------------------------------------

  @property
  def is_moe(self) -> bool:
    return self.n_experts > 0

  @property
  def attention_params(self) -> int:
    """One layer's q, k, v and o projections."""
    q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
    return 2 * self.d_model * q + 2 * self.d_model * kv

  @property
  def expert_params(self) -> int:
    return 3 * self.d_model * self.expert_dim

  @property
  def router_params(self) -> int:
    return self.d_model * self.n_experts

  @property
  def layer_params(self) -> int:
    """One layer, all experts."""
    if self.is_moe:
      return self.attention_params + self.router_params + self.n_experts * self.expert_params
    return self.attention_params + 3 * self.d_model * self.mlp_dim

  @property
  def layer_active_params(self) -> int:
    """One layer, as one token uses it (top-k experts)."""
    if self.is_moe:
      return (self.attention_params + self.router_params
              + self.experts_per_token * self.expert_params)
    return self.layer_params

  @property
  def dense_mlp_dim(self) -> int:
    """The MLP width of a dense layer doing one token's work (k experts for MoE)."""
    return self.experts_per_token * self.expert_dim if self.is_moe else self.mlp_dim

  @property
  def embedding_params(self) -> int:
    """Input embedding plus output head (once when tied)."""
    return self.vocab * self.d_model * (1 if self.tied_embeddings else 2)

  @property
  def total_params(self) -> int:
    return self.n_layers * self.layer_params + self.embedding_params + self.extra_params

  @property
  def active_params(self) -> int:
    """Parameters one token uses, embeddings included (the "A22B" of Qwen3-235B-A22B)."""
    return self.n_layers * self.layer_active_params + self.embedding_params + self.extra_params

  @property
  def param_bytes(self) -> float:
    return self.total_params * self.weight_bytes

  @property
  def kv_bytes_per_token(self) -> float:
    """K and V of one token, all layers."""
    return self.n_layers * 2 * self.n_kv_heads * self.head_dim * self.kv_bytes

  # Work of a forward ----------------------------------------------------------------------

  def touched_experts(self, tokens):
    """Expected experts per layer the routing of `tokens` tokens reaches (uniform routing)."""
    x, k = self.n_experts, self.experts_per_token
    return x * (1.0 - (1.0 - k / x) ** np.asarray(tokens, float))

  def forward_work(self, rows, tokens_per_row, context, head_tokens=None) -> ForwardWork:
    """The work of one forward (numbers, or arrays of one shape for many forwards)."""
    b = np.asarray(rows, float)
    t = np.asarray(tokens_per_row, float)
    n = b * t
    head = n if head_tokens is None else np.asarray(head_tokens, float)
    per_token = self.n_layers * self.layer_active_params + self.extra_params
    if self.is_moe:
      layer_bytes = (self.attention_params + self.router_params
                     + self.touched_experts(n) * self.expert_params)
    else:
      layer_bytes = self.layer_params
    head_params = self.vocab * self.d_model
    weights = (self.n_layers * layer_bytes + self.extra_params + head_params) * self.weight_bytes
    attn = (4.0 * self.n_layers * self.n_heads * self.head_dim * n
            * (np.asarray(context, float) + (t + 1.0) / 2.0))
    kv = self.kv_bytes_per_token * b * (np.asarray(context, float) + t)
    return ForwardWork(matmul_flops=2.0 * n * per_token + 2.0 * head * head_params,
                       weight_bytes=weights + 0.0 * n, attention_flops=attn, kv_bytes=kv,
                       activation_bytes=n * self.d_model * self.weight_bytes)

  def describe(self) -> str:
    kind = (f"MoE {self.n_experts} experts, top-{self.experts_per_token}" if self.is_moe
            else "dense")
    active = f", {self.active_params / 1e9:.1f}B active" if self.is_moe else ""
    return f"{self.name} ({self.total_params / 1e9:.2f}B params{active}, {kind})"


@dataclasses.dataclass(frozen=True)
class ForwardWork:
  """FLOP and bytes of one forward, on one device holding the whole model."""

  matmul_flops: Any
  weight_bytes: Any
  attention_flops: Any
  kv_bytes: Any
  activation_bytes: Any
