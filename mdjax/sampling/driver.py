"""`sample`: any sampler family, the whole reverse trajectory in one lax.scan."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.sampling import (ancestral, confidence, defer, local_remask, ordered, revision,
                            speculative)
from mdjax.sampling import specs as specs_lib
from mdjax.sampling.state import Context, State

Array = jax.Array

# Stream of the per-row keys used once before the loop (the random order);
# step i uses fold_in(row_key, i) with i < this.
_INIT_STREAM = 0x7FFFFFFF


@struct.dataclass
class SampleResult:
  """What `sample` returns.

  tokens_BxL: the final canvas. write_step_BxL: the step at which each position
  last received its value (-1 for positions never written). nfe: denoiser
  evaluations made; saved_calls: steps whose evaluation was skipped.
  reopened_B: committed tokens returned to the mask (remasking).
  trajectory_KxBxL: the canvas after each step, if the spec records it.
  rounds_B, evals_B (speculative family only): rounds in which the row had masked
  positions (its sequential depth) and contexts evaluated for it (k_eff per round,
  plus the start-up call).
  contexts (other families): sequences evaluated per row; a batched call of J test
  contexts (DeferSpec, leave-group-out scoring) counts J, where nfe counts it once.
  changes_KxB (RevisionSpec): visible tokens that changed value at each step.
  """

  tokens_BxL: Array
  write_step_BxL: Array
  nfe: Array
  saved_calls: Array
  reopened_B: Array
  trajectory_KxBxL: Array | None = None
  rounds_B: Array | None = None
  evals_B: Array | None = None
  contexts: Array | None = None
  changes_KxB: Array | None = None


def num_steps(spec: specs_lib.SamplerSpec, length: int) -> int:
  """The static number of scan steps a spec takes on a length-L canvas."""
  if isinstance(spec, (specs_lib.RandomOrderSpec, specs_lib.SpeculativeSpec)):
    return length
  if isinstance(spec, specs_lib.LocalRemaskSpec):
    return num_steps(spec.base, length) + spec.rounds * num_steps(spec.refill, length)
  return spec.steps


def _is_key_batch(key: Array) -> bool:
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key.ndim == 1
  return key.ndim == 2


def row_keys(key: Array, batch: int) -> Array:
  """Per-row keys: a batch of keys as given, or `split(key, B)` of one key."""
  if _is_key_batch(key):
    if key.shape[0] != batch:
      raise ValueError(f"key holds {key.shape[0]} row keys; tokens_BxL has B={batch} rows.")
    return key
  return jax.random.split(key, batch)


def _block_ids(editable_BxL: Array, block_length: int | None) -> Array:
  if block_length is None:
    return jnp.zeros(editable_BxL.shape, jnp.int32)
  rank_BxL = jnp.cumsum(editable_BxL, axis=-1) - 1
  return jnp.where(editable_BxL, rank_BxL // block_length, -1).astype(jnp.int32)


def _host_values(*arrays) -> list[np.ndarray] | None:
  """The arrays as numpy, or None when any is a tracer (sample called in jit)."""
  try:
    return [np.asarray(a) for a in arrays]
  except jax.errors.TracerArrayConversionError:
    return None


def _num_blocks(spec, editable: np.ndarray | None, length: int) -> int:
  """Checks block_length against the generation length; returns the block count."""
  block_length = getattr(spec, "block_length", None)
  if block_length is None:
    return 1
  if editable is None:
    raise ValueError("block_length needs concrete tokens_BxL / fixed_BxL to count the "
                     "generation length; call sample outside jit.")
  if isinstance(spec, specs_lib.AncestralSpec) and not isinstance(spec.grid, str):
    raise ValueError(f"grid={spec.grid!r}: with block_length use a named grid {specs_lib.GRIDS}.")
  gen_lengths = np.unique(editable.sum(-1))
  if len(gen_lengths) != 1:
    raise ValueError(f"block_length={block_length} needs the same generation length in every "
                     f"row; rows have {gen_lengths.tolist()} editable positions.")
  gen_length = int(gen_lengths[0])
  if gen_length % block_length:
    raise ValueError(f"block_length={block_length} must divide the generation length "
                     f"{gen_length}.")
  num_blocks = gen_length // block_length
  if spec.steps % num_blocks:
    raise ValueError(f"steps={spec.steps} must be divisible by the number of blocks "
                     f"{num_blocks} (generation length {gen_length} / block_length "
                     f"{block_length}).")
  return num_blocks


def _validate_data(spec, tokens: np.ndarray, fixed: np.ndarray, mask_id: int):
  if tokens.min() < 0 or tokens.max() > mask_id:
    bad = tokens[(tokens < 0) | (tokens > mask_id)][0]
    raise ValueError(f"tokens_BxL holds {bad}; token ids must lie in [0, {mask_id}] "
                     f"({mask_id} being the mask id).")
  if (fixed & (tokens == mask_id)).any():
    row, pos = np.argwhere(fixed & (tokens == mask_id))[0]
    raise ValueError(f"fixed_BxL marks position {pos} of row {row} as fixed, but it holds "
                     f"the mask id {mask_id}; fixed positions need a token.")
  if isinstance(spec, specs_lib.SpeculativeSpec) and spec.positions is not None:
    length = tokens.shape[1]
    if max(spec.positions) >= length:
      raise ValueError(f"positions name position {max(spec.positions)}; the canvas has "
                       f"L={length}.")
    missed = np.flatnonzero((~fixed & (tokens == mask_id)).any(0)
                            & ~np.isin(np.arange(length), spec.positions))
    if missed.size:
      raise ValueError(f"positions miss masked positions {missed.tolist()}; order='fixed' "
                       "must list every generated position.")
  if isinstance(spec, (specs_lib.OrderedSpec, specs_lib.FieldOrderSpec)):
    name = "groups" if isinstance(spec, specs_lib.OrderedSpec) else "fields"
    length = tokens.shape[1]
    covered = np.zeros(length, bool)
    flat = [p for g in getattr(spec, name) for p in g]
    if max(flat) >= length:
      raise ValueError(f"{name} name position {max(flat)}; the canvas has L={length}.")
    covered[flat] = True
    missed = np.flatnonzero((~fixed & (tokens == mask_id)).any(0) & ~covered)
    if missed.size:
      raise ValueError(f"{name} miss masked positions {missed.tolist()}; every generated "
                       f"position must be in exactly one of the {name}.")


def sample(apply_fn, params: Any, key: Array, tokens_BxL: Array,
           spec: specs_lib.SamplerSpec, fixed_BxL: Array | None = None, *,
           mask_id: int | None = None) -> SampleResult:
  """Samples with any family; the whole trajectory is one compiled program.

  Args:
    apply_fn: the denoiser, `apply_fn(params, tokens_BxL, t_B) -> logits_BxLxV`.
    params: its parameters (traced, never baked into the program).
    key: one PRNG key (split into B row keys), or a batch of B row keys.
    tokens_BxL: the starting canvas: the mask id where generation happens.
    spec: the sampler and its knobs (a frozen spec from `mdjax.sampling`).
    fixed_BxL: positions that never change; default: every visible position.
    mask_id: the mask id V; inferred from the denoiser's output when None.
  """
  args, static = _checked_args(apply_fn, params, key, tokens_BxL, spec, fixed_BxL, mask_id)
  return _sample_jit(apply_fn, *args, **static)


def _checked_args(apply_fn, params, key, tokens_BxL, spec, fixed_BxL, mask_id):
  """Validates the call on the host; returns (traced args, static args)."""
  if not isinstance(spec, specs_lib.SamplerSpec):
    raise ValueError(f"spec={spec!r} must be a sampler spec from mdjax.sampling.")
  tokens_BxL = jnp.asarray(tokens_BxL)
  if tokens_BxL.ndim != 2 or not jnp.issubdtype(tokens_BxL.dtype, jnp.integer):
    raise ValueError(f"tokens_BxL has shape {tokens_BxL.shape} and dtype {tokens_BxL.dtype}; "
                     "it must be a 2-D integer array.")
  batch, length = tokens_BxL.shape
  if mask_id is None:
    out = jax.eval_shape(apply_fn, params, tokens_BxL, jnp.zeros((batch,)))
    mask_id = int(out.shape[-1])
  if fixed_BxL is None:
    fixed_BxL = tokens_BxL != mask_id
  fixed_BxL = jnp.asarray(fixed_BxL, bool)
  if fixed_BxL.shape != tokens_BxL.shape:
    raise ValueError(f"fixed_BxL has shape {fixed_BxL.shape}; tokens_BxL has "
                     f"{tokens_BxL.shape}.")
  editable = None
  # A localized-remasking spec fills the canvas with its base family first.
  first = spec.base if isinstance(spec, specs_lib.LocalRemaskSpec) else spec
  host = _host_values(tokens_BxL, fixed_BxL)
  if host is not None:
    tokens, fixed = host
    _validate_data(first, tokens, fixed, mask_id)
    editable = ~fixed
  num_blocks = _num_blocks(first, editable, length)
  keys_B = row_keys(key, batch)
  return ((params, keys_B, tokens_BxL.astype(jnp.int32), fixed_BxL),
          dict(spec=spec, mask_id=mask_id, num_blocks=num_blocks))


def _update_fn(spec):
  """The family's update: (spec, state, ctx, x, logits, keys) -> state."""
  if isinstance(spec, (specs_lib.AncestralSpec, specs_lib.RemaskSpec)):
    return ancestral.update
  if isinstance(spec, specs_lib.ConfidenceSpec):
    return confidence.update
  if isinstance(spec, specs_lib.DeferSpec):
    return defer.update
  if isinstance(spec, specs_lib.RevisionSpec):
    return revision.update
  return ordered.update


