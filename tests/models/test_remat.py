"""Per-layer rematerialisation (`ModelConfig.remat`): the same numbers, less kept."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from specjax.errors import ConfigError
from specjax.models import ModelConfig, init_params
from specjax.rl.updates import sequence_logprobs

CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1,
                     head_dim=16, mlp_dim=64, num_mtp_modules=1, max_position=64)
PARAMS = init_params(CONFIG, jax.random.key(0))
TOKENS = jax.random.randint(jax.random.key(1), (4, 24), 0, 64)


def _loss(params, config):
  logprobs, out = sequence_logprobs(params, config, TOKENS, 0.9)
  weights = jnp.linspace(-1.0, 1.0, logprobs.shape[-1])
  return (logprobs * weights).sum() + 1e-3 * (out.hidden ** 2).sum()


@pytest.mark.parametrize("policy", ["dots", "full"])
def test_losses_and_gradients_equal_those_without_rematerialisation(policy):
  grad = jax.jit(jax.value_and_grad(_loss), static_argnums=1)
  loss, grads = grad(PARAMS, CONFIG)
  remat_loss, remat_grads = grad(PARAMS, dataclasses.replace(CONFIG, remat=policy))
  np.testing.assert_allclose(remat_loss, loss, rtol=0, atol=1e-6)
  for a, b in zip(jax.tree.leaves(remat_grads), jax.tree.leaves(grads)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


_RESIDUAL = re.compile(r"^(\w+)\[([\d,]*)\] (.*)$")


def _kept_bytes(fn, capsys) -> int:
  """Bytes of what the backward pass of `fn(PARAMS)` keeps, but for the parameters
  themselves (JAX's own account, `print_saved_residuals`)."""
  capsys.readouterr()
  print_saved_residuals(fn, PARAMS)
  total = 0
  for line in capsys.readouterr().out.splitlines():
    dtype, shape, source = _RESIDUAL.match(line).groups()
    if "from the argument" not in source:
      itemsize = int(re.search(r"\d+", dtype).group()) // 8 if dtype != "bool" else 1
      total += int(np.prod([int(d) for d in shape.split(",") if d])) * itemsize
  return total


def test_each_policy_keeps_less_for_the_backward_pass(capsys):
  kept = {policy: _kept_bytes(lambda p: _loss(p, dataclasses.replace(CONFIG, remat=policy)),
                              capsys) for policy in ("none", "dots", "full")}
  assert kept["full"] < kept["dots"] < kept["none"], kept
  # "full": per layer its input residual stream [4, 24, 32] (and the head's), not its insides.
  per_layer_input = 4 * 24 * 32 * 4
  assert kept["none"] - kept["full"] > 3 * 4 * 24 * (64 + 2 * 24) * 4 - per_layer_input


def test_decoding_is_untouched_and_a_bad_policy_is_named():
  from specjax.decoding import generate
  prompts, lengths = np.full((2, 5), 7, np.int32), np.array([5, 3], np.int32)
  plain = generate(PARAMS, CONFIG, prompts, lengths, jax.random.key(0), max_new_tokens=4)
  remat = generate(PARAMS, dataclasses.replace(CONFIG, remat="full"), prompts, lengths,
                   jax.random.key(0), max_new_tokens=4)
  np.testing.assert_array_equal(plain.tokens, remat.tokens)
  with pytest.raises(ConfigError, match="remat='some' is invalid"):
    dataclasses.replace(CONFIG, remat="some")
