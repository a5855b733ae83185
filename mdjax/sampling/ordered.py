"""Fixed write orders (by position or by field), and the chain rule in a random order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.sampling import specs as specs_lib
from mdjax.sampling import transforms
from mdjax.sampling.state import Context, State, candidates, commit, value_probs

Array = jax.Array


def plan(spec, length: int) -> dict[str, np.ndarray]:
  """Per-step arrays: which positions each step writes (fixed orders)."""
  if isinstance(spec, specs_lib.RandomOrderSpec):
    return {"t": 1.0 - np.arange(length) / length, "block": np.zeros(length, np.int32)}
  if isinstance(spec, specs_lib.FieldOrderSpec):
    return {"t": 1.0 - np.arange(spec.steps) / spec.steps,
            "counts_F": np.asarray(spec.counts, np.int32),
            "block": np.zeros(spec.steps, np.int32)}
  write_KxL = np.zeros((spec.steps, length), bool)
  for i, group in enumerate(spec.groups):
    write_KxL[i, list(group)] = True
  return {"t": 1.0 - np.arange(spec.steps) / spec.steps, "write_L": write_KxL,
          "block": np.zeros(spec.steps, np.int32)}


def random_order_rank(keys_B: Array, editable_BxL: Array) -> Array:
  """A uniformly random rank 0..n-1 over each row's editable positions."""
  noise_BxL = transforms.row_uniform(keys_B, transforms.ORDER, editable_BxL.shape[1:])
  return transforms.rank_descending(noise_BxL, editable_BxL)


def _field_writes(spec: specs_lib.FieldOrderSpec, cand_BxL: Array, score_BxL: Array,
                  counts_F: Array) -> Array:
  """Each field's counts_F[f] highest-scoring candidates."""
  batch, length = cand_BxL.shape
  write_BxL = jnp.zeros((batch, length), bool)
  for f, positions in enumerate(spec.fields):  # static: a handful of fields
    in_field_L = np.zeros(length, bool)
    in_field_L[list(positions)] = True
    k_B = jnp.broadcast_to(counts_F[f], (batch,))
    write_BxL |= transforms.select_top_k(score_BxL, cand_BxL & in_field_L, k_B)
  return write_BxL


def update(spec, state: State, ctx: Context, xs, logits_BxLxV: Array,
           keys_B: Array) -> State:
  """Writes this step's positions with independent draws from the conditionals."""
  values_BxL = transforms.draw_values(keys_B, logits_BxLxV, **spec.transform)
  probs_BxLxV, conf_BxL = value_probs(logits_BxLxV, values_BxL)
  cand_BxL = candidates(state, ctx, xs["block"])
  if isinstance(spec, specs_lib.FieldOrderSpec):
    score_BxL = transforms.confidence_score(spec.score, probs_BxLxV, values_BxL, keys_B)
    write_BxL = _field_writes(spec, cand_BxL, score_BxL, xs["counts_F"])
    return commit(state, write_BxL, values_BxL, conf_BxL, xs["step"])
  if isinstance(spec, specs_lib.RandomOrderSpec):
    now_BxL = ctx.order_rank_BxL == xs["step"]
  else:
    now_BxL = xs["write_L"][None, :]
  write_BxL = now_BxL & cand_BxL
  return commit(state, write_BxL, values_BxL, conf_BxL, xs["step"])
