"""Samplers that may revise (uniform_ancestral, diffusion_gemma): one step against a numpy
brute force, the two_color invalid rates against their exact values, the model's process
through `mdjax.generate`, bad input.

Tolerances: an invalid fraction over N independent rows has standard error sqrt(p(1-p)/N);
4 standard errors leave a two-sided miss of about 6e-5 per check (normal approximation), and
the seeds are fixed. A per-cell frequency of N draws against its law p: the same 4 sqrt(p(1-p)/N).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from mdjax import noise, sampling
from mdjax.bench import revision
from mdjax.errors import ArgumentError
from mdjax.sampling.families import diffusion_gemma

V, L = 3, 2
SEQUENCES = [(0, 0), (1, 2), (2, 1), (2, 2)]
PROBS = [0.4, 0.3, 0.2, 0.1]


def _coefficients(kind: str, t: float) -> tuple[float, float, float]:
  """(alpha, mask, uniform) at t, from the papers' formulas (linear schedule)."""
  if kind == "uniform":
    return 1 - t, 0.0, t
  p, gamma = 0.1, 1.0  # GIDD's hybrid, tau = t
  c = 2**gamma * p / (1 - p) * (t * (1 - t))**(gamma / 2)
  return (1 - t) / (1 + c), t / (1 + c), c / (1 + c)


def _marginal(kind: str, t: float) -> np.ndarray:
  """Q[v, x] = q_t(x | x0 = v) over the S states (V tokens, then the mask for hybrid)."""
  alpha, mask, uniform = _coefficients(kind, t)
  states = V + (kind == "hybrid")
  q = np.zeros((V, states))
  q[:, :V] = alpha * np.eye(V) + uniform / V
  if kind == "hybrid":
    q[:, V] = mask
  return q


def brute_force_step(kind: str, z, s: float, t: float) -> np.ndarray:
  """The exact per-position reverse step (L x S) by enumeration: p(x0 | z) over the law's
  sequences, then sum_x0 p(x0 | z) q(x_s,i | z_i, x0_i), with q(x_s | z, x0) = q(z | x_s)
  q_s(x_s | x0) / q_t(z | x0) from the transition q(z | x_s) = Q_s^-1 Q_t's kernel."""
  q_s, q_t = _marginal(kind, s), _marginal(kind, t)
  alpha_s, alpha_t = _coefficients(kind, s)[0], _coefficients(kind, t)[0]
  keep = alpha_t / alpha_s
  noise_s, noise_t = q_s[0] - alpha_s * np.eye(q_s.shape[1])[0], q_t[0] - alpha_t * np.eye(
      q_t.shape[1])[0]
  trans = keep * np.eye(q_s.shape[1]) + (noise_t - keep * noise_s)[None, :]  # [x_s, x_t]
  post = np.array([p * np.prod([q_t[x0[i], z[i]] for i in range(L)])
                   for x0, p in zip(SEQUENCES, PROBS)])
  post /= post.sum()
  out = np.zeros((L, q_s.shape[1]))
  for x0, w in zip(SEQUENCES, post):
    for i in range(L):
      out[i] += w * trans[:, z[i]] * q_s[x0[i]] / q_t[x0[i], z[i]]
  return out


def _model(kind: str):
  process = noise.get(kind, V)
  support = noise.Support.of_sequences(SEQUENCES, PROBS, V)
  return process, noise.exact_denoiser(process), support.arrays


@pytest.mark.parametrize("kind", ["uniform", "hybrid"])
def test_the_exact_reverse_step_equals_a_brute_force_one(kind):
  process, denoiser, params = _model(kind)
  states = V + (kind == "hybrid")
  z_NxL = np.array(list(itertools.product(range(states), repeat=L)), np.int32)
  t, s = 0.75, 0.5
  post = jnp.exp(denoiser(params, jnp.asarray(z_NxL), jnp.full((len(z_NxL),), t)))
  got = np.asarray(process.reverse_step(post, jnp.asarray(z_NxL), jnp.full((len(z_NxL),), s),
                                        jnp.full((len(z_NxL),), t)))
  for n, z in enumerate(z_NxL):
    np.testing.assert_allclose(got[n], brute_force_step(kind, z, s, t), atol=2e-6)


