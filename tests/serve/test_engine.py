"""The serving engine: rows at different steps in one program equal `mdjax.generate` offline,
token for token; rows leave when done and their slots serve the next request; nothing
recompiles while serving; bad requests are refused before anything compiles."""

import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from mdjax import generation
from mdjax.errors import ArgumentError
from mdjax.model import Model
from mdjax.serve.engine import Engine, QueueFull
from tests.devices import run_on_cpu_devices
from tests.paths import REPO

pytestmark = pytest.mark.xdist_group("serve_engine")

LLADA = os.path.join(REPO, "tests", "fixtures", "pretrained", "llada")
DREAM = os.path.join(REPO, "tests", "fixtures", "pretrained", "dream")


class Listener:
  """What a job's rows report: every update, and each row's completion."""

  def __init__(self):
    self.updates, self.completions = [], {}

  def __call__(self, update):
    self.updates.append(update)
    if update.completion is not None or update.error:
      self.completions[update.choice] = update


def drive(engine, handles, most_ticks=200):
  for _ in range(most_ticks):
    if all(h.done for h in handles):
      return
    engine.run_once()
  raise AssertionError("the engine did not finish its rows")


def offline(model, prompt, job):
  return mdjax.generate(model, [prompt] * job.n, max_new_tokens=job.max_new_tokens,
                        key=jax.random.key(job.seed), spec=job.spec)


@pytest.mark.slow
def test_rows_at_different_steps_equal_generate_offline(dream_model):
  """Mixed requests (prompt lengths, max_new_tokens, n, two specs) joining while others are
  mid-run: each row equals `generate` of its prompt alone, token for token."""
  model = dream_model
  engine = Engine(model, max_batch=3, max_queue=16, canvas_length=40)
  # (prompt, fields); sampling at temperature 1 so the keys decide the tokens. Prompt and
  # max_new_tokens add up to 17 in every request, so the offline calls of one spec and n
  # share a program; on the lane each row is padded to 40 as it comes.
  requests = [
      ("Hello", dict(max_new_tokens=12, seed=1, knobs=dict(steps=4, temperature=1.0))),
      ("Hi there, you", dict(max_new_tokens=4, seed=2, n=2,
                             knobs=dict(steps=4, temperature=1.0))),
      ("A", dict(max_new_tokens=16, seed=3, sampler="confidence",
                 knobs=dict(steps=4, block_length=4, threshold=0.5, temperature=1.0))),
      ("Once upon a", dict(max_new_tokens=6, seed=4, knobs=dict(steps=4, temperature=1.0))),
  ]
  jobs, listeners, handles = [], [], []
  for index, (prompt, fields) in enumerate(requests):
    job = engine.prepare(generation.prompt_ids(model, [prompt])[0], **fields)
    listener = Listener()
    # The last one waits for its completion only (a whole response): one update, no steps.
    handles.append(engine.submit(job, listener, every_step=index < len(requests) - 1))
    jobs.append(job), listeners.append(listener)
    if index == 1:
      engine.run_once()  # the first rows are a step ahead of the next ones
  drive(engine, handles)
  assert engine.stats().lanes == 2  # one program per spec, rows of any length in it
  for (prompt, _), job, listener in zip(requests, jobs, listeners):
    want = offline(model, prompt, job)
    for choice in range(job.n):
      got = listener.completions[choice].completion
      np.testing.assert_array_equal(got.token_ids, want[choice].token_ids)
      assert (got.text, got.finish_reason) == (want[choice].text, want[choice].finish_reason)
  assert len(listeners[-1].updates) == 1 and len(listeners[0].updates) > 1
  # The keys decide these tokens: the two rows of one request differ.
  assert (listeners[1].completions[0].completion.token_ids.tolist()
          != listeners[1].completions[1].completion.token_ids.tolist())


