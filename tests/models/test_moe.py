"""Mixture-of-experts layers (Qwen3-MoE): routing and experts against a NumPy reference, both
implementations, cached decoding, gradients, MTP drafting, LoRA and refused layouts.

Parity with transformers' Qwen3-MoE is in tests/models/test_hf.py (its qwen3_moe case); the
sampled-distribution test of an MoE target in tests/decoding/test_lossless_sampling.py.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from specjax.decoding import DraftTree, MTPDrafter, SamplingConfig, generate
from specjax.errors import CheckpointError, ConfigError
from specjax.models import (KVCache, LoraConfig, ModelConfig, forward, init_lora, init_params,
                            load_hf, save_hf)
from specjax.models.moe import load_balancing_loss, moe_mlp, route, routed_experts, uses_loop

MOE = ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  mlp_dim=64, qk_norm=True, family="qwen3_moe", n_experts=8,
                  experts_per_token=2, expert_dim=16, num_mtp_modules=2, max_position=64)


def _params(config=MOE, seed=0, router_scale=10.0):
  """Random parameters with a router sharp enough that the top-k choice is far from ties, and
  experts (std 0.2) whose outputs are far from zero."""
  params = init_params(config, jax.random.key(seed))
  for layer in params["layers"]:
    layer["router"] = layer["router"] * router_scale
    for name in ("experts_gate", "experts_up", "experts_down"):
      layer[name] = layer[name] * 10.0
  return params


def _reference_mlp(layer, config: ModelConfig, h: np.ndarray) -> np.ndarray:
  """The MoE MLP in float64 NumPy, every expert evaluated, weights by a sorted softmax."""
  x = h.reshape(-1, h.shape[-1]).astype(np.float64)
  logits = x @ np.asarray(layer["router"], np.float64)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.zeros_like(x)
  for a in range(x.shape[0]):
    top = np.argsort(-probs[a])[:config.experts_per_token]
    weights = probs[a, top] / (probs[a, top].sum() if config.normalize_top_k else 1.0)
    for z, w in zip(top, weights):
      gate = x[a] @ np.asarray(layer["experts_gate"][z], np.float64)
      up = x[a] @ np.asarray(layer["experts_up"][z], np.float64)
      silu = gate / (1 + np.exp(-gate))
      out[a] += w * ((silu * up) @ np.asarray(layer["experts_down"][z], np.float64))
  return out.reshape(h.shape)


@pytest.mark.parametrize("impl", ["loop", "ragged"])
@pytest.mark.parametrize("normalize", [True, False])
def test_both_implementations_match_a_reference_that_runs_every_expert(impl, normalize):
  config = MOE.replace(moe_impl=impl, normalize_top_k=normalize)
  layer = _params(config)["layers"][0]
  h = jax.random.normal(jax.random.key(1), (3, 5, config.d_model))
  got = np.asarray(moe_mlp(layer, config, h)[0])
  want = _reference_mlp(layer, config, np.asarray(h))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert np.abs(want).max() > 1e-3  # not a comparison near zero


def test_auto_runs_the_loop_on_a_cpu_and_grouped_matmuls_for_large_forwards_elsewhere():
  assert uses_loop(MOE, 1000, "cpu") and uses_loop(MOE, 4, "tpu")  # 4 x 2 pairs <= 8 experts
  assert not uses_loop(MOE, 5, "tpu") and not uses_loop(MOE, 5, "cuda")
  assert not uses_loop(MOE.replace(moe_impl="ragged"), 1, "cpu")
  # Lowered for TPU, a large forward holds the grouped matmuls; for the CPU, the loop.
  params = _params()
  tokens = jnp.zeros((2, 8), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
  lower = lambda platform: jax.jit(forward, static_argnums=1).trace(
      params, MOE, tokens, positions).lower(lowering_platforms=(platform,)).as_text()
  assert "ragged_dot" in lower("tpu") and "ragged_dot" not in lower("cpu")


def test_normalising_the_top_k_weights_changes_the_output_negative_control():
  layer = _params()["layers"][0]
  h = jax.random.normal(jax.random.key(1), (1, 4, MOE.d_model))
  a = moe_mlp(layer, MOE, h)[0]
  b = moe_mlp(layer, MOE.replace(normalize_top_k=False), h)[0]
  assert float(jnp.abs(a - b).max()) > 1e-3


def test_the_router_picks_the_top_k_of_a_float32_softmax():
  layer = _params()["layers"][0]
  x = jax.random.normal(jax.random.key(2), (6, MOE.d_model))
  logits, experts, weights = route(layer["router"], MOE, x)
  probs = jax.nn.softmax(logits, -1)
  assert experts.shape == (6, 2) and logits.dtype == jnp.float32
  np.testing.assert_array_equal(np.sort(experts, 1), np.sort(np.argsort(-probs, 1)[:, :2], 1))
  np.testing.assert_allclose(weights.sum(1), 1.0, atol=1e-6)


@pytest.mark.parametrize("impl", ["auto", pytest.param("loop", marks=pytest.mark.slow),
                                  pytest.param("ragged", marks=pytest.mark.slow)])
def test_a_cached_decode_gives_the_logits_of_a_forward_over_the_whole_sequence(impl):
  """Prefill of 9 tokens, then one token at a time, equals one uncached forward."""
  config = MOE.replace(moe_impl=impl)
  params = _params()
  tokens = jax.random.randint(jax.random.key(3), (2, 14), 0, MOE.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(14), (2, 14))
  whole = forward(params, MOE.replace(moe_impl="loop"), tokens, positions).logits
  cache = KVCache.create(config, 2, 16)
  out = forward(params, config, tokens[:, :9], positions[:, :9], cache)
  steps = [out.logits]
  cache = out.cache
  for t in range(9, 14):
    out = forward(params, config, tokens[:, t:t + 1], positions[:, t:t + 1], cache)
    steps.append(out.logits)
    cache = out.cache
  np.testing.assert_allclose(jnp.concatenate(steps, 1), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # two gradient compiles
def test_gradients_through_both_implementations_agree():
  params = _params()
  tokens = jax.random.randint(jax.random.key(4), (2, 6), 0, MOE.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(6), (2, 6))

  def loss(p, impl):
    logits = forward(p, MOE.replace(moe_impl=impl), tokens, positions).logits
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  loop, ragged = jax.grad(loss)(params, "loop"), jax.grad(loss)(params, "ragged")
  for a, b in zip(jax.tree.leaves(loop), jax.tree.leaves(ragged)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)
  experts = loop["layers"][0]["experts_gate"]
  assert float(jnp.abs(experts).max()) > 0  # the experts are trained, not only attention


def test_routed_experts_counts_the_distinct_experts_a_layer_read_for_the_live_rows():
  params = _params()
  tokens = jax.random.randint(jax.random.key(5), (4, 3), 0, MOE.vocab_size)
  out = forward(params, MOE, tokens, jnp.broadcast_to(jnp.arange(3), (4, 3)))
  logits = out.router_logits[1]  # the second layer's
  experts = np.argsort(-np.asarray(logits), axis=-1)[..., :2]  # [B, T, k]
  assert int(routed_experts(logits, MOE)) == len(np.unique(experts))
  rows = jnp.array([True, False, False, True])
  assert int(routed_experts(logits, MOE, rows)) == len(np.unique(experts[[0, 3]]))


@pytest.mark.slow  # three generate compiles; the chi-square test of MTP drafting is slow too
def test_greedy_mtp_drafting_of_an_moe_target_equals_plain_decoding():
  params = _params(router_scale=3.0)
  prompts = jax.random.randint(jax.random.key(6), (3, 8), 0, MOE.vocab_size)
  lengths = jnp.array([8, 5, 3])
  greedy = SamplingConfig(temperature=0.0)
  plain = generate(params, MOE, prompts, lengths, jax.random.key(0), max_new_tokens=20,
                   sampling=greedy)
  for tree in (DraftTree.chain(2), DraftTree.from_widths((2, 1))):
    spec = generate(params, MOE, prompts, lengths, jax.random.key(0), max_new_tokens=20,
                    sampling=greedy, drafter=MTPDrafter(), tree=tree)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    np.testing.assert_allclose(spec.logprobs, plain.logprobs, atol=1e-5)


def test_an_moe_model_with_mtp_heads_round_trips_through_save_hf_exactly(tmp_path):
  params = _params()
  save_hf(params, MOE, tmp_path)
  hf = json.loads((tmp_path / "config.json").read_text())
  assert hf["model_type"] == "qwen3_moe" and hf["num_experts"] == 8
  params2, config2 = load_hf(tmp_path)
  assert config2 == MOE
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2), strict=True):
    np.testing.assert_array_equal(a, b)


def test_lora_on_an_moe_model_adapts_the_attention_and_refuses_only_mlp_targets():
  adapters = init_lora(MOE, LoraConfig(rank=2), jax.random.key(0))
  assert set(adapters.factors["layers"][0]) == {"wq", "wk", "wv", "wo"}
  merged = adapters.merge(_params())
  assert set(merged["layers"][0]) >= {"router", "experts_gate"}
  with pytest.raises(ConfigError, match="no dense MLP"):
    init_lora(MOE, LoraConfig(rank=2, targets=("w_gate", "w_up")), jax.random.key(0))


@pytest.mark.parametrize("changes,match", [
    (dict(experts_per_token=9), r"experts_per_token=9 is invalid: must be between 1 and "
                                r"n_experts=8"),
    (dict(experts_per_token=0), r"experts_per_token=0 is invalid"),
    (dict(expert_dim=0), r"expert_dim=0 is invalid"),
    (dict(n_experts=0, experts_per_token=0, expert_dim=0), r"family='qwen3_moe' is invalid"),
    (dict(n_experts=0, experts_per_token=0), r"expert_dim=16 is invalid: a dense model "
                                             r"\(n_experts=0\) has 0"),
    (dict(family="qwen3"), r"family='qwen3' is invalid: qwen3_moe checkpoints \(and only "
                           r"they\) have experts"),
    (dict(moe_impl="dense"), r"moe_impl='dense' is invalid: one of \('auto', 'loop', "
                             r"'ragged'\)"),
])
def test_a_config_that_cannot_work_is_refused_naming_the_field(changes, match):
  with pytest.raises(ConfigError, match=match):
    MOE.replace(**changes)


@pytest.fixture(scope="module")
def saved_moe(tmp_path_factory):
  path = tmp_path_factory.mktemp("moe")
  save_hf(_params(MOE.replace(num_mtp_modules=0)), MOE.replace(num_mtp_modules=0), path)
  return path


def _copy_with(saved, tmp_path, config=None, drop=()):
  for f in saved.iterdir():
    (tmp_path / f.name).write_bytes(f.read_bytes())
  if config:
    hf = json.loads((tmp_path / "config.json").read_text()) | config
    (tmp_path / "config.json").write_text(json.dumps(hf))
  if drop:
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k not in drop},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
  return tmp_path


@pytest.mark.parametrize("config,error,match", [
    ({"num_experts_per_tok": 9}, ConfigError,
     r"num_experts_per_tok=9 is invalid: allowed 1 \.\. num_experts=8"),
    ({"mlp_only_layers": [1]}, ConfigError,
     r"mlp_only_layers=\[1\].*dense MLP layers among the sparse ones, which is unsupported"),
    ({"decoder_sparse_step": 2}, ConfigError, r"decoder_sparse_step=2 puts dense MLP layers"),
    ({"shared_expert_intermediate_size": 64}, ConfigError,
     r"shared_expert_intermediate_size=64 \(a shared expert, as in Qwen2-MoE\) is unsupported"),
    ({"num_experts": 0}, ConfigError, r"num_experts=0 is invalid for qwen3_moe"),
    ({"norm_topk_prob": "yes"}, ConfigError, r"norm_topk_prob='yes' is invalid"),
])
def test_an_moe_checkpoint_specjax_cannot_run_is_refused_when_read(saved_moe, tmp_path, config,
                                                                     error, match):
  with pytest.raises(error, match=match):
    load_hf(_copy_with(saved_moe, tmp_path, config=config))


def test_a_checkpoint_without_router_weights_is_refused_naming_them(saved_moe, tmp_path):
  path = _copy_with(saved_moe, tmp_path, drop=("model.layers.1.mlp.gate.weight",))
  with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.mlp.gate.weight' "
                                            r"\(expected shape \(8, 32\), the router of "
                                            r"model.layers.1's experts\)"):
    load_hf(path)


def test_a_checkpoint_missing_one_expert_is_refused_naming_it(saved_moe, tmp_path):
  path = _copy_with(saved_moe, tmp_path, drop=("model.layers.0.mlp.experts.5.up_proj.weight",))
  with pytest.raises(CheckpointError, match=r"missing tensor "
                                            r"'model.layers.0.mlp.experts.5.up_proj.weight'"):
    load_hf(path)


def test_the_load_balancing_loss_is_transformers_and_k_when_balanced():
  """Against transformers' own `load_balancing_loss_func` (two layers, a padding mask), and
  by hand: k for routing that spreads evenly, larger when every token picks the same."""
  import torch
  from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
  logits = [jax.random.normal(jax.random.key(i), (2, 5, 8)) * 3 for i in range(2)]
  mask = jnp.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
  want = load_balancing_loss_func(tuple(torch.tensor(np.asarray(x).reshape(10, 8))
                                        for x in logits), 8, 2, torch.tensor(np.asarray(mask)))
  np.testing.assert_allclose(load_balancing_loss(logits, MOE, mask), float(want), rtol=1e-5)
  even = jnp.tile(jnp.log(jnp.eye(8) * 0.9 + 0.1 / 8), (1, 1, 1))  # token i prefers expert i
  assert abs(float(load_balancing_loss([even], MOE)) - 2.0) < 0.3
  same = jnp.tile(jnp.array([5.0, 4.0] + [0.0] * 6), (1, 8, 1))  # all pick experts 0 and 1
  assert float(load_balancing_loss([same], MOE)) > 6.0
  with pytest.raises(ConfigError, match="needs the router logits"):
    load_balancing_loss([], MOE)
