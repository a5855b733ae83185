"""Attacks on the cached and block-by-block decoders served per step (issue 59), driven on
the engine: a frozen server (`new_programs=refuse`) compiles nothing for a KV-cached lane
whatever rows refresh together, a threshold that never fires still ends each row within its
steps, and a row cancelled mid-block frees its slot for a request that then equals
`mdjax.generate`. Each case is the smallest that reaches its path (the fixtures' tiny
LLaDA and SDAR, 2-3 slots); each compiles a lane, so each is slow."""

import os

import numpy as np
import pytest

from mdjax.errors import ArgumentError
from mdjax.serve import lanes
from mdjax.serve.engine import Engine
from tests.serve.test_cached_decoders import BLOCK_REQUESTS, CANVAS, load, offline_of

pytestmark = pytest.mark.xdist_group("serve_engine")

LLADA = os.path.join("pretrained", "llada")


def run_until_done(engine, handles, most_ticks):
  """Rounds until every handle is done; fails past `most_ticks` rounds."""
  for _ in range(most_ticks):
    if all(h.done for h in handles):
      return
    engine.run_once()
  assert all(h.done for h in handles), f"rows still running after {most_ticks} rounds"


@pytest.mark.slow
def test_a_frozen_kv_lane_compiles_nothing_however_many_rows_refresh():
  """Three slots: three rows refreshing at one tick run the refresh program of 4 rows (a
  power of two), which `warm` left uncompiled, so a frozen server compiled it on the
  engine's thread mid-request. A threshold of 1 never fires (no probability reaches 1 at
  temperature 1): each row still ends within its steps, every position written."""
  engine = Engine(load(LLADA), max_batch=3, max_queue=8)
  knobs = dict(steps=4, block_length=2, kv_cache="dual", threshold=1.0, temperature=1.0)
  job = engine.prepare([5, 6, 7], max_new_tokens=4, seed=0, n=3, knobs=knobs)
  engine.warm(job)
  engine.freeze()
  traces = lanes.traces()
  for other, param in ((dict(knobs, threshold=0.9), "sampler"),  # a setting never warmed
                       (dict(knobs, steps=3), "steps"),  # not a multiple of its 2 blocks
                       (dict(knobs, refresh_every=10**30), "refresh_every")):
    with pytest.raises(ArgumentError) as error:
      engine.prepare([5, 6, 7], max_new_tokens=4, seed=0, knobs=other)
    assert error.value.param == param, str(error.value)
  got = {}
  handle = engine.submit(job, lambda u: got.__setitem__(u.choice, u)
                         if u.completion is not None or u.error else None)
  run_until_done(engine, [handle], job.num_steps + 1)
  assert lanes.traces() == traces  # nothing compiled while frozen
  [lane] = engine.lanes
  assert lane.full_passes >= 3  # the three rows refreshed together (one program of 4)
  for choice in range(3):
    assert got[choice].error is None, got[choice].error
    assert not np.any(got[choice].canvas_ids == job.mask_id)
  assert engine.stats().ticks <= job.num_steps


@pytest.mark.slow
def test_a_row_cancelled_mid_block_frees_its_slot_and_the_next_equals_generate():
  """SDAR block lane, two slots: a two-row request cancelled in the middle of its second
  block leaves both slots (its rows' blocks and caches discarded); the next request takes
  them and gets generate's tokens, within its steps."""
  engine = Engine(load("sdar"), max_batch=2, max_queue=8, canvas_length=CANVAS)
  (prompt_a, fields_a), (prompt_b, fields_b) = BLOCK_REQUESTS[1], BLOCK_REQUESTS[0]
  first = engine.prepare(list(prompt_a), **fields_a)
  cancelled = engine.submit(first, lambda u: None)
  steps_a_block = first.blocks.stepper.num_steps()
  assert steps_a_block > 2
  engine.run_once()  # admitted; the first block (the prompt's tail and one mask) written
  [lane] = engine.lanes
  for _ in range(steps_a_block):
    if lane.commits == 2:
      break
    engine.run_once()
  engine.run_once()  # one step into the second block
  assert lane.active == 2 and lane.commits == 2
  index = np.asarray(lane.rows.carry.index)[:2]
  assert np.all((index >= 1) & (index < steps_a_block)), index  # both rows mid-block
  cancelled.cancel()
  second = engine.prepare(list(prompt_b), **fields_b)
  got = {}
  handle = engine.submit(second, lambda u: got.__setitem__(u.choice, u)
                         if u.completion is not None or u.error else None)
  ticks = engine.stats().ticks
  run_until_done(engine, [cancelled, handle], second.num_steps + 2)
  assert engine.stats().ticks - ticks <= second.num_steps
  assert got[0].error is None, got[0].error
  want = offline_of("sdar", prompt_b, fields_b)
  assert got[0].completion.token_ids.tolist() == want[0][0]
  assert got[0].completion.finish_reason == want[0][1]
  assert lane.active == 0 and engine.stats().queue_rows == 0
