"""`sample`: any registered family, the whole reverse trajectory in one compiled loop.

The driver knows families only through the protocol in `sampling.base`: it checks the
call, asks the family for its plan, and runs the family's steps (or, for a composite
family, its own program). It owns which steps call the denoiser: every one (a scan), or
only those the family says can write something (a while loop that jumps over idle steps,
`sampling.skipping`); with `cache=True` a call is also skipped when the canvas did not
change.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax import streams
from mdjax.denoiser import Denoiser
from mdjax.sampling import kv_cache, skipping, threefry
from mdjax.sampling.base import (BoundDenoiser, Canvas, Context, CountedView, Core, Counters,
                                 Family, SamplerSpec, StepInfo, family_of)
from mdjax.sampling.end_of_row import EndOfRow

Array = jax.Array


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


def num_steps(spec: SamplerSpec, length: int) -> int:
  """The static number of steps (rounds) a spec takes on a length-L canvas."""
  return family_of(spec).num_steps(spec, length)


def _is_key_batch(key: Array) -> bool:
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key.ndim == 1
  return key.ndim == 2


def _check_key_rows(key: Array, batch: int) -> None:
  if _is_key_batch(key) and key.shape[0] != batch:
    raise ValueError(f"key holds {key.shape[0]} row keys; tokens_BxL has B={batch} rows.")


def row_keys(key: Array, batch: int) -> Array:
  """Per-row keys: a batch of keys as given, or `split(key, B)` of one key."""
  _check_key_rows(key, batch)
  return key if _is_key_batch(key) else jax.random.split(key, batch)


def _host_array(x) -> np.ndarray | None:
  """`x` on the host (one copy for a device array, none for numpy); None for a tracer."""
  if isinstance(x, np.ndarray):
    return x
  try:
    return np.asarray(x)
  except jax.errors.TracerArrayConversionError:
    return None


def _check_values(tokens: np.ndarray, fixed: np.ndarray, mask_id: int,
                  vocab_size: int | None):
  """Token ids in [0, V) or the mask id, and no fixed position on the mask. With V None
  (not known before the denoiser is traced) only what needs no V: no negative id."""
  bad_BxL = tokens < 0
  if vocab_size is not None:
    bad_BxL |= (tokens >= vocab_size) & (tokens != mask_id)
  if bad_BxL.any():
    allowed = ("must be >= 0" if vocab_size is None else
               f"must lie in [0, {vocab_size - 1}] or be the mask id {mask_id}")
    raise ValueError(f"tokens_BxL holds {tokens[bad_BxL][0]}; token ids {allowed}.")
  if (fixed & (tokens == mask_id)).any():
    row, pos = np.argwhere(fixed & (tokens == mask_id))[0]
    raise ValueError(f"fixed_BxL marks position {pos} of row {row} as fixed, but it holds "
                     f"the mask id {mask_id}; fixed positions need a token.")


def check_mask_id(mask_id, vocab_size: int | None = None) -> None:
  """mask_id is an integer in [0, V]: V (outside the vocabulary) or an id inside it."""
  if isinstance(mask_id, bool) or not isinstance(mask_id, (int, np.integer)) or mask_id < 0:
    raise ValueError(f"mask_id={mask_id!r} is invalid: it must be an integer id >= 0 (V, the "
                     "denoiser's logits per position, or an id inside the vocabulary).")
  if vocab_size is not None and mask_id > vocab_size:
    raise ValueError(f"mask_id={mask_id} is invalid: the denoiser returns V={vocab_size} "
                     f"logits per position, so the mask id must lie in [0, {vocab_size}]: "
                     f"{vocab_size} (the mask outside the vocabulary) or an id inside it "
                     "(its logit is then ruled out, -inf).")


# The denoiser's output shape per signature (denoiser, parameter shapes, B, L): tracing a
# model abstractly costs milliseconds, so `sample` does it once per signature, as jit does.
_LOGITS_SHAPES: dict[tuple, tuple[int, ...]] = {}
_MAX_CACHED_SIGNATURES = 256


def _logits_shape(denoiser: Denoiser, params, batch: int, length: int) -> tuple[int, ...]:
  leaves, treedef = jax.tree.flatten(params)
  avals = tuple(jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in leaves)
  signature = (denoiser, treedef, avals, batch, length)
  shape = _LOGITS_SHAPES.get(signature)
  if shape is None:
    tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    time_B = jax.ShapeDtypeStruct((batch,), jnp.float32)
    out = jax.eval_shape(denoiser, jax.tree.unflatten(treedef, avals), tokens, time_B)
    if not isinstance(out, jax.ShapeDtypeStruct):
      raise ValueError(f"apply_fn returns {type(out).__name__} {out}; the denoiser contract is "
                       "apply_fn(params, tokens_BxL, t_B) -> logits_BxLxV, one array.")
    shape = tuple(out.shape)
    if len(_LOGITS_SHAPES) >= _MAX_CACHED_SIGNATURES:
      _LOGITS_SHAPES.pop(next(iter(_LOGITS_SHAPES)))
    _LOGITS_SHAPES[signature] = shape
  return shape


def _prepare(denoiser: Denoiser, params, key, tokens_BxL, spec, fixed_BxL, mask_id,
             valid_BxL=None):
  """Checks the call on the host; returns (family, traced args, static args).

  Shapes, the spec and the denoiser's output shape are checked without touching values
  (the output shape once per signature); the token values are read on the host once.
  """
  family = family_of(spec)
  if not isinstance(key, jax.Array) or not (
      jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) or key.dtype == jnp.uint32):
    raise ValueError(f"key={key!r} must be a PRNG key (jax.random.key(seed)) or a batch of B "
                     "row keys.")
  if not isinstance(tokens_BxL, (np.ndarray, jax.Array)):
    tokens_BxL = np.asarray(tokens_BxL)
  if fixed_BxL is not None and not isinstance(fixed_BxL, (np.ndarray, jax.Array)):
    fixed_BxL = np.asarray(fixed_BxL)
  shape, dtype = np.shape(tokens_BxL), tokens_BxL.dtype
  if len(shape) != 2 or not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"tokens_BxL has shape {shape} and dtype {dtype}; "
                     "it must be a 2-D integer array.")
  batch, length = shape
  if batch < 1 or length < 1:
    raise ValueError(f"tokens_BxL has shape {shape}; it needs at least one row and position.")
  _check_key_rows(key, batch)
  logits_shape = None
  if mask_id is None:
    logits_shape = _logits_shape(denoiser, params, batch, length)
    mask_id = int(logits_shape[-1])
  else:
    check_mask_id(mask_id)
    mask_id = int(mask_id)
  if fixed_BxL is not None and np.shape(fixed_BxL) != shape:
    raise ValueError(f"fixed_BxL has shape {np.shape(fixed_BxL)}; tokens_BxL has {shape}.")
  tokens = _host_array(tokens_BxL)
  fixed = None if fixed_BxL is None else _host_array(fixed_BxL)
  if fixed is not None:
    fixed = fixed.astype(bool)  # known even with traced tokens: blocks can be counted
  elif fixed_BxL is not None:
    tokens = None  # a traced layout: nothing value-dependent can be checked before the run
  inferred = logits_shape is not None
  if tokens is not None:
    fixed = tokens != mask_id if fixed is None else fixed
    # With mask_id given, V is known only after the trace below: an id above the mask id
    # may be a token (a mask inside the vocabulary), so only negative ids are refused here.
    _check_values(tokens, fixed, mask_id, mask_id if inferred else None)
    if inferred and not family.rewrites and not (tokens == mask_id).any():
      raise ValueError(
          f"tokens_BxL holds no mask id {mask_id} (taken from apply_fn's {mask_id} logits per "
          "position): there is nothing to generate. If the denoiser's logits include the mask "
          "class, pass its id as mask_id=.")
  # The one check that traces the denoiser (abstractly, once per signature): V.
  logits_shape = logits_shape or _logits_shape(denoiser, params, batch, length)
  if len(logits_shape) != 3 or logits_shape[:2] != (batch, length):
    raise ValueError(f"apply_fn returns logits of shape {logits_shape}; expected (B, L, V) "
                     f"with (B, L) = {(batch, length)}.")
  vocab_size = int(logits_shape[-1])
  check_mask_id(mask_id, vocab_size)
  if tokens is not None and not inferred:
    _check_values(tokens, fixed, mask_id, vocab_size)
  EndOfRow.of(spec).check_vocabulary(vocab_size, mask_id)
  canvas = Canvas(batch=batch, length=length, mask_id=mask_id, tokens=tokens, fixed=fixed,
                  vocab_size=vocab_size)
  streams.check_steps(family.num_steps(spec, length))
  family.validate(spec, canvas)
  plan = family.plan(spec, canvas)
  kv_plan = kv_cache.plan(denoiser, family, spec, canvas)
  args = (params, key, tokens_BxL, fixed_BxL, plan, kv_plan)
  if valid_BxL is not None:
    args += (_check_valid(denoiser, params, valid_BxL, canvas),)
    kv_cache.check_exact_valid(denoiser, spec, canvas, args[-1])
  skip = skips_idle_steps(family, spec, canvas, plan)
  return family, args, dict(spec=spec, mask_id=mask_id, vocab_size=vocab_size, skip=skip)


def _check_valid(denoiser: Denoiser, params, valid_BxL, canvas: Canvas):
  """The validity mask as a bool array, after checking it against the canvas and that
  apply_fn takes it (`apply_fn(params, tokens_BxL, t_B, valid_BxL=...)`)."""
  shape = (canvas.batch, canvas.length)
  if np.shape(valid_BxL) != shape:
    raise ValueError(f"valid_BxL has shape {np.shape(valid_BxL)}; tokens_BxL has {shape}.")
  valid = _host_array(valid_BxL)
  if valid is not None:
    valid = valid.astype(bool)
    if not valid.any(-1).all():
      raise ValueError(f"valid_BxL leaves row {int(np.flatnonzero(~valid.any(-1))[0])} "
                       "without a valid position.")
    if canvas.fixed is not None and (~valid & ~canvas.fixed).any():
      row, pos = np.argwhere(~valid & ~canvas.fixed)[0]
      raise ValueError(f"valid_BxL marks position {pos} of row {row} as padding, but it is "
                       "editable; padding must be fixed (hold any id but the mask id).")
  try:
    jax.eval_shape(lambda p, x, t, v: denoiser(p, x, t, valid_BxL=v), params,
                   jax.ShapeDtypeStruct(shape, jnp.int32),
                   jax.ShapeDtypeStruct(shape[:1], jnp.float32),
                   jax.ShapeDtypeStruct(shape, jnp.bool_))
  except TypeError as error:
    raise ValueError(f"valid_BxL is given but apply_fn does not take it ({error}); the "
                     "denoiser contract with padding is apply_fn(params, tokens_BxL, t_B, "
                     "valid_BxL=...).") from None
  return jnp.asarray(valid_BxL, bool) if valid is None else valid


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
  if family.rewrites:
    return False
  if spec.skip_idle_steps or canvas is None:
    return True
  idle = family.idle_steps(spec, canvas, plan)
  return idle is None or idle >= IDLE_FRACTION_TO_SKIP * family.num_steps(spec, canvas.length)


# ----------------------------------------------------------------------------
# The program.
# ----------------------------------------------------------------------------


@struct.dataclass
class _Reuse:
  """The last call's canvas and logits (families whose denoiser ignores t)."""

  tokens_BxL: Array
  logits_BxLxV: Array


