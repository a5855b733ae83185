"""The cached lane against the uncached one (`python -m mdjax.bench.serve`'s `cached` rows).

A random LLaDA-shaped checkpoint (bidirectional, absolute positions; `SHAPE`, logits spread
as in `mdjax.bench.pretrained`) saved in the published layout and loaded by `mdjax.load`,
served by one server with two lanes side by side: LLaDA's reference decoder with Fast-dLLM's
threshold (blocks of 32, 0.9) on the whole canvas (`kv_cache="none"`, the uncached lane the
server had before it served caches) and the same decoder with the dual cache
(`kv_cache="dual"`: a full pass at each block's first step, in the lane's `refresh`
program over those rows alone, window passes between). Prompts of 192 ids and 64 new tokens
(a canvas of 256, two blocks). At each concurrency both lanes run in turn (so a change in
the machine's load falls on both); beside them the offline batch (`mdjax.generate` with the
same spec, the 16 prompts at once) of each, timed between the 16-client runs, every request of the 16-client runs against
`mdjax.generate` of its prompt alone, and the full passes the cached lane made per row.
"""

from __future__ import annotations

import os
import resource
import tempfile
import time

import numpy as np

VOCAB, MASK_ID, EOS_ID, EOT_ID = 1024, 1000, 999, 1001
SHAPE = dict(d_model=128, num_layers=4, num_heads=4, mlp_hidden=384)
PROMPT_LEN, MAX_TOKENS, BLOCK, THRESHOLD = 192, 64, 32, 0.9
PROMPTS = 16
DEFAULT_PATH = os.path.join(tempfile.gettempdir(), "mdjax_bench_serve_llada")


def llada_config():
  """The LLaDA-shaped network of these rows (SHAPE, VOCAB, LLaDA's RoPE base)."""
  from mdjax.models import published

  return published.PublishedConfig(
      family="llada", vocab_size=VOCAB, num_kv_heads=SHAPE["num_heads"],
      head_dim=SHAPE["d_model"] // SHAPE["num_heads"], rope_theta=500000.0, norm_eps=1e-5,
      qkv_bias=False, logit_shift=False, mask_id=MASK_ID, eos_id=EOS_ID, eot_id=EOT_ID,
      max_len=512, **SHAPE)


def random_llada(path: str, log=print):
  """The random LLaDA-shaped checkpoint (written to `path` once, then loaded)."""
  import mdjax
  from mdjax import io
  from mdjax.bench.pretrained import spread_params

  config = llada_config()
  if not os.path.exists(os.path.join(path, "config.json")):
    io.save(spread_params(config, 0), path, config=config)
    log(f"wrote the random LLaDA-shaped checkpoint to {path}")
  return mdjax.load(path)


def published_shape(name: str):
  """A published shape of `mdjax.bench.families.PUBLISHED` (say "LLaDA2.0-mini") with random
  bfloat16 weights, spread as there (no download; for an accelerator: 32.5 GB for it)."""
  import jax

  from mdjax import formats
  from mdjax.bench import families
  from mdjax.io import record
  from mdjax.models import published

  entry = families.PUBLISHED[name]
  family = formats.get(entry["family"])
  config = family.config_from_hf(dict(entry["raw"]), "bfloat16")
  params = jax.jit(published.init_params, static_argnums=0)(config, jax.random.key(0))
  params = jax.jit(families.spread, static_argnums=1, donate_argnums=0)(params, config.mask_id)
  return record.published_model(params=params, config=config, family=family.family,
                                hf_config=dict(entry["raw"]))


def lanes_of(model) -> dict:
  """Each lane's request fields. LLaDA: its reference decoder with the threshold (a block's
  steps at most its length) on the canvas, without and with the dual cache. A block-causal
  family (LLaDA2, SDAR): the confidence decoder with its blocks and threshold on the canvas
  (what the server ran before it served caches) against the family's own decoder (blocks
  with the exact cache of finished blocks)."""
  common = dict(max_tokens=MAX_TOKENS, temperature=0.0)
  if model.family == "llada":
    lane = lambda kv: dict(common, steps=MAX_TOKENS, block_length=BLOCK, threshold=THRESHOLD,
                           kv_cache=kv)
    return {"uncached": lane("none"), "cached": lane("dual")}
  return {"uncached": dict(common, sampler="confidence", steps=MAX_TOKENS, block_length=BLOCK,
                           threshold=THRESHOLD),
          "cached": dict(common, threshold=THRESHOLD) if model.family == "llada2"
          else dict(common)}


