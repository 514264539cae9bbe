"""Offline EAGLE-3 training: self-distillation on the target's own text, training-time test.

The recipe the reference system found best: the target generates responses to in-domain
prompts (`self_distillation_data`), and the head learns, on the target's own features and
distributions over those sequences, to predict what the target predicts, unrolled over
`ttt_steps` draft steps on its own outputs exactly as it drafts (`eagle3_ttt_loss`).

    weights, history = train_eagle3(target_params, target_config, eagle_config, batches,
                                    optimizer=optax.adamw(1e-3), ttt_steps=3)
    generate(..., drafter=Eagle3Drafter(eagle_config), drafter_params=weights)

The target is frozen: its forward runs inside the step only to produce features (three
residual streams) and log-probabilities, both treated as constants.

Shape letters: see `specjax` (B batch, T tokens, P prompt buffer, L = P + max new tokens,
E d_model, V vocab, W draft vocab, J training-time-test steps).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from specjax.decoding.drafters.eagle3 import Eagle3Weights
from specjax.decoding.generation import generate
from specjax.decoding.sampling import SamplingConfig
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.eagle3 import (Eagle3Config, build_draft_vocab, check_d2t, count_tokens,
                                   eagle3_ttt_loss, init_eagle3, select_aux)
from specjax.models.params import Params
from specjax.models.transformer import forward


@struct.dataclass
class Eagle3TrainState:
  """Parameters, optimizer state and step count of an EAGLE-3 head in training.

  Attributes:
    params: the head's float parameters.
    opt_state: optax state of `params`.
    step: scalar int32.
  """

  params: Params
  opt_state: optax.OptState
  step: jax.Array


def target_features(target_params: Params, target_config: ModelConfig,
                    eagle_config: Eagle3Config, tokens: jax.Array
                    ) -> tuple[tuple[jax.Array, ...], jax.Array]:
  """The target's (low, mid, high) streams `3 x [B, T, E]` and log-probabilities `[B, T, V]`
  over `tokens [B, T]`, as constants (no gradient reaches the target)."""
  b, t = tokens.shape
  out = forward(target_params, target_config, tokens,
                jnp.broadcast_to(jnp.arange(t), (b, t)),
                hidden_layers=eagle_config.hidden_layers)
  aux = select_aux(eagle_config, out.intermediates)
  logprobs = jax.nn.log_softmax(out.logits, axis=-1)
  return jax.lax.stop_gradient(aux), jax.lax.stop_gradient(logprobs)


def eagle3_loss(params: Params, eagle_config: Eagle3Config, target_params: Params,
                target_config: ModelConfig, d2t: jax.Array, tokens: jax.Array,
                loss_mask: jax.Array, *, ttt_steps: int, soft_labels: bool = True,
                step_decay: float = 1.0) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Training-time-test loss of the head on `tokens [B, T]` (targets where `loss_mask`).

  With `soft_labels` the head learns the target's full distribution at each position (the
  forward KL that bounds acceptance under sampling); otherwise the tokens themselves.
  """
  aux, logprobs = target_features(target_params, target_config, eagle_config, tokens)
  return eagle3_ttt_loss(params, eagle_config, target_params["embed"], tokens, aux,
                         logprobs if soft_labels else None, loss_mask, d2t, ttt_steps,
                         step_decay=step_decay)


def make_eagle3_step(target_config: ModelConfig, eagle_config: Eagle3Config,
                     optimizer: optax.GradientTransformation, *, ttt_steps: int = 3,
                     soft_labels: bool = True, step_decay: float = 1.0
                     ) -> Callable[..., tuple[Eagle3TrainState, dict[str, jax.Array]]]:
  """A jitted step `(state, target_params, d2t, tokens [B, T], loss_mask [B, T]) ->
  (state, metrics)`; metrics hold the loss, the per-step CE and top-1 accuracy `[J]`, and
  the gradient norm. The state is donated (parameters and moments are updated in place)."""
  if not isinstance(ttt_steps, int) or ttt_steps < 1:
    raise ConfigError(f"ttt_steps={ttt_steps!r} is invalid: must be an int >= 1")
  eagle_config.check_target(target_config)

  def step(state: Eagle3TrainState, target_params, d2t, tokens, loss_mask):
    (loss, metrics), grads = jax.value_and_grad(eagle3_loss, has_aux=True)(
        state.params, eagle_config, target_params, target_config, d2t, tokens, loss_mask,
        ttt_steps=ttt_steps, soft_labels=soft_labels, step_decay=step_decay)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "ce": metrics["ce"], "accuracy": metrics["accuracy"],
               "grad_norm": optax.global_norm(grads)}
    return Eagle3TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics

  # The old parameters and moments are dead after the update.
  return jax.jit(step, donate_argnums=0)


