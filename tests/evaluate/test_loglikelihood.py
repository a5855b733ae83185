"""mdjax.evaluate.loglikelihood: the estimators on two-color's exact law, bad input, batches."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import evaluate, tasks
from mdjax.denoiser import Denoiser

TWO_COLOR = tasks.get("two_color")


@pytest.mark.parametrize("estimator", evaluate.ESTIMATORS)
@pytest.mark.slow
def test_exact_denoiser_within_four_standard_errors(estimator):
  """Whole sequences: log p = -ln 2; the second token given the first: log p = 0.

  Why 4 standard errors is safe at 64 draws: with the exact denoiser a draw is -2 ln 2 times
  its weight when both tokens are masked and 0 otherwise (a lone masked token is copied from
  the other). iid: the count is 1 or 2 with weight 2 or 1, so a draw is 0 or -2 ln 2 w.p. 1/2
  each: sd ln 2, and the mean of 64 is off by 4 sd with probability < 1e-4. stratified: 64
  counts alternate 1, 2 exactly, so the estimate is exact. antithetic: both masked w.p. p^2
  with weight (1 - eps)/p, second moment 4 ln^2 2 (1 - eps)^2, sd about sqrt(3) ln 2; its bias
  (eps^2 ln 2) is far below one standard error. The returned stderr estimates these sds over
  sqrt(64); the seed is fixed, so the check is deterministic.
  """
  x_Bx2 = np.array([[0, 0], [1, 1]])
  whole = evaluate.loglikelihood(TWO_COLOR.exact_denoiser, None, x_Bx2[:, :0], x_Bx2,
                                 estimator=estimator, num_samples=64, batch_size=16,
                                 key=jax.random.key(0), mask_id=TWO_COLOR.mask_id)
  assert np.all(np.abs(whole.estimate_B + math.log(2.0)) <= 4 * whole.stderr_B)
  assert np.all(whole.stderr_B > 0)
  half = evaluate.loglikelihood(TWO_COLOR.exact_denoiser, None, x_Bx2[:, :1], x_Bx2[:, 1:],
                                estimator=estimator, num_samples=8, batch_size=8,
                                key=jax.random.key(1), mask_id=TWO_COLOR.mask_id)
  np.testing.assert_array_equal(half.estimate_B, 0.0)


def _stub(table_VxV, tokens_BxL, t_B):
  """A denoiser whose logits depend on every earlier token and on t."""
  return jnp.cumsum(table_VxV[tokens_BxL], axis=1) + t_B[:, None, None]


@pytest.mark.slow
def test_batch_equals_its_rows():
  table = jax.random.normal(jax.random.key(0), (5, 4))
  ctx_Bx3 = np.array([[0, 1, 2], [3, 3, 0], [2, 1, 1]])
  cont_Bx4 = np.array([[1, 2, 3, 0], [0, 0, 1, 2], [3, 2, 1, 0]])
  for estimator, cfg in (("stratified", 0.0), ("antithetic", 0.5), ("iid", 0.0)):
    kwargs = dict(estimator=estimator, num_samples=8, batch_size=4, key=jax.random.key(3),
                  mask_id=4, cfg_scale=cfg)
    batch = evaluate.loglikelihood(_stub, table, ctx_Bx3, cont_Bx4, **kwargs)
    rows = [evaluate.loglikelihood(_stub, table, ctx_Bx3[b:b + 1], cont_Bx4[b:b + 1], **kwargs)
            for b in range(3)]
    np.testing.assert_allclose(batch.estimate_B, [r.estimate_B[0] for r in rows], rtol=1e-5)
    np.testing.assert_allclose(batch.stderr_B, [r.stderr_B[0] for r in rows], rtol=1e-5)
    assert np.all(batch.estimate_B < 0)


@pytest.mark.parametrize("change, message", [
    (dict(continuation_BxT=np.zeros((2, 0), int)), "empty continuation"),
    (dict(estimator="exact"), r"known estimators: \['stratified', 'antithetic', 'iid'\]"),
    (dict(num_samples=6), "multiple of batch_size=4"),
    (dict(max_len=3), "exceed the denoiser's max_len=3"),
    (dict(context_BxC=np.zeros((3, 1), int)), "context_BxC has shape"),
])
def test_bad_input(change, message):
  args = dict(context_BxC=np.zeros((2, 1), int), continuation_BxT=np.zeros((2, 3), int),
              estimator="iid", num_samples=8, batch_size=4, key=jax.random.key(0), mask_id=4)
  args.update(change)
  with pytest.raises(ValueError, match=message):
    evaluate.loglikelihood(_stub, None, **args)


def test_the_denoisers_max_len_bounds_context_and_continuation():
  """A `Denoiser` carrying max_len (a `Model`'s does) bounds C + T without max_len=."""
  bounded = Denoiser(_stub, max_len=3)
  with pytest.raises(ValueError, match="exceed the denoiser's max_len=3"):
    evaluate.loglikelihood(bounded, None, np.zeros((2, 1), int), np.zeros((2, 3), int),
                           estimator="iid", num_samples=8, batch_size=4, key=jax.random.key(0),
                           mask_id=4)


def test_guidance_keeps_the_mask_logit_out():
  """A model that sets its mask logit to -inf (the stub's last column) gives finite guided
  estimates: the guidance rule's -inf - -inf is NaN unless that column stays -inf."""

  def masked_out(table_VxV, tokens_BxL, t_B):
    return _stub(table_VxV, tokens_BxL, t_B).at[..., -1].set(-jnp.inf)

  table = jax.random.normal(jax.random.key(0), (5, 5))
  out = evaluate.loglikelihood(masked_out, table, np.array([[0, 1]]), np.array([[2, 3]]),
                               estimator="stratified", num_samples=4, batch_size=4,
                               key=jax.random.key(1), mask_id=4, cfg_scale=0.5)
  assert np.all(np.isfinite(out.estimate_B)) and np.all(out.estimate_B < 0)
