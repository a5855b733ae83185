"""The serving benchmark (`python -m mdjax.bench.serve` -> results/serve.json).

A server (`mdjax.serve.server.running`: the OpenAI-compatible app over the engine, in a
thread of this process) is loaded by `openai` clients in a process of their own
(`serve_clients.load_generator`), one connection each, at 1, 4, 16 and 32 concurrent clients; every request has the same sampler settings and max_tokens (one
engine lane, one compiled step), prompts differ. Beside it: the 16 prompts of the
concurrency-16 run through one batched `mdjax.generate` call (the offline batch), the
engine alone without HTTP (`Engine.run_once`, unstarted: the tick time at batch 1 and 16),
every served completion against `mdjax.generate` of its prompt and seed alone
(`served_equals_offline`), and ~20 bad requests that must each get a 4xx while the server
keeps serving.

The model: `--model=PATH` (anything `mdjax.load` reads), else configs/shakespeare_char.py's
denoiser (1.07M parameters: d_model 128, 4 layers, 64 positions, characters) trained for
`--train_steps` steps in `--workdir` (kept: a second run loads it). Its weights barely
matter to the timings; its shape does.

    python -m mdjax.bench.serve                       # ~3-5 minutes on 2 CPU cores
    python -m mdjax.bench.serve --model=/tmp/models/char --requests=64

`--parts` adds the `cached` record (`mdjax.bench.serve_cached`: a LLaDA-shaped model's cached
lane against its uncached one, ~20 more minutes on the shared CPU) and the `prefix` record
(`mdjax.bench.serve_prefix`: the prefix cache on a shared system prompt, ~5 minutes);
`--parts=cached,prefix` runs them alone and keeps the rest of --out as it was.
`--parts=cached_trained` (not in the default) adds the `cached_trained` record
(`mdjax.bench.serve_trained`: the cached rows on a LLaDA-shaped model trained here, whose
threshold fires; its training, ~5.5 CPU minutes, runs once into a temporary folder);
`--parts=cached_trained_partial` the `cached_trained_partial` record (the same recipe trained
for fewer steps, into a folder of its own: a model between, its threshold passing a few
positions a step).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from typing import Callable, Sequence

from mdjax import files


CONCURRENCY = (1, 4, 16, 32)
# the records beside the plain rows
PARTS = ("cached", "prefix", "cached_trained", "cached_trained_partial")
# The load generator, shared with serve_cached (re-exported: bench.request_plan, ...).
from mdjax.bench.serve_clients import (API_KEY, OFFLINE_PROMPTS, device_info,  # noqa: F401
                                       level_row, load_generator, model_info, one_request,
                                       request_plan)
DEFAULT_WORKDIR = os.path.join(tempfile.gettempdir(), "mdjax_bench_serve_model")

# Sixteen prompts of 12 to 16 characters (two lengths, so rows are left-padded).
PROMPTS = (
    "ROMEO.\nBut soft", "JULIET.\nO Romeo", "HAMLET.\nTo be,", "KING LEAR.\nBlow",
    "OTHELLO.\nSoft you", "MACBETH.\nIs this", "PORTIA.\nThe quality", "PUCK.\nIf we",
    "LEAR.\nNothing will", "IAGO.\nO, beware", "BRUTUS.\nThere is", "VIOLA.\nI left",
    "PROSPERO.\nOur revels", "ARIEL.\nFull fathom", "FALSTAFF.\nThe better",
    "CASSIUS.\nThe fault",
)


def bench_model(workdir: str, train_steps: int, log=print):
  """configs/shakespeare_char.py's denoiser trained `train_steps` steps (batch 16) in
  `workdir`; a finished run there is only loaded."""
  import mdjax
  from mdjax import train

  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if root not in sys.path:
    sys.path.insert(0, root)  # configs/ lives at the repository root
  from configs import shakespeare_char

  c = shakespeare_char.get_config()
  c.batch_size = 16
  c.train.update(num_steps=train_steps, warmup_steps=min(10, train_steps))
  c.checkpoint.update(every=train_steps)
  c.eval_every = 0
  c.num_eval_samples = 0
  c.log_every = train_steps
  started = time.perf_counter()
  train.train(c, workdir, log=lambda *a: None)
  log(f"model: {workdir} ({train_steps} training steps, {time.perf_counter() - started:.1f} s)")
  return mdjax.load(workdir)


def offline_batch(model, prompts: Sequence[str], spec, max_tokens: int, seed: int,
                  repeats: int = 3) -> dict:
  """The prompts through one batched `mdjax.generate` call: a warm-up call (it compiles),
  then `repeats` timed calls; tokens/s of the median."""
  import jax

  import mdjax

  from mdjax.bench import timing

  median, out = timing.median_run(
      lambda: mdjax.generate(model, list(prompts), max_new_tokens=max_tokens,
                             key=jax.random.key(seed), spec=spec), repeats)
  tokens = int(sum(len(c.token_ids) for c in out))
  return dict(tokens=tokens, median_s=round(median, 4), tokens_per_s=round(tokens / median, 2),
              nfe=int(out.nfe))


def offline_equal(model, records: list[dict], spec_of: Callable[[dict], object],
                  max_tokens: int) -> tuple[bool, list[dict]]:
  """Each served record against `mdjax.generate(model, [prompt], key=key(seed), spec=...)`
  alone (row 0 of a one-prompt call: exactly the server's row key): (all equal, the
  mismatches)."""
  import jax

  import mdjax

  mismatches = []
  for record in records:
    out = mdjax.generate(model, [record["prompt"]], max_new_tokens=max_tokens,
                         key=jax.random.key(record["seed"]), spec=spec_of(record))
    offline = [int(t) for t in out[0].token_ids]
    if offline != record["token_ids"]:
      mismatches.append(dict(prompt=record["prompt"], seed=record["seed"],
                             served=record["token_ids"], offline=offline))
  return not mismatches, mismatches


def bad_bodies(model_name: str, fields: dict, max_batch: int, limit: int) -> list:
  """(name, route, body: dict or raw bytes, authorized) of the bad requests: each must get a
  4xx naming what is wrong."""
  good = dict(model=model_name, prompt="ROMEO.\nBut soft", max_tokens=fields["max_tokens"],
              steps=fields["steps"], seed=1)
  with_ = lambda **changes: {**good, **changes}
  without = lambda name: {k: v for k, v in good.items() if k != name}
  completions, chat = "/v1/completions", "/v1/chat/completions"
  return [
      ("malformed JSON", completions, b'{"prompt": "x", "max_tokens": ', True),
      ("a JSON list, not an object", completions, b"[1, 2, 3]", True),
      ("no prompt", completions, without("prompt"), True),
      ("prompt of the wrong type", completions, with_(prompt={"text": "x"}), True),
      ("max_tokens a string", completions, with_(max_tokens="ten"), True),
      ("max_tokens 0", completions, with_(max_tokens=0), True),
      ("max_tokens negative", completions, with_(max_tokens=-3), True),
      ("max_tokens past the model's length", completions, with_(max_tokens=10 * limit), True),
      ("prompt longer than the context", completions, with_(prompt="a" * (2 * limit)), True),
      ("unknown sampler", completions, with_(sampler="no_such_sampler"), True),
      ("unknown field / knob", completions, with_(no_such_knob=1), True),
      ("negative temperature", completions, with_(temperature=-1.0), True),
      ("top_p past 1", completions, with_(top_p=1.5), True),
      ("n too large", completions, with_(n=max_batch + 1), True),
      ("n 0", completions, with_(n=0), True),
      ("steps 0", completions, with_(steps=0), True),
      ("steps a string", completions, with_(steps="many"), True),
      ("seed negative", completions, with_(seed=-1), True),
      ("stream not a bool", completions, with_(stream="yes"), True),
      ("stop of the wrong type", completions, with_(stop=5), True),
      ("messages not a list", chat, dict(model=model_name, messages="hi", max_tokens=4), True),
      ("no Authorization header", completions, good, False),
      ("wrong API key", completions, good, "wrong-key"),
  ]


def bad_requests(url: str, api_key: str, bodies: list, good: Callable[[], bool]) -> dict:
  """Sends the bad requests with httpx; counts 4xx answers; then `good()` must succeed."""
  import httpx

  answers = []
  with httpx.Client(base_url=url, timeout=60) as http:
    for name, route, body, auth in bodies:
      headers = {"Content-Type": "application/json"}
      if auth is True:
        headers["Authorization"] = f"Bearer {api_key}"
      elif isinstance(auth, str):
        headers["Authorization"] = f"Bearer {auth}"
      content = body if isinstance(body, bytes) else json.dumps(body).encode()
      response = http.post(route, content=content, headers=headers)
      try:
        message = response.json().get("error", {}).get("message", "")
      except ValueError:
        message = response.text[:200]
      answers.append(dict(request=name, status=response.status_code, message=message[:160]))
  answered = sum(400 <= a["status"] < 500 for a in answers)
  return dict(sent=len(answers), answered_4xx=answered, server_alive_after=bool(good()),
              answers=answers)


def engine_alone(model, jobs: list, max_batch: int, canvas_length: int) -> dict:
  """The engine without HTTP (unstarted; `run_once` from here): all `jobs` submitted at once,
  run to the end, its lane compiled before the clock starts (each engine's lanes compile
  their own programs). (seconds, ticks, tokens/s, seconds a tick)."""
  from mdjax.serve.engine import Engine

  engine = Engine(model, max_batch=max_batch, max_queue=len(jobs) + max_batch,
                  canvas_length=canvas_length)
  engine.warm(jobs[0])
  tokens = [0]

  def on_update(update):
    if update.completion is not None:
      tokens[0] += len(update.completion.token_ids)

  handles = [engine.submit(job, on_update, every_step=False) for job in jobs]
  started = time.perf_counter()
  while not all(h.done for h in handles):
    engine.run_once()
  seconds = time.perf_counter() - started
  ticks = engine.stats().ticks
  return dict(rows=len(jobs), slots=max_batch, seconds=round(seconds, 4), ticks=ticks,
              tick_s=round(seconds / max(ticks, 1), 5), tokens=tokens[0],
              tokens_per_s=round(tokens[0] / seconds, 2))


def main(argv: Sequence[str] | None = None, log=print) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default=None, help="a model mdjax.load reads (default: the "
                      "bench model, trained in --workdir)")
  parser.add_argument("--workdir", default=DEFAULT_WORKDIR)
  parser.add_argument("--train_steps", type=int, default=20)
  parser.add_argument("--out", default="results/serve.json")
  parser.add_argument("--requests", type=int, default=16,
                      help="requests at each concurrency (at least the concurrency)")
  parser.add_argument("--max_tokens", type=int, default=32)
  parser.add_argument("--steps", type=int, default=32)
  parser.add_argument("--temperature", type=float, default=1.0)
  parser.add_argument("--sampler", default=None, help="a sampler family (default: the "
                      "model's default sampler)")
  parser.add_argument("--max_batch", type=int, default=16)
  parser.add_argument("--canvas_length", type=int, default=None,
                      help="default: the longest prompt + max_tokens")
  parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
  parser.add_argument("--repeats", type=int, default=3,
                      help="runs at concurrency 16 and offline timed calls (medians)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--parts", default="plain,cached,prefix",
                      help="plain (the character model's rows), cached (serve_cached's), "
                      "prefix (serve_prefix's), cached_trained and cached_trained_partial "
                      "(serve_trained's: not in the default, ~5 more minutes each, 10-15 more "
                      "the first time: the training)")
  parser.add_argument("--cached_shape", default="cpu", help="the cached rows' model: cpu (a "
                      "small random LLaDA-shaped one) or a published shape of "
                      "mdjax.bench.families.PUBLISHED (LLaDA2.0-mini: an accelerator's)")
  args = parser.parse_args(argv)
  bench_started = time.perf_counter()
  parts = set(args.parts.split(","))
  if "plain" not in parts:
    return write_parts(args, {}, parts, log)

  import mdjax
  from mdjax import generation
  from mdjax.serve.server import running, served_name

  model = mdjax.load(args.model) if args.model else bench_model(args.workdir, args.train_steps,
                                                                 log)
  prompts = list(PROMPTS)
  prompt_lengths = [len(generation.prompt_ids(model, [p])[0]) for p in prompts]
  canvas = args.canvas_length or max(prompt_lengths) + args.max_tokens
  levels = [int(c) for c in args.concurrency.split(",")]
  fields = dict(max_tokens=args.max_tokens, temperature=args.temperature, steps=args.steps)
  if args.sampler:
    fields["sampler"] = args.sampler
  knobs = dict(steps=args.steps, temperature=args.temperature)
  log(f"model {model_info(model)}; canvas {canvas}; {fields}")

  served: list[dict] = []
  rows: list[dict] = []
  c16_runs: list[dict] = []
  with contextlib.ExitStack() as stack:
    server = stack.enter_context(running(model, max_batch=args.max_batch, canvas_length=canvas,
                                         max_queue=max(64, 2 * max(levels)), api_key=API_KEY))
    engine = server.engine
    name = served_name(model)
    spec_of = lambda record: engine.prepare(
        generation.prompt_ids(model, [record["prompt"]])[0], max_new_tokens=args.max_tokens,
        seed=record["seed"], sampler=args.sampler, knobs=knobs).spec
    job = engine.prepare(generation.prompt_ids(model, [prompts[0]])[0],
                         max_new_tokens=args.max_tokens, seed=0, sampler=args.sampler,
                         knobs=knobs)
    # Warm-up: every program of the lane compiles here (the empty lane, admit, move, and the
    # tick of every bucket), so nothing compiles while measured.
    engine.warm(job, timeout=600)
    clients = stack.enter_context(load_generator(server.base_url, API_KEY, name))
    warm, _ = clients.run(request_plan(2, 4, prompts, args.seed + 7), 2, fields)
    compiles_before = engine.stats().compiles
    for concurrency in levels:
      runs = args.repeats if concurrency == OFFLINE_PROMPTS else 1
      level = []
      for run in range(runs):
        count = max(args.requests, concurrency)
        count -= count % concurrency  # every client sends as many
        plan = request_plan(concurrency, count, prompts, args.seed + 100 * run)
        records, wall = clients.run(plan, concurrency, fields)
        served += records
        level.append(level_row(concurrency, records, wall))
        log(f"concurrency {concurrency} run {run}: {level[-1]} (wall {wall:.2f} s)")
      chosen = sorted(level, key=lambda r: r["tokens_per_s"])[len(level) // 2]
      rows.append(chosen)
      if concurrency == OFFLINE_PROMPTS:
        c16_runs = level
    ticks_after = engine.stats().ticks

    def good() -> bool:
      import openai
      api = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
      record = one_request(api, name, dict(prompt=prompts[0], seed=args.seed + 99), fields)
      served.append(record)
      return len(record["token_ids"]) > 0

    bad = bad_requests(server.url, API_KEY, bad_bodies(name, fields, args.max_batch, canvas),
                       good)
    log(f"bad requests: {bad['answered_4xx']} of {bad['sent']} answered 4xx; alive after: "
        f"{bad['server_alive_after']}")
    compiles_after = engine.stats().compiles
    engine_stats = engine.stats()
    spec_reprs = sorted({r["spec"] for r in served + warm})

  spec = job.spec
  if spec_reprs != [repr(spec)]:
    log(f"warning: responses name specs {spec_reprs}, the engine's is {spec!r}")
  offline = offline_batch(model, prompts[:OFFLINE_PROMPTS], spec, args.max_tokens, args.seed,
                          repeats=args.repeats)
  log(f"offline batch of {OFFLINE_PROMPTS}: {offline}")

  # The engine alone (no HTTP): the 16 prompts at once and one row on the server's slots (its
  # ticks run the 1-row bucket), and two rows one after the other on a 1-slot lane; medians of
  # `repeats` runs.
  from mdjax.serve.engine import Engine
  prep = Engine(model, max_batch=args.max_batch, canvas_length=canvas)
  jobs = [prep.prepare(generation.prompt_ids(model, [p])[0], max_new_tokens=args.max_tokens,
                       seed=args.seed + i, sampler=args.sampler, knobs=knobs)
          for i, p in enumerate(prompts[:OFFLINE_PROMPTS])]
  def median_of(runs: list[dict]) -> dict:
    return {**sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2],
            "runs_tick_s": [r["tick_s"] for r in runs]}

  repeat = lambda slots, count: median_of(
      [engine_alone(model, jobs[:count], slots, canvas) for _ in range(args.repeats)])
  alone = dict(batch16_slots=repeat(args.max_batch, OFFLINE_PROMPTS),
               batch1_slots=repeat(args.max_batch, 1), batch1_1slot=repeat(1, 2))
  log(f"engine alone: {alone}")

  started = time.perf_counter()
  equal, mismatches = offline_equal(model, served, spec_of, args.max_tokens)
  check_s = time.perf_counter() - started
  log(f"served_equals_offline: {equal} over {len(served)} requests ({check_s:.1f} s)")

  by = {row["concurrency"]: row for row in rows}
  sequential = by[1]["tokens_per_s"] if 1 in by else None
  at16 = by.get(OFFLINE_PROMPTS)
  result = dict(
      model=model_info(model),
      settings=dict(max_batch=args.max_batch, canvas_length=canvas, max_tokens=args.max_tokens,
                    steps=args.steps, temperature=args.temperature,
                    sampler=args.sampler or "the model's default", spec=repr(spec),
                    num_steps=job.num_steps, requests_per_level=args.requests,
                    prompts=prompts, prompt_lengths=prompt_lengths, seed=args.seed,
                    api_key="set (every request sends it)"),
      device=device_info(),
      rows=rows,
      offline_batch_tokens_per_s=offline["tokens_per_s"],
      sequential_tokens_per_s=sequential,
      ratio_16_to_offline=None if at16 is None else
      round(at16["tokens_per_s"] / offline["tokens_per_s"], 3),
      gain_over_sequential=None if at16 is None or not sequential else
      round(at16["tokens_per_s"] / sequential, 2),
      served_equals_offline=equal,
      served_checked=len(served),
      mismatches=mismatches[:5],
      bad_requests=bad,
      compiles=dict(before=compiles_before, after=compiles_after,
                    grew=compiles_after != compiles_before),
      engine=dict(ticks=engine_stats.ticks, ticks_measured=ticks_after,
                  denoiser_calls=engine_stats.denoiser_calls,
                  completion_tokens=engine_stats.completion_tokens,
                  rows_done=engine_stats.rows_done),
      profile=dict(offline=offline, engine_alone=alone,
                   c16_runs_tokens_per_s=[r["tokens_per_s"] for r in c16_runs]),
  )
  result["notes"] = notes(result, args)
  result["bench_seconds"] = round(time.perf_counter() - bench_started, 1)
  if parts & set(PARTS):
    return write_parts(args, result, parts, log)
  if args.out and os.path.exists(args.out):  # the parts not run keep their records
    with open(args.out, encoding="utf-8") as f:
      kept = json.load(f)
    result.update({k: kept[k] for k in PARTS if k in kept})
  if args.out:
    write_record(args.out, result, log)
  log(result["notes"])
  return result


def write_record(path: str, result: dict, log) -> None:
  """`result` as --out's JSON, written atomically (a run stopped midway keeps the old file)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with files.atomic_write(path, "w") as f:
    json.dump(result, f, indent=1)
    f.write("\n")
  log(f"wrote {path}")


