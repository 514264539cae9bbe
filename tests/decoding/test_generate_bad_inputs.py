"""generate on bad input: a clear error that names the problem, or (tiny temperatures) a
correct result; never NaN log-probs or a silently different model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decoding import (Adaptive, CostTable, DraftModelDrafter, DraftTree, Eagle3Drafter,
                              Eagle3Weights, NGramDrafter, SamplingConfig, build_drafter, calibrate,
                              default_drafter, generate)
from specjax.errors import ConfigError
from specjax.models import Eagle3Config, ModelConfig, init_eagle3, init_params

CONFIG = ModelConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                     head_dim=16, mlp_dim=64, max_position=64)
PARAMS = init_params(CONFIG, jax.random.key(0))
PROMPTS = jnp.array([[1, 2, 3, 0], [4, 5, 6, 7]])
LENGTHS = jnp.array([3, 4])


def _generate(params=PARAMS, prompts=PROMPTS, **kwargs):
  kwargs.setdefault("max_new_tokens", 4)
  return generate(params, CONFIG, prompts, LENGTHS, jax.random.key(0), **kwargs)


@pytest.mark.parametrize("token", [16, 1000, -1])
def test_a_prompt_token_outside_the_vocabulary_is_named(token):
  with pytest.raises(ValueError, match=rf"prompt_tokens\[1, 2\] = {token} .* \[0, 16\)"):
    _generate(prompts=PROMPTS.at[1, 2].set(token))


DRAFT = CONFIG.replace(n_layers=1)
DRAFTERS = {"plain": {}, "ngram": dict(drafter=NGramDrafter(), tree=DraftTree.chain(2)),
            "draft model": dict(drafter=DraftModelDrafter(DRAFT), tree=DraftTree.chain(2),
                                drafter_params=init_params(DRAFT, jax.random.key(1)))}


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("pad", [-7, 16, 1000, -1000])
def test_padding_after_a_prompt_may_hold_anything(pad, drafter):
  """Even ids past the vocabulary, which would embed as NaN and poison the row through the
  attention mask's zero weights (0 x NaN)."""
  out = _generate(prompts=PROMPTS.at[0, 3].set(pad), **DRAFTERS[drafter])
  clean = _generate(**DRAFTERS[drafter])
  np.testing.assert_array_equal(out.tokens, clean.tokens)
  np.testing.assert_array_equal(out.logprobs, clean.logprobs)


@pytest.mark.parametrize("prompts,lengths,needle", [
    (PROMPTS + 0.7, LENGTHS, "prompt_tokens is traced with dtype float32"),
    (PROMPTS > 2, LENGTHS, "prompt_tokens is traced with dtype bool"),
    (PROMPTS, LENGTHS + 0.5, "prompt_lengths is traced with dtype float32"),
])
def test_non_integer_prompts_under_the_callers_jit_are_refused_not_truncated(prompts, lengths,
                                                                              needle):
  run = jax.jit(lambda p, n: generate(PARAMS, CONFIG, p, n, jax.random.key(0),
                                      max_new_tokens=2).tokens)
  with pytest.raises(ValueError, match=needle):
    run(prompts, lengths)


def test_numpy_ints_and_arrays_are_taken_where_python_ints_are():
  reference = _generate(tree=DraftTree.chain(2), drafter=NGramDrafter(), eos_id=(5, 9),
                        compaction=1, sampling=SamplingConfig(0.5, top_k=4))
  out = _generate(max_new_tokens=np.int64(4), tree=DraftTree.chain(np.int32(2)),
                  drafter=NGramDrafter(max_ngram=np.int64(3)), eos_id=jnp.array([5, 9]),
                  compaction=np.int8(1), max_len=np.int64(12),
                  sampling=SamplingConfig(0.5, top_k=np.int64(4)))
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  for eos in (np.array(5), jnp.array(5), np.int64(5)):
    np.testing.assert_array_equal(_generate(eos_id=eos).tokens, _generate(eos_id=5).tokens)


def _eagle3(**change):
  head = Eagle3Config.for_target(CONFIG, draft_vocab_size=8)
  weights = Eagle3Weights(init_eagle3(head, jax.random.key(2)), jnp.arange(8, dtype=jnp.int32))
  return _generate(drafter=Eagle3Drafter(head), tree=DraftTree.chain(2),
                   drafter_params=weights.replace(**change))


