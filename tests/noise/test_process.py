"""The noise processes against numpy float64 references (tests/noise/reference.py): marginals,
jump rates, transitions and the exact reverse step, brute force on small cases."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import diffusion, errors, noise
from tests.noise import reference

NAMES = ("absorbing", "uniform", "hybrid")
V = 3


def process(name, vocab=V):
  return noise.get(name, vocab)


@pytest.mark.parametrize("name", NAMES)
def test_marginal_and_rates_match_the_reference(name):
  p = process(name)
  for t in (0.05, 0.3, 0.5, 0.8, 0.97):
    t_B = jnp.array([t])
    want = reference.marginal_matrix(name, t, V)
    got = np.asarray(p.marginal_of_tokens(jnp.arange(V)[None], t_B))[0]
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(np.asarray(p.jump_rates(t_B))[0],
                               reference.jump_rates(name, t, V), rtol=1e-4, atol=1e-6)
    # q_t(z_i | v) for every token v is the marginal matrix's column z.
    lik = np.asarray(p.likelihood(jnp.arange(p.num_states)[None], t_B))[0]
    np.testing.assert_allclose(lik, want.T, atol=1e-6)


def test_hybrid_is_gidds_process():
  """At t = 1/2 (gamma = 1) uniform noise is a share p_uniform of every token; t = 1 is all
  masks; p_uniform = 0 is absorbing."""
  p = noise.Hybrid(vocab_size=5, p_uniform=0.2)
  alpha, mask, uniform = (float(x[0]) for x in p.coefficients(jnp.array([0.5])))
  assert uniform == pytest.approx(0.2) and alpha == pytest.approx(mask) == pytest.approx(0.4)
  alpha, mask, uniform = (float(x[0]) for x in p.coefficients(jnp.array([1.0])))
  assert (alpha, mask, uniform) == (0.0, 1.0, 0.0)
  t_B = jnp.array([0.3, 0.6])
  np.testing.assert_allclose(noise.Hybrid(vocab_size=5, p_uniform=0.0).noise_BxS(t_B),
                             noise.Absorbing(vocab_size=5).noise_BxS(t_B), atol=1e-7)


@pytest.mark.parametrize("name", NAMES)
def test_transition_is_the_rates_integrated_and_carries_the_marginals(name):
  """q(x_t | x_s) equals the forward rates integrated from s to t (RK4), and q_s K = q_t."""
  p = process(name)
  s, t = 0.2, 0.7
  k_rates = reference.transition_by_rates(name, s, t, V)
  k = np.asarray(p.transition(jnp.arange(p.num_states)[None], jnp.array([s]), jnp.array([t])))[0]
  np.testing.assert_allclose(k, k_rates, atol=1e-5)
  np.testing.assert_allclose(reference.marginal_matrix(name, s, V) @ k_rates,
                             reference.marginal_matrix(name, t, V), atol=1e-8)


@functools.cache
def _rates_integrated(name, s, t):
  return reference.transition_by_rates(name, s, t, V, steps=1000)


def _brute_bridge(name, s, t, v, z):
  """q(x_s | x_t = z, x0 = v) by Bayes on the integrated rates."""
  k = _rates_integrated(name, s, t)
  joint = k[:, z] * reference.marginal_matrix(name, s, V)[v]
  return joint / joint.sum()


@pytest.mark.parametrize("name", NAMES)
def test_reverse_step_is_the_mixture_of_bridges(name):
  """The exact reverse step sum_v q(x_s | x_t, x0 = v) p(v | x_t), brute force, for every
  current state z (a mask included) and a posterior consistent with z."""
  p = process(name)
  s, t = 0.35, 0.6
  rng = np.random.default_rng(0)
  for z in range(p.num_states):
    post = rng.dirichlet(np.ones(V))
    if name == "absorbing" and z < V:
      post = np.eye(V)[z]  # a visible token is x0
    want = sum(post[v] * _brute_bridge(name, s, t, v, z) for v in range(V) if post[v] > 0)
    got = np.asarray(p.reverse_step(jnp.asarray(post, jnp.float32)[None, None],
                                    jnp.array([[z]]), jnp.array([s]), jnp.array([t])))[0, 0]
    np.testing.assert_allclose(got, want, atol=2e-6)
    # The bridge at a one-hot x0 is Bayes's too.
    for v in range(V):
      one = np.asarray(p.bridge(jnp.eye(V)[v][None, None], jnp.array([[z]]), jnp.array([s]),
                                jnp.array([t])))[0, 0]
      if np.isfinite(one).all():  # (x0 = v, x_t = z) possible
        np.testing.assert_allclose(one, _brute_bridge(name, s, t, v, z), atol=2e-6)


def test_uniform_bridge_is_duos_posterior():
  """For uniform noise `bridge` is DUO's `_posterior_from_x0` (s-sahoo/duo, algo.py),
  transcribed, at any x0 law."""
  p = process("uniform")
  rng = np.random.default_rng(1)
  w = rng.dirichlet(np.ones(V), size=(1, 4))
  z = np.array([[0, 1, 2, 1]])
  a_s, a_t = 0.6, 0.25
  s, t = 1 - a_s, 1 - a_t
  a_ts, da = a_t / a_s, a_s - a_t
  z1 = np.eye(V)[z]
  w_z = np.take_along_axis(w, z[..., None], -1)
  duo = ((a_t * V * w * z1 + (a_ts - a_t) * z1 + da * w + (1 - a_ts) * (1 - a_s) / V)
         / (a_t * V * w_z + (1 - a_t)))
  got = p.bridge(jnp.asarray(w, jnp.float32), jnp.asarray(z), jnp.array([s]), jnp.array([t]))
  np.testing.assert_allclose(np.asarray(got), duo, atol=1e-6)


def test_plugging_the_posterior_in_counts_the_evidence_twice():
  """Under uniform noise q(x_s | x_t, x0 = p) with the full posterior p is not the exact step,
  and its implied jump rate (step - stay) / (t - s) keeps a gap as t - s -> 0; with the weights
  p / q_t(z | .) renormalised (`plugin_from_posterior`) it is exact."""
  p = process("uniform")
  post = jnp.asarray([[[0.2, 0.5, 0.3]]])
  z = jnp.array([[1]])
  gaps = []
  for dt in (0.1, 0.01, 0.001):
    s, t = jnp.array([0.5 - dt]), jnp.array([0.5])
    exact = np.asarray(p.reverse_step(post, z, s, t))[0, 0]
    naive = np.asarray(p.bridge(post, z, s, t))[0, 0]
    want = sum(float(post[0, 0, v]) * _brute_bridge("uniform", 0.5 - dt, 0.5, v, 1)
               for v in range(V))
    np.testing.assert_allclose(exact, want, atol=1e-5)
    gaps.append(abs(naive[0] - exact[0]) / dt)  # rate of a jump to token 0
  assert min(gaps) > 0.1 and gaps[-1] == pytest.approx(gaps[-2], rel=0.05), gaps
  back = p.posterior_from_plugin(p.plugin_from_posterior(post, z, jnp.array([0.5])), z,
                                 jnp.array([0.5]))
  np.testing.assert_allclose(np.asarray(back), np.asarray(post), atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_corrupt_draws_the_marginal(name):
  """Per state, the frequency of z_t over 200,000 draws is within 4 standard errors of q_t."""
  p = process(name)
  n, t = 200_000, 0.4
  x0 = jnp.zeros((n, 1), jnp.int32)
  z = np.asarray(p.corrupt(jax.random.key(0), x0, jnp.full((n,), t)))[:, 0]
  want = reference.marginal_matrix(name, t, V)[0]
  freq = np.bincount(z, minlength=p.num_states) / n
  assert np.all(np.abs(freq - want) < 4 * np.sqrt(want * (1 - want) / n) + 1e-12), (freq, want)
  kept = p.corrupt(jax.random.key(0), x0, jnp.full((n,), t), jnp.zeros((n, 1), bool))
  assert not np.asarray(kept).any()  # positions outside maskable_BxL stay clean


def test_absorbing_corrupt_is_forward_mask():
  x = jax.random.randint(jax.random.key(1), (8, 16), 0, V)
  t_B = jnp.linspace(0.1, 0.9, 8)
  got = process("absorbing").corrupt(jax.random.key(2), x, t_B)
  want = diffusion.forward_mask(jax.random.key(2), x, 1 - t_B, V)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_prior_canvas_and_static_use():
  """t = 1's canvas is all masks (absorbing, hybrid) or uniform tokens; processes are static
  jit arguments."""
  key = jax.random.key(3)
  assert (np.asarray(process("hybrid").prior_canvas(key, 4, 5)) == V).all()
  tokens = np.asarray(process("uniform").prior_canvas(key, 64, 64))
  assert tokens.max() < V and len(np.unique(tokens)) == V

  @jax.jit
  def alphas(t_B):
    return [noise.get(name, V).alpha(t_B) for name in NAMES]

  f = jax.jit(lambda proc, t_B: proc.alpha(t_B), static_argnums=0)
  assert float(f(process("uniform"), jnp.array([0.25]))[0]) == 0.75
  assert len(alphas(jnp.array([0.5]))) == 3
  assert process("uniform") == noise.Uniform(vocab_size=V) != noise.Absorbing(vocab_size=V)


def test_bad_input_names_the_argument():
  for make, param in ((lambda: noise.get("gaussian", V), "noise"),
                      (lambda: noise.Hybrid(vocab_size=V, p_uniform=1.0), "p_uniform"),
                      (lambda: noise.Hybrid(vocab_size=V, gamma=3.0), "gamma"),
                      (lambda: noise.Uniform(vocab_size=0), "vocab_size"),
                      (lambda: noise.get("uniform", V, power=2), "power"),
                      (lambda: noise.as_process(noise.Uniform(vocab_size=4), V), "noise")):
    with pytest.raises(errors.ArgumentError) as info:
      make()
    assert info.value.param == param, (param, str(info.value))
  assert noise.get("hybrid", V, schedule="cosine").schedule == diffusion.CosineSchedule()
  assert math.isclose(noise.Hybrid(vocab_size=V).scale, 2 * 0.1 / 0.9)


@pytest.mark.parametrize("schedule", [diffusion.CosineSchedule(), diffusion.PolynomialSchedule(
    power=3.0), diffusion.LogLinearSchedule()], ids=repr)
@pytest.mark.parametrize("name", NAMES)
def test_derivatives_under_any_schedule(name, schedule):
  """`derivatives` is the time derivative of `coefficients` (central differences) for other
  schedules too (hybrid: GIDD's process at tau = 1 - alpha_schedule(t), by the chain rule)."""
  p = noise.get(name, V, schedule=schedule)
  t_B = jnp.array([0.1, 0.35, 0.6, 0.85])
  h = 1e-3
  up, down = p.coefficients(t_B + h), p.coefficients(t_B - h)
  for got, hi, lo in zip(p.derivatives(t_B), up, down):
    np.testing.assert_allclose(np.asarray(got), (np.asarray(hi) - np.asarray(lo)) / (2 * h),
                               rtol=2e-3, atol=2e-3)
  alpha, mask, uniform = p.coefficients(t_B)
  np.testing.assert_allclose(np.asarray(alpha + mask + uniform), 1.0, atol=1e-6)
  assert (np.asarray(p.jump_rates(t_B)) >= 0).all()
