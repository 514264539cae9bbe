"""Devices of a run, how the rollout is laid out on them, and what collectives cost.

Layouts:
- Rollout: the rollout devices form replicas of m devices (tensor parallel for attention and
  dense MLPs, expert parallel for MoE experts, with the same m); the B rows are dealt to the
  replicas, longest first, round robin, so every replica gets a like share of the tail and
  replica 0 (which holds the longest row) finishes last. m is the smallest power of two that
  holds the weights and the peak KV cache of its rows (`usable` of HBM; paged KV: a finished
  row frees its entries), unless given.
- Training: FSDP within a scale-up group of m = min(devices, domain) devices (parameters
  gathered for the forward and the backward, gradients reduce-scattered), the gradient shards
  all-reduced across the groups over the NIC (HSDP), plus, for MoE, expert-parallel
  all-to-alls within a group (EP = the largest power of two <= min(devices, experts, domain)).
- Colocated: rollout and training take turns on all devices; split: disjoint sets.

Collective prices (ring algorithms; n devices, bandwidth bw per device and direction):
  all-reduce      2 (n - 1) / n * bytes / (bw * collective_eff) + latency
  all-gather, reduce-scatter, all-to-all   (n - 1) / n * bytes / (bw * collective_eff) + latency
bw is the scale-up link while n fits in one scale-up domain, else the scale-out NIC.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from specjax.errors import ConfigError
from specjax.sim import _checks as C
from specjax.sim.hardware import DeviceProfile
from specjax.sim.model import ModelSpec


@dataclasses.dataclass(frozen=True)
class Cluster:
  """The devices of a run and how rollout and training share them.

  Attributes:
    profile: the device.
    devices: how many.
    rollout_devices, train_devices: disjoint sets for rollout and training (both, summing to
      at most `devices`), or both None: colocated (each phase on all devices in turn).
    rollout_replica: devices per rollout replica (m); None: the smallest that fits.
    usable: fraction of HBM the rollout's weights and KV cache may take.
  """

  profile: DeviceProfile
  devices: int
  rollout_devices: int | None = None
  train_devices: int | None = None
  rollout_replica: int | None = None
  usable: float = 0.9

  def __post_init__(self):
    C.require(isinstance(self.profile, DeviceProfile), "Cluster.profile", self.profile,
              "must be a DeviceProfile")
    C.positive_int("Cluster.devices", self.devices)
    if (self.rollout_devices is None) != (self.train_devices is None):
      raise ConfigError("pass both rollout_devices and train_devices (split sets), or neither "
                        "(colocated)")
    if self.rollout_devices is not None:
      C.positive_int("Cluster.rollout_devices", self.rollout_devices)
      C.positive_int("Cluster.train_devices", self.train_devices)
      C.require(self.rollout_devices + self.train_devices <= self.devices,
                "Cluster.rollout_devices + train_devices",
                self.rollout_devices + self.train_devices, f"must be <= devices={self.devices}")
    if self.rollout_replica is not None:
      C.positive_int("Cluster.rollout_replica", self.rollout_replica)
      C.require(self.n_rollout % self.rollout_replica == 0, "Cluster.rollout_replica",
                self.rollout_replica, f"must divide the rollout devices ({self.n_rollout})")
    C.fraction("Cluster.usable", self.usable)

  @property
  def colocated(self) -> bool:
    return self.rollout_devices is None

  @property
  def n_rollout(self) -> int:
    return self.devices if self.colocated else self.rollout_devices

  @property
  def n_train(self) -> int:
    return self.devices if self.colocated else self.train_devices

  def describe(self) -> str:
    name = self.profile.name
    if self.colocated:
      return f"{self.devices}x {name}, colocated"
    return (f"{self.devices}x {name}, split: {self.rollout_devices} rollout + "
            f"{self.train_devices} training")


def link_bandwidth(profile: DeviceProfile, span: int) -> float:
  """Per-device bandwidth of a collective over `span` devices."""
  return profile.link_bw if span <= profile.domain else profile.scaleout_bw


def _ring(profile: DeviceProfile, nbytes, n: int, passes: float, bandwidth: float | None):
  if n <= 1:
    return 0.0 * nbytes
  bw = (bandwidth or link_bandwidth(profile, n)) * profile.collective_eff
  return passes * (n - 1) / n * nbytes / bw + profile.collective_latency_s


def all_reduce_seconds(profile: DeviceProfile, nbytes, n: int, bandwidth: float | None = None):
  """All-reduce `nbytes` over n devices (`bandwidth`: the link to use; default by span)."""
  return _ring(profile, nbytes, n, 2.0, bandwidth)


def all_gather_seconds(profile: DeviceProfile, nbytes, n: int, bandwidth: float | None = None):
  """Gather `nbytes` in all (each device holds nbytes / n); reduce-scatter costs the same."""
  return _ring(profile, nbytes, n, 1.0, bandwidth)


def all_to_all_seconds(profile: DeviceProfile, nbytes, n: int, bandwidth: float | None = None):
  """Each device sends and receives `nbytes` spread over the others."""
  return _ring(profile, nbytes, n, 1.0, bandwidth)


def largest_power_of_two(limit: int) -> int:
  return 2 ** int(math.log2(max(limit, 1)))


def fsdp_seconds(profile: DeviceProfile, param_bytes: float, n: int, gathers: int,
                 gradients: bool) -> float:
  """Parameter traffic of a pass over the model on n devices (HSDP beyond one domain):
  `gathers` all-gathers (or reduce-scatters) of the parameters sharded over the m devices of
  a scale-up group, and with `gradients`, the all-reduce of each device's gradient shard
  (param_bytes / m) across the n / m groups over the scale-out NIC."""
  m = min(n, largest_power_of_two(profile.domain))
  seconds = gathers * all_gather_seconds(profile, param_bytes, m, profile.link_bw)
  if gradients and n > m:
    seconds += all_reduce_seconds(profile, param_bytes / m, n // m, profile.scaleout_bw)
  return seconds


def kv_peak_tokens(lengths, prompt_len: int, extra: int = 0) -> int:
  """Most tokens the KV cache holds at once (paged: a finished row frees its entries) while
  rows of `lengths` (longest first) decode in lockstep: max_j j * (prompt_len + L_j + extra),
  the j longest rows all live just before the j-th finishes."""
  lengths = np.asarray(lengths)
  return int((np.arange(1, lengths.size + 1) * (prompt_len + lengths + extra)).max())


def rollout_memory(model: ModelSpec, replica: int, kv_tokens: int,
                   drafter: ModelSpec | None = None) -> float:
  """Bytes per device of a replica of `replica` devices: weights (and the drafter's), and
  `kv_tokens` tokens of KV cache (split over kv heads, replicated beyond)."""
  weights = model.param_bytes + (drafter.param_bytes if drafter is not None else 0.0)
  kv = model.kv_bytes_per_token
  if drafter is not None:
    kv += drafter.kv_bytes_per_token
  return weights / replica + kv * kv_tokens / min(replica, model.n_kv_heads)


def choose_replica(model: ModelSpec, cluster: Cluster, lengths, prompt_len: int,
                   extra_tokens: int = 0, drafter: ModelSpec | None = None) -> int:
  """Devices per rollout replica: `cluster.rollout_replica`, or the smallest power of two
  (dividing the rollout devices, within a scale-up domain) whose memory fits the weights and
  the peak KV cache of its share of `lengths` (all rows' response lengths, longest first)."""
  n = cluster.n_rollout
  budget = cluster.usable * cluster.profile.hbm_bytes
  if cluster.rollout_replica is not None:
    candidates = [cluster.rollout_replica]
  else:
    top = min(n, cluster.profile.domain)
    candidates = [2**i for i in range(int(math.log2(top)) + 1) if n % 2**i == 0]
  need = {}
  for m in candidates:
    mine = np.asarray(lengths)[::n // m]
    need[m] = (rollout_memory(model, m, kv_peak_tokens(mine, prompt_len, extra_tokens), drafter),
               mine.size)
    if need[m][0] <= budget:
      return m
  m = candidates[-1]
  raise ConfigError(
      f"{model.name} does not fit the rollout: {need[m][0] / 1e9:.1f} GB per device with "
      f"replicas of {m} x {cluster.profile.name} ({budget / 1e9:.1f} GB usable: weights + the "
      f"peak KV cache of {need[m][1]} rows of prompt {prompt_len} + responses up to "
      f"{int(np.max(lengths))}); use more rollout devices, a larger rollout replica, fewer "
      "rows or shorter responses")
