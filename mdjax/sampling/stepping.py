"""The public stepping door: one sampler step at a time, from inside or outside a trace.

`Stepper` is the static half of a call (the spec, the ids; hashable, so a static argument
of jit); `Carry` is what one step hands the next (the canvas, the family's own carry, the
call's constants). Everyone who drives a family goes through them: `sample` scans
`Stepper.step` inside one program, `sample_python_loop` calls it from a Python loop, a
served lane vmaps it over rows at different steps, and block generation runs it on one
block at a time. A run's checks and plan come from `sampling.prepare`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.sampling import kv_cache, skipping, threefry
from mdjax.sampling.base import (BoundDenoiser, Canvas, Context, CountedView, Core, Counters,
                                 Family, SamplerSpec, StepInfo, family_of, mask_inside)
from mdjax.sampling.end_of_row import EndOfRow

Array = jax.Array


def _is_key_batch(key: Array) -> bool:
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key.ndim == 1
  return key.ndim == 2


def check_key_rows(key: Array, batch: int) -> None:
  """A batch of row keys has one key per canvas row (one key is split into B)."""
  if _is_key_batch(key) and key.shape[0] != batch:
    raise ValueError(f"key holds {key.shape[0]} row keys; tokens_BxL has B={batch} rows.")


def row_keys(key: Array, batch: int) -> Array:
  """Per-row keys: a batch of keys as given, or `split(key, B)` of one key."""
  check_key_rows(key, batch)
  return key if _is_key_batch(key) else jax.random.split(key, batch)


@struct.dataclass
class SampleResult(CountedView):
  """What `sample` returns.

  tokens_BxL: the final canvas. write_step_BxL: the step at which each position last
  received its value (-1 for positions never written).
  counters: what the run counted (`base.Counters`), each also read by name:
    nfe: sequential denoiser calls made (a batched call of several contexts counts once).
    saved_calls: steps whose call was skipped (nothing to write, or an unchanged canvas).
    contexts_B: sequences evaluated for each row (a call of J contexts counts J).
    rounds_B: steps (speculative: rounds) in which the row still had positions to write:
      its sequential depth.
    reopened_B: committed tokens returned to the mask (remasking, revision).
    nonfinite_B: positions of the row written from non-finite (NaN or inf) logits.
  invalid_B: positions of the row whose input was invalid (a token id outside [0, V) that is
    not the mask id, or a fixed position holding the mask id). `sample` raises for these before tracing; inside
    the caller's jit, where values cannot be read before the run, they are reported here.
  unfilled_B: editable positions of the row still masked at the end (0 for every family
    when the spec covers the canvas; inside a jit, a write order that misses positions
    shows here).
  generated_length_B: editable positions of the row before its first EOS (`spec.eos_id`;
    every editable position when the row has none or eos_id is None).
  trajectory_KxBxL: the canvas after each step, if the spec records it.
  extras: family-specific outputs (RevisionSpec: `changes_KxB`).
  """

  tokens_BxL: Array
  write_step_BxL: Array
  counters: Counters
  invalid_B: Array
  unfilled_B: Array
  generated_length_B: Array
  trajectory_KxBxL: Array | None = None
  extras: dict = struct.field(default_factory=dict)


# The driver jumps over idle steps only when at least this fraction of the steps is idle. The
# jumping while loop costs one test per step (under 1 us on the CPU, 0 to 3% of a bench-model
# step, within noise) but on an accelerator each test is a device-to-host read of the loop
# predicate, where a scan runs without one; a scan stays the default where few calls are saved.
IDLE_FRACTION_TO_SKIP = 0.1


def skips_idle_steps(family: Family, spec, canvas: Canvas | None = None, plan=None) -> bool:
  """Whether the program jumps over idle steps (see `SamplerSpec.skip_idle_steps`); the one
  place this is decided. Without a canvas (a run inside a composite family, whose positions
  are chosen at run time) the idle steps cannot be counted before the run."""
  if spec.skip_idle_steps is False:
    return False
  if EndOfRow.of(spec).leaves_idle_steps:
    return True
  if family.rewrites and not family.stops_early:
    return False
  if spec.skip_idle_steps or canvas is None:
    return True
  idle = family.idle_steps(spec, canvas, plan)
  return idle is None or idle >= IDLE_FRACTION_TO_SKIP * family.num_steps(spec, canvas.length)


# ----------------------------------------------------------------------------
# One step, and the loops over it.
# ----------------------------------------------------------------------------


@struct.dataclass
class _Reuse:
  """The last call's canvas and logits (families whose denoiser ignores t)."""

  tokens_BxL: Array
  logits_BxLxV: Array