@pytest.mark.slow
def test_a_model_with_absolute_positions_is_served_unpadded():
  """LLaDA counts positions from the canvas start: its rows run on canvases of exactly
  prompt + max_new_tokens (a lane per length), and equal generate offline."""
  model = mdjax.load(LLADA)
  assert not model.padding_invariant
  engine = Engine(model, max_batch=2)
  knobs = dict(steps=4, block_length=4, temperature=1.0)
  prompts = ["Hello", "Hi there, you"]
  jobs = [engine.prepare(generation.prompt_ids(model, [p])[0], max_new_tokens=8, seed=5,
                         knobs=knobs) for p in prompts]
  assert [job.canvas_length for job in jobs] == [len(j.prompt_ids) + 8 for j in jobs]
  assert jobs[0].lane_key != jobs[1].lane_key  # a lane per canvas length
  listener = Listener()  # one runs (each lane compiles its own programs)
  drive(engine, [engine.submit(jobs[1], listener)])
  np.testing.assert_array_equal(listener.completions[0].completion.token_ids,
                                offline(model, prompts[1], jobs[1])[0].token_ids)


@pytest.mark.slow
def test_slots_are_reused_and_nothing_recompiles(dream_model):
  """Five single-row requests through two slots: finished rows leave, waiting rows take
  their slots at the next tick; a second wave compiles nothing."""
  engine = Engine(dream_model, max_batch=2, max_queue=16, canvas_length=24)
  knobs = dict(steps=3, temperature=1.0)

  def wave(first_seed):
    jobs = [engine.prepare(generation.prompt_ids(dream_model, ["x" * (i + 1)])[0],
                           max_new_tokens=6, seed=first_seed + i, knobs=knobs)
            for i in range(5)]
    handles = [engine.submit(job, Listener()) for job in jobs]
    ticks = engine.stats().ticks
    drive(engine, handles)
    return engine.stats().ticks - ticks

  ticks = wave(0)
  # At most 3 steps a row (fewer after an early EOS), 2 slots, 5 rows: a freed slot is
  # taken at the next tick, so at most ceil(5 / 2) * 3 = 9 ticks (one row at a time: 15).
  assert ticks <= 9
  compiled = engine.stats().compiles
  wave(100)
  stats = engine.stats()
  assert stats.compiles == compiled and stats.rows_done == 10 and stats.active_rows == 0


def _always_eos_model(vocab=8, length=12, eos=0):
  """A stub denoiser whose every position is EOS with certainty."""
  def apply_fn(params, tokens_BxL, t_B):
    logits = jnp.full(tokens_BxL.shape + (vocab,), -10.0)
    return logits.at[..., eos].set(10.0)
  return Model(denoiser=apply_fn, params=None, family="stub", vocab_size=vocab, max_len=length,
               mask_id_or_none=vocab, eos_id=eos, takes_padding=False)


@pytest.mark.slow
def test_a_row_that_wrote_eos_leaves_at_once():
  """Left to right (one position a step), the first step writes EOS: the row leaves after
  that tick with finish_reason "stop", as generate ends it, not after its 8 steps."""
  model = _always_eos_model()
  engine = Engine(model, max_batch=2)
  job = engine.prepare(np.array([3, 4], np.int32), max_new_tokens=8, seed=0,
                       sampler="confidence", knobs=dict(steps=8, block_length=1))
  assert job.num_steps == 8 and job.spec.eos_id == 0
  listener = Listener()
  drive(engine, [engine.submit(job, listener)])
  finished = listener.completions[0]
  assert finished.step == 1 and len(listener.updates) == 1
  want = offline(model, [3, 4], job)[0]
  assert finished.completion.finish_reason == want.finish_reason == "stop"
  assert finished.completion.token_ids.size == want.token_ids.size == 0


@pytest.mark.slow
def test_cancel_frees_the_row_and_a_full_queue_is_refused(dream_model):
  engine = Engine(dream_model, max_batch=1, max_queue=1, canvas_length=24)
  prepare = lambda seed: engine.prepare(generation.prompt_ids(dream_model, ["Hi"])[0],
                                        max_new_tokens=6, seed=seed, knobs=dict(steps=6))
  first = engine.submit(prepare(0), Listener())
  engine.submit(prepare(1), Listener())  # one slot (no lane yet) + max_queue=1
  with pytest.raises(QueueFull) as refused:
    engine.submit(prepare(2), Listener())
  assert refused.value.retry_after >= 1
  engine.run_once()
  assert engine.stats().active_rows == 1 and engine.stats().queue_rows == 1
  first.cancel()
  engine.run_once()  # the cancelled row leaves; the waiting one takes its slot
  assert first.done and engine.stats().queue_rows == 0 and engine.stats().active_rows == 1


