"""Shared by the attack suites (tests/*/test_*_attacks.py): which files a call opens, a guard
that turns a hang into a failure, and the peak memory a call allocates."""

import contextlib
import os
import signal
import sys
import tracemalloc

_opened = None  # while a test records: the paths the process opens


def _audit(event, args):
  if _opened is not None and event == "open" and isinstance(args[0], (str, bytes)):
    _opened.append(os.path.abspath(os.fsdecode(args[0])))


sys.addaudithook(_audit)  # sees builtins.open, os.open and np.memmap's open alike


@contextlib.contextmanager
def recording_opens():
  """The list of paths opened inside the block (absolute)."""
  global _opened
  _opened = []
  try:
    yield _opened
  finally:
    _opened = None


class Hung(BaseException):
  """A call ran past its guard (a BaseException: no `except Exception` on the way swallows
  it, so a test fails instead of hanging, on a FIFO that waits for its other end, say)."""


@contextlib.contextmanager
def deadline(seconds: float = 5.0):
  """Raises Hung in the main thread once the block has run `seconds`."""
  def expire(*_):
    raise Hung(f"still running after {seconds} s")
  previous = signal.signal(signal.SIGALRM, expire)
  signal.setitimer(signal.ITIMER_REAL, seconds)
  try:
    yield
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


def peak_bytes(fn):
  """(what fn returned, or the ValueError it raised; tracemalloc's peak of its allocations:
  numpy arrays, bytes and str all report there)."""
  tracemalloc.start()
  try:
    try:
      out = fn()
    except ValueError as e:
      out = e
    return out, tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
