"""The GRPO train step: rollout -> reward -> advantages -> update -> drafter update, fused.

`make_train_step` returns one `jax.jit`-compiled function
`(train_state, prompt_batch) -> (train_state, metrics)`. Inside it the policy generates G
responses per prompt with the speculative engine (`specjax.rl.rollouts`), the task's JAX
reward scores them, group advantages are formed, and `num_epochs x num_minibatches` optax
updates run under `lax.scan` (`specjax.rl.updates`), the same minibatch forward training the
drafter on the rollouts from detached target activations. What the step is configured with
and carries is `specjax.rl.state`.

Modes:
- sync: the update uses the batch generated in the same step by the current parameters.
- async (one-step off-policy): the step generates batch t + 1 with the current parameters and
  updates on batch t, generated one step earlier (`TrainState.pending`). The truncated
  importance weight `min(pi_old / pi_behaviour, tis_cap)` corrects for the lag.
- split (`make_split_step`): for Python rewards, the rollout and the update are two programs
  with the reward computed on the host in between.

Rows are prompt-major: the G samples of prompt i are rows i * G .. i * G + G - 1.
Shape letters: see `specjax` (B rows, B / G prompts, G group size, P prompt buffer,
T max new tokens, L = P + T sequence buffer, D tree depth, V vocab).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.decoding.policy import AcceptanceCounts
from specjax.errors import ConfigError
from specjax.models.lora import merged_policy
from specjax.rl.rollouts import (recorded, rollout, rollout_metrics, rollout_samples, score,
                                 scored_rollout)
from specjax.rl.state import RewardFn, Rollout, TrainConfig, TrainState
from specjax.rl.updates import update


def step_keys(key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A train step's keys from the state's raw key data: (the next step's key data, the
  rollout's key, the update's key). Every step program splits them this way, so that the
  fused and the disaggregated async modes draw the same samples."""
  key, k_roll, k_update = jax.random.split(jax.random.wrap_key_data(key), 3)
  return jax.random.key_data(key), k_roll, k_update



def prime_keys(key: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Async mode's priming keys: (the next key data, the first rollout's key)."""
  key, k_roll = jax.random.split(jax.random.wrap_key_data(key))
  return jax.random.key_data(key), k_roll



def _with_acceptance(state: TrainState, acceptance: AcceptanceCounts) -> TrainState:
  """`state` carrying the rollout's counts, when it carries any."""
  return state if state.acceptance is None else state.replace(acceptance=acceptance)



def _state_rollout(state: TrainState, config: TrainConfig, batch, key: jax.Array,
                   reward_fn: RewardFn, pad_id: int) -> tuple[Rollout, TrainState]:
  """`scored_rollout` by the state's policy and drafter, and the state with its counts and,
  with a history drafter, its bank with the rollout recorded."""
  roll, acceptance = scored_rollout(state.policy, state.rollout_drafter_params,
                                    state.acceptance, config, batch, key, reward_fn, pad_id)
  history = recorded(state.history, config, batch.tokens, batch.lengths, roll)
  return roll, _with_acceptance(state, acceptance).replace(history=history)




def make_train_step(config: TrainConfig, reward_fn: RewardFn,
                    optimizer: optax.GradientTransformation, *, pad_id: int = 0,
                    jit: bool = True, state_sharding: Any = None, batch_sharding: Any = None,
                    samples: int = 0
                    ) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
  """The fused step `(state, batch) -> (state, metrics)`; batch has tokens, lengths, answers.

  `reward_fn(responses [B, T], lengths [B], answers [B]) -> [B]` must be JAX. In async mode the
  state must hold a pending rollout first (`make_prime_fn`). With `samples`, the metrics also
  hold `metrics["samples"]`: the trained rollout's first rows (`rollout_samples`), for a log
  of sample completions.
  """

  def step(state: TrainState, batch) -> tuple[TrainState, dict[str, jax.Array]]:
    key, k_roll, k_update = step_keys(state.key)
    roll, state = _state_rollout(state, config, batch, k_roll, reward_fn, pad_id)
    train_on = state.pending if config.async_mode else roll
    new_state, metrics = update(state, config, optimizer, train_on, k_update)
    metrics |= rollout_metrics(config, train_on)
    if samples:
      metrics["samples"] = rollout_samples(train_on, samples)
    new_state = new_state.replace(key=key, pending=roll if config.async_mode else None)
    return new_state, metrics

  if not jit:
    return step
  # The state is donated: parameters, optimizer moments and the pending rollout are replaced.
  kwargs = {}
  if state_sharding is not None:
    kwargs = dict(in_shardings=(state_sharding, batch_sharding),
                  out_shardings=(state_sharding, None))
  return jax.jit(step, donate_argnums=0, **kwargs)



