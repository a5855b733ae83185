"""Tests of the diffusion core: schedules, forward masking, NELBO and MLM."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import diffusion
from mdjax.tasks import two_color

SCHEDULES = [
    diffusion.LinearSchedule(),
    diffusion.CosineSchedule(),
    diffusion.PolynomialSchedule(power=3.0),
    diffusion.PolynomialSchedule(power=0.5),
    diffusion.LogLinearSchedule(),
    diffusion.CosineSchedule(eps=1e-2),
]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_schedule_endpoints_and_monotone(schedule):
  t = jnp.linspace(0.0, 1.0, 101)
  alpha = np.asarray(schedule.alpha(t))
  np.testing.assert_allclose(alpha[0], 1.0, atol=1e-7)
  np.testing.assert_allclose(alpha[-1], schedule.eps, atol=1e-6)
  assert np.all(np.diff(alpha) <= 1e-7)


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_weight_matches_finite_difference(schedule):
  with jax.enable_x64(True):
    t = jnp.linspace(0.02, 0.98, 49, dtype=jnp.float64)
    h = 1e-6
    dalpha_fd = (schedule.alpha(t + h) - schedule.alpha(t - h)) / (2 * h)
    weight_fd = -dalpha_fd / schedule.one_minus_alpha(t)
    np.testing.assert_allclose(schedule.dalpha(t), dalpha_fd, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(schedule.weight(t), weight_fd, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_weight_finite_and_nonnegative_near_both_ends(schedule):
  t = jnp.array([1e-7, 1e-5, 1e-3, 0.5, 1 - 1e-3, 1 - 1e-6, 1.0], jnp.float32)
  weight = np.asarray(schedule.weight(t))
  assert np.all(np.isfinite(weight)), weight
  assert np.all(weight >= 0.0), weight
  # Grad of the weight stays finite too (the loss is differentiated through t).
  grads = jax.vmap(jax.grad(schedule.weight))(t[1:-1])
  assert np.all(np.isfinite(np.asarray(grads)))


def test_unknown_schedule_lists_known_ones():
  with pytest.raises(ValueError, match="known schedules.*cosine.*linear"):
    diffusion.get_schedule("poly3")
  assert diffusion.get_schedule("polynomial", power=3).power == 3


def test_forward_mask_fraction_and_maskable():
  batch, length, mask_id = 64, 512, 7
  key_x, key_m = jax.random.split(jax.random.key(0))
  x_BxL = jax.random.randint(key_x, (batch, length), 0, mask_id)
  alpha_B = jnp.linspace(0.0, 1.0, batch)
  maskable_BxL = jnp.arange(length)[None, :] >= 100  # a 100-token prompt
  z_BxL = diffusion.forward_mask(key_m, x_BxL, alpha_B, mask_id, maskable_BxL)
  z, x = np.asarray(z_BxL), np.asarray(x_BxL)
  np.testing.assert_array_equal(z[:, :100], x[:, :100])
  masked = (z[:, 100:] == mask_id)
  assert np.all((z == x) | (z == mask_id))
  # Per row, the masked count is Binomial(412, 1 - alpha): 4 standard errors.
  n = length - 100
  p = 1.0 - np.asarray(alpha_B)
  tol = 4.0 * np.sqrt(n * p * (1 - p)) + 1e-9
  np.testing.assert_array_less(np.abs(masked.sum(1) - n * p), tol + 1e-6)
  # Pooled over all rows the fraction is tight: 4 standard errors of the mean.
  pooled_se = np.sqrt((p * (1 - p)).sum() * n) / (batch * n)
  assert abs(masked.mean() - p.mean()) < 4 * pooled_se


# Every (denoiser, schedule, num_steps) the NELBO tests below estimate.
_NELBO_CASES = (
    [(two_color.exact_denoiser, schedule, 0) for schedule in SCHEDULES]
    + [(two_color.uniform_denoiser, schedule, 0) for schedule in SCHEDULES[:3]]
    + [(two_color.exact_denoiser, diffusion.LinearSchedule(), steps) for steps in (1, 2, 4, 16, 64)])


@functools.cache
def _oracle_nelbos(batch=200_000, seed=0):
  """Per case: the mean NELBO of `batch` two-color sequences and its standard error.

  All cases in one compiled program: compiling is most of the cost, and one program of
  14 losses compiles several times faster than 14 programs. Every case sees the same data
  and key, as separate calls with the same seed would.
  """
  x_BxL = two_color.sample_data(jax.random.key(seed), batch)

  def losses(key, x_BxL):
    return [diffusion.nelbo_loss(denoiser, None, key, x_BxL, schedule=schedule,
                                 mask_id=two_color.MASK_ID, num_steps=steps)[1]["nelbo_nats_B"]
            for denoiser, schedule, steps in _NELBO_CASES]

  out = {}
  for case, nelbo_B in zip(_NELBO_CASES, jax.jit(losses)(jax.random.key(seed + 1), x_BxL)):
    nelbo_B = np.asarray(nelbo_B, np.float64)
    out[case] = nelbo_B.mean(), nelbo_B.std() / np.sqrt(batch)
  return out


def _oracle_nelbo(schedule, denoiser, *, num_steps=0):
  return _oracle_nelbos()[denoiser, schedule, num_steps]


def _two_color_nelbo_theory(schedule):
  # With the exact denoiser only "both masked" costs, 2 ln 2 at rate w(t):
  # int w (1-a)^2 2 ln2 dt = 2 ln2 int_{a(1)}^{a(0)} (1 - a) da.
  a0, a1 = float(schedule.alpha(0.0)), float(schedule.alpha(1.0))
  return 2 * math.log(2) * ((a0 - a0**2 / 2) - (a1 - a1**2 / 2))


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
@pytest.mark.slow
def test_elbo_is_tight_for_exact_denoiser(schedule):
  mean, stderr = _oracle_nelbo(schedule, two_color.exact_denoiser)
  theory = _two_color_nelbo_theory(schedule)
  if schedule.eps == 0.0:
    assert theory == pytest.approx(two_color.ENTROPY_NATS)
  # 4 Monte Carlo standard errors of the batch mean.
  assert abs(mean - theory) < 4 * stderr, (mean, stderr, theory)


@pytest.mark.parametrize("schedule", SCHEDULES[:3], ids=repr)
@pytest.mark.slow
def test_uniform_denoiser_nelbo_is_strictly_larger(schedule):
  mean, stderr = _oracle_nelbo(schedule, two_color.uniform_denoiser)
  # Uniform: every masked token costs ln 2, so the NELBO is 2 ln 2 exactly.
  assert abs(mean - 2 * math.log(2)) < 4 * stderr
  assert mean - 4 * stderr > two_color.ENTROPY_NATS


@pytest.mark.slow
def test_discrete_time_nelbo_upper_bounds_and_converges():
  # Linear schedule, exact denoiser: sum_i (a_s - a_t)(1 - a_t) 2 ln 2
  # = ln 2 (T + 1) / T, which is >= ln 2 and decreases to it.
  schedule = diffusion.LinearSchedule()
  means = []
  for steps in (1, 2, 4, 16, 64):
    mean, stderr = _oracle_nelbo(schedule, two_color.exact_denoiser, num_steps=steps)
    theory = math.log(2) * (steps + 1) / steps
    # 4 standard errors, plus float32 rounding (T = 1 has zero variance).
    assert abs(mean - theory) < 4 * stderr + 1e-6, (steps, mean, stderr, theory)
    assert mean + 4 * stderr >= math.log(2)
    means.append(mean)
  assert means[0] > means[2] > means[-1]
  assert abs(means[-1] - math.log(2)) < 0.03


def test_aux_bits_per_token_and_masked_fraction():
  x_BxL = two_color.sample_data(jax.random.key(3), 50_000)
  loss, aux = diffusion.nelbo_loss(
      two_color.exact_denoiser, None, jax.random.key(4), x_BxL,
      schedule=diffusion.LinearSchedule(), mask_id=two_color.MASK_ID,
  )
  np.testing.assert_allclose(aux["bits_per_token"], loss / 2 / math.log(2), rtol=1e-5)
  # Stratified t ~ U[0, 1] with the linear schedule: E[masked fraction] = 1/2.
  assert abs(float(aux["masked_fraction"]) - 0.5) < 0.01


def _tiny_model_params(key, vocab_size, length, dim=16):
  k1, k2, k3 = jax.random.split(key, 3)
  return {
      "embed": jax.random.normal(k1, (vocab_size + 1, dim)) * 0.1,
      "pos": jax.random.normal(k2, (length, dim)) * 0.1,
      "out": jax.random.normal(k3, (dim, vocab_size)) * 0.1,
  }


def _tiny_model_apply(params, tokens_BxL, t_B):
  h_BxLxD = params["embed"][tokens_BxL] + params["pos"][None]
  h_BxLxD = h_BxLxD + jnp.tanh(h_BxLxD.mean(axis=1, keepdims=True)) + t_B[:, None, None]
  return h_BxLxD @ params["out"]


class LossVariantsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_nelbo_gradients_finite_and_jit_agrees(self):
    vocab, length, mask_id = 5, 8, 5
    params = _tiny_model_params(jax.random.key(0), vocab, length)
    x_BxL = jax.random.randint(jax.random.key(1), (16, length), 0, vocab)
    for num_steps in (0, 4):
      loss_fn = functools.partial(
          diffusion.nelbo_loss, _tiny_model_apply, schedule=diffusion.CosineSchedule(),
          mask_id=mask_id, num_steps=num_steps,
      )
      grad_fn = self.variant(jax.value_and_grad(loss_fn, has_aux=True))
      (loss, aux), grads = grad_fn(params, jax.random.key(2), x_BxL)
      (loss_ref, _), grads_ref = jax.value_and_grad(loss_fn, has_aux=True)(
          params, jax.random.key(2), x_BxL)
      assert np.isfinite(float(loss)) and float(loss) >= 0.0
      for leaf in jax.tree.leaves(grads):
        assert np.all(np.isfinite(np.asarray(leaf)))
      np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
      chex.assert_trees_all_close(grads, grads_ref, rtol=1e-4, atol=1e-6)
      assert 0.0 <= float(aux["masked_fraction"]) <= 1.0

  @chex.variants(with_jit=True, without_jit=True)
  def test_mlm_gradients_finite(self):
    vocab, length, mask_id = 5, 8, 5
    params = _tiny_model_params(jax.random.key(0), vocab, length)
    x_BxL = jax.random.randint(jax.random.key(1), (16, length), 0, vocab)
    loss_fn = functools.partial(
        diffusion.mlm_loss, _tiny_model_apply, vocab_size=vocab, mask_id=mask_id)
    (loss, _), grads = self.variant(jax.value_and_grad(loss_fn, has_aux=True))(
        params, jax.random.key(2), x_BxL)
    assert np.isfinite(float(loss)) and float(loss) > 0.0
    for leaf in jax.tree.leaves(grads):
      assert np.all(np.isfinite(np.asarray(leaf)))


def test_mlm_corruption_proportions():
  batch, length, vocab, mask_id = 4000, 64, 50, 50
  x_BxL = jax.random.randint(jax.random.key(0), (batch, length), 0, vocab)
  maskable_BxL = jnp.broadcast_to(jnp.arange(length) >= 4, (batch, length))
  corruption = diffusion.MlmCorruption()
  z_BxL, sel_BxL = diffusion.mlm_corrupt(
      jax.random.key(1), x_BxL, vocab_size=vocab, mask_id=mask_id,
      corruption=corruption, maskable_BxL=maskable_BxL)
  z, x, sel = map(np.asarray, (z_BxL, x_BxL, sel_BxL))
  assert not sel[:, :4].any() and np.array_equal(z[:, :4], x[:, :4])
  assert np.array_equal(z[~sel], x[~sel])  # unselected positions untouched
  full = sel[:, 4:].all(1) & (z[:, 4:] == mask_id).all(1)
  # E[selected fraction] = 0.1 * 1 + 0.9 * 1/2 = 0.55.
  frac = sel[:, 4:].mean()
  assert abs(frac - 0.55) < 0.02
  # Fully masked examples: Binomial(4000, 0.1) (plus tiny chance r ~ 1): 4 s.e.
  assert abs(full.mean() - 0.1) < 4 * math.sqrt(0.1 * 0.9 / batch) + 1e-3
  # Among selected positions of partially masked rows: random tokens are
  # 0.5 * 0.1 = 5% (a random token equal to x counts as unchanged: * 49/50),
  # unchanged 10% (+ 5% / 50). Eligibility is per row, so positions of a row
  # are correlated: use the cluster (per-row) standard error of a ratio.
  rows = ~full
  sel_r, z_r, x_r = sel[rows], z[rows], x[rows]
  n_r = sel_r.sum(1)

  def ratio_and_cluster_se(hits_r):
    ratio = hits_r.sum() / n_r.sum()
    return ratio, np.sqrt(((hits_r - ratio * n_r) ** 2).sum()) / n_r.sum()

  rand_r = ((z_r != x_r) & (z_r != mask_id) & sel_r).sum(1)
  keep_r = ((z_r == x_r) & sel_r).sum(1)
  ratio, se = ratio_and_cluster_se(rand_r)
  assert abs(ratio - 0.05 * 49 / 50) < 4 * se, (ratio, se)
  ratio, se = ratio_and_cluster_se(keep_r)
  assert abs(ratio - (0.1 + 0.05 / 50)) < 4 * se, (ratio, se)


@pytest.mark.parametrize("low_ratio_prob", [0.0, 0.5, 1.0])
@pytest.mark.slow
def test_mlm_low_ratio_mixture_mean(low_ratio_prob):
  # r ~ U[0, 1] with prob 1 - p, U[0, 0.3] with prob p: E[selected fraction] =
  # (1 - p) / 2 + p * 0.15. Rows are independent, so 4 standard errors of the
  # mean of the per-row fractions bound the deviation.
  batch, length = 4000, 60
  corruption = diffusion.MlmCorruption(full_mask_prob=0.0, low_ratio_prob=low_ratio_prob,
                                       low_ratio_max=0.3)
  x_BxL = jnp.zeros((batch, length), jnp.int32)
  _, sel_BxL = diffusion.mlm_corrupt(jax.random.key(3), x_BxL, vocab_size=10, mask_id=10,
                                     corruption=corruption)
  frac_B = np.asarray(sel_BxL).mean(1)
  expected = (1 - low_ratio_prob) * 0.5 + low_ratio_prob * 0.15
  assert abs(frac_B.mean() - expected) < 4 * frac_B.std() / math.sqrt(batch), frac_B.mean()
  if low_ratio_prob == 1.0:
    # No row selects far above 0.3: 0.3 plus 4 binomial s.e. of 60 positions.
    assert frac_B.max() < 0.3 + 4 * math.sqrt(0.3 * 0.7 / length)


def test_mlm_default_draws_do_not_change_with_the_low_ratio_knob_off():
  # The low-ratio choice has its own stream: the default objective's draws are the same
  # whatever low_ratio_max is when low_ratio_prob = 0.
  x_BxL = jnp.zeros((64, 20), jnp.int32)
  a = diffusion.mlm_corrupt(jax.random.key(0), x_BxL, vocab_size=10, mask_id=10)
  b = diffusion.mlm_corrupt(jax.random.key(0), x_BxL, vocab_size=10, mask_id=10,
                            corruption=diffusion.MlmCorruption(low_ratio_max=0.01))
  np.testing.assert_array_equal(a[1], b[1])
