"""Fast-dLLM's prefix cache on a denoiser that offers the cached contract: where
`sampling.sample`'s dual cache makes a window pass over the block, the pass runs over the
block and everything after it, attending to the cached keys and values before the block
(`generate_with_prefix_cache`). LLaDA's reference sampler wraps its denoiser in it
(`kv_cache="prefix"`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mdjax.denoiser import Denoiser


def _given(valid_BxL) -> dict:
  return {} if valid_BxL is None else {"valid_BxL": valid_BxL}


@dataclasses.dataclass(frozen=True)
class _PrefixPrefill:
  inner: Denoiser

  def __call__(self, params, tokens_BxL, t_B, valid_BxL=None):
    logits_BxLxV, cache = self.inner.prefill(params, tokens_BxL, t_B, **_given(valid_BxL))
    return logits_BxLxV, (cache, tokens_BxL)


@dataclasses.dataclass(frozen=True)
class _PrefixDecode:
  """A window pass of the dual cache run as Fast-dLLM's prefix cache: the pass covers the
  block and every position after it (fresh keys and values), attending to the cached
  ones before the block. Its width, the length minus the block's start, is static only
  per block, so the pass is a `lax.switch` over the blocks, one branch per width."""

  inner: Denoiser
  generation_start: int
  block_length: int

  def __call__(self, params, cache, tokens_BxW, start, t_B, valid_BxL=None):
    inner_cache, canvas_BxL = cache
    # The canvas as of the block's first step, with the block's current tokens: the
    # positions after the block do not change while the block is decoded.
    canvas_BxL = jax.lax.dynamic_update_slice_in_dim(canvas_BxL, tokens_BxW, start, axis=1)
    length, width = canvas_BxL.shape[1], tokens_BxW.shape[1]
    num_blocks = (length - self.generation_start) // self.block_length

    def branch(block):
      begin = self.generation_start + block * self.block_length

      def run():
        logits_BxRxV, _ = self.inner.decode(params, inner_cache, canvas_BxL[:, begin:], begin,
                                            t_B, **_given(valid_BxL))
        return logits_BxRxV[:, :width]

      return run

    block = (jnp.asarray(start, jnp.int32) - self.generation_start) // self.block_length
    logits_BxWxV = jax.lax.switch(jnp.clip(block, 0, num_blocks - 1),
                                  [branch(b) for b in range(num_blocks)])
    return logits_BxWxV, cache


def prefix_cache(denoiser, generation_start: int, block_length: int) -> Denoiser:
  """A cached denoiser whose window passes follow Fast-dLLM's prefix cache (`_PrefixDecode`)
  where `sampling.sample`'s dual cache makes window passes; the blocks are those of a
  generation that starts at `generation_start` and runs to the canvas's end."""
  inner = Denoiser.of(denoiser)
  return Denoiser(_PrefixApply(inner), prefill=_PrefixPrefill(inner),
                  decode=_PrefixDecode(inner, int(generation_start), int(block_length)))


@dataclasses.dataclass(frozen=True)
class _PrefixApply:
  inner: Denoiser

  def __call__(self, params, tokens_BxL, t_B, valid_BxL=None):
    return self.inner(params, tokens_BxL, t_B, valid_BxL)
