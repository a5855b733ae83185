"""On a CPU backend, keep the memory a served program frees for its next call.

XLA's CPU client takes each call's buffers from the C library's malloc. glibc serves a large
block by mmap and unmaps it when freed, and trims its heap's free top past a threshold, so a
program run once a tick (a lane's tick: the logits of its rows over their canvas, tens of
MB) gets fresh pages at every call, and the kernel zeroes each as it is first touched. An
offline `mdjax.generate` is one call over every step and pays that once. Measured on the
LLaDA-shaped model of `mdjax.bench.serve_cached` (16 rows, the dual cache's window step,
CPU seconds, 3 rounds on the shared 2-core machine): 66, 64 and 68 ms a tick as glibc
leaves it, 49, 48 and 48 ms with `keep_freed_memory`, against 57, 54 and 55 ms a step for
the offline batch (its full passes included).

`keep_freed_memory` has glibc serve large blocks from its heap and keep what is freed there
(`mallopt`: no mmap'd blocks, a trim threshold of 1 GiB, 256 MiB of top padding): the
process keeps its peak footprint, as an accelerator's pooling allocator keeps its pool.
`python -m mdjax.serve` calls it on a CPU backend, and so does the serving benchmark.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# glibc's mallopt options (malloc.h).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
SETTINGS = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 1 << 28))
_kept = [False]


def keep_freed_memory() -> bool:
  """Whether the C library took the settings (glibc; elsewhere nothing changes)."""
  try:
    mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
  except (OSError, AttributeError, TypeError):
    return False
  mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
  _kept[0] = all([mallopt(option, value) == 1 for option, value in SETTINGS])
  return _kept[0]


def kept() -> bool:
  """Whether `keep_freed_memory` applied in this process."""
  return _kept[0]
