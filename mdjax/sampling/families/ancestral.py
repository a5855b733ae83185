"""The exact ancestral reverse kernel of MD4 / MDLM, optionally in blocks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax import diffusion
from mdjax.sampling import semi_autoregressive, reveal
from mdjax.sampling.base import (Family, SamplerSpec, StepPlan, check, check_block_length,
                                 check_steps, knob, register)

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class AncestralSpec(SamplerSpec):
  """The exact reverse kernel of MD4 / MDLM on a time grid.

  Each masked position is revealed with probability
  (alpha(s) - alpha(t)) / (1 - alpha(t)) and its value drawn from the
  denoiser's categorical at the current state.
  """

  steps: int = knob(help="Denoiser steps (with block_length: over all blocks).", minimum=1)
  schedule: diffusion.Schedule = knob(diffusion.LinearSchedule(),
                                      help="The masking schedule alpha(t), by name.",
                                      choices=tuple(diffusion.SCHEDULES))
  grid: reveal.Grid = knob("uniform", help="The time grid t_0 = 1 > ... > t_K = 0, by name "
                           "(or, in Python, a tuple of times).", choices=reveal.GRIDS)
  cache: bool = knob(False, help="Skip the denoiser when nothing changed since its last call "
                     "(valid for denoisers that ignore t).")
  block_length: int | None = knob(None, help="Decode semi-autoregressively in blocks of this "
                                  "many positions, each on its own grid with steps / "
                                  "num_blocks steps.", minimum=1)

  def __post_init__(self):
    super().__post_init__()
    check_steps(self.steps)
    check_block_length(self.block_length)
    reveal.freeze_grid(self)


@struct.dataclass
class AncestralPlan(StepPlan):
  block: Array  # the block this step works on
  reveal_p: Array  # probability that a masked position of the block is revealed


@register
class Ancestral(Family):
  name = "ancestral"
  spec_type = AncestralSpec
  decodes_blocks = True

  def block_length(self, spec) -> int | None:
    return spec.block_length

  def examples(self, generated):
    return [AncestralSpec(steps=5, min_p=0.1),
            AncestralSpec(steps=6, grid="cosine", cache=True),
            AncestralSpec(steps=4, block_length=len(generated) // 2,
                          schedule=diffusion.CosineSchedule())]

  def validate(self, spec: AncestralSpec, canvas):
    if spec.block_length is not None:
      check(isinstance(spec.grid, str), "grid", spec.grid,
            f"with block_length use a named grid {reveal.GRIDS}")

  def plan(self, spec: AncestralSpec, canvas) -> AncestralPlan:
    """Each block runs its own grid of steps / num_blocks steps."""
    num_blocks = semi_autoregressive.count(spec.block_length, spec.steps, canvas)
    per_block = spec.steps // num_blocks
    times = reveal.time_grid(spec.grid, per_block)
    t_K, s_K = np.tile(times[:-1], num_blocks), np.tile(times[1:], num_blocks)
    return AncestralPlan(t=t_K, block=semi_autoregressive.step_blocks(num_blocks, per_block),
                         reveal_p=reveal.intervals(spec.schedule, t_K, s_K)["reveal_p"])

  def idle_steps(self, spec: AncestralSpec, canvas, plan: AncestralPlan) -> float | None:
    """Expected idle steps: a step of a block is idle when every row revealed the whole
    block before it; a position masked at the block's start is still masked after step j
    with probability prod_{i <= j} (1 - reveal_p_i), independently of the others."""
    n_BxN = semi_autoregressive.masked_counts(canvas, spec.block_length)
    if n_BxN is None:
      return None
    num_blocks = n_BxN.shape[1]
    still_NxJ = np.cumprod(1.0 - plan.reveal_p.reshape(num_blocks, -1), axis=1)
    # Step 0 of a block is idle only if no row has anything in it; step j >= 1 if every row
    # finished the block by step j - 1.
    done_NxJ = np.concatenate([np.zeros_like(still_NxJ[:, :1]), 1.0 - still_NxJ[:, :-1]], axis=1)
    return float((done_NxJ[None] ** n_BxN[..., None]).prod(0).sum())

  def init(self, spec: AncestralSpec, core, ctx) -> Array:
    return semi_autoregressive.block_ids(ctx.editable_BxL, spec.block_length)

  def reuses_logits(self, spec: AncestralSpec) -> bool:
    return spec.cache

  def needs_call(self, spec, core, block_id_BxL, ctx, plan: AncestralPlan) -> Array:
    return jnp.any(semi_autoregressive.candidates(core.tokens_BxL, ctx, block_id_BxL, plan.block))

  def update(self, spec, core, block_id_BxL, ctx, step, logits_BxLxV, denoise):
    """One reverse step t -> s: reveal each masked position of the block w.p. reveal_p."""
    masked_BxL = semi_autoregressive.candidates(core.tokens_BxL, ctx, block_id_BxL, step.plan.block)
    reveal_p_B = jnp.broadcast_to(step.plan.reveal_p, core.tokens_BxL.shape[:1])
    return reveal.reveal(spec, core, step, masked_BxL, logits_BxLxV, reveal_p_B), block_id_BxL
