"""LoRA adapters (`specjax.models.lora`): the factored forward is the merged model's, the
adapters start as the base model, and their gradients are those of the merged weights."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from specjax import sharding
from specjax.errors import ConfigError
from specjax.models import ModelConfig, forward, init_params
from specjax.models.lora import ADAPTABLE, LoraConfig, init_lora, lora_axes

MODEL = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    mlp_dim=48, family="qwen3", qk_norm=True, max_position=64)
PARAMS = init_params(MODEL, jax.random.key(0))
TOKENS = jax.random.randint(jax.random.key(1), (3, 9), 0, 64)
POSITIONS = jnp.broadcast_to(jnp.arange(9), (3, 9))


def _logits(params):
  return forward(params, MODEL, TOKENS, POSITIONS).logits


def _trained(adapters, seed=2):
  """`adapters` with every factor moved off its initial value (B off zero)."""
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape)
                                   for x, k in zip(leaves, keys)])


def test_fresh_adapters_are_the_base_model_exactly():
  adapters = init_lora(MODEL, LoraConfig(rank=4), jax.random.key(3))
  base = _logits(PARAMS)
  np.testing.assert_array_equal(_logits(adapters.attach(PARAMS)), base)
  np.testing.assert_array_equal(_logits(adapters.merge(PARAMS)), base)
  # B is zero, A is not: the first gradients reach B.
  layer = adapters.factors["layers"][0]["wq"]
  assert not np.any(layer["b"]) and np.all(np.std(np.asarray(layer["a"])) > 0)


@pytest.mark.parametrize("targets", [tuple(ADAPTABLE), ("wq", "wv"), ("wo",), ("w_down",)])
def test_the_factored_forward_is_the_merged_models(targets):
  adapters = _trained(init_lora(MODEL, LoraConfig(rank=4, alpha=8.0, targets=targets),
                                jax.random.key(3)))
  factored, merged = _logits(adapters.attach(PARAMS)), _logits(adapters.merge(PARAMS))
  assert np.abs(factored - _logits(PARAMS)).max() > 1e-2  # the adapters change the model
  np.testing.assert_allclose(factored, merged, rtol=0, atol=2e-5)
  # Merging touches the adapted projections and nothing else.
  merged_params = adapters.merge(PARAMS)
  for i, layer in enumerate(merged_params["layers"]):
    for name, w in layer.items():
      same = np.array_equal(w, PARAMS["layers"][i][name])
      assert same == (name not in targets), (i, name)
  assert merged_params["embed"] is PARAMS["embed"]


def test_merge_scales_the_product_by_alpha_over_rank():
  adapters = _trained(init_lora(MODEL, LoraConfig(rank=2, alpha=6.0, targets=("w_up",)),
                                jax.random.key(3)))
  f = adapters.factors["layers"][1]["w_up"]
  want = PARAMS["layers"][1]["w_up"] + 3.0 * np.asarray(f["a"]) @ np.asarray(f["b"])
  np.testing.assert_allclose(adapters.merge(PARAMS)["layers"][1]["w_up"], want, atol=1e-6)


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_gradients_of_the_factored_forward_are_those_through_the_merged_weights():
  adapters = _trained(init_lora(MODEL, LoraConfig(rank=3), jax.random.key(3)))
  weights = jnp.linspace(-1.0, 1.0, 64)

  def loss(ad, factored):
    params = ad.attach(PARAMS) if factored else ad.merge(PARAMS)
    return (jax.nn.log_softmax(_logits(params)) * weights).sum()

  factored = jax.grad(loss)(adapters, True)
  merged = jax.grad(loss)(adapters, False)
  for a, b in zip(jax.tree.leaves(factored), jax.tree.leaves(merged)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
  assert all(np.any(g) for g in jax.tree.leaves(factored))


def test_bfloat16_trunk_with_float32_adapters():
  model = dataclasses.replace(MODEL, dtype="bfloat16", param_dtype="bfloat16")
  params = init_params(model, jax.random.key(0))
  adapters = _trained(init_lora(model, LoraConfig(rank=4), jax.random.key(3)))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(adapters))
  merged = adapters.merge(params)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(merged))
  out = forward(adapters.attach(params), model, TOKENS, POSITIONS).logits
  ref = forward(merged, model, TOKENS, POSITIONS).logits
  assert np.all(np.isfinite(out))
  np.testing.assert_allclose(out, ref, atol=0.1)  # bf16 rounding of the merged weights


def test_adapters_shard_as_their_projections():
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  config = LoraConfig(rank=4)
  adapters = init_lora(MODEL, config, jax.random.key(3))
  shardings = jax.tree.map(lambda x, a: sharding.logical_sharding(a, mesh, x.shape),
                           adapters.factors, lora_axes(MODEL, config),
                           is_leaf=lambda x: isinstance(x, P))
  placed = jax.device_put(adapters.factors, shardings)
  wq = placed["layers"][0]["wq"]
  weight = sharding.param_shardings(MODEL, mesh)["layers"][0]["wq"].spec
  assert wq["a"].sharding.spec[:1] == weight[:1] and wq["a"].sharding.spec[-1] is None
  assert wq["b"].sharding.spec[0] is None and wq["b"].sharding.spec[1:] == weight[1:]
  attached = adapters.replace(factors=placed).attach(PARAMS)
  np.testing.assert_allclose(_logits(attached), _logits(PARAMS), atol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    ({"rank": -1}, "lora.rank=-1 is invalid"),
    ({"rank": 2.5}, "lora.rank=2.5 is invalid"),
    ({"rank": True}, "lora.rank=True is invalid"),
    ({"rank": 4, "alpha": 0}, "lora.alpha=0 is invalid"),
    ({"rank": 4, "alpha": float("nan")}, "lora.alpha=nan is invalid"),
    ({"rank": 4, "targets": ("q_proj",)}, "'q_proj' unknown"),
    ({"rank": 4, "targets": ("wq", "wq")}, "must be distinct names"),
    ({"rank": 4, "targets": ()}, "lora.targets=() is invalid"),
])
def test_bad_lora_configs_are_named(kwargs, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
    LoraConfig(**kwargs)


def test_a_single_target_may_be_named_as_a_string():
  assert LoraConfig(rank=2, targets="wv").targets == ("wv",)
  assert not LoraConfig().enabled
