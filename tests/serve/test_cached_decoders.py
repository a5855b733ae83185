"""The cached and block-by-block decoders served per step: the published families' reference
decoders (SDAR, Fast-dLLM v2, LLaDA2 block by block with the exact block cache; LLaDA with
Fast-dLLM's dual and prefix caches) on the fixtures' tiny checkpoints. Requests join while
others are mid-run, rows sit at different blocks and steps in one tick, and each row equals
`mdjax.generate` of its prompt alone, token for token.

The suite is compile-bound, so each case is the smallest that reaches its paths: two slots
(a lane's tick and commit/refresh programs for buckets 1 and 2), one lane a case, a canvas
of 16 positions, one or two blocks past the prompt, and the fewest distinct offline
programs (`offline` keeps each generate's answer, so the HTTP case reuses the engine case's)."""

import concurrent.futures
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest

import mdjax
from mdjax.models import moe
from mdjax.serve.block_lanes import BlockLane
from mdjax.serve.engine import Engine
from tests.paths import REPO
from tests.serve.conftest import running_server

pytestmark = pytest.mark.xdist_group("serve_engine")

FIXTURES = os.path.join(REPO, "tests", "fixtures")
CANVAS = 16  # the block lanes' room: the longest prompt and its new tokens fill it

# Two requests on one lane (one spec: temperature 1 is a knob of both): prompts of two
# lengths, whole model blocks and a tail (10 = 8 + 2 in SDAR's blocks of 4 and Fast-dLLM
# v2's of 8) and a tail alone (3); the second asks for two rows. With two slots its first
# row joins the first request mid-run and its second joins when the first request leaves.
HOT = {"temperature": 1.0}
BLOCK_REQUESTS = (
    ((5, 6, 7, 8, 9, 10, 11, 12, 13, 14), dict(max_new_tokens=6, seed=1, knobs=HOT)),
    ((3, 4, 5), dict(max_new_tokens=8, seed=2, n=2, knobs=HOT)),
)


def _experts_vmap() -> bool:
  """Whether the MoE MLP runs under jax.vmap (a lane vmaps the network over its rows)."""
  config = moe.MoEConfig(num_experts=2, experts_per_token=1, n_group=1, topk_group=1,
                         expert_hidden=4)
  layer = {name: jnp.ones((2, 4, 4)) for name in ("experts_gate", "experts_up",
                                                  "experts_down")}
  try:
    jax.eval_shape(jax.vmap(lambda x: moe.routed(config, layer, x, jnp.zeros((3, 1), jnp.int32),
                                                 jnp.ones((3, 1)))), jnp.ones((2, 3, 4)))
  except NotImplementedError:
    return False
  return True


@functools.cache
def load(path: str):
  return mdjax.load(os.path.join(FIXTURES, path))


@functools.cache
def offline(path: str, prompt: tuple, n: int, max_new_tokens: int, seed: int,
            knobs: tuple) -> tuple:
  """mdjax.generate of `prompt` alone, n rows: ((token ids, finish_reason) per row)."""
  out = mdjax.generate(load(path), [list(prompt)] * n, max_new_tokens=max_new_tokens,
                       key=jax.random.key(seed), **dict(knobs))
  return tuple((c.token_ids.tolist(), c.finish_reason) for c in out)


def offline_of(path: str, prompt, fields: dict) -> tuple:
  return offline(path, tuple(prompt), fields.get("n", 1), fields["max_new_tokens"],
                 fields["seed"], tuple(sorted(fields.get("knobs", {}).items())))


def serve(engine, requests, join_after):
  """Submits (prompt ids, fields) in turn, ticking `join_after` rounds after each but the
  last (so later ones join mid-run); returns each request's (job, {choice: update})."""
  out, handles = [], []
  for index, (prompt, fields) in enumerate(requests):
    job = engine.prepare(list(prompt), **fields)
    got = {}
    handles.append(engine.submit(job, lambda u, got=got: got.__setitem__(u.choice, u)
                                 if u.completion is not None or u.error else None))
    out.append((job, got))
    if index < len(requests) - 1:
      for _ in range(join_after):
        engine.run_once()
  for _ in range(400):
    if all(h.done for h in handles):
      return out
    engine.run_once()
  raise AssertionError("the engine did not finish its rows")


