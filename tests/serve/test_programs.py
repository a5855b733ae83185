"""Bounded compilation (issue 55): a lane per sampler setting, at most max_programs of them,
each with its own programs, so a dropped lane frees them; new lanes compiled off the engine's
thread; a frozen server (`--new_programs=refuse`) refuses a setting it has not compiled.
Driven on a real uvicorn server with httpx."""

import gc
import threading
import time

import httpx
import pytest

from mdjax.serve import __main__ as serve_main
from mdjax.serve.metrics import resident_bytes
from tests.serve.conftest import running_server
from tests.serve.test_attacks import assert_error, post

pytestmark = pytest.mark.xdist_group("serve_engine")


def _setting(server, index: int, **fields):
  """A request with its own temperature: a setting of its own, a lane of its own."""
  body = {"prompt": "Hi", "max_tokens": 4, "steps": 4, "seed": 0,
          "temperature": 0.5 + index / 100, **fields}
  response = post(server, body, timeout=300)
  assert response.status_code == 200, response.text
  return response


@pytest.mark.slow
def test_settings_past_max_programs_free_their_programs(dream_model):
  """Nine settings through a server that holds two lanes: the least recently used idle
  lane is dropped for each new one, and its compiled programs go with it. After the first
  three settings, six more leave the process's RSS within 40 MB. Measured here: with every
  lane's programs traced from one module-level jit (jax's caches keep what a live function
  compiled), the six grew it by 87 MB (14.5 MB a setting, kept for ever); with programs of
  the lane's own, by 2 and 3 MB in two runs (the allocator's slack). 40 MB is under half
  the first and over ten times the second."""
  with running_server(dream_model, max_batch=1, max_programs=2) as server:
    for index in range(3):
      _setting(server, index)
    gc.collect()
    settled = resident_bytes()
    for index in range(3, 9):
      _setting(server, index)
    gc.collect()
    grown_mb = (resident_bytes() - settled) / 2**20
    stats = server.engine.stats()
  assert stats.lanes == 2 and stats.lanes_built == 9 and stats.lanes_evicted == 7
  assert grown_mb < 40, f"six more settings grew the server by {grown_mb:.0f} MB"


@pytest.mark.slow
def test_a_new_lane_compiles_while_the_others_keep_ticking(dream_model):
  """A request on a new setting is compiled on the compile thread: a request already
  running on another lane keeps ticking meanwhile (the engine thread never waits for
  the compiler), and both end as they would alone."""
  with running_server(dream_model, max_batch=1, max_programs=4) as server:
    engine = server.engine
    _setting(server, 0, max_tokens=2, steps=2)  # lane 0 compiled
    long = {"prompt": "Hi", "max_tokens": 60, "steps": 240, "seed": 1, "temperature": 0.5}
    results = {}
    running = threading.Thread(target=lambda: results.setdefault("long", post(
        server, long, timeout=300)))
    running.start()
    while engine.stats().active_rows == 0:
      time.sleep(0.005)
    other = threading.Thread(target=lambda: results.setdefault("new", _setting(server, 7)))
    other.start()
    while engine.stats().lanes_building == 0 and engine.stats().active_rows == 1:
      time.sleep(0.001)
    ticks_at_start, ticked_while_building = engine.stats().ticks, False
    while engine.stats().lanes_building:
      ticked_while_building |= engine.stats().ticks > ticks_at_start
      time.sleep(0.01)
    running.join()
    other.join()
  assert results["long"].status_code == 200 and results["new"].status_code == 200
  assert ticked_while_building, "the running lane stopped ticking while a lane compiled"


@pytest.mark.slow
def test_a_frozen_server_refuses_a_setting_it_has_not_compiled(dream_model):
  """`Engine.freeze` (`--new_programs=refuse`): the warmed setting is served, another is
  a 400 naming `sampler` before anything compiles, and /metrics shows the bound."""
  with running_server(dream_model, max_batch=1, max_programs=3) as server:
    engine = server.engine
    engine.warm(engine.prepare("Hi", max_new_tokens=4, seed=0,
                               knobs=dict(steps=4, temperature=0.5)))
    engine.freeze()
    compiles = engine.stats().compiles
    assert post(server, {"prompt": "Hi", "max_tokens": 4, "steps": 4, "temperature": 0.5,
                         "seed": 3}).status_code == 200
    response = post(server, {"prompt": "Hi", "max_tokens": 4, "steps": 4, "temperature": 0.6})
    assert_error(response, 400, "sampler", "new_programs=refuse", "not among the 1 settings")
    assert engine.stats().compiles == compiles and engine.stats().lanes_built == 1
    metrics = httpx.get(f"{server.url}/metrics").text
  for line in ("mdjax_max_programs 3", "mdjax_lanes 1", "mdjax_lanes_built_total 1",
               "mdjax_lanes_evicted_total 0", "mdjax_lanes_building 0"):
    assert line in metrics.splitlines(), line
  assert "process_resident_memory_bytes " in metrics and "mdjax_lane_state_bytes " in metrics


