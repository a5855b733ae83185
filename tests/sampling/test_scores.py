"""Rank-mask top-k selection and scheduled commit counts against numpy."""

import jax.numpy as jnp
import numpy as np

from mdjax.sampling import scores
from tests.sampling.common import np_top_k


def test_select_top_k_matches_numpy_with_ties():
  rng = np.random.default_rng(0)
  score = np.round(rng.normal(size=(64, 20)) * 2) / 2  # many exact ties
  cand = rng.random((64, 20)) < 0.7
  k = rng.integers(0, 21, 64)
  got = np.asarray(scores.select_top_k(jnp.asarray(score), jnp.asarray(cand), jnp.asarray(k)))
  np.testing.assert_array_equal(got, np_top_k(score, cand, k))


def test_confidence_commit_counts_per_row():
  k = scores.commit_counts(jnp.array([10, 7, 3]), jnp.array([10, 5, 3]), 0.3)
  np.testing.assert_array_equal(k, [7, 3, 3])  # floor(10*.3)=3, floor(7*.3)=2, 0

