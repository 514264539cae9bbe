"""bfloat16 end to end: bf16 parameters and activations, float32 logits and probabilities.

A model with `dtype="bfloat16", param_dtype="bfloat16"` runs its trunk and draft heads in bf16;
logits, softmax, sampling, verification and the reported log-probabilities stay float32. The
properties protected here, on tiny random models:

- greedy speculative decoding emits exactly the tokens of plain greedy decoding, for every
  kind of drafter, on chains and trees (a draft model that is the target's own trunk accepts
  every draft, so accepted paths and their cache commits are exercised too);
- sampled speculative decoding keeps the exact target distribution (the chi-square test of
  `test_lossless_sampling`, its reference computed from the bf16 model's own logits), and a
  verifier that accepts every draft fails the same test;
- logits of the trunk and of every head, the log-probabilities `generate` reports and those
  the trainer computes are float32, and a train step's metrics are float32.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

# The sampling test's models and statistics, importable also when this file runs alone (the
# whole suite has put tests/decoding on the path by the time this file is collected).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decoding"))
import test_lossless_sampling as lossless  # noqa: E402
from specjax.decoding import (DraftModelDrafter, DraftTree, MedusaDrafter, MTPDrafter,
                              NGramDrafter, SamplingConfig, generate)
from specjax.decoding.drafters.eagle3 import Eagle3Drafter, Eagle3Weights
from specjax.decoding.sampling import processed_logprobs
from specjax.models import (Eagle3Config, ModelConfig, eagle3_draft_logits, forward,
                            init_eagle3, init_params, medusa_logits, mtp_logits_all,
                            to_target_vocab)
from specjax.rl.data import PromptBatch
from specjax.rl.losses import GRPOConfig
from specjax.rl.state import RolloutConfig, TrainConfig, init_train_state
from specjax.rl.trainer import make_train_step
from specjax.rl.updates import sequence_logprobs

BF16 = dict(dtype="bfloat16", param_dtype="bfloat16")
GREEDY = SamplingConfig(temperature=0.0)
NEW_TOKENS = 12

TARGET = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=8, mlp_dim=64, num_mtp_modules=2, num_medusa_heads=2,
                     max_position=64, **BF16)
DRAFT = TARGET.replace(n_layers=1, num_mtp_modules=0, num_medusa_heads=0)
TRUNK = TARGET.replace(num_mtp_modules=0, num_medusa_heads=0)  # the target as a draft model
EAGLE = Eagle3Config.for_target(TARGET, draft_vocab_size=28)


def _bf16(tree):
  return jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree)


@pytest.fixture(scope="module")
def bf16_models():
  params = init_params(TARGET, jax.random.key(0))
  return {
      "target": params,
      "draft": init_params(DRAFT, jax.random.key(1)),
      "trunk": {k: v for k, v in params.items() if k not in ("mtp", "medusa")},
      "eagle": Eagle3Weights(params=init_eagle3(EAGLE, jax.random.key(2)),
                             d2t=jnp.arange(28, dtype=jnp.int32)),
  }


def _prompts():
  """A ragged batch: lengths 6, 4, 5 (padding is garbage on purpose)."""
  tokens = np.random.default_rng(0).integers(0, TARGET.vocab_size, (3, 6))
  return jnp.asarray(tokens), jnp.array([6, 4, 5])


@pytest.fixture(scope="module")
def plain_greedy(bf16_models):
  prompts, lengths = _prompts()
  return generate(bf16_models["target"], TARGET, prompts, lengths, jax.random.key(0),
                  max_new_tokens=NEW_TOKENS, sampling=GREEDY)


# name: (drafter, tree, key of its drafter_params in `bf16_models`)
GREEDY_CASES = {
    "mtp_chain2": (MTPDrafter(), DraftTree.chain(2), None),
    "mtp_tree21": (MTPDrafter(), DraftTree.from_widths((2, 1)), None),
    "draft_model_chain3": (DraftModelDrafter(DRAFT), DraftTree.chain(3), "draft"),
    "own_trunk_tree22": (DraftModelDrafter(TRUNK), DraftTree.from_widths((2, 2)), "trunk"),
    "ngram_chain3": (NGramDrafter(), DraftTree.chain(3), None),
    "eagle3_tree21": (Eagle3Drafter(EAGLE), DraftTree.from_widths((2, 1)), "eagle"),
}


@pytest.mark.parametrize("name", sorted(GREEDY_CASES))
def test_bf16_greedy_speculative_output_equals_plain_greedy(bf16_models, plain_greedy, name):
  drafter, tree, drafter_params = GREEDY_CASES[name]
  prompts, lengths = _prompts()
  spec = generate(bf16_models["target"], TARGET, prompts, lengths, jax.random.key(0),
                  max_new_tokens=NEW_TOKENS, sampling=GREEDY, drafter=drafter, tree=tree,
                  drafter_params=bf16_models.get(drafter_params))
  np.testing.assert_array_equal(spec.tokens, plain_greedy.tokens)
  np.testing.assert_array_equal(spec.lengths, plain_greedy.lengths)
  assert spec.logprobs.dtype == jnp.float32
  np.testing.assert_allclose(spec.logprobs, plain_greedy.logprobs, atol=1e-5)
  if name.startswith("own_trunk"):  # the target drafting for itself: every draft accepted
    assert float(spec.stats.accepted_per_depth[-1]) > 0.99, spec.stats


# The chi-square test of `test_lossless_sampling`, on its models in bf16. Temperature only:
# top-k / top-p make the distribution jump where a token crosses the threshold, and bf16 logits
# depend on how XLA fuses the program (jitted and eager forwards differ by ~1e-2 here), so the
# reference and the engine would truncate differently whenever a token sits near it.
CHI_TARGET = lossless.TARGET.replace(**BF16)
CHI_DRAFT = lossless.DRAFT.replace(**BF16)
CHI_SAMPLING = SamplingConfig(0.7)
CHI_CASES = {
    "sampled_tree": (DraftModelDrafter(CHI_DRAFT, sampled=True), DraftTree.from_widths((3, 2))),
    "deterministic_tree": (MedusaDrafter(), DraftTree.from_widths((3, 2))),
}


@pytest.fixture(scope="module")
def sharp_bf16_models():
  """`test_lossless_sampling`'s sharpened target and draft model, every parameter in bf16, and
  the exact joint distribution of the target's first tokens (from its own bf16 logits)."""
  target = _bf16(lossless._sharpen(init_params(CHI_TARGET, jax.random.key(0)), 15.0,
                                   jax.random.key(10)))
  draft = _bf16(lossless._sharpen(init_params(CHI_DRAFT, jax.random.key(1)), 12.0,
                                  jax.random.key(11)))
  return (target, draft), lossless._exact_joint(target, CHI_SAMPLING, CHI_TARGET)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CHI_CASES))
