"""The entropy-bounded sampler: the prefix rule, and what it does on known joints."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import sampling
from mdjax.sampling.families import entropy_bounded
from mdjax.tasks import two_color

N = 20_000


def _binomial_tol(p: float, n: int) -> float:
  """4 standard errors of a binomial frequency."""
  return 4.0 * math.sqrt(p * (1 - p) / n)


def _prefix_counts_np(entropy, cand, gamma):
  """Reference: sort candidates by (entropy, position), grow the prefix while
  sum - max <= gamma."""
  counts = []
  for h, c in zip(entropy, cand):
    order = [i for i in np.lexsort((np.arange(len(h)), h)) if c[i]]
    k = 0
    for j in range(len(order)):
      chosen = h[order[:j + 1]]
      if chosen.sum() - chosen.max() <= gamma:
        k = j + 1
      else:
        break
    counts.append(k)
  return np.array(counts)


@pytest.mark.parametrize("gamma", [0.0, 0.3, 1.0, 5.0])
def test_prefix_counts_match_the_definition(gamma):
  rng = np.random.default_rng(0)
  entropy = np.round(rng.exponential(0.5, size=(64, 16)) * 4) / 4  # ties included
  cand = rng.random((64, 16)) < 0.7
  got = entropy_bounded.entropy_prefix_counts(jnp.asarray(entropy, jnp.float32),
                                              jnp.asarray(cand), gamma)
  np.testing.assert_array_equal(got, _prefix_counts_np(entropy, cand, gamma))


def _two_color_invalid(gamma: float) -> float:
  out = sampling.sample(two_color.exact_denoiser, None, jax.random.key(0),
                        two_color.empty_canvas(N), sampling.EntropyBoundedSpec(steps=2,
                                                                               gamma=gamma))
  assert not np.any(np.asarray(out.tokens_BxL) == two_color.MASK_ID)
  return float(two_color.invalid_fraction(out.tokens_BxL))


def test_two_color_below_ln2_never_writes_the_pair_together():
  # Both positions have entropy ln 2; the second joins the first only if ln 2 <= gamma.
  assert _two_color_invalid(0.6) == 0.0


def test_two_color_above_ln2_writes_the_pair_together():
  # Then both values are drawn independently: mismatched half the time.
  frac = _two_color_invalid(0.7)
  assert abs(frac - 0.5) < _binomial_tol(0.5, N), frac


def test_zero_gamma_writes_one_position_a_step_on_uncertain_positions():
  # Every position of the two-color canvas has positive entropy at the start; after
  # one is written the other is certain (entropy 0), so gamma = 0 still writes it next.
  out = sampling.sample(two_color.exact_denoiser, None, jax.random.key(1),
                        two_color.empty_canvas(64), sampling.EntropyBoundedSpec(steps=2,
                                                                                gamma=0.0))
  write_step = np.asarray(out.write_step_BxL)
  assert np.all(np.sort(write_step, axis=1) == [0, 1])
  assert np.all(np.asarray(out.rounds_B) == 2)


def test_rows_stop_calling_when_their_canvas_is_full():
  # gamma large: every row fills in one step; the other steps are skipped.
  out = sampling.sample(two_color.exact_denoiser, None, jax.random.key(2),
                        two_color.empty_canvas(8), sampling.EntropyBoundedSpec(steps=5,
                                                                               gamma=10.0))
  assert int(out.nfe) == 1 and int(out.saved_calls) == 4
  assert np.all(np.asarray(out.rounds_B) == 1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(steps=4, gamma=-0.1), "gamma=-0.1"),
    (dict(steps=0), "steps=0"),
    (dict(steps=4, final_temperature=0.0), "final_temperature=0.0"),
    (dict(steps=4, temperature=0.0, final_temperature=0.5), "final_temperature=0.5"),
    (dict(steps=4, block_length=0), "block_length=0"),
])
def test_bad_specs(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sampling.EntropyBoundedSpec(**kwargs)
