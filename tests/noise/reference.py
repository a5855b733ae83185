"""Numpy float64 references for the noise tests, written from the papers, not from mdjax.noise.

All use the linear schedule (the processes' default): alpha = 1 - t for absorbing and uniform,
and GIDD's `HybridDiffusion.get_alpha_betapi` (dvruette/gidd) for hybrid, with tau = t.
"""

from __future__ import annotations

import itertools

import numpy as np

P_UNIFORM, GAMMA = 0.1, 1.0  # noise.Hybrid's defaults


def coefficients(name: str, t, p_uniform=P_UNIFORM, gamma=GAMMA):
  """(alpha, mask, uniform) at times t (arrays)."""
  t = np.asarray(t, np.float64)
  if name == "absorbing":
    return 1 - t, t, np.zeros_like(t)
  if name == "uniform":
    return 1 - t, np.zeros_like(t), t
  big_b = 2.0**gamma * p_uniform / (1 - p_uniform)
  c = big_b * (t * (1 - t))**(gamma / 2)
  return (1 - t) / (1 + c), t / (1 + c), c / (1 + c)


def has_mask(name: str) -> bool:
  return name != "uniform"


def noise_law(name: str, t, vocab: int):
  """The noise mass per state (... x S)."""
  _, mask, uniform = coefficients(name, t)
  tokens = np.repeat(np.asarray(uniform)[..., None] / vocab, vocab, -1)
  return np.concatenate([tokens, np.asarray(mask)[..., None]], -1) if has_mask(name) else tokens


def marginal_matrix(name: str, t: float, vocab: int):
  """M[v, z] = q_t(z | x0 = v) (V x S)."""
  alpha = coefficients(name, t)[0]
  states = vocab + has_mask(name)
  return alpha * np.eye(vocab, states) + noise_law(name, t, vocab)[None]


def jump_rates(name: str, t: float, vocab: int, h=1e-6):
  """omega_t(z) = n'(z) - (alpha'/alpha) n(z), derivatives by central differences."""
  alpha = coefficients(name, t)[0]
  dalpha = (coefficients(name, t + h)[0] - coefficients(name, t - h)[0]) / (2 * h)
  dnoise = (noise_law(name, t + h, vocab) - noise_law(name, t - h, vocab)) / (2 * h)
  return dnoise - dalpha / alpha * noise_law(name, t, vocab)


def rate_matrix(name: str, t: float, vocab: int):
  """Q[a, b]: the forward rate from state a to b != a is omega_t(b)."""
  omega = jump_rates(name, t, vocab)
  q = np.broadcast_to(omega, (len(omega), len(omega))).copy()
  np.fill_diagonal(q, 0.0)
  np.fill_diagonal(q, -q.sum(1))
  return q


def transition_by_rates(name: str, s: float, t: float, vocab: int, steps=4000):
  """K[a, b] = q(x_t = b | x_s = a), by integrating dK/dt = K Q_t (RK4)."""
  states = vocab + has_mask(name)
  k = np.eye(states)
  h = (t - s) / steps
  for n in range(steps):
    u = s + n * h
    k1 = k @ rate_matrix(name, u, vocab)
    k2 = (k + h / 2 * k1) @ rate_matrix(name, u + h / 2, vocab)
    k3 = (k + h / 2 * k2) @ rate_matrix(name, u + h / 2, vocab)
    k4 = (k + h * k3) @ rate_matrix(name, u + h, vocab)
    k = k + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
  return k


def posterior(name: str, t: float, vocab: int, seqs_XxL, probs_X, z_L):
  """p(x0_i = v | z) (L x V) by summing the joint over a list of sequences; a position
  holding the mask id under uniform noise is unobserved."""
  m = evidence_matrix(name, t, vocab)
  lik_X = np.prod(m[seqs_XxL, np.asarray(z_L)[None]], -1) * probs_X
  out = np.zeros((len(z_L), vocab))
  for i in range(len(z_L)):
    np.add.at(out[i], seqs_XxL[:, i], lik_X)
  with np.errstate(invalid="ignore"):  # nan: a state the law cannot produce
    return out / out.sum(-1, keepdims=True)


def evidence_matrix(name: str, t: float, vocab: int):
  """q_t(z | x0 = v) (V x (V + 1)): the marginal, and under uniform noise a last column of ones
  for the mask id (unobserved)."""
  m = marginal_matrix(name, t, vocab)
  return m if has_mask(name) else np.concatenate([m, np.ones((vocab, 1))], 1)


def all_states(states: int, length: int):
  return np.array(list(itertools.product(range(states), repeat=length)))
