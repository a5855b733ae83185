"""Direct revision (D3IM-style): every step rebuilds the editable canvas."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax import diffusion
from mdjax.sampling import contexts, scores
from mdjax.sampling.base import (Family, SamplerSpec, StepPlan, check, check_steps,
                                 knob, register)

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class RevisionSpec(SamplerSpec):
  """Direct revision (D3IM-style): every step rebuilds the editable canvas.

  Each step draws a value for every editable position, masked or not, keeps the
  n_i best by `score` (n_i of N editable positions after step i of K follows
  `count_schedule`, as ConfidenceSpec's counts) and masks the rest, so a visible
  token can change value, or return to the mask, without being remasked first.
  `SampleResult.extras["changes_KxB"]` counts the visible tokens that changed value at
  each step.
  """

  steps: int = knob(help="Denoiser steps.", minimum=1)
  score: str = knob("max_prob", help="The score that ranks the drawn values "
                    "(scores.SCORES).", choices=scores.SCORES)
  count_schedule: diffusion.Schedule = knob(
      diffusion.LinearSchedule(), help="The schedule of the kept counts, as ConfidenceSpec's.",
      choices=tuple(diffusion.SCHEDULES))
  keep_visible: bool = knob(False, help="Keep every visible token as it is: confidence "
                            "decoding token for token.")
  score_groups: int = knob(
      0, help="0: predictions at visible positions come from the denoiser's output there "
      "(meaningful for models trained to predict every position, e.g. with MLM random-token "
      "corruption; the exact oracles copy visible tokens); G > 0: from G leave-group-out "
      "contexts (positions i mod G = g masked) in one more batched call.", minimum=0)

  def __post_init__(self):
    super().__post_init__()
    check_steps(self.steps)
    check(self.score in scores.SCORES, "score", self.score, f"must be one of {scores.SCORES}")
    check(isinstance(self.score_groups, (int, np.integer)) and self.score_groups >= 0,
          "score_groups", self.score_groups, "must be an integer >= 0")


@struct.dataclass
class RevisionPlan(StepPlan):
  remaining: Array  # fraction of the editable positions left masked after this step


@register
class Revision(Family):
  name = "revision"
  spec_type = RevisionSpec
  rewrites = True  # visible tokens may change at any step

  def examples(self, generated):
    return [RevisionSpec(steps=5, score="margin"), RevisionSpec(steps=4, score_groups=2, top_k=3)]

  def plan(self, spec: RevisionSpec, canvas) -> RevisionPlan:
    j = np.arange(spec.steps)
    return RevisionPlan(t=1.0 - j / spec.steps,
                        remaining=scores.remaining_fractions(spec.count_schedule, spec.steps))

  def init(self, spec: RevisionSpec, core, ctx) -> Array:
    return jnp.zeros((spec.steps, core.tokens_BxL.shape[0]), jnp.int32)  # changes_KxB

  def extras(self, spec, changes_KxB) -> dict[str, Array]:
    return {"changes_KxB": changes_KxB}

  def update(self, spec: RevisionSpec, core, changes_KxB, ctx, step, logits_BxLxV, denoise):
    """Draws every editable position, keeps the n best, masks the rest."""
    mask_id, editable_BxL = ctx.mask_id, ctx.editable_BxL
    visible_BxL = editable_BxL & (core.tokens_BxL != mask_id)
    if spec.score_groups and not spec.keep_visible:
      # Skipped (a lax.cond) while no editable token is visible, e.g. at the first step.
      need = jnp.any(visible_BxL)
      regrouped = jax.lax.cond(
          need, lambda: contexts.leave_group_out_logits(denoise, core.tokens_BxL, visible_BxL,
                                                        spec.score_groups, mask_id),
          lambda: logits_BxLxV)
      logits_BxLxV = jnp.where(visible_BxL[..., None], regrouped, logits_BxLxV)
      core = core.count_call(need, spec.score_groups)
    values_BxL, _, conf_BxL, score_BxL = scores.propose(spec, step, logits_BxLxV)
    num_editable_B = editable_BxL.sum(-1)
    # Kept after this step: all but the scheduled remaining fraction (ConfidenceSpec's counts).
    keep_count_B = scores.commit_counts(num_editable_B, num_editable_B, step.plan.remaining)
    if spec.keep_visible:
      values_BxL = jnp.where(visible_BxL, core.tokens_BxL, values_BxL)
      conf_BxL = jnp.where(visible_BxL, core.write_conf_BxL, conf_BxL)
      score_BxL = jnp.where(visible_BxL, jnp.inf, score_BxL)
    keep_BxL = scores.select_top_k(score_BxL, editable_BxL, keep_count_B)
    changed_BxL = keep_BxL & visible_BxL & (values_BxL != core.tokens_BxL)
    written_BxL = keep_BxL & (~visible_BxL | changed_BxL)
    dropped_BxL = visible_BxL & ~keep_BxL
    core = core.commit(written_BxL, values_BxL, conf_BxL, step.index)
    core = core.replace(tokens_BxL=jnp.where(dropped_BxL, mask_id, core.tokens_BxL),
                        write_step_BxL=jnp.where(dropped_BxL, -1, core.write_step_BxL),
                        ).count(reopened_B=dropped_BxL.sum(-1))
    return core, changes_KxB.at[step.index].set(changed_BxL.sum(-1))
