"""GRPO over a device mesh and several processes: the sharding of the whole `TrainState`, the
prompt batch each process feeds, moving host-side state onto the mesh and back, and joining a
`jax.distributed` cluster.

Every process runs the same program on the same global mesh (`specjax.sharding.make_mesh`
over `jax.devices()`, which lists every process's devices). A global array has shards on
devices of several processes; a process reads and writes only its own (addressable) shards:
- the train state: parameters split by the logical-axis rules, optimizer moments as their
  parameters, the pending rollout of async mode split over the batch, scalars and keys
  replicated (`train_state_shardings`). Orbax saves and restores it shard by shard, each
  process its own, into any mesh (`specjax.checkpoint.Checkpointer`).
- the prompts of a step: each process reads only the rows its devices hold
  (`process_prompts`), and `global_batch` joins them into global arrays without any process
  seeing the others'.
- host-side state (a warm start, an initial drafter) computed on every process: process 0's
  copy is broadcast and split onto the mesh (`distribute`), so replicas agree bit for bit
  even where a kernel is not deterministic across hosts.

Shape letters: see `specjax` (B rows, B / G prompts, P prompt buffer, L sequence buffer,
D tree depth).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from specjax.checks import is_int
from specjax.errors import ConfigError
from specjax.models.eagle3 import eagle3_param_axes
from specjax.models.lora import lora_axes
from specjax.models.params import Params, param_axes
from specjax.rl.data import PromptBatch, PromptReader
from specjax.rl.roll_call import roll_call
from specjax.rl.state import DrafterTrainState, RewardFn, Rollout, TrainConfig, TrainState
from specjax.rl.trainer import make_prime_fn, make_train_step
from specjax.sharding import (DEFAULT_RULES, Rules, logical_sharding, on_mesh, opt_state_shardings,
                              replicated)

__all__ = ["COORDINATOR_ENV", "broadcast_json", "distribute", "global_batch", "join_cluster",
           "local_copy", "process_prompts", "process_rows", "prompt_batch_shardings",
           "rollout_shardings", "sharded_prime_fn", "sharded_train_step",
           "train_state_shardings"]


# The environment variables `join_cluster` reads (JAX reads the first one itself, too).
COORDINATOR_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")

# Statistics of a whole rollout, not one value per row: replicated like the metrics.
_ROLLOUT_STATS = ("tokens_per_round", "accepted_per_depth", "plain_share", "drafter_stats")


def _logical_tree(tree: Params, axes: Params, mesh: Mesh, rules: Rules, what: str) -> Params:
  """`NamedSharding` of every leaf of `tree` (arrays or `ShapeDtypeStruct`s) from the logical
  axes `axes` (same structure)."""
  is_spec = lambda x: isinstance(x, P)
  if jax.tree.structure(tree) != jax.tree.structure(axes, is_leaf=is_spec):
    raise ValueError(f"{what} do not have the tree structure of their logical axes:\n"
                     f"{jax.tree.structure(tree)}\nvs\n"
                     f"{jax.tree.structure(axes, is_leaf=is_spec)}")
  return jax.tree.map(lambda x, a: logical_sharding(a, mesh, np.shape(x), rules), tree, axes)


def rollout_shardings(roll: Rollout, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Rollout:
  """A `Rollout` of shardings for `roll` (arrays or `jax.ShapeDtypeStruct`s): per-row fields
  (`[B, ...]`) split over the "batch" axes (replicated when B does not divide), the
  rollout's statistics replicated."""
  shard = lambda x: logical_sharding(P("batch"), mesh, np.shape(x), rules)
  whole = lambda x: replicated(mesh)
  return roll.replace(**{
      name: jax.tree.map(whole if name in _ROLLOUT_STATS else shard, getattr(roll, name))
      for name in Rollout.__dataclass_fields__})