def make_prime_fn(config: TrainConfig, reward_fn: RewardFn, *, pad_id: int = 0):
  """Async mode: `(state, batch) -> state` with the first pending rollout generated."""

  def prime(state: TrainState, batch) -> TrainState:
    key, k_roll = prime_keys(state.key)
    roll, state = _state_rollout(state, config, batch, k_roll, reward_fn, pad_id)
    return state.replace(key=key, pending=roll)

  return jax.jit(prime)



def make_split_step(config: TrainConfig, reward_fn: Callable[..., Any],
                    optimizer: optax.GradientTransformation, *, pad_id: int = 0,
                    state_sharding: Any = None):
  """Split mode for host-side (Python) rewards: the rollout and the update are compiled
  programs, the reward runs on the host.

  Returns `step(state, batch) -> (state, metrics)`, where `reward_fn(responses [B, T] numpy,
  lengths [B] numpy, batch) -> [B]` runs on the host (e.g. decode the responses and call a
  `PythonReward` with `reader.references(np.repeat(batch.index, G))`); it may also return
  `([B] rewards, {name: float})`, whose named values join the step's metrics (a
  `DatasetTask`'s per-function means).

  Sync mode: rollout, reward, update, in turn. Async mode (`make_split_prime` first): the
  rollout of this batch and the update on the pending one (the last step's rollout, scored)
  are dispatched in that order, and the host scores this rollout while the device runs the
  update; the scored rollout becomes the pending one. The same semantics, keys and samples as
  the fused async step with a JAX reward; the reward is hidden behind the update.

  With `state_sharding` (`train_state_shardings`, one process) the state stays on its mesh:
  every program runs with the mesh set, so the model's layout hints hold, and the state comes
  back on `state_sharding`.
  """
  mesh = None if state_sharding is None else jax.tree.leaves(state_sharding)[0].mesh
  rollout_fn = _split_rollout(config, pad_id)
  finish_fn = _split_finish(config, state_sharding)

  def update_step(state, roll, rewards, key, next_key, prompts, prompt_lengths):
    roll = score(config, roll, rewards)
    state = state.replace(history=recorded(state.history, config, prompts, prompt_lengths,
                                           roll))
    state, metrics = update(state, config, optimizer, roll, key)
    return state.replace(key=next_key), metrics | rollout_metrics(config, roll)

  def update_pending(state, pending, key, next_key):
    state, metrics = update(state, config, optimizer, pending, key)
    return state.replace(key=next_key), metrics | rollout_metrics(config, pending)

  # The state is donated: parameters and optimizer moments are replaced by the update.
  def compiled(fn, state_out):
    out_shardings = None if mesh is None else (state_out, NamedSharding(mesh, P()))
    return jax.jit(fn, donate_argnums=0, out_shardings=out_shardings)

  update_fn = compiled(update_step, state_sharding)
  pending_fn = compiled(update_pending, None if state_sharding is None
                        else state_sharding.replace(pending=None))

  def step(state: TrainState, batch):
    key, k_roll, k_update = step_keys(state.key)
    with _mesh_scope(mesh):
      roll, responses, lengths, acceptance = rollout_fn(
          state.params, state.adapters, batch.tokens, batch.lengths, k_roll,
          state.rollout_drafter_params, state.acceptance)
      if config.async_mode:
        if state.pending is None:
          raise ConfigError("an async split step needs a pending rollout: prime the state "
                            "with make_split_prime first")
        # Dispatched after the rollout: the device runs it while the host scores below. (The
        # pending rollout is not donated: nothing of the new state could reuse its buffers.)
        state, metrics = pending_fn(state.replace(pending=None), state.pending, k_update, key)
      rewards, extra = _host_scores(reward_fn, responses, lengths, batch)
      if config.async_mode:
        # The step's metrics describe the rollout it trained on: the pending one's reward
        # means (unknown after a resume: left out), not this rollout's, held for the next.
        trained_extra = _PENDING_EXTRA.pop(reward_fn, {})
        _PENDING_EXTRA[reward_fn] = extra
        return finish_fn(state, roll, rewards, acceptance, batch.tokens, batch.lengths), {
            **metrics, **trained_extra}
      state, metrics = update_fn(_with_acceptance(state, acceptance), roll, rewards, k_update,
                                 key, batch.tokens, batch.lengths)
    return state, {**metrics, **extra}

  return step