def assert_offline(path, requests, served):
  for (prompt, fields), (job, got) in zip(requests, served):
    want = offline_of(path, prompt, fields)
    for choice in range(job.n):
      update = got[choice]
      assert update.error is None, update.error
      assert update.completion.token_ids.tolist() == want[choice][0]
      assert update.completion.finish_reason == want[choice][1]


@pytest.mark.slow
@pytest.mark.parametrize("family", [
    "sdar", "fast_dllm_v2",
    pytest.param("llada2", marks=pytest.mark.skipif(
        not _experts_vmap(), reason="the MoE MLP's ragged_dot does not run under jax.vmap "
        "here (a lane vmaps the network over its rows)")),
])
def test_block_decoders_served_equal_generate(family):
  """Each family's reference decoder (its default sampler: blocks with the exact cache) at
  temperature 1: prompts of two lengths (a prompt's partial model block held at the first
  block's start; one with no whole block) in one lane, two rows of one request, a row
  joining while another is a block ahead."""
  model = load(family)
  engine = Engine(model, max_batch=2, max_queue=16, canvas_length=CANVAS)
  requests = BLOCK_REQUESTS
  if family == "llada2":  # its steps a block default to min(32, max_new_tokens), as its
    # reference does: fixed, so that the two requests have one spec, hence one lane
    requests = tuple((p, {**f, "knobs": {**f["knobs"], "steps": 4}}) for p, f in requests)
  steps_a_block = engine.prepare([1], max_new_tokens=1, seed=0, knobs=requests[0][1][
      "knobs"]).blocks.stepper.num_steps()
  served = serve(engine, requests, join_after=steps_a_block + 1)
  assert_offline(family, requests, served)
  lanes = engine.lanes
  assert len(lanes) == 1 and isinstance(lanes[0], BlockLane)
  assert lanes[0].commits > 0  # blocks committed between steps
  jobs = [job for job, _ in served]
  assert jobs[0].lane_key == jobs[1].lane_key  # prompts of any length share a lane
  assert jobs[0].cache.startswith("block by block") and "exact cache" in jobs[0].cache


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache", ["dual", "prefix"])
def test_llada_kv_caches_served_equal_generate(kv_cache):
  """LLaDA with Fast-dLLM's caches and a confidence threshold, at temperature 1: a row's full
  passes (its cache's refreshes) run in a program over the refreshing rows alone while the
  others make window passes; each row equals generate."""
  model = load(os.path.join("pretrained", "llada"))
  engine = Engine(model, max_batch=4, max_queue=16)
  knobs = dict(steps=8, block_length=4, kv_cache=kv_cache, threshold=0.5, temperature=1.0)
  # One canvas length (LLaDA's absolute positions: a lane per prompt + max_tokens) and one
  # offline program (n=2 both); 4 steps a block. The second request joins at the first's
  # fourth step: its rows refresh while the first's make window passes, and next tick the
  # first's rows refresh (their second block) while the second's make window passes.
  requests = [
      ((5, 6, 7, 8, 9, 10, 11), dict(max_new_tokens=8, seed=1, n=2, knobs=knobs)),
      ((3, 4, 5, 6, 7, 8, 9), dict(max_new_tokens=8, seed=2, n=2, knobs=knobs)),
  ]
  served = serve(engine, requests, join_after=3)
  assert_offline(os.path.join("pretrained", "llada"), requests, served)
  [lane] = engine.lanes
  # 2 blocks a row, a refresh at each block's first step at most.
  assert 0 < lane.full_passes <= 2 * 4
  assert served[0][0].cache == "kv_cache='dual'"  # the prefix cache is the dual one's


