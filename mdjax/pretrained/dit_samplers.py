"""MDLM's and BD3-LM's published samplers on a DiT checkpoint.

`mdlm_sample`: MDLM's `_sample` with its `ddpm_cache` predictor (`sampling.MDLMSpec`).
`bd3lm_sample`: BD3-LM's `_semi_ar_sampler`: block by block (`sampling.sample_blocks`, the
exact KV cache of the block-causal model, any length after a sliding window of the model's
length), each block by BD3-LM's update (`sampling.BD3LMSpec`: first hitting, nucleus).
(The NELBO and perplexity bound of a token file: `mdjax.evaluate.perplexity`.)

`model` is anything with `denoiser` (None: `dit.denoiser(config)`), `params` and `config` (a
`mdjax.models.dit.DiTConfig`): `mdjax.pretrained.load` of a MDLM or BD3-LM folder, or a
tiny model from `dit.init_params`.
"""

from __future__ import annotations

import jax
import numpy as np

from mdjax import sampling
from mdjax.checkpoints import bd3lm, mdlm
from mdjax.checkpoints.dit import sampled_config
from mdjax.models.checks import check_count

Array = jax.Array


def mdlm_sample(model, *, num_samples: int, steps: int, key: Array, length: int | None = None,
                eps: float = 1e-5, noise_removal: bool = True, cache: bool | None = None
                ) -> sampling.SampleResult:
  """MDLM's `_sample` (predictor `ddpm_cache`): `num_samples` rows of `length` tokens
  (default the model's length) from all masks, `steps` steps on linspace(1, eps, steps + 1),
  then noise removal (the argmax of whatever is still masked). `cache` (default: unless the
  model is time-conditioned, as MDLM) reuses the last call while the canvas is unchanged;
  `result.nfe` counts the calls made, `result.saved_calls` those reused or skipped.
  One compiled program."""
  config = sampled_config(model)
  check_count("num_samples", num_samples)
  length = config.model_length if length is None else length
  plan = mdlm.plan(model, length=length, steps=steps, eps=eps, noise_removal=noise_removal,
                   cache=cache)
  tokens_BxL = np.full((num_samples, length), config.mask_id, np.int32)
  return sampling.sample(plan.denoiser, plan.params, key, tokens_BxL, plan.spec)


def bd3lm_sample(model, *, num_samples: int, length: int, key: Array,
                 steps_per_block: int | None = None, nucleus_p: float = 0.9,
                 first_hitting: bool = True, bos_id: int | None = None,
                 cached: bool = True) -> sampling.BlocksResult:
  """BD3-LM's `_semi_ar_sampler`: `num_samples` rows of `length` tokens (any multiple of the
  block size, past the model's length too), block by block after a sliding window of the
  model's length minus one block (the reference's context), each block by BD3-LM's update
  (`sampling.BD3LMSpec`). steps_per_block: None with first hitting is one step per masked
  position (the reference's T >> block_size ends each block after as many); without first
  hitting, the DDPM grid's steps (default: the block size). `bos_id`: the first token is held
  at it, as the reference's `x[:, 0] = BOS` (GPT-2's 50256 for the released checkpoints;
  None: every position generated). cached: the exact KV cache of finished blocks.
  Returns `sampling.BlocksResult` (tokens_BxT of `length` tokens, counters summed)."""
  config = sampled_config(model)
  check_count("num_samples", num_samples)
  check_count("length", length)
  plan = bd3lm.plan(model, length=length, steps_per_block=steps_per_block, nucleus_p=nucleus_p,
                    first_hitting=first_hitting)
  apply_fn, params, spec = plan.denoiser, plan.params, plan.spec
  block, window = plan.blocks_of, plan.window
  keys = sampling.row_keys(key, num_samples)
  if bos_id is None:
    return sampling.sample_blocks(apply_fn, params, keys, np.zeros((num_samples, 0), np.int32),
                                  spec, length=length, blocks_of=block, window=window,
                                  mask_id=config.mask_id, cached=cached)
  if not (isinstance(bos_id, (int, np.integer)) and 0 <= bos_id < config.vocab_size):
    raise ValueError(f"bos_id={bos_id!r} must be a token id in [0, {config.vocab_size}).")
  # The first block on its own canvas, BOS fixed at position 0 (as the reference's first
  # block); then the rest after it as a prompt of one whole block, so no block is spent on
  # BOS's offset.
  first_BxK = np.full((num_samples, block), config.mask_id, np.int32)
  first_BxK[:, 0] = bos_id
  first_keys, rest_keys = jax.vmap(jax.random.split, out_axes=1)(keys)
  first = sampling.sample(apply_fn, params, first_keys, first_BxK, spec)
  counters, tokens_BxT = first.counters, first.tokens_BxL
  if length > block:
    rest = sampling.sample_blocks(apply_fn, params, rest_keys, np.asarray(tokens_BxT), spec,
                                  length=length - block, blocks_of=block, window=window,
                                  mask_id=config.mask_id, cached=cached)
    counters, tokens_BxT = counters + rest.counters, rest.tokens_BxT
  return sampling.BlocksResult(tokens_BxT=tokens_BxT,
                               generated_length_B=np.full(num_samples, length - 1),
                               counters=counters,
                               blocks_run=np.int32(length // block))


__all__ = ["bd3lm_sample", "mdlm_sample"]
