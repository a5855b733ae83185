"""A lane: the fixed slots of one sampler spec on one canvas length, and its three compiled
programs: `empty` (the slots, idle), `admit` (a request's row started in a free slot) and
`tick` (every active row one denoising step, each at its own step: the driver's step,
vmapped over rows). Shapes never change within a lane, so nothing retraces while serving;
`traces()` counts the programs traced so far."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax import sampling
from mdjax.sampling import driver
from mdjax.sampling.base import BoundDenoiser, Context
from mdjax.sampling.end_of_row import EndOfRow

Array = jax.Array

# Every trace of an engine program bumps this (a Python side effect runs at trace time only).
_TRACES = itertools.count()
_traced = [0]


def _count_trace() -> None:
  _traced[0] = next(_TRACES) + 1


def traces() -> int:
  """Engine programs traced in this process so far."""
  return _traced[0]


@struct.dataclass
class RowState:
  """One slot: the driver's loop state of a one-row run, its constants, its plan, its step."""

  loop: driver.LoopState
  ctx: Context
  plan: Any
  valid_1xS: Array
  index: Array  # the next step
  active: Array


_STATIC = ("denoiser", "family", "spec", "mask_id", "vocab_size", "padded", "sharding")


def _placed(rows: RowState, sharding) -> RowState:
  """The rows on the lane's sharding (every program returns them there, so the next one
  sees the same input shardings and nothing retraces)."""
  return rows if sharding is None else jax.lax.with_sharding_constraint(rows, sharding)


def row_sharding(params, slots: int):
  """Where a lane's rows live: split over the 'data' axis of the mesh the parameters are
  on (when it divides the slots), else replicated on it; None off a mesh."""
  for leaf in jax.tree.leaves(params):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
      mesh = sharding.mesh
      data = mesh.shape.get("data", 1)
      spec = jax.sharding.PartitionSpec("data" if data > 1 and slots % data == 0 else None)
      return jax.sharding.NamedSharding(mesh, spec)
  return None


def _bound(denoiser, params, row_ctx: Context, valid_1xS, padded: bool) -> BoundDenoiser:
  return BoundDenoiser(denoiser, params, valid_1xS if padded else None,
                       mask_in_vocab=row_ctx.mask_in_vocab)


def _start_row(denoiser, params, key, tokens_1xS, valid_1xS, plan, *, family, spec, mask_id,
               vocab_size, padded, sharding=None) -> RowState:
  core, ctx = driver._start(key[None], tokens_1xS, None, mask_id,
                            valid_1xS if padded else None, vocab_size)
  loop = driver._init(family, spec, _bound(denoiser, params, ctx, valid_1xS, padded), core,
                      ctx, cached=False)
  return RowState(loop=loop, ctx=ctx, plan=plan, valid_1xS=valid_1xS, index=jnp.int32(0),
                  active=jnp.bool_(True))


@functools.partial(jax.jit, static_argnames=_STATIC + ("slots",))
def _empty_lane(denoiser, params, key, tokens_1xS, valid_1xS, plan, *, slots, **static):
  """`slots` idle rows (copies of one row, inactive): the lane's fixed shapes."""
  _count_trace()
  row = _start_row(denoiser, params, key, tokens_1xS, valid_1xS, plan, **static)
  rows = jax.vmap(lambda _: row)(jnp.arange(slots))
  return _placed(rows.replace(active=jnp.zeros((slots,), bool)), static["sharding"])


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("rows",))
def _admit(denoiser, params, rows, slot, key, tokens_1xS, valid_1xS, plan, **static):
  """The rows with slot `slot` started on a new row."""
  _count_trace()
  row = _start_row(denoiser, params, key, tokens_1xS, valid_1xS, plan, **static)
  rows = jax.tree.map(lambda all_rows, one: all_rows.at[slot].set(one), rows, row)
  return _placed(rows, static["sharding"])


