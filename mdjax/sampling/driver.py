"""`sample`: any registered family, the whole reverse trajectory in one compiled loop.

The driver knows families only through the protocol in `sampling.base`: `prepare` checks
the call on the host, once, and asks the family for its plan (a `Prepared` record); the
program then runs the family's steps (`sampling.stepping`) or, for a composite family, its
own program. It owns which steps call the denoiser: every one (a scan), or only those the
family says can write something (a while loop that jumps over idle steps,
`sampling.skipping`); with `cache=True` a call is also skipped when the canvas did not
change.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mdjax import streams
from mdjax.denoiser import Denoiser
from mdjax.sampling import kv_cache
from mdjax.sampling.base import BoundDenoiser, Canvas, SamplerSpec, family_of
from mdjax.sampling.end_of_row import EndOfRow
from mdjax.sampling.stepping import (Carry, SampleResult, Stepper, StepInputs, advance,
                                     check_key_rows, invalid_input, plan_at, result, run,
                                     skips_idle_steps, start_canvas)

Array = jax.Array


def num_steps(spec: SamplerSpec, length: int) -> int:
  """The static number of steps (rounds) a spec takes on a length-L canvas."""
  return family_of(spec).num_steps(spec, length)


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
  # (shape, dtype) pairs key the cache: a jax array's dtype is already canonical, read
  # without jnp's type promotion (~20 us a leaf); anything else (numpy, a scalar) goes through it.
  signature = (denoiser, treedef, batch, length) + tuple(
      (np.shape(x), x.dtype if isinstance(x, jax.Array) else jnp.result_type(x))
      for x in leaves)
  shape = _LOGITS_SHAPES.get(signature)
  if shape is None:
    avals = tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in signature[4:])
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


@dataclasses.dataclass(frozen=True)
class Prepared:
  """A `sample` call checked on the host, by name: what its program (or a caller stepping
  it by hand, `Stepper`) needs.

  denoiser: the call's `Denoiser` (static). stepper: the spec and the ids (static).
  params, key, tokens_BxL, fixed_BxL, valid_BxL: the arguments as given (traced).
  plan: the family's per-step plan (leading axis K = num_steps). kv_plan: the KV cache's
  per-step plan (a spec with kv_cache), else None. skip: whether the whole-run program
  jumps over idle steps (`stepping.skips_idle_steps`).
  """

  denoiser: Denoiser
  stepper: Stepper
  params: Any
  key: Array
  tokens_BxL: Any
  fixed_BxL: Any
  valid_BxL: Any
  plan: Any
  kv_plan: Any
  skip: bool

  @property
  def spec(self) -> SamplerSpec:
    return self.stepper.spec

  @property
  def num_steps(self) -> int:
    return self.stepper.num_steps(np.shape(self.tokens_BxL)[1])

  def bind(self) -> BoundDenoiser:
    """The denoiser bound to the call's parameters and padding."""
    return self.stepper.bind(self.denoiser, self.params, self.valid_BxL)

  def start(self) -> Carry:
    """The carry at step 0 (`Stepper.start` on the call's arguments)."""
    return self.stepper.start(self.bind(), self.key, self.tokens_BxL, self.fixed_BxL,
                              self.valid_BxL)

  def program_args(self) -> tuple:
    """The traced arguments of the `sample` program, in its order."""
    args = (self.params, self.key, self.tokens_BxL, self.fixed_BxL, self.plan, self.kv_plan)
    return args if self.valid_BxL is None else args + (self.valid_BxL,)


def prepare(apply_fn, params: Any, key: Array, tokens_BxL, spec: SamplerSpec, fixed_BxL=None,
            *, mask_id: int | None = None, valid_BxL=None) -> Prepared:
  """Checks a `sample` call on the host and lays out its plan; the arguments are `sample`'s.

  Shapes, the spec and the denoiser's output shape are checked without touching values
  (the output shape once per signature); the token values are read on the host once.
  Raises ValueError naming the argument before anything is compiled.
  """
  denoiser = Denoiser.of(apply_fn)
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
  check_key_rows(key, batch)
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
  if valid_BxL is not None:
    valid_BxL = _check_valid(denoiser, params, valid_BxL, canvas)
    kv_cache.check_exact_valid(denoiser, spec, canvas, valid_BxL)
  stepper = Stepper(spec=spec, mask_id=mask_id, vocab_size=vocab_size,
                    cached=kv_plan is not None)
  return Prepared(denoiser=denoiser, stepper=stepper, params=params, key=key,
                  tokens_BxL=tokens_BxL, fixed_BxL=fixed_BxL, valid_BxL=valid_BxL, plan=plan,
                  kv_plan=kv_plan, skip=skips_idle_steps(family, spec, canvas, plan))


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


