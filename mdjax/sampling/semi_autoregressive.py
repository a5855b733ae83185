"""Semi-autoregressive blocks: the layout shared by the families that take `block_length`.

The editable positions of a row, in order, are cut into blocks of `block_length`;
block b is generated in steps [b * K / n, (b + 1) * K / n) of a K-step run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.errors import ArgumentError
from mdjax.sampling.base import Canvas, Context

Array = jax.Array


def count(block_length: int | None, steps: int, canvas: Canvas) -> int:
  """The number of blocks, after checking block_length against the generation length."""
  if block_length is None:
    return 1
  if canvas.fixed is None:
    raise ArgumentError("block_length", f"block_length={block_length} needs the generation "
                        "length before the run: inside jit, pass fixed_BxL as a concrete "
                        "(numpy) array, or call sample outside jit.")
  gen_lengths = np.unique((~canvas.fixed).sum(-1))
  if len(gen_lengths) != 1:
    raise ArgumentError("block_length", f"block_length={block_length} needs the same "
                        f"generation length in every row; rows have {gen_lengths.tolist()} "
                        "editable positions.")
  gen_length = int(gen_lengths[0])
  if gen_length % block_length:
    raise ArgumentError("block_length", f"block_length={block_length} must divide the "
                        f"generation length {gen_length}.")
  num_blocks = gen_length // block_length
  if steps % num_blocks:
    raise ArgumentError("steps", f"steps={steps} must be divisible by the number of blocks "
                        f"{num_blocks} (generation length {gen_length} / block_length "
                        f"{block_length}).")
  return num_blocks


def masked_counts(canvas: Canvas, block_length: int | None) -> np.ndarray | None:
  """Masked editable positions of each row in each block (B x num_blocks), on the host;
  None when the canvas is only known inside a trace."""
  if canvas.tokens is None:
    return None
  editable_BxL = ~canvas.fixed
  masked_BxL = (canvas.tokens == canvas.mask_id) & editable_BxL
  if block_length is None:
    return masked_BxL.sum(-1, keepdims=True)
  block_BxL = (np.cumsum(editable_BxL, -1) - 1) // block_length
  num_blocks = int(editable_BxL.sum(-1).max()) // block_length
  return np.stack([(masked_BxL & (block_BxL == b)).sum(-1) for b in range(num_blocks)], -1)


def block_ids(editable_BxL: Array, block_length: int | None) -> Array:
  """Block of each editable position (-1 elsewhere); all 0 without blocks."""
  if block_length is None:
    return jnp.zeros(editable_BxL.shape, jnp.int32)
  rank_BxL = jnp.cumsum(editable_BxL, axis=-1) - 1
  return jnp.where(editable_BxL, rank_BxL // block_length, -1).astype(jnp.int32)


def step_blocks(num_blocks: int, per_block: int) -> np.ndarray:
  """The block each step works on."""
  return np.repeat(np.arange(num_blocks), per_block)


def candidates(tokens_BxL: Array, ctx: Context, block_id_BxL: Array, block: Array) -> Array:
  """Masked editable positions of the current block: what a step may write."""
  return ctx.masked(tokens_BxL) & (block_id_BxL == block)
