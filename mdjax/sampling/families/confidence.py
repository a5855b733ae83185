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
                                 check_steps, knob, register)
from mdjax.streams import StepStream

Array = jax.Array


COUNT_RULES = ("schedule", "even", "even_block")
THRESHOLD_FLOORS = ("one", "count")
ORDERS = ("score", "position")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfidenceSpec(SamplerSpec):
  """Confidence-ordered decoding (MaskGIT / LLaDA).

  Each step proposes a value for every masked position, scores the proposals (`score`)
  and commits the k_i best; the rest stay masked. After step i of K a fraction
  1 - alpha(1 - (i+1)/K) of the row's (block's) masked positions remains, for
  `count_schedule` alpha. Ties go to the lower position. `threshold` or `factor` instead
  commit by the scores, with `steps` as the bound; `count_rule`, `threshold_floor` and
  `order` give LLaDA's, Fast-dLLM's and SDAR's variants (each knob's help).
  `banned_ids`: these ids' logits are -inf before the step reads them (draw and score).
  `score_excluded_ids`: these ids' logits are -inf only in the softmax the score reads, not
  in the draw: a proposal of one scores 0 and the other proposals' probabilities are
  renormalised without them (what LLaDA's code does for `confidence_eos_eot_inf`).
  """

  steps: int = knob(help="Denoiser steps (with block_length: over all blocks; with a "
                    "threshold or factor: the bound).", minimum=1)
  score: str = knob("max_prob", help="The confidence score of a proposal (scores.SCORES), "
                    "read from the untransformed softmax.", choices=scores.SCORES)
  count_schedule: diffusion.Schedule = knob(
      diffusion.LinearSchedule(), help="The schedule alpha whose 1 - alpha(1 - (i+1)/K) "
      "leaves the fraction still masked after step i (cosine is MaskGIT's).",
      choices=tuple(diffusion.SCHEDULES))
  gumbel_temperature: float = knob(
      0.0, help="> 0 ranks by log(score) + c_i * Gumbel with c_i annealed linearly to 0 "
      "(MaskGIT's choice temperature).", minimum=0.0)
  threshold: float | None = knob(
      None, help="Commit every proposal scoring at least it (always at least one, everything "
      "at the last step of a block), steps the bound; in [0, 1], or <= 0 for neg_entropy.")
  block_length: int | None = knob(None, help="Decode semi-autoregressively in blocks of this "
                                  "many positions.", minimum=1)
  count_rule: str = knob(
      "schedule", help="'even': LLaDA's get_num_transfer_tokens, the N masked positions of "
      "the block at its first step spread over its S steps as N // S each, the remainder one "
      "more each on the FIRST steps; 'even_block': the block's P positions (block_length, or "
      "the canvas without blocks; written ones counted too) as P // S a step, the remainder on "
      "the first steps, each capped at the positions still masked (SDAR's "
      "get_num_transfer_tokens(block_length, steps)); 'schedule': count_schedule's counts.",
      choices=COUNT_RULES)
  factor: float | None = knob(
      None, help="Fast-dLLM's dynamic threshold (get_transfer_index_dynamic, factor_counts): "
      "with the block's n proposals ranked by score, the first rank i >= 1 scoring below "
      "1 - factor / (i + 2) stops the commits at i, but a stop at the last rank n - 1, or "
      "none, commits all n; everything at the last step of a block, steps the bound.",
      minimum=0.0)
  banned_ids: tuple[int, ...] = ()
  score_excluded_ids: tuple[int, ...] = ()
  threshold_floor: str = knob(
      "one", help="The least a threshold step commits: 'one' (Fast-dLLM's) every proposal "
      "scoring at least threshold, at least one; 'count' at least the step's scheduled count "
      "(count_rule's), more when more proposals score at least the threshold (SDAR's "
      "low_confidence_dynamic). Either way the last step of a block commits the rest.",
      choices=THRESHOLD_FLOORS)
  order: str = knob("score", help="Which k positions a step commits: 'score' the k best "
                    "scoring, 'position' the k leftmost masked (SDAR's sequential).",
                    choices=ORDERS)
  score_transformed: bool = knob(
      False, help="The score reads the distribution values are drawn from (the EOS knobs, "
      "temperature, top-k, top-p: transforms.transformed_probs) rather than the untransformed "
      "softmax (SDAR's x0_p); at temperature 0, where nothing is drawn, the untransformed "
      "one.")

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
    check(self.count_rule in COUNT_RULES, "count_rule", self.count_rule,
          f"must be one of {COUNT_RULES}")
    if self.factor is not None:
      check(isinstance(self.factor, (int, float)) and not isinstance(self.factor, bool)
            and math.isfinite(self.factor) and self.factor > 0, "factor", self.factor,
            "must be None or a finite number > 0")
      check(self.threshold is None, "factor", self.factor,
            "and threshold are two rules for one thing: set one")
    for name in ("banned_ids", "score_excluded_ids"):
      ids = getattr(self, name)
      if not isinstance(ids, tuple):  # lists become tuples: specs are hashed
        ids = tuple(ids) if isinstance(ids, (list, np.ndarray)) else ids
        object.__setattr__(self, name, ids)
      check(isinstance(ids, tuple) and all(isinstance(i, (int, np.integer))
                                           and not isinstance(i, bool) and i >= 0 for i in ids),
            name, ids, "must be a tuple of token ids >= 0")
      object.__setattr__(self, name, tuple(int(i) for i in ids))
    check(self.threshold_floor in THRESHOLD_FLOORS, "threshold_floor", self.threshold_floor,
          f"must be one of {THRESHOLD_FLOORS}")
    check(self.order in ORDERS, "order", self.order, f"must be one of {ORDERS}")
    if self.order == "position":
      check(not self.adaptive and self.gumbel_temperature == 0.0 and not self.eos_rank_last,
            "order", self.order, "commits the scheduled count leftmost first: it takes no "
            "threshold, factor, gumbel_temperature or eos_rank_last")
    check(isinstance(self.score_transformed, bool), "score_transformed", self.score_transformed,
          "must be True or False")
    if self.score_transformed:
      check(not self.score_excluded_ids, "score_transformed", self.score_transformed,
            "with score_excluded_ids: set one (both say which softmax the score reads)")

  @property
  def adaptive(self) -> bool:
    """Commits decided by the scores (threshold or factor), `steps` only the bound."""
    return self.threshold is not None or self.factor is not None