@dataclasses.dataclass(frozen=True)
class StepDenoiser:
  """A step's denoiser as a family's `update` gets it: `denoise(tokens_NxL)` evaluates
  further contexts at the step's t; `encode_condition(shaped_NxLxV)` makes the next call's
  self-conditioning input (`BoundDenoiser.encode_condition`)."""

  bound: BoundDenoiser
  t: Any

  def __call__(self, tokens_NxL: Array, row_major: bool = False) -> Array:
    return self.bound(tokens_NxL, self.t, row_major)

  def encode_condition(self, shaped_NxLxV: Array) -> Array:
    return self.bound.encode_condition(shaped_NxLxV)


@struct.dataclass
class LoopState:
  """What a step-wise family's loop carries from one step to the next."""

  core: Core  # the canvas and the counters every family shares
  aux: Any  # the family's own carry (`Family.init`; None when it has none)
  reuse: _Reuse | None  # the last call's canvas and logits (a family that reuses logits)
  kv: kv_cache.KVState | None  # the KV cache (a spec with kv_cache), else None


@struct.dataclass
class StepInputs:
  """What the loop hands one step: its index and its slices of the per-step plans."""

  index: Array  # the step i, 0..K-1
  plan: Any  # the family's plan at step i
  kv_plan: kv_cache.KVPlan | None  # the cache's plan at step i (a cached spec), else None


def plan_at(plan_K, index):
  """Step `index` of per-step plans (leading axis K; host or device arrays); None stays None.
  A host index slices on the host; a traced one reads the plan as a device array."""
  if isinstance(index, (int, np.integer)):
    return jax.tree.map(lambda x: x[index], plan_K)
  return jax.tree.map(lambda x: jnp.asarray(x)[index], plan_K)


def start_canvas(key, tokens_BxL, fixed_BxL, mask_id: int, valid_BxL=None,
                 vocab_size: int | None = None) -> tuple[Core, Context]:
  """The shared carry and the call's constants, from the arguments as `sample` got them.
  With a validity mask, draws are indexed from each row's first valid position."""
  tokens_BxL = tokens_BxL.astype(jnp.int32)
  fixed_BxL = tokens_BxL != mask_id if fixed_BxL is None else fixed_BxL.astype(bool)
  keys_B = row_keys(key, tokens_BxL.shape[0])
  shift_B = None if valid_BxL is None else jnp.argmax(valid_BxL, -1).astype(jnp.int32)
  return Core.start(tokens_BxL), Context(mask_id=mask_id, editable_BxL=~fixed_BxL, keys_B=keys_B,
                                         shift_B=shift_B, vocab_size=vocab_size)


def init_loop(family: Family, spec, denoiser: BoundDenoiser, core: Core, ctx: Context,
              cached: bool) -> LoopState:
  """The loop's state at step 0: the core the family starts from (`Family.start`), its
  carry beside it, the reuse slot when it reuses logits, the KV cache when `cached`."""
  core = family.start(spec, core, ctx)
  reuse = None
  if family.reuses_logits(spec):
    out = jax.eval_shape(denoiser, core.tokens_BxL, 1.0)
    reuse = _Reuse(tokens_BxL=jnp.full_like(core.tokens_BxL, -1),
                   logits_BxLxV=jnp.zeros(out.shape, out.dtype))
  kv = kv_cache.init(denoiser, core.tokens_BxL) if cached else None
  return LoopState(core=core, aux=family.init(spec, core, ctx), reuse=reuse, kv=kv)


