"""HF checkpoint I/O: parity with transformers, exact round trips, and clear errors.

Reference: tiny random `transformers` models (float32, eager attention, eval mode) built
locally. Every comparison uses atol 1e-4 on logits of magnitude ~1-3.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from specjax.models import (CheckpointError, ConfigError, Llama3RopeScaling, ModelConfig,
                            config_from_hf, config_to_hf, forward, init_params, load_hf,
                            medusa_logits, save_hf)

ATOL = 1e-4
VOCAB = 128
PAD = 0
LENGTHS = (11, 6, 2)  # right-padded batch of prompts of different lengths

_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, initializer_range=0.1)
# original_max_position_embeddings=32 puts RoPE wavelengths of head_dim 32 in all three
# llama3 bands (unscaled, smoothed, divided by factor) for the positions used here.
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# name -> (HF config, save_pretrained max_shard_size)
CASES = {
    "llama3_gqa_untied_headdim32": (
        lambda: transformers.LlamaConfig(**_SMALL, num_key_value_heads=2, head_dim=32,
                                         rope_theta=500_000.0, rope_scaling=_LLAMA3_ROPE,
                                         tie_word_embeddings=False),
        None),
    "llama_mqa_tied_attention_bias_sharded": (
        lambda: transformers.LlamaConfig(**_SMALL, num_key_value_heads=1, attention_bias=True,
                                         tie_word_embeddings=True),
        "20KB"),
    "qwen2_gqa_tied": (
        lambda: transformers.Qwen2Config(**_SMALL, num_key_value_heads=2,
                                         tie_word_embeddings=True),
        None),
    "qwen3_gqa_untied_headdim32_sharded": (
        lambda: transformers.Qwen3Config(**_SMALL, num_key_value_heads=2, head_dim=32,
                                         tie_word_embeddings=False),
        "30KB"),
    "qwen3_moe_8_experts_top2_sharded": (
        lambda: transformers.Qwen3MoeConfig(**_SMALL, num_key_value_heads=2, head_dim=16,
                                            num_experts=8, num_experts_per_tok=2,
                                            moe_intermediate_size=32, norm_topk_prob=True,
                                            tie_word_embeddings=False),
        "30KB"),
}


def _tokens_and_mask() -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(0)
  t = max(LENGTHS)
  mask = np.arange(t)[None, :] < np.array(LENGTHS)[:, None]
  tokens = np.where(mask, rng.integers(1, VOCAB, (len(LENGTHS), t)), PAD)
  return tokens, mask


def _hf_logits(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
  positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  with torch.no_grad():
    out = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                position_ids=torch.tensor(positions))
  return out.logits.float().numpy()


_jit_forward = jax.jit(forward, static_argnums=1)


def _specjax_logits(params, config: ModelConfig, tokens: np.ndarray) -> np.ndarray:
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  return np.asarray(_jit_forward(params, config, jnp.asarray(tokens), positions).logits)


def _randomize(model) -> None:
  """Norm weights and biases away from their 1 / 0 init, so a wrong mapping shows."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1 + 0.2 * torch.randn_like(p))
      elif name.endswith("mlp.gate.weight"):  # a router: distinct logits, no top-k ties
        p.copy_(0.5 * torch.randn_like(p))
      elif name.endswith("o_proj.bias"):
        p.zero_()  # specjax has no output-projection bias; see test_nonzero_o_proj_bias_...
      elif name.endswith("bias"):
        p.copy_(0.2 * torch.randn_like(p))


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_case(request, tmp_path_factory):
  """A saved tiny HF model and its reference logits on the padded batch."""
  make_config, shard_size = CASES[request.param]
  transformers.set_seed(0)
  torch.manual_seed(0)
  hf_config = make_config()
  hf_config._attn_implementation = "eager"
  model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
  model.eval()
  _randomize(model)
  path = tmp_path_factory.mktemp(request.param)
  kwargs = {"max_shard_size": shard_size} if shard_size else {}
  model.save_pretrained(path, safe_serialization=True, **kwargs)
  if shard_size:
    assert (path / "model.safetensors.index.json").is_file()
  tokens, mask = _tokens_and_mask()
  return {"name": request.param, "path": path, "tokens": tokens, "mask": mask,
          "logits": _hf_logits(model, tokens, mask)}


