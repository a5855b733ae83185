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


def jump_rates(name: str, t: float, vocab: int):
  """omega_t(z) = n'(z) - (alpha'/alpha) n(z), derivatives by central differences (steps
  relative to the distance to either end, where hybrid noise's derivatives blow up)."""
  h = 1e-4 * min(t, 1 - t)
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


def nelbo_integrand(name: str, t: float, vocab: int, seqs_XxL, probs_X) -> float:
  """E_{x0, z ~ q_t} of the continuous-time NELBO's integrand for the exact reverse process, in
  the rate form (Campbell et al. 2022; Lou et al. 2024's score entropy): every z and x0
  enumerated, and at each position i and state y != z_i

      omega_t(z_i) [r - r_x0 log r + r_x0 log r_x0 - r_x0],

  r = q_t(z with z_i := y) / q_t(z) the true ratio of the joint, r_x0 the same given x0. It
  reads no denoiser: the true reverse rates come from the law itself."""
  seqs_XxL = np.asarray(seqs_XxL)
  length = seqs_XxL.shape[1]
  states = vocab + has_mask(name)
  z_ZxL = all_states(states, length)
  m = marginal_matrix(name, t, vocab)
  q_XxZ = np.prod(m[seqs_XxL[:, None, :], z_ZxL[None]], -1)
  q_Z = probs_X @ q_XxZ
  omega = jump_rates(name, t, vocab)
  place = states ** np.arange(length - 1, -1, -1)
  index_Z = z_ZxL @ place
  total = 0.0
  for i in range(length):
    for y in range(states):
      moved = y != z_ZxL[:, i]
      neighbour_Z = index_Z + (y - z_ZxL[:, i]) * place[i]
      with np.errstate(divide="ignore", invalid="ignore"):
        r_Z = np.where(q_Z > 0, q_Z[neighbour_Z] / q_Z, 0.0)
        r_x_XxZ = m[seqs_XxL[:, i], y][:, None] / m[seqs_XxL[:, i][:, None], z_ZxL[None, :, i]]
        log_r = np.log(np.where(r_Z > 0, r_Z, 1.0))
        term = r_Z - r_x_XxZ * log_r - r_x_XxZ + np.where(
            r_x_XxZ > 0, r_x_XxZ * np.log(np.where(r_x_XxZ > 0, r_x_XxZ, 1.0)), 0.0)
      weight_XxZ = probs_X[:, None] * q_XxZ * omega[z_ZxL[:, i]][None] * moved[None]
      total += np.sum(np.where(weight_XxZ > 0, weight_XxZ * term, 0.0))
  return float(total)


def exact_nelbo(name: str, vocab: int, seqs_XxL, probs_X, t_min: float, nodes=24) -> float:
  """int_{t_min}^1 of `nelbo_integrand`: Gauss-Legendre on panels that shrink geometrically
  towards both ends (where the integrand varies on the scale of t and of 1 - t)."""
  edges = np.unique(np.concatenate([
      [t_min], np.geomspace(t_min, 0.5, 14), 1 - np.geomspace(0.5, 1e-7, 12), [1.0]]))
  x, w = np.polynomial.legendre.leggauss(nodes)
  total = 0.0
  for a, b in zip(edges[:-1], edges[1:]):
    ts = (a + b) / 2 + (b - a) / 2 * x
    total += (b - a) / 2 * sum(wi * nelbo_integrand(name, ti, vocab, seqs_XxL, probs_X)
                               for wi, ti in zip(w, ts))
  return total
