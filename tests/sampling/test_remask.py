"""Remasking (ReMDM): eta = 0 is ancestral; the marginal schedule holds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import diffusion, sampling
from tests import stubs
from tests.sampling.common import (LENGTH, VOCAB, binomial_tol,
                                   prompted_canvas)

pytestmark = pytest.mark.slow


def test_remask_eta_zero_equals_ancestral_token_for_token():
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = prompted_canvas(64)
  key = jax.random.key(7)
  for schedule in (diffusion.LinearSchedule(), diffusion.CosineSchedule()):
    a = sampling.sample(stubs.stub_denoiser, params, key, tokens,
                        sampling.AncestralSpec(steps=9, schedule=schedule))
    r = sampling.sample(stubs.stub_denoiser, params, key, tokens,
                        sampling.RemaskSpec(steps=9, schedule=schedule, eta=0.0))
    np.testing.assert_array_equal(a.tokens_BxL, r.tokens_BxL)
    np.testing.assert_array_equal(a.write_step_BxL, r.write_step_BxL)
    assert int(r.reopened_B.sum()) == 0


def test_remask_reopens_and_keeps_the_marginal_schedule():
  # Per-step masked fraction must follow 1 - alpha(s) whatever sigma does.
  batch, length, steps = 2000, 16, 10
  params = stubs.stub_params(VOCAB, length)
  tokens = jnp.full((batch, length), VOCAB, jnp.int32)
  spec = sampling.RemaskSpec(steps=steps, eta=0.3, record_trajectory=True)
  result = sampling.sample(stubs.stub_denoiser, params, jax.random.key(0), tokens, spec)
  assert int(result.reopened_B.sum()) > 0
  masked_K = (np.asarray(result.trajectory_KxBxL) == VOCAB).mean(axis=(1, 2))
  expected_K = 1.0 - np.arange(1, steps + 1) / steps
  # Positions are dependent only through the per-row reveal probability;
  # 4 binomial standard errors over B*L draws, doubled for that dependence.
  for got, p in zip(masked_K, expected_K):
    assert abs(got - p) < 2 * binomial_tol(p, batch * length) + 1e-9, (masked_K, expected_K)