def test_load_hf_logits_match_transformers(hf_case):
  params, config = load_hf(hf_case["path"])
  logits = _specjax_logits(params, config, hf_case["tokens"])
  valid = hf_case["mask"]
  np.testing.assert_allclose(logits[valid], hf_case["logits"][valid], atol=ATOL, rtol=0)
  assert np.abs(hf_case["logits"][valid]).max() > 1.0  # the comparison is not near zero


@pytest.mark.parametrize("hf_case", ["llama3_gqa_untied_headdim32"], indirect=True)
def test_llama3_rope_scaling_changes_logits_negative_control(hf_case):
  """Dropping the llama3 scaling must break parity, so the parity test exercises it."""
  params, config = load_hf(hf_case["path"])
  assert isinstance(config.rope_scaling, Llama3RopeScaling)
  logits = _specjax_logits(params, config.replace(rope_scaling=None), hf_case["tokens"])
  valid = hf_case["mask"]
  assert np.abs(logits[valid] - hf_case["logits"][valid]).max() > 100 * ATOL


def test_save_hf_output_loads_in_transformers_with_identical_logits(hf_case, tmp_path):
  params, config = load_hf(hf_case["path"])
  save_hf(params, config, tmp_path, max_shard_bytes=40_000)
  assert (tmp_path / "model.safetensors.index.json").is_file()  # sharded at this size
  model, info = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager", output_loading_info=True)
  assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
  model.eval()
  logits = _hf_logits(model, hf_case["tokens"], hf_case["mask"])
  valid = hf_case["mask"]
  np.testing.assert_allclose(logits[valid], hf_case["logits"][valid], atol=ATOL, rtol=0)


def _assert_trees_bitwise_equal(a, b) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def test_load_save_load_is_bitwise_exact(hf_case, tmp_path):
  params, config = load_hf(hf_case["path"])
  save_hf(params, config, tmp_path / "single")
  save_hf(params, config, tmp_path / "sharded", max_shard_bytes=10_000)
  for out in ("single", "sharded"):
    params2, config2 = load_hf(tmp_path / out)
    assert config2 == config
    _assert_trees_bitwise_equal(params2, params)


def test_bfloat16_round_trip_is_bitwise_exact_and_auto_dtype_reads_it(hf_case, tmp_path):
  params, config = load_hf(hf_case["path"], param_dtype="bfloat16")
  assert config.param_dtype == "bfloat16" and params["embed"].dtype == jnp.bfloat16
  save_hf(params, config, tmp_path)
  assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
  params2, config2 = load_hf(tmp_path, param_dtype="auto")
  assert config2 == config
  _assert_trees_bitwise_equal(params2, params)


def _draft_config() -> ModelConfig:
  return ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=16, mlp_dim=48, qkv_bias=True, family="qwen2",
                     num_mtp_modules=2, num_medusa_heads=3, medusa_layers=2)


def test_draft_heads_round_trip_exactly_and_transformers_ignores_them(tmp_path):
  config = _draft_config()
  params = init_params(config, jax.random.key(0))
  # Medusa blocks init to zero; make them non-zero so the round trip is not trivially exact.
  params["medusa"] = jax.tree.map(
      lambda x: jax.random.normal(jax.random.key(x.size), x.shape, x.dtype), params["medusa"])
  save_hf(params, config, tmp_path)
  hf = json.loads((tmp_path / "config.json").read_text())
  assert hf["specjax"] == {"num_mtp_modules": 2, "num_medusa_heads": 3, "medusa_layers": 2}
  assert (tmp_path / "specjax_heads.safetensors").is_file()
  params2, config2 = load_hf(tmp_path)
  assert config2 == config
  _assert_trees_bitwise_equal(params2, params)
  hidden = jnp.ones((1, config.d_model))
  np.testing.assert_array_equal(medusa_logits(params2, config2, hidden),
                                medusa_logits(params, config, hidden))

  model, info = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager", output_loading_info=True)
  assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
  tokens, mask = _tokens_and_mask()
  valid = mask
  np.testing.assert_allclose(_hf_logits(model.eval(), tokens, mask)[valid],
                             _specjax_logits(params, config, tokens)[valid], atol=ATOL, rtol=0)


