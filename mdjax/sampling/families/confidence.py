"""Confidence-ordered decoding (MaskGIT / LLaDA), optionally in blocks."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax import diffusion
from mdjax.sampling import semi_autoregressive, scores, transforms
from mdjax.sampling.base import (Family, SamplerSpec, StepPlan, check, check_block_length,
                                 check_steps, register)
from mdjax.streams import StepStream

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfidenceSpec(SamplerSpec):
  """Confidence-ordered decoding (MaskGIT / LLaDA).

  Each step proposes a value for every masked position, scores the proposals
  (`score` in scores.SCORES, read from the untransformed softmax) and
  commits the k_i best; the rest stay masked. After step i of K a fraction
  1 - alpha(1 - (i+1)/K) of the row's (block's) masked positions remains, for
  `count_schedule` alpha (linear; cosine is MaskGIT's). Ties go to the lower
  position. `gumbel_temperature` > 0 ranks by log(score) + c_i * Gumbel with
  c_i annealed linearly to 0 (MaskGIT's choice temperature). `threshold`
  instead commits every proposal scoring at least it (always at least one,
  everything at the last step), with `steps` as the bound.
  """

  steps: int
  score: str = "max_prob"
  count_schedule: diffusion.Schedule = diffusion.LinearSchedule()
  gumbel_temperature: float = 0.0
  threshold: float | None = None
  block_length: int | None = None

  def __post_init__(self):
    super().__post_init__()
    check_steps(self.steps)
    check_block_length(self.block_length)
    check(self.score in scores.SCORES, "score", self.score, f"must be one of {scores.SCORES}")
    check(self.gumbel_temperature >= 0.0, "gumbel_temperature", self.gumbel_temperature,
          "must be >= 0")
    if self.threshold is not None:
      # Scores are probabilities in [0, 1], except neg_entropy (sum p log p <= 0).
      low, high = (-math.inf, 0.0) if self.score == "neg_entropy" else (0.0, 1.0)
      check(isinstance(self.threshold, (int, float)) and low <= self.threshold <= high,
            "threshold", self.threshold, f"must be None or lie in [{low}, {high}] for "
            f"score={self.score!r}")


@struct.dataclass
class ConfidencePlan(StepPlan):
  block: Array  # the block this step works on
  block_start: Array  # first step of its block
  last_in_block: Array  # last step of its block (threshold mode commits the rest)
  remaining: Array  # fraction of the block left masked after this step
  choice_temperature: Array  # MaskGIT's Gumbel scale at this step


@struct.dataclass
class ConfidenceCarry:
  block_id_BxL: Array  # block of each editable position
  block_count_B: Array  # masked positions of the current block at its start


@register
class Confidence(Family):
  name = "confidence"
  spec_type = ConfidenceSpec
  decodes_blocks = True

  def block_length(self, spec) -> int | None:
    return spec.block_length

  def examples(self, generated):
    return [ConfidenceSpec(steps=5, score="prob", temperature=0.7, top_k=3),
            ConfidenceSpec(steps=4, score="margin", block_length=len(generated) // 2,
                           count_schedule=diffusion.CosineSchedule()),
            ConfidenceSpec(steps=8, score="neg_entropy", gumbel_temperature=2.0, top_p=0.8),
            ConfidenceSpec(steps=5, threshold=0.5, temperature=0.0)]

  def plan(self, spec: ConfidenceSpec, canvas) -> ConfidencePlan:
    num_blocks = semi_autoregressive.count(spec.block_length, spec.steps, canvas)
    per_block = spec.steps // num_blocks
    j = np.arange(per_block)
    tile = lambda x: np.tile(x, num_blocks)
    return ConfidencePlan(
        t=tile(1.0 - j / per_block), block=semi_autoregressive.step_blocks(num_blocks, per_block),
        block_start=tile(j == 0), last_in_block=tile(j == per_block - 1),
        remaining=tile(scores.remaining_fractions(spec.count_schedule, per_block)),
        choice_temperature=tile(spec.gumbel_temperature * (1.0 - (j + 1) / per_block)))

  def init(self, spec: ConfidenceSpec, core, ctx) -> ConfidenceCarry:
    block_id_BxL = semi_autoregressive.block_ids(ctx.editable_BxL, spec.block_length)
    return ConfidenceCarry(block_id_BxL=block_id_BxL,
                           block_count_B=jnp.zeros(core.tokens_BxL.shape[:1], jnp.int32))

  def idle_steps(self, spec: ConfidenceSpec, canvas, plan: ConfidencePlan) -> float | None:
    """With a count schedule, exactly the steps at which every row's count is 0."""
    n_BxN = semi_autoregressive.masked_counts(canvas, spec.block_length)
    if n_BxN is None or spec.threshold is not None:
      return None
    num_blocks = n_BxN.shape[1]
    remaining_NxJ = plan.remaining.reshape(num_blocks, -1).astype(np.float32)
    left_BxNxJ = np.floor(n_BxN[..., None] * remaining_NxJ + np.float32(scores.COUNT_EPS))
    before_BxNxJ = np.concatenate([n_BxN[..., None], left_BxNxJ[..., :-1]], axis=-1)
    return float((before_BxNxJ - left_BxNxJ <= 0).all(0).sum())

  def needs_call(self, spec, core, aux: ConfidenceCarry, ctx, plan) -> Array:
    """A step calls the denoiser when some row commits something: k_B > 0."""
    cand_BxL = semi_autoregressive.candidates(core.tokens_BxL, ctx, aux.block_id_BxL, plan.block)
    if spec.threshold is not None:  # commits at least one wherever a candidate is left
      return jnp.any(cand_BxL)
    return jnp.any(_scheduled_counts(cand_BxL, aux, plan)[0] > 0)

  def update(self, spec: ConfidenceSpec, core, aux: ConfidenceCarry, ctx, step, logits_BxLxV,
             denoise):
    """Proposes every masked position of the block, commits the k_B best by score."""
    plan, keys_B = step.plan, step.keys_B
    length = core.tokens_BxL.shape[1]
    cand_BxL = semi_autoregressive.candidates(core.tokens_BxL, ctx, aux.block_id_BxL, plan.block)
    k_B, block_count_B = _scheduled_counts(cand_BxL, aux, plan)
    values_BxL = transforms.draw_values(keys_B, logits_BxLxV, shift_B=step.shift_B,
                                        **spec.transform)
    probs_BxLxV, conf_BxL = transforms.value_probs(logits_BxLxV, values_BxL)
    score_BxL = scores.confidence_score(spec.score, probs_BxLxV, values_BxL, keys_B,
                                         step.shift_B)
    if spec.threshold is not None:
      above_B = (cand_BxL & (score_BxL >= spec.threshold)).sum(-1)
      k_B = jnp.where(plan.last_in_block, cand_BxL.sum(-1), jnp.maximum(above_B, 1))
    score_BxL = scores.eos_last(score_BxL, values_BxL, spec)
    rank_score_BxL = score_BxL
    if spec.gumbel_temperature > 0:
      gumbel_BxL = transforms.row_gumbel(keys_B, StepStream.SELECT, (length,), step.shift_B)
      log_score = (score_BxL if spec.score == "neg_entropy"
                   else jnp.log(jnp.maximum(score_BxL, 1e-30)))
      rank_score_BxL = scores.eos_last(log_score + plan.choice_temperature * gumbel_BxL,
                                       values_BxL, spec)
    write_BxL = scores.select_top_k(rank_score_BxL, cand_BxL, k_B)
    core = core.commit(write_BxL, values_BxL, conf_BxL, step.index)
    return core, aux.replace(block_count_B=block_count_B)


def _scheduled_counts(cand_BxL: Array, aux: ConfidenceCarry, plan: ConfidencePlan):
  """(k_B, block_count_B): this step's scheduled commits, and the block's masked count at
  its first step."""
  num_masked_B = cand_BxL.sum(-1)
  block_count_B = jnp.where(plan.block_start, num_masked_B, aux.block_count_B)
  return scores.commit_counts(block_count_B, num_masked_B, plan.remaining), block_count_B