@pytest.mark.slow
def test_rows_that_all_refresh_run_no_tick():
  """Rows in step (one request of two rows): at each block's first step every row makes its
  full pass in the refresh program (the full pass alone: KVPlan.full_only) and no tick
  program runs beside it; the rows still equal generate."""
  engine = Engine(load(os.path.join("pretrained", "llada")), max_batch=2, max_queue=4)
  knobs = dict(steps=8, block_length=4, kv_cache="dual", temperature=1.0)
  requests = [((5, 6, 7, 8, 9, 10, 11), dict(max_new_tokens=8, seed=3, n=2, knobs=knobs))]
  served = serve(engine, requests, join_after=0)
  assert_offline(os.path.join("pretrained", "llada"), requests, served)
  [lane] = engine.lanes
  refresh_ticks = lane.full_passes // 2  # two rows refresh at each
  assert refresh_ticks >= 1
  # Each engine tick ran the refresh program alone or the tick program alone.
  assert sum(lane.ticks_by_bucket.values()) == engine.stats().ticks - refresh_ticks


@pytest.mark.slow
def test_a_block_the_threshold_fills_ticks_none_of_its_idle_steps():
  """A threshold every position passes fills each block at its first step: the row jumps
  over the block's other steps as generate's loop does (`Stepper.jump`), so a request of
  two blocks of 4 steps takes 2 ticks (each block's refresh), not 8; it still equals
  generate, and its last update names the step it ended at (its second block's first)."""
  engine = Engine(load(os.path.join("pretrained", "llada")), max_batch=2, max_queue=4)
  knobs = dict(steps=8, block_length=4, kv_cache="dual", threshold=1e-9, temperature=1.0)
  requests = [((5, 6, 7, 8, 9, 10, 11), dict(max_new_tokens=8, seed=4, knobs=knobs))]
  served = serve(engine, requests, join_after=0)
  assert_offline(os.path.join("pretrained", "llada"), requests, served)
  [lane] = engine.lanes
  assert engine.stats().ticks == 2 and lane.full_passes == 2
  [(job, got)] = served
  assert job.num_steps == 8 and got[0].step == 5


@pytest.mark.slow
def test_sdar_served_over_http_equals_generate():
  """A real server: concurrent requests on SDAR's reference decoder through the openai
  client (the engine case's requests and lane: its programs and offline answers are
  reused), each equal to generate; the response names its spec and its cache."""
  model = load("sdar")
  with running_server(model, model_name="sdar", canvas_length=CANVAS, max_batch=2) as server:
    api = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)

    def send(request):
      prompt, fields = request
      return api.completions.create(model="sdar", prompt=[list(prompt)],
                                    max_tokens=fields["max_new_tokens"], seed=fields["seed"],
                                    n=fields.get("n", 1), extra_body=fields["knobs"])

    with concurrent.futures.ThreadPoolExecutor(len(BLOCK_REQUESTS)) as pool:
      outs = list(pool.map(send, BLOCK_REQUESTS))
  for (prompt, fields), out in zip(BLOCK_REQUESTS, outs):
    want = offline_of("sdar", prompt, fields)
    assert [c.model_extra["mdjax"]["token_ids"] for c in out.choices] == [
        ids for ids, _ in want]
    extension = out.model_extra["mdjax"]
    assert "ConfidenceSpec" in extension["spec"] and "exact cache" in extension["cache"]


@pytest.mark.slow
def test_prefix_cache_hits_equal_generate():
  """SDAR with a prefix cache: a prompt whose whole blocks a served prompt had (its tail
  differs) starts from that prompt's keys and values, and its row is still generate's token
  for token (as the rows that missed are: a hit equals a miss); a prompt sharing only its
  first block misses."""
  model = load("sdar")
  engine = Engine(model, max_batch=2, max_queue=16, canvas_length=CANVAS,
                  prefix_cache_bytes=1 << 24)
  first = BLOCK_REQUESTS[0]  # its whole blocks: 5..12 (two of 4), its tail 13, 14
  prompt = first[0]
  requests = [
      first,
      (prompt[:8] + (20, 21), dict(first[1], seed=3)),  # the same whole blocks: a hit
      (prompt[:4] + (30, 31, 32, 33) + prompt[8:], dict(first[1], seed=5)),  # a miss
  ]
  served = serve(engine, requests, join_after=3)
  assert_offline("sdar", requests, served)
  stats, cache = engine.stats(), engine.prefix_cache
  assert (stats.prefix_hits, stats.prefix_misses) == (1, 2)
  assert cache.matched_blocks == 1  # the miss that shared the first block
  assert stats.prefix_bytes > 0 and cache.entries == 2