def _start(key, tokens_BxL, fixed_BxL, mask_id, valid_BxL=None,
           vocab_size: int | None = None) -> tuple[Core, Context]:
  """The shared carry and the call's constants, from the arguments as `sample` got them.
  With a validity mask, draws are indexed from each row's first valid position."""
  tokens_BxL = tokens_BxL.astype(jnp.int32)
  fixed_BxL = tokens_BxL != mask_id if fixed_BxL is None else fixed_BxL.astype(bool)
  keys_B = row_keys(key, tokens_BxL.shape[0])
  shift_B = None if valid_BxL is None else jnp.argmax(valid_BxL, -1).astype(jnp.int32)
  return Core.start(tokens_BxL), Context(mask_id=mask_id, editable_BxL=~fixed_BxL, keys_B=keys_B,
                                         shift_B=shift_B, vocab_size=vocab_size)


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


def _step(family: Family, spec, denoiser: BoundDenoiser, ctx: Context, state: LoopState,
          inputs: StepInputs) -> LoopState:
  """One step of a step-wise family: call the denoiser (or, with `reuse`, reuse the last
  logits when the canvas did not change), count, update. With a KV cache the call is a
  full pass or a window pass."""
  core, plan = state.core, inputs.plan
  step = StepInfo(index=inputs.index, keys_B=threefry.fold_in(ctx.keys_B, inputs.index),
                  plan=plan, shift_B=ctx.shift_B)
  if state.kv is None:
    call = lambda: (denoiser(core.tokens_BxL, plan.t), None)
    keep = lambda logits: (logits, None)
  else:
    width = family.block_length(spec)
    call = lambda: kv_cache.call(denoiser, state.kv, core.tokens_BxL, plan.t, inputs.kv_plan,
                                 width)
    keep = lambda logits: (logits, kv_cache.skipped(state.kv, inputs.kv_plan))
  end = EndOfRow.of(spec)
  full_ctx, ctx = ctx, end.open(ctx, core.tokens_BxL)  # finished rows freeze
  active_B = ctx.masked(core.tokens_BxL).any(-1)
  reuse = state.reuse
  if reuse is not None:
    called = jnp.any(core.tokens_BxL != reuse.tokens_BxL)
    logits, kv = jax.lax.cond(called, call, lambda: keep(reuse.logits_BxLxV))
    reuse = _Reuse(tokens_BxL=core.tokens_BxL, logits_BxLxV=logits)
  else:
    called = jnp.array(True)
    logits, kv = call()
  core = core.count_call(called).count(saved_calls=~called, rounds_B=called & active_B)
  denoise = lambda tokens_NxL: denoiser(tokens_NxL, plan.t)
  core, aux = family.update(spec, core, state.aux, ctx, step, logits, denoise)
  return LoopState(core=end.finish(core, full_ctx, inputs.index), aux=aux, reuse=reuse, kv=kv)