def init_eagle3_state(eagle_config: Eagle3Config, optimizer: optax.GradientTransformation,
                      key: jax.Array, params: Params | None = None) -> Eagle3TrainState:
  """A fresh training state (random head unless `params` are given)."""
  params = init_eagle3(eagle_config, key) if params is None else params
  return Eagle3TrainState(params=params, opt_state=optimizer.init(params),
                          step=jnp.zeros((), jnp.int32))


def self_distillation_data(target_params: Params, target_config: ModelConfig,
                           prompts: np.ndarray, prompt_lengths: np.ndarray, key: jax.Array, *,
                           max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
                           eos_id: int | None = None, pad_id: int = 0,
                           batch_size: int = 64) -> tuple[np.ndarray, np.ndarray]:
  """The target's own responses to `prompts [B, P]`, as training sequences.

  Returns:
    `(tokens [B, L], loss_mask [B, L])` with L = P + max_new_tokens: each prompt
    followed by its response and padding; the mask marks response tokens (what the head is
    trained to draft).
  """
  prompts = np.asarray(prompts, np.int32)
  prompt_lengths = np.asarray(prompt_lengths, np.int32)
  b, p = prompts.shape
  width = p + max_new_tokens
  tokens = np.full((b, width), pad_id, np.int32)
  mask = np.zeros((b, width), np.int32)
  for start in range(0, b, batch_size):
    rows = slice(start, min(start + batch_size, b))
    out = generate(target_params, target_config, prompts[rows], prompt_lengths[rows],
                   jax.random.fold_in(key, start), max_new_tokens=max_new_tokens,
                   sampling=sampling, eos_id=eos_id, pad_id=pad_id)
    gen, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    for i, row in enumerate(range(rows.start, rows.stop)):
      n, m = prompt_lengths[row], lengths[i]
      tokens[row, :n] = prompts[row, :n]
      tokens[row, n:n + m] = gen[i, :m]
      mask[row, n:n + m] = 1
  return tokens, mask


def draft_vocab_from_data(tokens: np.ndarray, loss_mask: np.ndarray, vocab_size: int,
                          draft_vocab_size: int) -> np.ndarray:
  """`d2t [W]`: the W target ids most frequent among the masked tokens (the EAGLE-3 recipe)."""
  return build_draft_vocab(count_tokens(tokens, loss_mask, vocab_size), draft_vocab_size)


def train_eagle3(target_params: Params, target_config: ModelConfig,
                 eagle_config: Eagle3Config, batches: Iterable[tuple[np.ndarray, np.ndarray]],
                 *, optimizer: optax.GradientTransformation, d2t: np.ndarray,
                 key: jax.Array | None = None, params: Params | None = None,
                 ttt_steps: int = 3, soft_labels: bool = True, step_decay: float = 1.0,
                 callback: Callable[[int, dict[str, float]], None] | None = None
                 ) -> tuple[Eagle3Weights, list[dict[str, Any]]]:
  """Train an EAGLE-3 head on `(tokens [B, T], loss_mask [B, T])` batches.

  Args:
    d2t: `[W]` the draft vocabulary (e.g. `draft_vocab_from_data`).
    key: initialisation key when `params` is None.
    params: start from these parameters (fine-tuning) instead of a random head.
    callback: called after every step with `(step, metrics as floats)` (progress, logging).

  Returns:
    The trained `Eagle3Weights` and the per-step metrics.
  """
  check_d2t(d2t, eagle_config)
  if params is None and key is None:
    raise ConfigError("train_eagle3 needs key= (to initialise the head) or params=")
  state = init_eagle3_state(eagle_config, optimizer, key, params)
  step = make_eagle3_step(target_config, eagle_config, optimizer, ttt_steps=ttt_steps,
                          soft_labels=soft_labels, step_decay=step_decay)
  d2t_dev = jnp.asarray(d2t, jnp.int32)
  history = []
  for i, (tokens, mask) in enumerate(batches):
    state, metrics = step(state, target_params, d2t_dev, jnp.asarray(tokens, jnp.int32),
                          jnp.asarray(mask, jnp.int32))
    record = {"step": i + 1, "loss": float(metrics["loss"]),
              "grad_norm": float(metrics["grad_norm"]),
              "ce": [float(x) for x in metrics["ce"]],
              "accuracy": [float(x) for x in metrics["accuracy"]]}
    if not np.isfinite(record["loss"]):
      raise FloatingPointError(f"EAGLE-3 training diverged at step {i + 1}: loss "
                               f"{record['loss']}; lower the learning rate")
    history.append(record)
    if callback is not None:
      callback(i + 1, record)
  return Eagle3Weights(params=state.params, d2t=d2t_dev), history
