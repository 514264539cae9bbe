"""Parameter pytrees: initialisation and the logical axis names of every leaf.

Parameters are nested dicts of arrays. Layers are a list of per-layer dicts rather than one
stacked array: the forward pass unrolls the layers in Python, so each layer's weights and KV
buffers are separate XLA buffers and nothing is sliced out of (or copied into) a stack.

A mixture-of-experts layer (`ModelConfig.n_experts` > 0) has, in place of the dense MLP's
`w_gate`, `w_up`, `w_down`, a router `[E, Z]` and the experts' stacked weights
`experts_gate`, `experts_up` `[Z, E, F]` and `experts_down` `[Z, F, E]` (`specjax.models.moe`).

Shape letters: see `specjax` (V vocab, E d_model, Q query heads, K kv heads, H head_dim,
F MLP width, Z experts).

Logical axes (see `param_axes`) are `PartitionSpec`s of *logical* names — "vocab", "embed",
"heads", "kv_heads", "head_dim", "mlp", "expert" — mapped to mesh axes by `specjax.sharding`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from specjax.errors import ConfigError
from specjax.models.config import ModelConfig

Params = dict[str, Any]  # a parameter pytree: nested dicts of arrays (the one definition)

_INIT_STD = 0.02


def block_axes(config: ModelConfig) -> dict[str, P]:
  """Logical axes of one transformer block's parameters."""
  axes = {
      "attn_norm": P("embed"),
      "wq": P("embed", "heads", "head_dim"),
      "wk": P("embed", "kv_heads", "head_dim"),
      "wv": P("embed", "kv_heads", "head_dim"),
      "wo": P("heads", "head_dim", "embed"),
      "mlp_norm": P("embed"),
  }
  if config.is_moe:
    axes |= {"router": P("embed", None),
             "experts_gate": P("expert", "embed", "mlp"),
             "experts_up": P("expert", "embed", "mlp"),
             "experts_down": P("expert", "mlp", "embed")}
  else:
    axes |= {"w_gate": P("embed", "mlp"), "w_up": P("embed", "mlp"),
             "w_down": P("mlp", "embed")}
  if config.qkv_bias:
    axes |= {"bq": P("heads", "head_dim"), "bk": P("kv_heads", "head_dim"),
             "bv": P("kv_heads", "head_dim")}
  if config.qk_norm:
    axes |= {"q_norm": P("head_dim"), "k_norm": P("head_dim")}
  return axes


def param_axes(config: ModelConfig) -> Params:
  """Logical axis names with the same tree structure as `init_params(config, key)`."""
  axes: Params = {
      "embed": P("vocab", "embed"),
      "layers": [block_axes(config) for _ in range(config.n_layers)],
      "final_norm": P("embed"),
  }
  if not config.tie_embeddings:
    axes["unembed"] = P("embed", "vocab")
  if config.num_mtp_modules:
    axes["mtp"] = [
        {"h_norm": P("embed"), "e_norm": P("embed"), "proj": P(None, "embed"),
         "block": block_axes(config), "out_norm": P("embed")}
        for _ in range(config.num_mtp_modules)
    ]
  if config.num_medusa_heads:
    axes["medusa"] = [
        [{"w": P("embed", None), "b": P(None)} for _ in range(config.medusa_layers)]
        for _ in range(config.num_medusa_heads)
    ]
  return axes


def _init_block(config: ModelConfig, key: jax.Array) -> Params:
  e, q, k, h, f = (config.d_model, config.n_heads, config.n_kv_heads, config.head_dim,
                   config.mlp_dim)
  dt = config.weight_dtype
  keys = jax.random.split(key, 8)
  normal = lambda kk, shape: (_INIT_STD * jax.random.normal(kk, shape)).astype(dt)
  block = {
      "attn_norm": jnp.ones((e,), dt),
      "wq": normal(keys[0], (e, q, h)),
      "wk": normal(keys[1], (e, k, h)),
      "wv": normal(keys[2], (e, k, h)),
      "wo": normal(keys[3], (q, h, e)),
      "mlp_norm": jnp.ones((e,), dt),
  }
  if config.is_moe:
    z, fe = config.n_experts, config.expert_dim
    block |= {"router": normal(keys[7], (e, z)),
              "experts_gate": normal(keys[4], (z, e, fe)),
              "experts_up": normal(keys[5], (z, e, fe)),
              "experts_down": normal(keys[6], (z, fe, e))}
  else:
    block |= {"w_gate": normal(keys[4], (e, f)), "w_up": normal(keys[5], (e, f)),
              "w_down": normal(keys[6], (f, e))}
  if config.qkv_bias:
    block |= {"bq": jnp.zeros((q, h), dt), "bk": jnp.zeros((k, h), dt),
              "bv": jnp.zeros((k, h), dt)}
  if config.qk_norm:
    block |= {"q_norm": jnp.ones((h,), dt), "k_norm": jnp.ones((h,), dt)}
  return block


