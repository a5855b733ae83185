"""The NELBOs of uniform and hybrid noise (`noise.udlm_loss`, `noise.gidd_loss`) and MD4's,
against the papers' formulas transcribed and against an exact computation on oracle tasks."""

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from mdjax import diffusion, errors, noise, tasks
from tests.noise import reference

NAMES = ("absorbing", "uniform", "hybrid")
T_MIN = 1e-5  # the losses' default


def _random_case(vocab, batch=6, length=5, seed=0):
  rng = np.random.default_rng(seed)
  x0 = rng.integers(0, vocab, (batch, length))
  z = np.where(rng.random((batch, length)) < 0.5, x0, rng.integers(0, vocab, (batch, length)))
  w = rng.dirichlet(np.ones(vocab) * 0.7, size=(batch, length))
  t = rng.uniform(0.05, 0.95, batch)
  return x0, z, w, t


def _integrand(process, w, x0, z, t):
  """weight x divergence of `elbo_parts` at plug-in weights w."""
  post = process.posterior_from_plugin(jnp.asarray(w, jnp.float32), jnp.asarray(z), jnp.asarray(t))
  weight, divergence = noise.elbo_parts(process, post, jnp.asarray(x0), jnp.asarray(z),
                                        jnp.asarray(t))
  return np.asarray(weight * divergence)


def test_uniform_integrand_is_duos_udlm_loss():
  """`UniformState.nll_per_token` of DUO (s-sahoo/duo, algo.py), transcribed in numpy with
  x_theta the plug-in weights: the same integrand (the linear schedule: alpha' = -1)."""
  vocab = 4
  x0, z, w, t = _random_case(vocab)
  alpha = (1 - t)[:, None]
  dalpha = -np.ones_like(alpha)
  x_bar_theta = vocab * alpha[..., None] * w + 1 - alpha[..., None]
  coeff = dalpha / (vocab * alpha)
  x_eq_xt = (x0 == z).astype(float)
  x_neq_xt = 1 - x_eq_xt
  xbar_xt = (1 - alpha) + vocab * alpha * x_eq_xt
  xbar_theta_xt = np.take_along_axis(x_bar_theta, z[..., None], -1)[..., 0]
  xbar_theta_x = np.take_along_axis(x_bar_theta, x0[..., None], -1)[..., 0]
  term1 = vocab * (1 / xbar_xt - 1 / xbar_theta_xt)
  const = (1 - alpha) / (vocab * alpha + 1 - alpha)
  term2_coefs = x_eq_xt * const + x_neq_xt
  term2_offset = ((vocab - 1) * const * x_eq_xt - (1 / const) * x_neq_xt) * np.log(const)
  term2_theta = -term2_coefs * (np.log(x_bar_theta).sum(-1) - vocab * np.log(xbar_theta_xt))
  term2_theta = term2_theta - vocab * alpha / (1 - alpha) * (
      np.log(xbar_theta_x) - np.log(xbar_theta_xt)) * x_neq_xt
  duo = coeff * (term1 - (term2_theta + term2_offset))
  got = _integrand(noise.get("uniform", vocab), w, x0, z, t)
  np.testing.assert_allclose(got, duo, rtol=2e-4, atol=1e-5)


@pytest.mark.parametrize("p_uniform,gamma", [(0.1, 1.0), (0.3, 1.5)])
def test_hybrid_integrand_is_gidds_loss(p_uniform, gamma):
  """`GiddLoss` of GIDD (dvruette/gidd, gidd/loss.py), transcribed: its ELBO weights in closed
  form (on x, on a uniform token, on the mask) times KL + Itakura-Saito."""
  vocab = 4
  x0, z, w, t = _random_case(vocab + 1, seed=1)  # z may be the mask (id vocab)
  x0 = np.minimum(x0, vocab - 1)
  w = w[..., :vocab] / w[..., :vocab].sum(-1, keepdims=True)
  process = noise.Hybrid(vocab_size=vocab, p_uniform=p_uniform, gamma=gamma)
  tt = np.broadcast_to(t[:, None], z.shape)
  big_b = 2**gamma * p_uniform / (1 - p_uniform)
  c = (tt**gamma)**0.5 * ((1 - tt)**gamma)**0.5 * big_b
  dc = (gamma / 2) * (1 - 2 * tt) / (tt * (1 - tt)) * c
  is_mask, is_x = (z == vocab).astype(float), (z == x0).astype(float)
  on_x = (c + (1 - tt) * dc) / vocab / ((1 - tt) * (1 - tt + c / vocab))
  on_u = (c + (1 - tt) * dc) / ((1 - tt) * c)
  on_m = 1 / ((1 - tt) * tt)
  elbo_weights = is_x * on_x + is_mask * on_m + (1 - is_x - is_mask) * on_u

  def probs_at_t(prs):  # HybridDiffusion.probs_at_t
    a = ((1 - tt) / (1 + c))[..., None]
    noise_law = np.concatenate([np.repeat((c / (1 + c))[..., None] / vocab, vocab, -1),
                                (tt / (1 + c))[..., None] * np.ones_like(prs[..., :1])], -1)
    return a * np.concatenate([prs, np.zeros_like(prs[..., :1])], -1) + noise_law

  log_q = np.log(probs_at_t(np.eye(vocab)[x0]))
  log_p = np.log(probs_at_t(w))
  kl = (np.exp(log_q) * (log_q - log_p)).sum(-1)
  log_ratio = np.take_along_axis(log_q - log_p, z[..., None], -1)[..., 0]
  gidd = elbo_weights * (kl + np.exp(log_ratio) - log_ratio - 1)
  np.testing.assert_allclose(_integrand(process, w, x0, z, t), gidd, rtol=2e-4, atol=1e-5)


