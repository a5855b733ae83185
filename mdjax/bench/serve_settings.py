"""Many sampler settings against one server (`python -m mdjax.bench.serve_settings` ->
results/serve_settings.json): does a client that sends a new setting per request grow the
server's memory or slow everyone else?

A server (`mdjax.serve.server.running`, in a thread of this process) holds at most
`--max_programs` lanes. A steady client sends one request after another on the server's
default setting; first alone (its quiet latencies), then while a second client sends
`--settings` requests, each with its own temperature (a new lane, new programs, each). Per
mode of `--new_programs`: the steady client's median and p99 latency, quiet and during, and
their ratios; the process's resident memory (RSS) before the settings, at the most and
after, with the growth per setting; the lanes built and evicted. 'compile' builds each new
lane on the engine's compile thread; 'refuse' answers a setting it has not compiled with a
400.

The model: `mdjax.bench.serve.bench_model` (configs/shakespeare_char.py's denoiser, 1.07M
parameters, trained `--train_steps` steps in `--workdir`), or `--model=PATH`.

    python -m mdjax.bench.serve_settings          # ~6-10 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from typing import Sequence

import numpy as np

from mdjax.bench import serve as serve_bench
from mdjax.serve.metrics import resident_bytes

MODES = ("compile", "refuse")


def steady_client(base_url: str, model_name: str, fields: dict, stop: threading.Event,
                  latencies: list) -> None:
  """Requests on the default setting one after another until `stop`, each latency kept."""
  import openai
  api = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
  seed = 0
  while not stop.is_set():
    started = time.perf_counter()
    api.completions.create(model=model_name, prompt="ROMEO.\nBut soft", seed=seed, **fields)
    latencies.append(time.perf_counter() - started)
    seed += 1


def new_settings(base_url: str, model_name: str, fields: dict, count: int,
                 min_seconds: float, rss_mb: list) -> dict:
  """`count` requests, each with its own temperature (again from the first while fewer than
  `min_seconds` have passed, so a fast refusal is still measured against the steady
  client), the RSS after each of the first `count` in `rss_mb`: {status: requests}."""
  import openai
  api = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
  statuses: dict[str, int] = {}
  started, sent = time.perf_counter(), 0
  while sent < count or time.perf_counter() - started < min_seconds:
    i, sent = sent % count, sent + 1
    try:
      api.completions.create(model=model_name, prompt="JULIET.\nO Romeo", seed=i,
                             **{**fields, "temperature": 0.5 + i / 100})
      status = "200"
    except openai.APIStatusError as error:
      status = str(error.status_code)
    statuses[status] = statuses.get(status, 0) + 1
    if sent <= count:
      rss_mb.append(resident_bytes() / 2**20)
  return statuses


def percentiles(latencies: Sequence[float]) -> dict:
  array = np.asarray(latencies)
  return dict(requests=int(array.size), median_s=float(np.median(array)),
              p99_s=float(np.percentile(array, 99)))


def run_mode(model, mode: str, args, log=print) -> dict:
  """One server in `mode`: the steady client's latencies quiet and during the settings,
  the RSS around them, the lanes built and evicted."""
  from mdjax.serve.server import running

  fields = dict(max_tokens=args.max_tokens, temperature=1.0,
                extra_body=dict(steps=args.steps))
  with running(model, model_name="bench", max_batch=args.max_batch,
               max_programs=args.max_programs, canvas_length=args.canvas_length) as server:
    engine = server.engine
    if mode == "refuse":  # the default setting is the one this server compiles
      engine.warm(engine.prepare("ROMEO.\nBut soft", max_new_tokens=args.max_tokens, seed=0,
                                 knobs=dict(steps=args.steps, temperature=1.0)))
      engine.freeze()
    base = server.url + "/v1"
    quiet: list[float] = []
    stop = threading.Event()
    steady_client(base, "bench", fields, _after(2), [])  # warm: compiled, first calls
    thread = threading.Thread(target=steady_client, args=(base, "bench", fields, stop, quiet))
    thread.start()
    time.sleep(args.quiet_s)
    stop.set()
    thread.join()
    rss_before = resident_bytes()
    during: list[float] = []
    stop = threading.Event()
    peak = [rss_before]
    sampler = threading.Thread(target=_watch_rss, args=(stop, peak), daemon=True)
    steady = threading.Thread(target=steady_client, args=(base, "bench", fields, stop, during))
    sampler.start()
    steady.start()
    started = time.perf_counter()
    rss_mb: list[float] = []
    statuses = new_settings(base, "bench", fields, args.settings, args.quiet_s, rss_mb)
    settings_s = time.perf_counter() - started
    stop.set()
    steady.join()
    sampler.join()
    stats = engine.stats()
    rss_after = resident_bytes()
  quiet_row, during_row = percentiles(quiet), percentiles(during)
  row = dict(mode=mode, settings=args.settings, settings_s=settings_s, statuses=statuses,
             quiet=quiet_row, during=during_row,
             p99_ratio=during_row["p99_s"] / quiet_row["p99_s"],
             median_ratio=during_row["median_s"] / quiet_row["median_s"],
             rss_before_mb=rss_before / 2**20, rss_peak_mb=peak[0] / 2**20,
             rss_after_mb=rss_after / 2**20,
             rss_growth_per_setting_mb=(rss_after - rss_before) / 2**20 / args.settings,
             rss_mb_after_setting=rss_mb,
             # The default setting holds a lane: after setting max_programs - 2 (from 0) every
             # lane is held and each new setting drops one, so from there on the RSS should
             # stay flat (the bound), whatever the number of settings.
             rss_growth_once_full_mb=_growth_once_full(rss_mb, args.max_programs - 2),
             lanes_built=stats.lanes_built, lanes_evicted=stats.lanes_evicted,
             lanes_held=stats.lanes, compiles=stats.compiles)
  log(f"{mode}: RSS after each setting {[round(mb) for mb in rss_mb]} MB")
  log(f"{mode}: p99 {quiet_row['p99_s']:.3f} s quiet -> {during_row['p99_s']:.3f} s during "
      f"({row['p99_ratio']:.2f}x); RSS {row['rss_before_mb']:.0f} -> {row['rss_after_mb']:.0f}"
      f" MB (peak {row['rss_peak_mb']:.0f}); {statuses}; {stats.lanes_built} lanes built, "
      f"{stats.lanes_evicted} evicted, {settings_s:.0f} s")
  return row


def _growth_once_full(rss_mb: list, full: int) -> float | None:
  """The most the RSS rose above its value after setting `full` (None: too few)."""
  full = max(0, full)
  if len(rss_mb) <= full + 1:
    return None
  return max(rss_mb[full + 1:]) - rss_mb[full]


def _after(count: int) -> threading.Event:
  """An event that is set after `count` checks (a client that sends `count` requests)."""
  class Countdown(threading.Event):
    def is_set(self) -> bool:
      nonlocal count
      count -= 1
      return count < 0
  return Countdown()


def _watch_rss(stop: threading.Event, peak: list) -> None:
  while not stop.wait(0.25):
    peak[0] = max(peak[0], resident_bytes())


def main(argv: Sequence[str] | None = None, log=print) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default=None, help="a model mdjax.load reads (default: the "
                      "serving benchmark's character model)")
  parser.add_argument("--workdir", default=serve_bench.DEFAULT_WORKDIR)
  parser.add_argument("--train_steps", type=int, default=20)
  parser.add_argument("--out", default="results/serve_settings.json")
  parser.add_argument("--settings", type=int, default=40)
  parser.add_argument("--max_programs", type=int, default=4)
  parser.add_argument("--max_batch", type=int, default=4)
  parser.add_argument("--max_tokens", type=int, default=16)
  parser.add_argument("--canvas_length", type=int, default=None,
                      help="each row's canvas (default: the model's length)")
  parser.add_argument("--steps", type=int, default=16)
  parser.add_argument("--quiet_s", type=float, default=20.0)
  parser.add_argument("--modes", default=",".join(MODES))
  args = parser.parse_args(argv)
  import mdjax
  model = (mdjax.load(args.model) if args.model else
           serve_bench.bench_model(args.workdir, args.train_steps, log=log))
  rows = [run_mode(model, mode, args, log=log) for mode in args.modes.split(",")]
  result = dict(benchmark="serve_settings", args=vars(args), model=serve_bench.model_info(model),
                device=serve_bench.device_info(), modes=rows)
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  partial = args.out + ".partial"
  with open(partial, "w") as f:
    json.dump(result, f, indent=1)
  os.replace(partial, args.out)
  log(f"wrote {args.out}")
  return result


if __name__ == "__main__":
  main()
