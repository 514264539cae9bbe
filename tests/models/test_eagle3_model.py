"""EAGLE-3 draft model: the midlayer against a float64 NumPy reference written from the public
layout, cache consistency, training-time test against the inference chain, a training smoke
run, the draft vocabulary, and checkpoint I/O in the vLLM / SGLang layout."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import save_file

from specjax.models import (CheckpointError, ConfigError, Eagle3Config, ModelConfig,
                            build_draft_vocab, count_tokens, default_aux_layers, eagle3_cache,
                            eagle3_draft_logits, eagle3_layer, eagle3_param_axes,
                            eagle3_ttt_logits, eagle3_ttt_loss, forward, fuse, init_eagle3,
                            init_params, load_eagle3, save_eagle3, select_aux,
                            to_target_vocab)
from specjax.models import eagle3_io
from specjax.models.transformer import run_blocks

TARGET = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                     head_dim=8, mlp_dim=64, max_position=128, rope_theta=500.0)
W = 48

# Jitted once per shape: op-by-op dispatch of these small graphs costs more than compiling.
_layer = jax.jit(eagle3_layer, static_argnums=1)
_ttt_logits = jax.jit(eagle3_ttt_logits, static_argnums=(1, 5))
_ttt_loss = jax.jit(eagle3_ttt_loss, static_argnums=(1, 8))
_draft_logits = jax.jit(eagle3_draft_logits, static_argnums=1)


def _config(**changes) -> Eagle3Config:
  return Eagle3Config.for_target(TARGET, draft_vocab_size=W, mlp_dim=48).replace(**changes)


def _random_params(config: Eagle3Config, seed: int) -> dict:
  """Parameters large enough that attention is far from uniform, norms far from one."""
  params = init_eagle3(config, jax.random.key(seed))
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
  out = []
  for leaf, key in zip(leaves, keys):
    noise = jax.random.normal(key, leaf.shape)
    out.append(1.0 + 0.3 * noise if leaf.ndim == 1 else 0.25 * noise)
  return jax.tree.unflatten(treedef, out)


def _d2t(seed: int = 0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  return np.sort(rng.choice(TARGET.vocab_size, W, replace=False)).astype(np.int32)


def _to_hf(params: dict, config: Eagle3Config) -> dict[str, np.ndarray]:
  """The documented public layout, written out independently of `eagle3_io`."""
  d, nh, kh = config.d_model, config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
  p, l = jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, params["layer"])
  return {
      "fc.weight": p["fc"].T,
      "midlayer.hidden_norm.weight": l["hidden_norm"],
      "midlayer.input_layernorm.weight": l["input_norm"],
      "midlayer.self_attn.q_proj.weight": l["wq"].reshape(2 * d, nh).T,
      "midlayer.self_attn.k_proj.weight": l["wk"].reshape(2 * d, kh).T,
      "midlayer.self_attn.v_proj.weight": l["wv"].reshape(2 * d, kh).T,
      "midlayer.self_attn.o_proj.weight": l["wo"].reshape(nh, d).T,
      "midlayer.post_attention_layernorm.weight": l["mlp_norm"],
      "midlayer.mlp.gate_proj.weight": l["w_gate"].T,
      "midlayer.mlp.up_proj.weight": l["w_up"].T,
      "midlayer.mlp.down_proj.weight": l["w_down"].T,
      "norm.weight": p["norm"],
      "lm_head.weight": p["lm_head"].T,
  }


# ---------------------------------------------------------------------------------------------
# Slow float64 reference of the EAGLE-3 draft, on HF-layout tensors (Linear: y = x W^T).


def _rms(x, w, eps):
  return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope(x, positions, theta):
  h = x.shape[-1]
  inv = 1.0 / theta ** (np.arange(0, h, 2) / h)
  ang = positions[..., None] * inv  # [B, T, H/2]
  cos = np.cos(np.concatenate([ang, ang], -1))[:, :, None, :]
  sin = np.sin(np.concatenate([ang, ang], -1))[:, :, None, :]
  rot = np.concatenate([-x[..., h // 2:], x[..., :h // 2]], -1)
  return x * cos + rot * sin


def _ref_fuse(hf, aux):
  return np.concatenate([np.asarray(a, np.float64) for a in aux], -1) @ hf["fc.weight"].T


def _ref_midlayer(hf, c, emb, hidden, positions, mask):
  """Output stream of the midlayer; queries see keys (of the same T tokens) where mask."""
  hf = {k: np.asarray(v, np.float64) for k, v in hf.items()}
  emb, hidden = np.asarray(emb, np.float64), np.asarray(hidden, np.float64)
  b, t, _ = hidden.shape
  eps = c.rms_norm_eps
  x = np.concatenate([_rms(emb, hf["midlayer.input_layernorm.weight"], eps),
                      _rms(hidden, hf["midlayer.hidden_norm.weight"], eps)], -1)
  q = (x @ hf["midlayer.self_attn.q_proj.weight"].T).reshape(b, t, c.n_heads, c.head_dim)
  k = (x @ hf["midlayer.self_attn.k_proj.weight"].T).reshape(b, t, c.n_kv_heads, c.head_dim)
  v = (x @ hf["midlayer.self_attn.v_proj.weight"].T).reshape(b, t, c.n_kv_heads, c.head_dim)
  pos = np.asarray(positions, np.float64)
  q, k = _rope(q, pos, c.rope_theta), _rope(k, pos, c.rope_theta)
  out = np.zeros((b, t, c.n_heads, c.head_dim))
  for n in range(c.n_heads):
    kv_head = n // (c.n_heads // c.n_kv_heads)
    scores = np.einsum("bth,bsh->bts", q[:, :, n], k[:, :, kv_head]) / np.sqrt(c.head_dim)
    scores = np.where(np.asarray(mask), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out[:, :, n] = np.einsum("bts,bsh->bth", probs, v[:, :, kv_head])
  x1 = hidden + out.reshape(b, t, -1) @ hf["midlayer.self_attn.o_proj.weight"].T
  h = _rms(x1, hf["midlayer.post_attention_layernorm.weight"], eps)
  gate = h @ hf["midlayer.mlp.gate_proj.weight"].T
  up = h @ hf["midlayer.mlp.up_proj.weight"].T
  return x1 + (gate / (1 + np.exp(-gate)) * up) @ hf["midlayer.mlp.down_proj.weight"].T


def _ref_logits(hf, c, stream):
  return _rms(np.asarray(stream, np.float64), hf["norm.weight"], c.rms_norm_eps) @ np.asarray(
      hf["lm_head.weight"], np.float64).T


def _inputs(b, t, seed):
  keys = jax.random.split(jax.random.key(seed), 3)
  emb = jax.random.normal(keys[0], (b, t, TARGET.d_model))
  hidden = 2.0 * jax.random.normal(keys[1], (b, t, TARGET.d_model))
  positions = jnp.arange(t)[None, :] + jnp.array([[0], [5]])[:b]
  return emb, hidden, positions


# ---------------------------------------------------------------------------------------------
# Model


def test_fuse_layer_and_logits_match_float64_numpy_reference():
  config = _config()
  params = _random_params(config, 0)
  hf = _to_hf(params, config)
  emb, hidden, positions = _inputs(2, 7, 1)
  # An arbitrary (tree-like, non-causal) visibility pattern with the diagonal always visible.
  mask = jax.random.bernoulli(jax.random.key(2), 0.5, (2, 7, 7)) | jnp.eye(7, dtype=bool)
  out, kv = _layer(params, config, emb, hidden, positions, mask=mask)
  assert kv is None
  want = _ref_midlayer(hf, config, emb, hidden, positions, mask)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(_draft_logits(params, config, out),
                             _ref_logits(hf, config, want), rtol=1e-5, atol=1e-5)
  aux = [jax.random.normal(k, (2, 7, 32)) for k in jax.random.split(jax.random.key(3), 3)]
  np.testing.assert_allclose(fuse(params, config, aux), _ref_fuse(hf, aux), rtol=1e-5,
                             atol=1e-5)


def test_cached_token_by_token_decoding_equals_one_causal_pass():
  config = _config()
  params = _random_params(config, 4)
  b, t, s = 2, 8, 12
  emb, hidden, positions = _inputs(b, t, 5)
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  want, _ = _layer(params, config, emb, hidden, positions, mask=causal)

  cache = eagle3_cache(config, b, s)
  kv = (cache.keys[0], cache.values[0])
  slot = jnp.arange(s)
  # The first three tokens in one call, then one token per call, each into explicit slots.
  chunks = [(0, 3)] + [(i, i + 1) for i in range(3, t)]
  got = []
  for lo, hi in chunks:
    slots = jnp.broadcast_to(jnp.arange(lo, hi), (b, hi - lo))
    mask = slot[None, None, :] <= slots[:, :, None]
    out, kv = _layer(params, config, emb[:, lo:hi], hidden[:, lo:hi], positions[:, lo:hi],
                     mask=mask, kv=kv, slots=slots)
    got.append(out)
  np.testing.assert_allclose(jnp.concatenate(got, axis=1), want, rtol=1e-5, atol=1e-5)

  # Out-of-range slots are dropped: row 1 writes to slot S, so its buffers stay unchanged.
  slots = jnp.array([[t], [s]])
  mask = slot[None, None, :] <= jnp.array([[t], [t - 1]])[:, :, None]
  _, kv2 = _layer(params, config, emb[:, :1], hidden[:, :1], positions[:, :1], mask=mask,
                  kv=kv, slots=slots)
  np.testing.assert_array_equal(kv2[0][1], kv[0][1])
  assert not np.array_equal(kv2[0][0, :, t], kv[0][0, :, t])


def test_ttt_step_logits_equal_inference_chain_with_cache():
  """Step j at position p must be exactly what the drafter computes at depth j + 1 for the
  root at p - j + 1: committed target features up to r - 1, then its own chain."""
  config = _config()
  params = _random_params(config, 6)
  target_params = init_params(TARGET, jax.random.key(7))
  b, t, steps = 2, 12, 4
  tokens = jax.random.randint(jax.random.key(8), (b, t), 0, TARGET.vocab_size)
  aux = [jax.random.normal(k, (b, t, 32)) for k in jax.random.split(jax.random.key(9), 3)]
  ttt = _ttt_logits(params, config, target_params["embed"], tokens, aux, steps)
  assert ttt.shape == (steps, b, t, W)

  ahead = jnp.take(target_params["embed"], jnp.pad(tokens[:, 1:], ((0, 0), (0, 1))), axis=0)
  features = fuse(params, config, aux)
  slot = jnp.arange(t)

  def step(emb, hidden, p, kv):  # one position p into slot p, seeing slots <= p
    pos = jnp.full((b, 1), p)
    return _layer(params, config, emb, hidden, pos, mask=slot[None, None, :] <= p, kv=kv,
                  slots=pos)

  for root in (1, 4, 9):
    cache = eagle3_cache(config, b, t)
    kv = (cache.keys[0], cache.values[0])
    for p in range(root):  # commit positions <= root - 1 with target features
      h, kv = step(ahead[:, p:p + 1], features[:, p:p + 1], p, kv)
    for j in range(steps):  # depth j + 1 runs at root + j - 1 on the chain's own output
      p = root + j - 1
      if p >= t:
        break
      if j:
        h, kv = step(ahead[:, p:p + 1], h, p, kv)
      np.testing.assert_allclose(ttt[j, :, p], _draft_logits(params, config, h[:, 0]),
                                 rtol=1e-5, atol=1e-5, err_msg=f"root={root} step={j}")


def test_ttt_loss_equals_hand_computed_soft_and_hard_cross_entropy():
  """Soft: target's distribution for tokens[p + 2] (at p + 1) restricted to the draft vocab and
  renormalised. Hard: tokens[p + 2], skipped when outside the draft vocab. Masked means."""
  config = _config()
  params = _random_params(config, 10)
  embed_table = jax.random.normal(jax.random.key(11), (TARGET.vocab_size, 32))
  b, t, steps = 2, 9, 3
  tokens = jax.random.randint(jax.random.key(12), (b, t), 0, TARGET.vocab_size)
  aux = [jax.random.normal(k, (b, t, 32)) for k in jax.random.split(jax.random.key(13), 3)]
  target_logprobs = jax.nn.log_softmax(
      3 * jax.random.normal(jax.random.key(14), (b, t, TARGET.vocab_size)))
  loss_mask = jnp.ones((b, t)).at[0, 5].set(0)
  d2t = _d2t()
  logits = np.asarray(_ttt_logits(params, config, embed_table, tokens, aux, steps), np.float64)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  soft = np.exp(np.asarray(target_logprobs, np.float64))[..., d2t]
  soft /= soft.sum(-1, keepdims=True)
  tok, mask_np, target_np = map(np.asarray, (tokens, loss_mask, target_logprobs))
  counted = lambda j: [(bb, p) for bb in range(b) for p in range(t)
                       if p - j >= 0 and p + 2 < t and mask_np[bb, p + 2]]
  for target, decay in ((target_logprobs, 0.5), (None, 1.0)):
    loss, metrics = _ttt_loss(params, config, embed_table, tokens, aux, target, loss_mask,
                              jnp.asarray(d2t), steps, step_decay=decay)
    ces, accs = [], []
    for j in range(steps):
      if target is None:
        terms = [-logp[j, bb, p, list(d2t).index(tok[bb, p + 2])] for bb, p in counted(j)
                 if tok[bb, p + 2] in d2t]
        labels = [tok[bb, p + 2] for bb, p in counted(j)]
      else:
        terms = [-(soft[bb, p + 1] * logp[j, bb, p]).sum() for bb, p in counted(j)]
        labels = [np.argmax(target_np[bb, p + 1]) for bb, p in counted(j)]
      preds = [d2t[np.argmax(logits[j, bb, p])] for bb, p in counted(j)]
      assert metrics["count"][j] == len(terms) > 0
      ces.append(np.mean(terms))
      accs.append(np.mean(np.equal(preds, labels)))
    np.testing.assert_allclose(metrics["ce"], ces, rtol=1e-5)
    np.testing.assert_allclose(metrics["accuracy"], accs, rtol=1e-6)
    weights = decay ** np.arange(steps)
    np.testing.assert_allclose(loss, np.dot(weights, ces) / weights.sum(), rtol=1e-5)


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_ttt_training_raises_draft_accuracy_on_target_features():
  """A few hundred Adam steps on a tiny random target's features over arithmetic progressions
  (each token predictable from the previous two). Negative control: accuracy before training."""
  target = TARGET.replace(n_layers=2)
  config = Eagle3Config.for_target(target, draft_vocab_size=40, mlp_dim=64)
  assert config.aux_layers == (1, 1, 1)
  target_params = init_params(target, jax.random.key(0))
  rng = np.random.default_rng(0)
  b, t, steps = 16, 16, 2

  def batch():
    start, step = rng.integers(0, 40, (b, 1)), rng.integers(1, 4, (b, 1))
    return jnp.asarray((start + step * np.arange(t)) % 40)

  d2t = jnp.asarray(build_draft_vocab(count_tokens(np.asarray(batch()), None, 64), 40))
  np.testing.assert_array_equal(d2t, np.arange(40))
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  optimizer = optax.adam(1e-2)

  @jax.jit
  def train_step(params, opt_state, tokens):
    out = forward(target_params, target, tokens, positions, hidden_layers=config.hidden_layers,
                  compute_logits=False)
    aux = select_aux(config, out.intermediates)

    def loss_fn(p):
      return eagle3_ttt_loss(p, config, target_params["embed"], tokens, aux, None,
                             jnp.ones((b, t)), d2t, steps)

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, metrics

  params = init_eagle3(config, jax.random.key(1))
  opt_state = optimizer.init(params)
  _, _, before = train_step(params, opt_state, batch())
  for _ in range(150):
    params, opt_state, metrics = train_step(params, opt_state, batch())
  assert before["accuracy"][0] < 0.2
  assert metrics["accuracy"][0] > 0.9, metrics
  assert metrics["accuracy"][1] > 0.8, metrics
  assert metrics["ce"][0] < before["ce"][0] / 4


def test_aux_layer_ids_are_inputs_of_target_layers():
  """vLLM's id i is the residual stream entering target layer i (output of layer i - 1)."""
  params = init_params(TARGET, jax.random.key(0))
  config = Eagle3Config.for_target(TARGET)
  assert config.aux_layers == (1, 2, 3) and config.hidden_layers == (0, 1, 2)
  tokens = jax.random.randint(jax.random.key(1), (2, 5), 0, 64)
  positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
  out = forward(params, TARGET, tokens, positions, hidden_layers=config.hidden_layers)
  x = jnp.take(params["embed"], tokens, axis=0)
  for layer_id, stream in zip(config.aux_layers, select_aux(config, out.intermediates)):
    want, _, _, _ = run_blocks(params["layers"][:layer_id], TARGET, x, positions, None, None)
    np.testing.assert_array_equal(stream, want)