def write_parts(args, result: dict, parts: set, log) -> dict:
  """`result` (empty: --out's record as it is) with its `cached`, `prefix` and trained
  (`serve_trained.RECORDS`) records (those of `parts`), written to --out."""
  from mdjax.bench import serve_cached, serve_prefix, serve_trained

  if not result and args.out and os.path.exists(args.out):
    with open(args.out, encoding="utf-8") as f:
      result = json.load(f)
  if "cached" in parts:
    result["cached"] = serve_cached.run(
        levels=[int(c) for c in args.concurrency.split(",")], repeats=args.repeats,
        max_batch=args.max_batch, seed=args.seed, shape=args.cached_shape, log=log)
    log(result["cached"]["notes"])
  if "prefix" in parts:
    result["prefix"] = serve_prefix.run(max_batch=args.max_batch, seed=args.seed,
                                        repeats=args.repeats, log=log)
    log(result["prefix"]["notes"])
  for record in serve_trained.RECORDS:
    if record in parts:
      result[record] = serve_trained.run(
          levels=[int(c) for c in args.concurrency.split(",")], repeats=args.repeats,
          max_batch=args.max_batch, seed=args.seed, record=record, log=log)
      log(result[record]["notes"])
  if args.out:
    write_record(args.out, result, log)
  return result


