"""Devices and parameters on a mesh: the one FSDP rule, used by training, loading and sampling.

The rule (`fsdp_spec`): a leaf with two or more dimensions (a matrix, or a stack of them) is
split over one mesh axis along its largest dimension that the axis size divides (the first
of equal ones); the layer axis of a stacked leaf (`stacked`: dimension 0, one entry per
layer) is never split, and vectors and scalars are replicated. A matrix that no dimension
divides is replicated (`strict=False`, training), or a ValueError naming the tensor, its
shape and the axis (`strict=True`, loading).

Why this rule serves both. Whichever dimension is split, each device holds the same share
of a matrix; what matters is that one splits. Trying every dimension, largest first, finds
one where a rule of one fixed dimension fails (GPT-2's vocabulary of 50258 does not split
over 8 devices; its width of 768 does), and where several divide it keeps the layout the
loader always had. A stacked leaf keeps its layer axis whole because the loader fills it
layer by layer in place. Vectors (norms, biases) cost nothing to replicate. Training keeps
running with an odd matrix replicated (small models on any device count), while loading
refuses one: a mesh is given to `mdjax.io.load` to fit a model that one device does not
hold, and a whole matrix on every device is what that asked to avoid.

Model parallelism (docs/devices.md). A mesh that names a 'tensor' or an 'expert' axis
splits a published Transformer's heads and hidden columns over 'tensor' and LLaDA2's
routed experts over 'expert', by the one table of `mdjax.models.parallel` (`model_spec`);
its 'data' axis, when it has one, splits a batch's rows. `parallel_mesh(n, mode)` makes the
mesh of each mode over n devices (`MODES`): "fsdp" (the rule above), "tensor", "expert".

Auto axes. mdjax's models are written for the compiler to place their intermediate values
(sharding propagation); on a mesh of Explicit axes, `jax.make_mesh`'s default, the
embedding's gather over a split vocabulary is refused (`ShardingTypeError`). Every function
here places arrays on `auto_axes(mesh)`, the same devices and axis names with Auto axes, so
a mesh made either way works.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from mdjax import sampling
from mdjax.denoiser import Denoiser
from mdjax.errors import ArgumentError
from mdjax.models import parallel, published
from mdjax.models.parallel import EXPERT, TENSOR

# The mesh axis that training splits the batch (and, with FSDP, the parameters) over.
DATA = parallel.DATA
# How --devices=N splits a model (`parallel_mesh`): the mesh axis each mode puts N on.
MODES = {"fsdp": DATA, "tensor": TENSOR, "expert": EXPERT}


# ----------------------------------------------------------------------------
# Meshes.
# ----------------------------------------------------------------------------


def ordered_devices(num_devices: int | None = None) -> list:
  """Every process's devices, process 0's first: process p holds the p-th contiguous slice
  of the mesh, hence of the batch (one process: `jax.devices()` as it is)."""
  devices = sorted(jax.devices(), key=lambda d: d.process_index)  # stable: ids kept in order
  return devices[:num_devices] if num_devices else devices


def make_mesh(num_devices: int | None = None) -> Mesh:
  """A 1-D mesh with the batch axis 'data' over every process's devices, process by process
  (`ordered_devices`: one process's devices hold one slice of the batch)."""
  return auto_axes(Mesh(np.array(ordered_devices(num_devices)), (DATA,)))


def parallel_mesh(num_devices: int | None = None, mode: str = "fsdp") -> Mesh:
  """The mesh of `mode` (`MODES`) over the first `num_devices` devices (default all):
  "fsdp" is `make_mesh`'s ('data': the rows, the FSDP rule); "tensor" and "expert" put
  them all on that axis beside a 'data' axis of 1 (every device sees every row)."""
  if mode not in MODES:
    raise ArgumentError.invalid("parallel", mode, f"it must be one of {', '.join(MODES)}")
  devices = ordered_devices(num_devices)
  if mode == "fsdp":
    return make_mesh(len(devices))
  return Mesh(np.array(devices).reshape(1, -1), (DATA, MODES[mode]),
              axis_types=(AxisType.Auto,) * 2)


def auto_axes(mesh: Mesh) -> Mesh:
  """`mesh` with every axis Auto (module docstring); `mesh` itself when it is already."""
  if all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


# ----------------------------------------------------------------------------
# The FSDP rule.
# ----------------------------------------------------------------------------


def fsdp_spec(shape: tuple[int, ...], axis_name: str, axis_size: int, *, stacked: bool = False,
              strict: bool = False, name: str = "tensor") -> PartitionSpec:
  """The PartitionSpec of one leaf of `shape` over the mesh axis `axis_name` of `axis_size`
  devices (module docstring). stacked: shape[0] is the layer axis (never split). strict: a
  matrix that no dimension divides is a ValueError naming `name` (else it is replicated)."""
  shape = tuple(int(d) for d in shape)
  dims = shape[1:] if stacked else shape
  if len(dims) < 2:
    return PartitionSpec()
  divisible = [j for j, dim in enumerate(dims) if dim % axis_size == 0 and dim >= axis_size]
  if not divisible:
    if strict:
      largest = max(range(len(dims)), key=lambda j: (dims[j], -j))
      raise ValueError(
          f"tensor {name} {shape}: dim {largest + stacked} of size {dims[largest]} is not "
          f"divisible by mesh axis {axis_name!r} of size {axis_size}, nor is any other "
          f"dimension; use a mesh axis whose size divides one of {list(dims)}, or no mesh.")
    return PartitionSpec()
  j = max(divisible, key=lambda j: (dims[j], -j))  # the largest; the first of equal ones
  spec: list[Any] = [None] * len(shape)
  spec[j + stacked] = axis_name
  return PartitionSpec(*spec)


def partition_spec(name: str, shape: tuple[int, ...], axis_name: str, axis_size: int,
                   stacked: bool = False) -> PartitionSpec:
  """The loader's spec of one leaf: `fsdp_spec` with strict=True (a matrix the axis cannot
  split is a ValueError naming it)."""
  return fsdp_spec(shape, axis_name, axis_size, stacked=stacked, strict=True, name=name)


# ----------------------------------------------------------------------------
# Tensor and expert parallelism.
# ----------------------------------------------------------------------------


def splits_model(mesh: Mesh | None) -> bool:
  """Whether `mesh` names a 'tensor' or an 'expert' axis (the table, not the FSDP rule)."""
  return mesh is not None and any(a in mesh.axis_names for a in parallel.MODEL_AXES)


def check_model_mesh(mesh: Mesh, config) -> None:
  """An ArgumentError (param `mesh`) unless the network of `config` splits over `mesh`'s
  model axes: a published Transformer whose heads, widths and experts they divide."""
  if not isinstance(config, published.PublishedConfig):
    raise ArgumentError("mesh", f"mesh axes {tuple(mesh.axis_names)}: a {type(config).__name__}"
                        f" network is not split over {TENSOR!r} or {EXPERT!r} (the published "
                        f"Transformer families are: {', '.join(published.FAMILIES)}); give a "
                        "mesh without them (the FSDP rule).")
  parallel.check(config, dict(mesh.shape))


def refuse_model_axes(mesh: Mesh | None, what: str) -> None:
  """An ArgumentError when `mesh` has model axes and `what` (a kind of model) has no table."""
  if splits_model(mesh):
    raise ArgumentError("mesh", f"mesh axes {tuple(mesh.axis_names)}: {what} is not split over "
                        f"{TENSOR!r} or {EXPERT!r} (only the published Transformer families: "
                        f"{', '.join(published.FAMILIES)}); give a mesh without them (the FSDP "
                        "rule).")


def load_spec(mesh: Mesh, config, key: str, shape: tuple[int, ...], stacked: bool,
              name: str) -> PartitionSpec:
  """The loader's spec of the leaf `key`: the table's on a mesh with model axes (checked
  with `check_model_mesh`), else the FSDP rule over the mesh's first axis (strict)."""
  if splits_model(mesh):
    check_model_mesh(mesh, config)
    return parallel.leaf_spec(config, key, shape, stacked, dict(mesh.shape))
  axis = mesh.axis_names[0]
  return partition_spec(name, shape, axis, mesh.shape[axis], stacked)


def model_sharding(mesh: Mesh, config, params):
  """The NamedSharding of every leaf of a published Transformer's `params` by the table
  (`mdjax.models.parallel`), after `check_model_mesh`."""
  mesh = auto_axes(mesh)
  check_model_mesh(mesh, config)
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  specs = [parallel.leaf_spec(config, "/".join(str(getattr(k, "key", k)) for k in path),
                              np.shape(x), path[0].key in parallel.STACKS,
                              dict(mesh.shape)) for path, x in flat]
  return jax.tree.unflatten(treedef, [NamedSharding(mesh, s) for s in specs])


def bytes_per_device(config, mode: str, num_devices: int) -> int:
  """The parameter bytes each device holds when a published Transformer of `config` is
  split by `mode` over `num_devices` (from shapes: `jax.eval_shape`, no weights)."""
  shapes = jax.eval_shape(lambda: published.init_params(config, jax.random.key(0)))
  if mode != "fsdp":
    parallel.check(config, {MODES[mode]: num_devices})
  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
    key = "/".join(str(getattr(k, "key", k)) for k in path)
    stacked = key.split("/")[0] in parallel.STACKS
    if mode == "fsdp":
      spec = fsdp_spec(leaf.shape, DATA, num_devices, stacked=stacked)
    else:
      spec = parallel.leaf_spec(config, key, leaf.shape, stacked, {MODES[mode]: num_devices})
    parts = num_devices ** sum(axis is not None for axis in spec)
    total += leaf.size * leaf.dtype.itemsize // parts
  return total


def param_sharding(mesh: Mesh, params, fsdp: bool, axis_name: str | None = None):
  """The NamedSharding of every leaf of `params`: split by `fsdp_spec` over `axis_name`
  (default the mesh's first axis, as the loader splits; training's mesh has 'data' alone)
  with fsdp=True (matrices no dimension divides replicated), or all replicated."""
  mesh = auto_axes(mesh)
  axis_name = mesh.axis_names[0] if axis_name is None else axis_name
  size = mesh.shape[axis_name]
  spec = lambda x: fsdp_spec(np.shape(x), axis_name, size) if fsdp else PartitionSpec()
  return jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), params)


