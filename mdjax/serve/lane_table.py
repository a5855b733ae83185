"""The lanes an engine holds: at most `max_programs`, each with its own compiled programs
(`lanes.Programs`), so a dropped lane frees its programs and its device rows with it.

A setting with no lane gets one. Before the engine starts (a test or a benchmark calling
`Engine.run_once`), the lane is built where it is asked for and its programs compile on
first use. Once the engine runs, a new lane is built on a compile thread that also compiles
every program the lane will run (`Lane.warm`): the engine thread keeps ticking the other
lanes meanwhile and never compiles, and the setting's rows wait in the queue until their
lane is ready. When `max_programs` lanes are held (or being built), the least recently
used idle one is dropped for a new one; when none is idle, the new setting waits.

With `max_bytes` (the server's `--max_lane_bytes`) the lanes' rows are bounded too: every
slot of a lane, idle ones included, holds a row (a cached decoder's keys and values of every
layer at every position of its canvas or window), so a lane's bytes are its slots times a
row's, known from shapes before it compiles (`Lane.row_bytes`). A new lane opens only when
its bytes and those of the lanes held or being built fit; else the least recently used idle
lanes are dropped until it fits, and while the busy ones keep it from fitting its setting
waits, as for `max_programs`. A lane larger than the bound alone is refused by
`Engine.prepare`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading
from typing import Callable

import jax

from mdjax.serve.block_lanes import BlockLane
from mdjax.serve.canvas_lanes import CanvasesLane
from mdjax.serve.lanes import Lane


class LaneTable:
  """The lanes of one engine, keyed by `Job.lane_key`. Only the engine's thread (or, before
  it starts, its caller) calls these methods; the compile thread only builds."""

  def __init__(self, *, slots: int, padded: bool, max_programs: int,
               wake: Callable[[], None], prefix_cache=None, max_bytes: int | None = None):
    """slots: each lane's rows; padded: the model reads a padding mask; wake: called from
    the compile thread when a lane is ready (the engine's thread may be waiting);
    prefix_cache: the block lanes' `prefix_cache.PrefixCache` (None: none); max_bytes: the
    most device bytes of the lanes' rows, held and being built (None: no bound)."""
    self.slots, self.padded, self.max_programs = slots, padded, max_programs
    self.max_bytes = max_bytes
    self._bytes: dict[tuple, int] = {}  # of the lanes held and being built (with max_bytes)
    # A lane's bytes by setting, kept for the settings seen lately: `Engine.prepare` (on
    # the request threads) asks first, so the engine's thread never traces for it.
    self._sized: collections.OrderedDict[tuple, int] = collections.OrderedDict()
    self._sized_lock = threading.Lock()
    self.prefix_cache = prefix_cache
    self._wake = wake
    self.lanes: dict[tuple, Lane] = {}
    self._building: dict[tuple, concurrent.futures.Future] = {}
    self._failed: dict[tuple, Exception] = {}
    self._compiler: concurrent.futures.ThreadPoolExecutor | None = None
    self.built = 0
    self.evicted = 0

  @property
  def building(self) -> int:
    """Lanes being built on the compile thread."""
    return len(self._building)

  def collect(self) -> None:
    """Takes in the lanes the compile thread has finished (or the errors it met)."""
    for key, future in list(self._building.items()):
      if future.done():
        del self._building[key]
        error = future.exception()
        if error is None:
          self.lanes[key] = future.result()
          self.built += 1
        else:
          self._failed[key] = error
          self._bytes.pop(key, None)

  def lane_for(self, job, *, background: bool) -> Lane | None:
    """`job`'s lane; None while it is being built or while no lane can be dropped for it.
    background: build a new lane on the compile thread (else here, compiling on first use).
    Raises the error its build met (once: each waiting row of the setting fails with it
    in the round that takes it in; `forget_failures` ends the round)."""
    key = job.lane_key
    self.collect()
    if key in self._failed:
      raise self._failed[key]
    if key in self.lanes:
      return self.lanes[key]
    if key in self._building or not self._make_room(job):
      return None
    if self.max_bytes is not None:
      self._bytes[key] = self.lane_bytes(job)
    if not background:
      try:
        lane = self.lanes[key] = self._lane(job)
      except Exception:
        self._bytes.pop(key, None)
        raise
      self.built += 1
      return lane
    if self._compiler is None:
      self._compiler = concurrent.futures.ThreadPoolExecutor(
          max_workers=1, thread_name_prefix="mdjax-compile", initializer=_yield_to_serving)
    future = self._building[key] = self._compiler.submit(self._build, job)
    future.add_done_callback(lambda _: self._wake())
    return None

  def pending(self, job) -> concurrent.futures.Future | None:
    """The build of `job`'s lane under way, if any."""
    return self._building.get(job.lane_key)

  def forget_failures(self) -> None:
    self._failed.clear()

  def drop(self, key) -> None:
    self.lanes.pop(key, None)
    self._bytes.pop(key, None)
    if self.prefix_cache is not None:
      self.prefix_cache.drop_lane(key)

  def lane_bytes(self, job) -> int:
    """Device bytes of `job`'s lane: its slots' rows (`Lane.row_bytes`, from shapes; nothing
    compiles). Thread-safe; a setting's is computed once while it is among the last 256."""
    key = job.lane_key
    with self._sized_lock:
      if key in self._sized:
        self._sized.move_to_end(key)
        return self._sized[key]
    kind = _kind(job)
    size = self.slots * kind.row_bytes(job, self.padded)
    with self._sized_lock:
      self._sized[key] = size
      while len(self._sized) > 256:
        self._sized.popitem(last=False)
    return size

  def held_bytes(self) -> int:
    """Device bytes of the lanes held and being built, from their shapes (0 without
    `max_bytes`: not computed)."""
    return sum(self._bytes.values())

  def state_bytes(self) -> int:
    """Device bytes of the lanes' rows (their programs' code is not counted)."""
    lanes = list(self.lanes.values())  # a copy: `Engine.stats` runs on other threads
    return sum(leaf.nbytes for lane in lanes for leaf in jax.tree.leaves(lane.rows))

  def close(self) -> None:
    """Stops the compile thread (a build under way finishes; queued ones are dropped)."""
    if self._compiler is not None:
      self._compiler.shutdown(wait=True, cancel_futures=True)
      self._compiler = None

  def _make_room(self, job) -> bool:
    """Room for `job`'s lane: fewer than `max_programs` lanes held or being built and, with
    `max_bytes`, their bytes and the new lane's within it. Drops the least recently used
    idle lanes until there is; False, dropping none, when dropping every idle lane would
    not make room."""
    need = 0 if self.max_bytes is None else self.lane_bytes(job)
    count, held = len(self.lanes) + len(self._building), self.held_bytes()
    idle = sorted((key for key, lane in self.lanes.items() if not lane.active),
                  key=lambda key: self.lanes[key].last_used)
    dropping = []
    while count >= self.max_programs or (self.max_bytes is not None
                                         and held + need > self.max_bytes):
      if len(dropping) == len(idle):
        return False
      key = idle[len(dropping)]
      dropping.append(key)
      count, held = count - 1, held - self._bytes.get(key, 0)
    for key in dropping:
      self.drop(key)
      self.evicted += 1
    return True

  def _build(self, job) -> Lane:
    """On the compile thread: the lane, with every program it will run compiled."""
    lane = self._lane(job)
    lane.warm(job)
    return lane


  def _lane(self, job) -> Lane:
    """A new lane for `job`: block by block (`Job.blocks`, with the prefix cache),
    DiffusionGemma's canvases (`Job.canvases`) or on one canvas."""
    if job.blocks is not None:
      return BlockLane(job, self.slots, self.padded, prefix_cache=self.prefix_cache)
    return _kind(job)(job, self.slots, self.padded)


def _kind(job) -> type:
  """The lane class of `job`: block by block, DiffusionGemma's canvases, or one canvas."""
  return BlockLane if job.blocks is not None else (
      CanvasesLane if job.canvases is not None else Lane)


def _yield_to_serving() -> None:
  """The compile thread runs at a lower CPU priority than the engine's (Linux sets a
  thread's nice value alone, and the threads it starts inherit it): a compile takes the
  cores the ticks leave."""
  try:
    os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10))
  except (AttributeError, OSError):  # no per-thread priority here: compile as is
    pass
