"""specjax.sim: a performance simulator of RL steps with plain and speculative rollouts.

Pure Python and NumPy: it imports without JAX. Measuring the machine at hand runs JAX and
lives above it (`specjax.experiments.device_profile.calibrate_profile`).
A step is rollout + reward + log-prob recompute + update + weight sync (`simulate_step`), on
a sync or k-step async schedule, colocated or on split device sets. The rollout is a sequence
of decoding rounds over a live batch that shrinks as responses end (`simulate_rollout`); each
round is priced by a roofline with efficiency factors per operation class (`hardware`,
`cost`), for dense and MoE models (`ModelSpec`, presets in `MODELS`) on spec-sheet devices
(`device_profile`) or measured ones (`fit_efficiency`, `calibrate_profile`).

  from specjax import sim
  model, (profile, n) = sim.model_spec("qwen3-8b"), sim.parse_devices("32xGB200")
  workload = sim.Workload(512, 16, 256, sim.Lognormal(2048, 0.8, 8192))
  spec = sim.Speculation.chain("eagle3", 3, acceptance=3.3)
  result = sim.compare(model, sim.Cluster(profile, n), workload, spec)
  result.speedup("adaptive")       # plain step seconds / speculative step seconds
  print(sim.reference_report())    # the reference system's 8B table, and its 235B case
"""

from specjax.sim.cost import ForwardTime, RoundTime, forward_time, prefill_seconds, round_time
from specjax.sim.devices import DEVICE_NAMES, device_profile, parse_devices
from specjax.sim.fit import FITTABLE, Measurement, fit_efficiency, predict, prediction_errors
from specjax.sim.hardware import (Curve, DeviceProfile, attention_seconds, logits_seconds,
                                  matmul_seconds)
from specjax.sim.model import ForwardWork, ModelSpec
from specjax.sim.parallel import (Cluster, all_gather_seconds, all_reduce_seconds,
                                  all_to_all_seconds, choose_replica, fsdp_seconds,
                                  kv_peak_tokens)
from specjax.sim.presets import MODELS, default_draft_model, model_spec
from specjax.sim.reference import (REFERENCE_WORKLOADS, ReferenceSetup, project_235b,
                                   reference_report, reproduce_table)
from specjax.sim.rollout import POLICIES, RolloutResult, simulate_rollout
from specjax.sim.speculation import (DRAFTERS, PLAIN, MenuEntry, Speculation,
                                     chain_expected_tokens, per_depth_from_mean)
from specjax.sim.step import (STAGES, Comparison, Schedule, StepBreakdown, compare,
                              logprob_seconds, overall_seconds, simulate_step, sync_seconds,
                              training_seconds)
from specjax.sim.sweep import (Heatmap, save_heatmap, sweep_devices_models,
                               sweep_draft_acceptance)
from specjax.sim.workload import Empirical, Fixed, Lognormal, Workload


__all__ = [
    "all_gather_seconds", "all_reduce_seconds", "all_to_all_seconds", "attention_seconds",
    "chain_expected_tokens", "choose_replica", "Cluster", "compare",
    "Comparison", "Curve", "default_draft_model", "DEVICE_NAMES", "device_profile",
    "DeviceProfile", "DRAFTERS", "Empirical", "fit_efficiency", "FITTABLE", "Fixed",
    "forward_time", "ForwardTime", "ForwardWork", "fsdp_seconds", "Heatmap", "kv_peak_tokens",
    "logits_seconds", "Lognormal", "logprob_seconds", "matmul_seconds", "Measurement",
    "MenuEntry", "model_spec", "MODELS", "ModelSpec", "overall_seconds", "parse_devices",
    "per_depth_from_mean", "PLAIN", "POLICIES", "predict", "prediction_errors",
    "prefill_seconds", "project_235b", "reference_report", "REFERENCE_WORKLOADS",
    "ReferenceSetup", "reproduce_table", "RolloutResult", "round_time", "RoundTime",
    "save_heatmap", "Schedule", "simulate_rollout",
    "simulate_step", "Speculation", "STAGES", "StepBreakdown", "sweep_devices_models",
    "sweep_draft_acceptance", "sync_seconds", "training_seconds", "Workload",
]
