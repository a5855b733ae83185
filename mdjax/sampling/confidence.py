"""Confidence-ordered decoding (MaskGIT / LLaDA), optionally in blocks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.sampling import specs as specs_lib
from mdjax.sampling import transforms
from mdjax.sampling.state import Context, State, candidates, commit, value_probs

Array = jax.Array

# floor(N * ratio + _COUNT_EPS): absorbs float rounding of N * ratio (N < 1e5).
_COUNT_EPS = 1e-4


def plan(spec: specs_lib.ConfidenceSpec, num_blocks: int) -> dict[str, np.ndarray]:
  """Per-step arrays: the fraction of the block left masked after each step."""
  per_block = spec.steps // num_blocks
  j = np.arange(per_block)
  remaining = np.asarray(spec.count_schedule.one_minus_alpha(1.0 - (j + 1) / per_block),
                         np.float64)
  remaining[-1] = 0.0
  return {
      "t": np.tile(1.0 - j / per_block, num_blocks),
      "block": np.repeat(np.arange(num_blocks), per_block),
      "block_start": np.tile(j == 0, num_blocks),
      "last_in_block": np.tile(j == per_block - 1, num_blocks),
      "remaining": np.tile(remaining, num_blocks),
      "choice_temperature": np.tile(spec.gumbel_temperature * (1.0 - (j + 1) / per_block),
                                    num_blocks),
  }


def commit_counts(num_block_B: Array, num_masked_B: Array, remaining: Array) -> Array:
  """k_B = masked now - floor(N_block * remaining fraction), never negative."""
  target_B = jnp.floor(num_block_B * remaining + _COUNT_EPS).astype(jnp.int32)
  return jnp.maximum(num_masked_B - target_B, 0)


def update(spec: specs_lib.ConfidenceSpec, state: State, ctx: Context, xs,
           logits_BxLxV: Array, keys_B: Array) -> State:
  """Proposes every masked position, commits the k_B best by score."""
  length = state.tokens_BxL.shape[1]
  cand_BxL = candidates(state, ctx, xs["block"])
  num_masked_B = cand_BxL.sum(-1)
  block_count_B = jnp.where(xs["block_start"], num_masked_B, state.block_count_B)
  values_BxL = transforms.draw_values(keys_B, logits_BxLxV, **spec.transform)
  probs_BxLxV, conf_BxL = value_probs(logits_BxLxV, values_BxL)
  score_BxL = transforms.confidence_score(spec.score, probs_BxLxV, values_BxL, keys_B)
  if spec.threshold is None:
    k_B = commit_counts(block_count_B, num_masked_B, xs["remaining"])
  else:
    above_B = (cand_BxL & (score_BxL >= spec.threshold)).sum(-1)
    k_B = jnp.where(xs["last_in_block"], num_masked_B, jnp.maximum(above_B, 1))
  rank_score_BxL = score_BxL
  if spec.gumbel_temperature > 0:
    gumbel_BxL = transforms.row_gumbel(keys_B, transforms.SELECT, (length,))
    log_score = (score_BxL if spec.score == "neg_entropy"
                 else jnp.log(jnp.maximum(score_BxL, 1e-30)))
    rank_score_BxL = log_score + xs["choice_temperature"] * gumbel_BxL
  write_BxL = transforms.select_top_k(rank_score_BxL, cand_BxL, k_B)
  state = commit(state, write_BxL, values_BxL, conf_BxL, xs["step"])
  return state.replace(block_count_B=block_count_B)
