"""Plans before spending: what one GRPO train step of a configuration needs per device, from
the compiled program and from a formula, before any accelerator is paid for.

`plan(config, devices=8)` builds the train state abstractly (`jax.eval_shape`: no weight is
materialised), lowers and compiles the fused step (`specjax.rl.sharded_train_step`) for the
config's mesh over `devices` fake CPU devices, and reads the compiled program's per-device
`memory_analysis()` (arguments, outputs, temporaries, generated code) and `cost_analysis()`
(FLOPs). Beside it, `estimate` computes the same memory from the shapes and the sharding rules
alone, term by term:

  parameters       the policy's (and the reference's, and an EAGLE-3 head's) shards.
  optimizer state  Adam's moments, sharded as their parameters.
  state and batch  step, key, pending rollout (async mode), speculation counts, prompts.
  gradients        one per parameter, sharded as it (live through the backward pass).
  activations      what the update's backward pass keeps for one minibatch: per layer the
                   inputs of every matmul and the float32 attention scores and probabilities;
                   at the head, the float32 log-probabilities over V, their gradient and the
                   logits' gradient, and the output head's weight gathered whole with its
                   whole float32 gradient (and the embedding's) before the reduce-scatter;
                   with fsdp, every layer's weights gathered whole and kept for the backward
                   pass (compute dtype), except experts split over devices, which are never
                   gathered; an MoE layer's dispatch buffers (with split experts, over all
                   tokens of the device's expert group); MTP and Medusa heads likewise; an
                   EAGLE-3 head trains after the policy's backward, so the larger of the two
                   counts.
  log-prob pass    with several minibatches or epochs (pi_old) or a KL penalty (reference),
                   the update first runs a forward over every row, a minibatch of rows at a
                   time: float32 logits and log-probabilities `[B / M, L, V]`.
  KV cache         the rollout's keys and values (B rows, S = P + T + N + 1 slots), the
                   drafter's caches included.
  prefill logits   the rollout's prefill: float32 logits at each row's last prompt position.

The three phases run one after the other, so the estimated temporaries are the largest of
the minibatch update (gradients + activations), the log-prob pass and the rollout (KV cache +
prefill logits); the estimated total adds the arguments. Arguments equal outputs (the state
is donated), so the total counts them once. Each term is per device: rows divided over the
mesh axes of the "batch" rule, heads, MLP and vocabulary over those of theirs.

What the numbers are not:
- Fake CPU devices compile with XLA:CPU, which computes bfloat16 dots and elementwise ops in
  float32 and fuses differently from a GPU or TPU, so the compiled temporaries are those of
  this backend; arguments (the state) are exact on every backend. The estimate is printed
  twice: with float32 activations (what XLA:CPU keeps, compared with the compiled program)
  and with the model's compute dtype (what an accelerator keeps).
- XLA counts a loop body once, with no trip count: the compiled FLOPs are one decode round,
  one prefill and one minibatch update, not a step. The analytical FLOPs are per step: every
  row through prompt and response once in the rollout (the work of plain decoding; a
  speculative rollout verifies more tokens per forward in fewer forwards), and the update's
  forward and backward passes (2 and 4 FLOPs per weight and token, plus attention).
- Adaptive speculation is planned with its fixed `rollout.tree_widths` tree (the largest of its
  menu).

Shape letters: see `specjax` (B rows, G group size, P prompt buffer, T max new tokens,
L = P + T, S cache slots, N tree nodes, E d_model, F MLP width, V vocab, W draft vocab,
Q query heads, K kv heads, H head_dim, J training-time-test steps).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from specjax.checks import is_int, is_number
from specjax.decoding import Eagle3Weights
from specjax.errors import ConfigError
from specjax.experiments.grpo import ExperimentConfig, abstract_state, task_records, with_shardings
from specjax.models.config import REMAT_POLICIES
from specjax.rl.data import PromptReader
from specjax.rl.distributed import prompt_batch_shardings, sharded_train_step, train_state_shardings
from specjax.sharding import MeshConfig, logical_to_mesh

__all__ = ["Compiled", "Estimate", "Plan", "estimate", "estimate_config", "fake_devices", "plan"]

GIB = 2**30


# Fake CPU devices cost ~1.2 ms and ~0.15 MB of host memory each to create (4096: 4.9 s,
# 0.6 GB on a 2-core CPU), and the step compiles for every one: 100,000 ran for minutes.
MAX_FAKE_DEVICES = 4096


def fake_devices(n: int) -> list[jax.Device]:
  """`n` CPU devices to compile for: asks JAX for `n` CPU devices when its backend has not
  started yet (`jax_num_cpu_devices`, which overrides XLA_FLAGS'
  --xla_force_host_platform_device_count), else uses the first `n` it already has.

  Raises:
    ConfigError: `n` is not an int in [1, MAX_FAKE_DEVICES], or JAX already started with
      fewer CPU devices.
  """
  if not is_int(n) or not 1 <= n <= MAX_FAKE_DEVICES:
    raise ConfigError(f"devices={n!r} is invalid: must be an int in [1, {MAX_FAKE_DEVICES}] "
                      "fake CPU devices (each costs host memory and time to create), or a list "
                      "of devices; plan a larger mesh with its data-parallel axis cut down")
  try:
    if jax.config.jax_num_cpu_devices < n:
      jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:  # the backend is up: its device count is fixed now
    pass
  cpus = jax.devices("cpu")
  if len(cpus) < n:
    raise ConfigError(
        f"devices={n} is invalid here: JAX was already initialised with {len(cpus)} CPU "
        f"device(s) in this process, and the count cannot change once it has started. Plan "
        f"in a fresh process (`specjax plan` sets the count itself), or set "
        f"jax.config.update('jax_num_cpu_devices', {n}) (or XLA_FLAGS="
        f"--xla_force_host_platform_device_count={n}) before anything touches a device")
  return cpus[:n]


@dataclasses.dataclass(frozen=True)
class Compiled:
  """Per-device bytes of a compiled program (`Compiled.memory_analysis()`)."""

  arguments: int
  outputs: int
  aliased: int
  temporaries: int
  generated_code: int

  @property
  def total(self) -> int:
    """Peak bytes: arguments, outputs that are not donated arguments' buffers, temporaries
    and code."""
    return self.arguments + self.outputs - self.aliased + self.temporaries + self.generated_code


@dataclasses.dataclass(frozen=True)
class Estimate:
  """The analytical per-device bytes of one train step (see the module docstring), and its
  FLOPs per device."""

  parameters: int
  optimizer_state: int
  state_and_batch: int
  gradients: int
  activations: int
  logprob_pass: int
  kv_cache: int
  prefill_logits: int
  rollout_flops: float
  update_flops: float
  merged_policy: int = 0

  @property
  def arguments(self) -> int:
    return self.parameters + self.optimizer_state + self.state_and_batch

  @property
  def minibatch(self) -> int:
    """The minibatch update's temporaries: gradients and the backward's activations."""
    return self.gradients + self.activations

  @property
  def rollout(self) -> int:
    """The rollout's temporaries: caches, the prefill's logits and, with LoRA, the merged
    projections it decodes with."""
    return self.kv_cache + self.prefill_logits + self.merged_policy

  @property
  def temporaries(self) -> int:
    return max(self.minibatch, self.logprob_pass, self.rollout)

  @property
  def total(self) -> int:
    return self.arguments + self.temporaries

  @property
  def flops(self) -> float:
    return self.rollout_flops + self.update_flops


@dataclasses.dataclass(frozen=True)
class Plan:
  """A configuration's train step compiled for a mesh, beside its analytical estimate.

  Attributes:
    name: what was planned (the config file).
    mesh: mesh axis sizes, {"data": ., "fsdp": ., "tensor": ., "expert": .}.
    hbm_gib: memory per device to fit in.
    shapes: the step's sizes (rows, prompt buffer, new tokens, cache slots, minibatch rows,
      rows per device, parameter counts, dtypes).
    compiled: per-device bytes of the step as the devices' backend compiled it (XLA:CPU for
      fake CPU devices).
    compiled_flops: per device, XLA's count (each loop body once).
    estimate: the analytical per-device bytes and FLOPs on an accelerator, activations in
      the model's compute dtype.
    estimate_here: the same with activations in float32, as XLA:CPU computes bfloat16 and
      float16 (equal to `estimate` for a float32 model): what `compiled` is compared with on
      fake CPU devices (`compared`).
    largest: the largest arrays of the compiled program (HLO shape, bytes per device): where
      compiled and analytical disagree, these name the term.
    lower_s: seconds to trace and lower.
    compile_s: seconds to compile.
  """

  name: str
  mesh: dict[str, int]
  hbm_gib: float
  shapes: dict[str, Any]
  compiled: Compiled
  compiled_flops: float
  estimate: Estimate
  estimate_here: Estimate
  largest: tuple[tuple[str, int], ...]
  lower_s: float
  compile_s: float
  platform: str = "cpu"

  @property
  def devices(self) -> int:
    return math.prod(self.mesh.values())

  @property
  def fits(self) -> bool:
    """Whether the compiled step's peak per device fits in `hbm_gib`."""
    return self.compiled.total <= self.hbm_gib * GIB

  @property
  def compared(self) -> Estimate:
    """The estimate the compiled program is held against: float32 activations on XLA:CPU,
    the compute dtype on an accelerator."""
    return self.estimate_here if self.platform == "cpu" else self.estimate

  @property
  def ratio(self) -> float:
    """Compiled total / analytical total per device (`compared`)."""
    return self.compiled.total / max(self.compared.total, 1)

  def format(self) -> str:
    """The plan as a table: compiled and analytical bytes per device, side by side."""
    s, c, h, e = self.shapes, self.compiled, self.estimate_here, self.estimate
    unit, scale = ("GiB", GIB) if max(c.total, e.total) >= GIB else ("MiB", 2**20)
    g = lambda n: f"{n / scale:9.2f}"
    blank = f"{'':>9}"
    both = lambda f: (blank, g(f(h)), g(f(e)))
    mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items() if k != "expert" or v != 1)
    backend = f"XLA:{self.platform.upper()}"
    compared = "XLA:CPU" if self.platform == "cpu" else s["dtype"]
    rows = [
        ("parameters", *both(lambda x: x.parameters),
         f"{s['parameters'] / 1e9:.3f}B weights, {s['param_dtype']}"
         + ("" if s["lora"] is None else f", + {s['lora']['trained'] / 1e6:.2f}M LoRA "
            f"(rank {s['lora']['rank']}), float32")),
        ("optimizer state", *both(lambda x: x.optimizer_state),
         "Adam moments" + ("" if s["lora"] is None else " of the adapters")),
        ("state and batch", *both(lambda x: x.state_and_batch), "step, key, pending, prompts"),
        ("= arguments", g(c.arguments), *both(lambda x: x.arguments)[1:], ""),
        ("gradients", *both(lambda x: x.gradients),
         "as the parameters" if s["lora"] is None else "as the adapters"),
        ("activations", *both(lambda x: x.activations),
         f"{s['minibatch_rows_per_device']} rows x L={s['sequence']} per device"),
        ("  minibatch update", *both(lambda x: x.minibatch), "gradients + activations"),
        ("  log-prob pass", *both(lambda x: x.logprob_pass),
         f"float32 [{s['minibatch_rows_per_device']}, L, V] logits, log-probs"),
        ("KV cache", *both(lambda x: x.kv_cache),
         f"{s['rows_per_device']} rows x S={s['cache_slots']} per device, {s['dtype']}"),
        ("prefill logits", *both(lambda x: x.prefill_logits), "float32 [rows, V]"),
        *([] if s["lora"] is None else [
            ("merged policy", *both(lambda x: x.merged_policy),
             "the adapted projections, merged for decoding")]),
        ("  rollout", *both(lambda x: x.rollout),
         "KV cache + prefill logits" + ("" if s["lora"] is None else " + merged policy")),
        ("= temporaries", g(c.temporaries), *both(lambda x: x.temporaries)[1:],
         "analytical: the largest phase"),
        ("outputs not donated", g(c.outputs - c.aliased), blank, blank, "metrics"),
        ("generated code", g(c.generated_code), blank, blank, ""),
        ("= total", g(c.total), *both(lambda x: x.total)[1:],
         f"compiled / analytical = {self.ratio:.2f}"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [
        f"plan: {self.name} on {self.devices} "
        + ("fake CPU devices" if self.platform == "cpu" else f"{self.platform} device(s)")
        + f", mesh {mesh}",
        f"step: {s['prompts']} prompts x G={s['group_size']} = {s['rows']} rows, P={s['prompt']} "
        f"T={s['new_tokens']} (L={s['sequence']}), drafter {s['drafter']}, "
        f"{s['minibatches']} minibatch(es) of {s['minibatch_rows']} rows",
        f"{'':<{width}}  {'compiled':>9}  {'analytical':>20}",
        f"{'per device, ' + unit:<{width}}  {backend:>9}  {'XLA:CPU':>9}  "
        f"{s['dtype']:>9}",
    ]
    lines += [f"{name:<{width}}  {comp}  {here}  {accel}  {note}".rstrip()
              for name, comp, here, accel, note in rows]
    if abs(self.ratio - 1) <= 0.1:
      lines.append(f"compiled and analytical ({compared}) agree within 10%")
    else:
      a = self.compared
      lines.append(f"compiled differs from analytical ({compared}) by more than 10%: arguments"
                   f" x{c.arguments / max(a.arguments, 1):.2f}, temporaries x"
                   f"{c.temporaries / max(a.temporaries, 1):.2f}; largest compiled arrays: "
                   + ", ".join(f"{shape} {size / GIB:.2f} GiB" for shape, size in self.largest))
    verdict = "fits" if self.fits else "does NOT fit"
    hbm = self.hbm_gib * GIB
    lines.append(f"{verdict} in {self.hbm_gib:g} GiB per device: compiled peak "
                 f"{100 * c.total / hbm:.0f}% of it; analytical on an accelerator "
                 f"({s['dtype']} activations) {100 * e.total / hbm:.0f}%")
    flop, fscale = ("TFLOP", 1e12) if e.flops >= 1e12 else ("GFLOP", 1e9)
    lines.append(f"FLOPs per device: analytical per step {e.flops / fscale:.1f} {flop} (trunk; "
                 f"rollout {e.rollout_flops / fscale:.1f}, update {e.update_flops / fscale:.1f});"
                 f" compiled {self.compiled_flops / fscale:.1f} {flop} (XLA counts each loop "
                 "body once)")
    by_remat = ", ".join(f"{policy} {total / GIB:.2f}" for policy, total in
                         s["total_by_remat"].items())
    lines.append(f"analytical total on an accelerator by model.remat (GiB): {by_remat}; this "
                 f"plan: {s['remat']}")
    lines.append(f"lowered in {self.lower_s:.1f}s, compiled in {self.compile_s:.1f}s")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The analytical estimate


def _bytes(tree: Any) -> int:
  """Per-device bytes of a tree of `jax.ShapeDtypeStruct`s that carry their shardings."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))


def _split(mesh: Mesh, logical: str, size: int) -> int:
  """Into how many parts the sharding rules split a dimension `logical` of `size`."""
  axes = logical_to_mesh(P(logical), mesh, (size,))[0]
  axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape[a] for a in axes)


def _layer_bytes(e: int, q: int, k: int, h: int, f: int, keys: int, c: int,
                 tq: int, tk: int, tf: int) -> int:
  """Bytes one transformer block keeps per token for its backward pass: the residual stream
  in and after attention, both norms' outputs, q, k, v, the attention output, the MLP's gate,
  up and their product (compute dtype, `c` bytes), and float32 attention scores and
  probabilities over `keys` positions (XLA keeps both). `tq`, `tk`, `tf` are the tensor
  splits of Q, K and F."""
  return (c * (4 * e + 2 * q * h // tq + 2 * k * h // tk + 3 * f // tf)
          + 2 * 4 * (q // tq) * keys)


def _matmul_weights(model) -> int:
  """Weights a token meets in the trunk's matmuls (output head included): of an MoE layer,
  the router and its k experts."""
  e, q, k, h = model.d_model, model.n_heads, model.n_kv_heads, model.head_dim
  mlp = (e * model.n_experts + 3 * e * model.experts_per_token * model.expert_dim
         if model.is_moe else 3 * e * model.mlp_dim)
  return model.n_layers * (e * (q + 2 * k) * h + q * h * e + mlp) + e * model.vocab_size


def _mlp_weights(model, tf: int) -> int:
  """One layer's MLP weights with the MLP width split `tf` ways: of an MoE layer, the router
  and every expert."""
  if model.is_moe:
    return model.d_model * model.n_experts * (1 + 3 * model.expert_dim // tf)
  return 3 * model.d_model * model.mlp_dim // tf


def estimate(config, train_config, state, batch, mesh: Mesh, *,
             activation_bytes: int | None = None) -> Estimate:
  """The analytical per-device bytes and FLOPs of one train step (module docstring).

  Args:
    config: the `ExperimentConfig`.
    train_config: its `TrainConfig` (the fixed-tree one the step is compiled with).
    state: the abstract `TrainState` with shardings (`jax.ShapeDtypeStruct(..., sharding=)`).
    batch: the abstract prompt batch with shardings.
    mesh: the mesh.
    activation_bytes: bytes per activation element (default: the model's compute dtype's;
      4 models XLA:CPU, which computes bfloat16 and float16 in float32). KV caches keep the
      compute dtype either way.
  """
  model, gc, rc = config.model, config.grpo, train_config.rollout
  cache_bytes = np.dtype(model.compute_dtype).itemsize
  c = cache_bytes if activation_bytes is None else activation_bytes
  prompts, p = batch.tokens.shape
  rows = prompts * gc.group_size
  t = rc.max_new_tokens
  l = p + t
  nodes = 0 if rc.tree is None else rc.tree.num_nodes
  slots = min(p + t + nodes + 1, model.max_position)
  rows_dev = rows // _split(mesh, "batch", prompts)
  mb = rows // gc.num_minibatches
  mb_dev = mb // _split(mesh, "batch", mb)
  e, q, k, h, f, v = (model.d_model, model.n_heads, model.n_kv_heads, model.head_dim,
                      model.mlp_dim, model.vocab_size)
  tq, tk, tf, tv = (_split(mesh, "heads", q), _split(mesh, "kv_heads", k),
                    _split(mesh, "mlp", model.expert_dim if model.is_moe else f),
                    _split(mesh, "vocab", v))
  dispatch, tx = 0, 1
  if model.is_moe:
    # A token's MLP activations are its k experts' (F = k x one expert's width), and the
    # grouped dispatch keeps its k gathered inputs and k outputs ([k, E] each). With the
    # experts split tx ways (`moe.experts_parallel`), a device runs its experts on the tokens
    # of all tx devices of its group: the gathered tokens and the reduce-scatter's input
    # ([E] each), and every pair's input, SwiGLU and output, per token of the group.
    ke, fe = model.experts_per_token, model.expert_dim
    f = ke * fe
    tx = _split(mesh, "expert", model.n_experts)
    dispatch = (tx * (2 * e + ke * (2 * e + 3 * fe // tf)) if tx > 1 else 2 * ke * e) * c

  # With LoRA the optimizer trains the adapters alone; the rollout decodes with the adapted
  # projections merged into a copy of the trunk's.
  adapters = state.adapters
  params = _bytes(state.params) + _bytes(state.ref_params) + _bytes(adapters)
  opt = _bytes(state.opt_state)
  grads = _bytes(state.params if adapters is None else adapters)
  merged = 0 if adapters is None else sum(
      _bytes(layer[name]) for layer, adapted in zip(state.params["layers"],
                                                   adapters.factors["layers"], strict=True)
      for name in adapted)
  if state.drafter is not None:
    params += _bytes(state.drafter.weights)
    if state.drafter.opt_state is not None:  # an EAGLE-3 head, or a draft model distilled
      opt += _bytes(state.drafter.opt_state)
      weights = state.drafter.weights
      grads += _bytes(weights.params if isinstance(weights, Eagle3Weights) else weights)
  # The step reads the prompts' tokens, lengths and answers (jit drops the unread `index`).
  # A history drafter's bank is replicated: every device holds all of it.
  other = _bytes((state.step, state.key, state.pending, state.acceptance, state.history,
                  batch.tokens, batch.lengths, batch.answers))

  # Update: one minibatch's forward kept for the backward pass (`model.remat`: per layer
  # everything, the projections' outputs, or the layer's input; a rematerialised layer's
  # whole activations are live again while its backward runs, one layer at a time).
  layer = _layer_bytes(e, q, k, h, f, l, c, tq, tk, tf) + dispatch
  kept = {"none": layer,
          "dots": c * (3 * e + q * h // tq + 2 * k * h // tk + 2 * f // tf),
          "full": c * e}[model.remat]
  token = model.n_layers * kept + (layer if model.remat != "none" else 0) + c * e
  head = (3 * 4 + c) * v // tv  # float32 log-probs, their and the logits' gradients; + cast
  token += head
  eagle_token = 0
  if train_config.drafter_training.loss_weight:
    mtp = model.num_mtp_modules
    token += mtp * (_layer_bytes(e, q, k, h, f, l, c, tq, tk, tf) + c * 2 * e + head)
    token += model.num_medusa_heads * (model.medusa_layers * 2 * c * e + head)
    eagle = train_config.eagle3
    if eagle is not None:
      # The head trains after the policy's backward, on its forward's kept [3E] features and
      # the target's float32 log-probabilities over V (the logits die as log_softmax reads
      # them; the shifted targets are a slice read in place: one [V] buffer per token, as an
      # H200 compile of the 0.6B preset keeps, docs/accelerator-h200.md), then per step j
      # the draft layer over [2E] inputs attending to (j + 1) L keys, and float32
      # log-probabilities over W, their gradient and the logits'.
      ec, w = eagle.config, eagle.config.draft_vocab_size
      eagle_token = 4 * v // tv + c * 3 * e
      eagle_token += sum(_layer_bytes(ec.d_model, ec.n_heads, ec.n_kv_heads, ec.head_dim,
                                      ec.mlp_dim, (j + 1) * l, c, tq, tk,
                                      _split(mesh, "mlp", ec.mlp_dim))
                         + c * 2 * ec.d_model + (3 * 4 + c) * w
                         for j in range(train_config.drafter_training.ttt_steps))
  # Weights split over fsdp are gathered whole for the forward and kept for the backward
  # (in the compute dtype, split only by tensor); the output head's gradient and the
  # embedding lookup's are whole float32 [E, V] buffers until reduce-scattered (with LoRA
  # they have none).
  # Experts split over devices are never gathered (each runs where it lives): of their
  # layer, only the router is.
  mlp = e * model.n_experts if tx > 1 else _mlp_weights(model, tf)
  layer_weights = e * (q // tq + 2 * k // tk) * h + q // tq * h * e + mlp
  gathered = model.n_layers * layer_weights * c if _split(mesh, "embed", e) > 1 else 0
  weight_bytes = np.dtype(model.weight_dtype).itemsize
  head_grads = 2 * 4 if adapters is None else 0
  activations = (mb_dev * l * max(token, eagle_token) + gathered
                 + e * v // tv * (weight_bytes + head_grads))

  # Rollout: the caches the decode loop carries, and the prefill's logits.
  per_row_slot = 2 * (k // tk) * h * cache_bytes
  cache_layers = model.n_layers
  if rc.drafter is not None:
    cache_layers += model.num_mtp_modules + (1 if train_config.eagle3 is not None else 0)
  kv = rows_dev * slots * cache_layers * per_row_slot
  if state.history is not None:  # each call row's prompt + earlier answers, int32 (`init`)
    kv += rows * state.history.lengths.shape[1] * slots * 4
  prefill = rows_dev * 4 * v // tv  # the head runs at each row's last prompt position
  logprob_pass = 0
  if gc.num_minibatches > 1 or gc.num_epochs > 1 or gc.beta > 0:
    # float32 logits and log-probabilities of a minibatch of rows at a time
    logprob_pass = mb_dev * l * 2 * 4 * v // tv

  weights = _matmul_weights(model)
  attention = lambda queries, keys: 4 * model.n_layers * queries * keys * q * h  # QK^T, PV
  passes = 1 + (gc.num_minibatches > 1 or gc.num_epochs > 1) + (gc.beta > 0)
  # A trained forward costs 3 passes (forward, input and weight gradients); with LoRA's frozen
  # weights, 2 (the adapters' thin matmuls are not counted).
  trained_passes = 3 if adapters is None else 2
  rollout_flops = rows * (2 * weights * l + attention(l, l / 2))
  update_flops = rows * l * 2 * weights * (trained_passes * gc.num_epochs + passes - 1)
  update_flops += rows * attention(l, l / 2) * (trained_passes * gc.num_epochs + passes - 1)
  n = math.prod(mesh.shape.values())
  return Estimate(parameters=params, optimizer_state=opt, state_and_batch=other,
                  gradients=grads, activations=activations, logprob_pass=logprob_pass,
                  kv_cache=kv,
                  prefill_logits=prefill, rollout_flops=rollout_flops / n,
                  update_flops=update_flops / n, merged_policy=merged)


# ---------------------------------------------------------------------------------------------
# Compiling the step

_HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
              "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_HLO_ARRAY = re.compile(r"\b(" + "|".join(_HLO_BYTES) + r")\[([0-9,]*)\]")


def _largest_arrays(hlo: str, count: int = 3) -> tuple[tuple[str, int], ...]:
  """The `count` largest distinct array shapes in an HLO module's text, with their bytes."""
  sizes = {f"{dtype}[{dims}]": _HLO_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
           for dtype, dims in set(_HLO_ARRAY.findall(hlo))}
  return tuple(sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))[:count])


