"""Dream's sampler (`DreamGenerationMixin._sample`): its time grid and its four algorithms."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.sampling import scores, transforms
from mdjax.sampling.base import (Family, SamplerSpec, StepPlan, check, check_steps, knob,
                                 register)
from mdjax.streams import StepStream

Array = jax.Array

ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DreamSpec(SamplerSpec):
  """Dream's sampler on its time grid t_i = linspace(1, eps, steps + 1) (float32).

  The values come from Dream's `sample_tokens`: logits / temperature (T > 0), then top-p
  (a value is kept while the mass sorted before it is at most top_p), then top-k, in that
  order; T = 0 takes the most likely value of these transformed probabilities, T > 0 draws
  from them. `alg`:
    origin: each masked position is revealed with probability 1 - t_(i+1) / t_i (1 at
      the last step), its value drawn as above;
    maskgit_plus, topk_margin, entropy: every masked position is proposed and scored on
      the TRANSFORMED probabilities (the proposal's probability, top-1 minus top-2, or
      sum p log(p + 1e-10)); the int(n (1 - t_(i+1) / t_i)) best commit (int(n) at the last
      step), n the BATCH MEAN of the rows' masked counts in float32 (Dream's rule, or
      `per_row_count`), the positions taken best first (or drawn, `alg_temp`).
  The counts are worked out on the host before the run (every step commits exactly its
  count) with Dream's float32 arithmetic, or in the program when the canvas is traced.
  min_p is not Dream's: it must stay 0.
  """

  steps: int = knob(help="Denoiser steps on Dream's grid.", minimum=1)
  eps: float = knob(1e-3, help="The time grid's last point: t_i = linspace(1, eps, steps + "
                    "1), in [0, 1).", minimum=0.0)
  alg: str = knob("origin", help="The algorithm that picks the revealed positions: origin "
                  "(random, by the grid), or the best by maskgit_plus (probability), "
                  "topk_margin (top-1 minus top-2) or entropy.", choices=ALGS)
  alg_temp: float | None = knob(None, help="> 0: draw the revealed positions without "
                                "replacement from softmax(score / alg_temp) (Gumbel-top-k) "
                                "instead of taking the best.", minimum=0.0)
  per_row_count: bool = knob(False, help="Each row commits by its own masked count instead "
                             "of the batch mean (Dream's rule).")

  def __post_init__(self):
    super().__post_init__()
    check_steps(self.steps)
    check(isinstance(self.eps, (int, float)) and not isinstance(self.eps, bool)
          and 0.0 <= self.eps < 1.0, "eps", self.eps, "must lie in [0, 1)")
    check(self.alg in ALGS, "alg", self.alg, f"must be one of {ALGS}")
    if self.alg_temp is not None:
      check(isinstance(self.alg_temp, (int, float)) and not isinstance(self.alg_temp, bool)
            and math.isfinite(self.alg_temp) and self.alg_temp >= 0.0, "alg_temp",
            self.alg_temp, "must be None or a finite number >= 0")
    check(isinstance(self.per_row_count, bool), "per_row_count", self.per_row_count,
          "must be True or False")
    check(self.min_p == 0.0, "min_p", self.min_p, "is not part of Dream's sampler: leave it 0")


@struct.dataclass
class DreamPlan(StepPlan):
  ratio: Array  # float32 1 - t_(i+1) / t_i, 1 at the last step: reveal probability, count rate
  count_B: Array  # int32 commits of each row (K x B), -1 where only the run can tell


def _fma32(a, b, c) -> np.float32:
  """a * b + c rounded once to float32 (a fused multiply-add; a and b float32, so the
  product is exact in float64)."""
  return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def timesteps(eps: float, steps: int) -> np.ndarray:
  """`torch.linspace(1, eps, steps + 1)` (float32) as torch's CPU kernel computes it: step
  (eps - 1) / steps, the first half start + step * i and the second end - step * (n-1-i),
  each a fused multiply-add."""
  n = steps + 1
  start, end = np.float32(1.0), np.float32(eps)
  step = np.float32((end - start) / np.float32(n - 1))
  return np.array([_fma32(step, np.float32(i), start) if i < n // 2
                   else _fma32(-step, np.float32(n - 1 - i), end) for i in range(n)], np.float32)


def ratios(eps: float, steps: int) -> np.ndarray:
  """Dream's 1 - s / t per step in float32, 1 at the last step."""
  t = timesteps(eps, steps)
  ratio = np.float32(1.0) - t[1:] / t[:-1]
  ratio[-1] = 1.0
  return ratio.astype(np.float32)


