"""DiffusionGemma served: its default sampler (gemma's DiffusionSampler, the
`diffusion_gemma_canvases` family: canvases in turn against the cache, each appended by the
encoder pass) a denoising step a tick on a canvases lane (`mdjax.serve.canvas_lanes`), on the
tiny checkpoint of tests/fixtures/diffusion_gemma. Requests join while others are mid-run, a
request's rows share a slot (one ends at a stop id a canvas before the other), and each row
equals `mdjax.generate` of its prompt alone, token for token.

Compile-bound: one setting (the fixture's 4-step case, 3 canvases of 8), two lanes (requests
of one row and of two), `offline` kept across the two cases."""

import concurrent.futures
import functools

import jax
import openai
import pytest

import mdjax
from mdjax.errors import ArgumentError
from mdjax.serve.canvas_lanes import CanvasesLane
from mdjax.serve.engine import Engine
from tests.formats.test_diffusion_gemma import model
from tests.formats.test_diffusion_gemma_canvases import prompts
from tests.serve.conftest import running_server
from tests.serve.test_cached_decoders import serve

pytestmark = pytest.mark.xdist_group("serve_engine")

CANVAS = 40  # the engine's room: a prompt of 9 and 24 new tokens
KNOBS = dict(steps=4, entropy_bound=2.0, early_stop=False, reference_length=8)


def _requests():
  p0, p1 = (tuple(p.tolist()) for p in prompts()[:2])
  # With two slots of one row, the third request joins the first's lane mid-run; the
  # second's two rows share a slot of their own (at seed 2 its first row ends a canvas early).
  return ((p0, dict(max_new_tokens=24, seed=1, knobs=KNOBS)),
          (p1, dict(max_new_tokens=24, seed=2, n=2, knobs=KNOBS)),
          (p0, dict(max_new_tokens=24, seed=3, knobs=KNOBS)))


@functools.cache
def offline(prompt: tuple, n: int, seed: int) -> tuple:
  """mdjax.generate of `prompt` alone, n rows: ((token ids, finish_reason) per row)."""
  out = mdjax.generate(model(), [list(prompt)] * n, max_new_tokens=24, key=jax.random.key(seed),
                       **KNOBS)
  return tuple((c.token_ids.tolist(), c.finish_reason) for c in out)


def _want(prompt, fields):
  return offline(prompt, fields.get("n", 1), fields["seed"])


@pytest.mark.slow
def test_canvases_served_equal_generate():
  """The engine driven tick by tick: the third request joins the first's lane 3 ticks in,
  the second's rows end at different canvases in one slot; every row is generate's."""
  engine = Engine(model(), max_batch=2, max_queue=16, canvas_length=CANVAS)
  requests = _requests()
  served = serve(engine, requests, join_after=3)
  ends = []
  for (prompt, fields), (job, got) in zip(requests, served):
    want = _want(prompt, fields)
    for choice in range(job.n):
      update = got[choice]
      assert update.error is None, update.error
      assert update.completion.token_ids.tolist() == want[choice][0]
      assert update.completion.finish_reason == want[choice][1]
      ends.append(update.step)
    assert job.cache.startswith("canvas by canvas: 3 of 8")
  assert len(set(ends[1:3])) == 2  # the second request's rows left at different steps
  lanes = engine.lanes
  assert sorted(lane.group for lane in lanes) == [1, 2]
  assert all(isinstance(lane, CanvasesLane) and not lane.active for lane in lanes)
  assert served[0][0].lane_key == served[2][0].lane_key != served[1][0].lane_key


@pytest.mark.slow
def test_canvases_served_over_http_equal_generate():
  """A real server and the openai client: the first request streams its canvas each step;
  once it is under way the other two are sent at once; every completion is generate's."""
  requests = _requests()
  with running_server(model(), model_name="gemma", canvas_length=CANVAS, max_batch=2) as server:
    api = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)

    def send(request, **extra):
      prompt, fields = request
      return api.completions.create(model="gemma", prompt=[list(prompt)], max_tokens=24,
                                    seed=fields["seed"], n=fields.get("n", 1),
                                    extra_body={**fields["knobs"], **extra.pop("body", {})},
                                    **extra)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      first, later = [], None
      for chunk in send(requests[0], stream=True, body={"mdjax_canvas": True}):
        if later is None:  # a canvas event: the first request has run a step
          later = [pool.submit(send, r) for r in requests[1:]]
        first += [c for c in chunk.choices or () if c.finish_reason]
      outs = [f.result() for f in later]
  ids = lambda choice: choice.model_extra["mdjax"]["token_ids"]
  assert [(ids(c), c.finish_reason) for c in first] == list(_want(*requests[0]))
  for request, out in zip(requests[1:], outs):
    assert [(ids(c), c.finish_reason) for c in out.choices] == list(_want(*request))
    extension = out.model_extra["mdjax"]
    assert "DiffusionGemmaCanvasesSpec" in extension["spec"]
    assert extension["cache"].startswith("canvas by canvas")


def test_the_canvases_family_is_not_named_by_a_request():
  """It is the model's default: a request that names it is told to leave sampler out."""
  engine = Engine(model(), max_batch=1, canvas_length=CANVAS)
  with pytest.raises(ArgumentError, match="leave sampler out"):
    engine.prepare([5, 6], max_new_tokens=8, seed=0, sampler="diffusion_gemma_canvases")


@pytest.mark.slow
def test_the_one_canvas_rule_is_served_on_the_checkpoint():
  """`sampler="diffusion_gemma"` (DiffusionGemma's rule on one canvas, a step-wise family) on
  the checkpoint: its lane vmaps the network over rows, through the MoE's `ragged_dot` (was:
  no batching rule, the request failed); a request's rows equal generate's."""
  engine = Engine(model(), max_batch=2, canvas_length=16)
  job = engine.prepare([5, 6, 7, 8], max_new_tokens=8, seed=1, n=2, sampler="diffusion_gemma",
                       knobs=dict(steps=4))
  [(_, got)] = serve(engine, [([5, 6, 7, 8], dict(max_new_tokens=8, seed=1, n=2,
                                                    sampler="diffusion_gemma",
                                                    knobs=dict(steps=4)))], join_after=0)
  want = mdjax.generate(model(), [[5, 6, 7, 8]] * 2, max_new_tokens=8, key=1, spec=job.spec)
  assert [got[c].completion.token_ids.tolist() for c in range(2)] == [
      w.token_ids.tolist() for w in want]