def test_default_aux_layers_follow_vllm_and_fall_back_for_tiny_targets():
  assert default_aux_layers(32) == (2, 16, 29)
  assert default_aux_layers(7) == (2, 3, 4)
  assert default_aux_layers(6) == (1, 3, 5)
  assert default_aux_layers(4) == (1, 2, 3)
  assert default_aux_layers(3) == (1, 1, 2)
  assert default_aux_layers(2) == (1, 1, 1)
  with pytest.raises(ConfigError, match="n_target_layers=1"):
    default_aux_layers(1)


def test_config_errors_name_the_field_and_what_is_allowed():
  with pytest.raises(ConfigError, match=r"draft_vocab_size=65 is invalid: must be in 1..vocab"):
    _config(draft_vocab_size=65)
  with pytest.raises(ConfigError, match=r"aux_layers=\(3, 2, 1\) is invalid: must be non-dec"):
    _config(aux_layers=(3, 2, 1))
  with pytest.raises(ConfigError, match=r"aux_layers=\(0, 1, 2\)"):
    _config(aux_layers=(0, 1, 2))
  with pytest.raises(ConfigError, match="n_kv_heads=3 is invalid"):
    _config(n_kv_heads=3)
  with pytest.raises(ConfigError, match=(r"aux_layers=\(2, 16, 29\) is invalid for a 4-layer "
                                         r"target: each must be in 1..3")):
    _config(aux_layers=(2, 16, 29)).check_target(TARGET)
  with pytest.raises(ConfigError, match="d_model=64 is invalid for a target with d_model=32"):
    _config(d_model=64).check_target(TARGET)
  assert _config(aux_layers=[1, 2, 3]).aux_layers == (1, 2, 3)  # JSON lists stay hashable
  hash(_config())