@struct.dataclass
class ConfidencePlan(StepPlan):
  block: Array  # the block this step works on
  block_start: Array  # first step of its block
  last_in_block: Array  # last step of its block (threshold mode commits the rest)
  remaining: Array  # fraction of the block left masked after this step
  choice_temperature: Array  # MaskGIT's Gumbel scale at this step
  block_step: Array  # this step's index j within its block
  block_steps: Array  # S, the steps of each block


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
        choice_temperature=tile(spec.gumbel_temperature * (1.0 - (j + 1) / per_block)),
        block_step=tile(j.astype(np.int32)), block_steps=tile(np.full(per_block, per_block,
                                                                      np.int32)))

  def init(self, spec: ConfidenceSpec, core, ctx) -> ConfidenceCarry:
    block_id_BxL = semi_autoregressive.block_ids(ctx.editable_BxL, spec.block_length)
    return ConfidenceCarry(block_id_BxL=block_id_BxL,
                           block_count_B=jnp.zeros(core.tokens_BxL.shape[:1], jnp.int32))

  def idle_steps(self, spec: ConfidenceSpec, canvas, plan: ConfidencePlan) -> float | None:
    """With a count schedule, exactly the steps at which every row's count is 0."""
    n_BxN = semi_autoregressive.masked_counts(canvas, spec.block_length)
    if n_BxN is None or spec.adaptive:
      return None
    num_blocks = n_BxN.shape[1]
    if spec.count_rule == "even":
      j_J, per_block = plan.block_step[:plan.block_steps[0]], int(plan.block_steps[0])
      k_BxNxJ = n_BxN[..., None] // per_block + (j_J < n_BxN[..., None] % per_block)
      return float((k_BxNxJ <= 0).all(0).sum())
    if spec.count_rule == "even_block":  # the scheduled counts, capped at what is left
      per_block = int(plan.block_steps[0])
      scheduled_J = _even_block_count(spec, canvas.length, np.arange(per_block), per_block)
      before_J = np.concatenate([[0], np.cumsum(scheduled_J)[:-1]])
      left_BxNxJ = np.maximum(n_BxN[..., None] - before_J, 0)
      return float((np.minimum(scheduled_J, left_BxNxJ) <= 0).all(0).sum())
    remaining_NxJ = plan.remaining.reshape(num_blocks, -1).astype(np.float32)
    left_BxNxJ = np.floor(n_BxN[..., None] * remaining_NxJ + np.float32(scores.COUNT_EPS))
    before_BxNxJ = np.concatenate([n_BxN[..., None], left_BxNxJ[..., :-1]], axis=-1)
    return float((before_BxNxJ - left_BxNxJ <= 0).all(0).sum())

  def needs_call(self, spec, core, aux: ConfidenceCarry, ctx, plan) -> Array:
    """A step calls the denoiser when some row commits something: k_B > 0."""
    cand_BxL = semi_autoregressive.candidates(core.tokens_BxL, ctx, aux.block_id_BxL, plan.block)
    if spec.adaptive:  # commits at least one wherever a candidate is left
      return jnp.any(cand_BxL)
    return jnp.any(_scheduled_counts(spec, cand_BxL, aux, plan)[0] > 0)

  def update(self, spec: ConfidenceSpec, core, aux: ConfidenceCarry, ctx, step, logits_BxLxV,
             denoise):
    """Proposes every masked position of the block, commits the k_B best by score."""
    plan, keys_B = step.plan, step.keys_B
    length = core.tokens_BxL.shape[1]
    cand_BxL = semi_autoregressive.candidates(core.tokens_BxL, ctx, aux.block_id_BxL, plan.block)
    k_B, block_count_B = _scheduled_counts(spec, cand_BxL, aux, plan)
    logits_BxLxV = _without(logits_BxLxV, spec.banned_ids)
    values_BxL = transforms.draw_values(keys_B, logits_BxLxV, shift_B=step.shift_B,
                                        **spec.transform)
    probs_BxLxV, conf_BxL = transforms.value_probs(logits_BxLxV, values_BxL)
    if spec.score_excluded_ids:
      probs_BxLxV = jax.nn.softmax(
          _without(logits_BxLxV, spec.score_excluded_ids).astype(jnp.float32), axis=-1)
    if spec.score_transformed and spec.temperature > 0:
      probs_BxLxV = transforms.transformed_probs(logits_BxLxV, spec).astype(jnp.float32)
    score_BxL = scores.confidence_score(spec.score, probs_BxLxV, values_BxL, keys_B,
                                         step.shift_B)
    if spec.threshold is not None:
      above_B = (cand_BxL & (score_BxL >= spec.threshold)).sum(-1)
      floor_B = jnp.ones_like(k_B) if spec.threshold_floor == "one" else k_B
      k_B = jnp.where(plan.last_in_block, cand_BxL.sum(-1), jnp.maximum(above_B, floor_B))
    score_BxL = scores.eos_last(score_BxL, values_BxL, spec)
    if spec.factor is not None:
      k_B = jnp.where(plan.last_in_block, cand_BxL.sum(-1),
                      factor_counts(score_BxL, cand_BxL, spec.factor))
    rank_score_BxL = score_BxL
    if spec.gumbel_temperature > 0:
      gumbel_BxL = transforms.row_gumbel(keys_B, StepStream.SELECT, (length,), step.shift_B)
      log_score = (score_BxL if spec.score == "neg_entropy"
                   else jnp.log(jnp.maximum(score_BxL, 1e-30)))
      rank_score_BxL = scores.eos_last(log_score + plan.choice_temperature * gumbel_BxL,
                                       values_BxL, spec)
    if spec.order == "position":  # equal scores: the top k are the leftmost k
      rank_score_BxL = jnp.zeros_like(score_BxL)
    write_BxL = scores.select_top_k(rank_score_BxL, cand_BxL, k_B)
    core = core.commit(write_BxL, values_BxL, conf_BxL, step.index)
    return core, aux.replace(block_count_B=block_count_B)


