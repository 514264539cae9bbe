"""Device mesh, logical-axis rules, and the shardings of parameters, batches and caches.

Every parameter leaf carries a `PartitionSpec` of *logical* names (`param_axes`); a short
rules table maps each logical name to mesh axes. Keeping the two apart means one model
definition runs data-parallel, FSDP, tensor-parallel or any mix by changing only the mesh
shape (or, rarely, the rules).

The mesh always has the axes ("data", "fsdp", "tensor", "expert"), some possibly of size 1:
  data    pure data parallelism: batch split, parameters replicated.
  fsdp    batch split and parameters split along "embed" (gathered when used).
  tensor  Megatron-style split of heads, MLP hidden units and the vocabulary.
  expert  expert parallelism: a mixture-of-experts layer's experts split, each device
          running its own on every token of its expert group (`specjax.models.moe`); the
          batch is split over it too, so the rest of the model is data-parallel there.
          Experts are split over fsdp as well (after "expert"): an fsdp mesh holds each
          expert whole on one device rather than a slice of every expert on each.

A dimension whose size the mapped mesh axes do not divide (kv_heads=2 on tensor=4) falls
back to fewer of those axes and then to replication, and a mesh axis is used at most once
per array, so any model config runs on any mesh; such a fallback costs memory, not
correctness.

Shape letters: see `specjax` (B batch, S cache slots, K kv heads, H head_dim).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.checks import is_int
from specjax.errors import ConfigError
from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig
from specjax.models.layout import EXPERT_AXES
from specjax.models.params import Params, init_params, param_axes

__all__ = [
    "DEFAULT_RULES", "MESH_AXES", "MeshConfig", "Rules", "batch_sharding", "init_sharded_params",
    "kv_cache_shardings", "logical_sharding", "logical_to_mesh", "make_mesh", "on_mesh",
    "opt_state_shardings", "param_shapes", "param_shardings", "replicated", "shard_params",
    "transfer",
]

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# A logical name may appear more than once: later entries are fallbacks tried in order when an
# earlier one cannot be used (axis already taken in this array, or size not divisible).
DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp", "expert")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    # An MoE layer's experts: split over "expert", then "fsdp" (expert parallelism:
    # `specjax.models.moe`); within a device, its experts' width splits on "tensor" ("mlp").
    ("expert", EXPERT_AXES),
)

_CACHE_AXES = P("batch", "kv_heads", None, "head_dim")  # [B, K, S, H]


def _check_axis_sizes(sizes: dict[str, int], prefix: str = "") -> list[str]:
  """Raise `ConfigError` unless every size is an int >= 1 or -1, with at most one -1; return
  the names of the -1 axes. `prefix` names the sizes as the caller knows them ("mesh.")."""
  for name, size in sizes.items():
    if not is_int(size) or (size < 1 and size != -1):
      raise ConfigError(f"{prefix}{name}={size!r} is invalid: must be an int >= 1, or -1 for "
                        "all the devices the other axes leave")
  free = [name for name, size in sizes.items() if size == -1]
  if len(free) > 1:
    raise ConfigError(f"{' and '.join(f'{prefix}{n}=-1' for n in free)} is invalid: at most "
                      "one axis may be -1")
  return free


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, expert: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A `("data", "fsdp", "tensor", "expert")` mesh over `devices` (default: all global
  devices).

  One axis may be -1, meaning "all devices the other axes leave". On several hosts,
  `jax.devices()` lists every process's devices, so the same call on each host builds the
  same global mesh.

  Raises:
    ConfigError: a size that is not an int >= 1 or -1, two -1 axes, or a shape that does not
      cover the devices exactly.
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = {"data": data, "fsdp": fsdp, "tensor": tensor, "expert": expert}
  free = _check_axis_sizes(sizes)
  fixed = math.prod(size for size in sizes.values() if size != -1)
  if free:
    if len(devices) % fixed:
      raise ConfigError(
          f"{free[0]}=-1 is invalid: the other axes multiply to {fixed}, which does not "
          f"divide the {len(devices)} devices")
    sizes[free[0]] = len(devices) // fixed
  shape = tuple(sizes[name] for name in MESH_AXES)
  if math.prod(shape) != len(devices):
    named = " x ".join(f"{name}={size}" for name, size in zip(MESH_AXES, shape)
                       if size != 1 or name != "expert")
    raise ConfigError(
        f"mesh {named} = {math.prod(shape)} devices is invalid: there are {len(devices)} "
        "devices; the product must equal it (use -1 on one axis to take the rest)")
  # Auto axes: the model code leaves sharding of intermediates to the compiler; explicit
  # (sharding-in-types) axes, the jax.make_mesh default, would demand annotations on them.
  return jax.make_mesh(shape, MESH_AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """The shape of a run's `("data", "fsdp", "tensor", "expert")` mesh over every device of
  every process (`make_mesh`). One axis may be -1: all the devices the others leave.

  The default is pure data parallelism over all devices, what a run on one accelerator, on
  8 of them or on a pod slice needs unless the model does not fit one device (then fsdp
  splits parameters and optimizer moments; tensor splits heads, MLP and vocabulary).

  Attributes:
    data: batch split, parameters replicated.
    fsdp: batch split and parameters split along "embed".
    tensor: heads, MLP hidden units and vocabulary split (Megatron style).
    expert: a mixture-of-experts model's experts split (expert parallelism), the batch too;
      it must divide the number of experts.
  """

  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  expert: int = 1

  def __post_init__(self):
    _check_axis_sizes(dataclasses.asdict(self), prefix="mesh.")

  def make(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh over `devices` (default: all devices of all processes).

    Raises:
      ConfigError: the shape does not cover the devices exactly.
    """
    devices = list(jax.devices() if devices is None else devices)
    try:
      return make_mesh(self.data, self.fsdp, self.tensor, self.expert, devices=devices)
    except ValueError as err:
      sizes = dataclasses.asdict(self)
      shape = ", ".join(f"mesh.{name}={size}" for name, size in sizes.items()
                        if name != "expert" or size != 1)
      fixed = math.prod(s for s in sizes.values() if s != -1)
      raise ConfigError(
          f"{shape} is invalid: there are {len(devices)} devices ({jax.process_count()} "
          f"process(es) x {jax.local_device_count()}); the sizes must multiply to that, or one "
          f"be -1 and the others' product ({fixed}) divide it") from err


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_mesh(spec: P, mesh: Mesh, shape: Sequence[int], rules: Rules = DEFAULT_RULES
                    ) -> P:
  """Map a `PartitionSpec` of logical names to one of mesh axes for an array of `shape`.

  Each dimension takes the first rule for its logical name whose mesh axes are still free in
  this array, keeping the longest prefix of them whose total size divides the dimension;
  a dimension nothing fits is replicated. The result has one entry per dimension.

  Raises:
    ValueError: a logical name absent from `rules`, a rule naming an axis the mesh lacks,
      or a spec longer than `shape`.
  """
  if len(spec) > len(shape):
    raise ValueError(f"spec {spec} has {len(spec)} entries but the array has shape "
                     f"{tuple(shape)}; allowed: at most one entry per dimension")
  known = {name for name, _ in rules}
  used: set[str] = set()
  out: list[MeshAxes] = []
  for dim, logical in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
    chosen: tuple[str, ...] = ()
    for name in _as_tuple(logical):
      if name not in known:
        raise ValueError(f"logical axis {name!r} has no rule; rules cover {sorted(known)}")
      chosen += _first_rule_that_fits(name, dim // _size(mesh, chosen), mesh, rules,
                                      used | set(chosen))
    used.update(chosen)
    out.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
  return P(*out)


