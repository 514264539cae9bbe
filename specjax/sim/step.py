"""One RL step: rollout, reward, log-prob recompute, update and weight sync, on a schedule.

Stages (seconds), as in the reference system's step table:

  data        `Schedule.data_s` (loading and tokenising prompts)
  prepare     `Schedule.prepare_s` (waking the inference engine, allocating its cache)
  generation  the rollout (`specjax.sim.simulate_rollout`), on the rollout devices
  reward      `Schedule.reward_s`
  log-prob    2 * active params * train tokens / (n_train * peak * train_mfu) per pass (the
              old policy; the reference policy too with `reference_logprobs`), plus one FSDP
              all-gather of the parameters per pass, left exposed after overlap
  training    epochs * 6 * active params * train tokens / (n_train * peak * train_mfu), plus
              per epoch FSDP traffic (two all-gathers of the parameters, a reduce-scatter of
              the gradients, within a scale-up group; the gradient shards all-reduced across
              groups: `parallel.fsdp_seconds`) and for MoE four all-to-alls per layer of the
              tokens' k expert activations; communication hides behind compute up to
              `comm_overlap`: exposed = comm - comm_overlap * min(comm, compute). An
              online-trained drafter adds 6 * its params * train tokens.
  sync        the new weights to the rollout replicas: each rollout device receives its
              shard (param bytes / m), each trainer sends its part of the replicas' copies;
              over the scale-up link when rollout and training share one domain, else the NIC.

Schedules: "sync": every stage in turn; the step is their sum. Async with policy lag k on
split device sets: the rollout side (data, prepare, generation, reward) of step t + k runs
while the trainer does step t, so the step time in steady state is
max(rollout side, train side) + sync for k = 1, and max(rollout side, train side, sync) for
k >= 2 (the transfer overlaps the next rollout, which still uses older weights). Colocated,
the same devices do both phases, so async buys no overlap in this model (its step time is the
sync one); only its staleness differs.

Train tokens: every row's prompt and response (sequences packed).
"""

from __future__ import annotations

import dataclasses

from specjax.sim import _checks as C
from specjax.sim.model import ModelSpec
from specjax.sim.parallel import (Cluster, all_to_all_seconds, fsdp_seconds,
                                  largest_power_of_two, link_bandwidth)
from specjax.sim.rollout import RolloutResult, simulate_rollout
from specjax.sim.speculation import Speculation
from specjax.sim.workload import Workload

STAGES = ("data", "prepare", "generation", "reward", "logprob", "training", "sync")


@dataclasses.dataclass(frozen=True)
class Schedule:
  """How the stages of a step are arranged, and what the trainer does.

  Attributes:
    asynchronous: rollout of a later step overlaps training of this one (split sets only).
    policy_lag: steps between the weights that generated a batch and those it trains (k).
    epochs: passes of the update over each rollout batch (mu).
    reference_logprobs: a KL reference policy adds a second log-prob pass.
    comm_overlap: share of the trainer's communication hidden behind its compute.
    data_s, prepare_s, reward_s: fixed seconds of those stages.
  """

  asynchronous: bool = False
  policy_lag: int = 1
  epochs: int = 1
  reference_logprobs: bool = False
  comm_overlap: float = 0.9
  data_s: float = 0.0
  prepare_s: float = 0.0
  reward_s: float = 0.0

  def __post_init__(self):
    C.require(isinstance(self.asynchronous, bool), "Schedule.asynchronous", self.asynchronous,
              "must be a bool")
    C.positive_int("Schedule.policy_lag", self.policy_lag)
    C.positive_int("Schedule.epochs", self.epochs)
    C.require(C.is_real(self.comm_overlap) and 0 <= self.comm_overlap <= 1,
              "Schedule.comm_overlap", self.comm_overlap, "must be in [0, 1]")
    for field in ("data_s", "prepare_s", "reward_s"):
      C.nonneg(f"Schedule.{field}", getattr(self, field))

  def describe(self, cluster: Cluster) -> str:
    if not self.asynchronous:
      return "sync"
    where = "colocated: no overlap" if cluster.colocated else "split devices"
    return f"async, policy lag {self.policy_lag} ({where})"


@dataclasses.dataclass(frozen=True, eq=False)
class StepBreakdown:
  """Seconds of each stage of one step and of the whole step."""

  label: str
  data: float
  prepare: float
  generation: float
  reward: float
  logprob: float
  training: float
  sync: float
  overall: float
  rollout: RolloutResult

  def stages(self) -> dict[str, float]:
    return {name: getattr(self, name) for name in STAGES}


def _exposed(compute: float, comm: float, overlap: float) -> float:
  return compute + comm - overlap * min(compute, comm)