def _scheduled_counts(spec: ConfidenceSpec, cand_BxL: Array, aux: ConfidenceCarry,
                      plan: ConfidencePlan):
  """(k_B, block_count_B): this step's scheduled commits, and the block's masked count at
  its first step."""
  num_masked_B = cand_BxL.sum(-1)
  block_count_B = jnp.where(plan.block_start, num_masked_B, aux.block_count_B)
  if spec.count_rule == "even_block":
    scheduled = _even_block_count(spec, cand_BxL.shape[-1], plan.block_step, plan.block_steps)
    return jnp.minimum(scheduled.astype(jnp.int32), num_masked_B), block_count_B
  if spec.count_rule == "even":
    k_B = (block_count_B // plan.block_steps
           + (plan.block_step < block_count_B % plan.block_steps).astype(jnp.int32))
    return jnp.minimum(k_B, num_masked_B), block_count_B
  return scores.commit_counts(block_count_B, num_masked_B, plan.remaining), block_count_B


def _even_block_count(spec: ConfidenceSpec, canvas_length: int, step_j, steps_s):
  """count_rule="even_block"'s scheduled count at step j of a block of S steps (numpy or
  traced): the block's P positions as P // S each, the remainder one more each on the first
  steps."""
  positions = spec.block_length or canvas_length
  return positions // steps_s + (step_j < positions % steps_s)


def _without(logits_BxLxV: Array, ids: tuple[int, ...]) -> Array:
  """The logits with these ids' columns at -inf (unchanged without ids)."""
  if not ids:
    return logits_BxLxV
  return logits_BxLxV.at[..., np.asarray(ids)].set(-jnp.inf)


def factor_counts(score_BxL: Array, cand_BxL: Array, factor: float) -> Array:
  """Fast-dLLM's `get_transfer_index_dynamic` count: with the n candidates ranked by score
  (rank i, 0 first), the first rank i in [1, n - 2] whose score is below 1 - factor/(i + 2),
  else n. (The reference loops to the first failing rank and adds one when it stopped at
  rank 0 or n - 1: rank 0 never fails, its threshold being -1, and a stop at n - 1 commits
  all n.) 0 for a row without candidates."""
  length = score_BxL.shape[-1]
  n_B = cand_BxL.sum(-1)
  rank_BxL = scores.rank_descending(score_BxL, cand_BxL)
  rank_f = rank_BxL.astype(jnp.float32)
  below_BxL = score_BxL < 1.0 - factor / (rank_f + 2.0)
  stop_BxL = cand_BxL & (rank_BxL >= 1) & (rank_BxL <= n_B[:, None] - 2) & below_BxL
  return jnp.minimum(jnp.min(jnp.where(stop_BxL, rank_BxL, length), -1), n_B).astype(jnp.int32)
