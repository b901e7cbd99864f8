"""Device meshes and the one table mapping logical parameter axes to mesh axes.

Mesh axes: `data` (batch), `fsdp` (batch, and parameters sharded along `embed`), `tensor`
(heads, MLP width and vocabulary). Every parameter of the target and the drafters carries
logical axis names (`nn.with_logical_partitioning`); `RULES` below is the only place they meet
the mesh. A mesh axis that does not divide a dimension is dropped for that dimension
(replicated), so e.g. SmolLM2's 3 KV heads stay whole on tensor=2.
"""

import math
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

__all__ = [
  "AXES",
  "RULES",
  "abstract",
  "batch_sharding",
  "bytes_per_device",
  "constrain",
  "make_mesh",
  "mesh_shape",
  "param_shardings",
  "parse_mesh",
  "replicated",
  "shardings",
  "spec_for",
]

AXES = ("data", "fsdp", "tensor")

RULES = (
  ("batch", ("data", "fsdp")),
  ("length", None),
  ("embed", "fsdp"),
  ("vocab", "tensor"),
  ("q_heads", "tensor"),
  ("kv_heads", "tensor"),
  ("mlp", "tensor"),
  ("head_dim", None),
  ("layers", None),
  ("fused", None),
  ("draft", None),
)


def mesh_shape(num_devices: int, data: int = -1, fsdp: int = 1, tensor: int = 1) -> tuple:
  """(data, fsdp, tensor) sizes; one of them may be -1 (whatever is left)."""
  sizes = [data, fsdp, tensor]
  if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise ValueError(
      f"mesh sizes must be positive, at most one -1: got {dict(zip(AXES, sizes, strict=True))}"
    )
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(
        f"mesh {dict(zip(AXES, sizes, strict=True))} does not divide {num_devices} devices"
      )
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(
      f"mesh {dict(zip(AXES, sizes, strict=True))} needs {math.prod(sizes)} devices, "
      f"have {num_devices}"
    )
  return tuple(sizes)


def parse_mesh(spec: str) -> dict[str, int]:
  """Mesh sizes from text such as `data=2,tensor=4` (axes left out are 1; one may be -1)."""
  sizes = dict(data=1, fsdp=1, tensor=1)
  for part in filter(None, (p.strip() for p in spec.split(","))):
    name, _, value = part.partition("=")
    if name not in sizes or not value.lstrip("-").isdigit():
      raise ValueError(f"bad mesh {spec!r}: use e.g. data=2,tensor=4 (axes: {', '.join(AXES)})")
    sizes[name] = int(value)
  return sizes


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
  """A (data, fsdp, tensor) mesh over `devices` (default: all of them)."""
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(len(devices), data, fsdp, tensor)
  return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def param_shardings(init_boxed, cfg, mesh: Mesh, rules=RULES) -> Any:
  """NamedShardings of the parameters `init_boxed(cfg, key)` creates (only traced, so nothing
  is allocated), by their logical axis names."""
  boxed = jax.eval_shape(lambda: init_boxed(cfg, jax.random.key(0)))
  return shardings(nn.get_partition_spec(boxed), nn.meta.unbox(boxed), mesh, rules)


def spec_for(logical: PartitionSpec, shape: tuple, mesh: Mesh, rules=RULES) -> PartitionSpec:
  """The mesh PartitionSpec of one array: rules applied, non-dividing mesh axes dropped."""
  table = dict(rules)
  used, out = set(), []
  for name, size in zip(tuple(logical) + (None,) * (len(shape) - len(logical)), shape, strict=True):
    axes = table.get(name) if name is not None else None
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    kept = []
    for axis in axes:
      if axis in used or mesh.shape[axis] == 1:
        continue
      if size % (math.prod(mesh.shape[a] for a in kept) * mesh.shape[axis]) == 0:
        kept.append(axis)
    used.update(kept)
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*out)


def shardings(logical_tree, shapes_tree, mesh: Mesh, rules=RULES):
  """NamedShardings for a tree of arrays (or ShapeDtypeStructs) given their logical specs."""
  return jax.tree.map(
    lambda spec, x: NamedSharding(mesh, spec_for(spec, x.shape, mesh, rules)),
    logical_tree,
    shapes_tree,
    is_leaf=lambda x: isinstance(x, PartitionSpec),
  )


def constrain(x: jax.Array, logical: tuple, mesh: Mesh | None) -> jax.Array:
  """x laid out on `mesh` by its logical axes (`RULES`); a no-op without a mesh."""
  if mesh is None:
    return x
  spec = spec_for(PartitionSpec(*logical), x.shape, mesh)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Leading (batch) axis over data and fsdp."""
  return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), *([None] * (ndim - 1))))


def abstract(tree, sharding_tree) -> Any:
  """ShapeDtypeStructs of a tree of arrays or shapes, each carrying its sharding: what to lower
  a program with, or to restore a checkpoint into, without allocating anything."""
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sharding_tree
  )


def bytes_per_device(tree, sharding_tree) -> int:
  """Bytes each device holds of a tree of arrays or ShapeDtypeStructs under the shardings."""
  total = 0
  for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(sharding_tree), strict=True):
    shard = s.shard_shape(x.shape)
    total += int(np.prod(shard)) * np.dtype(x.dtype).itemsize
  return total
