"""Test-and-defer (PUNT-style): proposals that others would move stay masked."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.sampling import specs as specs_lib
from mdjax.sampling import transforms
from mdjax.sampling.state import Context, State, candidates, commit, value_probs

Array = jax.Array

# Float32 softmaxes of the same logits computed in two programs differ by ~1e-8 in total
# variation: a move smaller than this is rounding, not dependence.
TV_ROUNDING = 1e-6


def num_levels(length: int) -> int:
  """J: dyadic groups [2^j, 2^(j+1)), j < J, cover every rank 1..L-1."""
  return max(1, math.ceil(math.log2(max(length, 2))))


def plan(spec: specs_lib.DeferSpec) -> dict[str, np.ndarray]:
  j = np.arange(spec.steps)
  return {"t": 1.0 - j / spec.steps, "block": np.zeros(spec.steps, np.int32),
          "last": j == spec.steps - 1}


def levels(rank_BxL: Array) -> Array:
  """Dyadic group of each rank: -1 for the anchor (rank 0), j for 2^j <= rank < 2^(j+1)."""
  return jnp.where(rank_BxL >= 1, jnp.floor(jnp.log2(jnp.maximum(rank_BxL, 1))), -1
                   ).astype(jnp.int32)


def total_variation(p_BxLxV: Array, q_BxLxV: Array) -> Array:
  return 0.5 * jnp.abs(p_BxLxV - q_BxLxV).sum(-1)


def update(spec: specs_lib.DeferSpec, state: State, ctx: Context, xs, logits_BxLxV: Array,
           keys_B: Array, *, evaluate) -> State:
  """Proposes every masked position; commits the anchor and the proposals that did not move."""
  batch, length = state.tokens_BxL.shape
  num_j = num_levels(length)
  cand_BxL = candidates(state, ctx, xs["block"])
  values_BxL = transforms.draw_values(keys_B, logits_BxLxV, **spec.transform)
  probs_BxLxV, conf_BxL = value_probs(logits_BxLxV, values_BxL)
  score_BxL = transforms.confidence_score(spec.score, probs_BxLxV, values_BxL, keys_B)
  rank_BxL = transforms.rank_descending(score_BxL, cand_BxL)
  level_BxL = levels(rank_BxL)

  def test_contexts():
    # Context j: the canvas with the proposals of rank < 2^j written in.
    prefix_JxBxL = cand_BxL[None] & (rank_BxL[None] < (2 ** jnp.arange(num_j))[:, None, None])
    contexts_JxBxL = jnp.where(prefix_JxBxL, values_BxL[None], state.tokens_BxL[None])
    logits_JxBxLxV = evaluate(contexts_JxBxL.reshape(num_j * batch, length)).reshape(
        (num_j,) + logits_BxLxV.shape)
    probs_JxBxLxV = jax.nn.softmax(logits_JxBxLxV.astype(jnp.float32), axis=-1)
    # Each proposal is read in the context of its own group.
    chosen_BxLxV = jnp.take_along_axis(
        probs_JxBxLxV, jnp.clip(level_BxL, 0, num_j - 1)[None, ..., None], axis=0)[0]
    return total_variation(chosen_BxLxV, probs_BxLxV)

  # No test on the last step (everything commits) or when no row has two proposals.
  need = ~xs["last"] & jnp.any(cand_BxL.sum(-1) >= 2)
  tv_BxL = jax.lax.cond(need, test_contexts, lambda: jnp.zeros((batch, length), jnp.float32))
  moved_BxL = cand_BxL & (level_BxL >= 0) & (tv_BxL > spec.threshold + TV_ROUNDING)
  first_fail_B = jnp.where(moved_BxL, level_BxL, num_j).min(-1)
  write_BxL = cand_BxL & ((level_BxL < first_fail_B[:, None])
                          | ((level_BxL == first_fail_B[:, None]) & ~moved_BxL))
  write_BxL = jnp.where(xs["last"], cand_BxL, write_BxL)
  state = commit(state, write_BxL, values_BxL, conf_BxL, xs["step"])
  return state.replace(nfe=state.nfe + need, contexts=state.contexts + need * num_j)
