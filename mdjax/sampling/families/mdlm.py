"""MDLM's `ddpm_cache` sampler (kuleshov-group/mdlm `Diffusion._sample`): its grid, its
reverse kernel, its call cache and its final noise removal."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.sampling import transforms
from mdjax.sampling.base import (Family, SamplerSpec, StepPlan, check, check_steps, knob,
                                 register)
from mdjax.streams import StepStream

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class MDLMSpec(SamplerSpec):
  """MDLM's sampler on the grid t_i = linspace(1, eps, steps + 1).

  Step i (t = t_i, s = t_(i+1)) is `_ddpm_caching_update`: q(x_s | x_t) puts mass s on
  the mask and (t - s) p_x0 on the values, so each masked position is revealed with
  probability 1 - s / t, its value drawn from the denoiser's categorical; visible
  positions are copied. The canvas is always full at the end.
  """

  steps: int = knob(help="Denoiser steps on MDLM's grid.", minimum=1)
  eps: float = knob(1e-5, help="The time grid's last point: t_i = linspace(1, eps, steps + "
                    "1), in (0, 1).", minimum=0.0, maximum=1.0)
  cache: bool = knob(True, help="A step whose canvas did not change since the last call "
                     "reuses that call's logits (MDLM's p_x0 cache; valid only for a denoiser "
                     "that ignores t, as MDLM turns it off with time conditioning); the saved "
                     "calls are counted.")
  noise_removal: bool = knob(True, help="One more step at t = eps writes every position still "
                             "masked with the denoiser's argmax (MDLM's noise_removal); without "
                             "it the last interval ends at 0 (everything left is drawn).")

  def __post_init__(self):
    super().__post_init__()
    check_steps(self.steps)
    check(isinstance(self.eps, (int, float)) and not isinstance(self.eps, bool)
          and 0.0 < self.eps < 1.0, "eps", self.eps, "must lie in (0, 1)")
    for name in ("cache", "noise_removal"):
      check(isinstance(getattr(self, name), bool), name, getattr(self, name),
            "must be True or False")


@struct.dataclass
class MDLMPlan(StepPlan):
  reveal_p: Array  # 1 - s / t: a masked position is revealed (1 at the last step)
  final: Array  # the noise-removal step: values are the argmax


def grid(steps: int, eps: float) -> np.ndarray:
  """MDLM's timesteps linspace(1, eps, steps + 1) (float64)."""
  return np.linspace(1.0, eps, steps + 1)


@register
class MDLM(Family):
  name = "mdlm"
  spec_type = MDLMSpec

  def examples(self, generated):
    # One example: the contract suite compiles every example several times (the knobs
    # without noise removal and cache are tested in tests/formats/test_dit_samplers.py).
    return [MDLMSpec(steps=6, eps=0.3)]

  def num_steps(self, spec: MDLMSpec, length: int) -> int:
    return spec.steps + int(spec.noise_removal)

  def plan(self, spec: MDLMSpec, canvas) -> MDLMPlan:
    times = grid(spec.steps, spec.eps)
    t_K, s_K = times[:-1], times[1:].copy()
    if not spec.noise_removal:
      s_K[-1] = 0.0
    reveal_p = 1.0 - s_K / t_K
    final = np.zeros(spec.steps, bool)
    if spec.noise_removal:
      t_K, reveal_p = np.append(t_K, spec.eps), np.append(reveal_p, 1.0)
      final = np.append(final, True)
    return MDLMPlan(t=t_K.astype(np.float32), reveal_p=reveal_p.astype(np.float32),
                    final=final)

  def idle_steps(self, spec: MDLMSpec, canvas, plan: MDLMPlan) -> float | None:
    """Expected steps after every row revealed everything (as the ancestral sampler)."""
    if canvas.tokens is None:
      return None
    n_B = ((canvas.tokens == canvas.mask_id) & ~canvas.fixed).sum(-1)
    still_K = np.cumprod(1.0 - plan.reveal_p.astype(np.float64))
    done_K = np.concatenate([[0.0], 1.0 - still_K[:-1]])
    return float((done_K[None] ** n_B[:, None]).prod(0).sum())

  def reuses_logits(self, spec: MDLMSpec) -> bool:
    return spec.cache

  def update(self, spec: MDLMSpec, core, aux, ctx, step, logits_BxLxV, denoise):
    length = core.tokens_BxL.shape[1]
    masked_BxL = ctx.masked(core.tokens_BxL)
    # Inverse CDF: one uniform per position; Gumbel-max's B x L x V variates cost more than
    # the forward pass of a small DiT.
    values_BxL = transforms.draw_values(step.keys_B, logits_BxLxV, shift_B=step.shift_B,
                                        draw=transforms.inverse_cdf, **spec.transform)
    if spec.noise_removal:
      best_BxL = transforms.argmax_last(transforms.eos_logits(
          logits_BxLxV, spec.eos_id, spec.eos_penalty, spec.eos_never))
      values_BxL = jnp.where(step.plan.final, best_BxL, values_BxL)
    _, conf_BxL = transforms.value_probs(logits_BxLxV, values_BxL)
    u_BxL = transforms.row_uniform(step.keys_B, StepStream.REVEAL, (length,), step.shift_B)
    write_BxL = masked_BxL & (u_BxL < step.plan.reveal_p)
    return core.commit(write_BxL, values_BxL, conf_BxL, step.index), aux