def advance(family: Family, spec, denoiser: BoundDenoiser, ctx: Context, state: LoopState,
            inputs: StepInputs) -> LoopState:
  """One step of a step-wise family: call the denoiser (or, with `reuse`, reuse the last
  logits when the canvas did not change), count, update. With a KV cache the call is a
  full pass or a window pass."""
  core, plan = state.core, inputs.plan
  step = StepInfo(index=inputs.index, keys_B=threefry.fold_in(ctx.keys_B, inputs.index),
                  plan=plan, shift_B=ctx.shift_B)
  if state.kv is None:
    condition = family.condition(spec, state.aux)
    call = lambda: (denoiser(core.tokens_BxL, plan.t, condition=condition), None)
    keep = lambda logits: (logits, None)
  else:
    width = family.block_length(spec)
    call = lambda: kv_cache.call(denoiser, state.kv, core.tokens_BxL, plan.t, inputs.kv_plan,
                                 width)
    keep = lambda logits: (logits, kv_cache.skipped(state.kv, inputs.kv_plan))
  end = EndOfRow.of(spec)
  full_ctx, ctx = ctx, end.open(ctx, core.tokens_BxL)  # finished rows freeze
  active_B = family.active_rows(spec, core, state.aux, ctx)
  reuse = state.reuse
  if reuse is not None:
    called = jnp.any(core.tokens_BxL != reuse.tokens_BxL)
    logits, kv = jax.lax.cond(called, call, lambda: keep(reuse.logits_BxLxV))
    reuse = _Reuse(tokens_BxL=core.tokens_BxL, logits_BxLxV=logits)
  else:
    called = jnp.array(True)
    logits, kv = call()
  core = core.count_call(called).count(saved_calls=~called, rounds_B=called & active_B)
  core, aux = family.update(spec, core, state.aux, ctx, step, logits,
                            StepDenoiser(denoiser, plan.t))
  return LoopState(core=end.finish(core, full_ctx, inputs.index), aux=aux, reuse=reuse, kv=kv)


def needs_call(family: Family, spec, ctx: Context, state: LoopState, plan) -> Array:
  """Whether a step can write anything in any row; the loop jumps over steps that cannot
  (their update would leave everything as it is)."""
  core, end = state.core, EndOfRow.of(spec)
  open_ctx = end.open(ctx, core.tokens_BxL)
  always = family.rewrites and not family.stops_early
  need = jnp.array(True) if always else family.needs_call(spec, core, state.aux, open_ctx, plan)
  return need & end.any_open(core.tokens_BxL, ctx)


def skip_steps(kv_plan, state: LoopState, lo: Array, hi: Array) -> LoopState:
  """The bookkeeping of the idle steps lo..hi-1 jumped over: counted as saved calls; a
  cache refresh planned at one of them is owed to the next call (`kv_cache.skip_steps`)."""
  return state.replace(core=state.core.count(saved_calls=hi - lo),
                       kv=kv_cache.skip_steps(state.kv, kv_plan, lo, hi))