def test_param_axes_name_every_param_dimension():
  config = _config()
  params = init_eagle3(config, jax.random.key(0))
  axes = eagle3_param_axes(config)
  is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
  assert jax.tree.structure(params) == jax.tree.structure(axes, is_leaf=is_spec)
  for leaf, spec in zip(jax.tree.leaves(params), jax.tree.leaves(axes, is_leaf=is_spec)):
    assert leaf.ndim == len(spec) and leaf.dtype == jnp.float32


# ---------------------------------------------------------------------------------------------
# Draft vocabulary


def test_to_target_vocab_puts_exactly_zero_probability_outside_draft_vocab():
  d2t = _d2t(1)
  logits = 5 * jax.random.normal(jax.random.key(0), (3, W))
  full = to_target_vocab(logits, jnp.asarray(d2t), TARGET.vocab_size)
  probs = np.asarray(jnp.exp(jax.nn.log_softmax(full, axis=-1)))
  outside = np.setdiff1d(np.arange(TARGET.vocab_size), d2t)
  assert np.all(probs[:, outside] == 0.0)
  np.testing.assert_allclose(probs[:, d2t], jax.nn.softmax(logits, axis=-1), rtol=1e-6)


def test_build_draft_vocab_keeps_most_frequent_ids_ties_to_lower_id():
  counts = np.array([5, 1, 5, 0, 7, 1])
  np.testing.assert_array_equal(build_draft_vocab(counts, 3), [0, 2, 4])
  np.testing.assert_array_equal(build_draft_vocab(counts, 4), [0, 1, 2, 4])
  np.testing.assert_array_equal(build_draft_vocab(counts, 6), np.arange(6))
  assert build_draft_vocab(counts, 3).dtype == np.int32
  for bad in (0, 7):
    with pytest.raises(ConfigError, match=f"draft_vocab_size={bad} is invalid: must be in 1..6"):
      build_draft_vocab(counts, bad)
  tokens = np.array([[4, 4, 2, 9], [0, 4, 1, 1]])
  mask = np.array([[1, 1, 1, 0], [0, 1, 1, 1]])
  np.testing.assert_array_equal(count_tokens(tokens, mask, 6), [0, 2, 1, 0, 3, 0])
  with pytest.raises(ConfigError, match=r"allowed 0..5"):
    count_tokens(tokens, None, 6)