def test_config_to_hf_then_config_from_hf_is_identity():
  configs = [
      _draft_config(),
      ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=4, head_dim=8,
                  mlp_dim=64, rope_theta=500_000.0, tie_embeddings=True, max_position=4096,
                  rope_scaling=Llama3RopeScaling(factor=32.0, original_max_position=8192),
                  family="llama", param_dtype="bfloat16", dtype="bfloat16"),
      ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=1, head_dim=16,
                  mlp_dim=64, qk_norm=True, rms_norm_eps=1e-5, family="qwen3"),
      ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  mlp_dim=64, qk_norm=True, family="qwen3_moe", n_experts=16,
                  experts_per_token=4, expert_dim=8, normalize_top_k=False,
                  num_mtp_modules=1),
  ]
  for config in configs:
    hf = config_to_hf(config)
    assert hf["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                    "qwen3": "Qwen3ForCausalLM",
                                    "qwen3_moe": "Qwen3MoeForCausalLM"}[config.family]]
    assert config_from_hf(hf, param_dtype="auto", dtype=config.dtype) == config


def test_transformers_v4_config_spelling_reads_like_v5():
  v5 = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "dtype": "bfloat16",
        "rope_parameters": dict(_LLAMA3_ROPE, rope_theta=500_000.0)}
  v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "dtype")}
  v4 |= {"torch_dtype": "bfloat16", "rope_theta": 500_000,
         "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}
  assert config_from_hf(v4, param_dtype="auto") == config_from_hf(v5, param_dtype="auto")
  config = config_from_hf(v4, param_dtype="auto")
  assert config.head_dim == 8  # hidden_size / num_attention_heads when head_dim is absent
  assert config.param_dtype == "bfloat16" and config.rope_theta == 500_000.0


# --- errors ------------------------------------------------------------------------------------


@pytest.fixture
def saved_llama(tmp_path):
  config = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=8, mlp_dim=48, family="llama")
  save_hf(init_params(config, jax.random.key(1)), config, tmp_path)
  return tmp_path


def _edit_config(path, **changes) -> None:
  file = path / "config.json"
  hf = json.loads(file.read_text())
  hf |= changes
  file.write_text(json.dumps(hf))


def _edit_tensors(path, edit) -> None:
  file = path / "model.safetensors"
  tensors = load_file(file)
  edit(tensors)
  save_file(tensors, file, metadata={"format": "pt"})


def test_unknown_architecture_error_names_it_and_lists_allowed(saved_llama):
  _edit_config(saved_llama, architectures=["MistralForCausalLM"], model_type="mistral")
  with pytest.raises(ConfigError, match="MistralForCausalLM") as err:
    load_hf(saved_llama)
  for allowed in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
    assert allowed in str(err.value)