# ----------------------------------------------------------------------------
# The program, and the entry points.
# ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("denoiser", "stepper", "skip"))
def _program(denoiser, params, key, tokens_BxL, fixed_BxL, plan, kv_plan, valid_BxL=None, *,
             stepper: Stepper, skip: bool) -> SampleResult:
  core, ctx = start_canvas(key, tokens_BxL, fixed_BxL, stepper.mask_id, valid_BxL,
                           stepper.vocab_size)
  bound = stepper.bind(denoiser, params, valid_BxL)
  invalid_B = invalid_input(core.tokens_BxL, ctx)
  core, aux, trajectory = run(stepper.spec, bound, core, ctx, plan, skip, kv_plan)
  return result(stepper.family, stepper.spec, core, aux, trajectory, ctx, invalid_B)


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
  prepared = prepare(apply_fn, params, key, tokens_BxL, spec, fixed_BxL, mask_id=mask_id,
                     valid_BxL=valid_BxL)
  return _program(prepared.denoiser, *prepared.program_args(), stepper=prepared.stepper,
                  skip=prepared.skip)


def lower(apply_fn, params: Any, key: Array, tokens_BxL: Array, spec: SamplerSpec,
          fixed_BxL: Array | None = None, *, mask_id: int | None = None,
          valid_BxL: Array | None = None):
  """The `sample` program, lowered, and the arguments to call it with.

  Returns (lowered, args): `lowered.compile()(*args)` runs the same program
  as `sample(...)`; `.memory_analysis()` and `.cost_analysis()` of the
  compiled program measure it, `.as_text()` shows it.
  """
  prepared = prepare(apply_fn, params, key, tokens_BxL, spec, fixed_BxL, mask_id=mask_id,
                     valid_BxL=valid_BxL)
  args = prepared.program_args()
  return _program.lower(prepared.denoiser, *args, stepper=prepared.stepper,
                        skip=prepared.skip), args


@functools.partial(jax.jit, static_argnames=("denoiser", "stepper"))
def _start_jit(denoiser, params, key, tokens_BxL, fixed_BxL, *, stepper: Stepper) -> Carry:
  return stepper.start(stepper.bind(denoiser, params), key, tokens_BxL, fixed_BxL)


@functools.partial(jax.jit, static_argnames=("denoiser", "stepper"), donate_argnames=("carry",))
def _step_jit(denoiser, params, carry: Carry, inputs: StepInputs, *, stepper: Stepper) -> Carry:
  # The step's plan is sliced on the host: one small transfer a step, as a PyTorch loop.
  state = advance(stepper.family, stepper.spec, stepper.bind(denoiser, params), carry.ctx,
                  carry.state, inputs)
  return carry.replace(state=state)


@functools.partial(jax.jit, static_argnames=("stepper",))
def _jump_jit(carry: Carry, plan, kv_plan, start, *, stepper: Stepper):
  """The first step from `start` that needs a call, and the carry after the jump to it."""
  return stepper.jump(carry, start, plan, kv_plan)


def sample_python_loop(apply_fn, params: Any, key: Array, tokens_BxL: Array, spec: SamplerSpec,
                       fixed_BxL: Array | None = None, *,
                       mask_id: int | None = None) -> SampleResult:
  """`sample` as a Python loop calling one jitted step per step.

  The same kernel as `sample`, dispatched step by step from the host, the way
  the PyTorch reference samplers (LLaDA, MDLM, ReMDM) run; where `sample` jumps over idle
  steps, the host reads the next step that needs a call. It exists for the benchmark's
  side-by-side comparison. Gives the same tokens as `sample`.
  """
  prepared = prepare(apply_fn, params, key, tokens_BxL, spec, fixed_BxL, mask_id=mask_id)
  stepper, plan, kv_plan = prepared.stepper, prepared.plan, prepared.kv_plan
  if not stepper.family.python_loop:
    raise ValueError(f"spec={type(spec).__name__}: its rounds run only as one program; "
                     "use sample.")
  if spec.record_trajectory:
    raise ValueError("record_trajectory=True: use sample; the Python loop keeps no record.")
  carry = _start_jit(prepared.denoiser, params, key, prepared.tokens_BxL, prepared.fixed_BxL,
                     stepper=stepper)
  num_steps, i = prepared.num_steps, 0
  while True:
    if prepared.skip:
      following, carry = _jump_jit(carry, plan, kv_plan, np.int32(i), stepper=stepper)
      i = int(following)
    if i >= num_steps:
      break
    inputs = StepInputs(index=np.int32(i), plan=plan_at(plan, i), kv_plan=plan_at(kv_plan, i))
    carry = _step_jit(prepared.denoiser, params, carry, inputs, stepper=stepper)
    i += 1
  return stepper.result(carry)
