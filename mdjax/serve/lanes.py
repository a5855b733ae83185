"""A lane: the fixed slots of one sampler spec on one canvas length, and its compiled
programs: `empty` (the slots, idle), `admit` (a request's row started in a free slot),
`move` (a row copied from one slot to another, the vacated one idle) and `tick` (every
active row one denoising step, each at its own step: `sampling.Stepper.step`, vmapped over
rows; then, as `sample`'s loop does, each row jumps over the steps after it that would write
nothing, `Stepper.jump`: a block that a threshold filled early ticks none of its idle steps).

A lane keeps its active rows packed at the front of its slots (`Lane.order`: the slots in
the order they fill): a row that leaves is replaced by the last active row (`move`), so a
tick advances only the first `bucket` slots, the smallest power of two that holds the active
rows (capped at the slots). A lone request pays for a 1-row step, not for every slot. There
is one `tick` program per bucket (compiled on first use; at most log2(slots) + 1 of them),
and within a bucket shapes never change, so nothing retraces once each bucket has run;
`traces()` counts the programs traced so far.

A KV-cached spec (`kv_cache`) adds `refresh`: the rows whose next step makes a full pass (a
cache refresh; the tick reads back which) step in it alone, and the tick runs window passes
only (`KVPlan.window_only`), so no row pays a full pass at a step where it reads its cache."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.sampling import Carry, Stepper
from mdjax.sampling.end_of_row import EndOfRow
from mdjax.serve.row_axes import RowAxes

Array = jax.Array

# Every trace of an engine program bumps this (a Python side effect runs at trace time only).
_TRACES = itertools.count()
_traced = [0]


def count_trace() -> None:
  _traced[0] = next(_TRACES) + 1


def traces() -> int:
  """Engine programs traced in this process so far."""
  return _traced[0]


@struct.dataclass
class RowState:
  """One slot: the stepping carry of a one-row run, its plan, its step."""

  carry: Carry
  plan: Any
  valid_1xS: Array
  index: Array  # the next step
  active: Array
  kv_plan: Any = None  # the KV cache's per-step plan (a cached spec), else None
  full_next: Array | None = None  # a cached spec: the next step makes a full pass


_STATIC = ("denoiser", "stepper", "padded", "sharding", "axes")


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


def _start_rows(denoiser, params, keys_B, tokens_BxS, valid_BxS, plan, kv_plan=None, *,
                stepper: Stepper, padded: bool, sharding=None, axes=None) -> RowState:
  """A slot's state started on B rows (a lane's slot holds one: `_start_row`)."""
  valid = valid_BxS if padded else None
  carry = stepper.start(stepper.bind(denoiser, params, valid), keys_B, tokens_BxS,
                        valid_BxL=valid)
  full_next = None if kv_plan is None else stepper.needs_full(carry, 0, kv_plan)
  return RowState(carry=carry, plan=plan, valid_1xS=valid_BxS, index=jnp.int32(0),
                  active=jnp.bool_(True), kv_plan=kv_plan, full_next=full_next)


def _start_row(denoiser, params, key, tokens_1xS, valid_1xS, plan, kv_plan=None,
               **static) -> RowState:
  return _start_rows(denoiser, params, key[None], tokens_1xS, valid_1xS, plan, kv_plan,
                     **static)


def _empty_lane(denoiser, params, key, tokens_1xS, valid_1xS, plan, kv_plan=None, *, slots,
                **static):
  """`slots` idle rows (copies of one row, inactive): the lane's fixed shapes."""
  count_trace()
  axes: RowAxes = static["axes"]
  row = _start_row(denoiser, params, key, tokens_1xS, valid_1xS, plan, kv_plan, **static)
  rows = axes.stack(row, slots)
  return axes.placed(rows.replace(active=jnp.zeros((slots,), bool)), static["sharding"])


def _admit(denoiser, params, rows, slot, key, tokens_1xS, valid_1xS, plan, kv_plan=None,
           **static):
  """The rows with slot `slot` started on a new row."""
  count_trace()
  axes: RowAxes = static["axes"]
  row = _start_row(denoiser, params, key, tokens_1xS, valid_1xS, plan, kv_plan, **static)
  return axes.placed(axes.put(rows, slot, row), static["sharding"])