@pytest.mark.slow
def test_the_engine_thread_serves_and_drains_on_stop(dream_model):
  engine = Engine(dream_model, max_batch=2, canvas_length=24).start()
  job = engine.prepare(generation.prompt_ids(dream_model, ["Hi"])[0], max_new_tokens=4,
                       seed=0, knobs=dict(steps=2))
  listener = Listener()
  handle = engine.submit(job, listener)
  engine.stop(drain=True, timeout=120)
  assert handle.done and listener.completions[0].completion is not None
  with pytest.raises(QueueFull, match="shutting down"):
    engine.submit(job, Listener())


@pytest.mark.parametrize("fields, match, param", [
    (dict(n=0), r"n=0 is invalid", "n"),
    (dict(n=3), r"n=3 is invalid: it must be an integer in \[1, 2\]", "n"),
    (dict(seed=-1), r"seed=-1 is invalid", "seed"),
    (dict(max_new_tokens=0), r"max_new_tokens=0 is invalid", "max_new_tokens"),
    (dict(max_new_tokens=30), r"max_new_tokens=30 is too many: .* holds 24 positions",
     "max_new_tokens"),
    (dict(max_new_tokens=23), r"max_new_tokens=23 is too many: .* at most 22", "max_new_tokens"),
    (dict(prompt="x" * 30), r"prompt has 30 tokens; the server's canvas holds 24", "prompt"),
    (dict(sampler="nope"), r"sampler='nope' is invalid: .* one of ancestral, ", "sampler"),
    (dict(knobs=dict(nope=1)), r"nope= does not apply", "nope"),
    (dict(knobs=dict(temperature=-1.0)), r"temperature=-1.0 must be a finite number >= 0",
     "temperature"),
    (dict(sampler="ordered", knobs=dict(groups=((0,),))), r"names canvas positions", "sampler"),
    (dict(sampler="speculative"), r"runs rounds of its own", "sampler"),
])
def test_bad_requests_are_refused_before_compiling(dream_model, fields, match, param):
  """Checked once, by the engine: an ArgumentError naming the argument, nothing compiled."""
  engine = Engine(dream_model, max_batch=2, canvas_length=24)
  fields = {"max_new_tokens": 4, "seed": 0, **fields}
  prompt = fields.pop("prompt", "Hi")
  with pytest.raises(ArgumentError, match=match) as error:
    engine.prepare(prompt, **fields)
  assert error.value.param == param
  assert engine.stats().lanes == 0


def test_engine_settings_are_checked(dream_model):
  with pytest.raises(ValueError, match=r"max_batch=0 is invalid"):
    Engine(dream_model, max_batch=0)
  too_long = dream_model.max_len + 1
  with pytest.raises(ValueError,
                     match=rf"canvas_length={too_long} is invalid: .*\(the model holds"):
    Engine(dream_model, canvas_length=too_long)


def _packed(lane):
  """The lane's active rows hold the front of its slots (in fill order), no gaps."""
  owned = [slot for slot, owner in enumerate(lane.owners) if owner is not None]
  return sorted(owned) == sorted(lane.order[:len(owned)])