@pytest.mark.parametrize("kind", ["uniform", "hybrid"])
def test_a_sampler_step_draws_from_the_brute_force_law(kind):
  """Step 1 of K = 4 (t = 0.75 -> s = 0.5) from the canvas (1, 2), on N rows."""
  process, denoiser, params = _model(kind)
  rows, z = 40_000, np.array([1, 2], np.int32)
  spec = sampling.UniformAncestralSpec(steps=4, noise=process)
  canvas = np.full((rows, L), V, np.int32)
  prepared = sampling.prepare(denoiser, params, jax.random.key(0), canvas, spec)
  stepper, bound = prepared.stepper, prepared.bind()
  carry = prepared.start()
  core = carry.state.core.replace(tokens_BxL=jnp.tile(jnp.asarray(z), (rows, 1)))
  carry = carry.replace(state=carry.state.replace(core=core))
  carry = jax.jit(stepper.step)(bound, carry, 1, prepared.plan)
  drawn = np.asarray(carry.tokens_BxL)
  want = brute_force_step(kind, z, 0.5, 0.75)
  for i in range(L):
    freq = np.bincount(drawn[:, i], minlength=want.shape[1]) / rows
    tol = 4 * np.sqrt(want[i] * (1 - want[i]) / rows) + 1e-9
    assert np.all(np.abs(freq - want[i]) <= tol), (i, freq, want[i])


def test_the_two_color_closed_form_is_the_chain_and_the_sampled_rate():
  """The closed form (docs/revision.md) equals the exact chain for K = 1..32; sampled rates
  lie within 4 standard errors of it."""
  model = mdjax.load("two_color", noise="uniform")
  task = model.task
  law = revision.ancestral_law(model.noise)
  start = np.array([0.5, 0.5])
  for k in range(1, 33):
    chain = revision.chain_invalid(model, revision.invalid_fn(task), law, k, start)
    assert abs(chain - float(revision.two_color_uniform_invalid(k))) < 1e-6, k
  assert revision.two_color_uniform_invalid(2) == pytest.approx(17 / 50)
  rows = 20_000
  for k in (1, 2, 8):
    out = mdjax.generate(model, [[]] * rows, max_new_tokens=2, key=k, steps=k)
    tokens = np.array(out.token_ids)
    p = float(revision.two_color_uniform_invalid(k))
    got = float((tokens[:, 0] != tokens[:, 1]).mean())
    assert abs(got - p) <= 4 * np.sqrt(p * (1 - p) / rows), (k, got, p)


def test_diffusion_gemma_two_steps_on_two_color_in_closed_form():
  """K = 2: step 0 (t = 1, the posterior 1/2 each, entropy ln 2 at both positions) keeps
  position 0's draw and re-noises position 1; step 1 (t = 1/2, T = 0.6) keeps both draws.
  A re-noised color equal to the kept one (1/2) leaves p = 0.9 on it at both positions,
  shaped to q = 0.9^(1/T) / (0.9^(1/T) + 0.1^(1/T)): invalid 2 q (1 - q); a different one
  leaves 1/2 each: invalid 1/2."""
  q = 0.9**(1 / 0.6) / (0.9**(1 / 0.6) + 0.1**(1 / 0.6))
  want = 0.5 * (2 * q * (1 - q)) + 0.5 * 0.5
  model = mdjax.load("two_color", noise="uniform")
  spec = sampling.DiffusionGemmaSpec(steps=2)
  assert diffusion_gemma.anneal(spec, np.array([1.0, 0.5])) == pytest.approx([0.8, 0.6])
  chain = revision.chain_invalid(model, revision.invalid_fn(model.task),
                                 revision.gemma_law(spec), 2, np.array([0.5, 0.5]))
  assert chain == pytest.approx(want, abs=1e-6)
  rows = 20_000
  out = mdjax.generate(model, [[]] * rows, max_new_tokens=2, key=3, spec=spec)
  tokens = np.array(out.token_ids)
  got = float((tokens[:, 0] != tokens[:, 1]).mean())
  assert abs(got - want) <= 4 * np.sqrt(want * (1 - want) / rows), (got, want)