def offline_kwargs(job, fields: dict) -> dict:
  """What `mdjax.generate` takes to run a lane's decoder: a canvas lane's spec; a block
  lane's knobs (its spec alone runs on the canvas)."""
  if job.blocks is None:
    return dict(spec=job.spec)
  return {k: v for k, v in fields.items() if k not in ("max_tokens", "sampler")}


def cpu_seconds() -> float:
  """CPU seconds this process has used (every thread: the server's, the engine's, XLA's)."""
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def offline_call(model, prompts, kwargs: dict, seed: int):
  """A call of one batched `mdjax.generate` of the prompts (the offline batch): it returns
  (seconds, tokens, nfe, CPU seconds)."""
  import jax

  import mdjax

  def call():
    started, cpu = time.perf_counter(), cpu_seconds()
    out = mdjax.generate(model, [list(p) for p in prompts], max_new_tokens=MAX_TOKENS,
                         key=jax.random.key(seed), **kwargs)
    return (time.perf_counter() - started, int(sum(len(c.token_ids) for c in out)),
            int(out.nfe), cpu_seconds() - cpu)

  return call


def offline_record(timed: list) -> dict:
  """The offline batch's record from its timed calls: tokens/s of the median."""
  median = sorted(call[0] for call in timed)[len(timed) // 2]
  _, tokens, nfe, _ = timed[0]
  return dict(tokens=tokens, median_s=round(median, 4), tokens_per_s=round(tokens / median, 2),
              nfe=nfe, runs_s=[round(call[0], 3) for call in timed],
              runs_cpu_s=[round(call[3], 3) for call in timed])


def paired(served: list, offline: list) -> dict:
  """Each 16-client run against the offline call timed right after it: served tokens/s over
  offline tokens/s (wall), and served tokens a CPU second of this process (the server and
  its engine; the clients run in their own) over offline tokens a CPU second."""
  wall = [round(run["tokens"] / run["seconds"] / (tokens / seconds), 3)
          for run, (seconds, tokens, _, _) in zip(served, offline)]
  cpu = [round(run["tokens"] / run["cpu_s"] / (tokens / cpu_s), 3)
         for run, (_, tokens, _, cpu_s) in zip(served, offline)]
  return dict(wall=wall, cpu=cpu, served_cpu_s=[round(run["cpu_s"], 3) for run in served],
              clients_cpu_s=[run["clients_cpu_s"] for run in served])


def offline_check(model, records: list[dict], kwargs: dict) -> tuple[list[dict], list[int]]:
  """The served records that differ from `mdjax.generate` of their prompt alone, and each
  record's denoiser calls there (its steps: a block ends when the threshold has unmasked
  it)."""
  import jax

  import mdjax

  mismatches, nfe = [], []
  for record in records:
    out = mdjax.generate(model, [record["prompt"]], max_new_tokens=MAX_TOKENS,
                         key=jax.random.key(record["seed"]), **kwargs)
    offline = [int(t) for t in out[0].token_ids]
    nfe.append(int(out.nfe))
    if offline != record["token_ids"]:
      mismatches.append(dict(seed=record["seed"], served=record["token_ids"], offline=offline))
  return mismatches, nfe


def run(*, levels, repeats: int, max_batch: int, seed: int, shape: str = "cpu",
        path: str = DEFAULT_PATH, log=print) -> dict:
  """The `cached` record of results/serve.json. shape: "cpu" (the random LLaDA-shaped
  model of SHAPE) or a name of `mdjax.bench.families.PUBLISHED` (an accelerator's)."""
  model = random_llada(path, log) if shape == "cpu" else published_shape(shape)
  rng = np.random.default_rng(seed)
  prompts = [[int(t) for t in rng.integers(0, min(EOS_ID, model.eos_id or EOS_ID) - 1,
                                           PROMPT_LEN)] for _ in range(PROMPTS)]
  return measure(model, prompts, levels=levels, repeats=repeats, max_batch=max_batch,
                 seed=seed, about=dict(shape=SHAPE if shape == "cpu" else shape,
                                       weights="random (spread logits)"), log=log)


def measure(model, prompts: list[list[int]], *, levels, repeats: int, max_batch: int,
            seed: int, about: dict, log=print) -> dict:
  """Both lanes of `model` served and offline on `prompts` (PROMPTS of PROMPT_LEN ids), each
  16-client request checked against `mdjax.generate`: a record of results/serve.json. about:
  what the record says of the model beside `model_info` (its shape, its weights)."""
  from mdjax.bench import serve_clients as bench
  from mdjax.serve.server import running, served_name

  lanes = lanes_of(model)
  knobs = {name: {k: v for k, v in fields.items() if k not in ("max_tokens", "sampler")}
           for name, fields in lanes.items()}
  rows = {name: [] for name in lanes}
  c16 = {name: [] for name in lanes}
  records16 = {name: [] for name in lanes}
  runs16 = {name: [] for name in lanes}  # each 16-client run: tokens, seconds, CPU seconds
  served = {name: 0 for name in lanes}  # requests (one row each) served by each lane
  with running(model, max_batch=max_batch, max_queue=max(64, 2 * max(levels)),
               max_programs=4, api_key=bench.API_KEY) as server, \
       bench.load_generator(server.base_url, bench.API_KEY, served_name(model)) as clients:
    engine, name = server.engine, served_name(model)
    jobs = {lane: engine.prepare(prompts[0], max_new_tokens=MAX_TOKENS, seed=0,
                                 sampler=lanes[lane].get("sampler"), knobs=knobs[lane])
            for lane in lanes}
    started = time.perf_counter()
    for job in jobs.values():
      engine.warm(job, timeout=1200)
    kwargs = {lane: offline_kwargs(jobs[lane], lanes[lane]) for lane in lanes}
    offline_calls = {lane: offline_call(model, prompts, kwargs[lane], seed) for lane in lanes}
    for call in offline_calls.values():
      call()  # compiles
    log(f"cached bench: both lanes and both offline batches compiled in "
        f"{time.perf_counter() - started:.1f} s")
    timed = {lane: [] for lane in lanes}  # the offline calls, one a 16-client run
    compiles_before = engine.stats().compiles
    for concurrency in levels:
      runs = repeats if concurrency == bench.OFFLINE_PROMPTS else 1
      level = {lane: [] for lane in lanes}
      for run_index in range(runs):
        count = max(concurrency, 8)
        plan = bench.request_plan(concurrency, count, prompts, seed + 100 * run_index)
        for lane, fields in lanes.items():  # side by side: the same load on both
          cpu, clients_cpu = cpu_seconds(), clients.cpu_seconds()
          records, wall = clients.run(plan, concurrency, fields)
          level[lane].append(bench.level_row(concurrency, records, wall))
          served[lane] += len(records)
          if concurrency == bench.OFFLINE_PROMPTS:
            runs16[lane].append(dict(
                tokens=sum(r["completion_tokens"] for r in records), seconds=wall,
                cpu_s=cpu_seconds() - cpu,
                clients_cpu_s=None if clients_cpu is None
                else round(clients.cpu_seconds() - clients_cpu, 3)))
            if run_index == 0:
              records16[lane] = records
          log(f"{lane} concurrency {concurrency} run {run_index}: {level[lane][-1]}")
        if concurrency == bench.OFFLINE_PROMPTS:  # offline between the served runs
          for lane, call in offline_calls.items():
            timed[lane].append(call())
      for lane in lanes:
        rows[lane].append(sorted(level[lane], key=lambda r: r["tokens_per_s"])[runs // 2])
        if concurrency == bench.OFFLINE_PROMPTS:
          c16[lane] = [r["tokens_per_s"] for r in level[lane]]
    compiles_after = engine.stats().compiles
    cached_lane = next(lane for lane in engine.lanes if lane.key == jobs["cached"].lane_key)
    full_passes = cached_lane.full_passes

  offline = {lane: offline_record(timed[lane] or [offline_calls[lane]()]) for lane in lanes}
  log(f"offline batches: {offline}")
  checks = {lane: offline_check(model, records16[lane], kwargs[lane]) for lane in lanes}
  mismatches = [bad for lane in lanes for bad in checks[lane][0]]
  equal, checked = not mismatches, sum(len(records16[lane]) for lane in lanes)
  blocks = MAX_TOKENS // BLOCK
  by = {lane: {row["concurrency"]: row for row in rows[lane]} for lane in lanes}
  at = lambda lane, c: by[lane].get(c, {}).get("tokens_per_s")
  ratio = lambda a, b: None if not a or not b else round(a / b, 3)
  result = dict(
      model=dict(bench.model_info(model), **about),
      settings=dict(max_batch=max_batch, prompt_len=PROMPT_LEN, max_tokens=MAX_TOKENS,
                    canvas_length=PROMPT_LEN + MAX_TOKENS, block_length=BLOCK,
                    threshold=THRESHOLD, temperature=0.0,
                    specs={lane: repr(job.spec) for lane, job in jobs.items()},
                    num_steps={lane: job.num_steps for lane, job in jobs.items()},
                    requests="8 at 1 and 4 clients, else one a client", seed=seed),
      device=bench.device_info(),
      rows=rows,
      offline_batch_tokens_per_s={lane: offline[lane]["tokens_per_s"] for lane in lanes},
      ratio_cached_to_uncached={c: ratio(at("cached", c), at("uncached", c))
                                for c in levels},
      ratio_cached_16_to_offline_cached=ratio(at("cached", 16),
                                              offline["cached"]["tokens_per_s"]),
      ratio_uncached_16_to_offline_uncached=ratio(at("uncached", 16),
                                                  offline["uncached"]["tokens_per_s"]),
      offline_cached_to_uncached=ratio(offline["cached"]["tokens_per_s"],
                                       offline["uncached"]["tokens_per_s"]),
      served_equals_offline=equal, served_checked=checked, mismatches=mismatches[:3],
      full_passes_per_cached_row=round(full_passes / max(served["cached"], 1), 3),
      # each checked request's denoiser calls alone (served == offline, so its served steps)
      steps_per_block={lane: round(float(np.mean(checks[lane][1])) / blocks, 3)
                       for lane in lanes if checks[lane][1]},
      compiles=dict(before=compiles_before, after=compiles_after,
                    grew=compiles_after != compiles_before),
      profile=dict(offline=offline, c16_runs_tokens_per_s=c16, requests_served=served,
                   paired_16_to_offline={lane: paired(runs16[lane], timed[lane])
                                         for lane in lanes}),
  )
  result["notes"] = notes(result)
  return result


def notes(result: dict) -> str:
  """What the numbers say, computed from them."""
  rows = {lane: {r["concurrency"]: r for r in result["rows"][lane]} for lane in result["rows"]}
  ratios = result["ratio_cached_to_uncached"]
  parts = [f"LLaDA-shaped model, {result['model']['weights']} weights "
           f"({result['model']['params']:,} parameters), prompts of "
           f"{PROMPT_LEN} ids, {MAX_TOKENS} new tokens in blocks of {BLOCK}, threshold "
           f"{THRESHOLD}, {result['settings']['max_batch']} slots, clients in a process of "
           f"their own; load average {result['device']['load_average'][0]} at the end (a "
           "shared CPU: medians, the two lanes measured in turn at each level)."]
  if 16 in rows["cached"]:
    pairs = result["profile"]["paired_16_to_offline"]["cached"]
    parts.append(
        f"At 16 clients the cached lane serves {rows['cached'][16]['tokens_per_s']} tokens/s "
        f"against the uncached lane's {rows['uncached'][16]['tokens_per_s']} "
        f"({ratios.get(16)}x; goal 3x), and {result['ratio_cached_16_to_offline_cached']}x "
        f"the offline cached batch ({result['offline_batch_tokens_per_s']['cached']} tokens/s; "
        f"goal 0.9x); each 16-client run against the offline call right after it: "
        f"{pairs['wall']} in tokens/s, {pairs['cpu']} in tokens a CPU second of the "
        "server's process (the engine, HTTP; the clients' own process used "
        f"{pairs['clients_cpu_s']} CPU s a run).")
  nfe = result["profile"]["offline"]["cached"]["nfe"]
  steps = result["settings"]["num_steps"]["cached"]
  fired = (f"The threshold fired: the offline cached batch made {nfe} denoiser calls of "
           f"the {steps} its bound allows (a block ends when its slowest row's does)"
           if nfe < steps else
           f"The threshold never fired: every block ran its "
           f"{steps // (MAX_TOKENS // BLOCK)} steps, one full pass and the rest window "
           "passes cached, all full passes uncached")
  if result.get("steps_per_block"):
    fired += (f"; each checked request alone took {result['steps_per_block']} steps a block "
              "(mean)")
  parts.append(
      f"Offline the dual cache is {result['offline_cached_to_uncached']}x the uncached "
      f"decoder: the ceiling of the served ratio. {fired}; the cached lane made "
      f"{result['full_passes_per_cached_row']} full passes a row.")
  parts.append(f"Served == offline: {result['served_equals_offline']} over "
               f"{result['served_checked']} requests (the 16-client runs of both lanes).")
  return " ".join(parts)