def train_state_shardings(state: TrainState, mesh: Mesh, config: TrainConfig,
                          rules: Rules = DEFAULT_RULES) -> TrainState:
  """A `TrainState` of `NamedSharding`s for `state` (arrays or `jax.ShapeDtypeStruct`s).

  - params, ref_params: the logical axes of `param_axes(config.model)` mapped by `rules`;
    LoRA adapters by `lora_axes` (the factors split as their projection's input or output).
  - opt_state: Adam's moments (any subtree shaped like the parameters) as their
    parameters; counts and other leaves replicated (`specjax.sharding.opt_state_shardings`).
  - drafter (EAGLE-3): the head by `eagle3_param_axes`, its optimizer state likewise, its
    draft vocabulary map `d2t [W]` replicated; (a draft model): its parameters by
    `param_axes` of its config, and its optimizer state (when distilled online) likewise.
  - pending (async mode): rows `[B, ...]` over the "batch" axes, statistics replicated.
  - step, key, acceptance (the speculation policy's counts), history (the history drafter's
    bank, read whole by every row's drafts): replicated.

  Pass the result as `jit`'s `in_shardings`/`out_shardings` of the step, to `jax.device_put`
  (or `distribute`), or as the shardings of the abstract state a checkpoint is restored into.
  """
  params = _logical_tree(state.params, param_axes(config.model), mesh, rules,
                         "the state's params")
  adapters = None
  if state.adapters is not None:
    if config.lora is None:
      raise ConfigError("the state has LoRA adapters, but the config has no lora (pass the "
                        "TrainConfig the state was made with)")
    adapters = state.adapters.replace(factors=_logical_tree(
        state.adapters.factors, lora_axes(config.model, config.lora), mesh, rules,
        "the state's LoRA adapters"))
  trained = params if adapters is None else adapters
  opt = opt_state_shardings(state.opt_state, state.trainable, trained)
  drafter = None
  if state.drafter is not None and config.draft_model is not None:
    weights = _logical_tree(state.drafter.weights, param_axes(config.draft_model.config),
                            mesh, rules, "the draft model's params")
    opt_state = (None if state.drafter.opt_state is None else  # distilled online
                 opt_state_shardings(state.drafter.opt_state, state.drafter.weights, weights))
    drafter = DrafterTrainState(weights=weights, opt_state=opt_state)
  elif state.drafter is not None:
    if config.eagle3 is None:
      raise ConfigError("the state has a drafter train state, but config's rollout drafter is "
                        f"{config.rollout.drafter!r}, not an Eagle3Drafter or a "
                        "DraftModelDrafter")
    weights = state.drafter.weights
    head = _logical_tree(weights.params, eagle3_param_axes(config.eagle3.config), mesh, rules,
                         "the EAGLE-3 head's params")
    drafter = DrafterTrainState(
        weights=weights.replace(params=head, d2t=replicated(mesh)),
        opt_state=opt_state_shardings(state.drafter.opt_state, weights.params, head))
  return TrainState(
      params=params, opt_state=opt, ref_params=None if state.ref_params is None else params,
      step=replicated(mesh), key=replicated(mesh),
      pending=None if state.pending is None else rollout_shardings(state.pending, mesh, rules),
      drafter=drafter,
      acceptance=jax.tree.map(lambda _: replicated(mesh), state.acceptance),
      adapters=adapters,
      history=jax.tree.map(lambda _: replicated(mesh), state.history))


def sharded_train_step(config: TrainConfig, reward_fn: RewardFn,
                       optimizer: optax.GradientTransformation, state_shardings: TrainState,
                       batch_shardings: Any, *, pad_id: int = 0, samples: int = 0):
  """`make_train_step`'s fused step compiled for a mesh: the state stays on
  `state_shardings` (`train_state_shardings`), the batch arrives on `batch_shardings`
  (`prompt_batch_shardings`), and the metrics (with `samples`, the first rows of the
  rollout) come back replicated, so every process reads them without a gather."""
  mesh = jax.tree.leaves(state_shardings)[0].mesh
  step = make_train_step(config, reward_fn, optimizer, pad_id=pad_id, jit=False,
                         samples=samples)
  # The state is donated: parameters, optimizer moments and the pending rollout are replaced.
  return on_mesh(mesh, jax.jit(step, in_shardings=(state_shardings, batch_shardings),
                                out_shardings=(state_shardings, replicated(mesh)),
                                donate_argnums=0))


def sharded_prime_fn(config: TrainConfig, reward_fn: RewardFn, state_shardings: TrainState,
                     batch_shardings: Any, *, pad_id: int = 0):
  """Async mode's `make_prime_fn` compiled for a mesh: a state without a pending rollout on
  `state_shardings` (those of the primed state) in, the primed state on them out."""
  prime = make_prime_fn(config, reward_fn, pad_id=pad_id)
  mesh = jax.tree.leaves(state_shardings)[0].mesh
  return on_mesh(mesh, jax.jit(prime, in_shardings=(state_shardings.replace(pending=None),
                                                      batch_shardings),
                                out_shardings=state_shardings))