@pytest.mark.slow
def test_a_lone_request_ticks_the_one_row_program(dream_model):
  """One request on a 16-slot lane: every tick runs the 1-row program (not the 16-slot
  one), and the row still equals generate offline."""
  engine = Engine(dream_model, max_batch=16, canvas_length=24)
  job = engine.prepare(generation.prompt_ids(dream_model, ["Hi there"])[0], max_new_tokens=6,
                       seed=3, knobs=dict(steps=4, temperature=1.0))
  listener = Listener()
  drive(engine, [engine.submit(job, listener)])
  stats = engine.stats()
  assert stats.ticks_by_bucket == {1: stats.ticks} and stats.ticks >= 1
  lane, = engine.lanes
  assert lane.ticks_by_bucket == {1: stats.ticks}
  np.testing.assert_array_equal(listener.completions[0].completion.token_ids,
                                offline(dream_model, "Hi there", job)[0].token_ids)


@pytest.mark.slow
def test_rows_stay_packed_when_middle_rows_leave(dream_model):
  """Rows leave from the front and the middle (finished, cancelled): the last active row
  moves into the freed slot, the ticks shrink to the smallest bucket that holds the rows,
  and every remaining row still equals generate offline; a second wave through the same
  buckets compiles nothing."""
  engine = Engine(dream_model, max_batch=8, max_queue=16, canvas_length=24)
  knobs = dict(steps=5, temperature=1.0)
  prompts = ["Hi", "Hello there", "A", "Once upon", "xyz"]

  def wave(first_seed):
    jobs = [engine.prepare(generation.prompt_ids(dream_model, [p])[0], max_new_tokens=6,
                           seed=first_seed + i, knobs=knobs) for i, p in enumerate(prompts)]
    listeners = [Listener() for _ in jobs]
    submit = lambda i: engine.submit(jobs[i], listeners[i])
    handles = [submit(0)]
    engine.run_once()  # job 0 is a step ahead: it finishes first, from the front slot
    handles += [submit(1), submit(2), submit(3), submit(4)]
    engine.run_once()
    lane, = engine.lanes
    assert lane.active == 5 and _packed(lane)
    middle = lane.order[2]
    assert lane.owners[middle].handle is handles[2]
    handles[2].cancel()  # a middle row leaves: the last one (job 4) takes its slot
    engine.run_once()
    assert lane.owners[middle].handle is handles[4] and lane.active == 4 and _packed(lane)
    while not all(h.done for h in handles):
      assert _packed(lane)
      before = dict(engine.stats().ticks_by_bucket)
      active = lane.active
      engine.run_once()
      after = engine.stats().ticks_by_bucket
      if active:  # the tick ran the smallest bucket that holds the active rows
        bucket = {1: 1, 2: 2, 3: 4, 4: 4}[active]
        assert after[bucket] == before.get(bucket, 0) + 1
    assert lane.active == 0
    for i, (prompt, job, listener) in enumerate(zip(prompts, jobs, listeners)):
      if i == 2:
        continue  # cancelled
      np.testing.assert_array_equal(listener.completions[0].completion.token_ids,
                                    offline(dream_model, prompt, job)[0].token_ids)
    return set(engine.stats().ticks_by_bucket)

  buckets = wave(0)
  assert 8 in buckets and 1 in buckets
  compiled = engine.stats().compiles
  assert wave(50) == buckets
  assert engine.stats().compiles == compiled


@pytest.mark.slow
def test_warm_compiles_every_bucket_ahead(dream_model):
  """`Engine.warm`: every bucket's tick compiles before serving (changing nothing), and
  serving then compiles nothing."""
  engine = Engine(dream_model, max_batch=4, canvas_length=24)
  prepare = lambda seed, n: engine.prepare(generation.prompt_ids(dream_model, ["Hi"])[0],
                                           max_new_tokens=6, seed=seed, n=n,
                                           knobs=dict(steps=3, temperature=1.0))
  engine.warm(prepare(0, 1))
  compiled = engine.stats().compiles
  assert engine.stats().ticks == 0
  jobs = [prepare(1, 1), prepare(2, 3)]
  listeners = [Listener() for _ in jobs]
  drive(engine, [engine.submit(job, listener) for job, listener in zip(jobs, listeners)])
  assert engine.stats().compiles == compiled
  assert set(engine.stats().ticks_by_bucket) == {4}  # 4 rows at once, then 3
  for job, listener in zip(jobs, listeners):
    want = offline(dream_model, "Hi", job)
    for choice in range(job.n):
      np.testing.assert_array_equal(listener.completions[choice].completion.token_ids,
                                    want[choice].token_ids)
  # Started, the engine thread compiles (a new lane: another spec) and warm waits for it.
  engine.start()
  other = engine.prepare(generation.prompt_ids(dream_model, ["Hi"])[0], max_new_tokens=6,
                         seed=0, knobs=dict(steps=2, temperature=1.0))
  engine.warm(other, timeout=120)
  assert engine.stats().lanes == 2 and engine.stats().compiles > compiled
  engine.stop()