@pytest.mark.parametrize("call,needle", [
    (lambda: _generate(**{**DRAFTERS["draft model"], "tree": DraftTree.from_widths((20,))}),
     r"a draft tree whose node has 20 children is invalid for a vocabulary of 16 tokens"),
    (lambda: _generate(max_len=20.0), r"max_len=20\.0 is invalid: must be an int in \[1, "
                                      r"config\.max_position=64\]"),
    (lambda: _generate(max_len="20"), r"max_len='20' is invalid"),
    (lambda: _generate(max_len=65), r"max_len=65 is invalid"),
    (lambda: _generate(pad_id=2**40), r"pad_id=1099511627776 is invalid: must be an int that "
                                      "fits int32"),
    (lambda: NGramDrafter(max_ngram=2.5), r"NGramDrafter\(min_ngram=1, max_ngram=2\.5\) is "
                                          "invalid: need ints"),
    (lambda: NGramDrafter(True, True), r"NGramDrafter\(min_ngram=True, max_ngram=True\)"),
    (lambda: DraftTree.chain(True), r"chain length k=True is invalid"),
    (lambda: DraftTree.from_widths(3), r"widths=3 is invalid: must be a sequence of ints"),
    (lambda: _eagle3(d2t=jnp.arange(8.0)), r"Eagle3Weights\.d2t has dtype float32: must be "
                                           "integer target ids"),
    (lambda: _eagle3(params={}), r"Eagle3Weights\.params\['fc'\] is missing"),
    (lambda: _eagle3(d2t=jnp.arange(8) + 12), r"Eagle3Weights\.d2t maps to target ids in "
                                              r"\[12, 19\]: allowed 0\.\.15"),
    # The checkpoint's offsets (target id = draft id + offset) passed as ids: not injective.
    (lambda: _eagle3(d2t=jnp.zeros(8, jnp.int32)), r"d2t is not injective.*load_eagle3"),
    (lambda: _generate(drafter=DraftModelDrafter(DRAFT.replace(max_position=8)),
                       drafter_params=init_params(DRAFT, jax.random.key(1)),
                       tree=DraftTree.chain(2)),
     r"DraftModelDrafter\.config\.max_position=8 is too small for this call: .* 11 slots"),
    (lambda: calibrate({**PARAMS, "embed": PARAMS["embed"][:8]}, CONFIG, NGramDrafter(),
                       (DraftTree.chain(1),), batch_sizes=(2,), prompt_len=4,
                       max_new_tokens=3, cache_dir=None),
     r"params\['embed'\] has shape \(8, 32\)"),
    (lambda: calibrate(PARAMS, CONFIG, NGramDrafter(), (DraftTree.chain(1),), batch_sizes=(2,),
                       prompt_len=4, max_new_tokens=3, cache_dir=123),
     r"cache_dir=123 is invalid: must be a directory path"),
    (lambda: build_drafter("mtp", CONFIG), r"source=ModelConfig\(.*\) is invalid: must be a "
                                           "DraftSource"),
    (lambda: default_drafter(None), r"target=None is invalid"),
])
def test_bad_arguments_are_refused_naming_them(call, needle):
  with pytest.raises(ConfigError, match=needle):
    call()


@pytest.mark.parametrize("prompts,lengths,needle", [
    (np.zeros((2, 0), np.int32), np.array([0, 0]),
     r"prompt_tokens has width 0: shorter than the shortest prompt .* \(1 tokens\)"),
    ([[1, 2, 3], [4, 5]], np.array([3, 2]), r"prompt_tokens is ragged .* right-pad"),
])
def test_prompts_of_no_width_or_ragged_rows_are_named(prompts, lengths, needle):
  with pytest.raises(ValueError, match=needle):
    generate(PARAMS, CONFIG, prompts, lengths, jax.random.key(0), max_new_tokens=2)


@pytest.mark.parametrize("change,needle", [
    (lambda p: {**p, "embed": p["embed"][:8]}, r"params\['embed'\] has shape \(8, 32\)"),
    (lambda p: {**p, "layers": p["layers"][:1]},
     r"params\['layers'\]\[1\]\['attn_norm'\] is missing"),
    (lambda p: {**p, "layers": p["layers"] * 2}, r"params\['layers'\]\[2\].* not part"),
    (lambda p: init_params(CONFIG.replace(d_model=64, head_dim=32), jax.random.key(1)),
     r"has shape .*64"),
])
def test_parameters_that_do_not_match_the_config_are_named(change, needle):
  with pytest.raises(ConfigError, match=needle):
    _generate(params=change(PARAMS))
  with pytest.raises(ConfigError, match="do not match the model config"):
    jax.jit(lambda p: _generate(params=p).tokens)(change(PARAMS))  # shapes: checked under jit


def test_draft_model_parameters_that_do_not_match_its_config_are_named():
  draft = CONFIG.replace(n_layers=1)
  with pytest.raises(ConfigError, match=r"drafter_params\['layers'\]\[1\].* not part"):
    _generate(drafter=DraftModelDrafter(draft), drafter_params=PARAMS, tree=DraftTree.chain(2))


