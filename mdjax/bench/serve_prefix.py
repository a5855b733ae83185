"""The prefix cache on a shared system prompt (`python -m mdjax.bench.serve`'s `prefix` rows).

A random SDAR-shaped checkpoint (block-causal, blocks of 32; `SHAPE`) served by the engine
alone (no HTTP: `Engine.run_once`) with `prefix_cache_bytes`: 16 requests, each a system
prompt of 224 ids (7 whole blocks) and a question of 8 to 24 ids of its own (the prompt's
tail, held in the first generated block), 32 new tokens with SDAR's reference decoder. The
same requests run in turn with the lane's prefix cache on and off (the same compiled
programs: the lane only stops reading it), `repeats` times each; the rows with and without
it are compared token for token.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np

VOCAB, MASK_ID, EOS_ID = 1024, 1000, 999
SHAPE = dict(d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
             mlp_hidden=384)
BLOCK, SYSTEM_LEN, QUESTION_LENS, MAX_TOKENS, REQUESTS = 32, 224, (8, 24), 32, 16
DEFAULT_PATH = os.path.join(tempfile.gettempdir(), "mdjax_bench_serve_sdar")


def random_sdar(path: str, log=print):
  """The random SDAR-shaped checkpoint (written to `path` once, then loaded)."""
  import jax

  import mdjax
  from mdjax import io
  from mdjax.bench.families import spread
  from mdjax.models import published

  config = published.PublishedConfig(
      family="sdar", vocab_size=VOCAB, rope_theta=10000.0, norm_eps=1e-6, qkv_bias=False,
      logit_shift=False, qk_norm=True, block_size=BLOCK, mask_id=MASK_ID, eos_id=EOS_ID,
      max_len=512, **SHAPE)
  if not os.path.exists(os.path.join(path, "config.json")):
    params = spread(published.init_params(config, jax.random.key(0)), MASK_ID)
    io.save(params, path, family="sdar", config=config)
    log(f"wrote the random SDAR-shaped checkpoint to {path}")
  return mdjax.load(path)


def _serve(engine, jobs) -> tuple[float, list, list, float]:
  """All jobs submitted at once and run to the end: (seconds, each row's token ids, each
  row's seconds to its first update, the process's CPU seconds meanwhile: on a shared
  machine the steadier of the two)."""
  started, first, ids = time.perf_counter(), {}, {}
  cpu_started = time.process_time()

  def listener(index):
    def on_update(update):
      first.setdefault(index, time.perf_counter() - started)
      if update.completion is not None:
        ids[index] = [int(t) for t in update.completion.token_ids]
    return on_update

  handles = [engine.submit(job, listener(i)) for i, job in enumerate(jobs)]
  while not all(h.done for h in handles):
    engine.run_once()
  return time.perf_counter() - started, [ids[i] for i in range(len(jobs))], \
      [first[i] for i in range(len(jobs))], time.process_time() - cpu_started


def run(*, max_batch: int, seed: int, repeats: int, path: str = DEFAULT_PATH,
        log=print) -> dict:
  """The `prefix` record of results/serve.json."""
  from mdjax.bench import serve_clients
  from mdjax.serve.engine import Engine

  model = random_sdar(path, log)
  rng = np.random.default_rng(seed)
  system = [int(t) for t in rng.integers(0, EOS_ID - 1, SYSTEM_LEN)]
  prompts = [system + [int(t) for t in rng.integers(0, EOS_ID - 1, rng.integers(
      QUESTION_LENS[0], QUESTION_LENS[1] + 1))] for _ in range(REQUESTS)]
  room = SYSTEM_LEN + QUESTION_LENS[1] + MAX_TOKENS
  engine = Engine(model, max_batch=max_batch, max_queue=REQUESTS, canvas_length=room,
                  prefix_cache_bytes=1 << 30)
  jobs = [engine.prepare(p, max_new_tokens=MAX_TOKENS, seed=seed + i)
          for i, p in enumerate(prompts)]
  started = time.perf_counter()
  engine.warm(jobs[0])
  log(f"prefix bench: lane compiled in {time.perf_counter() - started:.1f} s")
  [lane] = engine.lanes
  cache = engine.prefix_cache
  runs = {"off": [], "on": []}
  tokens = {}
  hits = misses = 0
  for _ in range(repeats):
    for mode in ("off", "on"):  # in turn: the same load on both
      lane.prefix = cache if mode == "on" else None
      before, ticks = (cache.hits, cache.misses), engine.stats().ticks
      seconds, ids, ttft, cpu_s = _serve(engine, jobs)
      if mode == "on":
        hits += cache.hits - before[0]
        misses += cache.misses - before[1]
      runs[mode].append(dict(seconds=seconds, cpu_s=round(cpu_s, 3),
                             ttft_p50_s=statistics.median(ttft),
                             tokens=sum(len(t) for t in ids),
                             ticks=engine.stats().ticks - ticks))
      tokens.setdefault(mode, ids)
      log(f"prefix cache {mode}: {runs[mode][-1]}")
  median = {mode: sorted(r, key=lambda x: x["seconds"])[len(r) // 2] for mode, r in runs.items()}
  speed = lambda mode: median[mode]["tokens"] / median[mode]["seconds"]
  result = dict(
      model=dict(serve_clients.model_info(model), shape=SHAPE, block=BLOCK,
                 weights="random (spread logits)"),
      settings=dict(max_batch=max_batch, canvas_length=room, system_prompt=SYSTEM_LEN,
                    question_lengths=list(QUESTION_LENS), max_tokens=MAX_TOKENS,
                    requests=REQUESTS, repeats=repeats, spec=repr(jobs[0].spec),
                    cache=jobs[0].cache),
      device=serve_clients.device_info(),
      hit_rate=round(hits / max(hits + misses, 1), 3), hits=hits, misses=misses,
      entries=cache.entries, entry_bytes=cache.bytes // max(cache.entries, 1),
      tokens_per_s={mode: round(speed(mode), 2) for mode in runs},
      speedup=round(speed("on") / speed("off"), 3),
      # CPU seconds of the process, median of the runs (the machine's other load moves
      # wall times by up to 2x between runs; it moves these less).
      speedup_cpu=round(statistics.median(r["cpu_s"] for r in runs["off"])
                        / statistics.median(r["cpu_s"] for r in runs["on"]), 3),
      ttft_p50_s={mode: round(median[mode]["ttft_p50_s"], 4) for mode in runs},
      hits_equal_misses=tokens["on"] == tokens["off"],
      runs=runs,
  )
  result["notes"] = (
      f"{REQUESTS} requests sharing a {SYSTEM_LEN}-id system prompt ({SYSTEM_LEN // BLOCK} "
      f"blocks of {BLOCK}) with questions of their own in its tail: hit rate "
      f"{result['hit_rate']} with the cache ({misses} miss(es), the first row of the first "
      f"run), {result['tokens_per_s']['on']} tokens/s against {result['tokens_per_s']['off']} "
      f"without ({result['speedup']}x; in the process's CPU seconds "
      f"{result['speedup_cpu']}x), median time to a row's first step "
      f"{result['ttft_p50_s']['on']} s against {result['ttft_p50_s']['off']} s; rows with "
      f"and without the cache equal token for token: {result['hits_equal_misses']}. A hit "
      f"saves the row's first pass, over its canvas of {jobs[0].blocks.stepper.layout.span} "
      f"positions; the threshold passes often on these spread random weights, so the rows' "
      f"other passes (over a 32-position block) are few: {median['on']['ticks']} ticks for "
      f"the 16 rows at once.")
  return result
