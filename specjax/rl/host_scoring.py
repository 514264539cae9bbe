"""Host (Python) rewards for the compiled GRPO programs: a rollout's responses read back to the
host, scored there, and returned as the global `[B]` rewards the update takes.

Used by the split step (`specjax.rl.trainer.SplitStep`) and the disaggregated pipeline
(`specjax.rl.disaggregated.DisaggregatedAsync`): `scored_now` scores a rollout while the caller
waits (sync mode), `HostScoring` in a background thread while the device works on (async
mode), and `unscored` marks a rollout whose rewards are still being computed.

With several processes each scores the rows of the prompts its devices hold (whole groups),
the rewards meet as one global array, per-row metrics are averaged over every process's rows,
and a reward that fails on one process stops them all, naming it.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from specjax.errors import ConfigError, RewardError
from specjax.rl.state import Rollout

__all__ = ["HostScoring", "ReadyWatch", "scored_now", "unscored"]


def scored_now(reward_fn: Callable[..., Any], responses, lengths, batch, group: int
               ) -> tuple[Any, dict[str, Any], dict[str, float]]:
  """`reward_fn` on this process's rows of a rollout, waited for: `([B] global rewards,
  reward metrics, perf metrics)`, with no overlap (the device waits for the rewards).

  Raises:
    whatever the reward raised (on every process, when it failed on any: `RewardError`).
  """
  try:
    rewards, extra, seconds = score_rows(reward_fn, responses, lengths, batch, group)
  except Exception as err:
    every_process_scored(err)
    raise
  every_process_scored(None)
  rewards, extra = as_global(rewards, extra, lengths)
  return rewards, extra, {"perf_reward_s": seconds, "perf_reward_overlap": 0.0}


def unscored(roll: Rollout) -> Rollout:
  """A rollout whose rewards are still being scored: NaN rewards and advantages, so that an
  update on it by mistake shows as a diverged step, never as a silent one."""
  nan = jnp.full_like(roll.rewards, jnp.nan)
  return roll.replace(rewards=nan, advantages=jnp.full_like(roll.advantages, jnp.nan))


def local_rows(x: Any) -> np.ndarray:
  """This process's rows of `x` (split over its first axis only), in order: all of it in one
  process or where it is replicated."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(x)
  blocks = {}
  for shard in x.addressable_shards:
    if any(part.indices(n)[:2] != (0, n) for part, n in zip(shard.index[1:], x.shape[1:],
                                                            strict=True)):
      raise ValueError(f"an array of shape {x.shape} split over its axis > 0 ({x.sharding}): "
                       "host rewards read whole rows")
    blocks.setdefault(shard.index[0].indices(x.shape[0])[0], np.asarray(shard.data))
  return np.concatenate([blocks[start] for start in sorted(blocks)])


def score_rows(reward_fn: Callable[..., Any], responses, lengths, batch, group: int
                ) -> tuple[np.ndarray, dict[str, Any], float]:
  """`reward_fn` on this process's rows of the rollout (all of them in one process), which
  must be whole groups of its prompts: `([n] float32 rewards, metrics, seconds)`."""
  responses, lengths = local_rows(responses), local_rows(lengths)  # waits for the rollout
  batch = jax.tree.map(local_rows, batch)
  prompts = len(jax.tree.leaves(batch)[0])
  if len(lengths) != prompts * group:
    raise ConfigError(f"this process holds {len(lengths)} rollout rows and {prompts} prompts of "
                      f"group size {group}: host rewards score whole groups on the process "
                      "that holds their prompts (make the prompts per step a multiple of the "
                      "devices they are split over)")
  begin = time.perf_counter()
  scored = reward_fn(responses, lengths, batch)
  seconds = time.perf_counter() - begin
  rewards, extra = scored if isinstance(scored, tuple) else (scored, {})
  rewards = np.asarray(rewards, np.float32)
  if rewards.shape != lengths.shape:
    raise RewardError(f"the host reward returned shape {rewards.shape} for {len(lengths)} "
                      "rows: allowed one value per row")
  return rewards, extra, seconds


_MESSAGE_BYTES = 2048  # of a failed process's error, shown by every process


def every_process_scored(error: BaseException | None) -> None:
  """With several processes, each scoring its own rows: raise on every process when the
  rewards failed on any, naming it, so that none waits in the step's collectives for a
  process that stopped. (One process: nothing to agree on.)"""
  if jax.process_count() == 1:
    return
  text = b"" if error is None else f"{type(error).__name__}: {error}".encode()[:_MESSAGE_BYTES]
  mine = np.zeros(_MESSAGE_BYTES + 1, np.uint8)
  mine[0] = error is not None
  mine[1:1 + len(text)] = np.frombuffer(text, np.uint8)
  every = np.asarray(multihost_utils.process_allgather(mine))
  failed = np.flatnonzero(every[:, 0])
  if failed.size and error is None:
    first = int(failed[0])
    message = every[first, 1:].tobytes().rstrip(b"\0").decode(errors="replace")
    raise RewardError(f"the host rewards failed on process {first} of {jax.process_count()} "
                      f"(this is process {jax.process_index()}; {failed.size} failed): "
                      f"{message}")


def as_global(rewards: np.ndarray, extra: dict[str, Any], lengths: jax.Array
               ) -> tuple[Any, dict[str, Any]]:
  """This process's rewards as the rollout's `[B]` (a global array over every process's rows,
  placed as `lengths`), and its metrics with each per-row value (a `[n]` array, NaN where
  unscored: `reward_<name>`) averaged over the rows of every process."""
  rows = {k: np.asarray(v, np.float64) for k, v in extra.items()
          if np.ndim(v) == 1 and len(v) == len(rewards)}
  if isinstance(lengths, jax.Array) and not lengths.is_fully_addressable:
    rewards = jax.make_array_from_process_local_data(lengths.sharding, rewards, lengths.shape)
    # Every process's rows (each as often as any other, where processes share rows).
    rows = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
            for k, v in rows.items()}
  means = {k: float(np.mean(v[~np.isnan(v)])) if (~np.isnan(v)).any() else math.nan
           for k, v in rows.items()}
  return rewards, {**extra, **means}


class HostScoring:
  """A rollout's host rewards, computed in a background thread while the device works on."""

  def __init__(self, reward_fn: Callable[..., Any], responses, lengths, batch, group: int):
    self._lengths = lengths
    self._outcome: tuple | BaseException | None = None
    self._thread = threading.Thread(target=self._score, daemon=True, name="specjax-scoring",
                                    args=(reward_fn, responses, lengths, batch, group))
    self._thread.start()

  def _score(self, *args) -> None:
    try:
      self._outcome = score_rows(*args)
    except BaseException as err:  # noqa: BLE001 (raised to the step that waits for it)
      self._outcome = err

  def result(self, busy: Any = None) -> tuple[Any, dict[str, Any], dict[str, float]]:
    """Wait for the rewards: `([B] rewards, reward metrics, perf metrics)`; `busy` is the
    device work dispatched last (what the device can run while the host waits).

    Raises:
      whatever the reward raised.
    """
    ready = ReadyWatch(busy)
    begin = time.perf_counter()
    self._thread.join()
    end = time.perf_counter()
    failed = self._outcome if isinstance(self._outcome, BaseException) else None
    every_process_scored(failed)
    if failed is not None:
      raise failed
    rewards, extra, seconds = self._outcome
    rewards, extra = as_global(rewards, extra, self._lengths)
    stalled = min(ready.idle(begin, end), seconds)  # the device waited for the rewards
    overlap = 1.0 - stalled / seconds if seconds > 0 else 1.0
    return rewards, extra, {"perf_reward_s": seconds, "perf_reward_overlap": overlap}


class ReadyWatch:
  """When device work finished, stamped by a thread that waits for it, so that how long the
  host waited with the device idle is measured without blocking on the work."""

  def __init__(self, busy: Any):
    self._ready_at = None
    self._thread = None
    if busy is not None:
      self._thread = threading.Thread(target=self._wait, args=(busy,), daemon=True)
      self._thread.start()

  def _wait(self, busy: Any) -> None:
    jax.block_until_ready(busy)
    self._ready_at = time.perf_counter()

  def idle(self, begin: float, end: float) -> float:
    """Seconds of `[begin, end]` after the work finished (all of them without work; none while
    it still runs)."""
    if self._thread is None:
      return max(0.0, end - begin)
    if self._thread.is_alive() or self._ready_at is None:
      return 0.0
    return max(0.0, end - max(begin, self._ready_at))