def _needs_call(family: Family, spec, ctx: Context, state: LoopState, plan) -> Array:
  """Whether a step can write anything in any row; the loop jumps over steps that cannot
  (their update would leave everything as it is)."""
  core, end = state.core, EndOfRow.of(spec)
  open_ctx = end.open(ctx, core.tokens_BxL)
  need = jnp.array(True) if family.rewrites else family.needs_call(spec, core, state.aux,
                                                                    open_ctx, plan)
  return need & end.any_open(core.tokens_BxL, ctx)


def _skip_steps(kv_plan, state: LoopState, lo: Array, hi: Array) -> LoopState:
  """The bookkeeping of the idle steps lo..hi-1 jumped over: counted as saved calls; a
  cache refresh planned at one of them is owed to the next call (`kv_cache.skip_steps`)."""
  return state.replace(core=state.core.count(saved_calls=hi - lo),
                       kv=kv_cache.skip_steps(state.kv, kv_plan, lo, hi))


def _init(family: Family, spec, denoiser: BoundDenoiser, core: Core, ctx: Context,
          cached: bool) -> LoopState:
  """The loop's state at step 0: the family's carry beside the core, the reuse slot when it
  reuses logits, the KV cache when `cached`."""
  reuse = None
  if family.reuses_logits(spec):
    out = jax.eval_shape(denoiser, core.tokens_BxL, 1.0)
    reuse = _Reuse(tokens_BxL=jnp.full_like(core.tokens_BxL, -1),
                   logits_BxLxV=jnp.zeros(out.shape, out.dtype))
  kv = kv_cache.init(denoiser, core.tokens_BxL) if cached else None
  return LoopState(core=core, aux=family.init(spec, core, ctx), reuse=reuse, kv=kv)


