"""BD3-LM's sampler inside one block (kuleshov-group/bd3lms `Diffusion._semi_ar_sampler` and
`_ddpm_caching_update`): first hitting or its DDPM grid, and its nucleus filter.

Block by block generation is `sampling.sample_blocks` with this family as the block's
sampler (`mdjax.formats.bd3lm.bd3lm_sample`).
"""

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
class BD3LMSpec(SamplerSpec):
  """BD3-LM's update rule on one canvas (a block).

  Values come from the denoiser's categorical after the value transform, then BD3-LM's
  nucleus filter (`_nucleus_sample`, `nucleus_p`). With `first_hitting` (BD3-LM's default,
  after Zheng et al. 2025) each step reveals exactly one masked position per row, chosen
  uniformly among the masked ones: the next first-hitting event of the reverse process; the
  denoiser is told t_i = (N - i) / (N + 1), the expected hitting time with N masked
  positions (the reference's random t only reaches time-conditioned models). Otherwise
  BD3-LM's grid t_i = linspace(1, 0, steps)[i], s = t - 1 / steps: a masked position is
  revealed with probability 1 - s / t. The reference's last step (t = 0) divides by zero;
  here it reveals everything left (s = 0).
  """

  steps: int | None = knob(None, help="The steps' bound; with first_hitting at least the "
                           "masked positions of a row (None: the canvas length), the steps "
                           "after a row is full idle and skipped.", minimum=1)
  first_hitting: bool = knob(True, help="Each step reveals exactly one masked position per "
                             "row (the next first-hitting event); False: BD3-LM's DDPM grid.")
  nucleus_p: float = knob(1.0, help="BD3-LM's nucleus filter: the values sorted by "
                          "probability are kept while the cumulative mass including each one "
                          "is at most it (the first always), then renormalised (1.0: no "
                          "filter).", minimum=0.0, maximum=1.0)
  cache: bool = knob(True, help="Reuse the last logits while the canvas did not change (the "
                     "reference's p_x0 cache).")

  def __post_init__(self):
    super().__post_init__()
    if self.steps is not None:
      check_steps(self.steps)
    for name in ("first_hitting", "cache"):
      check(isinstance(getattr(self, name), bool), name, getattr(self, name),
            "must be True or False")
    check(isinstance(self.nucleus_p, (int, float)) and not isinstance(self.nucleus_p, bool)
          and 0.0 < self.nucleus_p <= 1.0, "nucleus_p", self.nucleus_p, "must lie in (0, 1]")


@struct.dataclass
class BD3LMPlan(StepPlan):
  reveal_p: Array  # DDPM grid: 1 - s / t (1 at the last step); first hitting: unused


def nucleus_logits(x_BxLxV: Array, nucleus_p: float) -> Array:
  """BD3-LM's `_nucleus_sample` as logits: -inf outside the kept values. Sorted by
  probability, a value is kept while the cumulative mass including it is <= p (the first
  always). Ties at the cut are all kept."""
  if nucleus_p >= 1.0:
    return x_BxLxV
  sorted_x = jnp.sort(x_BxLxV, axis=-1)[..., ::-1]
  mass_through = jnp.cumsum(jax.nn.softmax(sorted_x, axis=-1), axis=-1)
  num_keep = jnp.maximum((mass_through <= nucleus_p).sum(-1, keepdims=True), 1)
  cut = jnp.take_along_axis(sorted_x, num_keep - 1, axis=-1)
  return jnp.where(x_BxLxV < cut, -jnp.inf, x_BxLxV)


def value_logits(logits_BxLxV: Array, spec) -> Array:
  """The log-weights values are drawn from: the value transform, then the nucleus."""
  x = transforms.eos_logits(logits_BxLxV, spec.eos_id, spec.eos_penalty, spec.eos_never)
  x = transforms.transform_logits(x, spec.temperature, spec.top_k, spec.top_p, spec.min_p)
  return nucleus_logits(x, spec.nucleus_p)


def ddpm_grid(steps: int) -> tuple[np.ndarray, np.ndarray]:
  """(t_K, reveal_p_K) of BD3-LM's grid: t = linspace(1, 0, K), s = t - 1/K, 1 - s/t (1
  where t = 0)."""
  t_K = np.linspace(1.0, 0.0, steps)
  s_K = np.maximum(t_K - 1.0 / steps, 0.0)
  safe_t = np.where(t_K > 0, t_K, 1.0)
  return t_K, np.where(t_K > 0, 1.0 - s_K / safe_t, 1.0)


