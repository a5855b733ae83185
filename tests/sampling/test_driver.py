"""The driver: exactness of one position per step, idle-step skipping, lowering, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import sampling
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