def make_split_prime(config: TrainConfig, reward_fn: Callable[..., Any], *, pad_id: int = 0,
                     state_sharding: Any = None):
  """Async split mode: `(state, batch) -> state` with the first pending rollout generated and
  scored on the host (`make_prime_fn`'s keys), as `make_split_step` then expects."""
  mesh = None if state_sharding is None else jax.tree.leaves(state_sharding)[0].mesh
  rollout_fn = _split_rollout(config, pad_id)
  finish_fn = _split_finish(config, state_sharding)

  def prime(state: TrainState, batch) -> TrainState:
    key, k_roll = prime_keys(state.key)
    with _mesh_scope(mesh):
      roll, responses, lengths, acceptance = rollout_fn(
          state.params, state.adapters, batch.tokens, batch.lengths, k_roll,
          state.rollout_drafter_params, state.acceptance)
      rewards, _PENDING_EXTRA[reward_fn] = _host_scores(reward_fn, responses, lengths, batch)
      return finish_fn(state.replace(key=key), roll, rewards, acceptance, batch.tokens,
                       batch.lengths)

  return prime


def _split_rollout(config: TrainConfig, pad_id: int):
  @jax.jit
  def rollout_fn(params, adapters, tokens, lengths, key, drafter_params, acceptance):
    return rollout(merged_policy(params, adapters), config, tokens, lengths, key, pad_id,
                   drafter_params, acceptance, check_values=False)
  return rollout_fn


def _split_finish(config: TrainConfig, state_sharding: Any):
  """Async split mode: `(state, rollout, rewards [B], counts, prompts, prompt lengths) ->
  state` holding the scored rollout as its pending one, with its counts and, with a history
  drafter, its bank with the rollout recorded (what the fused step's rollout half does)."""

  def finish(state, roll, rewards, acceptance, prompts, prompt_lengths):
    roll = score(config, roll, rewards)
    history = recorded(state.history, config, prompts, prompt_lengths, roll)
    return _with_acceptance(state, acceptance).replace(history=history, pending=roll)

  return jax.jit(finish, donate_argnums=0,
                 out_shardings=None if state_sharding is None else state_sharding)


# Async split mode: each reward function's metrics (per-function means) of the pending rollout,
# reported by the step that trains on it.
_PENDING_EXTRA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _host_scores(reward_fn: Callable[..., Any], responses, lengths, batch):
  """`reward_fn` on the host: `([B] float32 rewards, {name: value} metrics)`."""
  scored = reward_fn(np.asarray(responses), np.asarray(lengths), batch)
  rewards, extra = scored if isinstance(scored, tuple) else (scored, {})
  return np.asarray(rewards, np.float32), extra


def _mesh_scope(mesh):
  return contextlib.nullcontext() if mesh is None else jax.sharding.set_mesh(mesh)
