"""The ancestral reverse kernel: its error on the two-color oracle, its call cache."""

import jax
import numpy as np
import pytest

from mdjax import sampling
from tests import stubs
from tests.sampling.common import (LENGTH, N_TWO_COLOR, VOCAB, binomial_tol,
                                   prompted_canvas, two_color_invalid)


@pytest.mark.parametrize("steps", [1, 8, 32])
@pytest.mark.slow
def test_two_color_ancestral_uniform_grid_invalid_fraction(steps):
  # Both positions revealed in one interval (prob 1/K under the linear
  # schedule) are drawn independently: invalid half the time.
  theory = 1.0 / (2 * steps)
  frac = two_color_invalid(sampling.AncestralSpec(steps=steps))
  assert abs(frac - theory) < binomial_tol(theory, N_TWO_COLOR), (frac, theory)


def test_two_color_ancestral_unequal_grid_invalid_fraction():
  grid = (1.0, 0.7, 0.2, 0.0)
  widths = -np.diff(grid)
  theory = 0.5 * float(np.sum(widths**2))
  frac = two_color_invalid(sampling.AncestralSpec(steps=3, grid=grid))
  assert abs(frac - theory) < binomial_tol(theory, N_TWO_COLOR), (frac, theory)


def test_cache_skips_calls_and_changes_nothing():
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = prompted_canvas(batch=1)
  plain = sampling.sample(stubs.stub_denoiser, params, jax.random.key(2), tokens,
                          sampling.AncestralSpec(steps=64))
  cached = sampling.sample(stubs.stub_denoiser, params, jax.random.key(2), tokens,
                           sampling.AncestralSpec(steps=64, cache=True))
  np.testing.assert_array_equal(plain.tokens_BxL, cached.tokens_BxL)
  # 9 positions revealed over 64 steps: at most 10 distinct canvases are seen.
  assert int(cached.nfe) <= 10 and int(cached.nfe) + int(cached.saved_calls) == 64

