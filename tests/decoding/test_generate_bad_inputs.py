"""generate on bad input: a clear error that names the problem, or (tiny temperatures) a
correct result; never NaN log-probs or a silently different model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.decoding import DraftModelDrafter, DraftTree, SamplingConfig, generate
from specjax.errors import ConfigError
from specjax.models import ModelConfig, init_params

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


def test_padding_after_a_prompt_may_hold_anything():
  out = _generate(prompts=PROMPTS.at[0, 3].set(-7))
  np.testing.assert_array_equal(out.tokens, _generate().tokens)


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
