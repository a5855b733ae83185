"""The end of a row: what a spec's end-of-sequence id (`SamplerSpec.eos_id`) does to a run.

A row that has written EOS at an editable position i, with every position before i written,
is finished: it stops changing, its editable positions after i become EOS, and its
generated length is the editable positions before i. `EndOfRow.of(spec)` is the policy the
driver, composite families and block-by-block generation ask, so none of them branches on
the id: `EndOfRow` itself (no id) leaves every row open and the program as it is;
`EndAtEos` ends rows at their EOS; `EndAfterRun` (uniform noise, whose canvas holds tokens
everywhere from the start) leaves every row open during the run and only counts the
generated length: such a family fills after each row's first EOS itself, at its last step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp

from mdjax.sampling.base import Context, Core, family_of

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class EndOfRow:
  """No end of sequence: rows never finish early, and every method leaves things as they are."""

  # Rows that end early leave idle steps that cannot be counted before the run.
  leaves_idle_steps: ClassVar[bool] = False

  @staticmethod
  def of(spec) -> "EndOfRow":
    """The policy of a spec: its `eos_id`, or none (`EndAfterRun` for a family whose canvas
    holds no mask)."""
    if spec.eos_id is None:
      return EndOfRow()
    return (EndAfterRun if family_of(spec).ends_rows_at_the_end else EndAtEos)(spec.eos_id)

  def check_vocabulary(self, vocab_size: int, mask_id: int | None = None) -> None:
    """Raises ValueError when the EOS id is not a token id: in [0, V) and not the mask id
    (host side; `mask_id` None: V is the mask id)."""

  def open(self, ctx: Context, tokens_BxL: Array) -> Context:
    """`ctx` with the positions of finished rows no longer editable (they stop changing)."""
    return ctx

  def finish(self, core: Core, ctx: Context, step: Array) -> Core:
    """Writes EOS at the editable positions after the first EOS of every finished row."""
    return core

  def any_open(self, tokens_BxL: Array, ctx: Context) -> Array | bool:
    """Whether some row is not finished (once none is, no step calls the denoiser)."""
    return True

  def open_rows(self, tokens_BxL: Array, ctx: Context) -> Array:
    """Per row: not finished (no row is, without an EOS id)."""
    return jnp.ones(tokens_BxL.shape[:1], bool)

  def generated_length(self, tokens_BxL: Array, editable_BxL: Array, mask_id: int) -> Array:
    """Editable positions of each row before its first EOS (all of them without one)."""
    return editable_BxL.sum(-1, dtype=jnp.int32)

  def unless_ended(self, ended_B: Array, run: Callable[[], Any], idle: Callable[[], Any]):
    """`run()`, or `idle()` once every row has ended (no pass for a block nobody writes)."""
    return run()

  def after_block(self, block_BxW: Array, ended_B: Array,
                  written_BxW: Array) -> tuple[Array, Array]:
    """(block, ended): a generated block with ended rows all EOS, and the rows that have
    ended after it (an EOS at a `written` position: one the block generated)."""
    return block_BxW, ended_B


@dataclasses.dataclass(frozen=True)
class EndAtEos(EndOfRow):
  """Rows end at their first EOS (`eos_id`)."""

  eos_id: int
  leaves_idle_steps: ClassVar[bool] = True

  def check_vocabulary(self, vocab_size, mask_id=None):
    mask_id = vocab_size if mask_id is None else mask_id
    if not 0 <= self.eos_id < vocab_size:
      raise ValueError(f"spec.eos_id={self.eos_id} is outside the vocabulary: token ids are "
                       f"0..{vocab_size - 1} (the mask id is {mask_id}).")
    if self.eos_id == mask_id:
      raise ValueError(f"spec.eos_id={self.eos_id} is the mask id; the end-of-sequence id "
                       "must be a token id other than the mask's.")

  def state(self, tokens_BxL: Array, editable_BxL: Array, mask_id: int):
    """(first_B, finished_B): each row's first EOS at an editable position (L if none), and
    whether the row is finished: it has one and every position before it is written."""
    length = tokens_BxL.shape[1]
    eos_BxL = (tokens_BxL == self.eos_id) & editable_BxL
    has_eos_B = eos_BxL.any(-1)
    first_B = jnp.where(has_eos_B, jnp.argmax(eos_BxL, -1), length).astype(jnp.int32)
    before_BxL = jnp.arange(length)[None] < first_B[:, None]
    return first_B, has_eos_B & ~((tokens_BxL == mask_id) & before_BxL).any(-1)

  def open(self, ctx, tokens_BxL):
    _, finished_B = self.state(tokens_BxL, ctx.editable_BxL, ctx.mask_id)
    return ctx.replace(editable_BxL=ctx.editable_BxL & ~finished_B[:, None])

  def finish(self, core, ctx, step):
    first_B, finished_B = self.state(core.tokens_BxL, ctx.editable_BxL, ctx.mask_id)
    after_BxL = jnp.arange(core.tokens_BxL.shape[1])[None] > first_B[:, None]
    fill_BxL = (finished_B[:, None] & after_BxL & ctx.editable_BxL
                & (core.tokens_BxL != self.eos_id))
    return core.commit(fill_BxL, jnp.full_like(core.tokens_BxL, self.eos_id),
                       jnp.ones(core.write_conf_BxL.shape, core.write_conf_BxL.dtype), step)

  def any_open(self, tokens_BxL, ctx):
    return ~self.state(tokens_BxL, ctx.editable_BxL, ctx.mask_id)[1].all()

  def open_rows(self, tokens_BxL, ctx):
    return ~self.state(tokens_BxL, ctx.editable_BxL, ctx.mask_id)[1]

  def generated_length(self, tokens_BxL, editable_BxL, mask_id):
    first_B, _ = self.state(tokens_BxL, editable_BxL, mask_id)
    before_BxL = jnp.arange(tokens_BxL.shape[1])[None] < first_B[:, None]
    return (editable_BxL & before_BxL).sum(-1, dtype=jnp.int32)

  def unless_ended(self, ended_B, run, idle):
    return jax.lax.cond(ended_B.all(), idle, run)

  def after_block(self, block_BxW, ended_B, written_BxW):
    block_BxW = jnp.where(ended_B[:, None], self.eos_id, block_BxW)
    return block_BxW, ended_B | ((block_BxW == self.eos_id) & written_BxW).any(-1)


@dataclasses.dataclass(frozen=True)
class EndAfterRun(EndAtEos):
  """Rows of a canvas without masks: an EOS drawn mid-run is noise like any token, so no row
  finishes during the run (every method of `EndOfRow`); the family writes EOS after each
  row's first EOS once its run is over (DiffusionGemma truncates at stop tokens after its
  loop), and the generated length counts the positions before it."""

  leaves_idle_steps: ClassVar[bool] = False
  open = EndOfRow.open
  finish = EndOfRow.finish
  any_open = EndOfRow.any_open
  open_rows = EndOfRow.open_rows
  unless_ended = EndOfRow.unless_ended