def _at(plans, i):
  """Step i of per-step plans (leading axis K)."""
  return jax.tree.map(lambda x: x[i], plans)


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
  state = _init(family, spec, denoiser, core, ctx, cached=kv_plan is not None)
  num_steps = family.num_steps(spec, core.tokens_BxL.shape[1])
  record = (lambda state: state.core.tokens_BxL) if spec.record_trajectory else None
  step = lambda state, inputs: _step(family, spec, denoiser, ctx, state, inputs)
  if skip:
    step_at = lambda state, i: step(state, StepInputs(index=i, plan=_at(plan, i),
                                                      kv_plan=_at(kv_plan, i)))
    needs = lambda state, i: _needs_call(family, spec, ctx, state, _at(plan, i))
    state, trajectory = skipping.loop(step_at, needs, num_steps, state,
                                      skip_range=functools.partial(_skip_steps, kv_plan),
                                      record=record)
    return state.core, state.aux, trajectory

  def body(state, inputs):
    state = step(state, inputs)
    return state, (None if record is None else record(state))

  inputs_K = StepInputs(index=jnp.arange(num_steps, dtype=jnp.int32), plan=plan, kv_plan=kv_plan)
  state, trajectory = jax.lax.scan(body, state, inputs_K)
  return state.core, state.aux, trajectory


