"""Leave-group-out contexts: re-scoring visible tokens in one batched call."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def leave_group_out_logits(evaluate, tokens_BxL: Array, rescored_BxL: Array, groups: int,
                           mask_id: int) -> Array:
  """Logits of every position with its group (positions i mod G = g, if rescored) masked.

  One batched call of G contexts; position i is read in context i mod G, where it and
  the other rescored positions of its group are masked and everything else is visible.
  """
  batch, length = tokens_BxL.shape
  group_L = jnp.arange(length) % groups
  hide_GxBxL = rescored_BxL[None] & (group_L[None, None] == jnp.arange(groups)[:, None, None])
  contexts_GxBxL = jnp.where(hide_GxBxL, mask_id, tokens_BxL[None])
  logits_GxBxLxV = evaluate(contexts_GxBxL.reshape(groups * batch, length))
  logits_GxBxLxV = logits_GxBxLxV.reshape((groups, batch, length, -1))
  index = jnp.broadcast_to(group_L[None, None, :, None], (1, batch, length, 1))
  return jnp.take_along_axis(logits_GxBxLxV, index, axis=0)[0]
