"""Value transforms and categorical draws."""

import jax
import jax.numpy as jnp
import numpy as np

from mdjax import sampling
from mdjax.sampling import transforms
from tests import stubs
from tests.sampling.common import (LENGTH, PROMPT, VOCAB, binomial_tol,
                                   prompted_canvas)


def test_draws_follow_the_transformed_categorical():
  # One position, V = 4, n draws: each frequency within 4 binomial s.e.
  n = 40_000
  logits = jnp.log(jnp.array([0.5, 0.25, 0.15, 0.1]))
  logits_BxLxV = jnp.broadcast_to(logits, (n, 1, 4))
  keys = jax.random.split(jax.random.key(0), n)
  cases = {  # (temperature, top_k, top_p, min_p): expected law
      (1.0, None, 1.0, 0.0): np.array([0.5, 0.25, 0.15, 0.1]),
      (1.0, 2, 1.0, 0.0): np.array([2 / 3, 1 / 3, 0, 0]),
      (1.0, None, 0.7, 0.0): np.array([2 / 3, 1 / 3, 0, 0]),  # 0.5 < 0.7 <= 0.75
      (0.5, None, 1.0, 0.0): np.array([0.25, 0.0625, 0.0225, 0.01]) / 0.345,
      (1.0, None, 1.0, 0.25): np.array([0.5, 0.25, 0.15, 0]) / 0.9,  # keep p >= 0.125
      (1.0, None, 1.0, 1.0): np.array([1.0, 0, 0, 0]),  # min-p always keeps the argmax
  }
  for (temperature, top_k, top_p, min_p), expected in cases.items():
    draws = np.asarray(transforms.draw_values(
        keys, logits_BxLxV, temperature=temperature, top_k=top_k, top_p=top_p,
        min_p=min_p))[:, 0]
    freq = np.bincount(draws, minlength=4) / n
    for f, p in zip(freq, expected):
      assert abs(f - p) <= binomial_tol(p, n) + 1e-12, (temperature, top_k, top_p, min_p, freq)
  argmax = transforms.draw_values(keys, logits_BxLxV, temperature=0.0, top_k=None, top_p=1.0)
  assert np.all(np.asarray(argmax) == 0)


def test_temperature_zero_sampler_is_deterministic_across_keys():
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = prompted_canvas()
  spec = sampling.OrderedSpec.left_to_right(LENGTH, temperature=0.0)
  spec = sampling.OrderedSpec(groups=spec.groups[PROMPT:], temperature=0.0)
  a = sampling.sample(stubs.stub_denoiser, params, jax.random.key(0), tokens, spec)
  b = sampling.sample(stubs.stub_denoiser, params, jax.random.key(1), tokens, spec)
  np.testing.assert_array_equal(a.tokens_BxL, b.tokens_BxL)



def test_min_p_keeps_the_argmax_and_everything_at_zero():
  logits = jax.random.normal(jax.random.key(0), (64, 5, 11)) * 3.0
  argmax = np.asarray(jnp.argmax(logits, -1))
  for min_p in (0.01, 0.3, 0.9, 1.0):
    kept = np.isfinite(np.asarray(transforms.transform_logits(logits, 1.0, None, 1.0, min_p)))
    assert np.all(np.take_along_axis(kept, argmax[..., None], -1))
  everything = transforms.transform_logits(logits, 1.0, None, 1.0, 0.0)
  np.testing.assert_array_equal(everything, logits)