def shape_bytes(start_row, *args) -> int:
  """Device bytes of what `start_row(*args)` returns, from its shapes (`jax.eval_shape`:
  traced, neither compiled nor run)."""
  shapes = jax.eval_shape(start_row, *args)
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(shapes))


def move_row(rows, source, target, *, sharding, axes: RowAxes, **static):
  """The rows with slot `target` holding slot `source`'s row, and slot `source` idle (when
  the two are one slot: that slot idle)."""
  count_trace()
  rows = axes.put(rows, target, axes.take(rows, source))
  rows = rows.replace(active=rows.active.at[source].set(False))
  return axes.placed(rows, sharding)


class TickOutputs:
  """A tick's results, indexed by slot (zeros where no row ran): `active_N`, the stop flags,
  read back at every tick; `tokens_NxS`, `lengths_N` (generated length) and `steps_N`
  read back only when first asked for (a row finished, or a client streams every step)."""

  def __init__(self, front: list[int], slots: int, active, tokens, lengths, steps):
    self.front, self.slots = front, slots
    self._device = (tokens, lengths, steps)
    (self.active_N,) = by_slot(front, slots, active)

  @functools.cached_property
  def _host(self) -> tuple[np.ndarray, ...]:
    return by_slot(self.front, self.slots, *self._device)

  @property
  def tokens_NxS(self) -> np.ndarray:
    return self._host[0]

  @property
  def lengths_N(self) -> np.ndarray:
    return self._host[1]

  @property
  def steps_N(self) -> np.ndarray:
    return self._host[2]


def by_slot(front: list[int], slots: int, *values_N) -> tuple[np.ndarray, ...]:
  """Each tick output of the front rows on the host, as an array over all `slots` (zeros
  where no row ran)."""
  out = []
  for values in map(np.asarray, values_N):
    array = np.zeros((slots,) + values.shape[1:], values.dtype)
    array[front] = values
    out.append(array)
  return tuple(out)


def _row_step(denoiser, params, row: RowState, *, stepper: Stepper, padded, num_steps,
              passes: str = "any") -> RowState:
  """One step of one row (an idle row as it is). passes (a cached spec): "window", no row of
  the program makes a full pass at this step (`kv_cache.KVPlan.window_only`); "full", every
  row does (`KVPlan.full_only`); "any", each row's plan chooses (under vmap a per-row
  choice runs every pass it may choose)."""
  index = jnp.minimum(row.index, num_steps - 1)
  bound = stepper.bind(denoiser, params, row.valid_1xS if padded else None)
  kv_plan = row.kv_plan
  if kv_plan is not None and passes != "any":
    kv_plan = kv_plan.replace(window_only=passes == "window", full_only=passes == "full")
  carry = stepper.step(bound, row.carry, index, row.plan, kv_plan)
  following = index + 1
  if stepper.skips_idle:  # as offline: a block the threshold has filled ticks no idle step
    # (a row that ends here keeps its step: its last update names the step it ended at)
    jumped, skipped = stepper.jump(carry, following, row.plan, row.kv_plan)
    ends = stepper.done(carry, following)[0]
    following = jnp.where(ends, following, jumped)
    carry = jax.tree.map(lambda here, there: jnp.where(ends, here, there), carry, skipped)
  keep = lambda new, old: jnp.where(row.active, new, old)
  row = row.replace(carry=jax.tree.map(keep, carry, row.carry),
                    index=keep(following, row.index),
                    active=row.active & ~stepper.done(carry, following)[0])
  if kv_plan is None:
    return row
  next_index = jnp.minimum(row.index, num_steps - 1)
  return row.replace(full_next=stepper.needs_full(row.carry, next_index, row.kv_plan))


