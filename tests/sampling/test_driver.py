"""The driver: exactness of one position per step, idle-step skipping, lowering, bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import diffusion, sampling
from tests import stubs
from tests.sampling.common import (LENGTH, N_TWO_COLOR, VOCAB, binomial_tol,
                                   prompted_canvas, two_color_invalid)


@pytest.mark.parametrize("spec", [
    sampling.OrderedSpec(groups=((1,), (0,))),
    sampling.RandomOrderSpec(),
    sampling.ConfidenceSpec(steps=2),
], ids=lambda s: type(s).__name__)
def test_two_color_one_position_per_step_is_exact(spec):
  assert two_color_invalid(spec) == 0.0


def test_two_color_parallel_group_is_wrong_half_the_time():
  theory = 0.5
  frac = two_color_invalid(sampling.OrderedSpec(groups=((0, 1),)))
  assert abs(frac - theory) < binomial_tol(theory, N_TWO_COLOR)


@pytest.mark.parametrize("make", [
    # The first interval reveals each position with probability 0.999: later steps idle.
    lambda **kw: sampling.AncestralSpec(steps=3, grid=(1.0, 1e-3, 5e-4, 0.0), **kw),
    # Threshold 0 commits every proposal at the first step of each block.
    lambda **kw: sampling.ConfidenceSpec(steps=8, block_length=4, threshold=0.0, **kw),
    # The last group holds only a prompt position: nothing is left to write by then.
    lambda **kw: sampling.OrderedSpec(groups=((4, 5), (6, 7, 8), (9, 10, 11), (0,)), **kw),
], ids=["ancestral", "confidence_blocks", "ordered"])
@pytest.mark.slow
def test_skip_idle_steps_off_calls_every_step_and_changes_nothing(make):
  # An idle step writes nothing whatever the logits, so dropping the skip changes only
  # the call count.
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = prompted_canvas(batch=1)
  skipping = sampling.sample(stubs.stub_denoiser, params, jax.random.key(4), tokens, make())
  calling = sampling.sample(stubs.stub_denoiser, params, jax.random.key(4), tokens,
                            make(skip_idle_steps=False))
  np.testing.assert_array_equal(skipping.tokens_BxL, calling.tokens_BxL)
  np.testing.assert_array_equal(skipping.write_step_BxL, calling.write_step_BxL)
  steps = int(skipping.nfe) + int(skipping.saved_calls)
  assert int(skipping.saved_calls) > 0, "the case must have idle steps to mean anything"
  assert int(calling.nfe) == steps and int(calling.saved_calls) == 0


def test_lowered_program_is_the_sampler():
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = prompted_canvas(batch=4)
  spec = sampling.ConfidenceSpec(steps=4)
  lowered, args = sampling.lower(stubs.stub_denoiser, params, jax.random.key(2), tokens, spec)
  direct = sampling.sample(stubs.stub_denoiser, params, jax.random.key(2), tokens, spec)
  np.testing.assert_array_equal(lowered.compile()(*args).tokens_BxL, direct.tokens_BxL)


@pytest.mark.parametrize("make, match", [
    (lambda: sampling.AncestralSpec(steps=0), "steps=0"),
    (lambda: sampling.ConfidenceSpec(steps=4, temperature=-1.0), "temperature=-1.0"),
    (lambda: sampling.AncestralSpec(steps=4, top_p=0.0), "top_p=0.0"),
    (lambda: sampling.AncestralSpec(steps=4, top_p=1.5), "top_p=1.5"),
    (lambda: sampling.AncestralSpec(steps=4, top_k=0), "top_k=0"),
    (lambda: sampling.ConfidenceSpec(steps=4, min_p=1.5), "min_p=1.5"),
    (lambda: sampling.AncestralSpec(steps=2, grid=(1.0, 0.6, 0.7, 0.0)), "grid="),
    (lambda: sampling.AncestralSpec(steps=2, grid=(0.9, 0.5, 0.0)), "decrease strictly"),
    (lambda: sampling.AncestralSpec(steps=2, grid="log"), "grid='log'"),
    (lambda: sampling.OrderedSpec(groups=((0, 1), (1, 2))), "one group only"),
    (lambda: sampling.ConfidenceSpec(steps=2, score="entropy"), "score='entropy'"),
    (lambda: sampling.RemaskSpec(steps=2, sigma="max"), "sigma='max'"),
    (lambda: sampling.RemaskSpec(steps=2, loop_t_on=0.5), "together"),
])
def test_bad_specs_raise_clear_errors(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_bad_data_raises_before_tracing():
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = prompted_canvas(prompt=3)  # 9 generated positions
  run = lambda tok, spec, fixed=None: sampling.sample(
      stubs.stub_denoiser, params, jax.random.key(0), tok, spec, fixed)
  with pytest.raises(ValueError, match="tokens_BxL holds 7"):
    run(tokens.at[0, 0].set(VOCAB + 1), sampling.AncestralSpec(steps=2))
  with pytest.raises(ValueError, match="tokens_BxL holds -1"):
    run(tokens.at[0, 0].set(-1), sampling.AncestralSpec(steps=2))
  fixed = np.zeros((16, LENGTH), bool)
  fixed[:, :4] = True  # position 3 is a mask
  with pytest.raises(ValueError, match="fixed_BxL marks position 3"):
    run(tokens, sampling.AncestralSpec(steps=2), fixed)
  with pytest.raises(ValueError, match="block_length=4 must divide the generation length 9"):
    run(tokens, sampling.AncestralSpec(steps=3, block_length=4))
  with pytest.raises(ValueError, match="steps=4 must be divisible by the number of blocks 3"):
    run(tokens, sampling.ConfidenceSpec(steps=4, block_length=3))
  with pytest.raises(ValueError, match=r"groups miss masked positions \[11\]"):
    run(tokens, sampling.OrderedSpec(groups=tuple((i,) for i in range(3, 11))))
  with pytest.raises(ValueError, match="groups name position 12"):
    run(tokens, sampling.OrderedSpec(groups=tuple((i,) for i in range(3, 13))))
  with pytest.raises(ValueError, match="2-D integer"):
    run(tokens.astype(jnp.float32), sampling.AncestralSpec(steps=2))



def _plan_and_canvas(spec, tokens):
  family = sampling.family_of(spec)
  tokens = np.asarray(tokens)
  canvas = sampling.Canvas(batch=tokens.shape[0], length=tokens.shape[1], mask_id=VOCAB,
                           tokens=tokens, fixed=tokens != VOCAB)
  return family, canvas, family.plan(spec, canvas)


@pytest.mark.parametrize("spec", [
    sampling.ConfidenceSpec(steps=32),  # N = 8 < K: the count changes every 4th step
    sampling.ConfidenceSpec(steps=8, block_length=4, count_schedule=diffusion.CosineSchedule()),
    sampling.OrderedSpec(groups=((4, 5), (6, 7, 8), (9, 10, 11), (0,))),
    sampling.RandomOrderSpec(),
], ids=["confidence_K_above_N", "confidence_cosine_blocks", "ordered", "random_order"])
@pytest.mark.slow
def test_counted_idle_steps_are_the_calls_the_run_skips(spec):
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = prompted_canvas(batch=3)
  family, canvas, plan = _plan_and_canvas(spec, tokens)
  idle = family.idle_steps(spec, canvas, plan)
  result = sampling.sample(stubs.stub_denoiser, params, jax.random.key(5), tokens,
                           dataclasses.replace(spec, skip_idle_steps=True))
  assert idle == int(result.saved_calls)
  assert int(result.nfe) + int(result.saved_calls) == family.num_steps(spec, LENGTH)


def test_confidence_calls_only_at_steps_that_commit():
  # K = 4 N: 3 of 4 steps commit nothing in any row; they skip the call, and the tokens
  # are those of the run that calls at every step.
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = prompted_canvas(batch=3)
  spec = sampling.ConfidenceSpec(steps=32)
  skipping = sampling.sample(stubs.stub_denoiser, params, jax.random.key(6), tokens, spec)
  calling = sampling.sample(stubs.stub_denoiser, params, jax.random.key(6), tokens,
                            dataclasses.replace(spec, skip_idle_steps=False))
  np.testing.assert_array_equal(skipping.tokens_BxL, calling.tokens_BxL)
  np.testing.assert_array_equal(skipping.write_step_BxL, calling.write_step_BxL)
  assert int(skipping.nfe) == 8 and int(calling.nfe) == 32


@pytest.mark.slow
def test_expected_idle_steps_of_the_ancestral_sampler():
  # The mean number of skipped calls over independent runs equals the plan's expectation
  # within 4 standard errors of the mean (the sample standard deviation over the runs).
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = prompted_canvas(batch=1)
  spec = sampling.AncestralSpec(steps=32, skip_idle_steps=True)
  family, canvas, plan = _plan_and_canvas(spec, tokens)
  expected = family.idle_steps(spec, canvas, plan)
  run = jax.jit(jax.vmap(lambda key: sampling.sample(stubs.stub_denoiser, params, key, tokens,
                                                     spec).saved_calls))
  saved = np.asarray(run(jax.random.split(jax.random.key(7), 2000)), np.float64)
  assert 2.0 < expected < 6.0  # sum_j (j / 32)^8 for 8 masked positions: about 3.5
  assert abs(saved.mean() - expected) < 4.0 * saved.std() / np.sqrt(len(saved))


def _primitives(jaxpr, names: set) -> set:
  """The names of every primitive in `jaxpr`, nested programs included."""
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          _primitives(sub.jaxpr, names)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          _primitives(sub, names)
  return names


def _jumps(spec, tokens) -> bool:
  """Whether the compiled sampler jumps over idle steps (a while loop, no scan)."""
  params = stubs.stub_params(VOCAB, LENGTH)
  program = jax.make_jaxpr(
      lambda key: sampling.sample(stubs.stub_denoiser, params, key, tokens, spec).tokens_BxL)
  names = _primitives(program(jax.random.key(0)).jaxpr, set())
  assert "cond" not in names  # no branch around the denoiser on the default path
  assert ("scan" in names) != ("while" in names), names
  return "while" in names


@pytest.mark.parametrize("spec, jumps", [
    (sampling.ConfidenceSpec(steps=8), False),  # every step commits: a plain scan
    (sampling.ConfidenceSpec(steps=32), True),  # 24 of 32 idle
    (sampling.ConfidenceSpec(steps=8, threshold=0.9), True),  # finishes early: cannot tell
    (sampling.ConfidenceSpec(steps=32, skip_idle_steps=False), False),
    (sampling.ConfidenceSpec(steps=8, skip_idle_steps=True), True),
    # Expected idle steps are about K / (B N + 1) for B rows of N masked positions:
    (sampling.AncestralSpec(steps=64), False),  # B N = 16: 6% of the steps
    (sampling.AncestralSpec(steps=64, block_length=2), True),  # B N = 4 per block: 20%
    (sampling.OrderedSpec.left_to_right(LENGTH), True),  # 4 steps write prompt positions
    (sampling.RemaskSpec(steps=8, skip_idle_steps=True), False),  # never idle
], ids=["confidence", "confidence_K_above_N", "threshold", "off", "on", "ancestral",
        "ancestral_blocks", "left_to_right", "remask"])
def test_the_default_jumps_only_where_the_plan_leaves_idle_steps(spec, jumps):
  tokens = prompted_canvas(batch=2)
  family, canvas, plan = _plan_and_canvas(spec, tokens)
  idle = family.idle_steps(spec, canvas, plan)
  if spec.skip_idle_steps is None and idle is not None:
    fraction = idle / family.num_steps(spec, LENGTH)
    assert (fraction >= sampling.IDLE_FRACTION_TO_SKIP) == jumps, fraction
  assert _jumps(spec, tokens) == jumps


def test_a_repeated_call_traces_nothing():
  # Shape checks are cached per signature: a second call with new keys and token values
  # but the same shapes neither traces the denoiser nor recompiles.
  traces = []

  def counting(params, tokens_BxL, t_B):
    traces.append(1)
    return stubs.stub_denoiser(params, tokens_BxL, t_B)

  params = stubs.stub_params(VOCAB, LENGTH)
  spec = sampling.ConfidenceSpec(steps=4)
  sampling.sample(counting, params, jax.random.key(0), prompted_canvas(batch=2), spec)
  first = len(traces)
  other = np.asarray(prompted_canvas(batch=2)).copy()
  other[:, 0] = (other[:, 0] + 1) % VOCAB
  result = sampling.sample(counting, params, jax.random.key(1), other, spec)
  assert first >= 1 and len(traces) == first
  assert not np.any(np.asarray(result.tokens_BxL) == VOCAB)