def run(spec, denoiser: BoundDenoiser, core: Core, ctx: Context, plan, skip: bool | None = None,
        kv_plan: kv_cache.KVPlan | None = None):
  """Runs a family from `core` in the current trace: (core, aux, trajectory or None).

  skip: whether the loop jumps over idle steps (`skips_idle_steps`): a while loop from
  one step that needs the denoiser to the next, instead of a scan over every step. None: a
  run inside a composite family, decided without a canvas.
  """
  family = family_of(spec)
  if skip is None:
    skip = skips_idle_steps(family, spec)
  if family.composite:
    core, aux, trajectory = family.run(spec, denoiser, core, ctx, plan)
    # The composite's own rounds freeze finished rows; this fills them.
    last = jnp.int32(family.num_steps(spec, core.tokens_BxL.shape[1]) - 1)
    return EndOfRow.of(spec).finish(core, ctx, last), aux, trajectory
  state = init_loop(family, spec, denoiser, core, ctx, cached=kv_plan is not None)
  num_steps = family.num_steps(spec, core.tokens_BxL.shape[1])
  record = (lambda state: state.core.tokens_BxL) if spec.record_trajectory else None
  step = lambda state, inputs: advance(family, spec, denoiser, ctx, state, inputs)
  if skip:
    step_at = lambda state, i: step(state, StepInputs(index=i, plan=plan_at(plan, i),
                                                      kv_plan=plan_at(kv_plan, i)))
    needs = lambda state, i: needs_call(family, spec, ctx, state, plan_at(plan, i))
    state, trajectory = skipping.loop(step_at, needs, num_steps, state,
                                      skip_range=functools.partial(skip_steps, kv_plan),
                                      record=record)
    return state.core, state.aux, trajectory

  def body(state, inputs):
    state = step(state, inputs)
    return state, (None if record is None else record(state))

  inputs_K = StepInputs(index=jnp.arange(num_steps, dtype=jnp.int32), plan=plan, kv_plan=kv_plan)
  state, trajectory = jax.lax.scan(body, state, inputs_K)
  return state.core, state.aux, trajectory


def invalid_input(tokens_BxL: Array, ctx: Context) -> Array:
  """Positions per row with a token id outside [0, V) that is not the mask id, or a fixed
  position on the mask."""
  out_of_range_BxL = (tokens_BxL < 0) | ((tokens_BxL >= ctx.vocab)
                                         & (tokens_BxL != ctx.mask_id))
  fixed_mask_BxL = ~ctx.editable_BxL & (tokens_BxL == ctx.mask_id)
  return (out_of_range_BxL | fixed_mask_BxL).sum(-1)


def result(family: Family, spec, core: Core, aux, trajectory, ctx: Context,
           invalid_B: Array) -> SampleResult:
  """The run's `SampleResult`, from its final core and carry."""
  generated_length_B = EndOfRow.of(spec).generated_length(core.tokens_BxL, ctx.editable_BxL,
                                                          ctx.mask_id)
  return SampleResult(tokens_BxL=core.tokens_BxL, write_step_BxL=core.write_step_BxL,
                      counters=core.counters, invalid_B=invalid_B,
                      unfilled_B=ctx.masked(core.tokens_BxL).sum(-1),
                      generated_length_B=generated_length_B, trajectory_KxBxL=trajectory,
                      extras=family.extras(spec, aux))


# ----------------------------------------------------------------------------
# The door: a Stepper and its Carry.
# ----------------------------------------------------------------------------


@struct.dataclass
class Carry:
  """What one step hands the next: the loop state (canvas, counters, the family's carry,
  the KV cache) and the call's constants. A pytree: jit, vmap and scan it."""

  state: LoopState
  ctx: Context
  invalid_B: Array  # positions of each row whose input was invalid (`SampleResult`)

  @property
  def tokens_BxL(self) -> Array:
    return self.state.core.tokens_BxL


