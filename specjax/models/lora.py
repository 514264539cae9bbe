"""LoRA: low-rank adapters on the trunk's projections, trained while the trunk stays frozen.

A projection `y = x W` with `W [in, out]` is trained as `y = x W + s (x A) B` with `A [in, r]`,
`B [r, out]`, rank r much smaller than in and out and `s = alpha / r` (Hu et al., 2021). Only A
and B have gradients and optimizer state: 14 bytes per trunk parameter of full-parameter
Adam training (bf16 weights, float32 master and moments) become 2 (the frozen bf16 weight)
plus a few per cent for the adapters, which is what lets a 1-2B policy train on one 16-24 GiB
device. B starts at zero, so the adapted model starts as the base model exactly; A starts
random (std 1 / sqrt(in)), so B's first gradients are not zero.

Two ways to apply them, the same function up to rounding:
- `LoraAdapters.attach(params)`: the trunk's layer dicts gain a `"lora"` entry of factors,
  which `specjax.models.transformer.block` adds as the low-rank path `s (x A) B` beside each
  adapted projection. Training uses this: gradients reach A and B through two thin matmuls,
  and no `[in, out]` weight gradient is ever formed.
- `LoraAdapters.merge(params)`: `W + s A B` rounded to W's dtype, plain parameters that every
  decoding path and `save_hf` take. Rollouts decode with the merged policy (no extra matmuls
  per token), and an export is merged.

Adapter names are the trunk's projection names (`ADAPTABLE`): "wq", "wk", "wv", "wo"
(attention), "w_gate", "w_up", "w_down" (MLP); PEFT calls them q_proj ... down_proj. A
mixture-of-experts model has no dense MLP: its adapters are on the attention projections
(`adapted_targets`); the router and the experts train only in a full-parameter run.
Shape letters: see `specjax` (E d_model, Q query heads, K kv heads, H head_dim, F MLP width).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from specjax.checks import is_int, is_real, require
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.params import Params, block_axes

# Projection -> how many of its weight's leading axes are inputs (the rest are outputs).
ADAPTABLE = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}
# The layer-dict key under which `attach` puts a layer's (A, s B) factors.
ATTACHED = "lora"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Which projections carry adapters, and their rank and scale.

  Attributes:
    rank: r, the adapters' inner width; 0: no adapters (every parameter is trained).
    alpha: the scale numerator: the low-rank path is multiplied by alpha / rank.
    targets: the projections adapted (`ADAPTABLE`'s names); default all seven.
  """

  rank: int = 0
  alpha: float = 32.0
  targets: tuple[str, ...] = tuple(ADAPTABLE)

  def __post_init__(self):
    require(is_int(self.rank) and self.rank >= 0, "lora.rank", self.rank,
            "must be an int >= 0 (0: no adapters, full-parameter training)")
    object.__setattr__(self, "rank", int(self.rank))
    require(is_real(self.alpha) and self.alpha > 0, "lora.alpha", self.alpha,
            "must be a finite number > 0")
    targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
    unknown = [t for t in targets if t not in ADAPTABLE]
    require(bool(targets) and not unknown and len(set(targets)) == len(targets),
            "lora.targets", self.targets,
            f"must be distinct names among {', '.join(ADAPTABLE)}"
            + (f" ({', '.join(map(repr, unknown))} unknown)" if unknown else ""))
    object.__setattr__(self, "targets", targets)

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def _split(name: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
  n = ADAPTABLE[name]
  return shape[:n], shape[n:]


@struct.dataclass
class LoraAdapters:
  """The adapters of every layer: `factors["layers"][i][name] = {"a": A, "b": B}` with
  `A [*in, r]` and `B [r, *out]` shaped like the projection's input and output axes (wq:
  A `[E, r]`, B `[r, Q, H]`). A pytree whose leaves are the factors (what the optimizer
  trains); the config is static."""

  factors: Params
  config: LoraConfig = struct.field(pytree_node=False)

  def attach(self, params: Params) -> Params:
    """`params` with each layer's factors `(A, s B)` under its `"lora"` key, for the
    factored forward (`block` adds `(x A)(s B)` to each adapted projection)."""
    s = self.config.scale
    layers = [{**layer, ATTACHED: {name: (f["a"], f["b"] * s) for name, f in lora.items()}}
              for layer, lora in zip(params["layers"], self.factors["layers"], strict=True)]
    return {**params, "layers": layers}

  def merge(self, params: Params) -> Params:
    """Plain parameters with `W + s A B` (computed in float32, rounded to W's dtype) in place
    of each adapted projection."""
    s = self.config.scale

    def merged(w, f):
      a, b = f["a"].astype(jnp.float32), f["b"].astype(jnp.float32)
      delta = jnp.tensordot(a, b, axes=1)
      return (w.astype(jnp.float32) + s * delta).astype(w.dtype)

    layers = [{**layer, **{name: merged(layer[name], f) for name, f in lora.items()}}
              for layer, lora in zip(params["layers"], self.factors["layers"], strict=True)]
    return {**params, "layers": layers}



def adapted_targets(model: ModelConfig, config: LoraConfig) -> tuple[str, ...]:
  """The projections of `config.targets` that `model`'s layers have (an MoE layer has no
  "w_gate", "w_up", "w_down"), in `config.targets`' order.

  Raises:
    ConfigError: none of them is there.
  """
  present = block_axes(model)
  names = tuple(name for name in config.targets if name in present)
  if not names:
    raise ConfigError(f"lora.targets={config.targets!r} names no projection of this model: "
                      f"its layers have {', '.join(n for n in ADAPTABLE if n in present)} "
                      + ("(a mixture-of-experts model has no dense MLP to adapt)"
                         if model.is_moe else ""))
  return names


def merged_policy(params: Params, adapters: LoraAdapters | None) -> Params:
  """The parameters a policy decodes with: `params`, with `adapters` merged in (if any)."""
  return params if adapters is None else adapters.merge(params)


def init_lora(model: ModelConfig, config: LoraConfig, key: jax.Array,
              dtype=jnp.float32) -> LoraAdapters:
  """Fresh adapters: A normal with std 1 / sqrt(fan-in), B zero (the model starts as the
  base model). Float32 by default: they are small, and a bfloat16 adapter would lose the
  small steps that master weights exist to keep."""
  if not config.enabled:
    raise ValueError("init_lora needs lora.rank >= 1")
  shapes = {"wq": (model.d_model, model.n_heads, model.head_dim),
            "wk": (model.d_model, model.n_kv_heads, model.head_dim),
            "wv": (model.d_model, model.n_kv_heads, model.head_dim),
            "wo": (model.n_heads, model.head_dim, model.d_model),
            "w_gate": (model.d_model, model.mlp_dim), "w_up": (model.d_model, model.mlp_dim),
            "w_down": (model.mlp_dim, model.d_model)}
  r = config.rank
  targets = adapted_targets(model, config)
  layers = []
  for layer_key in jax.random.split(key, model.n_layers):
    layer = {}
    for name, k in zip(targets, jax.random.split(layer_key, len(targets))):
      ins, outs = _split(name, shapes[name])
      std = 1.0 / math.sqrt(math.prod(ins))
      layer[name] = {"a": (std * jax.random.normal(k, ins + (r,))).astype(dtype),
                     "b": jnp.zeros((r,) + outs, dtype)}
    layers.append(layer)
  return LoraAdapters(factors={"layers": layers}, config=config)



def lora_axes(model: ModelConfig, config: LoraConfig) -> Params:
  """Logical axes of `init_lora(model, config, key).factors`: A takes its projection's input
  axes, B its output axes; the rank axis is never split."""
  axes = block_axes(model)
  layer = {}
  for name in adapted_targets(model, config):
    ins, outs = _split(name, tuple(axes[name]))
    layer[name] = {"a": P(*ins, None), "b": P(None, *outs)}
  return {"layers": [dict(layer) for _ in range(model.n_layers)]}



def low_rank(x: jax.Array, factors: tuple[jax.Array, jax.Array], dtype) -> jax.Array:
  """`(x A) B` for the attached factors of one projection, with `x [..., in]` flattened over
  the projection's input axes; `[..., out]`, flattened over its output axes."""
  a, b = factors
  a = a.reshape(-1, a.shape[-1]).astype(dtype)
  b = b.reshape(b.shape[0], -1).astype(dtype)
  return (x @ a) @ b
