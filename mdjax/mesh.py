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

# The mesh axis that training splits the batch (and, with FSDP, the parameters) over.
DATA = "data"


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