def test_bf16_speculative_samples_follow_the_exact_target_distribution(sharp_bf16_models,
                                                                      case):
  models, exact = sharp_bf16_models
  tokens, stats = lossless._sample(models, CHI_SAMPLING, *CHI_CASES[case], config=CHI_TARGET)
  assert 0.05 < float(stats.accepted_per_depth[0]) < 0.95, stats.accepted_per_depth
  p = lossless._chi_square_pvalue(tokens, exact)
  assert p > 1e-3, f"{case}: chi-square p={p:.2e}"


@pytest.mark.slow
def test_bf16_accept_everything_verifier_fails_the_same_test(sharp_bf16_models):
  models, exact = sharp_bf16_models
  tokens, _ = lossless._sample(models, CHI_SAMPLING, DraftModelDrafter(CHI_DRAFT, sampled=True),
                               DraftTree.chain(2), verifier=lossless._accept_every_draft,
                               config=CHI_TARGET)
  p = lossless._chi_square_pvalue(tokens, exact)
  assert p < 1e-3, f"the negative control passed (p={p:.2e}); the test has no power"


def test_bf16_model_computes_in_bf16_and_every_head_gives_float32_logits(bf16_models):
  m = bf16_models
  tokens, _ = _prompts()
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)

  def heads(params, eagle):
    out = forward(params, TARGET, tokens, positions)
    eagle_logits = to_target_vocab(eagle3_draft_logits(eagle.params, EAGLE, out.hidden),
                                   eagle.d2t, TARGET.vocab_size)
    return out.hidden, {
        "trunk": out.logits, "medusa": medusa_logits(params, TARGET, out.hidden),
        "mtp": mtp_logits_all(params, TARGET, out.hidden, tokens, positions),
        "eagle3": eagle_logits,
        # Logits that arrive in bf16 are processed in float32 all the same.
        "processed": processed_logprobs(out.logits.astype(jnp.bfloat16),
                                        SamplingConfig(0.7, top_k=5, top_p=0.9))}

  hidden, logits = jax.eval_shape(heads, m["target"], m["eagle"])
  assert hidden.dtype == jnp.bfloat16  # the activations really are bf16
  not_f32 = {jax.tree_util.keystr(k): x.dtype
             for k, x in jax.tree_util.tree_leaves_with_path(logits) if x.dtype != jnp.float32}
  assert not not_f32, not_f32


