"""The scan carry and the per-call context shared by every sampler family."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array


@struct.dataclass
class Context:
  """Per-call constants: traced arrays fixed for the whole trajectory."""

  mask_id: int = struct.field(pytree_node=False)
  editable_BxL: Array  # positions a sampler may write (not fixed)
  block_id_BxL: Array  # block of each editable position (0 without blocks)
  order_rank_BxL: Array  # random write order (RandomOrderSpec), else zeros


@struct.dataclass
class State:
  """The canvas and its bookkeeping, carried through `lax.scan`."""

  tokens_BxL: Array
  write_step_BxL: Array  # step at which a position last received its value (-1: never)
  write_conf_BxL: Array  # probability of the value when it was written
  reopened_B: Array  # committed tokens returned to the mask (remasking)
  block_count_B: Array  # masked positions of the current block at its start
  nfe: Array  # denoiser evaluations made
  saved_calls: Array  # evaluations skipped (cache, or nothing left to write)
  contexts: Array | None = None  # sequences evaluated per row (a batched call counts each)
  changes_KxB: Array | None = None  # revision: visible tokens that changed value, per step
  last_tokens_BxL: Array | None = None  # cache: canvas at the last call
  last_logits_BxLxV: Array | None = None  # cache: logits of the last call


def commit(state: State, write_BxL: Array, values_BxL: Array, conf_BxL: Array,
           step: Array) -> State:
  """Writes `values` where `write`, recording the step and the confidence."""
  return state.replace(
      tokens_BxL=jnp.where(write_BxL, values_BxL, state.tokens_BxL),
      write_step_BxL=jnp.where(write_BxL, step, state.write_step_BxL),
      write_conf_BxL=jnp.where(write_BxL, conf_BxL, state.write_conf_BxL),
  )


def candidates(state: State, ctx: Context, block: Array) -> Array:
  """Masked editable positions of the current block: what a step may write."""
  return ((state.tokens_BxL == ctx.mask_id) & ctx.editable_BxL
          & (ctx.block_id_BxL == block))


def value_probs(logits_BxLxV: Array, values_BxL: Array) -> tuple[Array, Array]:
  """Untransformed softmax and the probability of each drawn value."""
  probs_BxLxV = jax.nn.softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
  conf_BxL = jnp.take_along_axis(probs_BxLxV, values_BxL[..., None], axis=-1)[..., 0]
  return probs_BxLxV, conf_BxL