# ---------------------------------------------------------------------------------------------
# Checkpoints


def test_save_load_round_trip_is_bit_exact_in_float32_and_bfloat16(tmp_path):
  config = _config(rope_theta=123.0)
  params = _random_params(config, 20)
  d2t = _d2t(2)
  save_eagle3(tmp_path / "f32", params, config, d2t)
  loaded_config, loaded, loaded_d2t = load_eagle3(tmp_path / "f32", TARGET)
  assert loaded_config == config
  jax.tree.map(np.testing.assert_array_equal, loaded, params)
  np.testing.assert_array_equal(loaded_d2t, d2t)
  assert loaded_d2t.dtype == jnp.int32

  save_eagle3(tmp_path / "bf16", params, config, d2t, dtype="bfloat16")
  loaded_config, loaded, _ = load_eagle3(tmp_path / "bf16", TARGET)
  assert loaded_config == config.replace(dtype="bfloat16", param_dtype="bfloat16")
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b.astype(jnp.bfloat16)), loaded,
               params)
  assert jax.tree.leaves(loaded)[0].dtype == jnp.bfloat16

  hf = json.loads((tmp_path / "f32" / "config.json").read_text())
  assert hf["architectures"] == ["LlamaForCausalLMEagle3"]
  assert hf["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
  assert (hf["num_hidden_layers"], hf["draft_vocab_size"], hf["vocab_size"]) == (1, W, 64)
  assert hf["tie_word_embeddings"] is False and hf["torch_dtype"] == "float32"
  from safetensors import safe_open
  with safe_open(tmp_path / "f32" / "model.safetensors", framework="np") as f:
    stored = {name: f.get_tensor(name) for name in f.keys()}
  assert stored["d2t"].dtype == np.int64 and stored["t2d"].dtype == np.bool_
  np.testing.assert_array_equal(stored["d2t"] + np.arange(W), d2t)
  assert stored["t2d"].sum() == W and stored["t2d"][d2t].all()
  for name, want in _to_hf(params, config).items():
    np.testing.assert_array_equal(stored[name], want, err_msg=name)


def _hand_checkpoint(path, config: Eagle3Config, seed: int, *, aux=(1, 2, 3), drop=(),
                     extra=None, hf_changes=None):
  """A checkpoint written with numpy from the documented layout, as the EAGLE trainer saves."""
  rng = np.random.default_rng(seed)
  d, f = config.d_model, config.mlp_dim
  nh, kh = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
  shapes = {
      "fc.weight": (d, 3 * d), "midlayer.hidden_norm.weight": (d,),
      "midlayer.input_layernorm.weight": (d,), "midlayer.self_attn.q_proj.weight": (nh, 2 * d),
      "midlayer.self_attn.k_proj.weight": (kh, 2 * d),
      "midlayer.self_attn.v_proj.weight": (kh, 2 * d),
      "midlayer.self_attn.o_proj.weight": (d, nh),
      "midlayer.post_attention_layernorm.weight": (d,),
      "midlayer.mlp.gate_proj.weight": (f, d), "midlayer.mlp.up_proj.weight": (f, d),
      "midlayer.mlp.down_proj.weight": (d, f), "norm.weight": (d,),
      "lm_head.weight": (config.draft_vocab_size, d),
  }
  tensors = {name: (0.3 * rng.standard_normal(shape) + (len(shape) == 1)).astype(np.float32)
             for name, shape in shapes.items()}
  target_ids = _d2t(seed)
  tensors["d2t"] = target_ids.astype(np.int64) - np.arange(config.draft_vocab_size)
  tensors["t2d"] = np.isin(np.arange(config.vocab_size), target_ids)
  tensors["embed_tokens.weight"] = rng.standard_normal((config.vocab_size, d)).astype(np.float32)
  for name in drop:
    tensors.pop(name)
  tensors |= extra or {}
  hf = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": d,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim, "intermediate_size": f, "num_hidden_layers": 1,
        "vocab_size": config.vocab_size, "draft_vocab_size": config.draft_vocab_size,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "float32",
        "eagle_aux_hidden_state_layer_ids": list(aux) if aux else None}
  hf |= hf_changes or {}
  os.makedirs(path, exist_ok=True)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as fh:
    json.dump(hf, fh)
  return tensors, target_ids