@pytest.mark.slow  # moved from the README's test command to keep it under 10 minutes
def test_bf16_reported_logprobs_are_float32_and_match_the_trainers(bf16_models):
  """What the policy-gradient ratio compares: the engine's log-probabilities of sampled
  tokens (here from a sampled MTP tree) and the trainer's teacher-forced ones."""
  params = bf16_models["target"]
  prompts, lengths = _prompts()
  sampling = SamplingConfig(0.7)
  out = generate(params, TARGET, prompts, lengths, jax.random.key(1),
                 max_new_tokens=NEW_TOKENS, sampling=sampling,
                 drafter=MTPDrafter(sampled=True), tree=DraftTree.from_widths((2, 1)))
  assert out.logprobs.dtype == jnp.float32
  # Each row's prompt then its response (causal attention: what follows does not matter).
  rows = jnp.arange(prompts.shape[0])[:, None]
  at = lengths[:, None] + jnp.arange(NEW_TOKENS)[None, :]  # response positions
  seq = jnp.pad(prompts, ((0, 0), (0, NEW_TOKENS))).at[rows, at].set(out.tokens)
  logp, _ = jax.jit(sequence_logprobs, static_argnums=(1, 3))(params, TARGET, seq,
                                                               sampling.temperature)
  assert logp.dtype == jnp.float32
  # Two bf16 programs (a token at a time, the whole sequence) may round differently; a token
  # off by one position is off by ~0.2 nats here.
  np.testing.assert_allclose(out.logprobs, logp[rows, at], atol=1e-2)


def _reward(responses, lengths, answers):
  return (responses[:, 0] == answers).astype(jnp.float32)


def test_bf16_train_step_keeps_bf16_parameters_and_float32_metrics(bf16_models):
  """Traced only (`eval_shape`): gradients and updates keep the parameters' bf16; every
  loss, log-probability and metric (the draft heads' losses included) is float32."""
  params = bf16_models["target"]
  tokens, _ = _prompts()
  logp = jax.eval_shape(lambda p: sequence_logprobs(p, TARGET, tokens, 0.7)[0], params)
  grads = jax.eval_shape(
      jax.grad(lambda p: sequence_logprobs(p, TARGET, tokens, 0.7)[0].sum()), params)
  assert logp.dtype == jnp.float32
  assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype(jnp.bfloat16)}
  config = TrainConfig(model=TARGET, grpo=GRPOConfig(group_size=2, beta=0.1, num_minibatches=2),
                       rollout=RolloutConfig(max_new_tokens=4, eos_id=None))
  optimizer = optax.adam(1e-3)
  state = init_train_state(config, params, optimizer, seed=0)
  batch = PromptBatch(tokens=tokens[:2, :4], lengths=jnp.array([4, 3]),
                      answers=jnp.array([1, 2]), index=jnp.arange(2))
  new_state, metrics = jax.eval_shape(make_train_step(config, _reward, optimizer, jit=False),
                                      state, batch)
  assert {x.dtype for x in jax.tree.leaves(new_state.params)} == {jnp.dtype(jnp.bfloat16)}
  assert {"mtp_ce", "medusa_ce", "grad_norm", "entropy"} <= metrics.keys()
  not_f32 = {k: v.dtype for k, v in metrics.items()
             if jnp.issubdtype(v.dtype, jnp.floating) and v.dtype != jnp.float32}
  assert not not_f32, not_f32
