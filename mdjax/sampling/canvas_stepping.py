"""DiffusionGemma's canvases one denoising step at a time: the pieces of the composite
`diffusion_gemma_canvases` family, in public (as `block_stepping` is for `sample_blocks`).

The family's one program (`DiffusionGemmaCanvases.run`) scans over canvases, each a run of
the `diffusion_gemma` rule against the cache of the prompt and the canvases before it, then
the causal encoder pass that appends the finished canvas to that cache. `CanvasesStepper`
runs the same pieces from outside the program:

  start:  the prompt encoded into the cache (one pass), canvas 0 opened (its row keys,
          its family carry: `Stepper.start` on its W positions);
  step:   one step of the current canvas's family (`Stepper.step`: one decoder pass);
  commit: once every row's canvas is done (`canvas_done`: its steps spent or it stopped
          early), the canvas written into the whole, a row whose canvas holds a stop id
          ended, the canvas appended to the cache while a canvas follows (one pass), and
          the next canvas opened: as a block's commit ends a block.

A state holds one canvas index and one step index for all its rows, as the program does,
and steps exactly the steps the program runs (it jumps over the steps after every row of
a canvas stopped; `commit` counts them as saved calls), so `result` equals `sample`'s.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from mdjax.sampling import stepping
from mdjax.sampling.base import BoundDenoiser, Context, family_of, mask_inside
from mdjax.sampling.end_of_row import EndOfRow
from mdjax.sampling.families import diffusion_gemma_canvases as canvases
from mdjax.sampling.families.diffusion_gemma_canvases import (CanvasesCarry,
                                                              DiffusionGemmaCanvasesSpec)
from mdjax.sampling.stepping import Carry, SampleResult, Stepper

Array = jax.Array


def serves(spec) -> bool:
  """Whether `spec` is a composite family this door steps (DiffusionGemma's canvases)."""
  return isinstance(spec, DiffusionGemmaCanvasesSpec)


@struct.dataclass
class CanvasesState:
  """What one step hands the next: the whole canvas, the rows' rng and ended rows, the
  cache (`CanvasesCarry`), the call's constants, the current canvas c and its next step,
  its family carry, the stop steps of the canvases closed so far. A pytree."""

  whole: CanvasesCarry
  ctx: Context
  canvas: Array  # c (int32); `spec.canvases` once every canvas is closed
  index: Array  # the canvas's next step (int32)
  inner: Carry  # the canvas's `diffusion_gemma` carry (W positions)
  stop_NxB: Array  # the step each row stopped at in each closed canvas (-1: ended before)
  invalid_B: Array  # positions of each row whose input was invalid (`SampleResult`)


@dataclasses.dataclass(frozen=True)
class CanvasesStepper:
  """The canvases family's spec on a canvas of given ids: start, step, canvas_done,
  commit, done, tokens, result. Hashable (a static argument of jit). The denoiser is the
  whole canvas's (`bind`); the plan is one canvas's per-step plan (`sampling.prepare(...)
  .plan` of the spec, leading axis `spec.steps`)."""

  spec: DiffusionGemmaCanvasesSpec
  mask_id: int
  vocab_size: int | None = None

  @property
  def inner(self) -> Stepper:
    """A canvas's stepper: the `diffusion_gemma` rule on W positions."""
    return Stepper(canvases.canvas_spec(self.spec), self.mask_id, self.vocab_size)

  def num_steps(self, length: int | None = None) -> int:
    """The most steps a row runs: steps a canvas, times the canvases."""
    del length
    return self.spec.canvases * self.spec.steps

  def bind(self, denoiser, params, valid_BxL=None) -> BoundDenoiser:
    """`denoiser` (the whole canvas's `Denoiser`) bound to `params` and the padding."""
    return BoundDenoiser(denoiser, params, valid_BxL,
                         mask_in_vocab=mask_inside(self.mask_id, self.vocab_size))

  def start(self, denoiser: BoundDenoiser, key, tokens_BxL, valid_BxL=None) -> CanvasesState:
    """The state at step 0 of canvas 0: the prompt encoded (key: one PRNG key or B row
    keys; tokens_BxL: the prompt, then the mask id at the canvases' positions)."""
    core, ctx = stepping.start_canvas(key, tokens_BxL, None, self.mask_id, valid_BxL,
                                      self.vocab_size)
    batch = core.tokens_BxL.shape[0]
    whole = canvases.first_carry(denoiser, core, ctx)
    stop_NxB = jnp.full((self.spec.canvases, batch), -1, jnp.int32)
    state = CanvasesState(whole=whole, ctx=ctx, canvas=jnp.int32(0), index=jnp.int32(0),
                          inner=Carry(state=None, ctx=None, invalid_B=None), stop_NxB=stop_NxB,
                          invalid_B=stepping.invalid_input(core.tokens_BxL, ctx))
    return self._open(denoiser, state, jnp.int32(0))

  def _open(self, denoiser: BoundDenoiser, state: CanvasesState, c: Array) -> CanvasesState:
    """`state` at step 0 of canvas c: the rows' rng moved past it, its family started."""
    whole, key_B, tokens_BxW, fixed_BxW = canvases.open_canvas(self.spec, state.whole,
                                                               state.ctx)
    bound = canvases.canvas_denoiser(self.spec, denoiser, whole, c)
    inner = self.inner.start(bound, key_B, tokens_BxW, fixed_BxW)
    return state.replace(whole=whole, canvas=c, index=jnp.int32(0), inner=inner)

  def step(self, denoiser: BoundDenoiser, state: CanvasesState, plan_K) -> CanvasesState:
    """One step of the current canvas (its index clamped to the canvas's last step)."""
    index = jnp.minimum(state.index, self.spec.steps - 1)
    bound = canvases.canvas_denoiser(self.spec, denoiser, state.whole, state.canvas)
    inner = self.inner.step(bound, state.inner, index, plan_K)
    return state.replace(inner=inner, index=index + 1)

  def canvas_done(self, state: CanvasesState) -> Array:
    """Whether every row's current canvas is done (its steps spent, or it stopped early):
    the program runs no further step of it."""
    return self.inner.done(state.inner, state.index).all()

  def commit(self, denoiser: BoundDenoiser, state: CanvasesState) -> CanvasesState:
    """The current canvas closed (`close_canvas`: written, stop ids read, appended to the
    cache while a canvas follows) and the next one opened; its steps not run are counted
    as saved calls, as the program counts the steps it jumps over."""
    inner_core = state.inner.state.core.count(saved_calls=self.spec.steps - state.index)
    whole, stop_B = canvases.close_canvas(self.spec, denoiser, state.whole, inner_core,
                                          state.inner.state.aux.stop_step_B, state.canvas)
    stop_NxB = jax.lax.dynamic_update_index_in_dim(state.stop_NxB, stop_B, state.canvas, 0)
    state = state.replace(whole=whole, stop_NxB=stop_NxB)
    return self._open(denoiser, state, state.canvas + 1)

  def done(self, state: CanvasesState) -> Array:
    """Per row: finished (its canvas held a stop id, or every canvas is closed); its tokens
    are final then."""
    return state.whole.ended_B | (state.canvas >= self.spec.canvases)

  def tokens(self, state: CanvasesState) -> Array:
    """tokens_BxL: the whole canvas as it stands (an unfinished row's current canvas
    written in), eos_id after each row's first stop id (`after_stop`): a finished row's
    are `result`'s."""
    core, spec = state.whole.core, self.spec
    length = core.tokens_BxL.shape[1]
    start = canvases.canvas_start(spec, length, state.canvas)
    placed_BxL = jax.lax.dynamic_update_slice_in_dim(core.tokens_BxL, state.inner.tokens_BxL,
                                                     start, 1)
    positions_L = jnp.arange(length)
    here_BxL = ((positions_L >= start) & (positions_L < start + spec.reference_length))[None]
    here_BxL &= ~self.done(state)[:, None]
    core = core.replace(tokens_BxL=jnp.where(here_BxL, placed_BxL, core.tokens_BxL))
    return canvases.after_stop(spec, core, state.ctx, self.num_steps() - 1).tokens_BxL

  def result(self, state: CanvasesState) -> SampleResult:
    """The run's `SampleResult` once every row is done, as `sample` returns it."""
    spec, last = self.spec, jnp.int32(self.num_steps() - 1)
    core = canvases.after_stop(spec, state.whole.core, state.ctx, last)
    core = EndOfRow.of(spec).finish(core, state.ctx, last)  # as `stepping.run` ends it
    return stepping.result(family_of(spec), spec, core, state.stop_NxB, None, state.ctx,
                           state.invalid_B)