def _abstract_step(config, device_mesh: Mesh):
  """The fixed-tree `TrainConfig` of `config`, and its train state and first prompt batch as
  `jax.ShapeDtypeStruct`s carrying their shardings on `device_mesh` (no weight is made)."""
  tc = config.fixed_tree().train_config()
  tok = config.task.tokenizer
  reader = PromptReader(task_records(config.task, "train"),
                        batch_size=config.rollout.prompts_per_step, pad_id=tok.pad_id,
                        shuffle=False)
  host_batch = reader.batch_at(0)
  # The step planned drafts the fixed tree (adaptive costs need real weights to measure), and
  # a fixed-tree step keeps no acceptance counts: an adaptive config's are left out (a few
  # bytes).
  abstract = abstract_state(config, tc, config.optimizer(), host_batch).replace(acceptance=None)
  state = with_shardings(abstract, train_state_shardings(abstract, device_mesh, tc))
  batch = with_shardings(host_batch, prompt_batch_shardings(host_batch, device_mesh))
  return tc, state, batch


def estimate_config(config, devices: int | list[jax.Device], mesh=None, *,
                    activation_bytes: int | None = None) -> Estimate:
  """`estimate` of `config`'s train step on `devices` (fake CPU devices, or the devices
  themselves) and `mesh` (default `config.mesh`), without lowering or compiling it."""
  devs = fake_devices(devices) if isinstance(devices, numbers.Number) else list(devices)
  device_mesh = (config.mesh if mesh is None else mesh).make(devs)
  tc, state, batch = _abstract_step(config, device_mesh)
  return estimate(config, tc, state, batch, device_mesh, activation_bytes=activation_bytes)


