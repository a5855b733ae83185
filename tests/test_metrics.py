"""Tests of the distribution metrics."""

import numpy as np

from mdjax import metrics


def test_tvt_bounds_and_known_values():
  a = np.array([[0, 0], [1, 1]])
  b = np.array([[2, 2], [3, 3]])
  assert metrics.tvt(a, a, 4) == 0.0
  assert metrics.tvt(a, b, 4) == 1.0
  c = np.array([[0, 1], [0, 1]])  # same pooled histogram as a, other positions
  assert metrics.tvt(a, c, 4) == 0.0
  assert metrics.per_position_tv(a, c, 4) == 0.5
  np.testing.assert_allclose(metrics.tvt_exact(a, np.full((2, 4), 0.25)), 0.5)


def test_noise_floor_shrinks_like_one_over_sqrt_n_and_p_values():
  rng = np.random.default_rng(0)
  draw = lambda n: (lambda i: np.random.default_rng(i).integers(0, 10, (n, 5)))
  small = metrics.noise_floor(draw(100), 100, 10, repeats=40)
  large = metrics.noise_floor(draw(1600), 1600, 10, repeats=40)
  # The floor scales as 1/sqrt(n): a 16x larger set gives about a 4x lower one.
  assert 3.0 < small.mean() / large.mean() < 5.3
  fresh = rng.integers(0, 10, (1600, 5))
  biased = np.where(rng.random((1600, 5)) < 0.2, 0, fresh)
  reference = rng.integers(0, 10, (1600, 5))
  p_fresh = metrics.p_value(metrics.tvt(fresh, reference, 10), large)
  p_biased = metrics.p_value(metrics.tvt(biased, reference, 10), large)
  assert p_biased == 1 / 41 and p_fresh > 0.05
  boot = metrics.bootstrap_null(reference, 1600, 10, repeats=40)
  assert 0.5 < boot.mean() / large.mean() < 2.0


def test_uniqueness():
  assert metrics.uniqueness(np.array([[1, 2], [1, 2], [2, 1], [0, 0]])) == 0.75