@dataclasses.dataclass(frozen=True)
class Stepper:
  """A step-wise family's spec on a canvas of given ids: start, step, done, result.

  Hashable (a static argument of jit). Its methods run in any trace, or eagerly: the
  denoiser is a `BoundDenoiser` (`bind`), the plan the family's per-step plan from
  `sampling.prepare(...).plan` (leading axis K = `num_steps`)."""

  spec: SamplerSpec
  mask_id: int
  vocab_size: int | None = None  # V, the logits per position (None: V = mask_id)
  cached: bool = False  # the spec decodes against a KV cache (it needs `kv_plan` per step)

  @property
  def family(self) -> Family:
    return family_of(self.spec)

  def num_steps(self, length: int) -> int:
    """K, the steps on a length-L canvas."""
    return self.family.num_steps(self.spec, length)

  def bind(self, denoiser, params, valid_BxL=None, context=None) -> BoundDenoiser:
    """`denoiser` (a `Denoiser`) bound to `params` (and the padding, a block's context)."""
    return BoundDenoiser(denoiser, params, valid_BxL, context=context,
                         mask_in_vocab=mask_inside(self.mask_id, self.vocab_size))

  def start(self, denoiser: BoundDenoiser, key, tokens_BxL, fixed_BxL=None,
            valid_BxL=None) -> Carry:
    """The carry at step 0. key: one PRNG key or B row keys; fixed_BxL: positions never
    written (default: every position not on the mask id); valid_BxL: False on padding."""
    if self.family.composite:
      raise ValueError(f"spec={type(self.spec).__name__}: its rounds run only as one "
                       "program; use sample.")
    core, ctx = start_canvas(key, tokens_BxL, fixed_BxL, self.mask_id, valid_BxL,
                             self.vocab_size)
    state = init_loop(self.family, self.spec, denoiser, core, ctx, self.cached)
    return Carry(state=state, ctx=ctx, invalid_B=invalid_input(core.tokens_BxL, ctx))

  def step(self, denoiser: BoundDenoiser, carry: Carry, index, plan_K,
           kv_plan_K=None) -> Carry:
    """Step `index` (an int or a traced int32): one denoiser call and the family's update."""
    inputs = StepInputs(index=jnp.asarray(index, jnp.int32), plan=plan_at(plan_K, index),
                        kv_plan=plan_at(kv_plan_K, index))
    state = advance(self.family, self.spec, denoiser, carry.ctx, carry.state, inputs)
    return carry.replace(state=state)

  def needs_full(self, carry: Carry, index, kv_plan_K) -> Array:
    """A cached spec: whether step `index` makes more than a window pass (a cache refresh,
    an append, or a refresh owed by a skipped step); a caller that knows none of its rows
    does may run the step with `kv_plan_K.replace(window_only=True)`, one pass; one that
    knows all of them do, on the dual cache, with `full_only=True`."""
    return kv_cache.needs_full(carry.state.kv, plan_at(kv_plan_K, index))

  def needs_call(self, carry: Carry, index, plan_K) -> Array:
    """Whether step `index` can write anything in any row (else a loop may jump over it)."""
    return needs_call(self.family, self.spec, carry.ctx, carry.state, plan_at(plan_K, index))

  @property
  def skips_idle(self) -> bool:
    """Whether a loop may jump over the steps that need no call (`jump`): the family's steps
    can be idle and the spec does not forbid it (`skips_idle_steps` without a canvas)."""
    return skips_idle_steps(self.family, self.spec)

  def jump(self, carry: Carry, start, plan_K, kv_plan_K=None) -> tuple[Array, Carry]:
    """(the first step >= `start` that needs a call, K if none does; the carry after the
    jump over the idle steps before it: counted as saved calls, a cache refresh planned at
    one of them owed to the next call): what `sample`'s loop does between two calls."""
    num_steps = self.num_steps(carry.tokens_BxL.shape[1])
    following = skipping.next_needed(lambda c, i: self.needs_call(c, i, plan_K), num_steps,
                                     carry, start)
    return following, carry.replace(state=skip_steps(kv_plan_K, carry.state, start, following))

  def done(self, carry: Carry, index) -> Array:
    """Per row: finished before step `index` (the steps are spent, or, for a family that
    never rewrites, the row has nothing left to write, or a family whose rows stop early
    stopped it, or it has ended at EOS)."""
    tokens_BxL, ctx, family = carry.tokens_BxL, carry.ctx, self.family
    num_steps = self.num_steps(tokens_BxL.shape[1])
    open_B = EndOfRow.of(self.spec).open_rows(tokens_BxL, ctx)
    if not family.rewrites or family.stops_early:
      open_B &= family.active_rows(self.spec, carry.state.core, carry.state.aux, ctx)
    return (index >= num_steps) | ~open_B

  def result(self, carry: Carry, trajectory_KxBxL=None) -> SampleResult:
    """The run's `SampleResult`, as `sample` returns it."""
    return result(self.family, self.spec, carry.state.core, carry.state.aux, trajectory_KxBxL,
                  carry.ctx, carry.invalid_B)
