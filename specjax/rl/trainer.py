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

import threading
import time
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
from specjax.sharding import on_mesh
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
                    state_sharding: Any = None) -> SplitStep:
  """Split mode for host-side (Python) rewards (`SplitStep`): the rollout and the update are
  compiled programs, the reward runs on the host."""
  return SplitStep(config, reward_fn, optimizer, pad_id=pad_id, state_sharding=state_sharding)


class SplitStep:
  """Split mode for host-side (Python) rewards: `step(state, batch) -> (state, metrics)` with
  the rollout and the update compiled, the reward run on the host between them.

  `reward_fn(responses [B, T] numpy, lengths [B] numpy, batch) -> [B]` runs on the host (e.g.
  decode the responses and call a `PythonReward` with
  `reader.references(np.repeat(batch.index, G))`); it may also return
  `([B] rewards, {name: float})`, whose named values join the metrics of the step that trains
  on those rewards (a `DatasetTask`'s per-function means).

  Sync mode: rollout, reward, update, in turn. Async mode (`prime` first): the rollout of this
  batch and the update on the pending one (the last step's rollout, scored) are dispatched in
  that order, and the host scores this rollout while the device runs the update; the scored
  rollout becomes the pending one. The same semantics, keys and samples as the fused async
  step with a JAX reward; the reward is hidden behind the update.

  Every step also reports `perf_reward_s`, the host's time in `reward_fn` on this step's
  rollout, and `perf_reward_overlap`, the fraction of it during which the device was still
  running the step's update (0 in sync mode, where the update waits for the rewards).

  With `state_sharding` (`train_state_shardings`, one process) the state stays on its mesh:
  every program runs with the mesh set, so the model's layout hints hold, and the state comes
  back on `state_sharding`.
  """

  def __init__(self, config: TrainConfig, reward_fn: Callable[..., Any],
               optimizer: optax.GradientTransformation, *, pad_id: int = 0,
               state_sharding: Any = None):
    self.config, self.reward_fn = config, reward_fn
    mesh = None if state_sharding is None else jax.tree.leaves(state_sharding)[0].mesh

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
      return on_mesh(mesh, jax.jit(fn, donate_argnums=0, out_shardings=out_shardings))

    self._rollout = on_mesh(mesh, _split_rollout(config, pad_id))
    self._finish = on_mesh(mesh, _split_finish(config, state_sharding))
    self._update = compiled(update_step, state_sharding)
    self._update_pending = compiled(update_pending, None if state_sharding is None
                                    else state_sharding.replace(pending=None))
    # Async mode: the reward function's metrics of the pending rollout, reported by the step
    # that trains on it (unknown after a resume: left out).
    self._pending_extra: dict[str, Any] = {}

  def _generate(self, state: TrainState, batch, key: jax.Array):
    """The rollout of `batch`, dispatched: (rollout, responses, lengths, counts)."""
    return self._rollout(state.params, state.adapters, batch.tokens, batch.lengths, key,
                         state.rollout_drafter_params, state.acceptance)

  def _host_scores(self, responses, lengths, batch, busy: Any = None):
    """`reward_fn` on the rollout: `[B]` float32 rewards, its metrics, and the perf metrics,
    `busy` being device work dispatched before scoring (the async update)."""
    responses, lengths = np.asarray(responses), np.asarray(lengths)  # waits for the rollout
    ready = _ReadyWatch(busy)
    begin = time.perf_counter()
    scored = self.reward_fn(responses, lengths, batch)
    end = time.perf_counter()
    rewards, extra = scored if isinstance(scored, tuple) else (scored, {})
    perf = {"perf_reward_s": end - begin, "perf_reward_overlap": ready.overlap(begin, end)}
    return np.asarray(rewards, np.float32), extra, perf

  def prime(self, state: TrainState, batch) -> TrainState:
    """Async mode: `state` with the first pending rollout generated and scored on the host
    (`make_prime_fn`'s keys), as the step then expects."""
    key, k_roll = prime_keys(state.key)
    roll, responses, lengths, acceptance = self._generate(state, batch, k_roll)
    rewards, self._pending_extra, _ = self._host_scores(responses, lengths, batch)
    return self._finish(state.replace(key=key), roll, rewards, acceptance, batch.tokens,
                        batch.lengths)

  def __call__(self, state: TrainState, batch) -> tuple[TrainState, dict[str, Any]]:
    key, k_roll, k_update = step_keys(state.key)
    roll, responses, lengths, acceptance = self._generate(state, batch, k_roll)
    if not self.config.async_mode:
      rewards, extra, perf = self._host_scores(responses, lengths, batch)
      state, metrics = self._update(_with_acceptance(state, acceptance), roll, rewards,
                                    k_update, key, batch.tokens, batch.lengths)
      return state, {**metrics, **extra, **perf}
    if state.pending is None:
      raise ConfigError("an async split step needs a pending rollout: call step.prime(state, "
                        "batch) first")
    # Dispatched after the rollout: the device runs it while the host scores below. (The
    # pending rollout is not donated: nothing of the new state could reuse its buffers.)
    state, metrics = self._update_pending(state.replace(pending=None), state.pending,
                                          k_update, key)
    rewards, extra, perf = self._host_scores(responses, lengths, batch, busy=metrics)
    # The step's metrics describe the rollout it trained on: the pending one's reward means,
    # not this rollout's, which are held for the next step.
    trained_extra, self._pending_extra = self._pending_extra, extra
    state = self._finish(state, roll, rewards, acceptance, batch.tokens, batch.lengths)
    return state, {**metrics, **trained_extra, **perf}


class _ReadyWatch:
  """When device work dispatched before a host computation finished, stamped by a thread that
  waits for it, so the host's overlap with the device is measured without blocking on it."""

  def __init__(self, busy: Any):
    self._ready_at = None
    self._thread = None
    if busy is not None:
      self._thread = threading.Thread(target=self._wait, args=(busy,), daemon=True)
      self._thread.start()

  def _wait(self, busy: Any) -> None:
    jax.block_until_ready(busy)
    self._ready_at = time.perf_counter()

  def overlap(self, begin: float, end: float) -> float:
    """The fraction of `[begin, end]` during which the work was still running (1.0 when it
    still is)."""
    if self._thread is None or end <= begin:
      return 0.0
    if self._thread.is_alive():
      return 1.0
    return float(np.clip((self._ready_at - begin) / (end - begin), 0.0, 1.0))


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
