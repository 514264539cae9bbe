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

import functools
from typing import Any, Callable

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.decoding.policy import AcceptanceCounts
from specjax.errors import ConfigError
from specjax.models.lora import merged_policy
from specjax.rl.host_scoring import HostScoring, scored_now, unscored
from specjax.rl.rollouts import (recorded, rollout, rollout_metrics, rollout_samples, score,
                                 scored_rollout)
from specjax.rl.state import RewardFn, Rollout, TrainConfig, TrainState
from specjax.rl.updates import update
from specjax.sharding import on_mesh


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
  `([B] rewards, {name: value})`, whose values join the metrics of the step that trains on
  those rewards: a number as it is, a `[B]` array (NaN where unscored) as its mean over the
  scored rows (a `DatasetTask`'s per-function values, `reward_<name>`).

  With several processes each calls `reward_fn` on the rows of the prompts its devices hold
  (whole groups: `B` is then its own rows, `batch` its own prompts); the rewards meet as one
  global array, the `[B]` metrics are averaged over every process's rows, and a reward that
  fails on one process stops them all (`RewardError` naming it).

  Sync mode: rollout, reward, update, in turn.

  Async mode (`prime` first), one step off-policy as the fused async step, with the same keys,
  samples, losses and parameters: step t dispatches rollout t, waits for the rewards of
  rollout t - 1 (scored in a background thread since step t - 1), dispatches the update on
  rollout t - 1 (which also records rollout t in the history bank and its counts), and starts
  scoring rollout t in the background. So the host scores rollout t while the device runs the
  update on t - 1 and then rollout t + 1: the rewards are hidden behind both unless they take
  longer. Until its rewards arrive, the state's pending rollout is unscored (its rewards
  NaN): `settled(state)` waits for them and returns the state as the fused step holds it, to
  checkpoint.

  Every step also reports `perf_reward_s`, the host's seconds in `reward_fn` on the rollout it
  trains on, and `perf_reward_overlap`, the share of them during which the device had work
  (async mode: 1 less the time the step waited for the rewards with the device idle; 0 in sync
  mode, where the update waits for the rewards).

  With `state_sharding` (`train_state_shardings`) the state stays on its mesh:
  every program runs with the mesh set, so the model's layout hints hold, and the state comes
  back on `state_sharding`.
  """

  def __init__(self, config: TrainConfig, reward_fn: Callable[..., Any],
               optimizer: optax.GradientTransformation, *, pad_id: int = 0,
               state_sharding: Any = None):
    self.config, self.reward_fn = config, reward_fn
    mesh = None if state_sharding is None else jax.tree.leaves(state_sharding)[0].mesh
    self._mesh = mesh

    def update_step(state, roll, rewards, key, next_key, prompts, prompt_lengths):
      roll = score(config, roll, rewards)
      state = state.replace(history=recorded(state.history, config, prompts, prompt_lengths,
                                             roll))
      state, metrics = update(state, config, optimizer, roll, key)
      return state.replace(key=next_key), metrics | rollout_metrics(config, roll)

    def update_async(state, pending, rewards, key, next_key, roll, acceptance, prompts,
                     prompt_lengths):
      # `pending` scored here, or already (rewards None: a resumed or settled state).
      pending = pending if rewards is None else score(config, pending, rewards)
      state, metrics = update(state, config, optimizer, pending, key)
      history = recorded(state.history, config, prompts, prompt_lengths, roll)
      state = _with_acceptance(state, acceptance).replace(history=history,
                                                          pending=unscored(roll), key=next_key)
      return state, metrics | rollout_metrics(config, pending)

    # The state is donated: parameters and optimizer moments are replaced by the update.
    replicated = None if mesh is None else NamedSharding(mesh, P())
    self._rollout = on_mesh(mesh, _split_rollout(config, pad_id))
    self._update = on_mesh(mesh, jax.jit(
        update_step, donate_argnums=0,
        out_shardings=None if mesh is None else (state_sharding, replicated)))
    self._update_async = on_mesh(mesh, jax.jit(
        update_async, donate_argnums=0,
        out_shardings=None if mesh is None else (state_sharding, replicated)))
    self._prime = on_mesh(mesh, jax.jit(
        lambda state, roll, acceptance, prompts, prompt_lengths: _with_acceptance(
            state, acceptance).replace(history=recorded(state.history, config, prompts,
                                                        prompt_lengths, roll),
                                       pending=unscored(roll)),
        donate_argnums=0, out_shardings=state_sharding))
    self._settle = on_mesh(mesh, jax.jit(
        lambda state, rewards: state.replace(pending=score(config, state.pending, rewards)),
        donate_argnums=0, out_shardings=state_sharding))
    # Async mode: the pending rollout's rewards, being scored; or, once settled, what they
    # add to the metrics of the step that trains on it
    # (`pending_metrics`: public, so that a checkpoint can keep them for a resumed run).
    self._scoring: HostScoring | None = None
    self.pending_metrics: dict[str, Any] = {}

  def _generate(self, state: TrainState, batch, key: jax.Array):
    """The rollout of `batch`, dispatched: (rollout, responses, lengths, counts), the rows of
    the responses split as the prompts are."""
    sharding = getattr(batch.tokens, "sharding", None)
    rows = None
    if self._mesh is not None and isinstance(sharding, NamedSharding):
      rows = sharding.spec[0] if sharding.spec else None
    return self._rollout(state.params, state.adapters, batch.tokens, batch.lengths, key,
                         state.rollout_drafter_params, state.acceptance, rows=rows)

  def prime(self, state: TrainState, batch) -> TrainState:
    """Async mode: `state` with the first pending rollout generated (`make_prime_fn`'s keys),
    its rewards scored in the background for the first step."""
    key, k_roll = prime_keys(state.key)
    roll, responses, lengths, acceptance = self._generate(state, batch, k_roll)
    self._scoring = HostScoring(self.reward_fn, responses, lengths, batch,
                                self.config.grpo.group_size)
    self.pending_metrics = {}
    return self._prime(state.replace(key=key), roll, acceptance, batch.tokens, batch.lengths)

  def settled(self, state: TrainState) -> TrainState:
    """`state` with its pending rollout's rewards and advantages (waiting for them): the
    state a checkpoint holds, and the fused async step would. `state` itself in sync mode or
    when already settled."""
    if self._scoring is None:
      return state
    rewards, extra, perf = self._scoring.result()
    self._scoring, self.pending_metrics = None, {**extra, **perf}
    return self._settle(state, rewards)

  def __call__(self, state: TrainState, batch) -> tuple[TrainState, dict[str, Any]]:
    key, k_roll, k_update = step_keys(state.key)
    roll, responses, lengths, acceptance = self._generate(state, batch, k_roll)
    if not self.config.async_mode:
      rewards, extra, perf = scored_now(self.reward_fn, responses, lengths, batch,
                                        self.config.grpo.group_size)
      state, metrics = self._update(_with_acceptance(state, acceptance), roll, rewards,
                                    k_update, key, batch.tokens, batch.lengths)
      return state, {**metrics, **extra, **perf}
    if state.pending is None:
      raise ConfigError("an async split step needs a pending rollout: call step.prime(state, "
                        "batch) first")
    rewards, scored = None, self.pending_metrics  # a settled (or resumed) pending rollout
    if self._scoring is not None:
      rewards, extra, perf = self._scoring.result(busy=roll)
      scored = {**extra, **perf}
    # The pending rollout is not donated: nothing of the new state could reuse its buffers.
    state, metrics = self._update_async(state.replace(pending=None), state.pending, rewards,
                                        k_update, key, roll, acceptance, batch.tokens,
                                        batch.lengths)
    self._scoring = HostScoring(self.reward_fn, responses, lengths, batch,
                                self.config.grpo.group_size)
    self.pending_metrics = {}
    return state, {**metrics, **scored}


def _split_rollout(config: TrainConfig, pad_id: int):
  """The split step's rollout program; with `rows` (the mesh axes the prompts are split
  over), its responses and lengths split the same way, so that each process holds the rows of
  its own prompts (whole groups) for its host rewards."""

  @functools.partial(jax.jit, static_argnames="rows")
  def rollout_fn(params, adapters, tokens, lengths, key, drafter_params, acceptance, rows=None):
    roll, responses, lengths, acceptance = rollout(
        merged_policy(params, adapters), config, tokens, lengths, key, pad_id, drafter_params,
        acceptance, check_values=False)
    if rows is not None:
      responses = jax.lax.with_sharding_constraint(responses, P(rows, None))
      lengths = jax.lax.with_sharding_constraint(lengths, P(rows))
    return roll, responses, lengths, acceptance

  return rollout_fn