def test_missing_tensor_error_names_it(saved_llama):
  _edit_tensors(saved_llama, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj"):
    load_hf(saved_llama)


def test_untied_checkpoint_without_lm_head_is_a_missing_tensor(saved_llama):
  _edit_tensors(saved_llama, lambda t: t.pop("lm_head.weight"))
  with pytest.raises(CheckpointError, match="missing tensor 'lm_head.weight'"):
    load_hf(saved_llama)


def test_wrong_shape_error_names_tensor_got_and_expected(saved_llama):
  def edit(t):
    t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
  _edit_tensors(saved_llama, edit)
  with pytest.raises(CheckpointError,
                     match=r"'model\.layers\.0\.self_attn\.k_proj\.weight'.*\(8, 32\).*"
                           r"expected \(16, 32\)"):
    load_hf(saved_llama)


def test_unexpected_tensor_error_names_it(saved_llama):
  def edit(t):
    t["model.layers.2.mlp.up_proj.weight"] = np.zeros((48, 32), np.float32)
  _edit_tensors(saved_llama, edit)
  with pytest.raises(CheckpointError, match=r"unexpected tensors.*model\.layers\.2"):
    load_hf(saved_llama)


@pytest.mark.parametrize("rope_type", ["yarn", "linear", "dynamic"])
def test_unsupported_rope_type_error_names_it_and_allowed(saved_llama, rope_type):
  _edit_config(saved_llama, rope_scaling=None,
               rope_parameters={"rope_type": rope_type, "factor": 4.0, "rope_theta": 1e4})
  with pytest.raises(ConfigError, match=f"'{rope_type}'.*allowed.*'llama3'"):
    load_hf(saved_llama)


def test_a_config_json_that_names_a_key_twice_is_refused_naming_the_file_and_key(saved_llama):
  file = saved_llama / "config.json"
  text = file.read_text()
  file.write_text(text.replace('"num_hidden_layers":', '"num_hidden_layers": 9, '
                                                       '"num_hidden_layers":', 1))
  with pytest.raises(CheckpointError, match=re.escape(f"{file}: an object names the key "
                                                      "'num_hidden_layers' twice")):
    load_hf(saved_llama)


def test_missing_config_json_error_names_it(saved_llama):
  (saved_llama / "config.json").unlink()
  with pytest.raises(CheckpointError, match="missing config.json"):
    load_hf(saved_llama)


def test_missing_weights_file_error_names_it(saved_llama):
  (saved_llama / "model.safetensors").unlink()
  with pytest.raises(CheckpointError, match="no model.safetensors"):
    load_hf(saved_llama)


def test_nonzero_o_proj_bias_is_rejected(saved_llama):
  def edit(t):
    t["model.layers.0.self_attn.o_proj.bias"] = np.ones((32,), np.float32)
  _edit_config(saved_llama, attention_bias=True)
  _edit_tensors(saved_llama, edit)
  with pytest.raises(ConfigError, match=r"o_proj\.bias.*non-zero"):
    load_hf(saved_llama)


@pytest.mark.parametrize("changes", [
    {"hidden_act": "gelu"}, {"mlp_bias": True},
    {"layer_types": ["full_attention", "sliding_attention"]},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                         "partial_rotary_factor": 0.5}},
], ids=lambda c: next(iter(c)))
def test_unsupported_option_error_names_field(saved_llama, changes):
  _edit_config(saved_llama, **changes)
  field = "partial_rotary_factor" if "rope_parameters" in changes else next(iter(changes))
  with pytest.raises(ConfigError, match=field):
    load_hf(saved_llama)


def test_tied_checkpoint_with_stored_lm_head_loads(tmp_path):
  """transformers ties lm_head to the embedding when tie_word_embeddings is set; so do we."""
  config = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                       head_dim=8, mlp_dim=48, tie_embeddings=True, family="llama")
  params = init_params(config, jax.random.key(2))
  save_hf(params, config, tmp_path)
  _edit_tensors(tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}))
  params2, config2 = load_hf(tmp_path)
  assert config2 == config and "unembed" not in params2
  _assert_trees_bitwise_equal(params2, params)


def test_save_hf_rejects_params_that_do_not_match_config(tmp_path):
  config = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                       head_dim=8, mlp_dim=48, family="llama")
  params = init_params(config, jax.random.key(3))
  with pytest.raises(ConfigError, match=r"params layers/0/wq has shape \(32, 4, 8\), expected "
                                        r"\(32, 8, 8\)"):
    save_hf(params, config.replace(n_heads=8, n_kv_heads=2), tmp_path)
  del params["unembed"]
  with pytest.raises(ConfigError, match="params is missing unembed"):
    save_hf(params, config, tmp_path)


def test_resave_over_sharded_checkpoint_removes_stale_shards(tmp_path):
  config = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=8, mlp_dim=48, family="llama")
  params = init_params(config, jax.random.key(4))
  save_hf(params, config, tmp_path, max_shard_bytes=10_000)
  assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
  save_hf(params, config, tmp_path)
  assert not list(tmp_path.glob("model-*-of-*.safetensors"))
  assert not (tmp_path / "model.safetensors.index.json").exists()
  _assert_trees_bitwise_equal(load_hf(tmp_path)[0], params)
