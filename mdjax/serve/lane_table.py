"""The lanes an engine holds: at most `max_programs`, each with its own compiled programs
(`lanes.Programs`), so a dropped lane frees its programs and its device rows with it.

A setting with no lane gets one. Before the engine starts (a test or a benchmark calling
`Engine.run_once`), the lane is built where it is asked for and its programs compile on
first use. Once the engine runs, a new lane is built on a compile thread that also compiles
every program the lane will run (`Lane.warm`): the engine thread keeps ticking the other
lanes meanwhile and never compiles, and the setting's rows wait in the queue until their
lane is ready. When `max_programs` lanes are held (or being built), the least recently
used idle one is dropped for a new one; when none is idle, the new setting waits.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Callable

import jax

from mdjax.serve.block_lanes import BlockLane
from mdjax.serve.lanes import Lane


class LaneTable:
  """The lanes of one engine, keyed by `Job.lane_key`. Only the engine's thread (or, before
  it starts, its caller) calls these methods; the compile thread only builds."""

  def __init__(self, *, slots: int, padded: bool, max_programs: int,
               wake: Callable[[], None], prefix_cache=None):
    """slots: each lane's rows; padded: the model reads a padding mask; wake: called from
    the compile thread when a lane is ready (the engine's thread may be waiting);
    prefix_cache: the block lanes' `prefix_cache.PrefixCache` (None: none)."""
    self.slots, self.padded, self.max_programs = slots, padded, max_programs
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
    if key in self._building or not self._make_room():
      return None
    if not background:
      lane = self.lanes[key] = self._lane(job)
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
    if self.prefix_cache is not None:
      self.prefix_cache.drop_lane(key)

  def state_bytes(self) -> int:
    """Device bytes of the lanes' rows (their programs' code is not counted)."""
    lanes = list(self.lanes.values())  # a copy: `Engine.stats` runs on other threads
    return sum(leaf.nbytes for lane in lanes for leaf in jax.tree.leaves(lane.rows))

  def close(self) -> None:
    """Stops the compile thread (a build under way finishes; queued ones are dropped)."""
    if self._compiler is not None:
      self._compiler.shutdown(wait=True, cancel_futures=True)
      self._compiler = None

  def _make_room(self) -> bool:
    """Drops the least recently used idle lane when every lane is held; False when none
    is idle."""
    if len(self.lanes) + len(self._building) < self.max_programs:
      return True
    idle = [key for key, lane in self.lanes.items() if not lane.active]
    if not idle:
      return False
    dropped = min(idle, key=lambda key: self.lanes[key].last_used)
    del self.lanes[dropped]
    if self.prefix_cache is not None:
      self.prefix_cache.drop_lane(dropped)
    self.evicted += 1
    return True

  def _build(self, job) -> Lane:
    """On the compile thread: the lane, with every program it will run compiled."""
    lane = self._lane(job)
    lane.warm(job)
    return lane


  def _lane(self, job) -> Lane:
    """A new lane for `job`: block by block (`Job.blocks`, with the prefix cache) or on one
    canvas."""
    if job.blocks is None:
      return Lane(job, self.slots, self.padded)
    return BlockLane(job, self.slots, self.padded, prefix_cache=self.prefix_cache)


def _yield_to_serving() -> None:
  """The compile thread runs at a lower CPU priority than the engine's (Linux sets a
  thread's nice value alone, and the threads it starts inherit it): a compile takes the
  cores the ticks leave."""
  try:
    os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10))
  except (AttributeError, OSError):  # no per-thread priority here: compile as is
    pass