def test_gidd_loss_on_absorbing_noise_is_md4s_per_sequence():
  """Same key, same draws: MD4's NELBO of every sequence, for a denoiser that is not exact."""
  vocab, batch = 5, 64
  x = jax.random.randint(jax.random.key(0), (batch, 7), 0, vocab)

  def apply_fn(params, z_BxL, t_B):
    return jnp.sin(1.3 * z_BxL[..., None] * jnp.arange(vocab) + t_B[:, None, None]) * params

  process = noise.get("absorbing", vocab)
  key = jax.random.key(1)
  ours, md4 = jax.jit(lambda: (
      noise.gidd_loss(apply_fn, 2.0, key, x, process=process)[1],
      diffusion.nelbo_loss(apply_fn, 2.0, key, x, schedule=process.schedule, mask_id=vocab)[1]))()
  np.testing.assert_allclose(np.asarray(ours["nelbo_nats_B"]), np.asarray(md4["nelbo_nats_B"]),
                             rtol=1e-5, atol=1e-5)


# (task, task_kwargs, every sequence of the law, each equally likely)
LAWS = {"two_color": ({}, [[0, 0], [1, 1]]),
        "permutation": ({"n": 3}, [list(p) for p in itertools.permutations(range(3))])}
BATCH = 100_000


@functools.cache
def _exact(name, task_name):
  """The estimators' expectation: int_{t_min}^1 NELBO integrand dt / (1 - t_min) (t is drawn
  uniform on [t_min, 1]), computed by `reference.exact_nelbo`."""
  kwargs, seqs = LAWS[task_name]
  task = tasks.get(task_name, kwargs)
  probs = np.full(len(seqs), 1.0 / len(seqs))
  return reference.exact_nelbo(name, task.vocab_size, seqs, probs, T_MIN) / (1 - T_MIN)


def _estimate(loss_fn, model, seed=0, denoiser=None):
  """Mean and standard error of the per-sequence NELBO over BATCH data rows."""
  x = model.task.sample_data(jax.random.key(seed), BATCH)
  apply_fn = denoiser or model.denoiser
  nelbo_B = jax.jit(lambda key: loss_fn(apply_fn, model.params, key, x)[1]["nelbo_nats_B"])(
      jax.random.key(seed + 1))
  nelbo_B = np.asarray(nelbo_B, np.float64)
  return nelbo_B.mean(), nelbo_B.std() / math.sqrt(BATCH)


def _loss(name, model):
  process = noise.get(name, model.vocab_size)
  if name == "absorbing":  # MD4's own loss: a check of the harness
    return functools.partial(diffusion.nelbo_loss, schedule=process.schedule,
                             mask_id=model.mask_id)
  if name == "uniform":
    return functools.partial(noise.udlm_loss, process=process)
  return functools.partial(noise.gidd_loss, process=process)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("task_name", sorted(LAWS))