def _invalid_input(tokens_BxL: Array, ctx: Context) -> Array:
  """Positions per row with a token id outside [0, V) that is not the mask id, or a fixed
  position on the mask."""
  out_of_range_BxL = (tokens_BxL < 0) | ((tokens_BxL >= ctx.vocab)
                                         & (tokens_BxL != ctx.mask_id))
  fixed_mask_BxL = ~ctx.editable_BxL & (tokens_BxL == ctx.mask_id)
  return (out_of_range_BxL | fixed_mask_BxL).sum(-1)


def _result(family: Family, spec, core: Core, aux, trajectory, ctx: Context,
            invalid_B: Array) -> SampleResult:
  generated_length_B = EndOfRow.of(spec).generated_length(core.tokens_BxL, ctx.editable_BxL,
                                                          ctx.mask_id)
  return SampleResult(tokens_BxL=core.tokens_BxL, write_step_BxL=core.write_step_BxL,
                      counters=core.counters, invalid_B=invalid_B,
                      unfilled_B=ctx.masked(core.tokens_BxL).sum(-1),
                      generated_length_B=generated_length_B, trajectory_KxBxL=trajectory,
                      extras=family.extras(spec, aux))


@functools.partial(jax.jit, static_argnames=("denoiser", "spec", "mask_id", "vocab_size", "skip"))
def _program(denoiser, params, key, tokens_BxL, fixed_BxL, plan, kv_plan, valid_BxL=None, *,
             spec, mask_id, vocab_size, skip) -> SampleResult:
  family = family_of(spec)
  core, ctx = _start(key, tokens_BxL, fixed_BxL, mask_id, valid_BxL, vocab_size)
  bound = BoundDenoiser(denoiser, params, valid_BxL, mask_in_vocab=ctx.mask_in_vocab)
  invalid_B = _invalid_input(core.tokens_BxL, ctx)
  core, aux, trajectory = run(spec, bound, core, ctx, plan, skip, kv_plan)
  return _result(family, spec, core, aux, trajectory, ctx, invalid_B)


# ----------------------------------------------------------------------------
# Entry points.
# ----------------------------------------------------------------------------


def sample(apply_fn, params: Any, key: Array, tokens_BxL: Array, spec: SamplerSpec,
           fixed_BxL: Array | None = None, *, mask_id: int | None = None,
           valid_BxL: Array | None = None) -> SampleResult:
  """Samples with any family; the whole trajectory is one compiled program.

  Args:
    apply_fn: the denoiser, `apply_fn(params, tokens_BxL, t_B) -> logits_BxLxV`: a function
      or a `mdjax.denoiser.Denoiser` (which also says what else it offers: a KV cache).
    params: its parameters (traced, never baked into the program).
    key: one PRNG key (split into B row keys), or a batch of B row keys.
    tokens_BxL: the starting canvas: the mask id where generation happens.
    spec: the sampler and its knobs (a frozen spec from `mdjax.sampling`).
    fixed_BxL: positions that never change; default: every visible position.
    mask_id: the mask id: V (the denoiser's logits per position; the default when None), or
      an id inside the vocabulary (a published checkpoint's own: its logit is then set to
      -inf wherever the sampler reads logits, so it is never drawn). Token ids are 0..V-1
      and the mask id.
    valid_BxL: False on padding (left-padded prompts of different lengths); passed to
      apply_fn as `valid_BxL=` only when given. Padding must be fixed.
  """
  denoiser = Denoiser.of(apply_fn)
  _, args, static = _prepare(denoiser, params, key, tokens_BxL, spec, fixed_BxL, mask_id,
                             valid_BxL)
  return _program(denoiser, *args, **static)


