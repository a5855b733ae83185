"""The server's Prometheus metrics, in the text exposition format (version 0.0.4).

The engine's gauges and counters come from `Engine.stats()` at scrape time; the HTTP
counters (requests by status) and the latency histogram are kept here, by the app's
middleware, for the API routes (/v1/...). No client library: the format is a few lines.
"""

from __future__ import annotations

import bisect
import math
import os
import threading

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: a tiny model's request takes milliseconds, a large one's tens of seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)

# (metric name, EngineStats field, type, help)
ENGINE_METRICS = (
    ("mdjax_queue_rows", "queue_rows", "gauge", "Rows waiting for a slot."),
    ("mdjax_active_rows", "active_rows", "gauge", "Rows being denoised."),
    ("mdjax_slots", "slots", "gauge", "Slots of the lanes held (max_batch a lane)."),
    ("mdjax_lanes", "lanes", "gauge", "Lanes (compiled programs, one a sampler spec) held."),
    ("mdjax_max_programs", "max_programs", "gauge", "The most lanes held at once "
     "(--max_programs): the bound on compiled programs and their rows."),
    ("mdjax_lanes_building", "lanes_building", "gauge", "Lanes being compiled on the compile "
     "thread."),
    ("mdjax_lanes_built_total", "lanes_built", "counter", "Lanes built."),
    ("mdjax_lanes_evicted_total", "lanes_evicted", "counter", "Idle lanes dropped for a new "
     "setting, their programs and rows freed."),
    ("mdjax_lane_state_bytes", "lane_state_bytes", "gauge", "Device bytes of the lanes' rows "
     "(a cached decoder's keys and values in every slot)."),
    ("mdjax_max_lane_bytes", "max_lane_bytes", "gauge", "The most device bytes the lanes' rows "
     "may hold, held and being built (--max_lane_bytes; 0: no bound)."),
    ("mdjax_prefix_cache_hits_total", "prefix_hits", "counter", "Block lanes' rows started "
     "from the prefix cache (their prompt's whole blocks held: no pass)."),
    ("mdjax_prefix_cache_misses_total", "prefix_misses", "counter", "Block lanes' rows "
     "started by a pass over their prompt (with --prefix_cache_bytes)."),
    ("mdjax_prefix_cache_bytes", "prefix_bytes", "gauge", "Device bytes of the prefix "
     "cache's entries (at most --prefix_cache_bytes)."),
    ("mdjax_ticks_total", "ticks", "counter", "Engine ticks (one denoising step of every "
     "active row)."),
    ("mdjax_denoiser_calls_total", "denoiser_calls", "counter", "Denoiser passes run."),
    ("mdjax_completion_tokens_total", "completion_tokens", "counter",
     "Tokens of finished completions."),
    ("mdjax_rows_done_total", "rows_done", "counter", "Rows finished."),
    ("mdjax_compiles_total", "compiles", "counter", "Programs traced and compiled so far."),
    ("mdjax_tokens_per_second", "tokens_per_s", "gauge",
     "Completion tokens per second over the last 10 s."),
)


def resident_bytes() -> int | None:
  """This process's resident memory (Linux's /proc/self/statm; None elsewhere)."""
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return None


def _number(value) -> str:
  if value is None:
    return "NaN"
  value = float(value)
  if math.isnan(value):
    return "NaN"
  if math.isinf(value):
    return "+Inf" if value > 0 else "-Inf"
  return repr(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


def _label(value: str) -> str:
  return str(value).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class Histogram:
  """A cumulative Prometheus histogram of observations (seconds)."""

  def __init__(self, buckets=LATENCY_BUCKETS):
    self.buckets = tuple(sorted(buckets))
    self.counts = [0] * len(self.buckets)  # per bucket, not cumulative
    self.sum, self.count = 0.0, 0

  def observe(self, value: float) -> None:
    index = bisect.bisect_left(self.buckets, value)
    if index < len(self.buckets):
      self.counts[index] += 1
    self.sum += value
    self.count += 1

  def lines(self, name: str, labels: str = "") -> list[str]:
    out, cumulative = [], 0
    sep = "," if labels else ""
    for bound, count in zip(self.buckets, self.counts):
      cumulative += count
      out.append(f'{name}_bucket{{{labels}{sep}le="{_number(bound)}"}} {cumulative}')
    out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
    suffix = f"{{{labels}}}" if labels else ""
    out.append(f"{name}_sum{suffix} {_number(self.sum)}")
    out.append(f"{name}_count{suffix} {self.count}")
    return out


class Metrics:
  """The HTTP side: requests by status code and their latency (thread-safe)."""

  def __init__(self):
    self._lock = threading.Lock()
    self.requests: dict[str, int] = {}
    self.latency = Histogram()

  def record(self, status: int, seconds: float) -> None:
    with self._lock:
      key = str(int(status))
      self.requests[key] = self.requests.get(key, 0) + 1
      self.latency.observe(max(0.0, float(seconds)))

  def render(self, stats=None) -> str:
    """The exposition text: the engine's `stats` (an `EngineStats`, or None) and ours."""
    lines = []
    if stats is not None:
      for name, field, kind, help_text in ENGINE_METRICS:
        if not hasattr(stats, field):
          continue
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}",
                  f"{name} {_number(getattr(stats, field))}"]
      lines += ["# HELP mdjax_bucket_ticks_total Ticks by bucket: the slots a tick ran (the "
                "smallest power of two holding the active rows).",
                "# TYPE mdjax_bucket_ticks_total counter"]
      lines += [f'mdjax_bucket_ticks_total{{bucket="{bucket}"}} {count}'
                for bucket, count in sorted(getattr(stats, "ticks_by_bucket", {}).items())]
    resident = resident_bytes()
    if resident is not None:
      lines += ["# HELP process_resident_memory_bytes Resident memory of the server's process.",
                "# TYPE process_resident_memory_bytes gauge",
                f"process_resident_memory_bytes {resident}"]
    with self._lock:
      lines += ["# HELP mdjax_requests_total API requests answered, by HTTP status.",
                "# TYPE mdjax_requests_total counter"]
      lines += [f'mdjax_requests_total{{status="{_label(status)}"}} {count}'
                for status, count in sorted(self.requests.items())]
      lines += ["# HELP mdjax_request_latency_seconds API request latency, from its arrival "
                "to the last byte of its response.",
                "# TYPE mdjax_request_latency_seconds histogram"]
      lines += self.latency.lines("mdjax_request_latency_seconds")
    return "\n".join(lines) + "\n"