@pytest.mark.slow
def test_buckets_on_a_mesh_tick_an_equal_share_on_each_device():
  """Eight slots split over four simulated devices: the buckets are multiples of four (a
  row or two tick on the 4-slot program, one slot a device), rows fill the devices in turn
  and stay packed as they leave, and every row equals generate on one device."""
  code = textwrap.dedent(f"""
    import jax, numpy as np, mdjax
    from mdjax import generation, mesh as mesh_lib
    from mdjax.serve.engine import Engine
    one = mdjax.load({DREAM!r})
    model = mdjax.load({DREAM!r}, mesh=mesh_lib.make_mesh())
    engine = Engine(model, max_batch=8, canvas_length=24)
    prompts = ["Hi there", "Hello"]
    jobs = [engine.prepare(generation.prompt_ids(model, [p])[0], max_new_tokens=6,
                           seed=7 + i, n=n, knobs=dict(steps=3, temperature=1.0))
            for i, (p, n) in enumerate(zip(prompts, (2, 4)))]
    got = [{{}}, {{}}]
    listen = lambda i: lambda u: got[i].__setitem__(u.choice, u.completion)
    first = engine.submit(jobs[0], listen(0))
    engine.run_once()
    lane, = engine.lanes
    assert lane.split == 4 and lane.order == [0, 2, 4, 6, 1, 3, 5, 7]
    assert engine.stats().ticks_by_bucket == {{4: 1}}
    second = engine.submit(jobs[1], listen(1))
    while not (first.done and second.done):
      engine.run_once()
      owned = sorted(s for s, o in enumerate(lane.owners) if o is not None)
      assert owned == sorted(lane.order[:len(owned)])
    assert set(engine.stats().ticks_by_bucket) == {{4, 8}}
    assert lane.rows.index.sharding.spec == jax.sharding.PartitionSpec("data")
    for job, prompt, rows in zip(jobs, prompts, got):
      want = mdjax.generate(one, [prompt] * job.n, max_new_tokens=6,
                            key=jax.random.key(job.seed), spec=job.spec)
      for i in range(job.n):
        np.testing.assert_array_equal(rows[i].token_ids, want[i].token_ids)
    print("MESH BUCKETS OK")
  """)
  run_on_cpu_devices(code, 4, "MESH BUCKETS OK")


@pytest.mark.parametrize("noise,sampler", [("uniform", None), ("uniform", "diffusion_gemma"),
                                           ("hybrid", None)])
def test_revising_samplers_are_served_as_generate_samples_them(noise, sampler):
  """A uniform or hybrid oracle's samplers (uniform_ancestral, its default, and
  DiffusionGemma's rule) take the model's noise process on a lane as `generate` does: every
  row equals the offline one (was: the spec reached the lane without its process)."""
  model = mdjax.load("oracle:two_color", noise=noise)
  engine = Engine(model, max_batch=4)
  job = engine.prepare([], max_new_tokens=2, seed=3, n=4, sampler=sampler,
                       knobs=dict(steps=4))
  listener = Listener()
  drive(engine, [engine.submit(job, listener)])
  want = mdjax.generate(model, [[]] * 4, max_new_tokens=2, key=jax.random.key(3),
                        spec=job.spec)
  assert getattr(job.spec, "noise", model.noise) == model.noise  # gemma's rule: uniform only
  for choice in range(4):
    np.testing.assert_array_equal(listener.completions[choice].completion.token_ids,
                                  want[choice].token_ids)