def test_nelbo_estimate_matches_the_exact_value(task_name, name, capsys):
  """The Monte Carlo NELBO of the exact denoiser (UDLM's for uniform, GIDD's for hybrid, MD4's
  for absorbing) against the exact value: the law enumerated, every x_t, the true reverse
  rates, integrated over t by Gauss-Legendre on geometric panels (`reference.exact_nelbo`;
  24 and 48 nodes agree to 1e-9). It is also -log p(x0), the law's entropy, up to the part of
  [0, t_min] the losses leave out (the bound is tight for exact reverse rates).

  Tolerance: the per-sequence estimates are unbiased for the exact value (t ~ U[t_min, 1],
  z_t ~ q_t, the exact bracket). Their mean over B = 100,000 sequences is normal by the CLT
  with standard deviation sigma / sqrt(B); the sample standard error SE over-states it (the
  antithetic times are negatively correlated across the batch), so |mean - exact| < 4 SE
  fails by chance with probability about 1e-4 (fixed seeds make it deterministic). Under
  uniform and hybrid noise the values are heavy-tailed (a token corrupted at small t that
  another position's evidence contradicts costs about 1/t, with probability about t: the
  variance grows like log(1/t_min), finite), which skews the mean's law a little: over 30
  seeds per case the z-scores (mean - exact) / SE had standard deviation 0.9 to 1.3 and
  |z| <= 3.0. The quadrature (< 1e-9) and float32 rounding (~1e-6) are far below SE.
  """
  kwargs, _ = LAWS[task_name]
  model = mdjax.load(task_name, task_kwargs=kwargs, noise=name)
  mean, se = _estimate(_loss(name, model), model)
  exact = _exact(name, task_name)
  entropy = math.log(len(LAWS[task_name][1]))
  with capsys.disabled():
    print(f"\n{task_name} {name}: estimate {mean:.5f} +- {se:.5f}, exact {exact:.5f}, "
          f"entropy {entropy:.5f}")
  assert abs(mean - exact) < 4 * se, (mean, se, exact)
  assert exact == pytest.approx(entropy, abs=2e-3)


def test_plugging_the_full_posterior_in_overshoots_the_bound(capsys):
  """The warning in numbers: a denoiser whose posterior is fed to the loss as if it were the
  plug-in weights (UDLM/DUO's sampler with the full posterior) scores a NELBO above the
  entropy by many standard errors under uniform noise; the exact mapping scores the entropy."""
  model = mdjax.load("two_color", noise="uniform")
  process = model.noise

  def double_counting(params, z_BxL, t_B):
    post = jnp.exp(model.denoiser(params, z_BxL, t_B))
    return jnp.log(process.posterior_from_plugin(post, z_BxL, t_B))

  mean, se = _estimate(_loss("uniform", model), model, denoiser=double_counting)
  with capsys.disabled():
    print(f"\ntwo_color uniform, posterior plugged in: {mean:.5f} +- {se:.5f} "
          f"(entropy {math.log(2):.5f})")
  assert mean - 4 * se > _exact("uniform", "two_color") + 0.1


def test_weightings_and_gradients():
  """clip and dynamic weightings give finite losses and gradients under jit; their aux NELBO
  is the ELBO-weighted one; bad input names its argument."""
  vocab = 4
  x = jax.random.randint(jax.random.key(0), (16, 6), 0, vocab)
  table = jax.random.normal(jax.random.key(1), (vocab + 1, vocab))

  def apply_fn(params, z_BxL, t_B):
    return params[z_BxL] * (1 + t_B[:, None, None])

  process = noise.Hybrid(vocab_size=vocab)
  key = jax.random.key(2)
  maskable = jnp.broadcast_to(jnp.arange(6)[None] >= 2, x.shape)

  @jax.jit
  def run(p):
    out = {w: jax.value_and_grad(
        lambda p, w=w: noise.gidd_loss(apply_fn, p, key, x, process=process, weighting=w),
        has_aux=True)(p) for w in noise.WEIGHTINGS}
    out["udlm"] = noise.udlm_loss(apply_fn, p, key, x, process=noise.get("uniform", vocab),
                                  maskable_BxL=maskable)
    return out

  out = run(table)
  elbo_nats = float(out["elbo"][0][1]["nelbo_nats"])
  assert float(out["elbo"][0][0]) == pytest.approx(elbo_nats, rel=1e-6)
  for weighting in noise.WEIGHTINGS:
    (value, aux), grad = out[weighting]
    assert np.isfinite(float(value)) and np.isfinite(np.asarray(grad)).all()
    assert float(aux["nelbo_nats"]) == pytest.approx(elbo_nats, rel=1e-6)
  aux = out["udlm"][1]
  assert np.isfinite(float(aux["nelbo_nats"])) and float(aux["corrupted_fraction"]) > 0
  bad = [(dict(process=noise.get("uniform", vocab), weighting="dynamic"), "weighting"),
         (dict(process=process, weighting="none"), "weighting"),
         (dict(process=process, max_loss_weight=-1.0), "max_loss_weight"),
         (dict(process="uniform"), "process")]
  for kwargs, param in bad:
    with pytest.raises(errors.ArgumentError) as info:
      noise.gidd_loss(apply_fn, table, key, x, **kwargs)
    assert info.value.param == param
  with pytest.raises(errors.ArgumentError) as info:
    noise.udlm_loss(apply_fn, table, key, x, process=process)
  assert info.value.param == "process"
