"""The serving engine: continuous batching at step granularity over the compiled sampler step.

A `Lane` is a fixed number of rows (slots) of one sampler spec on one canvas length. Each
tick is one compiled program that advances every active row of the lane one denoising step,
whatever step each row is at: the public stepping door (`sampling.Stepper.step`), vmapped
over rows, each with its own step index and plan. A request's rows take free slots between ticks and
leave as soon as their canvas is done (or they wrote EOS), so their slots serve the next
request at the next tick. The active rows are kept packed at the front of the lane (a row
that leaves is replaced by the last one), and a tick runs only the front `bucket` slots,
the smallest power of two that holds them: a lone request pays for one row a step, not for
`max_batch`. The shapes of a lane never change and each bucket's program compiles once, on
first use: nothing recompiles while serving once each bucket has run
(`EngineStats.compiles` counts the programs traced; `Engine.warm` compiles them ahead).

Exactly the offline samples: a row is what `mdjax.generate` makes of its prompt alone,
left-padded to the lane's canvas. Row i of a request keys its draws with
`fold_in(key(seed), i)` and step k with `fold_in(row key, k)`; its draws are indexed from its
first real token (`sampling.transforms`), and a padding-invariant model (`Model.
padding_invariant`: positions from the first real token) reads the padding as nothing. So
a request gets what `generate(model, [prompt] * n, max_new_tokens=..., key=key(seed),
spec=job.spec)` gives, token for token, whatever else is being served. A model with absolute
positions (LLaDA) is served on canvases of exactly prompt + max_new_tokens positions (a lane
per length), where nothing pads it.

A request's checks and layout, its rows' updates and its handle are `mdjax.serve.jobs`'s; this
module schedules them.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
from typing import Callable

import numpy as np

from mdjax import generation
from mdjax.errors import ArgumentError
from mdjax.model import Model
from mdjax.serve import lanes as lane_programs
from mdjax.serve import jobs, limits
from mdjax.serve.jobs import Handle, Job, RowUpdate
from mdjax.serve.lane_table import LaneTable
from mdjax.serve.lanes import Lane
from mdjax.serve.prefix_cache import PrefixCache

class QueueFull(Exception):
  """More rows wait than the engine's `max_queue`: try again after `retry_after` seconds."""

  def __init__(self, message: str, retry_after: float):
    super().__init__(message)
    self.retry_after = retry_after


@dataclasses.dataclass(frozen=True)
class EngineStats:
  """What the engine has done so far (all counts since it was made)."""

  queue_rows: int
  active_rows: int
  slots: int
  lanes: int
  ticks: int
  denoiser_calls: int  # batched denoiser passes: one a tick
  completion_tokens: int
  rows_done: int
  compiles: int
  tokens_per_s: float
  ticks_by_bucket: dict = dataclasses.field(default_factory=dict)  # {bucket: ticks run}
  max_programs: int = 0  # the lanes it may hold
  lanes_building: int = 0  # on the compile thread
  lanes_built: int = 0
  lanes_evicted: int = 0  # dropped for another setting (their programs and rows freed)
  lane_state_bytes: int = 0  # device bytes of the lanes' rows
  max_lane_bytes: int = 0  # their bound (`Engine`'s max_lane_bytes; 0: none)
  prefix_hits: int = 0  # block lanes' starts served from the prefix cache (`prefix_cache`)
  prefix_misses: int = 0
  prefix_bytes: int = 0  # device bytes of its entries


# The engine.
# ----------------------------------------------------------------------------


