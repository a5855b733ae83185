"""gemma's `DiffusionSampler` whole (google-deepmind/gemma `gemma/diffusion/_sampler.py`:
`_sample_step` under `SamplerLoop._sample_loop`): canvases of `reference_length` tokens
denoised in turn, each by DiffusionGemma's rule (the `diffusion_gemma` family, drawing as the
reference draws) against a cache of the prompt and the canvases before it, then appended to
that cache by the causal encoder pass.

The key chain is gemma's: a row's key is the sampler's `rng`, and canvas c draws with the
second half of its c-th split (`next, sample = split(rng)`, as `_sample_step` splits its
state's rng), which `sample_next_canvas` splits again (the initial canvas, the step chain).
A canvas that holds a stop id (`stop_ids`, gemma's `end_tokens`; default: the spec's eos_id)
ends its row: no later canvas is denoised for it, and its positions after that first stop
id become eos_id (gemma writes PAD there and stops at the same point). Within a canvas a row
stops early as the `diffusion_gemma` family says (gemma's `early_stop_fn`), and starts the
next canvas afresh. Rows are independent: a batch equals its rows run alone with their keys
(gemma draws a batch's rows from one key in the batch's shape: docs/pretrained.md).

The cached passes are the denoiser's (DiffusionGemma's `Denoiser.prefill` and `decode`:
`mdjax.models.diffusion_gemma.denoiser`): prefill encodes the prompt; each step's call runs
the canvas as the decoder against the cache (the cache that call also returns, with the canvas
encoded after it, is dropped, and XLA drops its work); after a canvas, one decode keeps that
cache. A denoiser without self-conditioning or without the cached passes (an oracle, a test
stub) sees the whole canvas at each call instead, later canvases still on the mask.

One program: a scan over the canvases, each a run of the family's steps (a loop that jumps
over the steps after every row stopped), built of `first_carry`, then per canvas
`open_canvas`, `canvas_denoiser` and `close_canvas`. `sampling.canvas_stepping` steps the same
pieces one denoising step at a time (a served lane: `mdjax.serve.canvas_lanes`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.denoiser import Denoiser
from mdjax.sampling import stepping
from mdjax.sampling.base import (BoundDenoiser, Canvas, Core, Family, check, family_of,
                                 knob, register)
from mdjax.sampling.families.diffusion_gemma import DiffusionGemmaSpec

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiffusionGemmaCanvasesSpec(DiffusionGemmaSpec):
  """gemma's `DiffusionSampler` over `canvases` canvases of `reference_length` (module
  docstring); each canvas is run by the `diffusion_gemma` rule with these knobs (`steps` a
  canvas: gemma's max_denoising_steps). The generated positions are the canvas's last
  canvases x reference_length. `extras["stop_step_NxB"]`: the step at which each row stopped
  in each canvas (steps when it ran them all, -1 when the row had ended before it)."""

  reference_draws: bool = knob(True, help="Draw as google-deepmind/gemma's DiffusionSampler "
                               "does with the row's key (the canvases family always does).")
  canvases: int = knob(1, help="Canvases of reference_length denoised in turn, each appended "
                       "to the cache before the next (gemma's DiffusionSampler: max_new_tokens "
                       "over its canvas_length).", minimum=1)
  stop_ids: tuple[int, ...] = ()  # gemma's end_tokens; () stops at eos_id

  def __post_init__(self):
    super().__post_init__()
    check(self.reference_draws is True, "reference_draws", self.reference_draws,
          "must be True: the canvases family draws as gemma's sampler does")
    check(isinstance(self.canvases, int) and not isinstance(self.canvases, bool)
          and self.canvases >= 1, "canvases", self.canvases, "must be an integer >= 1")
    check(isinstance(self.stop_ids, tuple) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.stop_ids),
          "stop_ids", self.stop_ids, "must be a tuple of token ids >= 0")
    check(not self.stop_ids or self.eos_id is not None, "stop_ids", self.stop_ids,
          "needs eos_id (the id a row holds after its stop)")

  @property
  def ends_at(self) -> tuple[int, ...]:
    """The ids that end a row after its canvas (stop_ids, else eos_id)."""
    return self.stop_ids or (() if self.eos_id is None else (self.eos_id,))


def canvas_spec(spec: DiffusionGemmaCanvasesSpec) -> DiffusionGemmaSpec:
  """One canvas's spec: the rule's knobs, without the end of sequence (the canvases end rows)."""
  shared = {f.name: getattr(spec, f.name) for f in dataclasses.fields(DiffusionGemmaSpec)}
  return DiffusionGemmaSpec(**{**shared, "eos_id": None, "eos_penalty": 0.0,
                               "eos_never": False, "eos_rank_last": False,
                               "record_trajectory": False})


def canvas_keys(rng_B: Array) -> tuple[Array, Array]:
  """(the rows' rng after this canvas, this canvas's key): `_sample_step`'s
  `next_rng, sample_rng = split(state.rng)`, per row."""
  pair_Bx2 = jax.vmap(jax.random.split)(rng_B)
  return pair_Bx2[:, 0], pair_Bx2[:, 1]


def cached(denoiser: Denoiser) -> bool:
  """Whether the denoiser's cached passes are the encoder and decoder of a self-conditioning
  model (DiffusionGemma's), which the canvases read and append to."""
  return denoiser.offers_cache and denoiser.self_conditions and denoiser.block_size is None


@struct.dataclass
class Window:
  """What a canvas's calls read beside its tokens: the cache (cached) or the whole canvas
  and its padding (recomputed), and where the canvas starts."""

  start: Array
  cache: object = None
  canvas_BxL: Array | None = None
  valid_BxL: Array | None = None


def _cached_window(model: Denoiser, params, tokens_BxW, t_B, valid_BxL=None, context=None,
                   condition=None):
  del valid_BxL  # the canvas is all valid; the prompt's padding is the cache's
  extra = {} if condition is None else {"condition": condition}
  logits_BxWxV, _ = model.decode(params, context.cache, tokens_BxW, context.start, t_B, **extra)
  return logits_BxWxV


def _recomputed_window(model: Denoiser, params, tokens_BxW, t_B, valid_BxL=None,
                       context=None, condition=None):
  del valid_BxL
  width = tokens_BxW.shape[1]
  canvas_BxL = jax.lax.dynamic_update_slice_in_dim(context.canvas_BxL, tokens_BxW,
                                                   context.start, axis=1)
  if condition is not None:  # the canvas's own condition, zeros elsewhere
    zeros = jnp.zeros(canvas_BxL.shape + condition.shape[-1:], condition.dtype)
    condition = jax.lax.dynamic_update_slice_in_dim(zeros, condition, context.start, axis=1)
  logits_BxLxV = model(params, canvas_BxL, t_B, context.valid_BxL, condition)
  return jax.lax.dynamic_slice_in_dim(logits_BxLxV, context.start, width, axis=1)


@functools.cache
def window_denoiser(model: Denoiser) -> Denoiser:
  """The denoiser of one canvas: its W tokens' logits from the cache (`Window` as the
  call's `context`), or from the whole canvas for a denoiser without the cached passes."""
  fn = _cached_window if cached(model) else _recomputed_window
  return Denoiser(apply=functools.partial(fn, model), encode_condition=model.encode_condition)


@struct.dataclass
class CanvasesCarry:
  """What the scan over canvases carries."""

  core: Core  # the whole canvas
  rng_B: Array  # each row's sampler rng (gemma's state.rng)
  ended_B: Array  # rows whose canvas held a stop id
  cache: object = None  # the prompt and the finished canvases, encoded (cached)


@register
class DiffusionGemmaCanvases(Family):
  """gemma's DiffusionSampler: canvases in turn (module docstring), in one program."""

  name = "diffusion_gemma_canvases"
  spec_type = DiffusionGemmaCanvasesSpec
  composite = True
  refills = False
  python_loop = False
  rewrites = True
  stops_early = True
  noise_kinds = ("uniform",)
  ends_rows_at_the_end = True

  def bench_spec(self, steps, length):
    return DiffusionGemmaCanvasesSpec(steps=steps, reference_length=length)

  def examples(self, generated):
    # Two canvases where the generated positions halve, else one.
    canvases = 2 if len(generated) % 2 == 0 else 1
    width = len(generated) // canvases
    return [DiffusionGemmaCanvasesSpec(steps=3, reference_length=width, canvases=canvases,
                                       entropy_bound=1.0, final_renoise=True),
            DiffusionGemmaCanvasesSpec(steps=4, reference_length=width, canvases=canvases,
                                       entropy_bound=0.5, early_stop=True)]

  def num_steps(self, spec, length):
    return spec.canvases * spec.steps

  def validate(self, spec, canvas):
    check(spec.kv_cache == "none", "kv_cache", spec.kv_cache,
          "must be 'none': the canvases keep the cache themselves")
    span = spec.canvases * spec.reference_length
    check(span <= canvas.length, "canvases", spec.canvases,
          f"times reference_length={spec.reference_length} must fit the canvas's length "
          f"L={canvas.length}")
    generated = canvas.generated()
    if generated is not None:
      last = np.arange(canvas.length) >= canvas.length - span
      check(bool((generated == last).all()), "canvases", spec.canvases,
            f"times reference_length={spec.reference_length}: the generated positions must "
            f"be the canvas's last {span}")
    for i in spec.ends_at:
      check(i < canvas.vocab_size, "stop_ids", spec.stop_ids,
            f"must be token ids below V={canvas.vocab_size}")

  def plan(self, spec, canvas):
    width = spec.reference_length
    one = Canvas(batch=canvas.batch, length=width, mask_id=canvas.mask_id,
                 tokens=np.full((canvas.batch, width), canvas.mask_id, np.int32),
                 fixed=np.zeros((canvas.batch, width), bool), vocab_size=canvas.vocab_size)
    inner = canvas_spec(spec)
    return family_of(inner).plan(inner, one)

  def extras(self, spec, aux):
    return {"stop_step_NxB": aux}

  def run(self, spec, denoiser: BoundDenoiser, core, ctx, plan):
    batch = core.tokens_BxL.shape[0]
    steps, inner = spec.steps, canvas_spec(spec)

    def one_canvas(carry: CanvasesCarry, c):
      carry, key_B, tokens_BxW, fixed_BxW = open_canvas(spec, carry, ctx)
      canvas_core, canvas_ctx = stepping.start_canvas(key_B, tokens_BxW, fixed_BxW,
                                                      ctx.mask_id, vocab_size=ctx.vocab_size)
      bound = canvas_denoiser(spec, denoiser, carry, c)

      def denoise():
        out, aux, _ = stepping.run(inner, bound, canvas_core, canvas_ctx, plan)
        return out, aux.stop_step_B

      idle = lambda: (canvas_core, jnp.full((batch,), steps, jnp.int32))
      canvas_core, stop_B = jax.lax.cond(carry.ended_B.all(), idle, denoise)
      return close_canvas(spec, denoiser, carry, canvas_core, stop_B, c)

    carry = first_carry(denoiser, core, ctx)
    carry, stop_NxB = jax.lax.scan(one_canvas, carry, jnp.arange(spec.canvases, dtype=jnp.int32))
    core = after_stop(spec, carry.core, ctx, spec.canvases * steps - 1)
    return core, stop_NxB, None


# ----------------------------------------------------------------------------
# The pieces of a run: `run` scans them over the canvases, and
# `sampling.canvas_stepping.CanvasesStepper` steps them one denoising step at a time.
# ----------------------------------------------------------------------------


def canvas_start(spec: DiffusionGemmaCanvasesSpec, length: int, c) -> Array:
  """Where canvas c starts on a length-L canvas (the canvases are its last positions)."""
  return length - spec.canvases * spec.reference_length + c * spec.reference_length


def first_carry(denoiser: BoundDenoiser, core: Core, ctx) -> CanvasesCarry:
  """The carry before the first canvas: the prompt encoded (one pass; cached), no row
  ended, each row's rng its key."""
  batch = core.tokens_BxL.shape[0]
  cache = None
  if cached(denoiser.model):  # the prompt, encoded: one pass
    cache = denoiser.prefill(core.tokens_BxL, jnp.ones((batch,), jnp.float32))[1]
    core = core.count(nfe=1)
  return CanvasesCarry(core=core, rng_B=ctx.keys_B, ended_B=jnp.zeros((batch,), bool),
                       cache=cache)


def open_canvas(spec: DiffusionGemmaCanvasesSpec, carry: CanvasesCarry, ctx):
  """(the carry with each row's rng moved past the canvas, the canvas's row keys, its
  tokens_BxW and fixed_BxW): ended rows hold padding, fixed, so their canvas is never drawn
  or seen."""
  batch, width = carry.ended_B.shape[0], spec.reference_length
  rng_B, key_B = canvas_keys(carry.rng_B)
  fixed_BxW = jnp.broadcast_to(carry.ended_B[:, None], (batch, width))
  tokens_BxW = jnp.where(fixed_BxW, 0, ctx.mask_id)
  return carry.replace(rng_B=rng_B), key_B, tokens_BxW, fixed_BxW


def canvas_denoiser(spec: DiffusionGemmaCanvasesSpec, denoiser: BoundDenoiser,
                    carry: CanvasesCarry, c) -> BoundDenoiser:
  """The denoiser of canvas c (`window_denoiser`): its W tokens against the cache of the
  prompt and the canvases before it, or the whole canvas recomputed."""
  batch, width = carry.ended_B.shape[0], spec.reference_length
  start = canvas_start(spec, carry.core.tokens_BxL.shape[1], c)
  context = Window(start=start, cache=carry.cache) if cached(denoiser.model) else Window(
      start=start, canvas_BxL=carry.core.tokens_BxL, valid_BxL=denoiser.valid_BxL)
  return BoundDenoiser(window_denoiser(denoiser.model), denoiser.params,
                       valid_BxL=jnp.ones((batch, width), bool), context=context,
                       mask_in_vocab=denoiser.mask_in_vocab)


def close_canvas(spec: DiffusionGemmaCanvasesSpec, denoiser: BoundDenoiser,
                 carry: CanvasesCarry, canvas_core: Core, stop_B: Array, c):
  """(the carry after canvas c, each row's stop step there: -1 for a row ended before
  it): the finished canvas written into the whole one (rows that had ended keep theirs), a
  row whose canvas holds a stop id ended, and, while a canvas follows and a row goes on,
  the canvas appended to the cache (gemma's append_tokens_to_cache: one pass; cached)."""
  batch, length = carry.core.tokens_BxL.shape
  width, steps = spec.reference_length, spec.steps
  start = canvas_start(spec, length, c)
  ones_B = jnp.ones((batch,), jnp.float32)
  ends_at = jnp.asarray(spec.ends_at or (-1,), jnp.int32)
  ended_B = carry.ended_B
  canvas_BxW = canvas_core.tokens_BxL
  stopped_B = ~ended_B & jnp.isin(canvas_BxW, ends_at).any(-1)
  full = carry.core
  here_BxL = ((jnp.arange(length) >= start) & (jnp.arange(length) < start + width))[None]
  write_BxL = here_BxL & ~ended_B[:, None]
  place = lambda whole, part: jax.lax.dynamic_update_slice_in_dim(whole, part, start, 1)
  full = full.replace(
      tokens_BxL=jnp.where(write_BxL, place(full.tokens_BxL, canvas_BxW), full.tokens_BxL),
      write_step_BxL=jnp.where(write_BxL, place(full.write_step_BxL,
                                                canvas_core.write_step_BxL + c * steps),
                               full.write_step_BxL),
      write_conf_BxL=jnp.where(write_BxL, place(full.write_conf_BxL,
                                                canvas_core.write_conf_BxL),
                               full.write_conf_BxL),
      counters=full.counters + canvas_core.counters)
  cache_now, ended_now_B = carry.cache, ended_B | stopped_B
  if cached(denoiser.model):  # the finished canvas appended (gemma's append_tokens_to_cache)
    more = (c + 1 < spec.canvases) & ~ended_now_B.all()
    append = lambda: denoiser.decode(carry.cache, canvas_BxW, start, ones_B)[1]
    cache_now = jax.lax.cond(more, append, lambda: carry.cache)
    full = full.count(nfe=more.astype(jnp.int32))
  stop_B = jnp.where(ended_B, -1, stop_B)
  return CanvasesCarry(core=full, rng_B=carry.rng_B, ended_B=ended_now_B,
                       cache=cache_now), stop_B


def after_stop(spec: DiffusionGemmaCanvasesSpec, core: Core, ctx, step) -> Core:
  """eos_id at the generated positions after each row's first stop id (gemma's PAD after
  `_truncate_canvas_at_stop_tokens`), where the row has one."""
  if not spec.ends_at:
    return core
  stop_BxL = jnp.isin(core.tokens_BxL, jnp.asarray(spec.ends_at, jnp.int32)) & ctx.editable_BxL
  first_B = jnp.where(stop_BxL.any(-1), jnp.argmax(stop_BxL, -1), core.tokens_BxL.shape[1])
  fill_BxL = ((jnp.arange(core.tokens_BxL.shape[1])[None] > first_B[:, None])
              & ctx.editable_BxL & (core.tokens_BxL != spec.eos_id))
  return core.commit(fill_BxL, jnp.full_like(core.tokens_BxL, spec.eos_id),
                     jnp.ones(core.write_conf_BxL.shape, core.write_conf_BxL.dtype), step)
