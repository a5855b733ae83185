"""The permutation task: its oracle, its law, and the closed form of ancestral decoding."""

import itertools
import math

import jax
import numpy as np
import pytest

from mdjax import sampling, tasks
from mdjax.tasks import permutation


def brute_marginals(state, n):
  """p(x_i | visible) by enumerating the n! permutations."""
  perms = np.array(list(itertools.permutations(range(n))))
  visible = state != n
  keep = perms[np.all((perms == state) | ~visible, 1)]
  return np.stack([np.bincount(keep[:, i], minlength=n) / len(keep) for i in range(n)])


def test_oracle_marginals_match_brute_force_at_random_states():
  n = 4
  params = permutation.Params(n=n)
  rng = np.random.default_rng(0)
  for _ in range(50):
    state = rng.permutation(n)
    state[rng.random(n) < rng.random()] = n
    probs, possible = permutation.exact_probs(state[None], params)
    assert bool(possible[0])
    np.testing.assert_allclose(np.asarray(probs[0]), brute_marginals(state, n), atol=1e-6)


def test_impossible_states_are_flagged_and_get_the_all_masked_marginals():
  params = permutation.Params(n=3)
  probs, possible = permutation.exact_probs(np.array([[1, 1, 3]]), params)
  assert not bool(possible[0])
  np.testing.assert_allclose(np.asarray(probs[0, 2]), np.full(3, 1 / 3), atol=1e-6)
  assert permutation.is_impossible(np.array([[1, 1, 3], [0, 1, 3]], np.int32)).tolist() == [
      True, False]


def test_task_value_data_and_checks():
  task = tasks.get("permutation", {"n": 5})
  assert (task.length, task.vocab_size, task.mask_id) == (5, 5, 5)
  data = np.asarray(task.sample_data(jax.random.key(0), 200))
  assert task.checks(data)["valid"].all()
  assert task.sample_metrics(np.array([[0, 1, 2, 3, 4], [0, 0, 2, 3, 4]]))["valid"] == 0.5
  np.testing.assert_allclose(permutation.log_prob(data[:2], task.params), -math.log(120))
  with pytest.raises(ValueError, match="n=1"):
    tasks.get("permutation", {"n": 1})
  with pytest.raises(ValueError, match="unknown"):
    tasks.get("permutation", {"length": 3})


def test_closed_form_small_cases_by_hand():
  # n = 2: both positions in one step (prob 1/K) are distinct w.p. 1/2.
  for k in (1, 2, 3, 5):
    assert permutation.ancestral_valid_probability(2, k) == 1 - permutation.Fraction(1, 2 * k)
  # One step writes everything: n! / n^n.
  assert permutation.ancestral_valid_probability(4, 1) == permutation.Fraction(24, 4**4)
  # Jensen: the summed TC along the ideal trajectory is at least -log P(valid), with
  # equality in one step (the group sizes are then fixed).
  for k in (1, 2, 4):
    bound = permutation.ancestral_expected_total_correlation(5, k)
    assert bound >= -math.log(permutation.ancestral_valid_probability(5, k)) - 1e-12
  assert permutation.ancestral_expected_total_correlation(5, 1) == pytest.approx(
      -math.log(math.factorial(5) / 5**5))
  assert permutation.group_total_correlation(4, 2) == pytest.approx(math.log(16 / 12))


@pytest.mark.parametrize("steps", [1, 2, 4])
@pytest.mark.slow
def test_ancestral_sampler_matches_the_closed_form(steps):
  # 4 standard errors of a binomial proportion at the exact value, 4,000 rows: a false
  # failure has probability about 6e-5 per case.
  n, rows = 4, 4000
  task = permutation.make_task(permutation.Params(n=n))
  out = sampling.sample(task.exact_denoiser, None, jax.random.key(steps), task.empty_canvas(rows),
                        sampling.AncestralSpec(steps=steps))
  measured = task.checks(out.tokens_BxL)["valid"].mean()
  exact = float(permutation.ancestral_valid_probability(n, steps))
  assert abs(measured - exact) <= 4 * math.sqrt(exact * (1 - exact) / rows)