def lower(apply_fn, params: Any, key: Array, tokens_BxL: Array, spec: SamplerSpec,
          fixed_BxL: Array | None = None, *, mask_id: int | None = None,
          valid_BxL: Array | None = None):
  """The `sample` program, lowered, and the arguments to call it with.

  Returns (lowered, args): `lowered.compile()(*args)` runs the same program
  as `sample(...)`; `.memory_analysis()` and `.cost_analysis()` of the
  compiled program measure it, `.as_text()` shows it.
  """
  denoiser = Denoiser.of(apply_fn)
  _, args, static = _prepare(denoiser, params, key, tokens_BxL, spec, fixed_BxL, mask_id,
                             valid_BxL)
  return _program.lower(denoiser, *args, **static), args


_STEP_STATIC = ("family", "spec", "denoiser")


@functools.partial(jax.jit, static_argnames=_STEP_STATIC + ("mask_id", "vocab_size", "cached"))
def _start_jit(denoiser, params, key, tokens_BxL, fixed_BxL, *, family, spec, mask_id,
               vocab_size, cached) -> tuple[Context, LoopState]:
  core, ctx = _start(key, tokens_BxL, fixed_BxL, mask_id, vocab_size=vocab_size)
  bound = BoundDenoiser(denoiser, params, mask_in_vocab=ctx.mask_in_vocab)
  return ctx, _init(family, spec, bound, core, ctx, cached)


@functools.partial(jax.jit, static_argnames=_STEP_STATIC, donate_argnames=("state",))
def _step_jit(denoiser, params, ctx, state, inputs, *, family, spec) -> LoopState:
  bound = BoundDenoiser(denoiser, params, mask_in_vocab=ctx.mask_in_vocab)
  return _step(family, spec, bound, ctx, state, inputs)


@functools.partial(jax.jit, static_argnames=("family", "spec"))
def _jump_jit(ctx, state, plan, kv_plan, start, *, family, spec):
  """The first step from `start` that needs a call, and the state after the jump to it."""
  needs = lambda state, i: _needs_call(family, spec, ctx, state, _at(plan, i))
  following = skipping.next_needed(needs, plan.t.shape[0], state, start)
  return following, _skip_steps(kv_plan, state, start, following)


def sample_python_loop(apply_fn, params: Any, key: Array, tokens_BxL: Array, spec: SamplerSpec,
                       fixed_BxL: Array | None = None, *,
                       mask_id: int | None = None) -> SampleResult:
  """`sample` as a Python loop calling one jitted step per step.

  The same kernel as `sample`, dispatched step by step from the host, the way
  the PyTorch reference samplers (LLaDA, MDLM, ReMDM) run; where `sample` jumps over idle
  steps, the host reads the next step that needs a call. It exists for the benchmark's
  side-by-side comparison. Gives the same tokens as `sample`.
  """
  denoiser = Denoiser.of(apply_fn)
  family, args, static = _prepare(denoiser, params, key, tokens_BxL, spec, fixed_BxL, mask_id)
  if not family.python_loop:
    raise ValueError(f"spec={type(spec).__name__}: its rounds run only as one program; "
                     "use sample.")
  if spec.record_trajectory:
    raise ValueError("record_trajectory=True: use sample; the Python loop keeps no record.")
  params, key, tokens_BxL, fixed_BxL, plan, kv_plan = args
  ctx, state = _start_jit(denoiser, params, key, tokens_BxL, fixed_BxL, family=family,
                          spec=spec, mask_id=static["mask_id"],
                          vocab_size=static["vocab_size"], cached=kv_plan is not None)
  invalid_B = _invalid_input(state.core.tokens_BxL, ctx)
  num_steps, i = family.num_steps(spec, np.shape(tokens_BxL)[1]), 0
  while True:
    if static["skip"]:
      following, state = _jump_jit(ctx, state, plan, kv_plan, np.int32(i), family=family,
                                   spec=spec)
      i = int(following)
    if i >= num_steps:
      break
    inputs = StepInputs(index=np.int32(i), plan=_at(plan, i), kv_plan=_at(kv_plan, i))
    state = _step_jit(denoiser, params, ctx, state, inputs, family=family, spec=spec)
    i += 1
  return _result(family, spec, state.core, state.aux, None, ctx, invalid_B)