def test_hand_written_public_checkpoint_loads_to_the_documented_model(tmp_path):
  config = _config()
  tensors, target_ids = _hand_checkpoint(tmp_path, config, 3)
  loaded_config, params, d2t = load_eagle3(tmp_path, TARGET)
  assert loaded_config == config
  np.testing.assert_array_equal(d2t, target_ids)
  for name, got in _to_hf(params, config).items():
    np.testing.assert_array_equal(got, tensors[name], err_msg=name)
  # And the loaded model computes what the layout means, independently of specjax's layout.
  emb, hidden, positions = _inputs(2, 5, 4)
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((5, 5), bool)), (2, 5, 5))
  out, _ = _layer(params, config, emb, hidden, positions, mask=causal)
  want = _ref_midlayer(tensors, config, emb, hidden, positions, causal)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  full = to_target_vocab(_draft_logits(params, config, out), d2t, 64)
  np.testing.assert_allclose(full[..., target_ids], _ref_logits(tensors, config, want),
                             rtol=1e-5, atol=1e-5)


def test_checkpoint_without_aux_ids_takes_the_targets_default(tmp_path):
  _hand_checkpoint(tmp_path, _config(), 0, aux=None)
  with pytest.raises(ConfigError, match="no eagle_aux_hidden_state_layer_ids: pass target="):
    load_eagle3(tmp_path)
  assert load_eagle3(tmp_path, TARGET)[0].aux_layers == (1, 2, 3)