def _tick(denoiser, params, rows, hold_N=None, *, stepper: Stepper, padded, sharding,
          axes: RowAxes, num_steps, bucket, split=1):
  """One step for every active row among the `bucket` front slots (`RowAxes.front`; each row at
  its own step): (rows, and of those slots, in `Lane.front` order: tokens_BxS, active_B,
  generated_length_B, index_B, full_next_B). One program per bucket; the other slots are not
  read. A cached spec's tick makes window passes only: the rows whose step makes a full pass
  were stepped by `_refresh` before it, and `hold_N` keeps them as they are."""
  count_trace()
  step = functools.partial(_row_step, denoiser, params, stepper=stepper, padded=padded,
                           num_steps=num_steps, passes="any" if hold_N is None else "window")
  if hold_N is not None:
    held = rows.replace(active=rows.active & hold_N)
    rows = rows.replace(active=rows.active & ~hold_N)

  if bucket == rows.active.shape[0]:  # every slot: the rows as they are
    rows = front = axes.placed(axes.vmap(step)(rows), sharding)
  else:
    front = axes.front(rows, split, bucket)
    front = axes.placed(axes.vmap(step)(axes.placed(front, sharding)), sharding)
    rows = axes.placed(axes.put_front(rows, front, split), sharding)
  if hold_N is not None:  # the held rows, as `_refresh` left them
    rows = axes.placed(rows.replace(active=rows.active | held.active), sharding)
    front = axes.front(rows, split, bucket)
  return (rows,) + _outputs(front, stepper, axes)


def _outputs(stepped: RowState, stepper: Stepper, axes: RowAxes) -> tuple:
  """What a program that stepped these rows reads back (`TickOutputs`), in their order:
  tokens_BxS, active_B, generated_length_B, index_B, full_next_B."""
  end = EndOfRow.of(stepper.spec)
  lengths_B = jax.vmap(lambda r: end.generated_length(
      r.carry.tokens_BxL, r.carry.ctx.editable_BxL, stepper.mask_id)[0],
      in_axes=(axes.tree(),))(stepped)
  return (stepped.carry.tokens_BxL[:, 0], stepped.active, lengths_B, stepped.index,
          stepped.full_next)


def _refresh(denoiser, params, rows, slots_R, *, stepper: Stepper, padded, sharding,
             axes: RowAxes, num_steps):
  """The rows of `slots_R` (repeats allowed: they compute the same row) one step each, a
  full pass where their plan makes one (a cached spec's rows that refresh their cache this
  tick: a program over them alone, so the lane's tick runs window passes only): (rows, and
  of `slots_R`, in its order, what `_tick` returns of its front). On the dual cache every
  one of them makes a full pass (`full_only`), so none pays the window pass as well."""
  count_trace()
  picked = axes.gather(rows, slots_R)
  passes = "full" if picked.kv_plan.append is None else "any"
  picked = axes.vmap(functools.partial(_row_step, denoiser, params, stepper=stepper,
                                       padded=padded, num_steps=num_steps,
                                       passes=passes))(picked)
  rows = axes.placed(axes.scatter(rows, slots_R, picked), sharding)
  return (rows,) + _outputs(picked, stepper, axes)


def own_copy(fn):
  """A new function object that runs `fn`. jax keeps a program while the function it was
  traced from lives (its caches hold functions weakly): a lane that jits its own copies
  takes its compiled programs with it when it is dropped."""
  @functools.wraps(fn)
  def run(*args, **kwargs):
    return fn(*args, **kwargs)
  return run


class Programs:
  """One lane's compiled programs, jitted afresh for it (`own_copy`): `empty`, `admit`,
  `move` and `tick` (one program a bucket). Dropping the lane frees them."""

  def __init__(self):
    self.empty = jax.jit(own_copy(_empty_lane), static_argnames=_STATIC + ("slots",))
    self.admit = jax.jit(own_copy(_admit), static_argnames=_STATIC,
                         donate_argnames=("rows",))
    self.move = jax.jit(own_copy(move_row), static_argnames=_STATIC, donate_argnames=("rows",))
    self.tick = jax.jit(own_copy(_tick), static_argnames=_STATIC + ("num_steps", "bucket",
                                                                     "split"),
                        donate_argnames=("rows",))
    self.refresh = jax.jit(own_copy(_refresh), static_argnames=_STATIC + ("num_steps",),
                           donate_argnames=("rows",))


@dataclasses.dataclass
class Slot:
  """Who holds a slot: a request's handle (`jobs.Handle`), its row, when it started."""

  handle: Any
  choice: int
  started: float