class Engine:
  """Serves `model`: requests in, rows on fixed slots, one compiled step per lane a tick.

  max_batch: the slots of each lane (rows one program advances together). max_queue: rows
  that may wait for a slot; `submit` beyond it raises `QueueFull`. canvas_length: the
  positions of each row's canvas (default the model's length): a prompt and its
  max_new_tokens must fit in it. max_programs: lanes kept at once (a lane per distinct
  sampler spec and canvas, with its own compiled programs; the least recently used idle
  one is dropped, programs and rows, for a new one: `lane_table`); a setting with no lane
  gets one, compiled on a compile thread once the engine runs, until `freeze`. max_steps:
  the most denoising steps a request may run (default `limits.STEPS_PER_POSITION` times the
  positions a row holds, `room`); `prepare` refuses more, and the other knobs that size a
  request's work past their bounds (`mdjax.serve.limits`). prefix_cache_bytes: the device
  bytes of the block lanes' prompt caches (`mdjax.serve.prefix_cache`; 0: none).
  max_lane_bytes: the most device bytes the lanes' rows may hold together (a cached
  decoder's keys and values in every slot, idle ones too), each lane's known from shapes
  before it compiles; a setting whose lane does not fit waits for idle lanes to be dropped,
  one whose lane alone passes it is refused by `prepare` (`lane_table`; None: no bound).
  """

  def __init__(self, model: Model, *, max_batch: int = 8, max_queue: int = 64,
               canvas_length: int | None = None, max_programs: int = 8,
               max_steps: int | None = None, prefix_cache_bytes: int = 0,
               max_lane_bytes: int | None = None):
    self.model = model
    self.max_batch = limits.check_int(max_batch, "max_batch", 1)
    self.max_queue = limits.check_int(max_queue, "max_queue", 0)
    self.max_programs = limits.check_int(max_programs, "max_programs", 1)
    self.frozen = False  # `freeze`: only the settings with a lane are served
    self.canvas_length = limits.check_int(model.max_len if canvas_length is None else canvas_length,
                                    "canvas_length", 1, model.max_len,
                                    f" (the model holds {model.max_len} positions)")
    # A row's positions: a padding-invariant model shares the lane's canvas; any other runs
    # on exactly its own prompt and new tokens, within the model's length.
    self.room = self.canvas_length if model.padding_invariant else int(model.max_len)
    self.max_steps = limits.check_int(limits.STEPS_PER_POSITION * self.room if max_steps is None
                                else max_steps, "max_steps", 1)
    model.mask_id  # a causal judge is refused here, with its own message
    self._waiting: collections.deque[tuple[Handle, int]] = collections.deque()
    self._cv = threading.Condition()
    self._thread: threading.Thread | None = None
    self._stopping = False
    self._counts = collections.Counter()
    # (when it finished, seconds it took, tokens) of the rows finished lately: tokens/s over
    # the last 10 s, and Retry-After (the median time of the last 256).
    self._done_rows: collections.deque[tuple[float, float, int]] = collections.deque(
        maxlen=10_000)
    self._first_trace = lane_programs.traces()
    self._bucket_ticks = collections.Counter()
    self._chores: collections.deque = collections.deque()  # `warm` calls for the thread
    self._warm_waiters: list[tuple[Job, threading.Event]] = []  # for a lane being built
    prefix_bytes = limits.check_int(prefix_cache_bytes, "prefix_cache_bytes", 0)
    self.prefix_cache = PrefixCache(prefix_bytes) if prefix_bytes else None
    self.max_lane_bytes = (None if max_lane_bytes is None else
                           limits.check_int(max_lane_bytes, "max_lane_bytes", 1))
    self._table = LaneTable(slots=self.max_batch, padded=model.takes_padding,
                            max_programs=self.max_programs, wake=self._wake,
                            prefix_cache=self.prefix_cache, max_bytes=self.max_lane_bytes)

  # -- requests ---------------------------------------------------------------

  @functools.cached_property
  def max_prompt_bytes(self) -> int:
    """The most UTF-8 bytes of a text prompt (a chat's contents together): the positions a
    row holds times the tokenizer's longest token (`limits.longest_token_bytes`)."""
    return self.room * limits.longest_token_bytes(self.model)

  @property
  def max_n(self) -> int:
    """The most rows one request may ask for: past max_batch it cannot be served, past
    max_queue (when set) it could wait for ever."""
    return min(self.max_batch, self.max_queue or self.max_batch)

  def prepare(self, prompt, *, max_new_tokens: int, seed: int, n: int = 1,
              sampler: str | None = None, knobs: dict | None = None,
              where: str = "prompt", new_tokens: str = "max_new_tokens") -> Job:
    """A request checked once and laid out, before anything compiles: an `ArgumentError`
    names the argument (`where`, `new_tokens`: the caller's names of the prompt and of
    max_new_tokens). prompt: a text, a chat (a list of {"role", "content"} messages, through
    the model's template) or token ids. sampler: a family name (sample.py's --sampler; None:
    the model's default sampler, as `generate` with spec=None); knobs: that sampler's
    settings by name. What needs no prompt is checked before the prompt is encoded, the
    server's bounds among it (`mdjax.serve.limits`: the knobs that size the work, the
    prompt's bytes); the steps the sampler will run before its plan is built."""
    model, room = self.model, self.room
    n = limits.check_int(n, "n", 1, self.max_n, f" (the rows of one request; max_batch is "
                                          f"{self.max_batch}, max_queue {self.max_queue})")
    job = jobs.prepare_job(model, prompt, room=room, max_steps=self.max_steps,
                           max_prompt_bytes=self.max_prompt_bytes, max_new_tokens=max_new_tokens,
                           seed=seed, n=n, sampler=sampler, knobs=knobs, where=where,
                           new_tokens=new_tokens)
    if self.frozen and job.lane_key not in self._table.lanes:
      raise ArgumentError("sampler", f"{type(job.spec).__name__} with these settings (and "
                          f"{max_new_tokens} new tokens) is not among the {len(self.lanes)} "
                          "settings this server has compiled, and it compiles no others "
                          "(new_programs=refuse): use the server's default settings.")
    if self.max_lane_bytes is not None and job.lane_key not in self._table.lanes:
      size = self.lane_bytes(job)
      if size > self.max_lane_bytes:
        raise ArgumentError("sampler", f"{type(job.spec).__name__} with these settings (and "
                            f"{max_new_tokens} new tokens) needs a lane of {size} device bytes "
                            f"({self.max_batch} slots of {size // self.max_batch}, "
                            f"{job.cache or 'no cache'}), more than this server's "
                            f"max_lane_bytes={self.max_lane_bytes}: use another sampler "
                            "setting (one without a cache holds less), or fewer tokens.")
    return job

  def lane_bytes(self, job: Job) -> int:
    """Device bytes of `job`'s lane (its max_batch rows, a cache in each where the decoder
    keeps one), from shapes: nothing compiles or runs."""
    return self._table.lane_bytes(job)

  def freeze(self) -> None:
    """From now on `prepare` refuses a setting that has no lane (`warm` made the lanes to
    keep): nothing compiles while serving, and no lane is dropped."""
    self.frozen = True

  def submit(self, job: Job, on_update: Callable[[RowUpdate], None],
             every_step: bool = True) -> Handle:
    """Queues the job's rows; `on_update` hears of each row after every tick (from the
    engine thread), or with every_step False only once, when the row finished (or failed):
    a caller that waits for the completion spares the engine an update a row a tick. Raises
    QueueFull when `max_queue` rows already wait."""
    handle = Handle(job, on_update, every_step)
    with self._cv:
      if self._stopping:
        raise QueueFull("the server is shutting down", retry_after=1.0)
      if len(self._waiting) + job.n > self.max_queue + self._free_slots():
        raise QueueFull(f"{len(self._waiting)} rows wait for a slot (max_queue="
                        f"{self.max_queue})", retry_after=self._retry_after())
      self._waiting.extend((handle, choice) for choice in range(job.n))
      self._counts["requests"] += 1
      self._cv.notify()
    return handle

  def warm(self, job: Job, timeout: float | None = None) -> None:
    """Compiles the programs of `job`'s lane now (its admit, move and every bucket's tick),
    rather than at the first requests that need each; returns when they are compiled.
    Started, the engine thread takes it (it owns the lanes) at its next round, and a new
    lane is built on the compile thread. A lane with active rows is left as it is."""
    if not self._running():
      done, errors = threading.Event(), []
      self._warm(job, done, errors)
      if errors:
        raise errors[0]
      return
    chore = (job, threading.Event(), [])
    with self._cv:
      self._chores.append(chore)
      self._cv.notify()
    deadline = None if timeout is None else time.monotonic() + timeout
    while not chore[1].wait(0.5):
      if not self._thread.is_alive():  # it stopped meanwhile: nobody else runs the lanes
        self._run_chores()
      elif deadline is not None and time.monotonic() > deadline:
        raise TimeoutError(f"warm: the engine thread did not compile within {timeout} s")
    if chore[2]:
      raise chore[2][0]

  def _warm(self, job: Job, done: threading.Event, errors: list) -> None:
    """Warms `job`'s lane, or has the compile thread build it warm; sets `done` (with any
    error in `errors`) when its programs are compiled."""
    try:
      lane = self._table.lane_for(job, background=self._running())
      building = self._table.pending(job)
      if building is not None:  # done once the engine thread has taken the lane in
        building.add_done_callback(
            lambda future: future.exception() and errors.append(future.exception()))
        self._warm_waiters.append((job, done))
        return
      if lane is not None and not lane.active:
        lane.warm(job)
    except Exception as error:
      errors.append(error)
    done.set()

  def _run_chores(self) -> bool:
    """The `warm` calls asked for, and the news of those waiting for a lane's build."""
    with self._cv:
      chores, self._chores = list(self._chores), collections.deque()
    for chore in chores:
      self._warm(*chore)
    self._table.collect()
    waiting, self._warm_waiters = self._warm_waiters, []
    for job, done in waiting:
      if self._table.pending(job) is None:
        done.set()
      else:
        self._warm_waiters.append((job, done))
    return bool(chores)

  def _running(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  def _wake(self) -> None:
    with self._cv:
      self._cv.notify()

  def _free_slots(self) -> int:
    """Slots that admit at the next tick without waiting (no lane yet: one lane's worth)."""
    table = self._table
    free = sum(lane.owners.count(None) for lane in list(table.lanes.values()))
    room = len(table.lanes) + table.building < self.max_programs
    return free + (self.max_batch if room else 0)

  @property
  def lanes(self) -> list[Lane]:
    """The lanes held now (each one sampler setting's slots and programs)."""
    return list(self._table.lanes.values())

  def _retry_after(self) -> float:
    recent = [seconds for _, seconds, _ in list(self._done_rows)[-256:]]
    return 1.0 if not recent else max(1.0, round(float(np.median(recent)), 1))

  # -- the thread -------------------------------------------------------------

  def start(self) -> "Engine":
    if self._thread is None:
      self._thread = threading.Thread(target=self._serve, name="mdjax-engine", daemon=True)
      self._thread.start()
    return self

  def stop(self, drain: bool = True, timeout: float | None = None) -> None:
    """Stops admitting; with drain, finishes every queued and running row first; joins."""
    with self._cv:
      self._stopping = True
      if not drain:
        for handle, _ in self._waiting:
          handle.cancel()
        for lane in self.lanes:
          for owner in lane.owners:
            if owner is not None:
              owner.handle.cancel()
      self._cv.notify()
    if self._thread is not None:
      self._thread.join(timeout)
    self._table.close()

  def _serve(self) -> None:
    while True:
      with self._cv:
        busy = (self._waiting or self._chores or self._warm_waiters
                or any(lane.active for lane in self.lanes))
        if not busy:
          if self._stopping:
            return
          self._cv.wait(timeout=0.5)
          continue
      if not self.run_once():  # rows wait for a lane being built: until it is ready
        with self._cv:
          self._cv.wait(timeout=0.05)

  def run_once(self) -> bool:
    """One round of the loop: warm what `warm` asked for, drop cancelled rows, admit
    waiting ones, tick every lane with active rows (on its bucket's program); whether it
    did any of that. (The thread calls it; a test or a benchmark may too, unstarted.)"""
    worked = self._run_chores()
    self._drop_cancelled()
    worked |= self._admit_waiting()
    for lane in self.lanes:
      if lane.active:
        self._tick(lane)
        worked = True
    return worked

  def _drop_cancelled(self) -> None:
    with self._cv:
      kept = [(h, c) for h, c in self._waiting if not h.cancelled]
      for handle, _ in self._waiting:
        if handle.cancelled:
          handle.close_rows(1)
      self._waiting = collections.deque(kept)
    for lane in self.lanes:
      cancelled = [slot for slot, owner in enumerate(lane.owners)
                   if owner is not None and owner.handle.cancelled]
      for slot in cancelled:
        lane.owners[slot].handle.close_rows(1)
      if cancelled:
        lane.release(cancelled, idle=True)  # the last rows move into their slots

  def _admit_waiting(self) -> bool:
    """Waiting rows into free slots of their lanes (asking for the lanes they lack);
    whether any left the queue."""
    with self._cv:
      waiting = list(self._waiting)
    admitted = set()
    background = self._running()
    for index, (handle, choice) in enumerate(waiting):
      try:
        lane = self._table.lane_for(handle.job, background=background)
        if lane is None or lane.free_slot() is None:
          continue
        lane.admit(handle, choice)
      except Exception as error:  # a program that fails to build fails its request only
        self._fail(handle, choice, error)
      admitted.add(index)
    self._table.forget_failures()
    if admitted:
      with self._cv:
        taken = {id(waiting[i][0]) * 1000 + waiting[i][1] for i in admitted}
        self._waiting = collections.deque(
            (h, c) for h, c in self._waiting if id(h) * 1000 + c not in taken)
    return bool(admitted)

  def _fail(self, handle: Handle, choice: int, error: Exception) -> None:
    job = handle.job
    empty = np.full(job.max_new_tokens, job.mask_id, np.int32)
    handle.send(RowUpdate(choice, 0, job.num_steps, empty, empty == job.mask_id, 0,
                           np.zeros(job.max_new_tokens, bool), error=f"{type(error).__name__}: {error}"))
    handle.close_rows(1)

  def _tick(self, lane: Lane) -> None:
    bucket = lane.bucket()
    try:
      outputs = lane.tick(bucket)
    except Exception as error:
      for slot, owner in enumerate(lane.owners):
        if owner is not None:
          self._fail(owner.handle, owner.choice, error)
          lane.owners[slot] = None
      self._table.drop(lane.key)
      return
    self._counts["ticks"] += 1  # one batched denoiser pass
    self._bucket_ticks[bucket] += 1
    finished = self._send_updates(lane, outputs)
    lane.release(finished)  # the last active rows move into the finished rows' slots

  def _send_updates(self, lane: Lane, outputs: lane_programs.TickOutputs) -> list[int]:
    """Each active row's update after a tick (a row whose handle takes its last update
    only: when it finished); returns the slots of the rows that finished (their owners stay
    until the lane releases them). A tick's tokens are read back only for those updates."""
    left = []
    for slot, owner in enumerate(lane.owners):
      if owner is None:
        continue
      finished = not outputs.active_N[slot]
      if not finished and not owner.handle.every_step:
        continue
      job = owner.handle.job
      canvas_ids = lane.canvas_ids(outputs.tokens_NxS, slot, job)
      masked = canvas_ids == job.mask_id
      completion = None
      if finished:
        length = min(int(outputs.lengths_N[slot]), job.max_new_tokens)
        completion = generation.completion_of(self.model, job.prompt_ids, canvas_ids, length,
                                              job.max_new_tokens)
      provisional = lane.family.rewrites and not finished
      final = np.zeros_like(masked) if provisional else ~masked
      committed = int(np.argmin(final)) if not final.all() else job.max_new_tokens
      owner.handle.send(RowUpdate(owner.choice, int(outputs.steps_N[slot]), job.num_steps,
                                   canvas_ids, masked, committed, final, completion))
      if finished:
        left.append(slot)
        owner.handle.close_rows(1)
        self._counts["rows_done"] += 1
        self._counts["completion_tokens"] += len(completion.token_ids)
        now = time.monotonic()
        self._done_rows.append((now, now - owner.started, len(completion.token_ids)))
    return left

  # -- what it has done -------------------------------------------------------

  def stats(self) -> EngineStats:
    now = time.monotonic()
    window = [tokens for at, _, tokens in list(self._done_rows) if now - at <= 10.0]
    with self._cv:
      queue_rows = len(self._waiting)
    lanes, table = self.lanes, self._table
    return EngineStats(
        queue_rows=queue_rows, active_rows=sum(lane.active for lane in lanes),
        slots=self.max_batch * max(1, len(lanes)), lanes=len(lanes),
        ticks=self._counts["ticks"], denoiser_calls=self._counts["ticks"],
        completion_tokens=self._counts["completion_tokens"],
        rows_done=self._counts["rows_done"], compiles=lane_programs.traces() - self._first_trace,
        tokens_per_s=sum(window) / 10.0,
        ticks_by_bucket=dict(sorted(self._bucket_ticks.items())),
        max_programs=self.max_programs, lanes_building=table.building,
        lanes_built=table.built, lanes_evicted=table.evicted,
        lane_state_bytes=table.state_bytes(), max_lane_bytes=self.max_lane_bytes or 0,
        **(self.prefix_cache.counts() if self.prefix_cache else {}))
