"""Direct revision (D3IM-style): keep_visible is confidence decoding; visible tokens change."""

import jax
import numpy as np
import pytest

from mdjax import sampling
from mdjax.tasks import scan_and_add as sa
from mdjax.tasks import two_color
from tests import stubs
from tests.sampling.common import LENGTH, PROMPT, VOCAB, binomial_tol, prompted_canvas

N = 20_000


@pytest.mark.parametrize("score", ["max_prob", "prob", "margin", "random"])
@pytest.mark.slow
def test_revision_keeping_visible_tokens_is_confidence_decoding(score):
  params = stubs.stub_params(VOCAB, LENGTH, quantum=0.5)  # ties included
  tokens = prompted_canvas(16)
  for steps in (3, 8):
    conf = sampling.sample(stubs.stub_denoiser, params, jax.random.key(4), tokens,
                           sampling.ConfidenceSpec(steps=steps, score=score))
    rev = sampling.sample(stubs.stub_denoiser, params, jax.random.key(4), tokens,
                          sampling.RevisionSpec(steps=steps, score=score, keep_visible=True))
    np.testing.assert_array_equal(rev.tokens_BxL, conf.tokens_BxL)
    np.testing.assert_array_equal(rev.write_step_BxL, conf.write_step_BxL)
    assert int(np.asarray(rev.extras["changes_KxB"]).sum()) == 0


@pytest.mark.slow
def test_revision_keeping_visible_tokens_on_the_scan_and_add_oracle():
  canvas = sa.empty_canvas(500)
  for steps in (10, 25):
    conf = sampling.sample(sa.exact_denoiser, None, jax.random.key(2), canvas,
                           sampling.ConfidenceSpec(steps=steps))
    rev = sampling.sample(sa.exact_denoiser, None, jax.random.key(2), canvas,
                          sampling.RevisionSpec(steps=steps, keep_visible=True))
    np.testing.assert_array_equal(rev.tokens_BxL, conf.tokens_BxL)


def test_revision_changes_visible_tokens_and_records_it():
  # Two-color, 2 steps: step 2 redraws the visible position from the oracle (uniform, as
  # the other is masked) while the masked one copies the old value: a change and a
  # mismatch each with probability 1/2.
  out = sampling.sample(two_color.exact_denoiser, None, jax.random.key(3),
                        two_color.empty_canvas(N), sampling.RevisionSpec(steps=2))
  changes = np.asarray(out.extras["changes_KxB"])
  assert changes.shape == (2, N) and np.all(changes[0] == 0)
  assert abs(changes[1].mean() - 0.5) < binomial_tol(0.5, N)
  frac = float(two_color.invalid_fraction(out.tokens_BxL))
  assert abs(frac - 0.5) < binomial_tol(0.5, N)
  # Changed tokens get the step of their new value.
  assert np.all(np.asarray(out.write_step_BxL)[changes[1] == 1].max(-1) == 1)


def test_revision_with_leave_group_out_scores_fills_the_canvas():
  params = stubs.stub_params(VOCAB, LENGTH)
  spec = sampling.RevisionSpec(steps=6, score_groups=3)
  out = sampling.sample(stubs.stub_denoiser, params, jax.random.key(1), prompted_canvas(8), spec)
  final = np.asarray(out.tokens_BxL)
  assert not np.any(final == VOCAB)
  np.testing.assert_array_equal(final[:, :PROMPT], np.asarray(prompted_canvas(8))[:, :PROMPT])
  # Steps after the first evaluate the canvas and 3 leave-group-out contexts.
  assert int(out.contexts_B[0]) == 6 + 5 * 3 and int(out.nfe) == 6 + 5


@pytest.mark.parametrize("make,match", [
    (lambda: sampling.RevisionSpec(steps=4, score_groups=-1), "score_groups=-1"),
    (lambda: sampling.RevisionSpec(steps=4, score="best"), "score='best'"),
])
def test_bad_specs_raise_clear_errors(make, match):
  with pytest.raises(ValueError, match=match):
    make()