def _bad_d2t_offsets(kind):
  ids = _d2t(0).astype(np.int64)
  if kind == "range":
    ids[-1] = 64
  else:
    ids[1] = ids[0]
  return ids - np.arange(W)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"drop": ["midlayer.mlp.up_proj.weight"]}, CheckpointError,
     r"missing tensor 'midlayer.mlp.up_proj.weight' \(expected shape \(48, 32\)\)"),
    ({"extra": {"midlayer.self_attn.q_proj.weight": np.zeros((32, 32), np.float32)}},
     CheckpointError,
     r"tensor 'midlayer.self_attn.q_proj.weight' has shape \(32, 32\), expected \(32, 64\)"),
    ({"extra": {"midlayer.self_attn.q_norm.weight": np.zeros((8,), np.float32)}},
     CheckpointError, r"unexpected tensors for an EAGLE-3 draft: \['midlayer.self_attn.q_norm"),
    ({"extra": {"d2t": _bad_d2t_offsets("range")}}, CheckpointError,
     r"'d2t' .* invalid: d2t maps to target ids in \[\d+, 64\]: allowed 0..63"),
    ({"extra": {"d2t": _bad_d2t_offsets("dup")}}, CheckpointError, "d2t is not injective"),
    ({"extra": {"t2d": np.ones((64,), bool)}}, CheckpointError,
     "'t2d' .* is inconsistent with 'd2t'"),
    ({"drop": ["d2t", "t2d"]}, CheckpointError,
     r"missing tensor 'd2t' .* required when draft_vocab_size=48 < vocab_size=64"),
    ({"aux": (2, 16, 29)}, ConfigError,
     r"aux_layers=\(2, 16, 29\) is invalid for a 4-layer target: each must be in 1..3"),
    ({"hf_changes": {"num_hidden_layers": 2}}, ConfigError,
     "num_hidden_layers=2 is unsupported: allowed 1"),
    # Once silently taken: a fractional size truncated, integer and NaN weights loaded.
    ({"hf_changes": {"hidden_size": 32.5}}, ConfigError,
     r"config.json: hidden_size=32.5 is invalid: allowed an integer"),
    ({"hf_changes": {"rms_norm_eps": "1e-6"}}, ConfigError,
     r"rms_norm_eps='1e-6' is invalid: allowed a finite number"),
    ({"extra": {"norm.weight": np.ones((32,), np.int32)}}, CheckpointError,
     r"tensor 'norm.weight' has dtype I32: allowed a float dtype"),
    ({"extra": {"fc.weight": np.full((32, 96), np.nan, np.float32)}}, CheckpointError,
     r"tensor 'fc.weight' holds 3072 non-finite values \(NaN or inf\)"),
])
def test_bad_checkpoints_raise_clear_errors(tmp_path, kwargs, error, message):
  _hand_checkpoint(tmp_path, _config(), 0, **kwargs)
  with pytest.raises(error, match=message):
    load_eagle3(tmp_path, TARGET)


