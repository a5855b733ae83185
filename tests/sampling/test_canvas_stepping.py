"""The canvases door (`sampling.canvas_stepping.CanvasesStepper`): DiffusionGemma's canvases
stepped one denoising step at a time, each canvas committed once every row's is done, end
where `sample`'s one program ends, counters and stop steps included. The cached path (the
tiny DiffusionGemma checkpoint: prompt and canvases in its cache) is driven through a served
lane in tests/serve/test_canvas_lanes.py; here a stub without a cache recomputes the canvas."""

import jax
import numpy as np
import pytest

from mdjax import sampling
from mdjax.sampling.canvas_stepping import CanvasesStepper, serves
from tests import stubs

VOCAB, PROMPT, WIDTH, CANVASES = 6, 3, 3, 3
LENGTH = PROMPT + WIDTH * CANVASES
# Rows end at a canvas holding a stop id (2 or 3: a few in 6 tokens), so later canvases run
# with those rows fixed, and some rows of a canvas stop early (the entropy stop).
SPECS = {
    "stops": sampling.DiffusionGemmaCanvasesSpec(
        steps=3, reference_length=WIDTH, canvases=CANVASES, entropy_bound=1.0,
        final_renoise=True, eos_id=2, stop_ids=(2, 3)),
    "early": sampling.DiffusionGemmaCanvasesSpec(
        steps=4, reference_length=WIDTH, canvases=CANVASES, entropy_bound=0.5,
        entropy_stop=1.7, eos_id=2),
}


def _canvas(batch: int) -> np.ndarray:
  tokens = np.full((batch, LENGTH), VOCAB, np.int32)
  tokens[:, :PROMPT] = np.random.default_rng(1).integers(0, VOCAB, (batch, PROMPT))
  return tokens


@pytest.mark.parametrize("name", ["stops", pytest.param("early", marks=pytest.mark.slow)])
def test_stepped_canvases_equal_sample(name):
  """Start, then a step a call and a commit where every row's canvas is done, until every
  row is: `sample`'s tokens, write steps, counters and stop steps, at each seed."""
  spec, params, canvas = SPECS[name], stubs.stub_params(VOCAB, LENGTH), _canvas(4)
  prepared = sampling.prepare(stubs.stub_denoiser, params, jax.random.key(0), canvas, spec)
  door = CanvasesStepper(spec, prepared.stepper.mask_id, prepared.stepper.vocab_size)
  bound = prepared.bind()
  start = jax.jit(lambda key: door.start(bound, key, canvas))

  @jax.jit
  def advance(state):
    state = door.step(bound, state, prepared.plan)
    return jax.lax.cond(door.canvas_done(state), lambda s: door.commit(bound, s),
                        lambda s: s, state)

  ended_early = stopped_early = 0
  for seed in range(2):
    key = jax.random.key(seed)
    whole = sampling.sample(stubs.stub_denoiser, params, key, canvas, spec)
    state, ticks = start(key), 0
    while not bool(door.done(state).all()):
      state, ticks = advance(state), ticks + 1
    got = door.result(state)
    assert ticks <= door.num_steps()
    np.testing.assert_array_equal(got.tokens_BxL, whole.tokens_BxL)
    np.testing.assert_array_equal(door.tokens(state), whole.tokens_BxL)
    np.testing.assert_array_equal(got.write_step_BxL, whole.write_step_BxL)
    stop_NxB = np.asarray(whole.extras["stop_step_NxB"])
    np.testing.assert_array_equal(got.extras["stop_step_NxB"], stop_NxB)
    for field in ("nfe", "saved_calls", "rounds_B", "contexts_B"):
      np.testing.assert_array_equal(getattr(got, field), getattr(whole, field), err_msg=field)
    ended_early += int((stop_NxB[-1] == -1).sum())
    stopped_early += int(((stop_NxB >= 0) & (stop_NxB < spec.steps)).sum())
  # The cases reach what they are for: rows ended before the last canvas, canvases stopped.
  assert ended_early > 0 if name == "stops" else stopped_early > 0


def test_the_door_serves_the_canvases_family_only():
  assert serves(SPECS["stops"]) and not serves(sampling.DiffusionGemmaSpec(steps=2))
  assert CanvasesStepper(SPECS["early"], VOCAB).num_steps() == 4 * CANVASES
