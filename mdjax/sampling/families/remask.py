"""ReMDM: the ancestral kernel with committed tokens returned to the mask."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax import diffusion
from mdjax.sampling import reveal, transforms
from mdjax.sampling.base import (Family, SamplerSpec, StepPlan, check, check_steps, knob,
                                 register)
from mdjax.streams import StepStream

Array = jax.Array
SIGMAS = ("cap", "rescale", "conf")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemaskSpec(SamplerSpec):
  """ReMDM: committed tokens may return to the mask with probability sigma_t.

  Masked positions are revealed with probability
  (alpha(s) - (1 - sigma) alpha(t)) / (1 - alpha(t)), which keeps the
  marginal schedule; sigma_max = min(1, (1-alpha_s)/alpha_t) bounds `sigma`'s
  schedules. eta = 0 reproduces AncestralSpec token for token.
  """

  steps: int = knob(help="Denoiser steps.", minimum=1)
  schedule: diffusion.Schedule = knob(diffusion.LinearSchedule(),
                                      help="The masking schedule alpha(t), by name.",
                                      choices=tuple(diffusion.SCHEDULES))
  grid: reveal.Grid = knob("uniform", help="The time grid t_0 = 1 > ... > t_K = 0, by name "
                           "(or, in Python, a tuple of times).", choices=reveal.GRIDS)
  sigma: str = knob("cap", help="The remasking schedule: cap min(eta, sigma_max); rescale "
                    "eta * sigma_max; conf sigma_max spread over committed tokens by "
                    "softmax(-confidence when written).", choices=SIGMAS)
  eta: float = knob(0.05, help="Remasking strength.", minimum=0.0, maximum=1.0)
  loop_t_on: float | None = knob(
      None, help="With loop_t_off (0 < loop_t_off < loop_t_on < 1): sigma is 0 outside "
      "[loop_t_off, loop_t_on] and alpha is held at alpha(loop_t_on) inside it (ReMDM-loop).",
      minimum=0.0, maximum=1.0)
  loop_t_off: float | None = knob(
      None, help="With loop_t_on: below it the schedule resumes, compressed onto [0, "
      "loop_t_off].", minimum=0.0, maximum=1.0)

  def __post_init__(self):
    super().__post_init__()
    check_steps(self.steps)
    check(self.sigma in SIGMAS, "sigma", self.sigma, f"must be one of {SIGMAS}")
    check(0.0 <= self.eta <= 1.0, "eta", self.eta, "must lie in [0, 1]")
    reveal.freeze_grid(self)
    if (self.loop_t_on is None) != (self.loop_t_off is None):
      raise ValueError(
          f"loop_t_on={self.loop_t_on!r} and loop_t_off={self.loop_t_off!r} must be "
          "given together.")
    if self.loop_t_on is not None:
      check(0.0 < self.loop_t_off < self.loop_t_on < 1.0, "loop_t_on",
            (self.loop_t_on, self.loop_t_off), "need 0 < loop_t_off < loop_t_on < 1")


@struct.dataclass
class RemaskPlan(StepPlan):
  reveal_p: Array  # the ancestral reveal probability of the interval
  oma_t: Array  # 1 - alpha(t)
  sigma: Array  # the scalar sigma (cap, rescale), or sigma_max (conf)


def _loop_time(t: np.ndarray, t_on: float, t_off: float) -> np.ndarray:
  """ReMDM-loop clock: held at t_on on [t_off, t_on], compressed below t_off."""
  return np.where(t >= t_on, t, np.where(t >= t_off, t_on, t * t_on / t_off))


@register
class Remask(Family):
  name = "remask"
  spec_type = RemaskSpec
  rewrites = True  # a full canvas still remasks

  def examples(self, generated):
    return [RemaskSpec(steps=10, eta=0.2), RemaskSpec(steps=10, sigma="conf", eta=1.0),
            RemaskSpec(steps=12, eta=0.3, loop_t_on=0.6, loop_t_off=0.2)]

  def plan(self, spec: RemaskSpec, canvas) -> RemaskPlan:
    times = reveal.time_grid(spec.grid, spec.steps)
    t_K, s_K = times[:-1], times[1:]
    sigma_on = np.ones_like(t_K, bool)
    if spec.loop_t_on is not None:
      sigma_on = (s_K >= spec.loop_t_off) & (t_K <= spec.loop_t_on)
      t_K = _loop_time(t_K, spec.loop_t_on, spec.loop_t_off)
      s_K = _loop_time(s_K, spec.loop_t_on, spec.loop_t_off)
    interval = reveal.intervals(spec.schedule, t_K, s_K)
    alpha_t = 1.0 - interval["oma_t"]
    with np.errstate(divide="ignore", invalid="ignore"):  # 0 / 0 where alpha_t = 0: not taken
      sigma_max = np.where(alpha_t > 0, np.minimum(1.0, interval["oma_s"] / alpha_t), 1.0)
    if spec.sigma == "cap":
      sigma = np.minimum(spec.eta, sigma_max)
    elif spec.sigma == "rescale":
      sigma = spec.eta * sigma_max
    else:  # conf: sigma_max, spread over committed tokens at run time
      sigma = sigma_max
    return RemaskPlan(t=t_K, reveal_p=interval["reveal_p"], oma_t=interval["oma_t"],
                      sigma=np.where(sigma_on, sigma, 0.0))

  def update(self, spec: RemaskSpec, core, aux, ctx, step, logits_BxLxV, denoise):
    """Remask committed tokens w.p. sigma; reveal masked ones so the marginal holds."""
    plan = step.plan
    length = core.tokens_BxL.shape[1]
    masked_BxL = ctx.masked(core.tokens_BxL)
    committed_BxL = (core.tokens_BxL != ctx.mask_id) & ctx.editable_BxL
    if spec.sigma == "conf":
      # Spread sigma_max by softmax(-confidence when written) over committed.
      logit_BxL = jnp.where(committed_BxL, -core.write_conf_BxL, -jnp.inf)
      share_BxL = jnp.where(committed_BxL, jax.nn.softmax(logit_BxL, axis=-1), 0.0)
      sigma_BxL = plan.sigma * share_BxL
    else:
      sigma_BxL = jnp.where(committed_BxL, plan.sigma, 0.0)
    num_committed_B = jnp.maximum(committed_BxL.sum(-1), 1)
    mean_sigma_B = sigma_BxL.sum(-1) / num_committed_B
    # (alpha_s - (1 - sigma) alpha_t) / (1 - alpha_t), which keeps the marginal.
    alpha_t = 1.0 - plan.oma_t
    reveal_p_B = jnp.broadcast_to(plan.reveal_p, core.tokens_BxL.shape[:1])
    reveal_p_B = jnp.minimum(1.0, reveal_p_B + mean_sigma_B * alpha_t / plan.oma_t)
    remask_u_BxL = transforms.row_uniform(step.keys_B, StepStream.REMASK, (length,),
                                         step.shift_B)
    remask_BxL = committed_BxL & (remask_u_BxL < sigma_BxL)
    core = reveal.reveal(spec, core, step, masked_BxL, logits_BxLxV, reveal_p_B)
    return core.replace(tokens_BxL=jnp.where(remask_BxL, ctx.mask_id, core.tokens_BxL)
                        ).count(reopened_B=remask_BxL.sum(-1)), None