class Lane:
  """The slots of one (spec, canvas length): their device state and who holds each.

  The active rows always hold the first `active` slots of `order`; `ticks_by_bucket`
  counts the ticks run on each bucket's program."""

  def __init__(self, job, slots: int, padded: bool):
    """The lane of `job`'s spec and canvas (an `jobs.Job`), its `slots` rows idle."""
    self.key = job.lane_key
    self.family = job.stepper.family
    sharding = row_sharding(job.params, slots)
    self.static = dict(denoiser=job.denoiser, stepper=job.stepper, padded=padded,
                       sharding=sharding, axes=self.row_axes(job, padded))
    self.params, self.num_steps = job.params, job.num_steps
    self.slots = slots
    # Rows split over a 'data' axis of size d live in d equal parts, one a device. Slicing
    # the first `bucket` slots would put every active row on the first device (and move
    # them there each tick), so the front is the first bucket / d slots of each part
    # (`RowAxes.front`, a local slice on every device) and buckets are multiples of d: the active
    # rows fill the parts in turn (`order`), so every device ticks an equal share.
    self.split = data_split(sharding, slots)
    part = slots // self.split
    self.order = [(i % self.split) * part + i // self.split for i in range(slots)]
    self.owners: list[Slot | None] = [None] * slots
    self.programs = Programs()
    self.rows = self.programs.empty(job.denoiser, job.params, jax.random.key(0),
                                    *self.row_inputs(job), slots=slots,
                                    **lane_static(self.static))
    self.ticks_by_bucket: collections.Counter[int] = collections.Counter()
    self.last_used = time.monotonic()
    # A cached spec: per slot, whether the row's next step makes a full pass (read back
    # from each tick), and the full-pass steps run.
    self.full_next = None if job.kv_plan is None else np.zeros(slots, bool)
    self.full_passes = 0

  @property
  def active(self) -> int:
    return sum(owner is not None for owner in self.owners)

  def free_slot(self) -> int | None:
    active = self.active
    return self.order[active] if active < self.slots else None

  def bucket(self, active: int | None = None) -> int:
    """The slots a tick advances for `active` rows (default: the lane's): the smallest
    power of two >= them, rounded up to a multiple of the split, at most the slots."""
    active = self.active if active is None else active
    bucket = 1 << max(0, active - 1).bit_length()
    return min(self.slots, -(-bucket // self.split) * self.split)

  def front(self, bucket: int) -> list[int]:
    """The slots a tick of `bucket` advances, in the order its outputs list them."""
    part = self.slots // self.split
    return [p * part + i for p in range(self.split) for i in range(bucket // self.split)]

  @staticmethod
  def row_axes(job, padded: bool) -> RowAxes:
    """Where the lane keeps each leaf's slots (`row_axes`): from the shapes of a slot
    started on one row and on two (nothing compiles)."""
    start = functools.partial(_start_rows, job.denoiser, stepper=job.stepper, padded=padded)
    two = lambda x: np.concatenate([x, x])
    one_row = jax.eval_shape(start, job.params, jax.random.key(0)[None], job.tokens_1xS,
                             job.valid_1xS, job.plan, job.kv_plan)
    two_rows = jax.eval_shape(start, job.params, jax.random.split(jax.random.key(0)),
                              two(job.tokens_1xS), two(job.valid_1xS), job.plan, job.kv_plan)
    return RowAxes.of(one_row, two_rows)

  @classmethod
  def row_bytes(cls, job, padded: bool) -> int:
    """Device bytes of one slot of `job`'s lane (its keys and values too, for a cached
    spec), from shapes: nothing compiles."""
    start = functools.partial(_start_row, job.denoiser, stepper=job.stepper, padded=padded)
    return shape_bytes(start, job.params, jax.random.key(0), *cls.row_inputs(job))

  @staticmethod
  def row_inputs(job) -> tuple:
    """What `admit` starts a row of `job` from (after its key)."""
    return job.tokens_1xS, job.valid_1xS, job.plan, job.kv_plan

  def canvas_ids(self, tokens_NxS: np.ndarray, slot: int, job) -> np.ndarray:
    """A row's generated positions in a tick's tokens (the canvas's last max_new_tokens)."""
    return tokens_NxS[slot, -job.max_new_tokens:]

  def admit(self, handle, choice: int) -> None:
    slot, job = self.free_slot(), handle.job
    key = jax.random.fold_in(jax.random.key(job.seed), choice)  # generate's row key
    self.rows = self.programs.admit(job.denoiser, self.params, self.rows, np.int32(slot), key,
                                    *self.row_inputs(job), **lane_static(self.static))
    self.owners[slot] = Slot(handle, choice, time.monotonic())
    if self.full_next is not None:
      self.full_next[slot] = True  # a new row's cache is stale: its first step refreshes it
    self.last_used = time.monotonic()

  def release(self, slots, idle: bool = False) -> None:
    """The rows of `slots` leave: the last active rows move into their slots, so the
    active rows stay at the front. idle: their device rows may still be active (a
    cancelled row), so mark them idle even where nothing moves."""
    position = {slot: i for i, slot in enumerate(self.order)}
    for slot in sorted(slots, key=position.__getitem__, reverse=True):
      last = self.order[self.active - 1]
      if last != slot or idle:
        self.rows = self.programs.move(self.rows, np.int32(last), np.int32(slot),
                                       **lane_static(self.static))
      self.owners[slot], self.owners[last] = self.owners[last], None  # last == slot: None
      if self.full_next is not None:
        self.full_next[slot] = self.full_next[last]

  def tick(self, bucket: int | None = None) -> TickOutputs:
    """One tick of the `bucket` program (default: the lane's bucket): its outputs by slot,
    filled for the ticked slots."""
    bucket = self.bucket() if bucket is None else bucket
    front, hold_N = self.front(bucket), None
    if self.full_next is not None:  # a cached spec: full passes only for the rows making one
      hold_N = np.zeros(self.slots, bool)
      refreshing = [slot for slot in front if self.owners[slot] is not None
                    and self.full_next[slot]]
      if refreshing:
        outputs = self._refresh(refreshing)
        if len(refreshing) == self.active:  # every row stepped: no tick left to run
          self.last_used = time.monotonic()
          return outputs
        hold_N[refreshing] = True
    self.rows, tokens, active, lengths, steps, full_next = self.programs.tick(
        self.static["denoiser"], self.params, self.rows, hold_N, num_steps=self.num_steps,
        bucket=bucket, split=self.split, **lane_static(self.static))
    self.ticks_by_bucket[bucket] += 1
    self.last_used = time.monotonic()
    if self.full_next is not None:
      self.full_next[front] = np.asarray(full_next)
    return TickOutputs(front, self.slots, active, tokens, lengths, steps)

  def _refresh(self, slots: list[int]) -> TickOutputs:
    """Steps the rows of `slots` (their step makes a full pass) in one `refresh` program of a
    power-of-two size (repeats fill it): their outputs, as a tick of those rows alone."""
    size = 1 << max(0, len(slots) - 1).bit_length()
    padded = slots + [slots[0]] * (size - len(slots))
    self.rows, tokens, active, lengths, steps, full_next = self.programs.refresh(
        self.static["denoiser"], self.params, self.rows, np.asarray(padded, np.int32),
        num_steps=self.num_steps, **lane_static(self.static))
    self.full_passes += len(slots)
    self.full_next[padded] = np.asarray(full_next)  # a repeat reads its row's own value
    return TickOutputs(padded, self.slots, active, tokens, lengths, steps)

  def warm(self, job) -> None:
    """Compiles the lane's programs now: `admit` (a row of `job`, made idle again at once),
    `move` and every bucket's tick (an idle lane only: its rows are idle, so those ticks
    change nothing)."""
    if self.active:
      raise RuntimeError("warm() runs on an idle lane only")
    static = lane_static(self.static)
    self.rows = self.programs.admit(job.denoiser, self.params, self.rows, np.int32(0),
                                    jax.random.key(0), *self.row_inputs(job), **static)
    self.rows = self.programs.move(self.rows, np.int32(0), np.int32(0), **static)
    counted = self.ticks_by_bucket.copy()  # these ticks serve nobody: not counted
    for bucket in sorted({self.bucket(active) for active in range(1, self.slots + 1)}):
      self.tick(bucket)
    self.ticks_by_bucket = counted
    if self.full_next is not None:  # idle rows: these steps change nothing
      passes, size = self.full_passes, 1
      while True:  # every size `_refresh` runs: powers of two up to the first >= the slots
        self._refresh([0] * size)
        if size >= self.slots:
          break
        size *= 2
      self.full_passes = passes


def data_split(sharding, slots: int) -> int:
  """The parts the rows are split into over the mesh's 'data' axis (1: not split)."""
  if sharding is None or sharding.spec == jax.sharding.PartitionSpec(None):
    return 1
  return sharding.mesh.shape["data"]


def lane_static(static: dict) -> dict:
  return {k: v for k, v in static.items() if k != "denoiser"}


# ----------------------------------------------------------------------------
