"""The cached and block-by-block decoders served per step: the published families' reference
decoders (SDAR, Fast-dLLM v2, LLaDA2 block by block with the exact block cache; LLaDA with
Fast-dLLM's dual and prefix caches) on the fixtures' tiny checkpoints. Requests join while
others are mid-run, rows sit at different blocks and steps in one tick, and each row equals
`mdjax.generate` of its prompt alone, token for token."""

import concurrent.futures
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


def serve(engine, requests, join_after=2):
  """Submits (prompt ids, fields) in turn, ticking `join_after` rounds after each of the
  first two (later ones join mid-run); returns each request's (job, {choice: update})."""
  out, handles = [], []
  for index, (prompt, fields) in enumerate(requests):
    job = engine.prepare(prompt, **fields)
    got = {}
    handles.append(engine.submit(job, lambda u, got=got: got.__setitem__(u.choice, u)
                                 if u.completion is not None or u.error else None))
    out.append((job, got))
    if index < 2:
      for _ in range(join_after):
        engine.run_once()
  for _ in range(400):
    if all(h.done for h in handles):
      return out
    engine.run_once()
  raise AssertionError("the engine did not finish its rows")


def assert_offline(model, requests, served):
  for (prompt, fields), (job, got) in zip(requests, served):
    want = mdjax.generate(model, [prompt] * job.n, max_new_tokens=job.max_new_tokens,
                          key=jax.random.key(job.seed), **fields.get("knobs", {}))
    for choice in range(job.n):
      update = got[choice]
      assert update.error is None, update.error
      np.testing.assert_array_equal(update.completion.token_ids, want[choice].token_ids)
      assert update.completion.finish_reason == want[choice].finish_reason


@pytest.mark.slow
@pytest.mark.parametrize("family", [
    "sdar", "fast_dllm_v2",
    pytest.param("llada2", marks=pytest.mark.skipif(
        not _experts_vmap(), reason="the MoE MLP's ragged_dot does not run under jax.vmap "
        "here (a lane vmaps the network over its rows)")),
])
def test_block_decoders_served_equal_generate(family):
  """Each family's reference decoder (its default sampler: blocks with the exact cache),
  prompts of several lengths (a prompt's partial model block held at the first block's
  start) in one lane, two rows of one request, one request sampled at temperature 1."""
  model = mdjax.load(os.path.join(FIXTURES, family))
  engine = Engine(model, max_batch=2, max_queue=16, canvas_length=32)
  hot = {"temperature": 1.0}
  requests = [
      ([5, 6, 7, 8, 9, 10, 11], dict(max_new_tokens=12, seed=1)),
      ([3, 4, 5], dict(max_new_tokens=9, seed=2, n=2, knobs=hot)),
      ([7] * 10, dict(max_new_tokens=16, seed=3, knobs=hot)),
  ]
  served = serve(engine, requests)
  assert_offline(model, requests, served)
  lanes = engine.lanes
  assert all(isinstance(lane, BlockLane) for lane in lanes)
  assert sum(lane.commits for lane in lanes) > 0  # blocks committed between steps
  jobs = [job for job, _ in served]
  assert jobs[1].lane_key == jobs[2].lane_key  # prompts of any length share a lane
  assert jobs[0].cache.startswith("block by block") and "exact cache" in jobs[0].cache


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache", ["dual", "prefix"])
def test_llada_kv_caches_served_equal_generate(kv_cache):
  """LLaDA with Fast-dLLM's caches and a confidence threshold: a row's full passes (its
  cache's refreshes) run in a program over the refreshing rows alone, every other step of
  every row is a window pass; each row equals generate."""
  model = mdjax.load(os.path.join(FIXTURES, "pretrained", "llada"))
  engine = Engine(model, max_batch=2, max_queue=16)
  knobs = dict(steps=8, block_length=4, kv_cache=kv_cache, threshold=0.5)
  requests = [
      ([5, 6, 7, 8, 9, 10, 11], dict(max_new_tokens=16, seed=1, knobs=knobs)),
      ([3, 4, 5, 6, 7, 8, 9], dict(max_new_tokens=16, seed=2, n=2,
                                   knobs=dict(knobs, temperature=1.0))),
  ]
  served = serve(engine, requests, join_after=3)
  assert_offline(model, requests, served)
  rows_by_lane = {}
  for job, _ in served:
    rows_by_lane[job.lane_key] = rows_by_lane.get(job.lane_key, 0) + job.n
  for lane in engine.lanes:  # 4 blocks a row, a refresh at each block's first step at most
    assert 0 < lane.full_passes <= 4 * rows_by_lane[lane.key]
  assert served[0][0].cache == f"kv_cache='dual'"  # the prefix cache is the dual one's


@pytest.mark.slow
def test_sdar_served_over_http_equals_generate():
  """A real server: concurrent requests on SDAR's reference decoder through the openai
  client, each equal to generate; the response names its spec and its cache."""
  model = mdjax.load(os.path.join(FIXTURES, "sdar"))
  cases = [([5, 6, 7, 8, 9, 10, 11], 12, 1, 1), ([3, 4, 5], 8, 2, 2), ([9] * 6, 12, 3, 1)]
  with running_server(model, model_name="sdar", canvas_length=32, max_batch=4) as server:
    api = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)

    def send(case):
      prompt, new, seed, n = case
      return api.completions.create(model="sdar", prompt=[prompt], max_tokens=new, seed=seed,
                                    n=n, extra_body={"temperature": 1.0})

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
      outs = list(pool.map(send, cases))
  for (prompt, new, seed, n), out in zip(cases, outs):
    want = mdjax.generate(model, [prompt] * n, max_new_tokens=new, key=jax.random.key(seed),
                          temperature=1.0)
    assert [c.model_extra["mdjax"]["token_ids"] for c in out.choices] == [
        w.token_ids.tolist() for w in want]
    extension = out.model_extra["mdjax"]
    assert "ConfidenceSpec" in extension["spec"] and "exact cache" in extension["cache"]