def plan(config, devices: int | list[jax.Device], mesh=None, hbm_gib: float = 80.0, *,
         name: str = "config") -> Plan:
  """Compile `config`'s train step for `devices` fake CPU devices; see the module docstring.

  Args:
    config: an `ExperimentConfig`.
    devices: how many fake CPU devices (`fake_devices`), or the devices themselves.
    mesh: a `MeshConfig` (default: `config.mesh`).
    hbm_gib: memory per device the step must fit in.
    name: what to call the config in the report.

  Raises:
    ConfigError: the config is not an ExperimentConfig, the mesh does not cover the
      devices, or JAX already runs with fewer CPU devices than asked for.
  """
  if not isinstance(config, ExperimentConfig):
    raise ConfigError(f"config is a {type(config).__name__}: plan needs an ExperimentConfig "
                      "(see configs/qwen3_1p7b_grpo.py)")
  if not is_number(hbm_gib) or not hbm_gib > 0:
    raise ConfigError(f"hbm_gib={hbm_gib!r} is invalid: must be a number > 0")
  mesh_config = config.mesh if mesh is None else mesh
  if not isinstance(mesh_config, MeshConfig):
    raise ConfigError(f"mesh={mesh!r} is invalid: must be a MeshConfig(data=, fsdp=, tensor=, "
                      "expert=)")
  devs = fake_devices(devices) if isinstance(devices, numbers.Number) else list(devices)
  try:
    device_mesh = mesh_config.make(devs)
  except ConfigError:
    sizes = dataclasses.asdict(mesh_config)
    raise ConfigError(
        "mesh " + ", ".join(f"{k}={v}" for k, v in sizes.items() if k != "expert" or v != 1)
        + f" does not fit "
        f"{len(devs)} devices: the sizes must multiply to {len(devs)}, or one be -1 and the "
        f"others' product divide {len(devs)}") from None

  start = time.perf_counter()
  tc, state, batch = _abstract_step(config, device_mesh)
  sharding = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
  step = sharded_train_step(tc, config.task.reward, config.optimizer(), sharding(state),
                            sharding(batch), pad_id=config.task.tokenizer.pad_id)
  lowered = step.lower(state, batch)
  lower_s = time.perf_counter() - start
  start = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - start

  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  est = estimate(config, tc, state, batch, device_mesh)
  here = estimate(config, tc, state, batch, device_mesh, activation_bytes=4)
  prompts, p = batch.tokens.shape
  rows = prompts * config.grpo.group_size
  mb = rows // config.grpo.num_minibatches
  nodes = 0 if tc.rollout.tree is None else tc.rollout.tree.num_nodes
  count = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
  shapes = {
      "prompts": prompts, "group_size": config.grpo.group_size, "rows": rows, "prompt": p,
      "new_tokens": config.rollout.max_new_tokens, "sequence": p + config.rollout.max_new_tokens,
      "cache_slots": min(p + config.rollout.max_new_tokens + nodes + 1, config.model.max_position),
      "minibatches": config.grpo.num_minibatches, "minibatch_rows": mb,
      "rows_per_device": rows // _split(device_mesh, "batch", prompts),
      "minibatch_rows_per_device": mb // _split(device_mesh, "batch", mb),
      "drafter": config.drafter.name if tc.rollout.drafter is not None else "none",
      "parameters": count(state.params) + (0 if state.drafter is None
                                           else count(state.drafter.weights)),
      "dtype": config.model.dtype, "param_dtype": config.model.param_dtype,
      "remat": config.model.remat,
      "lora": None if state.adapters is None else {
          "rank": config.lora.rank, "trained": count(state.adapters)},
      # The accelerator estimate's total under each rematerialisation policy.
      "total_by_remat": {
          policy: estimate(dataclasses.replace(config, model=dataclasses.replace(
              config.model, remat=policy)), tc, state, batch, device_mesh).total
          for policy in REMAT_POLICIES},
  }
  return Plan(
      name=name, mesh=dict(device_mesh.shape), hbm_gib=float(hbm_gib), shapes=shapes,
      compiled=Compiled(arguments=memory.argument_size_in_bytes,
                        outputs=memory.output_size_in_bytes, aliased=memory.alias_size_in_bytes,
                        temporaries=memory.temp_size_in_bytes,
                        generated_code=memory.generated_code_size_in_bytes),
      compiled_flops=float(cost.get("flops", 0.0)), estimate=est, estimate_here=here,
      largest=_largest_arrays(compiled.as_text()), lower_s=lower_s, compile_s=compile_s,
      platform=devs[0].platform)
