"""Disaggregated async GRPO: rollouts on one set of devices, updates on another.

Async mode's fused step (`make_train_step`, `async_mode=True`) generates batch t + 1 and
updates on batch t in one program, so the two never run at the same time. Here they are two
programs on two meshes over disjoint devices:

- the rollout program (rollout mesh) generates (and, with a JAX reward, scores) a batch with
  the policy weights
  the rollout side holds (parameters, and the EAGLE-3 head if the drafter has one; MTP and
  Medusa heads are part of the parameters) and carries the speculation policy's counts;
- the update program (train mesh) runs the GRPO updates (and the online drafter update) on
  the rollout generated one step earlier, corrected by truncated importance sampling
  against its behaviour log-probabilities (`GRPOConfig.tis_cap`).

Each step dispatches both; then the new rollout moves to the train mesh and the updated
weights to the rollout mesh with `specjax.sharding.transfer` (device to device, laid out as
the destination wants on the source side first, never through host memory). JAX dispatches
asynchronously, so on accelerators the two programs overlap in wall time. On CPU, XLA runs
one multi-device program at a time: the meshes test the logic, not the overlap
(`benchmarks/disaggregated.py` times each side and prints the bound overlap would reach).

Policy lag k (`policy_lag`): with theta_t the weights after t updates, step t's update
trains theta_t on the rollout of step t - 1 while step t's rollout uses theta_{t-k+1}
(theta_0 before that exists). Every update thus trains on data k versions behind; a weight
transfer has k - 1 steps to arrive. The rollout mesh holds k versions of the weights, k + 1
while a new one arrives (2 at lag 1). Lag 1 is async mode exactly: the same keys
(`step_keys`) and the same values as the fused step, on any meshes.

Rewards: a JAX reward scores each rollout inside the rollout program. A host (Python) reward
(`host_reward=True`, the protocol of `specjax.rl.SplitStep`) scores rollout t between the
meshes, in a background thread (`specjax.rl.host_scoring`), from when rollout t finishes
until update t needs it; the values are the fused async step's with the same reward computed
in JAX. What that hides depends on the lag. At lag 1 rollout t + 2 needs update t's
weights, and update t the rewards of rollout t: the rewards sit on that chain, and the step
grows by about half of any scoring time beyond the difference between the rollout's and the
update's times (a model of the schedule: both 1 s, rewards 0.5 s -> 1.25 s steps). At lag 2
and beyond the rollouts wait for no update of the last step: rewards up to a step's time are
hidden. Slow rewards want `policy_lag >= 2`. `perf_reward_overlap` is measured on the train
mesh: 1 less the share of the reward's time during which it had finished its last update
and waited.

Checkpoints: `settled()` is the fused async mode's `TrainState`. The weight versions in flight
are not part of it: a run restarted from it at lag k > 1 rolls out its first k - 1 steps
with the checkpoint's weights (at lag 1 it continues exactly).

Shape letters: see `specjax` (B rows, B / G prompts, D tree depth).
"""

from __future__ import annotations

import collections
import functools
import time
from typing import Any, Callable

import jax
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh

from specjax.checks import is_int
from specjax.decoding.drafters.eagle3 import Eagle3Weights
from specjax.decoding.drafters.history import HistoryBank
from specjax.decoding.policy import AcceptanceCounts
from specjax.errors import ConfigError
from specjax.models.lora import LoraAdapters, merged_policy
from specjax.models.params import Params
from specjax.rl.distributed import (prompt_batch_shardings, rollout_shardings,
                                    train_state_shardings)
from specjax.rl.host_scoring import HostScoring, unscored
from specjax.rl.rollouts import recorded, rollout, rollout_metrics, score, scored_rollout
from specjax.rl.state import (RewardFn, Rollout, TrainConfig, TrainState,
                              rollout_drafter_params)
from specjax.rl.trainer import prime_keys, step_keys
from specjax.rl.updates import update
from specjax.sharding import DEFAULT_RULES, Rules, on_mesh, replicated, transfer

__all__ = ["DisaggregatedAsync", "PolicyWeights"]



@struct.dataclass
class PolicyWeights:
  """What the rollout side generates with.

  Attributes:
    params: policy parameters (trunk and MTP / Medusa heads).
    drafter: the EAGLE-3 head (None for drafters without parameters of their own).
    adapters: with LoRA, the adapters the rollout merges into `params` (the frozen trunk).
  """

  params: Params
  drafter: Eagle3Weights | None = None
  adapters: LoraAdapters | None = None

  @property
  def policy(self) -> Params:
    return merged_policy(self.params, self.adapters)


