"""Test-and-defer (PUNT-style): proposals that others would move stay masked."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.sampling import scores, skipping
from mdjax.sampling.base import (Family, SamplerSpec, StepPlan, check, check_steps,
                                 knob, register)

Array = jax.Array

# Float32 softmaxes of the same logits computed in two programs differ by ~1e-8 in total
# variation: a move smaller than this is rounding, not dependence.
TV_ROUNDING = 1e-6


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeferSpec(SamplerSpec):
  """Test-and-defer (PUNT-style): commit only proposals that the others do not move.

  Each step proposes a value for every masked position and ranks the proposals by
  `score`. The best is an anchor and always commits. The others are tested in dyadic
  groups: the proposals of rank r in [2^j, 2^(j+1)) are re-evaluated in context j, the
  canvas with the proposals of rank < 2^j written in, and a proposal whose distribution
  moved by more than `threshold` is deferred (left masked). All J = ceil(log2 L) test
  contexts go in one batched call, so a step costs 2 calls and 1 + J contexts. Proposals
  commit up to and including the first group with a deferral (those of it that did not
  move); later groups wait, since their test context held a deferred value. Not exact in
  general: members of one group are not tested against each other.
  """

  steps: int = knob(help="Denoiser steps; the last commits everything left.", minimum=1)
  threshold: float = knob(0.1, help="A proposal whose distribution moved by more than it in "
                          "total variation (plus 1e-6 of float rounding) is deferred.",
                          minimum=0.0, maximum=1.0)
  score: str = knob("max_prob", help="The score that ranks the proposals (scores.SCORES).",
                    choices=scores.SCORES)

  def __post_init__(self):
    super().__post_init__()
    check_steps(self.steps)
    check(0.0 <= self.threshold <= 1.0, "threshold", self.threshold,
          "must lie in [0, 1] (a total variation distance)")
    check(self.score in scores.SCORES, "score", self.score, f"must be one of {scores.SCORES}")


@struct.dataclass
class DeferPlan(StepPlan):
  last: Array  # the last step commits everything left


def num_levels(length: int) -> int:
  """J: dyadic groups [2^j, 2^(j+1)), j < J, cover every rank 1..L-1."""
  return max(1, math.ceil(math.log2(max(length, 2))))


def levels(rank_BxL: Array) -> Array:
  """Dyadic group of each rank: -1 for the anchor (rank 0), j for 2^j <= rank < 2^(j+1)."""
  return jnp.where(rank_BxL >= 1, jnp.floor(jnp.log2(jnp.maximum(rank_BxL, 1))), -1
                   ).astype(jnp.int32)


def total_variation(p_BxLxV: Array, q_BxLxV: Array) -> Array:
  return 0.5 * jnp.abs(p_BxLxV - q_BxLxV).sum(-1)


@register
class Defer(Family):
  name = "defer"
  spec_type = DeferSpec

  def examples(self, generated):
    return [DeferSpec(steps=4, threshold=0.1, temperature=0.8)]

  def plan(self, spec: DeferSpec, canvas) -> DeferPlan:
    j = np.arange(spec.steps)
    return DeferPlan(t=1.0 - j / spec.steps, last=j == spec.steps - 1)

  def update(self, spec: DeferSpec, core, aux, ctx, step, logits_BxLxV, denoise):
    """Proposes every masked position; commits the anchor and the proposals that did not move."""
    batch, length = core.tokens_BxL.shape
    num_j = num_levels(length)
    cand_BxL = ctx.masked(core.tokens_BxL)
    values_BxL, probs_BxLxV, conf_BxL, score_BxL = scores.propose(spec, step, logits_BxLxV)
    rank_BxL = scores.rank_descending(score_BxL, cand_BxL)
    level_BxL = levels(rank_BxL)

    def test_contexts():
      # Context j: the canvas with the proposals of rank < 2^j written in.
      prefix_JxBxL = cand_BxL[None] & (rank_BxL[None] < (2 ** jnp.arange(num_j))[:, None, None])
      contexts_JxBxL = jnp.where(prefix_JxBxL, values_BxL[None], core.tokens_BxL[None])
      logits_JxBxLxV = denoise(contexts_JxBxL.reshape(num_j * batch, length)).reshape(
          (num_j,) + logits_BxLxV.shape)
      probs_JxBxLxV = jax.nn.softmax(logits_JxBxLxV.astype(jnp.float32), axis=-1)
      # Each proposal is read in the context of its own group.
      chosen_BxLxV = jnp.take_along_axis(
          probs_JxBxLxV, jnp.clip(level_BxL, 0, num_j - 1)[None, ..., None], axis=0)[0]
      return total_variation(chosen_BxLxV, probs_BxLxV)

    # No test on the last step (everything commits) or when no row has two proposals.
    need = ~step.plan.last & jnp.any(cand_BxL.sum(-1) >= 2)
    tv_BxL = skipping.call_if(need, test_contexts, jnp.zeros((batch, length), jnp.float32))
    moved_BxL = cand_BxL & (level_BxL >= 0) & (tv_BxL > spec.threshold + TV_ROUNDING)
    first_fail_B = jnp.where(moved_BxL, level_BxL, num_j).min(-1)
    write_BxL = cand_BxL & ((level_BxL < first_fail_B[:, None])
                            | ((level_BxL == first_fail_B[:, None]) & ~moved_BxL))
    write_BxL = jnp.where(step.plan.last, cand_BxL, write_BxL)
    core = core.commit(write_BxL, values_BxL, conf_BxL, step.index)
    return core.count_call(need, num_j), None
