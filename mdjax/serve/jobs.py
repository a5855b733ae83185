"""A request as the engine serves it: checked and laid out on the host (`Job`, `prepare_job`),
the `RowUpdate` each of its rows sends after every tick, and the `Handle` that tracks it.

`prepare_job` is everything `Engine.prepare` does that needs no engine state but its bounds:
the request's checks, in the order that costs least (what needs no prompt before the prompt
is encoded, the steps before the plan is built), then its layout: on one canvas
(`sampling.prepare`, a row of `lanes.Lane`) or block by block (`block_lanes.block_run`, a row
of `block_lanes.BlockLane`). Nothing here compiles.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import jax
import numpy as np

from mdjax import generation, sampling
from mdjax.sampling import canvas_stepping
from mdjax.errors import ArgumentError
from mdjax.model import Model
from mdjax.serve import block_lanes, canvas_lanes, limits, served
from mdjax.serve.block_lanes import BlockRun
from mdjax.serve.canvas_lanes import CanvasesRun

MAX_SEED = 2**32 - 1  # a request's seed: jax.random.key's 32 bits (without x64)


@dataclasses.dataclass(frozen=True)
class RowUpdate:
  """A row of a job after a tick (see the module docstring of `mdjax.serve.app`).

  canvas_ids: the row's max_new_tokens generated positions (the mask id where masked).
  committed: leading generated positions that are final (their text will not change).
  final: each generated position's token is final: written by a sampler that never rewrites
    a written token, or the row finished (a rewriting sampler's written tokens are
    provisional until then).
  completion: set once, when the row finished: what `mdjax.generate` returns for it.
  """

  choice: int
  step: int
  num_steps: int
  canvas_ids: np.ndarray
  masked: np.ndarray
  committed: int
  final: np.ndarray
  completion: generation.Completion | None = None
  error: str | None = None


@dataclasses.dataclass(frozen=True)
class Job:
  """A request, checked and laid out on the host: n rows of one prompt under one spec.

  spec: the sampler spec run (`generate(..., spec=job.spec)` reproduces it offline).
  tokens_1xS / valid_1xS: the row's canvas (left padding, prompt, max_new_tokens masks).
  stepper, plan: what `sampling.prepare` made of it: the spec on the canvas's ids, and the
  family's per-step plan (leading axis num_steps).
  """

  prompt_ids: np.ndarray
  max_new_tokens: int
  seed: int
  n: int
  denoiser: Any
  params: Any
  tokens_1xS: np.ndarray
  valid_1xS: np.ndarray
  stepper: sampling.Stepper
  plan: Any
  blocks: BlockRun | None = None  # block by block (`block_lanes`): the row's layout
  kv_plan: Any = None  # a KV-cached spec on one canvas: the cache's per-step plan
  canvases: CanvasesRun | None = None  # DiffusionGemma's canvases (`canvas_lanes`): the door

  @property
  def spec(self):
    return self.stepper.spec

  @property
  def mask_id(self) -> int:
    return self.stepper.mask_id

  @property
  def canvas_length(self) -> int:
    return self.tokens_1xS.shape[1]

  @property
  def num_steps(self) -> int:
    if self.blocks is not None:
      return self.blocks.num_steps
    return self.stepper.num_steps(self.canvas_length)

  @property
  def cache(self) -> str | None:
    """The cache the run decodes against, as a response names it (None: none)."""
    if self.blocks is not None:
      return self.blocks.describe()
    if self.canvases is not None:
      return self.canvases.describe()
    return None if self.kv_plan is None else f"kv_cache={self.spec.kv_cache!r}"

  @property
  def lane_key(self) -> tuple:
    if self.blocks is not None:
      return (self.denoiser, id(self.params), self.blocks.stepper)
    if self.canvases is not None:  # a slot a request: its rows' count is the lane's
      return (self.denoiser, id(self.params), self.canvases)
    return (self.denoiser, id(self.params), self.stepper, self.canvas_length)


class Handle:
  """A submitted job: `cancel()` frees its rows at the next tick; `done` once every row
  finished, was cancelled or failed. The engine's thread `send`s each row's updates (every
  step's, or with every_step False only a row's last: its completion or its error) and
  `close_rows` the rows that leave."""

  def __init__(self, job: Job, on_update: Callable[[RowUpdate], None], every_step: bool = True):
    self.job, self.on_update, self.every_step = job, on_update, every_step
    self.cancelled = False
    self._open = job.n
    self._lock = threading.Lock()

  def cancel(self) -> None:
    self.cancelled = True

  @property
  def done(self) -> bool:
    return self._open == 0

  def close_rows(self, count: int) -> None:
    with self._lock:
      self._open = max(0, self._open - count)

  def send(self, update: RowUpdate) -> None:
    try:
      self.on_update(update)
    except Exception:  # a broken listener loses its rows, never the engine
      self.cancelled = True


def prepare_job(model: Model, prompt, *, room: int, max_steps: int, max_prompt_bytes: int,
                max_new_tokens: int, seed: int, n: int, sampler: str | None,
                knobs: dict | None, where: str, new_tokens: str) -> Job:
  """`Engine.prepare`'s request (n already checked against the engine's slots), checked and
  laid out: room, the positions a row holds; max_steps, max_prompt_bytes: the engine's
  bounds (`mdjax.serve.limits`)."""
  seed = limits.check_int(seed, "seed", 0, MAX_SEED)
  names = dict(prompts=where, new_tokens=new_tokens, room="the server's canvas")
  generation.check_new_tokens(max_new_tokens, room, new_tokens=new_tokens,
                              room=names["room"])
  knobs = dict(knobs or {})
  limits.check_knobs(knobs, max_steps=max_steps, room=room)
  limits.check_prompt_size(prompt, where=where, room=room, max_bytes=max_prompt_bytes)
  if sampler is not None:
    model = model.replace(sampler=served.named_sampler(model, sampler, knobs))
  ids = generation.prompt_ids(model, [prompt], where=where)[0]
  run = generation.sampler_plan(model, len(ids), max_new_tokens, None, **knobs)
  run = dataclasses.replace(run, spec=sampling.with_noise(run.spec, model.noise))
  family = sampling.family_of(run.spec)
  why = served.why_not_served(run, family)
  if why:
    name = (f"sampler={sampler!r}" if sampler else
            f"the model's default sampler ({type(run.spec).__name__})")
    raise ArgumentError("sampler", f"{name} is not served: {why}; use mdjax.generate (or "
                        "sample.py) for it, or a step-wise sampler (confidence, ancestral, "
                        "mdlm, dream, remask, ...).")
  params = model.params if run.params is None else run.params
  lay_out = (block_job if run.blocks_of is not None else
             canvases_job if canvas_stepping.serves(run.spec) else canvas_job)
  return lay_out(model, ids, run, params, max_new_tokens=int(max_new_tokens), seed=seed, n=n,
                 room=room, max_steps=max_steps, names=names)


def canvas_job(model: Model, ids, run, params, *, max_new_tokens: int, seed: int, n: int,
               room: int, max_steps: int, names: dict) -> Job:
  """A request on one canvas (`sampling.sample`'s layout), as a lane of `lanes.Lane`."""
  family = sampling.family_of(run.spec)
  generation.plan_generation([len(ids)], max_new_tokens, max_len=room,
                             block_length=family.block_length(run.spec), **names)
  unpadded = not model.padding_invariant or family.name in served.POSITIONAL
  length = len(ids) + max_new_tokens if unpadded else room
  limits.check_num_steps(sampling.num_steps(run.spec, length), max_steps)
  tokens, valid, _ = generation.left_padded([ids], length, model.mask_id, pad_id=model.pad_id,
                                            start=length - max_new_tokens)
  prepared = sampling.prepare(run.denoiser, params, jax.random.key(seed)[None], tokens,
                              run.spec, mask_id=model.mask_id)
  return Job(prompt_ids=ids, max_new_tokens=max_new_tokens, seed=seed, n=n,
             denoiser=prepared.denoiser, params=params, tokens_1xS=tokens, valid_1xS=valid,
             stepper=prepared.stepper, plan=prepared.plan, kv_plan=prepared.kv_plan)


def block_job(model: Model, ids, run, params, *, max_new_tokens: int, seed: int, n: int,
              room: int, max_steps: int, names: dict) -> Job:
  """A request block by block, as a row of a `block_lanes.BlockLane`."""
  denoiser, blocks, block_plan = block_lanes.block_run(
      model, ids, run, params, max_new_tokens=max_new_tokens, room=room, names=names)
  limits.check_num_steps(blocks.num_steps, max_steps)
  return Job(prompt_ids=ids, max_new_tokens=max_new_tokens, seed=seed, n=n,
             denoiser=denoiser, params=params, tokens_1xS=blocks.whole_1xP,
             valid_1xS=blocks.valid_1xP, stepper=blocks.stepper.stepper, plan=block_plan,
             blocks=blocks)


def canvases_job(model: Model, ids, run, params, *, max_new_tokens: int, seed: int, n: int,
                 room: int, max_steps: int, names: dict) -> Job:
  """A request of DiffusionGemma's canvases, as a slot of a `canvas_lanes.CanvasesLane`."""
  tokens, valid, prepared, canvases = canvas_lanes.canvases_run(
      model, ids, run, params, max_new_tokens=max_new_tokens, n=n, room=room, names=names)
  limits.check_num_steps(canvases.stepper.num_steps(), max_steps)
  return Job(prompt_ids=ids, max_new_tokens=max_new_tokens, seed=seed, n=n,
             denoiser=prepared.denoiser, params=params, tokens_1xS=tokens, valid_1xS=valid,
             stepper=prepared.stepper, plan=prepared.plan, canvases=canvases)