def _masked_counts(canvas) -> np.ndarray | None:
  if canvas.tokens is None:
    return None
  return ((canvas.tokens == canvas.mask_id) & ~canvas.fixed).sum(-1)


@register
class BD3LM(Family):
  name = "bd3lm"
  spec_type = BD3LMSpec

  def bench_spec(self, steps: int, length: int) -> BD3LMSpec:
    return BD3LMSpec(steps=steps, first_hitting=steps >= length)

  def examples(self, generated):
    # One example: the contract suite compiles every example several times (the DDPM grid
    # is tested in tests/formats/test_dit_samplers.py).
    return [BD3LMSpec(nucleus_p=0.9)]

  def num_steps(self, spec: BD3LMSpec, length: int) -> int:
    return length if spec.steps is None else spec.steps

  def validate(self, spec: BD3LMSpec, canvas):
    n_B = _masked_counts(canvas)
    if spec.first_hitting and n_B is not None and spec.steps is not None:
      check(spec.steps >= n_B.max(initial=0), "steps", spec.steps,
            f"first_hitting reveals one position per step: steps must be at least the "
            f"{int(n_B.max())} masked positions of a row (or None)")

  def plan(self, spec: BD3LMSpec, canvas) -> BD3LMPlan:
    steps = self.num_steps(spec, canvas.length)
    if not spec.first_hitting:
      t_K, reveal_p = ddpm_grid(steps)
      return BD3LMPlan(t=t_K.astype(np.float32), reveal_p=reveal_p.astype(np.float32))
    n_B = _masked_counts(canvas)
    n = canvas.length if n_B is None else int(n_B.max(initial=0))
    t_K = np.maximum(n - np.arange(steps), 0) / (n + 1)
    return BD3LMPlan(t=t_K.astype(np.float32), reveal_p=np.ones(steps, np.float32))

  def idle_steps(self, spec: BD3LMSpec, canvas, plan: BD3LMPlan) -> float | None:
    """First hitting: exactly the steps after the fullest row is full. Grid: expected, as
    the ancestral sampler's."""
    n_B = _masked_counts(canvas)
    if n_B is None:
      return None
    steps = len(plan.t)
    if spec.first_hitting:
      return float(max(steps - int(n_B.max(initial=0)), 0))
    still_K = np.cumprod(1.0 - plan.reveal_p.astype(np.float64))
    done_K = np.concatenate([[0.0], 1.0 - still_K[:-1]])
    return float((done_K[None] ** n_B[:, None]).prod(0).sum())

  def reuses_logits(self, spec: BD3LMSpec) -> bool:
    # First hitting changes the canvas at every step that calls: nothing to reuse.
    return spec.cache and not spec.first_hitting

  def update(self, spec: BD3LMSpec, core, aux, ctx, step, logits_BxLxV, denoise):
    keys_B, length = step.keys_B, core.tokens_BxL.shape[1]
    masked_BxL = ctx.masked(core.tokens_BxL)
    if spec.temperature == 0.0:
      values_BxL = transforms.argmax_last(transforms.eos_logits(
          logits_BxLxV, spec.eos_id, spec.eos_penalty, spec.eos_never))
    else:
      # Inverse CDF, as MDLM's: one uniform per position instead of one Gumbel per value.
      values_BxL = transforms.inverse_cdf(keys_B, StepStream.VALUES,
                                          value_logits(logits_BxLxV, spec), step.shift_B)
    _, conf_BxL = transforms.value_probs(logits_BxLxV, values_BxL)
    u_BxL = transforms.row_uniform(keys_B, StepStream.REVEAL, (length,), step.shift_B)
    if spec.first_hitting:
      # One masked position per row, uniformly: the largest uniform among the masked.
      pick_B = jnp.argmax(jnp.where(masked_BxL, u_BxL, -1.0), axis=-1)
      write_BxL = masked_BxL & (jnp.arange(length) == pick_B[:, None])
    else:
      write_BxL = masked_BxL & (u_BxL < step.plan.reveal_p)
    return core.commit(write_BxL, values_BxL, conf_BxL, step.index), aux
