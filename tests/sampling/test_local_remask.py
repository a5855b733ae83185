"""Localized remasking (PURE-style): windows, fixed positions, repairs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import sampling
from mdjax.sampling.families import local_remask
from mdjax.tasks import scan_and_add as sa
from tests import stubs
from tests.sampling.common import LENGTH, PROMPT, VOCAB, prompted_canvas

N = 20_000


def test_windows_around_seeds():
  seeds = np.zeros((2, 10), bool)
  seeds[0, [0, 6]] = True
  seeds[1, 9] = True
  got = np.asarray(local_remask.windows_around(jnp.asarray(seeds), 1))
  want = np.zeros((2, 10), bool)
  want[0, [0, 1, 5, 6, 7]] = True
  want[1, [8, 9]] = True
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(local_remask.windows_around(jnp.asarray(seeds), 0), seeds)


@pytest.mark.parametrize("refill", [sampling.ConfidenceSpec(steps=3), sampling.AncestralSpec(
    steps=4), sampling.RemaskSpec(steps=4, eta=0.3), sampling.DeferSpec(steps=3)],
                         ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("window,context_fraction", [(0, 0.0), (2, 0.5)])
@pytest.mark.slow
def test_local_remask_keeps_fixed_positions_and_fills_the_canvas(refill, window,
                                                                  context_fraction):
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = prompted_canvas(8)
  spec = sampling.LocalRemaskSpec(base=sampling.ConfidenceSpec(steps=4), refill=refill,
                                  rounds=3, seeds=2, window=window,
                                  context_fraction=context_fraction, score_groups=3)
  out = sampling.sample(stubs.stub_denoiser, params, jax.random.key(7), tokens, spec)
  final = np.asarray(out.tokens_BxL)
  assert not np.any(final == VOCAB), "no mask remains"
  np.testing.assert_array_equal(final[:, :PROMPT], np.asarray(tokens)[:, :PROMPT])
  assert np.all(np.asarray(out.write_step_BxL)[:, :PROMPT] == -1)
  # Each round remasks at least the seeds, all editable.
  assert np.all(np.asarray(out.reopened_B) >= 3 * 2)


@pytest.mark.slow
def test_local_remask_repairs_scan_and_add():
  # From a confidence fill at T = 10 (correct about 0.1 with the exact denoiser), rounds
  # of remasking and refilling raise correctness. 1000 samples: the binomial s.e. is at
  # most 0.016, and the gain asserted is at least 0.2.
  canvas = sa.empty_canvas(1000)
  base = sampling.ConfidenceSpec(steps=10)
  plain = sampling.sample(sa.exact_denoiser, None, jax.random.key(0), canvas, base)
  spec = sampling.LocalRemaskSpec(base=base, refill=sampling.ConfidenceSpec(steps=3), rounds=3)
  repaired = sampling.sample(sa.exact_denoiser, None, jax.random.key(0), canvas, spec)
  before = sa.sample_metrics(np.asarray(plain.tokens_BxL))["correct"]
  after = sa.sample_metrics(np.asarray(repaired.tokens_BxL))["correct"]
  assert after > before + 0.2, (before, after)
  assert int(repaired.nfe) == 10 + 3 * (1 + 3)


@pytest.mark.parametrize("make,match", [
    (lambda: sampling.LocalRemaskSpec(base=sampling.SpeculativeSpec(k=2),
                                      refill=sampling.ConfidenceSpec(steps=2)),
     "base='SpeculativeSpec'"),
    (lambda: sampling.LocalRemaskSpec(base=sampling.ConfidenceSpec(steps=2),
                                      refill=sampling.ConfidenceSpec(steps=2, block_length=2)),
     "refill.block_length=2"),
    (lambda: sampling.LocalRemaskSpec(base=sampling.ConfidenceSpec(steps=2),
                                      refill=sampling.ConfidenceSpec(steps=2), window=-1),
     "window=-1"),
    (lambda: sampling.LocalRemaskSpec(base=sampling.ConfidenceSpec(steps=2),
                                      refill=sampling.ConfidenceSpec(steps=2),
                                      context_fraction=2.0), "context_fraction=2.0"),
])
def test_bad_specs_raise_clear_errors(make, match):
  with pytest.raises(ValueError, match=match):
    make()