@pytest.mark.parametrize("temperature", [1e-10, 1e-30])
def test_tiny_temperatures_give_finite_log_probs_and_the_argmax(temperature):
  out = _generate(sampling=SamplingConfig(temperature=temperature), max_new_tokens=8)
  greedy = _generate(sampling=SamplingConfig(temperature=0.0), max_new_tokens=8)
  np.testing.assert_array_equal(out.tokens, greedy.tokens)
  logp = np.asarray(out.logprobs)
  assert np.isfinite(logp).all() and (logp <= 0).all(), logp


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0, "1", 1e-45])
def test_a_temperature_that_is_not_a_finite_number_is_refused(temperature):
  with pytest.raises(ConfigError, match="temperature"):
    SamplingConfig(temperature=temperature)


def test_a_decode_loop_called_directly_checks_shapes_and_the_cache_size():
  from specjax.decoding import DecodeLoop
  loop = DecodeLoop(config=CONFIG, max_new_tokens=4, max_len=8)
  with pytest.raises(ConfigError, match=r"prompt length 4 \+ max_new_tokens 4 .* = 9 does not "
                                        "fit the cache of 8 slots"):
    loop(PARAMS, PROMPTS, LENGTHS, jax.random.key(0))
  with pytest.raises(ValueError, match=r"prompt_lengths must have shape \[batch\]=\(2,\)"):
    DecodeLoop(config=CONFIG, max_new_tokens=4, max_len=9)(PARAMS, PROMPTS, LENGTHS[:1],
                                                           jax.random.key(0))


@pytest.mark.parametrize("change,needle", [
    (lambda c: c.replace(reached=c.reached.at[1, 0].set(jnp.nan)),
     r"acceptance\.reached holds nan: counts must be finite and >= 0"),
    (lambda c: c.replace(hits=c.hits.at[1, 0].set(-2.0)), r"acceptance\.hits holds -2\.0"),
    (lambda c: c.replace(hits=c.reached + 1.0), r"acceptance\.hits exceeds acceptance\.reached"),
    (lambda c: c.replace(rounds=-c.rounds - 1), r"acceptance\.rounds=.* is invalid: must be >= 0"),
    (lambda c: c.replace(rounds=jnp.stack([c.rounds] * 2)),
     r"acceptance\.rounds=.* is invalid: must be one integer"),
    (lambda c: c.replace(rounds=2.5), r"acceptance\.rounds=2\.5 is invalid: must be one integer"),
    (lambda c: c.replace(rounds="3"), r"acceptance\.rounds='3' is invalid: must be one integer"),
    (lambda c: c.replace(reached=None), r"acceptance\.reached is invalid: must be an array"),
])
def test_acceptance_counts_that_cannot_be_counts_are_refused(change, needle):
  policy = Adaptive.up_to(DraftTree.chain(2)).with_costs(
      CostTable((2,), ((1.0,), (1.5,), (2.0,))))
  kwargs = dict(drafter=NGramDrafter(), speculation=policy)
  counts = _generate(**kwargs).stats.acceptance
  _generate(**kwargs, acceptance=counts)  # an earlier call's counts are accepted
  with pytest.raises(ConfigError, match=needle):
    _generate(**kwargs, acceptance=change(counts))


def test_acceptance_counts_as_integers_or_lists_steer_the_policy_as_float32_ones_do():
  """Counts a caller wrote down (integers, nested lists) are counts: the loop carries float32
  and took other dtypes to a while_loop carry error."""
  policy = Adaptive.up_to(DraftTree.chain(2)).with_costs(
      CostTable((2,), ((1.0,), (1.5,), (2.0,))))
  kwargs = dict(drafter=NGramDrafter(), speculation=policy)
  counts = _generate(**kwargs).stats.acceptance
  whole = counts.replace(reached=jnp.round(counts.reached), hits=jnp.round(counts.hits))
  want = _generate(**kwargs, acceptance=whole)
  for given in (whole.replace(reached=whole.reached.astype(jnp.int32),
                              hits=whole.hits.astype(jnp.int32)),
                whole.replace(reached=np.asarray(whole.reached).tolist(),
                              hits=np.asarray(whole.hits).tolist(), rounds=int(whole.rounds))):
    got = _generate(**kwargs, acceptance=given)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.stats.tree_rounds, want.stats.tree_rounds)
  # The counts steer: integer evidence that nothing is accepted switches the drafter off.
  hopeless = whole.replace(reached=np.full(whole.reached.shape, 10_000, np.int32),
                           hits=np.zeros(whole.hits.shape, np.int32))
  assert int(np.asarray(_generate(**kwargs, acceptance=hopeless).stats.tree_rounds)[1:].sum()) == 0
  assert int(np.asarray(_generate(**kwargs).stats.tree_rounds)[1:].sum()) > 0
