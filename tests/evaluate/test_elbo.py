"""elbo.discrete_nelbo: MD4's T-step NELBO, every step summed, on exact denoisers."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import diffusion
from mdjax.evaluate import elbo
from mdjax.tasks import scan_and_add, two_color

LINEAR = diffusion.LinearSchedule()
SMALL = scan_and_add.Params(n=4)  # L = 15: a cheap exact denoiser
SA_DENOISER = scan_and_add.make_exact_denoiser(SMALL)


def test_two_color_equals_its_closed_form_and_converges_to_log_2():
  # Exact denoiser, linear schedule: only "both masked" costs, 2 ln 2, so the T-step NELBO is
  # sum_i (a_s - a_t)(1 - a_t) 2 ln 2 = ln 2 (T + 1) / T (tests/test_diffusion.py): >= ln 2 =
  # -log p(x), the gap ln 2 / T closing as T grows.
  x = np.asarray(two_color.sample_data(jax.random.key(0), 64))
  for steps in (1, 2, 4, 64):
    est = elbo.discrete_nelbo(two_color.exact_denoiser, None, x, schedule=LINEAR,
                                    mask_id=two_color.MASK_ID, num_steps=steps, samples=8,
                                    steps_per_call=1)
    theory = math.log(2) * (steps + 1) / steps
    # 4 standard errors of the replicates' mean, plus float32 rounding (T = 1: both masked
    # at t = 1 with certainty, no variance).
    assert abs(est["nelbo_nats"] - theory) < 4 * est["se"] + 1e-6, (steps, est, theory)
    assert (steps == 1) == (est["se"] == 0.0)
    np.testing.assert_allclose(est["bits_per_token"], est["nelbo_nats"] / 2 / math.log(2))
  # T = 64: within ln 2 / 64 + 4 standard errors of -log p(x) = ln 2.
  assert abs(est["nelbo_nats"] - math.log(2)) < math.log(2) / 64 + 4 * est["se"]


@pytest.mark.slow
def test_scan_and_add_converges_to_minus_log_p():
  x = np.asarray(scan_and_add.sample_data(jax.random.key(1), 8, SMALL))
  exact = -scan_and_add.log_prob(x, SMALL).mean()
  # Eight steps per call: both T run one compiled program (the exact denoiser compiles
  # slowly). T = 1 is the two-color test's.
  call = functools.partial(elbo.discrete_nelbo, SA_DENOISER, None, x, schedule=LINEAR,
                           mask_id=scan_and_add.MASK_ID, steps_per_call=8)
  est8, est256 = call(num_steps=8, samples=8), call(num_steps=256, samples=4)
  # T = 8: steps unmask several tokens at once (0.67 +- 0.12 nats above -log p(x) with 64
  # replicates); a bound, never more than 4 standard errors below -log p(x).
  assert est8["nelbo_nats"] > exact - 4 * est8["se"]
  # T = 256 is -log p(x) (the continuous bound of an exact denoiser) up to 4 standard errors:
  # the remaining gap, tokens unmasked in the same one of 256 steps, measured 0.03 +- 0.03
  # nats with 64 replicates, is a quarter of this test's standard error (about 0.12 nats).
  assert abs(est256["nelbo_nats"] - exact) < 4 * est256["se"], (est256, exact)
  assert est8["nelbo_nats"] > est256["nelbo_nats"]


def test_bad_input_is_refused_before_compiling():
  x = np.zeros((2, 2), np.int32)
  call = functools.partial(elbo.discrete_nelbo, two_color.exact_denoiser, None,
                           schedule=LINEAR, mask_id=two_color.MASK_ID)
  with pytest.raises(ValueError, match="num_steps=0"):
    call(x, num_steps=0)
  with pytest.raises(ValueError, match="samples=1"):
    call(x, num_steps=4, samples=1)
  with pytest.raises(ValueError, match="x_NxL has shape"):
    call(x[0], num_steps=4)
  with pytest.raises(ValueError, match="outside"):
    call(x + 2, num_steps=4)
  with pytest.raises(ValueError, match="schedule='bogus'"):
    call(x, num_steps=4, schedule="bogus")
