"""A canvases lane: DiffusionGemma's default sampler (`diffusion_gemma_canvases`: canvases in
turn, each denoised against the cache of the prompt and the canvases before it, then
appended to it by the encoder pass) served one denoising step a tick, on the public door
`sampling.canvas_stepping.CanvasesStepper`.

A slot here is a request's n rows together, run as `mdjax.generate(model, [prompt] * n)`
runs them: one batch of n rows on a canvas of exactly prompt + max_new_tokens positions,
with its keys. A tick advances each live slot one step of its current canvas
(`CanvasesStepper.step`: one decoder pass) and, in the same program, where every row's
canvas is done, commits it (`CanvasesStepper.commit`: the canvas written, its stop ids
read, one encoder pass appending it to the cache, the next canvas opened), as a block
lane's commit ends a block. A row leaves the tick its canvas held a stop id or its last
canvas closed; its slot runs on for the request's other rows.

Why a request's rows run as one batch, in its own program call, and not vmapped with other
requests' rows as the other lanes run theirs: XLA's matmuls round differently at different
batch sizes (a decoder pass of a row alone and of the same row among three differ in the
last bits, on this CPU), and DiffusionGemma rounds its self-conditioning embeddings to
bfloat16 between steps, where a last-bit difference flips a rounding now and then and the
rest of the canvas follows (tests/formats/test_diffusion_gemma_canvases.py's stability
counts). So a row equals `generate`'s token for token only when its passes have the shapes
`generate`'s have: n rows, the canvas of its prompt alone. The price: requests do not share
a denoiser pass (each live slot is one program call a tick, its rows batched).
"""

from __future__ import annotations

import collections
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from mdjax import generation, sampling
from mdjax.sampling.canvas_stepping import CanvasesStepper
from mdjax.serve import lanes

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class CanvasesRun:
  """A request's layout on a canvases lane: the door (the spec on the canvas's ids), the
  rows a slot runs together (the request's n) and the canvas's positions (its prompt and
  max_new_tokens)."""

  stepper: CanvasesStepper
  rows: int
  length: int

  def describe(self) -> str:
    spec = self.stepper.spec
    return (f"canvas by canvas: {spec.canvases} of {spec.reference_length}, the prompt and "
            "finished canvases in DiffusionGemma's cache (encoder passes)")


def canvases_run(model, ids, run, params, *, max_new_tokens: int, n: int, room: int,
                 names: dict):
  """(tokens_1xS, valid_1xS, `sampling.prepare`'s `Prepared`, `CanvasesRun`) of a request
  whose sampler is DiffusionGemma's canvases: generate's canvas of its prompt alone
  (prompt + max_new_tokens positions, within the engine's `room`), checked as `sample`
  checks it."""
  generation.plan_generation([len(ids)], max_new_tokens, max_len=room, **names)
  length = len(ids) + max_new_tokens
  tokens, valid, _ = generation.left_padded([ids], length, model.mask_id, pad_id=model.pad_id,
                                            start=len(ids))
  prepared = sampling.prepare(run.denoiser, params, jax.random.key(0)[None], tokens, run.spec,
                              mask_id=model.mask_id,
                              valid_BxL=valid if model.takes_padding else None)
  stepper = CanvasesStepper(run.spec, prepared.stepper.mask_id, prepared.stepper.vocab_size)
  return tokens, valid, prepared, CanvasesRun(stepper, n, length)


def _started(denoiser, params, keys_B, tokens_BxL, valid_BxL, *, stepper: CanvasesStepper):
  """A slot's state: the prompt encoded, canvas 0 opened (`CanvasesStepper.start`)."""
  return stepper.start(stepper.bind(denoiser, params, valid_BxL), keys_B, tokens_BxL,
                       valid_BxL)


def _start(denoiser, params, keys_B, tokens_BxL, valid_BxL, *, stepper: CanvasesStepper):
  lanes.count_trace()
  return _started(denoiser, params, keys_B, tokens_BxL, valid_BxL, stepper=stepper)


def _advance(denoiser, params, state, plan, valid_BxL, *, stepper: CanvasesStepper):
  """One step of the slot's current canvas, and its commit where every row's canvas is
  done: (state, and per row: the generated positions as they stand, whether it goes on,
  its generated length, its steps so far)."""
  lanes.count_trace()
  bound = stepper.bind(denoiser, params, valid_BxL)
  state = stepper.step(bound, state, plan)
  state = jax.lax.cond(stepper.canvas_done(state), lambda s: stepper.commit(bound, s),
                       lambda s: s, state)
  tokens_BxL = stepper.tokens(state)
  spec = stepper.spec
  generated_BxG = tokens_BxL[:, -spec.canvases * spec.reference_length:]
  lengths_B = sampling.EndOfRow.of(spec).generated_length(tokens_BxL, state.ctx.editable_BxL,
                                                          stepper.mask_id)
  steps = jnp.minimum(state.canvas, spec.canvases) * spec.steps + state.index
  batch = tokens_BxL.shape[0]
  return state, (generated_BxG, ~stepper.done(state), lengths_B,
                 jnp.full((batch,), steps, jnp.int32))


class CanvasesPrograms:
  """A canvases lane's compiled programs (its own copies: dropped with it)."""

  def __init__(self):
    self.start = jax.jit(lanes.own_copy(_start), static_argnames=("denoiser", "stepper"))
    self.advance = jax.jit(lanes.own_copy(_advance), static_argnames=("denoiser", "stepper"),
                           donate_argnames=("state",))