def shard_params(mesh: Mesh, params, fsdp: bool = True):
  """Parameters on the mesh as training stores them: split by the FSDP rule over the mesh's
  first axis (fsdp=True, train.fsdp=True), or replicated."""
  return jax.device_put(params, param_sharding(mesh, params, fsdp))


# ----------------------------------------------------------------------------
# Sampling on a mesh.
# ----------------------------------------------------------------------------


_GATHERED: dict[tuple, Denoiser] = {}


def gathered(apply_fn, mesh: Mesh) -> Denoiser:
  """The denoiser (and every pass it offers) computing with its parameters all-gathered.

  Stored sharded (FSDP), the weights are gathered where they are used, so every device
  runs one device's arithmetic and the tokens are one device's, bit for bit. Left to
  partition the matmuls over sharded weights instead, XLA sums in another order: logits
  move by ~1e-5 and near-ties in a sample flip. One wrapper per (denoiser, mesh), so
  repeated calls reuse the compiled program.
  """
  mesh = auto_axes(mesh)
  denoiser = Denoiser.of(apply_fn)
  wrapper = _GATHERED.get((denoiser, mesh))
  if wrapper is not None:
    return wrapper
  replicate = lambda params: jax.lax.with_sharding_constraint(
      params, jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), params))

  def on_gathered(method):
    return lambda params, *args, **kwargs: method(replicate(params), *args, **kwargs)

  wrapper = denoiser.map_passes(on_gathered)
  _GATHERED[denoiser, mesh] = wrapper
  return wrapper