@functools.partial(jax.jit, static_argnames=_STATIC + ("num_steps",),
                   donate_argnames=("rows",))
def _tick(denoiser, params, rows, *, family, spec, mask_id, vocab_size, padded, sharding,
          num_steps):
  """One step for every active row (each at its own step): (rows, tokens_NxS, active_N,
  generated_length_N)."""
  _count_trace()
  end = EndOfRow.of(spec)

  def step(row: RowState) -> RowState:
    index = jnp.minimum(row.index, num_steps - 1)
    inputs = driver.StepInputs(index=index, plan=driver._at(row.plan, index), kv_plan=None)
    bound = _bound(denoiser, params, row.ctx, row.valid_1xS, padded)
    loop = driver._step(family, spec, bound, row.ctx, row.loop, inputs)
    tokens_1xS = loop.core.tokens_BxL
    still_open = jnp.asarray(end.any_open(tokens_1xS, row.ctx))
    if not family.rewrites:  # a filled canvas no step changes: the row is done
      still_open &= row.ctx.masked(tokens_1xS).any()
    keep = lambda new, old: jnp.where(row.active, new, old)
    return row.replace(loop=jax.tree.map(keep, loop, row.loop),
                       index=keep(index + 1, row.index),
                       active=row.active & (index + 1 < num_steps) & still_open)

  rows = _placed(jax.vmap(step)(rows), sharding)
  tokens_NxS = rows.loop.core.tokens_BxL[:, 0]
  lengths_N = jax.vmap(lambda r: end.generated_length(r.loop.core.tokens_BxL,
                                                      r.ctx.editable_BxL, mask_id)[0])(rows)
  return rows, tokens_NxS, rows.active, lengths_N


@dataclasses.dataclass
class Slot:
  """Who holds a slot: a request's handle (`engine.Handle`), its row, when it started."""

  handle: Any
  choice: int
  started: float


class Lane:
  """The slots of one (spec, canvas length): their device state and who holds each."""

  def __init__(self, job, slots: int, padded: bool):
    """The lane of `job`'s spec and canvas (an `engine.Job`), its `slots` rows idle."""
    self.key = job.lane_key
    self.family = sampling.family_of(job.spec)
    self.static = dict(denoiser=job.denoiser, family=self.family, spec=job.spec,
                       mask_id=job.mask_id, vocab_size=job.vocab_size, padded=padded,
                       sharding=row_sharding(job.params, slots))
    self.params, self.num_steps = job.params, job.num_steps
    self.owners: list[Slot | None] = [None] * slots
    self.rows = _empty_lane(job.denoiser, job.params, jax.random.key(0), job.tokens_1xS,
                            job.valid_1xS, job.plan, slots=slots, **_lane_static(self.static))
    self.last_used = time.monotonic()

  @property
  def active(self) -> int:
    return sum(owner is not None for owner in self.owners)

  def free_slot(self) -> int | None:
    return next((i for i, owner in enumerate(self.owners) if owner is None), None)

  def admit(self, handle, choice: int) -> None:
    slot, job = self.free_slot(), handle.job
    key = jax.random.fold_in(jax.random.key(job.seed), choice)  # generate's row key
    self.rows = _admit(job.denoiser, self.params, self.rows, np.int32(slot), key,
                       job.tokens_1xS, job.valid_1xS, job.plan, **_lane_static(self.static))
    self.owners[slot] = Slot(handle, choice, time.monotonic())
    self.last_used = time.monotonic()

  def tick(self):
    self.rows, tokens, active, lengths = _tick(
        self.static["denoiser"], self.params, self.rows, num_steps=self.num_steps,
        **{k: v for k, v in self.static.items() if k != "denoiser"})
    self.last_used = time.monotonic()
    return (np.asarray(tokens), np.asarray(active), np.asarray(lengths),
            np.asarray(self.rows.index))


def _lane_static(static: dict) -> dict:
  return {k: v for k, v in static.items() if k != "denoiser"}


# ----------------------------------------------------------------------------
