"""Where a lane keeps each row: the slot axis of every leaf of its rows.

A lane stacks its one-row carries over its slots. Stacked in front ([slots, ...] for every
leaf), a KV cache that a model keeps stacked over its layers ([N, B, ...]: `published`'s
keys_NxBxGxLxK) became [slots, N, 1, ...], and every tick copied it whole to layers-major
for the model's scan over layers (two copies of the cache a tick on the LLaDA-shaped bench
model: the served tick's largest cost beyond the offline step's). So each leaf keeps its
rows on its own batch axis, the axis where a two-row start differs from a one-row one
([N, slots, 1, ...]: the layers stay leading, the slots sit beside the one row of each),
and every other leaf in front. The programs of `lanes` and `block_lanes` index, slice,
vmap and shard the rows through a `RowAxes`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class RowAxes:
  """The slot axis of each leaf of a lane's rows (a pytree like one row). Hashable: a
  static argument of the lane's programs."""

  treedef: Any
  axes: tuple[int, ...]

  @classmethod
  def of(cls, one_row, two_rows) -> "RowAxes":
    """From the shapes of a row started from one row's inputs and from two rows' (pytrees
    of one structure): a leaf's first axis whose size differs, else 0."""
    leaves, treedef = jax.tree.flatten(one_row)
    axes = tuple(next((axis for axis, (a, b) in enumerate(zip(one.shape, two.shape))
                       if a != b), 0)
                 for one, two in zip(leaves, jax.tree.leaves(two_rows)))
    return cls(treedef, axes)

  def tree(self):
    """The axes as a pytree of ints like a row (vmap's in_axes / out_axes)."""
    return jax.tree.unflatten(self.treedef, self.axes)

  def map(self, fn: Callable, rows, *others):
    """fn(axis, leaf, *other leaves) over the leaves of `rows` (and of `others`, rows of
    the same structure)."""
    leaves, treedef = jax.tree.flatten(rows)
    other_leaves = [treedef.flatten_up_to(other) for other in others]
    return jax.tree.unflatten(treedef, [fn(axis, leaf, *(o[i] for o in other_leaves))
                                        for i, (axis, leaf) in enumerate(zip(self.axes,
                                                                             leaves))])

  def vmap(self, fn: Callable, out_rows: bool = True) -> Callable:
    """`fn(row) -> row` (or `-> (row, outputs)` with out_rows False: outputs on axis 0)
    vmapped over the slots of rows."""
    tree = self.tree()
    return jax.vmap(fn, in_axes=(tree,), out_axes=tree if out_rows else (tree, 0))

  def stack(self, row, slots: int):
    """`slots` copies of `row`."""
    return self.map(lambda axis, leaf: jnp.repeat(jnp.expand_dims(leaf, axis), slots, axis),
                    row)

  def take(self, rows, slot):
    """The row in `slot` (a traced int)."""
    return self.map(lambda axis, leaf: jax.lax.dynamic_index_in_dim(leaf, slot, axis,
                                                                    keepdims=False), rows)

  def put(self, rows, slot, row):
    """`rows` with `row` in `slot`."""
    return self.map(lambda axis, leaf, one: jax.lax.dynamic_update_index_in_dim(
        leaf, one, slot, axis), rows, row)

  def gather(self, rows, slots_R: Array):
    """The rows of `slots_R` (repeats allowed), stacked as rows are."""
    return self.map(lambda axis, leaf: jnp.take(leaf, slots_R, axis=axis), rows)

  def scatter(self, rows, slots_R: Array, picked):
    """`rows` with `picked` (from `gather`) written back to `slots_R` (a repeated slot
    holds one row)."""
    return self.map(lambda axis, leaf, new: leaf.at[(slice(None),) * axis + (slots_R,)].set(
        new), rows, picked)

  def front(self, rows, split: int, bucket: int):
    """The `bucket` slots a tick advances: the first bucket / split of each of the `split`
    equal parts of the slots (the parts the 'data' axis puts on its devices)."""
    def front_of(axis, leaf):
      shape = leaf.shape
      parts = leaf.reshape(shape[:axis] + (split, shape[axis] // split) + shape[axis + 1:])
      front = jax.lax.slice_in_dim(parts, 0, bucket // split, axis=axis + 1)
      return front.reshape(shape[:axis] + (bucket,) + shape[axis + 1:])
    return self.map(front_of, rows)

  def put_front(self, rows, front, split: int):
    """`rows` with their `front` slots replaced by `front` (in place: the rows are
    donated)."""
    def put(axis, leaf, new):
      shape, count = leaf.shape, new.shape[axis]
      parts = leaf.reshape(shape[:axis] + (split, shape[axis] // split) + shape[axis + 1:])
      new = new.reshape(shape[:axis] + (split, count // split) + shape[axis + 1:])
      return jax.lax.dynamic_update_slice_in_dim(parts, new, 0, axis=axis + 1).reshape(shape)
    return self.map(put, rows, front)

  def placed(self, rows, sharding):
    """The rows on the lane's sharding, each leaf's slot axis split as `sharding` says
    (every program returns them there, so the next one sees the same input shardings and
    nothing retraces); None: as they are."""
    if sharding is None:
      return rows
    spec = tuple(sharding.spec)
    shardings = self.map(lambda axis, leaf: jax.sharding.NamedSharding(
        sharding.mesh, jax.sharding.PartitionSpec(*((None,) * axis + spec))), rows)
    return jax.lax.with_sharding_constraint(rows, shardings)