def sample_on_mesh(apply_fn, params: Any, key: jax.Array, tokens_BxL, spec, mesh: Mesh, *,
                   fixed_BxL=None, valid_BxL=None, mask_id: int | None = None,
                   fsdp: bool = True) -> sampling.SampleResult:
  """`sampling.sample` with the batch split on the mesh's `data` axis and the parameters
  stored sharded (FSDP) over it, gathered where used (`gathered`): one program over every
  device, the same tokens as on one device (the rows keep their keys: `split(key, B)`)."""
  if DATA not in mesh.shape:
    raise ValueError(f"mesh has axes {tuple(mesh.shape)}; sampling splits the batch on 'data'.")
  mesh = auto_axes(mesh)
  batch, size = np.shape(tokens_BxL)[0], mesh.shape[DATA]
  if batch % size:
    raise ValueError(f"mesh data axis of {size} devices does not divide the batch B={batch}; "
                     f"use a batch that is a multiple of {size}.")
  rows = NamedSharding(mesh, PartitionSpec(DATA))
  put = lambda x: None if x is None else jax.device_put(np.asarray(x), rows)
  keys_B = sampling.row_keys(key, batch)
  params = jax.device_put(params, param_sharding(mesh, params, fsdp, DATA))
  return sampling.sample(gathered(apply_fn, mesh), params,
                         jax.device_put(keys_B, rows),
                         put(tokens_BxL), spec, put(fixed_BxL), mask_id=mask_id,
                         valid_BxL=put(valid_BxL))