def _first_rule_that_fits(name: str, size: int, mesh: Mesh, rules: Rules, used: set[str]
                          ) -> tuple[str, ...]:
  """Mesh axes for logical `name` on a dimension of `size`, avoiding the axes in `used`."""
  for rule_name, axes in rules:
    if rule_name != name:
      continue
    for axis in _as_tuple(axes):
      if axis not in mesh.shape:
        raise ValueError(f"rule {name!r} -> {axis!r} names a mesh axis the mesh lacks; "
                         f"mesh axes are {tuple(mesh.axis_names)}")
    free = [a for a in _as_tuple(axes) if a not in used]
    # The longest prefix keeps the rule's order (batch over data before fsdp).
    for n in range(len(free), 0, -1):
      if size % _size(mesh, free[:n]) == 0:
        return tuple(free[:n])
  return ()


def _size(mesh: Mesh, axes: Sequence[str]) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def logical_sharding(spec: P, mesh: Mesh, shape: Sequence[int], rules: Rules = DEFAULT_RULES
                     ) -> NamedSharding:
  """`NamedSharding` of an array of `shape` whose dimensions have the logical names `spec`."""
  return NamedSharding(mesh, logical_to_mesh(spec, mesh, shape, rules))


def param_shapes(config: ModelConfig) -> Params:
  """`jax.ShapeDtypeStruct` of every parameter, computed without allocating any."""
  return jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))


