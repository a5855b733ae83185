"""The exact ancestral reverse kernel of any noise process: uniform, GIDD's hybrid, absorbing.

The run starts from the process's prior at the generated positions (uniform noise: random
tokens, no mask; hybrid: all masks at t = 1), then takes K equal steps t -> s = t - 1/K.
Each step draws every generated position from the exact per-position reverse step

    x_s,i ~ sum_v q(x_s,i | x_t,i, x0_i = v) p(x0_i = v | x_t)

(`NoiseProcess.reverse_step`), the mixture over the denoiser's posterior marginals, never
the posterior plugged in for x0 (which counts a position's own evidence twice under uniform
noise). A written token may change at any step: that is what uniform noise's reverse
process does. Positions are drawn independently given x_t, so a step that moves dependent
positions together errs, as the absorbing ancestral sampler does; the error vanishes as
K grows. Under absorbing noise this is the usual ancestral sampler's law (its draws differ).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.sampling import revising, transforms
from mdjax.sampling.base import (Family, SamplerSpec, StepPlan, check_steps, internal, knob,
                                 register)

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class UniformAncestralSpec(SamplerSpec):
  """The exact reverse kernel of the model's noise process on K equal time steps.

  `SampleResult.extras["changes_KxB"]` counts, per step and row, the generated positions whose
  token changed (a token rewritten, or returned to the mask under hybrid noise).
  """

  steps: int = knob(help="Denoiser steps, equal in time from t = 1 to 0.", minimum=1)
  noise: Any = internal(
      None, help="The model's noise process: a mdjax.noise process, or its name "
      "('uniform', 'hybrid', 'absorbing') over the denoiser's V with the linear schedule. "
      "None: the model's (Model.noise), which mdjax.generate and sample.py fill in; "
      "sampling.sample needs it given.")

  def __post_init__(self):
    super().__post_init__()
    check_steps(self.steps)
    revising.check_noise_field(self.noise)


@struct.dataclass
class UniformAncestralPlan(StepPlan):
  s: Array  # the time after this step
  last: Array  # the last step (s = 0): ends rows at EOS


@register
class UniformAncestral(Family):
  name = "uniform_ancestral"
  spec_type = UniformAncestralSpec
  rewrites = True
  noise_kinds = ("uniform", "hybrid", "absorbing")
  ends_rows_at_the_end = True

  def bench_spec(self, steps, length):
    return UniformAncestralSpec(steps=steps, noise="uniform")

  def examples(self, generated):
    return [UniformAncestralSpec(steps=5, noise="uniform"),
            UniformAncestralSpec(steps=4, noise="hybrid", top_k=3),
            UniformAncestralSpec(steps=3, noise="absorbing", temperature=0.8)]

  def validate(self, spec, canvas):
    revising.check_canvas(revising.process_of(spec.noise, canvas.vocab_size), canvas)

  def plan(self, spec, canvas) -> UniformAncestralPlan:
    j = np.arange(spec.steps)
    s = 1.0 - (j + 1) / spec.steps
    s[-1] = 0.0
    return UniformAncestralPlan(t=1.0 - j / spec.steps, s=s, last=j == spec.steps - 1)

  def idle_steps(self, spec, canvas, plan):
    return 0.0

  def start(self, spec, core, ctx):
    return revising.start_from_prior(revising.process_of(spec.noise, ctx.vocab), core, ctx)

  def init(self, spec, core, ctx) -> Array:
    return jnp.zeros((spec.steps, core.tokens_BxL.shape[0]), jnp.int32)  # changes_KxB

  def active_rows(self, spec, core, changes_KxB, ctx) -> Array:
    return jnp.ones(core.tokens_BxL.shape[:1], bool)  # every row steps K times

  def extras(self, spec, changes_KxB):
    return {"changes_KxB": changes_KxB}

  def update(self, spec, core, changes_KxB, ctx, step, logits_BxLxV, denoise):
    """Every generated position drawn from the exact reverse step t -> s."""
    process = revising.process_of(spec.noise, ctx.vocab)
    posterior_BxLxV = transforms.transformed_probs(logits_BxLxV, spec)
    z_BxL = core.tokens_BxL
    x_s_BxL, prob_BxL = revising.reverse_draw(process, posterior_BxLxV, z_BxL, step.plan.s,
                                              step.plan.t, step.keys_B, step.shift_B)
    editable_BxL = ctx.editable_BxL
    changed_BxL = editable_BxL & (x_s_BxL != z_BxL)
    reopened_BxL = changed_BxL & (z_BxL != ctx.mask_id) & (x_s_BxL == ctx.mask_id)
    core = core.commit(editable_BxL, x_s_BxL, prob_BxL, step.index)
    core = core.count(reopened_B=reopened_BxL.sum(-1))
    last_B = jnp.broadcast_to(step.plan.last, core.tokens_BxL.shape[:1])
    core = revising.end_rows(spec, core, ctx, last_B, step.index)
    return core, changes_KxB.at[step.index].set(changed_BxL.sum(-1))