def counts(masked_B: np.ndarray, ratio_K: np.ndarray, per_row: bool) -> np.ndarray:
  """Commits per step and row (K x B, int32): int(n * ratio) with n the batch mean of the
  masked counts in float32 (`mask_index.sum() / B`), or each row's own count; a row
  commits at most what it has left."""
  left_B = np.asarray(masked_B, np.int64).copy()
  out = np.zeros((len(ratio_K), len(left_B)), np.int32)
  for i, ratio in enumerate(ratio_K):
    if per_row:
      n_B = left_B.astype(np.float32)
    else:
      n_B = np.full(left_B.shape, np.float32(left_B.sum()) / np.float32(len(left_B)), np.float32)
    k_B = np.floor(n_B * np.float32(ratio)).astype(np.int64)
    k_B = np.minimum(k_B, left_B)
    out[i] = k_B
    left_B -= k_B
  return out


def dream_logits(logits_BxLxV: Array, spec) -> Array:
  """Dream's `sample_tokens` transform: the EOS knobs, / T (T > 0), top-p, then top-k;
  -inf outside the kept values. Ties at a cut-off are all kept."""
  x = transforms.eos_logits(logits_BxLxV, spec.eos_id, spec.eos_penalty,
                            spec.eos_never).astype(jnp.float32)
  if spec.temperature > 0:
    x = x / spec.temperature
  if spec.top_p < 1.0:
    sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
    sorted_p = jax.nn.softmax(sorted_x, axis=-1)
    # Dream drops a sorted value when the cumulative mass BEFORE it exceeds top_p.
    mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    num_keep = jnp.maximum((mass_before <= spec.top_p).sum(-1, keepdims=True), 1)
    x = jnp.where(x < jnp.take_along_axis(sorted_x, num_keep - 1, axis=-1), -jnp.inf, x)
  if spec.top_k is not None and spec.top_k < x.shape[-1]:
    kth = jax.lax.top_k(x, spec.top_k)[0][..., -1:]
    x = jnp.where(x < kth, -jnp.inf, x)
  return x


def dream_score(alg: str, probs_BxLxV: Array, values_BxL: Array) -> Array:
  """`sample_tokens`' confidence on the transformed probabilities."""
  if alg == "topk_margin":
    top2 = jax.lax.top_k(probs_BxLxV, 2)[0]
    return top2[..., 0] - top2[..., 1]
  if alg == "entropy":
    return (probs_BxLxV * jnp.log(probs_BxLxV + 1e-10)).sum(-1)
  return jnp.take_along_axis(probs_BxLxV, values_BxL[..., None], axis=-1)[..., 0]