def _plan(spec, length: int, num_blocks: int) -> dict[str, np.ndarray]:
  """The family's per-step arrays (fed as scan xs)."""
  if isinstance(spec, specs_lib.AncestralSpec):
    return ancestral.plan_ancestral(spec, num_blocks)
  if isinstance(spec, specs_lib.RemaskSpec):
    return ancestral.plan_remask(spec)
  if isinstance(spec, specs_lib.ConfidenceSpec):
    return confidence.plan(spec, num_blocks)
  if isinstance(spec, specs_lib.DeferSpec):
    return defer.plan(spec)
  if isinstance(spec, specs_lib.RevisionSpec):
    return revision.plan(spec)
  return ordered.plan(spec, length)


def _prepare(apply_fn, params, keys_B, tokens_BxL, fixed_BxL, *, spec, mask_id,
             num_blocks) -> tuple[State, Context, dict[str, Array]]:
  """The initial carry, the per-call context and the per-step arrays (scan xs)."""
  batch, length = tokens_BxL.shape
  xs = _plan(spec, length, num_blocks)
  xs = {name: jnp.asarray(value) for name, value in xs.items()}
  xs["step"] = jnp.arange(num_steps(spec, length), dtype=jnp.int32)
  editable_BxL = ~fixed_BxL
  init_keys_B = jax.vmap(jax.random.fold_in, (0, None))(keys_B, _INIT_STREAM)
  order_rank_BxL = (ordered.random_order_rank(init_keys_B, editable_BxL)
                    if isinstance(spec, specs_lib.RandomOrderSpec)
                    else jnp.zeros((batch, length), jnp.int32))
  block_length = getattr(spec, "block_length", None)
  ctx = Context(mask_id=mask_id, editable_BxL=editable_BxL,
                block_id_BxL=_block_ids(editable_BxL, block_length),
                order_rank_BxL=order_rank_BxL)
  zero = jnp.zeros((), jnp.int32)
  state = State(
      tokens_BxL=tokens_BxL,
      write_step_BxL=jnp.full((batch, length), -1, jnp.int32),
      write_conf_BxL=jnp.ones((batch, length), jnp.float32),
      reopened_B=jnp.zeros((batch,), jnp.int32),
      block_count_B=jnp.zeros((batch,), jnp.int32),
      nfe=zero, saved_calls=zero, contexts=zero,
      changes_KxB=(jnp.zeros((spec.steps, batch), jnp.int32)
                   if isinstance(spec, specs_lib.RevisionSpec) else None),
  )
  out = jax.eval_shape(apply_fn, params, tokens_BxL, jnp.zeros((batch,)))
  if out.shape != (batch, length, mask_id):
    raise ValueError(f"apply_fn returns logits of shape {out.shape}; expected "
                     f"(B, L, V) = {(batch, length, mask_id)} with V = mask id.")
  if getattr(spec, "cache", False):
    state = state.replace(last_tokens_BxL=jnp.full_like(tokens_BxL, -1),
                          last_logits_BxLxV=jnp.zeros(out.shape, out.dtype))
  return state, ctx, xs


