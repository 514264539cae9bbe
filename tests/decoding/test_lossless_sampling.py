"""Sampled speculative decoding keeps the target distribution exactly.

The joint distribution of the first three generated tokens is compared, by a chi-square
test over 60,000 samples, with the exact target distribution computed by enumerating every
continuation and processing the logits with an independent NumPy implementation of
temperature / top-k / top-p. The drafters are deliberately different models, so a wrong
acceptance rule would show; a verifier that accepts every draft is the negative control and
must fail the same test. The switching cases change the tree every round (an adaptive
policy's freedom); the early-stop cases cut each row's chain where the draft is unsure. The EAGLE-3 cases use a 2-layer target (the head reads its inner
residual streams) and a draft vocabulary of 6 of the 8 tokens, so the draft distribution
has zero mass where the target has some.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from support import CyclingPolicy
from specjax.decoding import (CostTable, DraftModelDrafter, DraftTree, FallbackDrafter,
                              FallbackParams, GroupDrafter, MedusaDrafter, MTPDrafter,
                              SamplingConfig, generate, verify)
from specjax.decoding.drafters.eagle3 import Eagle3Drafter, Eagle3Weights
from specjax.decoding.drafters.history import HistoryDrafter, history_drafter
from specjax.decoding.sampling import sample_tokens, processed_logprobs
from specjax.models import Eagle3Config, ModelConfig, forward, init_eagle3, init_params

V = 8
NEW = 3
SAMPLES = 60_000
PROMPT = [1, 2, 3]

TARGET = ModelConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                     head_dim=8, mlp_dim=32, num_medusa_heads=2, max_position=16)
DRAFT = TARGET.replace(num_medusa_heads=0)
EAGLE_TARGET = TARGET.replace(n_layers=2, num_medusa_heads=0)
EAGLE = Eagle3Config.for_target(EAGLE_TARGET, draft_vocab_size=6)
# A mixture-of-experts target (4 experts, top 2) drafted by its own MTP heads.
MOE_TARGET = ModelConfig(vocab_size=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                         head_dim=8, mlp_dim=32, qk_norm=True, family="qwen3_moe", n_experts=4,
                         experts_per_token=2, expert_dim=16, num_mtp_modules=2, max_position=16)


def _sharpen(params, scale, key):
  """Random models are near-uniform; scale the output head so the distributions differ."""
  params = dict(params)
  params["unembed"] = params["unembed"] * scale
  if "medusa" in params:
    params["medusa"] = [[{"w": 0.5 * jax.random.normal(jax.random.fold_in(key, h), l["w"].shape),
                          "b": l["b"]} for l in head] for h, head in enumerate(params["medusa"])]
  return params


@pytest.fixture(scope="module")
def models():
  return (_sharpen(init_params(TARGET, jax.random.key(0)), 15.0, jax.random.key(10)),
          _sharpen(init_params(DRAFT, jax.random.key(1)), 12.0, jax.random.key(11)))


@pytest.fixture(scope="module")
def eagle_models():
  """A sharpened random 2-layer target and an EAGLE-3 head over draft ids [0, 2, ..., 7]."""
  head = init_eagle3(EAGLE, jax.random.key(2))
  head["lm_head"] = head["lm_head"] * 40.0
  head["fc"] = head["fc"] * 10.0
  return (_sharpen(init_params(EAGLE_TARGET, jax.random.key(0)), 15.0, jax.random.key(10)),
          Eagle3Weights(params=head, d2t=jnp.array([0, 2, 3, 5, 6, 7], jnp.int32)))


@pytest.fixture(scope="module")
def moe_target():
  """The sharpened MoE target, its router and experts scaled so that routing matters."""
  params = _sharpen(init_params(MOE_TARGET, jax.random.key(0)), 15.0, jax.random.key(10))
  for layer in params["layers"] + [m["block"] for m in params["mtp"]]:
    layer["router"] = layer["router"] * 20.0
    for name in ("experts_gate", "experts_up", "experts_down"):
      layer[name] = layer[name] * 10.0
  return params


def _reference_probs(logits: np.ndarray, s: SamplingConfig) -> np.ndarray:
  """Independent NumPy temperature -> top-k -> top-p (smallest prefix reaching top_p)."""
  z = logits.astype(np.float64) / s.temperature
  if s.top_k:
    kth = np.sort(z)[-s.top_k]
    z = np.where(z >= kth, z, -np.inf)
  p = np.exp(z - z.max())
  p /= p.sum()
  if s.top_p < 1:
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, bool)
    keep[order[before < s.top_p]] = True
    p = np.where(keep, p, 0)
    p /= p.sum()
  return p


def _exact_joint(params, s: SamplingConfig, config: ModelConfig = TARGET) -> np.ndarray:
  """P(x1, x2, x3 | prompt) for all V**3 continuations, flattened."""
  seqs = np.array([PROMPT + list(c) for c in itertools.product(range(V), repeat=NEW - 1)])
  logits = np.asarray(forward(params, config, jnp.asarray(seqs),
                              jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape)).logits,
                      np.float64)
  p0 = len(PROMPT) - 1
  joint = np.zeros((V,) * NEW)
  for row, (x1, x2) in zip(logits, itertools.product(range(V), repeat=NEW - 1)):
    p1 = _reference_probs(row[p0], s)
    p2 = _reference_probs(row[p0 + 1], s)
    p3 = _reference_probs(row[p0 + 2], s)
    joint[x1, x2] = p1[x1] * p2[x2] * p3
  assert abs(joint.sum() - 1) < 1e-9
  return joint.ravel()


def _chi_square_pvalue(tokens: np.ndarray, expected_probs: np.ndarray) -> float:
  cells = np.ravel_multi_index(tokens.T, (V,) * NEW)
  observed = np.bincount(cells, minlength=V ** NEW).astype(np.float64)
  expected = expected_probs * len(tokens)
  assert observed[expected == 0].sum() == 0, "sampled a sequence of probability 0"
  big = expected >= 5
  obs = np.append(observed[big], observed[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  if exp[-1] < 5:  # fold a too-small remainder into the smallest kept cell
    obs, exp = obs[:-1], exp[:-1]
    obs[np.argmin(exp)] += observed[~big].sum()
    exp[np.argmin(exp)] += expected[~big].sum()
  return scipy.stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def _sample(models, s, drafter, tree, seed=0, verifier=verify.LosslessVerifier(),
            config=TARGET):
  """Sample with a fixed `tree`, or with a `CyclingPolicy` that changes it every round."""
  target, draft = models
  if history_drafter(drafter) is not None:  # the bank; behind it, a draft model's weights
    bank = _history_bank(history_drafter(drafter))
    weighted = isinstance(drafter, FallbackDrafter) and isinstance(drafter.fallback,
                                                                   DraftModelDrafter)
    draft = FallbackParams(primary=bank, fallback=draft) if weighted else bank
  prompts = jnp.tile(jnp.array([PROMPT]), (SAMPLES, 1))
  kwargs = {"speculation": tree} if isinstance(tree, CyclingPolicy) else {"tree": tree}
  out = generate(target, config, prompts, jnp.full((SAMPLES,), len(PROMPT)),
                 jax.random.key(seed), max_new_tokens=NEW, sampling=s, drafter=drafter,
                 drafter_params=draft, verifier=verifier, **kwargs)
  assert bool((out.lengths == NEW).all())
  return np.asarray(out.tokens), out.stats


def _history_bank(drafter: HistoryDrafter):
  """Earlier answers to PROMPT (and to another prompt, in the recent store) that a row's
  first tokens sometimes continue and sometimes not."""
  bank = drafter.new_bank(NEW)
  prompts, lengths = jnp.array([PROMPT, [4, 4, 4]]), jnp.array([3, 3])
  earlier = jnp.array([[4, 5, 6], [0, 0, 0], [2, 7, 1], [5, 5, 3]] * 2)
  return bank.record(prompts, lengths, earlier, jnp.full((8,), NEW), group_size=4)


SAMPLINGS = {"t1": SamplingConfig(1.0), "t07_topk_topp": SamplingConfig(0.7, top_k=5, top_p=0.9)}
SWITCHING = CyclingPolicy((DraftTree.chain(1), DraftTree.from_widths((3, 2))),
                          costs=CostTable((SAMPLES,), ((1.0,),) * 3))
CASES = {
    "sampled_chain": (DraftModelDrafter(DRAFT, sampled=True), DraftTree.chain(2)),
    "deterministic_tree": (MedusaDrafter(), DraftTree.from_widths((3, 2))),
    "sampled_tree": (DraftModelDrafter(DRAFT, sampled=True), DraftTree.from_widths((3, 2))),
    # The tree changes from round to round (chain 1, then a (3, 2) tree, then plain).
    "sampled_switching": (DraftModelDrafter(DRAFT, sampled=True), SWITCHING),
    # Rows stop drafting where the draft is unsure: the chain's length varies by row.
    "sampled_chain_early_stop": (DraftModelDrafter(DRAFT, sampled=True), DraftTree.chain(2)),
    "deterministic_chain_early_stop": (DraftModelDrafter(DRAFT), DraftTree.chain(2)),
    # Drafts from the other rows of each group of 4 (all rows answer the one prompt): what one
    # row drafts depends on what its siblings sampled.
    "group_chain": (GroupDrafter(group_size=4, min_ngram=1, max_ngram=2), DraftTree.chain(2)),
    # Earlier answers to the prompt, the group's and recent ones draft (`_history_bank`).
    "history_chain": (HistoryDrafter(group_size=4, min_ngram=1, max_ngram=2),
                      DraftTree.chain(2)),
    # A tree of the distinct continuations (the best two at each depth).
    "history_tree": (HistoryDrafter(group_size=4, min_ngram=1, max_ngram=2),
                     DraftTree.from_widths((2, 2))),
    "history_medusa_chain": (FallbackDrafter(HistoryDrafter(group_size=4, min_ngram=1,
                                                            max_ngram=2), MedusaDrafter()),
                             DraftTree.chain(2)),
    # The group's whole drafts where it has them, Medusa's elsewhere, row by row.
    "group_medusa_chain": (FallbackDrafter(GroupDrafter(group_size=4, min_ngram=1,
                                                        max_ngram=2), MedusaDrafter()),
                           DraftTree.chain(2)),
    # ... and a draft model's ("group+draft-model"); history's in front of one, each with its
    # own drafter_params (FallbackParams: the bank, the draft model's weights).
    "history_draft_model_chain": (FallbackDrafter(HistoryDrafter(group_size=4, min_ngram=1,
                                                                 max_ngram=2),
                                                  DraftModelDrafter(DRAFT)), DraftTree.chain(2)),
    "group_draft_model_chain": (FallbackDrafter(GroupDrafter(group_size=4, min_ngram=1,
                                                             max_ngram=2), DraftModelDrafter(DRAFT)),
                                DraftTree.chain(2)),
}
# Thresholds that cut some chains and not all (the sharper t07 distribution needs a higher).
STOP_BELOW = {"t1": 0.4, "t07_topk_topp": 0.6}


def _early_stop(case, drafter, sampling_name):
  if not case.endswith("early_stop"):
    return drafter
  return dataclasses.replace(drafter, confidence=STOP_BELOW[sampling_name])


def _check_early_stops(drafter, tree, stats):
  """A case with a confidence threshold must have cut some chains, and not all."""
  if getattr(drafter, "confidence", 0.0):
    assert 1.05 < float(stats.drafts_per_round) < tree.num_nodes - 0.05, stats.drafts_per_round


@pytest.mark.slow
@pytest.mark.parametrize("sampling_name", sorted(SAMPLINGS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_speculative_samples_follow_the_exact_target_distribution(models, case, sampling_name):
  s = SAMPLINGS[sampling_name]
  drafter, tree = CASES[case]
  drafter = _early_stop(case, drafter, sampling_name)
  tokens, stats = _sample(models, s, drafter, tree)
  # The drafter differs from the target but is not useless: both outcomes get exercised.
  assert 0.05 < float(stats.accepted_per_depth[0]) < 0.95, stats.accepted_per_depth
  _check_early_stops(drafter, tree, stats)
  p = _chi_square_pvalue(tokens, _exact_joint(models[0], s))
  assert p > 1e-3, f"{case}/{sampling_name}: chi-square p={p:.2e}"


EAGLE_CASES = {
    "eagle3_sampled_chain": (Eagle3Drafter(EAGLE, sampled=True), DraftTree.chain(2)),
    "eagle3_deterministic_tree": (Eagle3Drafter(EAGLE), DraftTree.from_widths((3, 2))),
    "eagle3_sampled_tree": (Eagle3Drafter(EAGLE, sampled=True), DraftTree.from_widths((3, 2))),
    "eagle3_sampled_switching": (Eagle3Drafter(EAGLE, sampled=True), SWITCHING),
    "eagle3_sampled_chain_early_stop": (Eagle3Drafter(EAGLE, sampled=True),
                                        DraftTree.chain(2)),
    # The group's whole drafts where it has them, the head's elsewhere ("group+eagle3"; a
    # tree: the random head's deterministic chain is too rarely accepted to test anything).
    "group_eagle3_tree": (FallbackDrafter(GroupDrafter(group_size=4, min_ngram=1, max_ngram=2),
                                          Eagle3Drafter(EAGLE)), DraftTree.from_widths((3, 2))),
}


@pytest.mark.slow
@pytest.mark.parametrize("sampling_name", sorted(SAMPLINGS))
@pytest.mark.parametrize("case", sorted(EAGLE_CASES))
def test_eagle3_samples_follow_the_exact_target_distribution(eagle_models, case,
                                                            sampling_name):
  s = SAMPLINGS[sampling_name]
  drafter, tree = EAGLE_CASES[case]
  drafter = _early_stop(case, drafter, sampling_name)
  tokens, stats = _sample(eagle_models, s, drafter, tree, config=EAGLE_TARGET)
  assert 0.05 < float(stats.accepted_per_depth[0]) < 0.95, stats.accepted_per_depth
  _check_early_stops(drafter, tree, stats)
  p = _chi_square_pvalue(tokens, _exact_joint(eagle_models[0], s, EAGLE_TARGET))
  assert p > 1e-3, f"{case}/{sampling_name}: chi-square p={p:.2e}"


def _accept_every_draft(tree, node_tokens, target_logits, draft_logprobs, sampling, key):
  """Negative control: a verifier that accepts the first child at every node."""
  b = node_tokens.shape[0]
  children = jnp.asarray(tree.children)
  cur = jnp.zeros((b,), jnp.int32)
  path, accepted = [cur], jnp.zeros((b,), jnp.int32)
  for _ in range(tree.depth):
    nxt = children[cur, 0]
    accepted += nxt >= 0
    cur = jnp.where(nxt >= 0, nxt, cur)
    path.append(cur)
  last = jnp.take_along_axis(target_logits, cur[:, None, None], axis=1)[:, 0]
  return verify.VerifyResult(path=jnp.stack(path, 1), num_accepted=accepted,
                             next_token=sample_tokens(key, processed_logprobs(last, sampling),
                                                      sampling))


@pytest.mark.slow
@pytest.mark.parametrize("sampling_name", sorted(SAMPLINGS))
def test_an_moe_target_drafted_by_its_mtp_heads_samples_the_exact_distribution(moe_target,
                                                                               sampling_name):
  s = SAMPLINGS[sampling_name]
  tree = DraftTree.from_widths((2, 1))
  tokens, stats = _sample((moe_target, None), s, MTPDrafter(sampled=True), tree,
                          config=MOE_TARGET)
  assert 0.05 < float(stats.accepted_per_depth[0]) < 0.95, stats.accepted_per_depth
  p = _chi_square_pvalue(tokens, _exact_joint(moe_target, s, MOE_TARGET))
  assert p > 1e-3, f"moe/{sampling_name}: chi-square p={p:.2e}"
  if sampling_name != "t1":  # (top-k / top-p: it samples sequences of probability 0 outright)
    return
  # The accept-everything verifier on the same target and heads is rejected.
  wrong, _ = _sample((moe_target, None), s, MTPDrafter(sampled=True), tree, seed=1,
                     verifier=_accept_every_draft, config=MOE_TARGET)
  p = _chi_square_pvalue(wrong, _exact_joint(moe_target, s, MOE_TARGET))
  assert p < 1e-3, f"the negative control passed (p={p:.2e}); the test has no power"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sampled_chain", "deterministic_tree",
                                  "eagle3_sampled_chain", "sampled_switching", "group_chain",
                                  "history_chain", "history_tree", "group_draft_model_chain",
                                  "history_draft_model_chain",
                                  "group_eagle3_tree"])
def test_accept_everything_verifier_fails_the_same_test(models, eagle_models, case):
  s = SAMPLINGS["t1"]
  if case in EAGLE_CASES:
    tokens, _ = _sample(eagle_models, s, *EAGLE_CASES[case], verifier=_accept_every_draft,
                        config=EAGLE_TARGET)
    p = _chi_square_pvalue(tokens, _exact_joint(eagle_models[0], s, EAGLE_TARGET))
  else:
    tokens, _ = _sample(models, s, *CASES[case], verifier=_accept_every_draft)
    p = _chi_square_pvalue(tokens, _exact_joint(models[0], s))
  assert p < 1e-3, f"the negative control passed (p={p:.2e}); the test has no power"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["group_draft_model_chain", "group_eagle3_tree"])
def test_the_grpo_steps_rollouts_follow_the_exact_target_distribution(models, eagle_models,
                                                                      case):
  """Issue 57: group drafts in front of a draft model or an EAGLE-3 head, as the GRPO step
  generates its rollouts (`specjax.rl.rollouts.rollout`: groups of G = 4 rows per prompt,
  the step's config, compiled): the same exact distribution. (The step has no verifier to
  swap; the accept-everything control above fails on the same drafters.)"""
  from specjax.rl import GRPOConfig
  from specjax.rl.rollouts import rollout
  from specjax.rl.state import RolloutConfig, TrainConfig
  eagle = case in EAGLE_CASES
  drafter, tree = (EAGLE_CASES if eagle else CASES)[case]
  (target, draft), model = (eagle_models, EAGLE_TARGET) if eagle else (models, TARGET)
  s = SAMPLINGS["t1"]
  config = TrainConfig(model=model, grpo=GRPOConfig(group_size=4),
                       rollout=RolloutConfig(max_new_tokens=NEW, eos_id=None, sampling=s,
                                             drafter=drafter, tree=tree))
  prompts = jnp.tile(jnp.array([PROMPT]), (SAMPLES // 4, 1))
  lengths = jnp.full((SAMPLES // 4,), len(PROMPT))
  roll, responses, response_lengths, _ = jax.jit(
      lambda key: rollout(target, config, prompts, lengths, key, drafter_params=draft,
                          check_values=False))(jax.random.key(3))
  assert bool((response_lengths == NEW).all())
  parts = {k: float(v) for k, v in roll.drafter_stats.items() if k.endswith("_rounds")}
  assert len(parts) == 2 and min(parts.values()) > 0, parts  # both drafters drafted
  p = _chi_square_pvalue(np.asarray(responses), _exact_joint(target, s, model))
  assert p > 1e-3, f"{case} in the GRPO step's rollout: chi-square p={p:.2e}"
