"""Timers for compiled programs: interleaved medians, compile time, peak memory, the machine."""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any, Callable

import jax


def interleaved_medians(fns: dict[Any, Callable[[], Any]], repeats: int) -> dict[Any, float]:
  """Median wall time of each fn (results blocked on) over `repeats` rounds, after a warm-up.

  Each round calls every fn once, so a change in the machine's load falls on all
  of them alike and their ratios stay meaningful on a shared machine.
  """
  for fn in fns.values():
    jax.block_until_ready(fn())
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(values) for name, values in times.items()}


def median_time(fn: Callable[[], Any], repeats: int) -> float:
  return interleaved_medians({"fn": fn}, repeats)["fn"]


def median_run(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
  """(median seconds of `repeats` calls after a warm-up call, the last output); `fn` blocks
  on its own result (a torch loop's too)."""
  out = fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times), out


def timed_compile(lower_fn):
  """(compiled program, its arguments, seconds to trace, lower and compile it);
  lower_fn -> (lowered, args), as `sampling.lower` returns them."""
  start = time.perf_counter()
  lowered, args = lower_fn()
  compiled = lowered.compile()
  return compiled, args, time.perf_counter() - start


def compiled_peak_bytes(compiled) -> int | None:
  """Peak memory XLA reserves for a compiled program (arguments + outputs + temporaries)."""
  try:
    mem = compiled.memory_analysis()
  except Exception:  # not every backend reports it
    return None
  if mem is None:
    return None
  return int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
             - mem.alias_size_in_bytes)


def machine_info() -> dict:
  """The device, the host CPU and the versions a result was measured with."""
  device = jax.devices()[0]
  cpu = platform.processor()
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    cpu = names[0] if names else cpu
  return dict(platform=device.platform, device_kind=device.device_kind,
              num_devices=jax.device_count(), cpu=cpu, cpu_count=os.cpu_count(),
              jax=jax.__version__, python=platform.python_version())