def logprob_seconds(model: ModelSpec, cluster: Cluster, tokens: float,
                    schedule: Schedule = Schedule()) -> float:
  """The no-gradient forward(s) over the batch that give the old (and reference) log-probs."""
  p, n = cluster.profile, cluster.n_train
  passes = 2 if schedule.reference_logprobs else 1
  compute = passes * 2.0 * model.active_params * tokens / (n * p.peak_flops * p.train_mfu)
  comm = passes * fsdp_seconds(p, model.param_bytes, n, gathers=1, gradients=False)
  return _exposed(compute, comm, schedule.comm_overlap)


def training_seconds(model: ModelSpec, cluster: Cluster, tokens: float,
                     schedule: Schedule = Schedule(), drafter: ModelSpec | None = None) -> float:
  """Forward and backward over the batch, `epochs` times, with FSDP (and EP) traffic."""
  p, n = cluster.profile, cluster.n_train
  flops = 6.0 * model.active_params * tokens
  if drafter is not None:
    flops += 6.0 * drafter.active_params * tokens
  compute = flops / (n * p.peak_flops * p.train_mfu)
  comm = fsdp_seconds(p, model.param_bytes, n, gathers=3, gradients=True)
  if model.is_moe and n > 1:
    ep = largest_power_of_two(min(n, model.n_experts, p.domain))
    routed = tokens / n * model.experts_per_token * model.d_model * model.weight_bytes
    comm += 4 * model.n_layers * all_to_all_seconds(p, routed, ep, p.link_bw)
  return schedule.epochs * _exposed(compute, comm, schedule.comm_overlap)


def sync_seconds(model: ModelSpec, cluster: Cluster, replica: int, replicas: int) -> float:
  """Sending the updated weights to every rollout replica of `replica` devices."""
  p = cluster.profile
  span = cluster.devices if not cluster.colocated else cluster.n_rollout
  bw = link_bandwidth(p, span) * p.collective_eff
  receive = model.param_bytes / replica
  send = replicas * model.param_bytes / cluster.n_train
  return max(receive, send) / bw + p.collective_latency_s


def simulate_step(model: ModelSpec, cluster: Cluster, workload: Workload,
                  speculation: Speculation | None = None, policy: str = "plain",
                  schedule: Schedule = Schedule(), label: str | None = None) -> StepBreakdown:
  """Seconds of one RL step, stage by stage, with the rollout run by `policy`."""
  rollout = simulate_rollout(model, cluster, workload, speculation, policy)
  tokens = workload.train_tokens()
  trained = (speculation.drafter_spec(model) if speculation is not None and policy != "plain"
             and speculation.online_training else None)
  s = dict(data=schedule.data_s, prepare=schedule.prepare_s, generation=rollout.seconds,
           reward=schedule.reward_s, logprob=logprob_seconds(model, cluster, tokens, schedule),
           training=training_seconds(model, cluster, tokens, schedule, trained),
           sync=sync_seconds(model, cluster, rollout.replica, rollout.replicas))
  overall = overall_seconds(s["data"] + s["prepare"] + s["generation"] + s["reward"],
                            s["logprob"] + s["training"], s["sync"], schedule,
                            colocated=cluster.colocated)
  return StepBreakdown(label=label or policy, overall=overall, rollout=rollout, **s)


def overall_seconds(rollout_side: float, train_side: float, sync: float, schedule: Schedule,
                    *, colocated: bool) -> float:
  """A step's seconds from its rollout side (data, prepare, generation, reward), its train
  side (log-probs, training) and the weight sync. In sequence when sync or colocated; async
  on split device sets overlaps the two sides, and with policy lag 1 the next rollout still
  waits for the sync, while a longer lag hides it behind the next step too. (What
  `specjax.rl.DisaggregatedAsync` does; `benchmarks/disaggregated.py` applies this to its
  measured sides.)"""
  if schedule.asynchronous and not colocated:
    if schedule.policy_lag == 1:
      return max(rollout_side, train_side) + sync
    return max(rollout_side, train_side, sync)
  return rollout_side + train_side + sync


@dataclasses.dataclass(frozen=True, eq=False)
class Comparison:
  """Plain, fixed and adaptive speculative rollouts of the same step, and their speedups."""

  plain: StepBreakdown
  fixed: StepBreakdown
  adaptive: StepBreakdown

  def speedup(self, which: str, stage: str = "overall") -> float:
    """Plain's seconds over `which`'s ("fixed" or "adaptive") for a stage or the step."""
    return getattr(self.plain, stage) / getattr(getattr(self, which), stage)


def compare(model: ModelSpec, cluster: Cluster, workload: Workload, speculation: Speculation,
            schedule: Schedule = Schedule()) -> Comparison:
  """The same step with plain, fixed-chain and adaptive speculative rollouts."""
  fixed_name = f"spec {speculation.fixed.name}"
  return Comparison(
      plain=simulate_step(model, cluster, workload, None, "plain", schedule, "plain"),
      fixed=simulate_step(model, cluster, workload, speculation, "fixed", schedule, fixed_name),
      adaptive=simulate_step(model, cluster, workload, speculation, "adaptive", schedule,
                             "spec adaptive"))