def _step(apply_fn, params, keys_B, state: State, ctx: Context, x, *, spec) -> State:
  """One reverse step of any family: the scan body."""
  batch = state.tokens_BxL.shape[0]
  step_keys_B = jax.vmap(jax.random.fold_in, (0, None))(keys_B, x["step"])
  t_B = jnp.full((batch,), x["t"], jnp.float32)
  call = lambda: apply_fn(params, state.tokens_BxL, t_B)
  out = jax.eval_shape(call)
  if getattr(spec, "cache", False):
    # MDLM's cache: the same canvas gives the same logits (t-free denoiser).
    need = jnp.any(state.tokens_BxL != state.last_tokens_BxL)
    logits = jax.lax.cond(need, call, lambda: state.last_logits_BxLxV)
    state = state.replace(last_tokens_BxL=state.tokens_BxL, last_logits_BxLxV=logits)
  elif (isinstance(spec, (specs_lib.RemaskSpec, specs_lib.RevisionSpec))
        or not spec.skip_idle_steps):
    need = jnp.array(True)
    logits = call()
  else:
    # Nothing left to write in this block: skip the denoiser.
    need = jnp.any((state.tokens_BxL == ctx.mask_id) & ctx.editable_BxL
                   & (ctx.block_id_BxL == x["block"]))
    logits = jax.lax.cond(need, call, lambda: jnp.zeros(out.shape, out.dtype))
  state = state.replace(nfe=state.nfe + need, saved_calls=state.saved_calls + (~need),
                        contexts=state.contexts + need)
  update = _update_fn(spec)
  if isinstance(spec, (specs_lib.DeferSpec, specs_lib.RevisionSpec)):
    # These families evaluate further contexts within the step (one batched call).
    update = functools.partial(update, evaluate=lambda tokens_NxL: apply_fn(
        params, tokens_NxL, jnp.full((tokens_NxL.shape[0],), x["t"], jnp.float32)))
  return update(spec, state, ctx, x, logits, step_keys_B)


