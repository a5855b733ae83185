"""Direct revision (D3IM-style), and leave-group-out re-scoring of visible tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.sampling import confidence, transforms
from mdjax.sampling import specs as specs_lib
from mdjax.sampling.state import Context, State, value_probs

Array = jax.Array


def plan(spec: specs_lib.RevisionSpec) -> dict[str, np.ndarray]:
  """Per-step arrays: the fraction of the editable positions left masked after each step."""
  conf_plan = confidence.plan(specs_lib.ConfidenceSpec(steps=spec.steps,
                                                       count_schedule=spec.count_schedule), 1)
  return {k: conf_plan[k] for k in ("t", "block", "remaining")}


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


def update(spec: specs_lib.RevisionSpec, state: State, ctx: Context, xs, logits_BxLxV: Array,
           keys_B: Array, *, evaluate) -> State:
  """Draws every editable position, keeps the n best, masks the rest."""
  mask_id = ctx.mask_id
  editable_BxL = ctx.editable_BxL
  visible_BxL = editable_BxL & (state.tokens_BxL != mask_id)
  nfe, contexts = state.nfe, state.contexts
  if spec.score_groups and not spec.keep_visible:
    # Skipped (a lax.cond) while no editable token is visible, e.g. at the first step.
    need = jnp.any(visible_BxL)
    regrouped = jax.lax.cond(
        need, lambda: leave_group_out_logits(evaluate, state.tokens_BxL, visible_BxL,
                                             spec.score_groups, mask_id),
        lambda: logits_BxLxV)
    logits_BxLxV = jnp.where(visible_BxL[..., None], regrouped, logits_BxLxV)
    nfe, contexts = nfe + need, contexts + need * spec.score_groups
  values_BxL = transforms.draw_values(keys_B, logits_BxLxV, **spec.transform)
  probs_BxLxV, conf_BxL = value_probs(logits_BxLxV, values_BxL)
  score_BxL = transforms.confidence_score(spec.score, probs_BxLxV, values_BxL, keys_B)
  num_editable_B = editable_BxL.sum(-1)
  # Kept after this step: all but the scheduled remaining fraction (ConfidenceSpec's counts).
  keep_count_B = confidence.commit_counts(num_editable_B, num_editable_B, xs["remaining"])
  if spec.keep_visible:
    values_BxL = jnp.where(visible_BxL, state.tokens_BxL, values_BxL)
    conf_BxL = jnp.where(visible_BxL, state.write_conf_BxL, conf_BxL)
    score_BxL = jnp.where(visible_BxL, jnp.inf, score_BxL)
  keep_BxL = transforms.select_top_k(score_BxL, editable_BxL, keep_count_B)
  changed_BxL = keep_BxL & visible_BxL & (values_BxL != state.tokens_BxL)
  written_BxL = keep_BxL & (~visible_BxL | changed_BxL)
  dropped_BxL = visible_BxL & ~keep_BxL
  tokens_BxL = jnp.where(written_BxL, values_BxL, state.tokens_BxL)
  tokens_BxL = jnp.where(dropped_BxL, mask_id, tokens_BxL)
  return state.replace(
      tokens_BxL=tokens_BxL,
      write_step_BxL=jnp.where(written_BxL, xs["step"],
                               jnp.where(dropped_BxL, -1, state.write_step_BxL)),
      write_conf_BxL=jnp.where(written_BxL, conf_BxL, state.write_conf_BxL),
      reopened_B=state.reopened_B + dropped_BxL.sum(-1),
      changes_KxB=state.changes_KxB.at[xs["step"]].set(changed_BxL.sum(-1)),
      nfe=nfe, contexts=contexts)