@pytest.mark.slow
def test_lanes_bytes_stay_within_max_lane_bytes(dream_model):
  """--max_lane_bytes, through the openai client: the bound holds one uncached lane (its
  bytes from shapes, before it compiles, equal to its rows' once built), not two, nor a
  dual-cached lane (its keys and values in the slot). The cached setting is a 400 naming
  `sampler` before anything compiles; a second setting waits in the queue while the first
  lane is busy (no second lane, none building) and takes its place once it is idle."""
  import openai
  long = dict(max_tokens=60, extra_body={"steps": 240, "temperature": 0.5})
  short = dict(max_tokens=4, extra_body={"steps": 4, "temperature": 0.6})
  with running_server(dream_model, max_batch=1, start=False) as sizing:
    long_bytes, short_bytes = (sizing.engine.lane_bytes(sizing.engine.prepare(
        "Hi", max_new_tokens=fields["max_tokens"], seed=0, knobs=fields["extra_body"]))
        for fields in (long, short))
    cached = sizing.engine.lane_bytes(sizing.engine.prepare(
        "Hi", max_new_tokens=4, seed=0, sampler="confidence",
        knobs=dict(steps=4, block_length=2, kv_cache="dual")))
  bound = max(long_bytes, short_bytes) + min(long_bytes, short_bytes) // 2  # one, not two
  assert cached > bound  # a row's keys and values outweigh its canvas and plan
  with running_server(dream_model, max_batch=1, max_lane_bytes=bound) as server:
    engine = server.engine
    api = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
    with pytest.raises(openai.BadRequestError) as refused:
      api.completions.create(model="dream", prompt="Hi", max_tokens=4, extra_body=dict(
          sampler="confidence", steps=4, block_length=2, kv_cache="dual"))
    assert refused.value.body["param"] == "sampler"
    assert f"needs a lane of {cached} device bytes" in refused.value.body["message"]
    assert f"max_lane_bytes={bound}" in refused.value.body["message"]
    assert engine.stats().lanes_built == 0
    engine.prepare("Hi", max_new_tokens=4, seed=0, knobs=short["extra_body"])  # sized now
    results = {}
    first = threading.Thread(target=lambda: results.setdefault("long", api.completions.create(
        model="dream", prompt="Hi", seed=1, **long)))
    first.start()
    while engine.stats().active_rows == 0:
      time.sleep(0.005)
    second = threading.Thread(target=lambda: results.setdefault(
        "short", api.completions.create(model="dream", prompt="Hi", seed=2, **short)))
    second.start()
    waited = False
    while "short" not in results:
      stats = engine.stats()
      if stats.queue_rows == 1 and stats.active_rows == 1:
        waited = True
        assert stats.lanes == 1 and stats.lanes_building == 0, stats
      time.sleep(0.002)
    first.join()
    second.join()
    stats = engine.stats()
    metrics = httpx.get(f"{server.url}/metrics").text.splitlines()
  assert waited, "the second setting never waited behind the busy lane"
  assert [c.finish_reason for c in results["long"].choices + results["short"].choices] in (
      ["length", "length"], ["stop", "length"], ["length", "stop"], ["stop", "stop"])
  assert stats.lanes_built == 2 and stats.lanes_evicted == 1 and stats.lanes == 1
  assert stats.lane_state_bytes == short_bytes <= bound
  assert f"mdjax_max_lane_bytes {bound}" in metrics
  assert f"mdjax_lane_state_bytes {short_bytes}" in metrics


def test_warm_max_tokens_is_checked_as_a_flag(capsys):
  for value in ("0", "16,x", ""):
    with pytest.raises(Exception) as error:
      serve_main._warm_max_tokens(value)
    assert getattr(error.value, "param", None) == "warm_max_tokens"
  assert serve_main._warm_max_tokens("16,64") == [16, 64]
  args = serve_main._parser().parse_args(["--model=m", "--new_programs=refuse"])
  assert args.new_programs == "refuse" and args.warm_max_tokens == "16"
  with pytest.raises(SystemExit):
    serve_main._parser().parse_args(["--model=m", "--new_programs=sometimes"])