def _result(state: State, trajectory=None) -> SampleResult:
  return SampleResult(tokens_BxL=state.tokens_BxL, write_step_BxL=state.write_step_BxL,
                      nfe=state.nfe, saved_calls=state.saved_calls,
                      reopened_B=state.reopened_B, trajectory_KxBxL=trajectory,
                      contexts=state.contexts, changes_KxB=state.changes_KxB)


_STATIC = ("apply_fn", "spec", "mask_id", "num_blocks")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _sample_jit(apply_fn, params, keys_B, tokens_BxL, fixed_BxL, *, spec, mask_id,
                num_blocks) -> SampleResult:
  if isinstance(spec, specs_lib.SpeculativeSpec):
    carry, trajectory = speculative.sample_program(apply_fn, params, keys_B, tokens_BxL,
                                                   fixed_BxL, spec=spec, mask_id=mask_id)
    return SampleResult(tokens_BxL=carry.tokens_BxL, write_step_BxL=carry.write_step_BxL,
                        nfe=carry.nfe, saved_calls=carry.saved_calls,
                        reopened_B=jnp.zeros(carry.rounds_B.shape, jnp.int32),
                        trajectory_KxBxL=trajectory, rounds_B=carry.rounds_B,
                        evals_B=carry.evals_B)
  if isinstance(spec, specs_lib.LocalRemaskSpec):
    state = local_remask.sample_program(
        lambda *a, **k: _run_family(*a, **k)[0], apply_fn, params, keys_B, tokens_BxL,
        fixed_BxL, spec=spec, mask_id=mask_id, num_blocks=num_blocks)
    return _result(state)
  return _result(*_run_family(apply_fn, params, keys_B, tokens_BxL, fixed_BxL, spec=spec,
                              mask_id=mask_id, num_blocks=num_blocks))