def prompt_batch_shardings(batch: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
  """Shardings of a prompt batch (a `PromptBatch`: every leaf `[B / G, ...]`) of the *global*
  shape: prompts over the "batch" axes, replicated when B / G does not divide."""
  return jax.tree.map(lambda x: logical_sharding(P("batch"), mesh, np.shape(x), rules), batch)


def process_rows(mesh: Mesh, prompts: int, rules: Rules = DEFAULT_RULES) -> np.ndarray:
  """The rows (sorted global indices) of a `[prompts, ...]` batch that this process's devices
  hold under `prompt_batch_shardings`: all of them when the batch is replicated across
  processes."""
  sharding = logical_sharding(P("batch"), mesh, (prompts,), rules)
  rows = set()
  for index in sharding.addressable_devices_indices_map((prompts,)).values():
    rows.update(range(*index[0].indices(prompts)))
  return np.array(sorted(rows), np.int64)


def process_prompts(reader: PromptReader, mesh: Mesh, rules: Rules = DEFAULT_RULES
                    ) -> Callable[[int], PromptBatch]:
  """A function from a data position to this process's rows of `reader`'s batch there (host
  arrays for `global_batch`); `reader` reads whole batches.

  When the rows are one aligned block of the batch (`make_mesh` orders devices process by
  process) only those prompts are read, by a `PromptReader` with this process's
  `process_index` and `process_count`; otherwise (a topology-aware device order that
  interleaves hosts) the whole batch is read and the rows picked from it.
  """
  if reader.process_count != 1:
    raise ValueError(f"reader has process_count={reader.process_count}; pass one that reads "
                     "whole batches (process_count=1): the mesh decides each process's rows")
  prompts = reader.batch_size
  rows = process_rows(mesh, prompts, rules)
  size = len(rows)
  first = int(rows[0])
  if np.array_equal(rows, np.arange(first, first + size)) and not (prompts % size
                                                                    or first % size):
    mine = dataclasses.replace(reader, process_index=first // size,
                               process_count=prompts // size)
    return mine.batch_at
  return lambda position: jax.tree.map(lambda x: x[rows], reader.batch_at(position))


def global_batch(local: Any, shardings: Any, prompts: int) -> Any:
  """Global arrays of a prompt batch from this process's rows `local` (leaves
  `[len(process_rows), ...]`, from `process_prompts`); `prompts` is the global B / G."""
  return jax.tree.map(
      lambda x, s: jax.make_array_from_process_local_data(
          s, np.asarray(x), (prompts,) + np.shape(x)[1:]), local, shardings)


def distribute(tree: Any, shardings: Any) -> Any:
  """`tree` (host arrays or single-device arrays, a full copy on every process) placed on
  `shardings`; with several processes, process 0's copy everywhere.

  Computations run on each process apart (a warm start, a distilled head) agree only as far
  as their kernels are deterministic; taking one process's values keeps every replica of a
  parameter equal.
  """
  if jax.process_count() > 1:
    tree = multihost_utils.broadcast_one_to_all(tree)
  return jax.device_put(tree, shardings)


def local_copy(tree: Any) -> Any:
  """A full copy of `tree` on this process's first device (global arrays are gathered: with
  several processes every process must call this together), for single-device code such as
  evaluation and measurements. Always new buffers: a step that donates `tree` afterwards
  leaves the copy intact (`device_put` alone returns the very arrays already there)."""
  if any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in jax.tree.leaves(tree)):
    tree = multihost_utils.process_allgather(tree, tiled=True)
  return jax.device_put(tree, jax.local_devices()[0], may_alias=False)


def broadcast_json(value: Any) -> Any:
  """`value` (JSON-serialisable) as process 0 holds it, on every process (all must call):
  for host-side decisions that every process must share, such as measured costs that
  choose what is compiled."""
  if jax.process_count() == 1:
    return value
  data = (np.frombuffer(json.dumps(value).encode(), np.uint8) if jax.process_index() == 0
          else np.zeros(0, np.uint8))
  size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
  buffer = np.zeros(size, np.uint8)
  buffer[:data.size] = data
  return json.loads(bytes(multihost_utils.broadcast_one_to_all(buffer)).decode())


def check_same_config(record: Any) -> None:
  """ConfigError on every process unless all processes of the run hold the same `record`
  (a JSON value, e.g. the resolved config): processes that would compile different programs
  otherwise stall in their first collective. Compared by a sha256 of each process's JSON,
  gathered to all before anything else crosses processes."""
  if jax.process_count() == 1:
    return
  text = json.dumps(record, sort_keys=True, default=str).encode()
  digest = np.frombuffer(hashlib.sha256(text).digest(), np.uint8)
  digests = np.asarray(multihost_utils.process_allgather(digest))  # [processes, 32]
  differ = [i for i in range(len(digests)) if not np.array_equal(digests[i], digests[0])]
  if differ:
    raise ConfigError(f"processes {differ} run a different config from process 0's (by "
                      "sha256 of the resolved config): give every process the same config "
                      "file and flags (only --process-id differs)")


def _resolved(flag: Any, env: Mapping[str, str], name: str, kind: type) -> Any:
  if flag is not None:
    return flag
  raw = env.get(name)
  if raw is None or raw == "":
    return None
  if kind is int:
    try:
      return int(raw)
    except ValueError:
      raise ConfigError(f"{name}={raw!r} is invalid: must be an int") from None
  return raw


DEFAULT_CLUSTER_TIMEOUT_S = 120


def join_cluster(coordinator_address: str | None = None, num_processes: int | None = None,
                 process_id: int | None = None, *, env: Mapping[str, str] | None = None,
                 detect: bool = True, timeout_s: int = DEFAULT_CLUSTER_TIMEOUT_S,
                 log: Callable[[str], None] = print) -> bool:
  """Initialise `jax.distributed` when this is one process of several; returns whether it did.

  Call it before anything touches a device. The coordinator's `HOST:PORT`, the process
  count and this process's id come from the arguments, else from `COORDINATOR_ENV`
  (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID). All three given: join that
  cluster (a count of 1 joins nothing). None given: with `detect`, a cluster JAX recognises
  by itself with more than one process (a Cloud TPU pod slice, a SLURM or Open MPI job, a
  Kubernetes JobSet) is joined with no arguments; otherwise this is a single process. CPU
  processes communicate over gloo (JAX's default CPU collectives).

  Every process first reports to process 0 (`specjax.rl.roll_call`), which waits up to
  `timeout_s` for all N: nobody at the coordinator address, an id given twice, a different
  process count or processes that never arrive fail on every process that reported, naming
  the problem, before JAX's own rendezvous (which would abort after its timeout without
  saying why).

  Raises:
    ConfigError: only some of the three are given, they are out of range, or the roll call
      fails (nobody at the coordinator address, a duplicate id, a different count, missing
      processes).
  """
  env = os.environ if env is None else env
  given = {"coordinator address": _resolved(coordinator_address, env, COORDINATOR_ENV[0], str),
           "number of processes": _resolved(num_processes, env, COORDINATOR_ENV[1], int),
           "process id": _resolved(process_id, env, COORDINATOR_ENV[2], int)}
  flags = ("--coordinator-address", "--num-processes", "--process-id")
  missing = [(what, flag, var) for (what, value), flag, var in
             zip(given.items(), flags, COORDINATOR_ENV) if value is None]
  if missing and len(missing) < 3:
    have = ", ".join(f"{what}={value!r}" for what, value in given.items() if value is not None)
    need = "; ".join(f"the {what} ({flag} or {var})" for what, flag, var in missing)
    raise ConfigError(f"a multi-process run needs the coordinator address, the number of "
                      f"processes and this process's id; got {have} but not {need}. Give all "
                      "three, or none (single process, or a cluster JAX detects itself such as "
                      "a TPU pod slice)")
  if not missing:
    address, count, index = given.values()
    if not is_int(count) or count < 1:
      raise ConfigError(f"number of processes={count!r} is invalid: must be an int >= 1")
    if not is_int(index) or not 0 <= index < count:
      raise ConfigError(f"process id={index!r} is invalid: allowed 0..{count - 1} (there are "
                        f"{count} processes)")
    if ":" not in address:
      raise ConfigError(f"coordinator address={address!r} is invalid: must be HOST:PORT, the "
                        "address of process 0 that every process can reach")
    if count == 1:
      return False
    if not is_int(timeout_s) or timeout_s < 1:
      raise ConfigError(f"cluster timeout={timeout_s!r} is invalid: must be an int >= 1 "
                        "(seconds)")
    log(f"joining the cluster at {address} as process {index} of {count}; waiting up to "
        f"{timeout_s}s for all {count} to report")
    roll_call(address, count, index, timeout_s)
    jax.distributed.initialize(coordinator_address=address, num_processes=count,
                               process_id=index, initialization_timeout=timeout_s)
    return True
  if detect and _detected_process_count() > 1:
    jax.distributed.initialize()
    return True
  return False


def _detected_process_count() -> int:
  """Processes of the cluster JAX's own detection recognises here (a TPU pod slice, a SLURM
  or Open MPI job, a Kubernetes JobSet; not the opt-in mpi4py method), 1 when none: a
  single-host TPU VM or a one-task job runs without `jax.distributed`."""
  try:  # a private module: if it moves, fall back to one process (pass the flags then)
    from jax._src import clusters
    with warnings.catch_warnings():  # e.g. "Kubernetes detected but not the package": noise
      warnings.simplefilter("ignore")
      for env in clusters.ClusterEnv._cluster_types:
        if not env.opt_in_only_method and env.is_env_present():
          return int(env.get_process_count())
  except Exception:  # noqa: BLE001 - a failed probe means "not detected", never a crash
    pass
  return 1