@struct.dataclass
class _RolloutSide:
  """The rollout mesh's state besides the weights: the speculation policy's counts (None
  without a carry), a replica of the train state's key, advanced in step with it, and a
  history drafter's bank (None without), which each rollout records into where it runs."""

  acceptance: AcceptanceCounts | None
  key: jax.Array
  history: HistoryBank | None = None


class DisaggregatedAsync:
  """Async GRPO with rollouts on `rollout_mesh` and updates on `train_mesh` (disjoint).

  Usage (one process)::

      run = DisaggregatedAsync(config, reward_fn, optimizer, rollout_mesh, train_mesh,
                               policy_lag=1)
      run.start(state, first_batch)        # primes the first pending rollout
      for batch in batches:
        metrics = run.step(batch)
      state = run.settled()                # a TrainState on the train mesh (checkpointable)

  `config.async_mode` must be True (it needs `grpo.tis_cap`). Batches are host
  `PromptBatch`es (tokens, lengths, answers; with a host reward, whatever it reads, such as
  `index`) of a fixed shape.

  `reward_fn` is a JAX reward (`RewardFn`), or with `host_reward=True` a host reward
  `reward_fn(responses [B, T] numpy, lengths [B] numpy, batch) -> [B] | ([B], metrics)` as
  `SplitStep` takes it, scored in a background thread (see the module). Its metrics, and
  `perf_reward_s` / `perf_reward_overlap`, join the step that trains on those rewards; a
  reward that raises stops the step that needs it, with the error it raised.
  """

  def __init__(self, config: TrainConfig, reward_fn: RewardFn | Callable[..., Any],
               optimizer: optax.GradientTransformation, rollout_mesh: Mesh, train_mesh: Mesh,
               *, policy_lag: int = 1, pad_id: int = 0, rules: Rules = DEFAULT_RULES,
               host_reward: bool = False):
    if not config.async_mode:
      raise ConfigError("DisaggregatedAsync needs TrainConfig(async_mode=True): updates "
                        "train on the rollout of the step before, with grpo.tis_cap set")
    if not is_int(policy_lag) or policy_lag < 1:
      raise ConfigError(f"policy_lag={policy_lag!r} is invalid: must be an int >= 1 (1 = "
                        "one-step off-policy)")
    shared = set(rollout_mesh.devices.flat) & set(train_mesh.devices.flat)
    if shared:
      raise ConfigError(f"the rollout and train meshes share devices "
                        f"{sorted(d.id for d in shared)}; disaggregated mode needs disjoint "
                        "device sets (for one set, use the fused async step)")
    if jax.process_count() > 1:
      raise ConfigError("DisaggregatedAsync runs in one process; with several processes use "
                        "the fused async step (`specjax.rl.sharded_train_step`)")
    self.config, self.reward_fn, self.optimizer = config, reward_fn, optimizer
    self.rollout_mesh, self.train_mesh = rollout_mesh, train_mesh
    self.policy_lag, self.pad_id, self.rules = policy_lag, pad_id, rules
    self.host_reward = host_reward
    self.times: list[dict[str, float]] = []
    # With a host reward: the pending rollout's rewards, being scored; or, once settled,
    # what they add to the metrics of the step that trains on it
    # (`pending_metrics`: public, so that a checkpoint can keep them for a resumed run).
    self._scoring: HostScoring | None = None
    self.pending_metrics: dict[str, Any] = {}

  def start(self, state: TrainState, batch=None) -> None:
    """Place `state` on the two meshes; its arrays are consumed (the first step donates
    them). Without a pending rollout, `batch` (the first prompts) is generated with
    `make_prime_fn`'s keys (scored in the rollout program, or with a host reward in the
    background); a state with one (restored from a checkpoint, which `settled()` scored)
    takes no batch. Every weight version on the rollout side starts as `state`'s weights."""
    if state.pending is None and batch is None:
      raise ConfigError("start(state) with no pending rollout needs the first batch: "
                        "start(state, batch) generates the rollout the first update trains on")
    if state.pending is not None and batch is not None:
      raise ConfigError("start(state, batch): the state already holds a pending rollout (the "
                        "first update's data); call start(state) and pass batch to step()")
    config, reward_fn, pad_id, rules = self.config, self.reward_fn, self.pad_id, self.rules
    host = self.host_reward
    if host and state.pending is not None and not np.isfinite(
        np.asarray(jax.device_get(state.pending.rewards))).all():
      raise ConfigError("start(state): the state's pending rollout has no rewards (NaN: it was "
                        "still being scored); save DisaggregatedAsync.settled(), not state()")
    roll_mesh, train_mesh = self.rollout_mesh, self.train_mesh
    weights = self._weights(state)
    side = _RolloutSide(acceptance=state.acceptance, key=state.key, history=state.history)
    every = replicated(roll_mesh)
    side_shardings = jax.tree.map(lambda _: every, side)

    def rollout_program(weights: PolicyWeights, side: _RolloutSide, batch, prime: bool):
      key, k_roll = prime_keys(side.key) if prime else step_keys(side.key)[:2]
      drafter_params = rollout_drafter_params(side.history, weights.drafter)
      if host:  # the rewards come from the host: (rollout, responses, lengths)
        roll, responses, lengths, acceptance = rollout(
            weights.policy, config, batch.tokens, batch.lengths, k_roll, pad_id,
            drafter_params, side.acceptance, check_values=False)
        out = (unscored(roll), responses, lengths)
      else:
        roll, acceptance = scored_rollout(weights.policy, drafter_params, side.acceptance,
                                          config, batch, k_roll, reward_fn, pad_id)
        out = (roll,)
      return out, _RolloutSide(acceptance=None if side.acceptance is None else acceptance,
                               key=key, history=recorded(side.history, config, batch.tokens,
                                                         batch.lengths, roll))

    pending = state.pending
    if pending is None:
      pending = jax.eval_shape(functools.partial(rollout_program, prime=True), weights, side,
                               batch)[0][0]
    train = state.replace(pending=None, acceptance=None, history=None)
    train_shardings = train_state_shardings(train, train_mesh, config, rules)
    self._pending_shardings = rollout_shardings(pending, train_mesh, rules)
    self._weight_shardings = self._weights_on(state, roll_mesh)
    on_rollout_mesh = rollout_shardings(pending, roll_mesh, rules)
    # The responses [B, T] and lengths [B] split over rows as the rollout's are.
    out_shardings = ((on_rollout_mesh, on_rollout_mesh.tokens, on_rollout_mesh.lengths)
                     if host else (on_rollout_mesh,))
    self._rollout = on_mesh(roll_mesh, jax.jit(
        rollout_program, static_argnums=3,
        in_shardings=(self._weight_shardings, side_shardings, None),
        out_shardings=(out_shardings, side_shardings)))

    def update_program(state: TrainState, pending: Rollout, *rewards):
      if host:  # the host's rewards [B] and their group advantages
        pending = score(config, pending, rewards[0])
      key, _, k_update = step_keys(state.key)
      state, metrics = update(state, config, self.optimizer, pending, k_update)
      return state.replace(key=key), metrics | rollout_metrics(config, pending)

    # The state is donated: parameters and optimizer moments are replaced. (The consumed
    # rollout is not: no output has its shapes, so XLA could not reuse its buffers.)
    rows = self._pending_shardings.rewards  # host rewards [B] arrive split as the rollout's
    self._update = on_mesh(train_mesh, jax.jit(
        update_program,
        in_shardings=(train_shardings, self._pending_shardings) + ((rows,) if host else ()),
        out_shardings=(train_shardings, replicated(train_mesh)), donate_argnums=0))
    self._settle = on_mesh(train_mesh, jax.jit(
        lambda pending, rewards: score(config, pending, rewards),
        in_shardings=(self._pending_shardings, rows), out_shardings=self._pending_shardings))

    self._train = jax.device_put(train, train_shardings)
    self._side = jax.device_put(side, side_shardings)
    self._versions = collections.deque([self._weights_of(self._train)])
    self._scoring, self.pending_metrics = None, {}
    self._updated = None  # the last update's metrics (none yet: the train mesh is idle)
    if state.pending is None:
      out, self._side = self._rollout(self._versions[0], self._side,
                                      self._on_rollout_mesh(batch), True)
      self._pending = transfer(out[0], self._pending_shardings)
      self._score_in_background(out, batch)
      # The train side's key advances as `make_prime_fn` leaves it.
      key = jax.jit(lambda k: prime_keys(k)[0], out_shardings=replicated(train_mesh))
      self._train = self._train.replace(key=key(self._train.key))
    else:
      self._pending = jax.device_put(state.pending, self._pending_shardings)

  def step(self, batch, *, timed: bool = False) -> dict[str, jax.Array]:
    """One step: roll out `batch` with the rollout side's weights while the train side
    updates on the pending rollout; then the rollout moves to the train mesh and the new
    weights to the rollout mesh. Returns the update's metrics (replicated on the train mesh,
    still being computed: JAX dispatches asynchronously).

    `timed=True` waits for each part and appends its seconds to `self.times` (`rollout_s`,
    `update_s`, `transfer_s`): for measurements, as waiting serialises the two sides.
    """
    if not hasattr(self, "_train"):
      raise ConfigError("call start(state, first_batch) before step()")
    clock = [time.perf_counter()]

    def lap(*arrays):
      if timed:
        jax.block_until_ready(arrays)
        clock.append(time.perf_counter())

    out, self._side = self._rollout(self._versions[0], self._side,
                                    self._on_rollout_mesh(batch), False)
    lap(out)
    rewards, scored = (), {}
    if self.host_reward:  # the pending rollout's rewards (scored since the step before)
      rewards, scored = self._pending_rewards(busy=self._updated)
      rewards = (rewards,)
    train, metrics = self._update(self._train, self._pending, *rewards)
    self._updated = metrics  # ready when the train mesh has finished this update
    lap(train, metrics)
    self._pending = transfer(out[0], self._pending_shardings)
    self._score_in_background(out, batch)
    self._versions.append(self._weights_of(train))
    while len(self._versions) > self.policy_lag:
      self._versions.popleft()
    self._train = train
    lap(self._pending, self._versions[-1])
    if timed:
      self.times.append(dict(zip(("rollout_s", "update_s", "transfer_s"),
                                 (b - a for a, b in zip(clock, clock[1:])))))
    return {**metrics, **scored}

  def settled(self) -> TrainState:
    """`state()` with the pending rollout's rewards and advantages (with a host reward,
    waiting for them): what a checkpoint saves, as the fused async step holds it.

    Raises:
      whatever a host reward raised on the pending rollout.
    """
    if self._scoring is not None:
      rewards, scored = self._pending_rewards()
      self._pending = self._settle(self._pending, rewards)
      self.pending_metrics = scored
    return self.state()

  def state(self) -> TrainState:
    """The train state on the train mesh with the pending rollout and the rollout side's
    counts and history bank (the weight versions in flight at lag > 1 are not in it). With a
    host reward the pending rollout may still be being scored (its rewards NaN): `settled()`
    is the state to checkpoint. Its arrays are the live state's: the next `step` donates
    them, so save or copy them first."""
    on_train = lambda tree: None if tree is None else transfer(
        tree, jax.tree.map(lambda _: replicated(self.train_mesh), tree))
    return self._train.replace(pending=self._pending, acceptance=on_train(self._side.acceptance),
                               history=on_train(self._side.history))

  def _score_in_background(self, out: tuple, batch) -> None:
    """With a host reward, start scoring the rollout `out` (rollout, responses, lengths) of
    `batch` while the meshes work on."""
    if self.host_reward:
      _, responses, lengths = out
      self._scoring = HostScoring(self.reward_fn, responses, lengths, batch,
                                  self.config.grpo.group_size)
      self.pending_metrics = {}

  def _pending_rewards(self, busy: Any = None) -> tuple[Any, dict[str, Any]]:
    """The pending rollout's rewards `[B]` and what they add to the metrics: waited for
    (`busy`: the train mesh's last work, whose end starts its wait), or the rewards it already
    holds (settled, or restored from a checkpoint).

    Raises:
      whatever the reward raised, again on every later call (the rollout stays unscored).
    """
    if self._scoring is None:
      return self._pending.rewards, self.pending_metrics
    rewards, extra, perf = self._scoring.result(busy=busy)
    self._scoring = None
    return rewards, {**extra, **perf}

  def _weights_on(self, state: TrainState, mesh: Mesh) -> PolicyWeights:
    shardings = train_state_shardings(state.replace(pending=None), mesh, self.config,
                                      self.rules)
    return self._weights(shardings)

  @staticmethod
  def _weights(state: TrainState) -> PolicyWeights:
    return PolicyWeights(params=state.params, drafter=state.drafter_weights,
                         adapters=state.adapters)

  def _weights_of(self, state: TrainState) -> PolicyWeights:
    """The train state's weights, copied onto the rollout mesh."""
    return transfer(self._weights(state), self._weight_shardings)

  def _on_rollout_mesh(self, batch):
    return jax.device_put(batch, prompt_batch_shardings(batch, self.rollout_mesh, self.rules))