def _run_family(apply_fn, params, keys_B, tokens_BxL, fixed_BxL, *, spec, mask_id,
                num_blocks) -> tuple[State, Array | None]:
  """The scan of one step-wise family: (final state, trajectory or None)."""
  state, ctx, xs = _prepare(apply_fn, params, keys_B, tokens_BxL, fixed_BxL, spec=spec,
                            mask_id=mask_id, num_blocks=num_blocks)

  def step_fn(state: State, x):
    state = _step(apply_fn, params, keys_B, state, ctx, x, spec=spec)
    return state, (state.tokens_BxL if spec.record_trajectory else None)

  return jax.lax.scan(step_fn, state, xs)


_prepare_jit = jax.jit(_prepare, static_argnames=_STATIC)
_step_jit = jax.jit(_step, static_argnames=("apply_fn", "spec"), donate_argnames=("state",))


def sample_python_loop(apply_fn, params: Any, key: Array, tokens_BxL: Array,
                       spec: specs_lib.SamplerSpec, fixed_BxL: Array | None = None, *,
                       mask_id: int | None = None) -> SampleResult:
  """`sample` as a Python loop calling one jitted step K times.

  The same kernel as `sample`, dispatched step by step from the host, the way
  the PyTorch reference samplers (LLaDA, MDLM, ReMDM) run; it exists for the
  benchmark's side-by-side comparison. Gives the same tokens as `sample`.
  """
  args, static = _checked_args(apply_fn, params, key, tokens_BxL, spec, fixed_BxL, mask_id)
  if isinstance(spec, (specs_lib.SpeculativeSpec, specs_lib.LocalRemaskSpec)):
    raise ValueError(f"spec={type(spec).__name__}: its rounds run only as one program; "
                     "use sample.")
  if spec.record_trajectory:
    raise ValueError("record_trajectory=True: use sample; the Python loop keeps no record.")
  state, ctx, xs = _prepare_jit(apply_fn, *args, **static)
  keys_B = args[1]
  xs = jax.device_get(xs)
  for i in range(num_steps(spec, args[2].shape[1])):
    x = {name: value[i] for name, value in xs.items()}
    state = _step_jit(apply_fn, params, keys_B, state, ctx, x, spec=spec)
  return _result(state)


def lower(apply_fn, params: Any, key: Array, tokens_BxL: Array, spec: specs_lib.SamplerSpec,
          fixed_BxL: Array | None = None, *, mask_id: int | None = None):
  """The `sample` program, lowered, and the arguments to call it with.

  Returns (lowered, args): `lowered.compile()(*args)` runs the same program
  as `sample(...)`; `.memory_analysis()` and `.cost_analysis()` of the
  compiled program measure it, `.as_text()` shows it.
  """
  args, static = _checked_args(apply_fn, params, key, tokens_BxL, spec, fixed_BxL, mask_id)
  return _sample_jit.lower(apply_fn, *args, **static), args