def notes(result: dict, args) -> str:
  """What the numbers say, computed from them."""
  rows = {row["concurrency"]: row for row in result["rows"]}
  offline, alone = result["profile"]["offline"], result["profile"]["engine_alone"]
  steps = result["settings"]["num_steps"]
  slots = result["settings"]["max_batch"]
  b16, b1, one = alone["batch16_slots"], alone["batch1_slots"], alone["batch1_1slot"]
  offline_step = offline["median_s"] / max(offline["nfe"], 1)
  parts = [f"Model {result['model']['params']:,} parameters (d_model {result['model']['d_model']}, "
           f"{result['model']['layers']} layers, {result['model']['max_len']} positions), "
           f"{result['settings']['max_tokens']} new tokens in {steps} steps a request, "
           f"canvas {result['settings']['canvas_length']}, {slots} slots, on "
           f"{result['device']['device_kind']} ({result['device']['cpus']} CPUs, load average "
           f"{result['device']['load_average'][0]} at the end: shared and noisy, times vary "
           f"up to 2x between runs; concurrency 16 and offline are medians of "
           f"{args.repeats})."]
  if OFFLINE_PROMPTS in rows:
    parts.append(
        f"At 16 clients {rows[16]['tokens_per_s']} tokens/s = {result['ratio_16_to_offline']}x "
        f"the offline batch of the same 16 prompts ({result['offline_batch_tokens_per_s']} "
        f"tokens/s; goal 0.8x: {'met' if result['ratio_16_to_offline'] >= 0.8 else 'missed'}).")
  parts.append(
      f"Where the time goes: offline, one step of the 16 rows takes {offline_step * 1e3:.1f} ms "
      f"inside one compiled scan ({offline['nfe']} steps); the engine alone (no HTTP) ticks its "
      f"{slots} slots in {b16['tick_s'] * 1e3:.1f} ms a tick with 16 rows "
      f"({b16['tokens_per_s']} tokens/s, {b16['tokens_per_s'] / offline['tokens_per_s']:.2f}x "
      f"offline) and {b1['tick_s'] * 1e3:.1f} ms with 1 row (its tick runs the 1-row "
      f"bucket); a 1-slot lane ticks in {one['tick_s'] * 1e3:.1f} ms.")
  if OFFLINE_PROMPTS in rows:
    share = rows[16]["tokens_per_s"] / b16["tokens_per_s"]
    parts.append(
        f"Served at 16 clients is {share:.2f}x the engine alone"
        + (f": HTTP, the client threads and admission between ticks cost {1 - share:.0%}."
           if share < 0.97 else ": the HTTP layer's cost is within the noise here."))
  if 1 in rows and OFFLINE_PROMPTS in rows:
    per_row = b16["tick_s"] / 16
    saving = b1["tick_s"] / per_row
    parts.append(
        f"Gain over sequential (one request at a time, {rows[1]['tokens_per_s']} tokens/s, "
        f"p50 {rows[1]['p50_s']} s): {result['gain_over_sequential']}x. Its size is what "
        f"batching saves per row on this hardware: a lone row ticks on the 1-row bucket in "
        f"{b1['tick_s'] * 1e3:.2f} ms a step, 16 rows on the 16-row one in "
        f"{b16['tick_s'] * 1e3:.1f} ms ({per_row * 1e3:.2f} ms a row, {saving:.2f}x less). "
        "On a CPU the matmuls of one row already keep the cores busy, so a step's time grows "
        "almost in proportion to its rows; on an accelerator a step's time grows far less "
        "with the batch, so the gain should be larger there (not measured by this run).")
  if 32 in rows and OFFLINE_PROMPTS in rows:
    parts.append(
        f"At 32 clients the {slots} slots are full and half the requests wait in the queue: "
        f"{rows[32]['tokens_per_s']} tokens/s, p99 {rows[32]['p99_s']} s against "
        f"{rows[16]['p99_s']} s at 16.")
  parts.append("sequential_tokens_per_s is the concurrency-1 row: one client, one request at "
               "a time.")
  compiles = result["compiles"]
  parts.append(f"Compiles: {compiles['before']} after warm-up, {compiles['after']} at the end "
               f"({'grew' if compiles['grew'] else 'none while measured'}).")
  return " ".join(parts)


if __name__ == "__main__":
  import jax

  from mdjax.serve import host_memory
  if jax.default_backend() == "cpu":  # as python -m mdjax.serve does (not a caller's process)
    host_memory.keep_freed_memory()
  main()
