"""Confidence scores, proposals, ranking and rank-mask top-k selection, scheduled commit
counts."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.sampling import transforms
from mdjax.streams import StepStream

Array = jax.Array

# floor(N * ratio + COUNT_EPS): absorbs float rounding of N * ratio (N < 1e5).
COUNT_EPS = 1e-4

SCORES = ("prob", "max_prob", "margin", "neg_entropy", "random")


def confidence_score(name: str, probs_BxLxV: Array, values_BxL: Array,
                     keys_B: Array, shift_B: Array | None = None) -> Array:
  """Confidence of each proposal, read from the untransformed softmax.

  prob: p(proposal); max_prob: max_v p(v); margin: top-1 minus top-2
  probability; neg_entropy: sum_v p log p (0 log 0 = 0); random: U[0, 1) noise. Values
  ruled out (-inf logits, p = 0) make no NaN.
  """
  if name == "prob":
    return jnp.take_along_axis(probs_BxLxV, values_BxL[..., None], axis=-1)[..., 0]
  if name == "max_prob":
    return probs_BxLxV.max(-1)
  if name == "margin":
    top2 = jax.lax.top_k(probs_BxLxV, 2)[0]
    return top2[..., 0] - top2[..., 1]
  if name == "neg_entropy":
    # 0 log 0 = 0 without ever forming 0 * -inf (values ruled out at -inf have p = 0).
    safe_BxLxV = jnp.where(probs_BxLxV > 0, probs_BxLxV, 1.0)
    return (probs_BxLxV * jnp.log(safe_BxLxV)).sum(-1)
  if name == "random":
    noise_BxL = transforms.row_uniform(keys_B, StepStream.SCORE, values_BxL.shape[1:], shift_B)
    return noise_BxL.astype(probs_BxLxV.dtype)
  raise ValueError(f"score={name!r} is unknown; known scores: {SCORES}.")


def eos_last(score_BxL: Array, values_BxL: Array, spec) -> Array:
  """With `spec.eos_rank_last`, EOS proposals score below every other proposal (ties among
  them still go to the lower position); otherwise `score_BxL` unchanged."""
  if spec.eos_id is None or not spec.eos_rank_last:
    return score_BxL
  # Finite, so ranks among candidates stay 0..n-1 (non-candidates rank on +inf keys).
  lowest = jnp.finfo(score_BxL.dtype).min / 2
  return jnp.where(values_BxL == spec.eos_id, lowest, score_BxL)


class Proposal(NamedTuple):
  """A drawn value for every position and how it scores (`propose`)."""

  values_BxL: Array  # drawn with the spec's transform (temperature, top-k, EOS knobs, ...)
  probs_BxLxV: Array  # the untransformed softmax
  conf_BxL: Array  # each value's probability under it
  score_BxL: Array  # its confidence score (`spec.score`), EOS last with eos_rank_last


def propose(spec, step, logits_BxLxV: Array) -> Proposal:
  """Proposes a value for every position and scores it: the start of each step of the
  families that rank proposals by `spec.score` (write orders, test-and-defer, revision)."""
  values_BxL = transforms.draw_values(step.keys_B, logits_BxLxV, shift_B=step.shift_B,
                                      **spec.transform)
  probs_BxLxV, conf_BxL = transforms.value_probs(logits_BxLxV, values_BxL)
  score_BxL = confidence_score(spec.score, probs_BxLxV, values_BxL, step.keys_B, step.shift_B)
  return Proposal(values_BxL, probs_BxLxV, conf_BxL, eos_last(score_BxL, values_BxL, spec))


# Up to this length ranks come from pairwise compares (L^2 work, no sort: 4x faster than
# two argsorts at L = 25 on CPU); above it from one sort and a scatter (2x faster than two).
_PAIRWISE_RANK_MAX_L = 256


def rank_descending(score_BxL: Array, candidates_BxL: Array) -> Array:
  """Rank of each candidate by descending score, ties to the lower index.

  Non-candidates get rank L (never selected).
  """
  length = score_BxL.shape[-1]
  key_BxL = jnp.where(candidates_BxL, -score_BxL, jnp.inf)
  if length <= _PAIRWISE_RANK_MAX_L:
    index_L = jnp.arange(length)
    # Position j comes before i if its key is smaller, or equal and j < i.
    key_i, key_j = key_BxL[..., :, None], key_BxL[..., None, :]
    before_BxLxL = (key_j < key_i) | ((key_j == key_i) & (index_L[None, :] < index_L[:, None]))
    rank_BxL = before_BxLxL.sum(-1, dtype=jnp.int32)
  else:
    order_BxL = jnp.argsort(key_BxL, axis=-1, stable=True)
    rank_BxL = jax.vmap(lambda order_L: jnp.zeros(length, jnp.int32).at[order_L].set(
        jnp.arange(length, dtype=jnp.int32)))(order_BxL)
  return jnp.where(candidates_BxL, rank_BxL, length)


def select_top_k(score_BxL: Array, candidates_BxL: Array, k_B: Array) -> Array:
  """The k_B highest-scoring candidates of each row (a rank mask, no loops)."""
  return rank_descending(score_BxL, candidates_BxL) < k_B[:, None]


def remaining_fractions(count_schedule, steps: int) -> np.ndarray:
  """Fraction of the positions left masked after each of `steps` steps (0 after the last)."""
  j = np.arange(steps)
  remaining = np.asarray(count_schedule.one_minus_alpha(1.0 - (j + 1) / steps), np.float64)
  remaining[-1] = 0.0
  return remaining


def commit_counts(num_block_B: Array, num_masked_B: Array, remaining: Array) -> Array:
  """k_B = masked now - floor(N_block * remaining fraction), never negative."""
  target_B = jnp.floor(num_block_B * remaining + COUNT_EPS).astype(jnp.int32)
  return jnp.maximum(num_masked_B - target_B, 0)
