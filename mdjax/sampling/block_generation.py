"""`sample_blocks`: block-by-block generation of any length, any family inside a block.

Block diffusion (BD3-LM) generates a sequence one block at a time, each block by masked
diffusion conditioned on the clean blocks before it. `sample_blocks` runs any registered
family on one block of `blocks_of` positions at a time; the family sees a canvas of
that one block, and its denoiser calls see the block after its context window: the last
`window` positions before the block (the prompt, then the blocks written so far).

The block is denoised on a canvas of `window + blocks_of` positions: [window, block],
with positions counted from the canvas's first valid token and nothing after the block
visible. While every row's tokens so far fit the window the canvas stays put (left padding
is used up block by block); after, it slides: the window is the last `window` positions.
A model trained on sequences of `window + blocks_of` positions thus sees at every block
what it saw in training, and generation runs past the training length.

With `cached=True` (a block-causal denoiser: a `Denoiser` with `block_size`, `prefill` and
`decode`) the family's calls run on the block's positions only, against the
canvas's cached keys and values, which are exact: under block-causal attention no earlier
position sees the block. While the canvas stays put the cache grows: one pass over each
finished block appends its keys and values. Once the window slides it is encoded anew at
each block (one pass over the canvas): keys computed under an earlier window would give
the window's first block a context the model never saw in its first block. The tokens are
those of `cached=False`, which runs the denoiser on the canvas at every call (any denoiser
that takes `valid_BxL`, bidirectional ones included).

A prompt that ends inside one of a block-causal model's blocks (`Denoiser.block_size`)
finishes that block first: its last `p % block_size` tokens are held fixed at the start of the first
generated block, so every block starts where the model's blocks do (positions count from
each row's first valid token) and the cache of finished blocks stays exact. Each row still
gets `length` positions after its own prompt; the generation then runs one block more at the
end, which no row's first `length` positions see.

With `spec.eos_id` a row that has written an end-of-sequence token is finished: its later
blocks are all EOS, and once every row has finished no further block calls the denoiser.
The whole generation is one `lax.scan` over blocks, one compiled program.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.denoiser import Denoiser
from mdjax.sampling import driver, kv_cache, stepping
from mdjax.sampling.block_stepping import (block_canvas, block_denoiser, generated,
                                          refreshed_cache, sequence)
from mdjax.sampling.base import BoundDenoiser, Canvas, CountedView, Counters, check, family_of
from mdjax.sampling.end_of_row import EndOfRow

Array = jax.Array


@struct.dataclass
class BlocksResult(CountedView):
  """What `sample_blocks` returns.

  tokens_BxT: the prompt (as given, padding included) and the T - P generated positions.
  generated_length_B: generated positions of each row before its first EOS (all of them
    when the row has none or `spec.eos_id` is None).
  counters: what the blocks counted, summed (`base.Counters`, as `SampleResult`'s), each
    also read by name; `nfe` is the sequential denoiser passes: the family's calls, plus,
    when cached, one pass per block that appends the finished block or encodes a slid
    window.
  blocks_run: blocks that called the denoiser (fewer than requested once every row ended).
  """

  tokens_BxT: Array
  generated_length_B: Array
  counters: Counters
  blocks_run: Array


def check_blocks(denoiser: Denoiser, params, prompt: np.ndarray, spec, *, length, blocks_of, window,
           mask_id, valid: np.ndarray | None, cached: bool):
  """`sample_blocks`' checks, on the host before any tracing (a served lane makes them
  too): returns (family, the family's per-step plan of one block, whether its loop jumps
  over idle steps, V)."""
  check(isinstance(blocks_of, (int, np.integer)) and blocks_of >= 1, "blocks_of",
        blocks_of, "must be an integer >= 1")
  check(isinstance(length, (int, np.integer)) and length >= 1 and length % blocks_of == 0,
        "length", length, f"must be a positive multiple of blocks_of={blocks_of}")
  check(isinstance(window, (int, np.integer)) and window >= blocks_of, "window", window,
        f"must be an integer >= blocks_of={blocks_of} (a window shorter than one "
        "block cannot hold the block before it)")
  driver.check_mask_id(mask_id)
  check(spec.kv_cache == "none", "spec.kv_cache", spec.kv_cache,
        "must be 'none': sample_blocks keeps the cache itself (cached=True)")
  if prompt.ndim != 2 or not np.issubdtype(prompt.dtype, np.integer):
    raise ValueError(f"prompt_BxP has shape {prompt.shape} and dtype {prompt.dtype}; it must "
                     "be a 2-D integer array (P = 0 for no prompt).")
  if valid is not None and valid.shape != prompt.shape:
    raise ValueError(f"valid_BxP has shape {valid.shape}; prompt_BxP has {prompt.shape}.")
  if cached:
    model_block = denoiser.block_size
    if model_block is None or not denoiser.offers_cache:
      raise ValueError("cached=True needs a block-causal denoiser with the cached contract "
                       "(Denoiser.block_size, .prefill, .decode: a Transformer "
                       "with block_size); a bidirectional model's window keys depend on the "
                       "block, so run it with cached=False.")
    check(blocks_of % model_block == 0, "blocks_of", blocks_of,
          f"must be a multiple of the model's block size {model_block} (cached=True)")
    check(window % model_block == 0, "window", window,
          f"must be a multiple of the model's block size {model_block} (cached=True)")
  batch = prompt.shape[0]
  # The denoiser on [window, block], traced abstractly: a model that cannot take
  # window + blocks_of positions or valid_BxL fails here, before compiling; its logits
  # give V.
  context = jax.ShapeDtypeStruct((batch, window + blocks_of), jnp.int32)
  try:
    out = jax.eval_shape(
        lambda p, x, v: denoiser(p, x, jnp.ones(batch), valid_BxL=v), params, context,
        jax.ShapeDtypeStruct(context.shape, jnp.bool_))
  except TypeError as error:
    raise ValueError(f"apply_fn does not take valid_BxL ({error}); sample_blocks pads the "
                     "window on the left and needs apply_fn(params, tokens_BxL, t_B, "
                     "valid_BxL=...).") from None
  if len(out.shape) != 3 or tuple(out.shape[:2]) != context.shape:
    raise ValueError(f"apply_fn returns logits of shape {tuple(out.shape)} on a window of "
                     f"{context.shape}; expected {(*context.shape, 'V')}.")
  vocab_size = int(out.shape[-1])
  driver.check_mask_id(mask_id, vocab_size)
  if prompt.size and (prompt.min() < 0 or prompt.max() >= vocab_size
                      or (prompt == mask_id).any()):
    raise ValueError(f"prompt_BxP holds ids in [{prompt.min()}, {prompt.max()}]; a prompt "
                     f"holds tokens 0..{vocab_size - 1}, never the mask id {mask_id}.")
  EndOfRow.of(spec).check_vocabulary(vocab_size, mask_id)
  family = family_of(spec)
  canvas = Canvas(batch=batch, length=blocks_of, mask_id=mask_id,
                  tokens=np.full((batch, blocks_of), mask_id, np.int32),
                  fixed=np.zeros((batch, blocks_of), bool), vocab_size=vocab_size)
  family.validate(spec, canvas)
  plan = family.plan(spec, canvas)
  return family, plan, stepping.skips_idle_steps(family, spec, canvas, plan), vocab_size


def sample_blocks(apply_fn, params: Any, key: Array, prompt_BxP, spec, *, length: int,
                  blocks_of: int, window: int, mask_id: int, valid_BxP=None,
                  cached: bool = True) -> BlocksResult:
  """Generates `length` positions after each prompt, `blocks_of` at a time.

  Args:
    apply_fn: the denoiser; it must take `valid_BxL=`. With `cached`, a block-causal one
      offering `prefill` and `decode` (mdjax's Transformer with `block_size`).
    params: its parameters.
    key: one PRNG key, or B row keys; block n of a row uses fold_in(row key, n).
    prompt_BxP: the prompts, left-padded to one length P (P may be 0), of any lengths: on a
      block-causal model a prompt's last partial block is finished first (module doc).
    spec: the sampler of one block: any family; its `steps` are steps per block, its own
      `block_length` (if any) splits the block further. `spec.kv_cache` must be "none".
    length: positions to generate (a multiple of blocks_of; any number of windows).
    blocks_of: positions per block (a multiple of the model's block size when cached).
    window: positions of context before each block (>= blocks_of); window +
      blocks_of should be the length the model was trained on.
    mask_id: the mask id: V (the denoiser's logits per position) or an id inside the
      vocabulary (never drawn: see `sampling.sample`).
    valid_BxP: False on the prompts' left padding (default: every position valid).
    cached: keep the canvas's keys and values (exact on a block-causal model) and run the
      family's calls on the block only.
  """
  prompt = np.asarray(prompt_BxP)
  valid = None if valid_BxP is None else np.asarray(valid_BxP).astype(bool)
  denoiser = Denoiser.of(apply_fn)
  family, plan, skip, vocab_size = check_blocks(denoiser, params, prompt, spec, length=length,
                                          blocks_of=blocks_of, window=window, mask_id=mask_id,
                                          valid=valid, cached=cached)
  mask_id = int(mask_id)
  batch = prompt.shape[0]
  valid = np.ones(prompt.shape, bool) if valid is None else valid
  prompt = prompt.astype(np.int32)
  whole_BxP, tail_BxR = prompt, np.zeros((batch, 0), np.int32)
  if denoiser.block_size is not None:  # blocks start where the model's blocks do
    whole_BxP, valid, tail_BxR = split_tails(prompt, valid, denoiser.block_size, mask_id)
  return _program(denoiser, params, stepping.row_keys(key, batch), prompt, whole_BxP, valid,
                  tail_BxR, plan, spec=spec, mask_id=mask_id, vocab_size=vocab_size,
                  length=length,
                  blocks_of=blocks_of, window=window, cached=cached, skip=skip)


def split_tails(prompt_BxP: np.ndarray, valid_BxP: np.ndarray, model_block: int, mask_id: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(whole_BxP, valid_BxP, tail_BxR): each left-padded prompt cut where its last whole
  model block ends. The whole blocks stay right-aligned at P (one more padding per tail
  token); the R = max tail tokens, left-aligned with `mask_id` after them, go first in the
  generated span."""
  batch, width = prompt_BxP.shape
  tail_B = valid_BxP.sum(-1) % model_block
  tail_BxR = np.full((batch, int(tail_B.max(initial=0))), mask_id, np.int32)
  whole_BxP, whole_valid_BxP = np.zeros_like(prompt_BxP), np.zeros_like(valid_BxP)
  for row, tail in enumerate(tail_B):
    tail_BxR[row, :tail] = prompt_BxP[row, width - tail:]
    whole_BxP[row, tail:] = prompt_BxP[row, :width - tail]
    whole_valid_BxP[row, tail:] = valid_BxP[row, :width - tail]
  return whole_BxP, whole_valid_BxP, tail_BxR


@struct.dataclass
class _BlocksState:
  """What the scan over blocks carries from one block to the next."""

  tokens_BxS: Array  # the sequence: [window of padding, prompt, generation, window]
  ended_B: Array  # rows that have written EOS: their later blocks are all EOS
  counters: Counters  # what the blocks so far counted (nfe: their denoiser passes)
  blocks_run: Array  # blocks that called the denoiser
  cache: Any  # the canvas's keys and values (cached=True), else None


@functools.partial(jax.jit, static_argnames=("denoiser", "spec", "mask_id", "vocab_size",
                                             "length", "blocks_of", "window", "cached", "skip"))
def _program(denoiser, params, keys_B, prompt_BxP, whole_BxP, valid_BxP, tail_BxR, plan, *,
             spec, mask_id, vocab_size, length, blocks_of, window, cached,
             skip) -> BlocksResult:
  """The generation: `whole_BxP` (valid: `valid_BxP`) before the blocks, `tail_BxR` fixed at
  the start of the first one (`split_tails`); returns `prompt_BxP` and each row's `length`
  positions after its tail."""
  batch, prompt_len = whole_BxP.shape
  tail_width = tail_BxR.shape[1]
  tail_B = (tail_BxR != mask_id).sum(-1)
  num_blocks = -(-(length + tail_width) // blocks_of)
  end = EndOfRow.of(spec)
  span = window + blocks_of  # the canvas each block is denoised on
  tokens_BxS, valid_BxS = sequence(whole_BxP, valid_BxP, tail_BxR, mask_id=mask_id,
                                    window=window, span_length=num_blocks * blocks_of)
  canvas_of = functools.partial(block_canvas, valid_BxS=valid_BxS,
                                longest_prompt=valid_BxP.sum(-1).max(), prompt_len=prompt_len,
                                window=window, blocks_of=blocks_of)

  def denoise_block(n, tokens_BxS, cache):
    """Block n's tokens by the family, its counters (nfe: the passes made), the cache."""
    fits, offset, tokens_BxC, valid_BxC = canvas_of(n, tokens_BxS)
    if cached:
      canvas = BoundDenoiser(denoiser, params, valid_BxL=valid_BxC)
      cache = refreshed_cache(canvas, n, cache, fits, offset, tokens_BxC, blocks_of)
    context = cache if cached else tokens_BxC
    block_BxW = jax.lax.dynamic_slice_in_dim(tokens_BxC, offset, blocks_of, axis=1)
    core, ctx = stepping.start_canvas(jax.vmap(jax.random.fold_in, (0, None))(keys_B, n),
                                      block_BxW, None, mask_id, vocab_size=vocab_size)
    block = BoundDenoiser(block_denoiser(denoiser, offset, cached), params, valid_BxL=valid_BxC,
                          context=context, mask_in_vocab=ctx.mask_in_vocab)
    core, _, _ = stepping.run(spec, block, core, ctx, plan, skip)
    return core.tokens_BxL, core.counters.add(nfe=int(cached)), cache

  def body(state: _BlocksState, n):
    # No pass once every row has ended.
    idle = lambda: (jnp.zeros((batch, blocks_of), jnp.int32), Counters.zeros(batch), state.cache)
    block_BxW, counted, cache = end.unless_ended(
        state.ended_B, lambda: denoise_block(n, state.tokens_BxS, state.cache), idle)
    written_BxW = (n * blocks_of + jnp.arange(blocks_of))[None] >= tail_B[:, None]
    block_BxW, ended_B = end.after_block(block_BxW, state.ended_B, written_BxW)
    tokens_BxS = jax.lax.dynamic_update_slice_in_dim(
        state.tokens_BxS, block_BxW, window + prompt_len + n * blocks_of, axis=1)
    return _BlocksState(tokens_BxS=tokens_BxS, ended_B=ended_B,
                        counters=state.counters + counted,
                        blocks_run=state.blocks_run + (counted.nfe > 0), cache=cache), None

  cache = None
  if cached:  # zeros of the prefill's shapes: the first block encodes its canvas
    cache = kv_cache.init(BoundDenoiser(denoiser, params, valid_BxL=valid_BxS[:, :span]),
                          tokens_BxS[:, :span]).cache
  state = _BlocksState(tokens_BxS=tokens_BxS, ended_B=jnp.zeros((batch,), bool),
                       counters=Counters.zeros(batch), blocks_run=jnp.zeros((), jnp.int32),
                       cache=cache)
  state, _ = jax.lax.scan(body, state, jnp.arange(num_blocks, dtype=jnp.int32))
  generated_BxG = generated(state.tokens_BxS, tail_B, first=window + prompt_len,
                             tail_width=tail_width, length=length)
  return BlocksResult(tokens_BxT=jnp.concatenate([prompt_BxP, generated_BxG], 1),
                      generated_length_B=end.generated_length(
                          generated_BxG, jnp.ones(generated_BxG.shape, bool), mask_id),
                      counters=state.counters, blocks_run=state.blocks_run)