@pytest.mark.parametrize("config_text, message", [
    ("", r"malformed JSON at line 1 column 1"),
    ("[1, 2]", r"holds a JSON list, expected an object"),
    ('{"hidden_size": 32,', r"malformed JSON"),
])
def test_a_malformed_config_json_is_named(tmp_path, config_text, message):
  _hand_checkpoint(tmp_path, _config(), 0)
  (tmp_path / "config.json").write_text(config_text)
  with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "config.json")) + ": "
                     + message):
    load_eagle3(tmp_path, TARGET)


def test_a_truncated_safetensors_file_is_named(tmp_path):
  _hand_checkpoint(tmp_path, _config(), 0)
  weights = tmp_path / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:100])
  with pytest.raises(CheckpointError, match=re.escape(str(weights))):
    load_eagle3(tmp_path, TARGET)


def test_pytorch_bin_only_checkpoint_says_only_safetensors_are_read(tmp_path):
  _hand_checkpoint(tmp_path, _config(), 0)
  os.rename(tmp_path / "model.safetensors", tmp_path / "pytorch_model.bin")
  with pytest.raises(CheckpointError, match="only safetensors are read.*safetensors.torch"):
    load_eagle3(tmp_path, TARGET)


def test_save_replaces_an_export_atomically_and_keeps_other_files(tmp_path, monkeypatch):
  config = _config()
  old, new = _random_params(config, 30), _random_params(config, 31)
  out = tmp_path / "draft"
  save_eagle3(out, old, config, _d2t())
  (out / "README.md").write_text("notes")

  def crash(*args, **kwargs):
    raise OSError("disk full")

  monkeypatch.setattr(eagle3_io, "save_file", crash)
  with pytest.raises(OSError, match="disk full"):
    save_eagle3(out, new, config, _d2t())
  monkeypatch.undo()
  jax.tree.map(np.testing.assert_array_equal, load_eagle3(out, TARGET)[1], old)

  save_eagle3(out, new, config, _d2t())
  jax.tree.map(np.testing.assert_array_equal, load_eagle3(out, TARGET)[1], new)
  assert (out / "README.md").read_text() == "notes"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]  # no temp dirs left behind


def test_an_export_killed_between_its_two_renames_is_read_and_restored_by_the_next_save(
    tmp_path):
  """A save killed after moving the old head aside and before renaming the new one in leaves
  no `draft/`: loading reads the old head where it was moved, and the next save puts it back
  before replacing it, leaving no temporary or backup directory behind."""
  config = _config()
  old, new = _random_params(config, 40), _random_params(config, 41)
  out = tmp_path / "draft"
  save_eagle3(out, old, config, _d2t())
  dead = tmp_path / ".draft.old-999999999"  # a backup of a writer that no longer runs
  os.rename(out, dead)
  (tmp_path / ".draft.tmp-999999999").mkdir()  # and its half-written new version
  with pytest.warns(UserWarning, match="interrupted write"):
    jax.tree.map(np.testing.assert_array_equal, load_eagle3(out, TARGET)[1], old)
  save_eagle3(out, new, config, _d2t())
  jax.tree.map(np.testing.assert_array_equal, load_eagle3(out, TARGET)[1], new)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]