def param_shardings(config: ModelConfig, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Params:
  """`NamedSharding` of every parameter, in the tree structure of `init_params(config, key)`."""
  shapes = param_shapes(config)
  axes = param_axes(config)
  if jax.tree.structure(shapes) != jax.tree.structure(axes, is_leaf=_is_spec):
    raise ValueError("param_axes(config) and init_params(config, key) have different tree "
                     f"structures:\n{jax.tree.structure(axes, is_leaf=_is_spec)}\nvs\n"
                     f"{jax.tree.structure(shapes)}")
  return jax.tree.map(lambda s, a: logical_sharding(a, mesh, s.shape, rules), shapes, axes)


def _is_spec(x: Any) -> bool:
  return isinstance(x, P)


def batch_sharding(mesh: Mesh, ndim: int, rules: Rules = DEFAULT_RULES) -> NamedSharding:
  """Sharding of a `[B, ...]` array of rank `ndim`: B over the first "batch" rule's axes.

  B must be divisible by the product of those axes' sizes (data x fsdp x expert by default);
  for a B that may not be, use `logical_sharding(P("batch", ...), mesh, shape)`, which falls
  back.
  """
  if ndim < 1:
    raise ValueError(f"ndim={ndim} is invalid: a batch array has rank >= 1")
  batch_axes = next((_as_tuple(axes) for name, axes in rules if name == "batch"), None)
  if batch_axes is None:
    raise ValueError(f"rules have no 'batch' entry; rules cover {[n for n, _ in rules]}")
  first = None if not batch_axes else batch_axes[0] if len(batch_axes) == 1 else batch_axes
  return NamedSharding(mesh, P(first, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  """A full copy on every device of `mesh` (scalars, step counters, metrics)."""
  return NamedSharding(mesh, P())


def kv_cache_shardings(cache: KVCache, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> KVCache:
  """A `KVCache` of shardings for `cache` (arrays or `jax.ShapeDtypeStruct`s).

  Buffers `[B, K, S, H]` split B over the "batch" axes and K over the "kv_heads" axes (the
  same split as the wk/wv columns that produce them, so writes need no communication);
  `lengths [B]` splits over the "batch" axes.
  """
  buf = lambda x: logical_sharding(_CACHE_AXES, mesh, x.shape, rules)
  return cache.replace(keys=tuple(buf(k) for k in cache.keys),
                       values=tuple(buf(v) for v in cache.values),
                       lengths=logical_sharding(P("batch"), mesh, cache.lengths.shape, rules))


def shard_params(params: Params, shardings: Params) -> Params:
  """Move existing parameters onto `shardings` (every host must hold the same values)."""
  return jax.device_put(params, shardings)


def init_sharded_params(config: ModelConfig, key: jax.Array, mesh: Mesh,
                        rules: Rules = DEFAULT_RULES) -> Params:
  """`init_params(config, key)` created directly in its shards, never whole on one device.

  The values equal the unsharded `init_params` because JAX's partitionable threefry
  (`jax_threefry_partitionable`, the default) makes random bits independent of sharding.
  """
  shardings = param_shardings(config, mesh, rules)
  init = jax.jit(init_params, static_argnums=0, out_shardings=shardings)
  return init(config, key)


def opt_state_shardings(opt_state: Any, params: Params, shardings: Params) -> Any:
  """Shardings of an optax state: leaves that mirror a parameter take its sharding.

  Any subtree of `opt_state` with the tree structure of `params` (Adam's `mu` and `nu`, a
  momentum buffer) is matched leaf by leaf; a matched leaf with the parameter's shape takes
  the parameter's sharding, everything else (step counts, Adafactor's factored moments) is
  replicated. `opt_state` and `params` may hold arrays or `jax.ShapeDtypeStruct`s.
  """
  mesh = _mesh_of(shardings)
  params_def = jax.tree.structure(params)
  flat_shapes = [np.shape(x) for x in jax.tree.leaves(params)]
  flat_shardings = jax.tree.leaves(shardings)

  def mirrors_params(node: Any) -> bool:
    return jax.tree.structure(node) == params_def

  def assign(node: Any) -> Any:
    if not mirrors_params(node):
      return replicated(mesh)
    leaves = jax.tree.leaves(node)
    return jax.tree.unflatten(params_def, [
        sh if np.shape(x) == shape else replicated(mesh)
        for x, shape, sh in zip(leaves, flat_shapes, flat_shardings)])

  return jax.tree.map(assign, opt_state, is_leaf=mirrors_params)


def transfer(tree: Any, shardings: Any) -> Any:
  """`tree`'s arrays copied onto `shardings` (a tree of the same structure, not a prefix) on
  other devices, device to device: for weights and rollouts moving between disjoint meshes
  in one process.

  `jax.device_put` onto another set of devices copies shard by shard only where the target
  cuts every array exactly as the source does; otherwise it gathers the array through host
  memory. So each array is first laid out on its own devices as the target will hold it (a
  jitted identity whose output is the target's partitioning on a mesh of the source devices
  of the same shape) and then copied shard to shard. Where the two sets differ in size, the
  array is replicated on its source devices and each target shard sliced from a source copy
  on its device. Arrays go one by one, each copy dispatched before the next array is laid
  out, so the extra memory on the source devices is that of the arrays in flight (a target
  that replicates what the source splits needs a full copy of each such array there), not
  of the whole tree at once. Nothing waits: the copies run as JAX dispatches them.

  Leaves that are not `jax.Array`s (host data) are simply placed.

  Raises:
    ValueError: an array or target spans several processes, or a target over several
      devices is not a `NamedSharding`.
  """
  leaves, treedef = jax.tree.flatten(tree)
  targets = treedef.flatten_up_to(shardings)
  out = []
  for x, target in zip(leaves, targets):
    if not isinstance(x, jax.Array):
      out.append(jax.device_put(x, target))
      continue
    if not (x.is_fully_addressable and target.is_fully_addressable):
      raise ValueError("transfer copies between devices of this process; an array or target "
                       "spans several processes")
    if not isinstance(target, NamedSharding) and target.num_devices != 1:
      raise ValueError(f"transfer needs NamedSharding targets across devices; got {target}")
    source = _device_order(x.sharding)
    if target.num_devices == len(source):
      laid = _reshard((_twin(target, source),))((x,))[0]
      out.append(jax.device_put(laid, target))
    else:
      out.append(_transfer_by_slices(x, target, source))
  return jax.tree.unflatten(treedef, out)


def _device_order(sharding: jax.sharding.Sharding) -> tuple[jax.Device, ...]:
  if isinstance(sharding, NamedSharding):
    return tuple(sharding.mesh.devices.flat)
  if sharding.num_devices == 1:
    return tuple(sharding.device_set)
  raise ValueError(f"transfer needs arrays on a NamedSharding or one device; got {sharding}")


def _twin(target: jax.sharding.Sharding, source: tuple[jax.Device, ...]
          ) -> jax.sharding.Sharding:
  """`target`'s partitioning over the `source` devices (as many as `target` has)."""
  if not isinstance(target, NamedSharding):  # one device
    return jax.sharding.SingleDeviceSharding(source[0], memory_kind=target.memory_kind)
  mesh = Mesh(np.array(source, dtype=object).reshape(target.mesh.devices.shape),
              target.mesh.axis_names, axis_types=target.mesh.axis_types)
  return NamedSharding(mesh, target.spec, memory_kind=target.memory_kind)


def _identity(xs):
  return xs


@functools.lru_cache(maxsize=256)
def _reshard(out_shardings: tuple[jax.sharding.Sharding, ...]):
  """A jitted identity onto `out_shardings` (cached: one compilation per layout)."""
  return jax.jit(_identity, out_shardings=out_shardings)


@functools.lru_cache(maxsize=256)
def _slicer(bounds: tuple[tuple[int, int], ...]):
  """A jitted slice with static `(start, stop)` per dimension (indexing eagerly with slices
  would send the bounds to the device as arrays)."""
  return jax.jit(lambda a: jax.lax.slice(a, [b[0] for b in bounds], [b[1] for b in bounds]))


def _transfer_by_slices(x: jax.Array, target: jax.sharding.Sharding,
                        source: tuple[jax.Device, ...]) -> jax.Array:
  """`x` onto `target` (a different number of devices): replicate it on its own devices,
  cut each target shard from a source copy there, copy the piece to its device."""
  if len(source) > 1:
    everywhere = Mesh(np.array(source, dtype=object), ("source",))
    x = _reshard((NamedSharding(everywhere, P()),))((x,))[0]
  copies = [shard.data for shard in x.addressable_shards]
  pieces = []
  for k, (device, index) in enumerate(target.addressable_devices_indices_map(x.shape).items()):
    bounds = tuple(cut.indices(size)[:2] for cut, size in zip(index, x.shape))
    pieces.append(jax.device_put(_slicer(bounds)(copies[k % len(copies)]), device))
  return jax.make_array_from_single_device_arrays(x.shape, target, pieces)


def _mesh_of(shardings: Params) -> Mesh:
  leaves = jax.tree.leaves(shardings)
  if not leaves or not all(isinstance(s, NamedSharding) for s in leaves):
    raise ValueError("shardings must be a non-empty tree of NamedSharding")
  return leaves[0].mesh


class _OnMesh:
  """`jitted` traced and called with `mesh` set (`jax.sharding.set_mesh`)."""

  def __init__(self, mesh: Mesh, jitted: Callable):
    self.mesh, self.jitted = mesh, jitted

  def __call__(self, *args, **kwargs):
    with jax.sharding.set_mesh(self.mesh):
      return self.jitted(*args, **kwargs)

  def _cache_size(self) -> int:
    return self.jitted._cache_size()

  def lower(self, *args):
    with jax.sharding.set_mesh(self.mesh):
      return self.jitted.lower(*args)


def on_mesh(mesh: Mesh | None, jitted: Callable) -> Callable:
  """`jitted` (a `jax.jit` function) traced and called with `mesh` set, so the model's layout
  hints (`specjax.models.layout`) keep activations split by rows; `jitted` itself when `mesh`
  is None."""
  return jitted if mesh is None else _OnMesh(mesh, jitted)
