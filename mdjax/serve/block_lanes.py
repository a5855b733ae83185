"""A block lane: the slots of one block-by-block decoder (SDAR, Fast-dLLM v2, LLaDA2,
BD3-LM, any family run by `sample_blocks`), each row at its own block and step.

Each row is a one-row `sampling.block_stepping.BlockCarry`: its sequence, its block's
canvas cache, the block's family carry. A tick advances every active row one step of its
block's decoder (`BlockStepper.step`, vmapped over rows, the block offsets per row); rows
whose block finished and that go on are then committed by a second program (`commit`:
the block written into the sequence, one pass appending its keys and values to the row's
cache, or encoding the slid window anew, and the next block started), run over those rows
only (gathered into a power-of-two bucket). The host learns which rows commit, and whether
a row's window slid (so the commit runs one kind of pass), from the tick's results it reads
back anyway. A row leaves the tick its last block is done or it wrote EOS.

Exactly `mdjax.generate`: a row's canvas, cache, keys and steps are those `sample_blocks`
gives its prompt alone. On a model whose positions count from each row's first token
(`Model.padding_invariant`) the lane's window holds any prompt and generation the engine
admits (`block_layout`), so prompts of any length share a lane; where a row's own window
slides (BD3-LM past its length), or the model has absolute positions, its lane has exactly
the window `generate` uses.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax import generation
from mdjax.denoiser import Denoiser
from mdjax.sampling.block_generation import check_blocks, split_tails
from mdjax.sampling.block_stepping import BlockCarry, BlockLayout, BlockStepper
from mdjax.sampling.end_of_row import EndOfRow
from mdjax.sampling.stepping import Stepper
from mdjax.serve import lanes
from mdjax.serve.lanes import Lane
from mdjax.serve.row_axes import RowAxes

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class BlockRun:
  """A request's block-by-block layout on its lane (host arrays of one row).

  stepper: the family on a block and the lane's `BlockLayout`; whole_1xP / valid_1xP /
  tail_1xR: the prompt's whole model blocks right-aligned in P columns (False on padding)
  and its tail (`split_tails`); longest: the whole prompt's positions; blocks: the blocks
  the row runs (its new tokens and tail in whole blocks)."""

  stepper: BlockStepper
  whole_1xP: np.ndarray
  valid_1xP: np.ndarray
  tail_1xR: np.ndarray
  longest: int
  blocks: int

  @property
  def num_steps(self) -> int:
    return self.blocks * self.stepper.num_steps()

  def describe(self) -> str:
    layout = self.stepper.layout
    how = "the exact cache of finished blocks" if layout.cached else "recomputed (no cache)"
    return f"block by block: blocks of {layout.blocks_of}, {how}"


def block_run(model, ids, run, params, *, max_new_tokens: int, room: int, names: dict):
  """(denoiser, `BlockRun`, the block's plan) of a request whose sampler runs block by block
  (`SamplerPlan.blocks_of`): generate's layout of its prompt alone (`plan_generation`),
  within the engine's `room` like every request."""
  generation.plan_generation([len(ids)], max_new_tokens, max_len=room, **names)
  denoiser = Denoiser.of(run.denoiser)
  plan = generation.plan_generation([len(ids)], max_new_tokens, max_len=model.max_len,
                                    model_block=denoiser.block_size, blocks_of=run.blocks_of,
                                    window=run.window)
  blocks, block_plan = block_layout(
      denoiser, params, ids, run.spec, mask_id=model.mask_id, blocks_of=plan.blocks_of,
      window=plan.window, length=plan.length, room=room,
      padding_invariant=model.padding_invariant)
  return denoiser, blocks, block_plan


def block_layout(denoiser, params, prompt_ids: np.ndarray, spec, *, mask_id: int,
                 blocks_of: int, window: int, length: int, room: int,
                 padding_invariant: bool) -> tuple[BlockRun, Any]:
  """(the row's `BlockRun`, the family's per-step plan of one block), checked as
  `sample_blocks` checks them. generate's layout for the prompt alone is `blocks_of`,
  `window`, `length`; `room`: the engine's positions for a prompt and its new tokens."""
  model_block = denoiser.block_size
  cached = model_block is not None
  prompt_1xP = np.asarray(prompt_ids, np.int32)[None]
  tail = len(prompt_ids) % model_block if cached else 0
  longest = len(prompt_ids) - tail
  blocks = -(-(length + tail) // blocks_of)
  holds_all = (blocks - 1) * blocks_of + longest <= window  # generate's window never slides
  lane_new = -(-room // blocks_of) * blocks_of
  lane_window = lane_new + blocks_of
  if padding_invariant and holds_all and (blocks - 1) * blocks_of + longest <= lane_window:
    # One lane for every prompt the engine admits: a window that never slides either.
    window, width = lane_window, room
    tail_width = model_block - 1 if cached else 0
    lane_length = lane_new
  else:
    width, tail_width, lane_length = longest, tail, length
  family, plan, _, vocab_size = check_blocks(
      denoiser, params, prompt_1xP, spec, length=lane_length, blocks_of=blocks_of,
      window=window, mask_id=mask_id, valid=None, cached=cached)
  del family
  layout = BlockLayout(blocks_of=blocks_of, window=window, prompt_width=width,
                       tail_width=tail_width,
                       num_blocks=-(-(lane_length + tail_width) // blocks_of), cached=cached)
  whole_1xP = np.zeros((1, width), np.int32)
  valid_1xP = np.zeros((1, width), bool)
  whole_1xP[0, width - longest:] = prompt_1xP[0, :longest]
  valid_1xP[0, width - longest:] = True
  tail_1xR = np.full((1, tail_width), mask_id, np.int32)
  if tail:
    _, _, own_tail = split_tails(prompt_1xP, np.ones_like(prompt_1xP, bool), model_block,
                                 mask_id)
    tail_1xR[0, :tail] = own_tail[0]
  stepper = BlockStepper(Stepper(spec, mask_id, vocab_size), layout)
  return BlockRun(stepper, whole_1xP, valid_1xP, tail_1xR, longest, blocks), plan


@struct.dataclass
class BlockRow:
  """One slot: a one-row block carry, its plan, the blocks it runs, whether it is live."""

  carry: BlockCarry
  plan: Any
  blocks: Array
  active: Array


_STATIC = ("denoiser", "stepper", "sharding", "axes")


def _start_rows(denoiser, params, keys_B, whole_BxP, valid_BxP, tail_BxR, plan, blocks,
                cache=None, *, stepper: BlockStepper, sharding=None, axes=None) -> BlockRow:
  """A slot's state started on B rows (a lane's slot holds one: `_start_row`)."""
  carry = stepper.start(denoiser, params, keys_B, whole_BxP, valid_BxP, tail_BxR, cache)
  return BlockRow(carry=carry, plan=plan, blocks=jnp.int32(blocks), active=jnp.bool_(True))


def _start_row(denoiser, params, key, whole_1xP, valid_1xP, tail_1xR, plan, blocks,
               cache=None, **static) -> BlockRow:
  return _start_rows(denoiser, params, key[None], whole_1xP, valid_1xP, tail_1xR, plan,
                     blocks, cache, **static)


def _empty_lane(denoiser, params, key, whole_1xP, valid_1xP, tail_1xR, plan, blocks, *, slots,
                **static):
  lanes.count_trace()
  axes: RowAxes = static["axes"]
  row = _start_row(denoiser, params, key, whole_1xP, valid_1xP, tail_1xR, plan, blocks,
                   **static)
  rows = axes.stack(row, slots)
  return axes.placed(rows.replace(active=jnp.zeros((slots,), bool)), static["sharding"])


def _admit(denoiser, params, rows, slot, key, whole_1xP, valid_1xP, tail_1xR, plan, blocks,
           cache=None, **static):
  """The rows with slot `slot` started on a new row (its start cache `cache` when the prefix
  cache holds it: no pass then)."""
  lanes.count_trace()
  axes: RowAxes = static["axes"]
  row = _start_row(denoiser, params, key, whole_1xP, valid_1xP, tail_1xR, plan, blocks, cache,
                   **static)
  return axes.placed(axes.put(rows, slot, row), static["sharding"])


def _start_cache(rows, slot, *, axes: RowAxes):
  """The cache of the row in `slot` (a copy: its start cache, read right after `admit`)."""
  lanes.count_trace()
  return axes.take(rows, slot).carry.cache


def _tick(denoiser, params, rows, *, stepper: BlockStepper, sharding, axes: RowAxes, bucket,
          split, view):
  """One step of every active row among the `bucket` front slots: (rows, and of those
  slots: tokens_BxG (each row's first `view` generated positions, its block as it
  stands), active_B, generated_length_B, steps_B, commits_B (the block finished and the
  row goes on), block_B)."""
  lanes.count_trace()
  end, num_steps = EndOfRow.of(stepper.stepper.spec), stepper.num_steps()

  def step(row: BlockRow):
    carry = stepper.step(denoiser, params, row.carry, row.plan)
    carry = jax.tree.map(lambda new, old: jnp.where(row.active, new, old), carry, row.carry)
    done = stepper.block_done(carry)[0] & row.active
    _, ended_1 = stepper.block_tokens(carry)
    finishes = done & (ended_1[0] | (carry.block + 1 >= row.blocks))
    tokens_1xG = stepper.generated(stepper.tokens(carry), carry.tail_B, view)
    length = end.generated_length(tokens_1xG, jnp.ones(tokens_1xG.shape, bool),
                                  stepper.stepper.mask_id)[0]
    row = row.replace(carry=carry, active=row.active & ~finishes)
    return row, (tokens_1xG[0], row.active, length, carry.block * num_steps + carry.index,
                 done & ~finishes, carry.block)

  if bucket == rows.active.shape[0]:
    rows, outputs = axes.vmap(step, out_rows=False)(rows)
    rows = axes.placed(rows, sharding)
  else:
    front = axes.front(rows, split, bucket)
    front, outputs = axes.vmap(step, out_rows=False)(axes.placed(front, sharding))
    rows = axes.placed(axes.put_front(rows, front, split), sharding)
  return (rows,) + outputs


def _commit(denoiser, params, rows, slots_C, *, stepper: BlockStepper, sharding,
            axes: RowAxes, refresh):
  """The rows of `slots_C` (repeats allowed: they compute the same row) committed:
  their block written and the next one opened (`BlockStepper.commit`, `refresh` its
  cache pass)."""
  lanes.count_trace()
  picked = axes.vmap(lambda row: row.replace(
      carry=stepper.commit(denoiser, params, row.carry, refresh)))(axes.gather(rows, slots_C))
  return axes.placed(axes.scatter(rows, slots_C, picked), sharding)


class BlockPrograms:
  """A block lane's compiled programs: `empty`, `admit`, `move`, `tick` (one a bucket) and
  `commit` (one a bucket of committing rows and kind of cache pass)."""

  def __init__(self):
    own = lanes.own_copy
    self.empty = jax.jit(own(_empty_lane), static_argnames=_STATIC + ("slots",))
    self.admit = jax.jit(own(_admit), static_argnames=_STATIC, donate_argnames=("rows",))
    self.move = jax.jit(own(lanes.move_row), static_argnames=_STATIC,
                        donate_argnames=("rows",))
    self.tick = jax.jit(own(_tick), static_argnames=_STATIC + ("bucket", "split", "view"),
                        donate_argnames=("rows",))
    self.commit = jax.jit(own(_commit), static_argnames=_STATIC + ("refresh",),
                          donate_argnames=("rows",))
    self.start_cache = jax.jit(own(_start_cache), static_argnames=("axes",))


class BlockLane(Lane):
  """The slots of one block-by-block decoder (`Job.blocks`): as a `Lane`, with a commit
  program run after each tick over the rows whose block finished."""

  def __init__(self, job, slots: int, padded: bool, prefix_cache=None):
    """As `Lane`'s; prefix_cache: a `prefix_cache.PrefixCache` its rows' start caches are
    kept in and taken from (an exact cache of finished blocks only)."""
    run: BlockRun = job.blocks
    self.key = job.lane_key
    self.run = run
    self.family = run.stepper.stepper.family
    sharding = lanes.row_sharding(job.params, slots)
    self.static = dict(denoiser=job.denoiser, stepper=run.stepper, sharding=sharding,
                       axes=self.row_axes(job, padded))
    self.params, self.num_steps = job.params, run.num_steps
    self.slots = slots
    self.split = lanes.data_split(sharding, slots)
    part = slots // self.split
    self.order = [(i % self.split) * part + i // self.split for i in range(slots)]
    self.owners = [None] * slots
    self.programs = BlockPrograms()
    layout = run.stepper.layout
    self.view = layout.num_blocks * layout.blocks_of - layout.tail_width
    self.rows = self.programs.empty(job.denoiser, job.params, jax.random.key(0),
                                    *self.row_inputs(job), slots=slots,
                                    **lanes.lane_static(self.static))
    self.ticks_by_bucket = collections.Counter()
    self.commits = 0  # rows committed (a block finished and the row went on)
    self.full_next, self.full_passes = None, 0  # (a canvas lane's KV cache plan)
    self.last_used = time.monotonic()
    self.prefix = prefix_cache if layout.cached else None
    self.model_block = job.denoiser.block_size

  @staticmethod
  def row_axes(job, padded: bool) -> RowAxes:
    """As `Lane.row_axes`."""
    del padded  # a block row always reads its validity
    run = job.blocks
    start = functools.partial(_start_rows, job.denoiser, stepper=run.stepper)
    two = lambda x: np.concatenate([x, x])
    one_row = jax.eval_shape(start, job.params, jax.random.key(0)[None], run.whole_1xP,
                             run.valid_1xP, run.tail_1xR, job.plan, np.int32(run.blocks))
    two_rows = jax.eval_shape(start, job.params, jax.random.split(jax.random.key(0)),
                              two(run.whole_1xP), two(run.valid_1xP), two(run.tail_1xR),
                              job.plan, np.int32(run.blocks))
    return RowAxes.of(one_row, two_rows)

  @classmethod
  def row_bytes(cls, job, padded: bool) -> int:
    """As `Lane.row_bytes`: a slot's sequence, its canvas's cache, its block's carry."""
    del padded  # a block row always reads its validity
    start = functools.partial(_start_row, job.denoiser, stepper=job.blocks.stepper)
    return lanes.shape_bytes(start, job.params, jax.random.key(0), *cls.row_inputs(job))

  @staticmethod
  def row_inputs(job):
    run = job.blocks
    return (run.whole_1xP, run.valid_1xP, run.tail_1xR, job.plan, np.int32(run.blocks))

  def canvas_ids(self, tokens_NxG: np.ndarray, slot: int, job) -> np.ndarray:
    return tokens_NxG[slot, :job.max_new_tokens]

  def admit(self, handle, choice: int) -> None:
    """As `Lane.admit`; with a prefix cache the row's start cache is taken from it when it
    holds the prompt's whole blocks (no pass), else kept there after the row's start."""
    if self.prefix is None:
      return super().admit(handle, choice)
    slot, job = self.free_slot(), handle.job
    run, static = job.blocks, lanes.lane_static(self.static)
    blocks = self.prefix.blocks(run.whole_1xP[0, run.whole_1xP.shape[1] - run.longest:],
                                self.model_block)
    entry = self.prefix.lookup(self.key, blocks)
    key = jax.random.fold_in(jax.random.key(job.seed), choice)  # generate's row key
    self.rows = self.programs.admit(job.denoiser, self.params, self.rows, np.int32(slot), key,
                                    *self.row_inputs(job),
                                    **({} if entry is None else {"cache": entry}), **static)
    if entry is None:
      self.prefix.insert(self.key, blocks, self.programs.start_cache(
          self.rows, np.int32(slot), axes=self.static["axes"]))
    self.owners[slot] = lanes.Slot(handle, choice, time.monotonic())
    self.last_used = time.monotonic()

  def tick(self, bucket: int | None = None):
    bucket = self.bucket() if bucket is None else bucket
    static = lanes.lane_static(self.static)
    self.rows, tokens, active, lengths, steps, commits, block = self.programs.tick(
        self.static["denoiser"], self.params, self.rows, bucket=bucket, split=self.split,
        view=self.view, **static)
    self.ticks_by_bucket[bucket] += 1
    front = self.front(bucket)
    commits, block = np.asarray(commits), np.asarray(block)
    self._commit([slot for slot, go in zip(front, commits) if go],
                 {slot: int(n) for slot, n in zip(front, block)})
    self.last_used = time.monotonic()
    return lanes.TickOutputs(front, self.slots, active, tokens, lengths, steps)

  def _commit(self, slots: list[int], block: dict[int, int]) -> None:
    """Commits the rows of `slots`, those whose window stays put by one appending pass and
    those whose window slid by one encoding pass (two programs, each run only when needed)."""
    layout = self.run.stepper.layout
    kinds: dict[str, list[int]] = {}
    for slot in slots:
      longest = self.owners[slot].handle.job.blocks.longest
      fits = not layout.cached or layout.fits(block[slot] + 1, longest)
      kinds.setdefault("append" if fits else "encode", []).append(slot)
    for refresh, chosen in kinds.items():
      size = 1 << max(0, len(chosen) - 1).bit_length()
      slots_C = np.asarray(chosen + [chosen[0]] * (size - len(chosen)), np.int32)
      self.rows = self.programs.commit(self.static["denoiser"], self.params, self.rows,
                                       slots_C, refresh=refresh,
                                       **lanes.lane_static(self.static))
      self.commits += len(chosen)

  def warm(self, job) -> None:
    """Compiles admit, move, every bucket's tick and the commits, and with a prefix cache
    the admit from a cache and the read of one (an idle lane only)."""
    super().warm(job)
    layout = self.run.stepper.layout
    if self.prefix is not None:
      static = lanes.lane_static(self.static)
      cache = self.programs.start_cache(self.rows, np.int32(0), axes=self.static["axes"])
      self.rows = self.programs.admit(job.denoiser, self.params, self.rows, np.int32(0),
                                      jax.random.key(0), *self.row_inputs(job), cache=cache,
                                      **static)
      self.rows = self.programs.move(self.rows, np.int32(0), np.int32(0), **static)
    may_slide = layout.cached and not layout.fits(layout.num_blocks - 1, 0)
    for refresh in ("append", "encode") if may_slide else ("append",):
      size = 1
      while True:
        self.rows = self.programs.commit(self.static["denoiser"], self.params, self.rows,
                                         np.zeros(size, np.int32), refresh=refresh,
                                         **lanes.lane_static(self.static))
        if size >= self.slots:
          break
        size *= 2
