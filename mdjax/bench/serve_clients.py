"""The load generator of the serving benchmarks (`mdjax.bench.serve`, `serve_cached`): the
`openai` client's requests from a process of its own, a level's row, the model's and
machine's record.

The clients run outside the server's process, as a server's clients do: in the server's
process their threads would take the interpreter's lock from the server's event loop and
its engine thread, and delay both (what the benchmark measured before: 16 client threads
in the server's process reached the engine up to seconds after the clock started). The
process is started once (`load_generator`), its imports and each run's connections made
before its clock starts; a run's wall time is from the first request sent to the last
answer, measured there.

    python -m mdjax.bench.serve_clients    # the process: one JSON run a line on stdin
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Iterator, Sequence

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


class LoadGenerator:
  """The client process (`load_generator`): `run` sends one run's requests."""

  def __init__(self, process: subprocess.Popen, base_url: str, api_key: str, model_name: str):
    self.process = process
    self.server = dict(base_url=base_url, api_key=api_key, model_name=model_name)

  def cpu_seconds(self) -> float | None:
    """CPU seconds the client process has used (None where /proc cannot tell)."""
    try:
      with open(f"/proc/{self.process.pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
      return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

  def run(self, plan: list, concurrency: int, fields: dict) -> tuple[list[dict], float]:
    """The plan's requests from `concurrency` clients (client k sends requests k, k + c,
    ... one after another, each client with its own `openai.AsyncOpenAI` and connection):
    (a record per request, wall seconds from the first send to the last answer)."""
    line = json.dumps(dict(self.server, plan=plan, concurrency=concurrency, fields=fields))
    self.process.stdin.write(line + "\n")
    self.process.stdin.flush()
    answer = self.process.stdout.readline()
    if not answer:
      raise RuntimeError(f"the client process ended (exit code {self.process.wait()})")
    out = json.loads(answer)
    if out.get("error"):
      raise RuntimeError(f"the clients failed: {out['error']}")
    return out["records"], out["wall"]


@contextlib.contextmanager
def load_generator(base_url: str, api_key: str, model_name: str) -> Iterator[LoadGenerator]:
  """The client process (`python -m mdjax.bench.serve_clients`), started and ready (its
  imports done); it ends with the block."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  process = subprocess.Popen([sys.executable, "-m", "mdjax.bench.serve_clients"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
  try:
    if process.stdout.readline().strip() != "ready":
      raise RuntimeError(f"the client process did not start (exit code {process.wait()})")
    yield LoadGenerator(process, base_url, api_key, model_name)
  finally:
    process.stdin.close()
    try:
      process.wait(timeout=30)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()


async def run_async(base_url: str, api_key: str, model_name: str, plan: list,
                    concurrency: int, fields: dict) -> tuple[list[dict], float]:
  """`LoadGenerator.run` in the client process: each client's connection opened (a
  `GET /v1/models`) before the clock, which stops at the last response's arrival."""
  import openai

  clients = [openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                timeout=600) for _ in range(concurrency)]
  try:
    await asyncio.gather(*(api.models.list() for api in clients))
    creates = [api.completions.with_raw_response.create for api in clients]  # (imports them)
    answers: list = [None] * len(plan)  # (the raw response, its latency)

    async def client(k: int) -> None:
      for j in range(k, len(plan), concurrency):
        started = time.perf_counter()
        raw = await creates[k](**request_body(model_name, plan[j], fields))
        answers[j] = raw, time.perf_counter() - started

    started = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(concurrency)))
    wall = time.perf_counter() - started
    # Parsed after the clock: the body has arrived whole; the openai client's models are the
    # clients' own work, on the server's cores here but not on a real server's.
    return [record_of(request, raw.parse().model_dump(), latency)
            for request, (raw, latency) in zip(plan, answers)], wall
  finally:
    await asyncio.gather(*(api.close() for api in clients))


def request_body(model_name: str, request: dict, fields: dict) -> dict:
  """`completions.create`'s arguments for one request of a plan."""
  return dict(model=model_name, prompt=request["prompt"], max_tokens=fields["max_tokens"],
              temperature=fields["temperature"], seed=request["seed"],
              extra_body={k: v for k, v in fields.items()
                          if k not in ("max_tokens", "temperature")})


def record_of(request: dict, body: dict, latency: float) -> dict:
  """A request's record from its response's body."""
  choice = body["choices"][0]
  return dict(prompt=request["prompt"], seed=request["seed"], latency_s=latency,
              token_ids=[int(t) for t in choice["mdjax"]["token_ids"]],
              completion_tokens=int(body["usage"]["completion_tokens"]),
              spec=body["mdjax"]["spec"], text=choice["text"])


def one_request(api, model_name: str, request: dict, fields: dict) -> dict:
  """One request from this process (a synchronous `openai.OpenAI`), outside any timing."""
  started = time.perf_counter()
  response = api.completions.create(**request_body(model_name, request, fields))
  return record_of(request, response.model_dump(), time.perf_counter() - started)


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


def main() -> None:
  """The client process: a run a line of JSON on stdin, its records and wall on stdout."""
  import openai  # noqa: F401  (imported before "ready": not in a run's time)

  print("ready", flush=True)
  for line in sys.stdin:
    run = json.loads(line)
    try:
      records, wall = asyncio.run(run_async(
          run["base_url"], run["api_key"], run["model_name"], run["plan"],
          run["concurrency"], run["fields"]))
      out = dict(records=records, wall=wall)
    except Exception as error:  # the parent raises it
      out = dict(error=repr(error))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