class CanvasesLane:
  """The slots of one canvases setting (`Job.canvases`): `slots // n` slots of a request's n
  rows (module docstring). To the engine it is a lane of `slots` rows (`owners`): row r of
  slot g is row g * n + r; a request's rows are admitted together into one free slot."""

  def __init__(self, job, slots: int, padded: bool):
    run = job.canvases
    self.key = job.lane_key
    self.run = run
    self.family = job.stepper.family
    self.denoiser, self.params, self.plan = job.denoiser, job.params, job.plan
    self.group = run.rows
    self.slots = slots // self.group * self.group
    self.owners: list[lanes.Slot | None] = [None] * self.slots
    self.states: list = [None] * (self.slots // self.group)  # a slot's device state, or None
    self.tokens_BxS = np.repeat(job.tokens_1xS, self.group, 0)
    self.valid_BxS = np.repeat(job.valid_1xS, self.group, 0) if padded else None
    self.programs = CanvasesPrograms()
    self.ticks_by_bucket: collections.Counter[int] = collections.Counter()
    self.filling: dict[int, int] = {}  # a request being admitted: id(handle) -> its slot
    self.last_used = time.monotonic()

  @property
  def active(self) -> int:
    return sum(owner is not None for owner in self.owners)

  @property
  def rows(self) -> list:
    """The live slots' device states."""
    return [state for state in self.states if state is not None]

  def free_slot(self) -> int | None:
    """The row the next admitted row takes: the next of a request being admitted, else the
    first row of a free slot (None: none is free)."""
    for slot in self.filling.values():
      return slot * self.group + sum(o is not None for o in
                                     self.owners[slot * self.group:(slot + 1) * self.group])
    free = [g for g, state in enumerate(self.states) if state is None]
    return free[0] * self.group if free else None

  def admit(self, handle, choice: int) -> None:
    """Row `choice` of a request: its first row starts the request's slot (all n rows,
    each keyed `fold_in(key(seed), row)` as generate keys them: one encoder pass)."""
    job = handle.job
    if choice == 0:
      slot = next(g for g, state in enumerate(self.states) if state is None)
      keys_B = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(job.seed),
                                                        np.arange(self.group))
      self.states[slot] = self.programs.start(self.denoiser, self.params, keys_B,
                                              self.tokens_BxS, self.valid_BxS,
                                              stepper=self.run.stepper)
      self.filling[id(handle)] = slot
    slot = self.filling[id(handle)]
    if choice == self.group - 1:
      del self.filling[id(handle)]
    self.owners[slot * self.group + choice] = lanes.Slot(handle, choice, time.monotonic())
    self.last_used = time.monotonic()

  def release(self, slots, idle: bool = False) -> None:
    """The rows of `slots` leave; a slot none of whose rows is held is freed (its rows
    that finished stay in its batch until then: the others' passes keep their shapes)."""
    del idle  # a freed slot is not ticked again
    for row in slots:
      self.owners[row] = None
    for slot in range(len(self.states)):
      rows = self.owners[slot * self.group:(slot + 1) * self.group]
      if all(owner is None for owner in rows) and slot not in self.filling.values():
        self.states[slot] = None

  def bucket(self, active: int | None = None) -> int:
    """Every live slot runs alone: one program, whatever the rows."""
    del active
    return self.slots

  def tick(self, bucket: int | None = None) -> lanes.TickOutputs:
    """One step of every live slot (one program call each): the outputs of their rows."""
    front, outputs = [], []
    for slot, state in enumerate(self.states):
      if state is None:
        continue
      self.states[slot], out = self.programs.advance(
          self.denoiser, self.params, state, self.plan, self.valid_BxS,
          stepper=self.run.stepper)
      front += range(slot * self.group, (slot + 1) * self.group)
      outputs.append(out)
    self.ticks_by_bucket[self.bucket() if bucket is None else bucket] += 1
    self.last_used = time.monotonic()
    if not outputs:
      return lanes.TickOutputs([], self.slots, np.zeros(0, bool), np.zeros((0, 1), np.int32),
                               np.zeros(0, np.int32), np.zeros(0, np.int32))
    tokens, active, lengths, steps = (jnp.concatenate(parts) for parts in zip(*outputs))
    return lanes.TickOutputs(front, self.slots, np.asarray(active), tokens, lengths, steps)

  def canvas_ids(self, tokens_NxG: np.ndarray, slot: int, job) -> np.ndarray:
    return tokens_NxG[slot, :job.max_new_tokens]

  def warm(self, job) -> None:
    """Compiles the start and the step (an idle lane only; the state made is dropped)."""
    if self.active:
      raise RuntimeError("warm() runs on an idle lane only")
    keys_B = jax.random.split(jax.random.key(0), self.group)
    state = self.programs.start(self.denoiser, self.params, keys_B, self.tokens_BxS,
                                self.valid_BxS, stepper=self.run.stepper)
    self.programs.advance(self.denoiser, self.params, state, self.plan, self.valid_BxS,
                          stepper=self.run.stepper)

  @classmethod
  def row_bytes(cls, job, padded: bool) -> int:
    """Device bytes of a row: its slot's state (the n rows' canvas, cache and carries)
    over n, from shapes (nothing compiles)."""
    run = job.canvases
    tokens_BxS = np.repeat(job.tokens_1xS, run.rows, 0)
    valid_BxS = np.repeat(job.valid_1xS, run.rows, 0) if padded else None
    keys_B = jax.random.split(jax.random.key(0), run.rows)
    start = lambda params, keys, tokens, valid: _started(job.denoiser, params, keys, tokens,
                                                         valid, stepper=run.stepper)
    return -(-lanes.shape_bytes(start, job.params, keys_B, tokens_BxS, valid_BxS) // run.rows)
