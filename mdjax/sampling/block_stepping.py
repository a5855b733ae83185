"""Block-by-block generation one step at a time: the pieces of `sample_blocks`, in public.

`sample_blocks` (`sampling.block_generation`) is one `lax.scan` over blocks; whoever drives
block-by-block decoding from outside it (a served lane, rows at different blocks and steps)
uses the same pieces through `BlockStepper`:

  start:  the sequence laid out ([window of padding, prompt, generation, window]), the first
          block's cache encoded, the first block's family carry (`Stepper.start`);
  step:   one step of the current block's family (`Stepper.step`) on [window, block];
  commit: a finished block written into the sequence (a row that wrote EOS ends), and the
          next block opened: its cache appended by one pass over the finished block, or
          encoded anew once the window slides, and its family carry started with the key
          `fold_in(row key, n)`.

A carry holds one block index and one step index for all its rows (as `sample_blocks`
does); a served lane vmaps the door over rows of one row each, so each row is at its own
block and step. The tokens are those of `sample_blocks`: the same canvas, cache, keys and
steps (a step whose update can write nothing leaves the row as it is, so stepping through
the steps `sample_blocks` jumps over changes nothing).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from mdjax.denoiser import Denoiser
from mdjax.sampling import kv_cache
from mdjax.sampling.base import BoundDenoiser
from mdjax.sampling.end_of_row import EndOfRow
from mdjax.sampling.stepping import Carry, Stepper

Array = jax.Array


# ----------------------------------------------------------------------------
# The pieces (sample_blocks' scan uses them too).
# ----------------------------------------------------------------------------


def block_denoiser(denoiser: Denoiser, offset: Array, cached: bool) -> Denoiser:
  """The denoiser of one block: (params, tokens_NxW, t_N, valid_BxL, context) ->
  logits_NxWxV of the block at `offset` on its canvas (`context`: the canvas's cache, or
  its tokens; each row's own, like its validity mask)."""

  def cached_logits(params, tokens_NxW, t_N, valid_BxL, context):
    logits_NxWxV, _ = denoiser.decode(params, context, tokens_NxW, offset, t_N,
                                      valid_BxL=valid_BxL)
    return logits_NxWxV

  def recomputed_logits(params, tokens_NxW, t_N, valid_BxL, context):
    canvas_NxC = jax.lax.dynamic_update_slice_in_dim(context, tokens_NxW, offset, axis=1)
    logits_NxCxV = denoiser(params, canvas_NxC, t_N, valid_BxL=valid_BxL)
    return jax.lax.dynamic_slice_in_dim(logits_NxCxV, offset, tokens_NxW.shape[1], axis=1)

  return Denoiser(cached_logits if cached else recomputed_logits)


def sequence(whole_BxP, valid_BxP, tail_BxR, *, mask_id: int, window: int,
             span_length: int) -> tuple[Array, Array]:
  """(tokens_BxS, valid_BxS): the sequence with room either side, [window of padding,
  prompt, generation (tails first), window of padding], and its validity."""
  batch, tail_width = tail_BxR.shape
  tokens_BxS = jnp.concatenate([jnp.zeros((batch, window), jnp.int32), whole_BxP, tail_BxR,
                                jnp.full((batch, span_length - tail_width), mask_id, jnp.int32),
                                jnp.zeros((batch, window), jnp.int32)], 1)
  valid_BxS = jnp.concatenate([jnp.zeros((batch, window), bool), valid_BxP,
                               jnp.ones((batch, span_length), bool),
                               jnp.zeros((batch, window), bool)], 1)
  return tokens_BxS, valid_BxS


def block_canvas(n: Array, tokens_BxS: Array, *, valid_BxS: Array, longest_prompt: Array,
                 prompt_len: int, window: int, blocks_of: int):
  """Block n's canvas: (whether every row's tokens so far fit the window, the block's
  offset on it, tokens_BxC, valid_BxC). While they fit the canvas stays put (the cache
  can grow block by block); after, it slides with the block at offset W."""
  span = window + blocks_of
  block_start = window + prompt_len + n * blocks_of
  fits = n * blocks_of + longest_prompt <= window
  begin = jnp.where(fits, window + prompt_len - longest_prompt, block_start - window)
  offset = block_start - begin
  tokens_BxC = jax.lax.dynamic_slice_in_dim(tokens_BxS, begin, span, axis=1)
  valid_BxC = jax.lax.dynamic_slice_in_dim(valid_BxS, begin, span, axis=1)
  # Nothing after the block is seen: a bidirectional model too gets [window, block].
  valid_BxC = valid_BxC & (jnp.arange(span) < offset + blocks_of)[None]
  return fits, offset, tokens_BxC, valid_BxC


def generated(tokens_BxS: Array, tail_B: Array, *, first: int, tail_width: int,
              length: int) -> Array:
  """generated_BxG: each row's `length` positions after its own tail (from `first`)."""
  if not tail_width:
    return tokens_BxS[:, first:first + length]
  columns_BxG = first + tail_B[:, None] + jnp.arange(length)[None]
  return jnp.take_along_axis(tokens_BxS, columns_BxG, axis=1)


def refreshed_cache(canvas: BoundDenoiser, n: Array, cache, fits: Array, offset: Array,
                    tokens_BxC: Array, blocks_of: int, how: str = "either"):
  """The canvas's cache for block n (`canvas`: the denoiser bound to the canvas's validity):
  encoded anew (the first block, or a slid window), or the last one with block n - 1
  appended (one pass over its final tokens). how: "encode", "append", or "either" (decided
  in the program: append while the canvas fits and n > 0)."""
  ones_B = jnp.ones(tokens_BxC.shape[:1], jnp.float32)

  def encode():
    return canvas.prefill(tokens_BxC, ones_B)[1]

  def append():
    begin = offset - blocks_of
    finished_BxW = jax.lax.dynamic_slice_in_dim(tokens_BxC, begin, blocks_of, axis=1)
    return canvas.decode(cache, finished_BxW, begin, ones_B)[1]

  if how == "encode":
    return encode()
  if how == "append":
    return append()
  return jax.lax.cond(fits & (n > 0), append, encode)


# ----------------------------------------------------------------------------
# The door.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockLayout:
  """The static shape of a block-by-block run.

  blocks_of: positions a block; window: positions of context before it; prompt_width: P,
  the sequence's prompt columns (whole model blocks of each prompt, right-aligned);
  tail_width: R, the columns of prompt tails held at the start of the first block
  (`block_generation.split_tails`); num_blocks: the blocks the sequence holds; cached: the
  exact cache of finished blocks (a block-causal denoiser), else every call recomputes the
  canvas."""

  blocks_of: int
  window: int
  prompt_width: int
  tail_width: int
  num_blocks: int
  cached: bool

  @property
  def span(self) -> int:
    """The positions of a block's canvas: [window, block]."""
    return self.window + self.blocks_of

  @property
  def first(self) -> int:
    """The sequence's first generated column."""
    return self.window + self.prompt_width

  def fits(self, n: int, longest_prompt: int) -> bool:
    """On the host: whether block n's canvas stays put (its cache is appended), for a
    longest whole prompt of `longest_prompt` positions; else the window has slid."""
    return n * self.blocks_of + longest_prompt <= self.window


@struct.dataclass
class BlockCarry:
  """What one step of block-by-block decoding hands the next: the sequence, the current
  block n and the step within it, the rows that ended, the canvas's cache, the block's
  family carry (`stepping.Carry` on a canvas of `blocks_of` positions). A pytree."""

  tokens_BxS: Array
  valid_BxS: Array
  longest_prompt: Array  # the rows' longest whole prompt (int32; `block_canvas`)
  keys_B: Array  # the row keys; block n's are fold_in(row key, n)
  tail_B: Array  # each row's tail tokens at the start of the first block
  block: Array  # n, the block being denoised (int32)
  index: Array  # the block's next step (int32)
  ended_B: Array  # rows that wrote EOS in a finished block
  cache: Any  # the canvas's keys and values (cached), else None
  inner: Carry  # the block's family carry


@dataclasses.dataclass(frozen=True)
class BlockStepper:
  """A step-wise family run block by block: start, step, block_done, commit.

  Hashable (a static argument of jit): `stepper` is the family's spec on a block
  (`Stepper`: its ids), `layout` the run's shapes. Methods take the plain `Denoiser` and
  its params, and the family's per-step plan of one block (leading axis K)."""

  stepper: Stepper
  layout: BlockLayout

  def num_steps(self) -> int:
    """K, the family's steps a block."""
    return self.stepper.num_steps(self.layout.blocks_of)

  def _canvas(self, carry: BlockCarry, n: Array):
    layout = self.layout
    return block_canvas(n, carry.tokens_BxS, valid_BxS=carry.valid_BxS,
                        longest_prompt=carry.longest_prompt, prompt_len=layout.prompt_width,
                        window=layout.window, blocks_of=layout.blocks_of)

  def _bound(self, denoiser: Denoiser, params, carry: BlockCarry, n: Array) -> BoundDenoiser:
    """The block's denoiser on block n's canvas (its cache, or its tokens)."""
    _, offset, tokens_BxC, valid_BxC = self._canvas(carry, n)
    context = carry.cache if self.layout.cached else tokens_BxC
    return self.stepper.bind(block_denoiser(denoiser, offset, self.layout.cached), params,
                             valid_BxC, context=context)

  def _open(self, denoiser: Denoiser, params, carry: BlockCarry, n: Array,
            refresh: str) -> BlockCarry:
    """`carry` at step 0 of block n: its cache refreshed (`refreshed_cache`'s `how`; "given":
    kept as the carry holds it), its family carry started on the block's tokens with the
    block's keys."""
    layout = self.layout
    cache = carry.cache
    if layout.cached and refresh != "given":
      fits, offset, tokens_BxC, valid_BxC = self._canvas(carry, n)
      canvas = BoundDenoiser(denoiser, params, valid_BxL=valid_BxC)
      cache = refreshed_cache(canvas, n, cache, fits, offset, tokens_BxC, layout.blocks_of,
                              refresh)
    carry = carry.replace(block=n, index=jnp.int32(0), cache=cache)
    block_BxW = jax.lax.dynamic_slice_in_dim(carry.tokens_BxS, layout.first + n * layout.blocks_of,
                                             layout.blocks_of, axis=1)
    keys_B = jax.vmap(jax.random.fold_in, (0, None))(carry.keys_B, n)
    inner = self.stepper.start(self._bound(denoiser, params, carry, n), keys_B, block_BxW)
    return carry.replace(inner=inner)

  def start(self, denoiser: Denoiser, params, keys_B: Array, whole_BxP, valid_BxP,
            tail_BxR, cache=None) -> BlockCarry:
    """The carry at step 0 of block 0: the prompts' whole blocks `whole_BxP` (valid:
    `valid_BxP`, left padding False) and tails `tail_BxR` (`block_generation.split_tails`;
    R = layout.tail_width); keys_B: the row keys. The first block's cache is encoded here
    (one pass over its canvas), unless `cache` gives it: the cache this start encoded for
    prompts of the same whole blocks (exactly this one's: a block-causal canvas's keys and
    values of the prompt do not depend on what follows it, and the positions from the
    first block on are written by its passes before they are read, or masked)."""
    layout, mask_id = self.layout, self.stepper.mask_id
    batch = whole_BxP.shape[0]
    tokens_BxS, valid_BxS = sequence(jnp.asarray(whole_BxP, jnp.int32), jnp.asarray(valid_BxP),
                                     jnp.asarray(tail_BxR, jnp.int32), mask_id=mask_id,
                                     window=layout.window,
                                     span_length=layout.num_blocks * layout.blocks_of)
    given = cache
    if given is None and layout.cached:  # zeros of the prefill's shapes, encoded by `_open`
      span = layout.span
      cache = kv_cache.init(BoundDenoiser(denoiser, params, valid_BxL=valid_BxS[:, :span]),
                            tokens_BxS[:, :span]).cache
    blank = Carry(state=None, ctx=None, invalid_B=None)
    carry = BlockCarry(tokens_BxS=tokens_BxS, valid_BxS=valid_BxS,
                       longest_prompt=jnp.asarray(valid_BxP).sum(-1).max().astype(jnp.int32),
                       keys_B=keys_B, tail_B=(jnp.asarray(tail_BxR) != mask_id).sum(-1),
                       block=jnp.int32(0), index=jnp.int32(0),
                       ended_B=jnp.zeros((batch,), bool), cache=cache, inner=blank)
    return self._open(denoiser, params, carry, jnp.int32(0),
                      "encode" if given is None else "given")

  def step(self, denoiser: Denoiser, params, carry: BlockCarry, plan_K) -> BlockCarry:
    """One step of the current block's family (the index clamped to its last step)."""
    index = jnp.minimum(carry.index, self.num_steps() - 1)
    bound = self._bound(denoiser, params, carry, carry.block)
    inner = self.stepper.step(bound, carry.inner, index, plan_K)
    return carry.replace(inner=inner, index=index + 1)

  def block_done(self, carry: BlockCarry) -> Array:
    """Per row: the current block is finished (its steps are spent or it has nothing left
    to write, `Stepper.done`)."""
    return self.stepper.done(carry.inner, carry.index)

  def block_tokens(self, carry: BlockCarry) -> tuple[Array, Array]:
    """(block_BxW, ended_B): the current block as it would be committed now (ended rows'
    all EOS) and the rows that have ended once it is."""
    layout = self.layout
    n = carry.block
    written_BxW = (n * layout.blocks_of + jnp.arange(layout.blocks_of))[None] >= carry.tail_B[:, None]
    return EndOfRow.of(self.stepper.spec).after_block(carry.inner.tokens_BxL, carry.ended_B,
                                                      written_BxW)

  def tokens(self, carry: BlockCarry) -> Array:
    """tokens_BxS: the sequence with the current block as it stands written in."""
    layout = self.layout
    return jax.lax.dynamic_update_slice_in_dim(
        carry.tokens_BxS, carry.inner.tokens_BxL, layout.first + carry.block * layout.blocks_of,
        axis=1)

  def commit(self, denoiser: Denoiser, params, carry: BlockCarry,
             refresh: str = "either") -> BlockCarry:
    """The current block written into the sequence and the next block opened: its cache
    appended or encoded anew (`refreshed_cache`'s `how`: a caller who knows whether the
    window slid names it, so the program runs one pass), its family carry started."""
    layout = self.layout
    block_BxW, ended_B = self.block_tokens(carry)
    tokens_BxS = jax.lax.dynamic_update_slice_in_dim(
        carry.tokens_BxS, block_BxW, layout.first + carry.block * layout.blocks_of, axis=1)
    carry = carry.replace(tokens_BxS=tokens_BxS, ended_B=ended_B)
    return self._open(denoiser, params, carry, carry.block + 1, refresh)

  def generated(self, tokens_BxS: Array, tail_B: Array, length: int) -> Array:
    """generated_BxG: each row's first `length` positions after its tail."""
    layout = self.layout
    return generated(tokens_BxS, tail_B, first=layout.first, tail_width=layout.tail_width,
                     length=length)
