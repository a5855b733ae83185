"""The list tasks (copy, replace, shuffle): oracles against brute force, closed forms."""

import itertools
import math

import jax
import numpy as np
import pytest

from mdjax import sampling, tasks
from mdjax.tasks import lists


def law(params):
  """Every (prompt, output) row of the law with its probability."""
  rows, probs = [], []
  for a in itertools.permutations(range(params.m), params.n):
    if params.kind == "copy":
      outs = [a]
    elif params.kind == "shuffle":
      outs = list(itertools.permutations(a))
    else:
      outs = [tuple(params.marker if i == j else a[i] for i in range(params.n))
              for j in range(params.n)]
    rows += [a + o for o in outs]
    probs += [1.0 / len(outs)] * len(outs)
  probs = np.array(probs)
  return np.array(rows), probs / probs.sum()


@pytest.mark.parametrize("kind", lists.KINDS)
def test_oracle_marginals_match_brute_force(kind):
  params = lists.Params(kind=kind, n=3, m=5)
  rows, probs = law(params)
  rng = np.random.default_rng(0)
  states = rows[rng.choice(len(rows), 64, p=probs)].copy()
  states[rng.random(states.shape) < rng.random((64, 1))] = params.mask_id
  got, possible = lists.exact_probs(states, params)
  assert np.asarray(possible).all()
  for state, g in zip(states, np.asarray(got)):
    keep = np.all((rows == state) | (state == params.mask_id), 1)
    w = probs * keep / (probs * keep).sum()
    want = np.stack([np.bincount(rows[:, i], weights=w, minlength=params.vocab_size)
                     for i in range(params.length)])
    np.testing.assert_allclose(g, want, atol=1e-5)


def test_checks_and_impossible_states():
  p = lists.Params(kind="replace", n=3, m=5)
  x = np.array([[0, 1, 2, 0, 5, 2], [0, 1, 2, 5, 5, 2], [0, 1, 2, 0, 1, 2]])
  assert lists.checks(x, p)["valid"].tolist() == [True, False, False]
  assert lists.is_impossible(np.array([[0, 1, 2, 5, 5, 6]]), p)[0]
  s = lists.Params(kind="shuffle", n=3, m=5)
  assert lists.checks(np.array([[0, 1, 2, 2, 0, 1], [0, 1, 2, 2, 2, 1]]), s)["valid"].tolist() == [
      True, False]
  task = tasks.get("list_copy", {"n": 3, "m": 5})
  assert task.checks(np.asarray(task.sample_data(jax.random.key(0), 50)))["valid"].all()
  with pytest.raises(ValueError, match="m=3"):
    tasks.get("list_replace", {"n": 3, "m": 3})


def test_closed_forms_by_hand():
  # One step: ParallelBench's n!/n^n (shuffle) and ((n-1)/n)^(n-1) (replace).
  n = 4
  assert lists.ancestral_valid_probability("shuffle", n, 1) == lists.Fraction(
      math.factorial(n), n**n)
  assert lists.ancestral_valid_probability("replace", n, 1) == lists.Fraction(n - 1, n)**(n - 1)
  assert lists.ancestral_valid_probability("copy", n, 1) == 1
  # One position a step is exact.
  assert lists.ancestral_valid_probability("replace", 3, 50) > 0.95


@pytest.mark.parametrize("kind, steps", [("replace", 1), ("replace", 2), ("shuffle", 2),
                                         ("copy", 1)])
@pytest.mark.slow
def test_ancestral_sampler_matches_the_closed_form(kind, steps):
  # One compiled program per spec serves every kind (the kind is the denoiser's params).
  # 4 binomial standard errors at the exact value, 3,000 rows.
  n, m, rows = 3, 5, 3000
  params = lists.Params(kind=kind, n=n, m=m)
  canvas = np.array(lists.sample_data(jax.random.key(0), rows, params))
  canvas[:, n:] = params.mask_id
  out = sampling.sample(lists.shared_denoiser(n, m), np.int32(params.kind_code),
                        jax.random.key(steps), canvas, sampling.AncestralSpec(steps=steps))
  measured = lists.checks(out.tokens_BxL, params)["valid"].mean()
  exact = float(lists.ancestral_valid_probability(kind, n, steps))
  assert abs(measured - exact) <= 4 * math.sqrt(exact * (1 - exact) / rows) + 1e-12