@register
class Dream(Family):
  name = "dream"
  spec_type = DreamSpec

  def examples(self, generated):
    return [DreamSpec(steps=5, temperature=0.7, top_p=0.9),
            DreamSpec(steps=4, alg="maskgit_plus", temperature=0.0, top_k=3),
            DreamSpec(steps=6, alg="entropy", alg_temp=0.5, temperature=0.5),
            DreamSpec(steps=3, alg="topk_margin", per_row_count=True)]

  def plan(self, spec: DreamSpec, canvas) -> DreamPlan:
    ratio_K = ratios(spec.eps, spec.steps)
    if canvas.tokens is None or spec.alg == "origin":
      count_KxB = np.full((spec.steps, canvas.batch), -1, np.int32)
    else:
      masked_B = ((canvas.tokens == canvas.mask_id) & ~canvas.fixed).sum(-1)
      count_KxB = counts(masked_B, ratio_K, spec.per_row_count)
    return DreamPlan(t=timesteps(spec.eps, spec.steps)[:-1], ratio=ratio_K, count_B=count_KxB)

  def idle_steps(self, spec: DreamSpec, canvas, plan: DreamPlan) -> float | None:
    """Counted algorithms: exactly the steps whose count is 0 in every row. origin: the
    expected steps after every row revealed everything (as the ancestral sampler)."""
    if canvas.tokens is None:
      return None
    if spec.alg != "origin":
      return float((plan.count_B <= 0).all(-1).sum())
    n_B = ((canvas.tokens == canvas.mask_id) & ~canvas.fixed).sum(-1)
    still_K = np.cumprod(1.0 - plan.ratio.astype(np.float64))
    done_K = np.concatenate([[0.0], 1.0 - still_K[:-1]])
    return float((done_K[None] ** n_B[:, None]).prod(0).sum())

  def needs_call(self, spec, core, aux, ctx, plan: DreamPlan) -> Array:
    masked_BxL = ctx.masked(core.tokens_BxL)
    if spec.alg == "origin":
      return jnp.any(masked_BxL)
    return jnp.any((_counts(spec, masked_BxL, plan) > 0) & masked_BxL.any(-1))

  def update(self, spec: DreamSpec, core, aux, ctx, step, logits_BxLxV, denoise):
    keys_B, plan, length = step.keys_B, step.plan, core.tokens_BxL.shape[1]
    masked_BxL = ctx.masked(core.tokens_BxL)
    x_BxLxV = dream_logits(logits_BxLxV, spec)
    probs_BxLxV = jax.nn.softmax(x_BxLxV, axis=-1)
    if spec.temperature == 0.0:
      values_BxL = transforms.argmax_last(probs_BxLxV)
    else:
      values_BxL = transforms.gumbel_max(keys_B, StepStream.VALUES, x_BxLxV, step.shift_B)
    _, conf_BxL = transforms.value_probs(logits_BxLxV, values_BxL)
    if spec.alg == "origin":
      u_BxL = transforms.row_uniform(keys_B, StepStream.REVEAL, (length,), step.shift_B)
      write_BxL = masked_BxL & (u_BxL < plan.ratio)
    else:
      score_BxL = scores.eos_last(dream_score(spec.alg, probs_BxLxV, values_BxL), values_BxL,
                                  spec)
      if spec.alg_temp:  # Gumbel-top-k: k draws without replacement from softmax(score / T)
        gumbel_BxL = transforms.row_gumbel(keys_B, StepStream.SELECT, (length,), step.shift_B)
        score_BxL = score_BxL / spec.alg_temp + gumbel_BxL.astype(score_BxL.dtype)
      write_BxL = scores.select_top_k(score_BxL, masked_BxL, _counts(spec, masked_BxL, plan))
    return core.commit(write_BxL, values_BxL, conf_BxL, step.index), aux


def _counts(spec: DreamSpec, masked_BxL: Array, plan: DreamPlan) -> Array:
  """This step's commits per row: the host's count, or Dream's rule on the current canvas
  where the canvas was traced (-1 in the plan)."""
  n_B = masked_BxL.sum(-1)
  if spec.per_row_count:
    n_B = n_B.astype(jnp.float32)
  else:
    n_B = jnp.broadcast_to(n_B.sum().astype(jnp.float32) / np.float32(n_B.shape[0]),
                           n_B.shape)
  in_run_B = jnp.floor(n_B * plan.ratio).astype(jnp.int32)
  return jnp.where(plan.count_B >= 0, plan.count_B, in_run_B)
