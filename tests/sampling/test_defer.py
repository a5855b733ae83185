"""Test-and-defer (PUNT-style): what it defers on known joints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import sampling
from mdjax.sampling.families import defer
from mdjax.tasks import two_color
from tests import stubs
from tests.sampling.common import LENGTH, PROMPT, VOCAB, binomial_tol, prompted_canvas

N = 20_000


def _product_denoiser(params, tokens_BxL, t_B):
  """The exact denoiser of a product law: per-position logits that ignore the canvas."""
  del t_B
  return jnp.broadcast_to(params["pos"][None], tokens_BxL.shape + (VOCAB,))


def test_defer_threshold_zero_defers_nothing_on_a_product_law():
  params = stubs.stub_params(VOCAB, LENGTH)
  out = sampling.sample(_product_denoiser, params, jax.random.key(0), prompted_canvas(8),
                        sampling.DeferSpec(steps=4, threshold=0.0))
  write_step = np.asarray(out.write_step_BxL)
  assert np.all(write_step[:, PROMPT:] == 0), "every proposal commits at the first step"
  assert np.all(write_step[:, :PROMPT] == -1)


def test_defer_on_two_color_defers_the_dependent_position():
  # Anchoring one position moves the other's distribution from (1/2, 1/2) to a point mass:
  # total variation 1/2. Below 1/2 it is deferred, then copied: never a mismatched pair.
  below = sampling.sample(two_color.exact_denoiser, None, jax.random.key(0),
                          two_color.empty_canvas(N), sampling.DeferSpec(steps=2, threshold=0.4))
  assert float(two_color.invalid_fraction(below.tokens_BxL)) == 0.0
  # Above 1/2 both proposals commit at once: independent draws, mismatched half the time.
  above = sampling.sample(two_color.exact_denoiser, None, jax.random.key(0),
                          two_color.empty_canvas(N), sampling.DeferSpec(steps=2, threshold=0.6))
  frac = float(two_color.invalid_fraction(above.tokens_BxL))
  assert abs(frac - 0.5) < binomial_tol(0.5, N), frac
  # Calls: the first step evaluates the canvas and one batched test context (J = 1 for
  # L = 2); the last step only the canvas.
  assert int(below.nfe) == 3 and int(below.contexts_B[0]) == 3
  assert int(above.nfe) == 2  # the row is full after step 1; step 2's call is skipped


def test_defer_levels_and_batched_test_call():
  np.testing.assert_array_equal(defer.levels(jnp.array([0, 1, 2, 3, 4, 7, 8, 15, 16])),
                                [-1, 0, 1, 1, 2, 2, 3, 3, 4])
  assert [defer.num_levels(n) for n in (1, 2, 3, 4, 5, 25, 64)] == [1, 1, 2, 2, 3, 5, 6]
  params = stubs.stub_params(VOCAB, LENGTH)
  spec = sampling.DeferSpec(steps=5, threshold=0.05)
  out = sampling.sample(stubs.stub_denoiser, params, jax.random.key(1), prompted_canvas(8), spec)
  assert not np.any(np.asarray(out.tokens_BxL) == VOCAB)
  calls_per_step = 1 + defer.num_levels(LENGTH)
  assert int(out.contexts_B.max()) <= spec.steps * calls_per_step
  assert int(out.nfe) <= 2 * spec.steps - 1


@pytest.mark.parametrize("make,match", [
    (lambda: sampling.DeferSpec(steps=4, threshold=1.5), "threshold=1.5"),
    (lambda: sampling.DeferSpec(steps=0), "steps=0"),
])
def test_bad_specs_raise_clear_errors(make, match):
  with pytest.raises(ValueError, match=match):
    make()
