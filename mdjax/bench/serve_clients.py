"""The load generator of the serving benchmarks (`mdjax.bench.serve`, `serve_cached`): the
`openai` client's requests from threads, a level's row, the model's and machine's record."""

from __future__ import annotations

import os
import threading
import time
from typing import Sequence

import numpy as np

OFFLINE_PROMPTS = 16  # the prompts of the concurrency-16 run, batched offline
API_KEY = "mdjax-bench-key"

def model_info(model) -> dict:
  import jax
  config = getattr(model, "config", None)
  cfg = getattr(config, "model", None) if config is not None else None
  hf = model.hf_config or {}
  d_model = getattr(cfg, "d_model", None) or hf.get("hidden_size") or hf.get("d_model")
  layers = getattr(cfg, "num_layers", None) or hf.get("num_hidden_layers") \
      or hf.get("n_layers")
  return dict(source=model.source, family=model.family,
              params=int(sum(np.size(x) for x in jax.tree.leaves(model.params))),
              d_model=None if d_model is None else int(d_model),
              layers=None if layers is None else int(layers),
              vocab=int(model.vocab_size), max_len=int(model.max_len))


def request_plan(concurrency: int, requests: int, prompts: Sequence[str], seed: int) -> list:
  """`requests` (prompt, seed) pairs for one concurrency: prompt j % len(prompts), a seed of
  its own (so no two requests of the run share a (level, index) seed)."""
  base = seed * 1_000_003 + concurrency * 10_000
  return [dict(prompt=prompts[j % len(prompts)], seed=base + j) for j in range(requests)]


def run_clients(base_url: str, api_key: str, model_name: str, plan: list, concurrency: int,
                fields: dict) -> tuple[list[dict], float]:
  """The plan's requests from `concurrency` threads (client k sends requests k, k + c, ...
  one after another, each thread with its own `openai.OpenAI`): (a record per request,
  wall seconds from the first send to the last answer)."""
  import openai

  records: list[dict | None] = [None] * len(plan)
  errors: list[BaseException] = []
  barrier = threading.Barrier(concurrency + 1)

  def client(k: int) -> None:
    api = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
    barrier.wait()
    try:
      for j in range(k, len(plan), concurrency):
        records[j] = one_request(api, model_name, plan[j], fields)
    except BaseException as error:  # reported after the join
      errors.append(error)

  threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(concurrency)]
  for thread in threads:
    thread.start()
  barrier.wait()
  started = time.perf_counter()
  for thread in threads:
    thread.join()
  wall = time.perf_counter() - started
  if errors:
    raise RuntimeError(f"{len(errors)} client(s) failed; first: {errors[0]!r}")
  return records, wall


def one_request(api, model_name: str, request: dict, fields: dict) -> dict:
  started = time.perf_counter()
  response = api.completions.create(
      model=model_name, prompt=request["prompt"], max_tokens=fields["max_tokens"],
      temperature=fields["temperature"], seed=request["seed"],
      extra_body={k: v for k, v in fields.items() if k not in ("max_tokens", "temperature")})
  latency = time.perf_counter() - started
  body = response.model_dump()
  choice = body["choices"][0]
  return dict(prompt=request["prompt"], seed=request["seed"], latency_s=latency,
              token_ids=[int(t) for t in choice["mdjax"]["token_ids"]],
              completion_tokens=int(body["usage"]["completion_tokens"]),
              spec=body["mdjax"]["spec"], text=choice["text"])


def level_row(concurrency: int, records: list[dict], wall: float) -> dict:
  latencies = np.array([r["latency_s"] for r in records])
  tokens = sum(r["completion_tokens"] for r in records)
  return dict(concurrency=concurrency, requests=len(records),
              tokens_per_s=round(tokens / wall, 2),
              p50_s=round(float(np.percentile(latencies, 50)), 4),
              p99_s=round(float(np.percentile(latencies, 99)), 4))


def device_info() -> dict:
  import jax

  from mdjax.serve import host_memory
  device = jax.devices()[0]
  return dict(platform=device.platform, device_kind=device.device_kind,
              count=len(jax.devices()), jax=jax.__version__, cpus=os.cpu_count(),
              load_average=[round(x, 2) for x in os.getloadavg()],
              host_memory_kept=host_memory.kept())