def init_params(config: ModelConfig, key: jax.Array) -> Params:
  """Random parameters (normal, std 0.02; norms one; biases zero; Medusa blocks zero).

  Medusa blocks start at zero so each head initially predicts what the base head predicts,
  which is the standard Medusa initialisation and keeps early drafts sensible.
  """
  e, v = config.d_model, config.vocab_size
  dt = config.weight_dtype
  k_embed, k_unembed, k_layers, k_mtp = jax.random.split(key, 4)
  params: Params = {
      "embed": (_INIT_STD * jax.random.normal(k_embed, (v, e))).astype(dt),
      "layers": [_init_block(config, kk)
                 for kk in jax.random.split(k_layers, config.n_layers)],
      "final_norm": jnp.ones((e,), dt),
  }
  if not config.tie_embeddings:
    params["unembed"] = (_INIT_STD * jax.random.normal(k_unembed, (e, v))).astype(dt)
  if config.num_mtp_modules:
    mtp = []
    for kk in jax.random.split(k_mtp, config.num_mtp_modules):
      k_proj, k_block = jax.random.split(kk)
      mtp.append({
          "h_norm": jnp.ones((e,), dt),
          "e_norm": jnp.ones((e,), dt),
          "proj": (_INIT_STD * jax.random.normal(k_proj, (2 * e, e))).astype(dt),
          "block": _init_block(config, k_block),
          "out_norm": jnp.ones((e,), dt),
      })
    params["mtp"] = mtp
  if config.num_medusa_heads:
    params["medusa"] = [
        [{"w": jnp.zeros((e, e), dt), "b": jnp.zeros((e,), dt)}
         for _ in range(config.medusa_layers)]
        for _ in range(config.num_medusa_heads)
    ]
  return params


def count_params(params: Params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))


_HEADS = ("['mtp']", "['medusa']")  # drafting heads: optional for what does not draft with them


@functools.lru_cache(maxsize=32)
def init_shapes(init: Callable[[Any, jax.Array], Params], config: Any
                ) -> dict[str, tuple[int, ...]]:
  """The shape of each leaf (by `keystr` path) that `init(config, key)` makes, traced only."""
  shapes = jax.eval_shape(functools.partial(init, config), jax.random.key(0))
  return {jax.tree_util.keystr(k): tuple(x.shape)
          for k, x in jax.tree_util.tree_leaves_with_path(shapes)}


def check_params(params: Params, config: ModelConfig, name: str = "params") -> None:
  """Raise a `ConfigError` unless `params` have the arrays `init_params(config, key)` makes,
  each with its shape and a float dtype (works on tracers: shapes and dtypes are static).

  The drafting heads (`mtp`, `medusa`) may be missing (a drafter that needs them says so),
  but those present must have the configured shapes.
  """
  if not isinstance(params, dict):
    raise ConfigError(f"{name} must be a dict of arrays as init_params(config, key) or "
                      f"load_hf(...) return, got {type(params).__name__}")
  check_leaves(params, init_shapes(init_params, config), name, _HEADS,
               f"Config: d_model={config.d_model}, n_layers={config.n_layers}, vocab_size="
               f"{config.vocab_size}; pass the config the parameters were made with (load_hf "
               "returns both)")


def check_leaves(params: Params, want: dict[str, tuple[int, ...]], name: str,
                 optional: tuple[str, ...], hint: str) -> None:
  """Raise a `ConfigError` unless the leaves of `params` are `want`'s (`keystr` path ->
  shape), each of a float dtype; paths starting with one of `optional` may be missing.
  `hint` ends the message (the config's sizes and where matching parameters come from)."""
  leaves = jax.tree_util.tree_leaves_with_path(params)
  got = {jax.tree_util.keystr(k): tuple(jnp.shape(x)) for k, x in leaves}
  # An integer or bool weight computes without error, in a different model (casts truncate).
  dtypes = {jax.tree_util.keystr(k): x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
            for k, x in leaves}
  not_float = sorted(k for k in want.keys() & dtypes.keys()
                     if not jnp.issubdtype(dtypes[k], jnp.floating))
  wrong = sorted(k for k in want.keys() & got.keys() if want[k] != got[k])
  missing = sorted(k for k in want.keys() - got.keys() if not k.startswith(optional))
  extra = sorted(k for k in got.keys() - want.keys() if not k.startswith(optional))
  if wrong or missing or extra or not_float:
    problems = ([f"{name}{k} has shape {got[k]}, the config needs {want[k]}" for k in wrong]
                + [f"{name}{k} has dtype {dtypes[k]}: allowed a float dtype (float32, "
                   "bfloat16, float16)" for k in not_float]
                + [f"{name}{k} is missing" for k in missing]
                + [f"{name}{k} is not part of this model" for k in extra])
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    raise ConfigError("parameters do not match the model config: " + "; ".join(problems[:3])
                      + more + ". " + hint)