def test_diffusion_gemma_keeps_the_entropy_bounded_prefix_and_stops_on_a_stable_canvas():
  entropy = jnp.array([[0.3, 0.05, 0.2, 0.9], [0.0, 0.0, 0.0, 0.0]])
  kept = diffusion_gemma.kept_within_bound(entropy, jnp.ones((2, 4), bool), 0.3)
  # Ascending 0.05, 0.2, 0.3, 0.9: the entropies before each are 0, 0.05, 0.25, 0.55.
  np.testing.assert_array_equal(kept, [[True, True, True, False], [True] * 4])
  model = mdjax.load("two_color", noise="uniform")
  spec = sampling.DiffusionGemmaSpec(steps=8, early_stop=True)
  out = sampling.sample(model.denoiser, model.params, jax.random.key(0),
                        np.full((512, 2), 2, np.int32), sampling.with_noise(spec, model.noise))
  stop_B = np.asarray(out.extras["stop_step_B"])
  assert (stop_B < 8).any() and int(out.nfe) + int(out.saved_calls) == 8
  np.testing.assert_array_equal(np.asarray(out.rounds_B), np.minimum(stop_B + 1, 8))


def test_the_process_comes_from_the_model_and_bad_input_names_the_argument():
  uniform = mdjax.load("two_color", noise="uniform")
  assert uniform.sampler.family == "uniform_ancestral"
  spec = sampling.with_noise(sampling.UniformAncestralSpec(steps=2), uniform.noise)
  assert spec.noise == uniform.noise
  assert sampling.with_noise(sampling.UniformAncestralSpec(steps=2, noise="uniform"),
                             uniform.noise).noise is uniform.noise
  cases = [
      (lambda: mdjax.generate(uniform, [[]], max_new_tokens=2, key=0,
                              spec=sampling.AncestralSpec(steps=2)), "spec"),
      (lambda: mdjax.generate(mdjax.load("two_color", noise="hybrid"), [[]], max_new_tokens=2,
                              key=0, spec=sampling.DiffusionGemmaSpec(steps=2)), "spec"),
      (lambda: mdjax.generate(uniform, [[]], max_new_tokens=2, key=0,
                              spec=sampling.UniformAncestralSpec(steps=2, noise="hybrid")),
       "spec.noise"),
      (lambda: sampling.sample(uniform.denoiser, uniform.params, jax.random.key(0),
                               np.full((1, 2), 2), sampling.UniformAncestralSpec(steps=2)),
       "noise"),
      (lambda: sampling.sample(uniform.denoiser, uniform.params, jax.random.key(0),
                               np.full((1, 2), 2), sampling.UniformAncestralSpec(
                                   steps=2, noise=noise.Uniform(vocab_size=3))), "noise"),
      (lambda: sampling.UniformAncestralSpec(steps=2, noise="gaussian"), "noise"),
      (lambda: sampling.DiffusionGemmaSpec(steps=2, temperature=0.5), "temperature"),
      (lambda: sampling.DiffusionGemmaSpec(steps=2, max_temperature=0.1), "max_temperature"),
      (lambda: sampling.DiffusionGemmaSpec(steps=2, entropy_bound=-1.0), "entropy_bound"),
  ]
  for call, param in cases:
    with pytest.raises(ArgumentError) as info:
      call()
    assert info.value.param == param, (param, info.value)
