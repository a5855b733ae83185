"""Continuous-time NELBOs of uniform and hybrid noise: UDLM's and GIDD's, beside MD4's.

For any interpolating process (`mdjax.noise.process`) the continuous-time NELBO of a sequence
(GIDD, von Rütte et al. 2025, Thm. 3.6) is

    NELBO(x0) = int_0^1 E_{z ~ q_t(.|x0)} sum_i w_t(z_i, x0_i) [KL(q_t(.|x0_i) || q_t(.|w_i))
                                                   + D_IS(q_t(z_i|x0_i) / q_t(z_i|w_i))] dt,

with the ELBO weight w_t(z, x0) = omega_t(z) / q_t(z | x0) (omega: the process's jump rates),
D_IS(r) = r - log r - 1, and w_i the model's plug-in weights: the denoiser's posterior p(x0_i |
z) with position i's own evidence divided out (`NoiseProcess.plugin_from_posterior`), so that
the reverse process the bound scores is the exact mixture step of that posterior. The prior
term at t = 1 is left out, as in `diffusion.nelbo_loss` (0 when alpha(1) = 0).

- Absorbing noise: the bracket is alpha (-log p(x0_i | z)) at masked positions and 0
  elsewhere: MD4's loss (`diffusion.nelbo_loss`, unchanged; `gidd_loss` on `Absorbing` makes
  the same draws and agrees with it per sequence).
- Uniform noise: UDLM's (Schiff et al. 2024, eq. 18; `UniformState.nll_per_token` in
  github.com/s-sahoo/duo): with xbar = V alpha x0 + (1 - alpha), xbar_w = V alpha w + (1 - alpha)
  and i the token z,  (alpha' / (V alpha)) [V/xbar_i - V/xbar_w,i - sum_j (xbar_j / xbar_i)
  log(xbar_w,i xbar_j / (xbar_w,j xbar_i))], the same integrand term by term
  (tests/noise/test_losses.py checks a transcription of it).
- Hybrid noise: GIDD's, with its loss weightings (`gidd_loss`).

Both are computed in the stable form KL + D_IS = sum_y q_w(y) f(d_y) + g(d_z), d = (q_x0 - q_w)
/ q_w, f(d) = (1+d) log(1+d) - d, g(d) = d - log(1+d), with series for small |d| (float32 would
otherwise lose the O(d^2) values to cancellation where alpha is small or the model is sure).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from mdjax import diffusion, errors
from mdjax.noise.process import Hybrid, NoiseProcess, Uniform

Array = jax.Array
ApplyFn = Callable[[Any, Array, Array], Array]

WEIGHTINGS = ("elbo", "clip", "dynamic")
SERIES_BELOW = 0.1  # |d| below which f and g are summed as series (error < d^9 / 72)


def _series_or_exact(d, series_fn, exact_fn):
  """series_fn(d) for |d| < SERIES_BELOW, else exact_fn(d); each branch fed only the values it
  is safe on, so gradients stay finite."""
  small = jnp.abs(d) < SERIES_BELOW
  return jnp.where(small, series_fn(jnp.where(small, d, 0.0)),
                   exact_fn(jnp.where(small, 1.0, d)))


def _kl_part(d):
  """f(d) = (1 + d) log(1 + d) - d >= 0, f(-1) = 1."""
  def series(x):  # sum_{k>=2} (-x)^k / (k (k - 1))
    return sum((-x)**k / (k * (k - 1)) for k in range(2, 9))

  def exact(x):
    one_plus = 1.0 + x
    safe = jnp.where(one_plus > 0, one_plus, 1.0)
    return jnp.where(one_plus > 0, safe * jnp.log(safe) - x, 1.0)

  return _series_or_exact(d, series, exact)


def _is_part(d):
  """g(d) = d - log(1 + d) >= 0: Itakura-Saito's r - log r - 1 at r = 1 + d."""
  def series(x):  # sum_{k>=2} (-x)^k / k
    return sum((-x)**k / k for k in range(2, 9))

  def exact(x):
    one_plus = 1.0 + x
    return jnp.where(one_plus > 0, x - jnp.log(jnp.where(one_plus > 0, one_plus, 1.0)), jnp.inf)

  return _series_or_exact(d, series, exact)


def elbo_parts(process: NoiseProcess, posterior_BxLxV: Array, x0_BxL: Array, z_BxL: Array,
               t_B: Array) -> tuple[Array, Array]:
  """(elbo_weight_BxL, divergence_BxL): w_t(z_i, x0_i) = omega_t(z_i) / q_t(z_i | x0_i) and
  KL + D_IS of the module docstring, from the denoiser's posterior marginals."""
  plugin = process.plugin_from_posterior(posterior_BxLxV, z_BxL, t_B)
  q_x0 = process.marginal_of_tokens(x0_BxL, t_B)
  q_w = process.marginal(plugin, t_B)
  has_w = q_w > 0
  d = jnp.where(has_w, (q_x0 - q_w) / jnp.where(has_w, q_w, 1.0), 0.0)
  kl_terms = jnp.where(has_w, q_w * _kl_part(d), jnp.where(q_x0 > 0, jnp.inf, 0.0))
  d_z = jnp.take_along_axis(d, z_BxL[..., None], -1)[..., 0]
  w_at_z = jnp.take_along_axis(q_w, z_BxL[..., None], -1)[..., 0]
  is_term = jnp.where(w_at_z > 0, _is_part(d_z), jnp.inf)
  divergence = kl_terms.sum(-1) + is_term
  q_x0_at_z = jnp.take_along_axis(q_x0, z_BxL[..., None], -1)[..., 0]
  rate_at_z = jnp.take_along_axis(process.jump_rates(t_B), z_BxL, 1)
  weight = rate_at_z / jnp.where(q_x0_at_z > 0, q_x0_at_z, 1.0)
  return weight, divergence


def gidd_loss(
    apply_fn: ApplyFn,
    params: Any,
    key: Array,
    x_BxL: Array,
    *,
    process: NoiseProcess,
    weighting: str = "elbo",
    min_loss_weight: float = 0.0,
    max_loss_weight: float = 2.0,
    maskable_BxL: Array | None = None,
    t_min: float = 1e-5,
) -> tuple[Array, dict[str, Array]]:
  """GIDD's loss and NELBO (module docstring) of a batch under any process.

  Times are antithetic over the batch in [t_min, 1] (`diffusion.stratified_times`) and z_t ~
  `process.corrupt` (for `Absorbing`: `diffusion.nelbo_loss`'s draws for the same key).
  `weighting` (GIDD's `loss.loss_weighting`): "elbo" (GIDD's "none": the NELBO itself),
  "clip" (the ELBO weights clipped to [min_loss_weight, max_loss_weight]) or "dynamic"
  (`Hybrid` only: weight 1 on a uniform-noised token, 2 on a mask, and B/(V+1) exp(gamma/2
  sigmoid(-tau)) on a token left clean, clipped; as in GIDD's code). Positions outside
  `maskable_BxL` stay clean and add nothing.

  Returns (loss, aux): loss is the batch mean of each sequence's weighted sum, in nats per
  sequence (GIDD divides by the number of tokens: a constant factor); aux holds the NELBO in
  `nelbo_nats` and `nelbo_nats_B` (per sequence, for error bars), `bits_per_token` (per
  maskable position) and `corrupted_fraction` (z != x0).
  """
  errors.check(isinstance(process, NoiseProcess), "process", process,
               "a mdjax.noise process (Absorbing, Uniform, Hybrid)")
  errors.check(weighting in WEIGHTINGS, "weighting", weighting, f"one of {WEIGHTINGS}")
  errors.check(weighting != "dynamic" or isinstance(process, Hybrid), "weighting", weighting,
               "'elbo' or 'clip' for this process ('dynamic' is GIDD's weighting of its hybrid "
               "process)")
  for name, value in (("min_loss_weight", min_loss_weight), ("max_loss_weight", max_loss_weight)):
    errors.check(isinstance(value, (int, float)) and math.isfinite(value) and value >= 0, name,
                 value, "a finite number >= 0")
  errors.check(max_loss_weight > 0 and min_loss_weight <= max_loss_weight, "max_loss_weight",
               max_loss_weight, f"a number > 0 and >= min_loss_weight={min_loss_weight!r}")
  batch = x_BxL.shape[0]
  if maskable_BxL is None:
    maskable_BxL = jnp.ones(x_BxL.shape, bool)
  time_key, noise_key = jax.random.split(key)
  t_B = diffusion.stratified_times(time_key, batch, t_min)
  z_BxL = process.corrupt(noise_key, x_BxL, t_B, maskable_BxL)
  logits_BxLxV = apply_fn(params, z_BxL, t_B)
  if logits_BxLxV.shape[-1] != process.vocab_size:  # static: raised while tracing
    raise errors.ArgumentError("process", f"process.vocab_size={process.vocab_size} but apply_fn "
                               f"returns {logits_BxLxV.shape[-1]} logits per position.")
  posterior = jax.nn.softmax(logits_BxLxV.astype(jnp.float32), -1)
  weight_BxL, divergence_BxL = elbo_parts(process, posterior, x_BxL, z_BxL, t_B)
  divergence_BxL = jnp.where(maskable_BxL, divergence_BxL, 0.0)
  nelbo_B = (weight_BxL * divergence_BxL).sum(-1)
  if weighting == "elbo":
    loss_weight_BxL = weight_BxL
  elif weighting == "clip":
    loss_weight_BxL = jnp.clip(weight_BxL, min_loss_weight, max_loss_weight)
  else:
    loss_weight_BxL = _dynamic_weight(process, x_BxL, z_BxL, t_B, min_loss_weight,
                                      max_loss_weight)
  loss = (loss_weight_BxL * divergence_BxL).sum(-1).mean()
  tokens = jnp.maximum(maskable_BxL.sum(), 1)
  aux = {"nelbo_nats": nelbo_B.mean(), "nelbo_nats_B": nelbo_B,
         "bits_per_token": nelbo_B.sum() / tokens / math.log(2.0),
         "corrupted_fraction": ((z_BxL != x_BxL) & maskable_BxL).sum() / tokens}
  return loss, aux


def _dynamic_weight(process: Hybrid, x_BxL, z_BxL, t_B, low, high):
  """GIDD's "dynamic" weighting (dvruette/gidd, gidd/loss.py): sigmoid(-tau) stands in for
  the log-SNR there, and B is divided by GIDD's vocabulary size, which counts the mask."""
  tau_B = process.schedule.one_minus_alpha(jnp.asarray(t_B))
  x_scale_B = (process.scale / (process.vocab_size + 1)
               * jnp.exp(process.gamma / 2 * jax.nn.sigmoid(-tau_B)))
  is_x = z_BxL == x_BxL
  is_mask = z_BxL == process.mask_id
  weight = jnp.where(is_x, x_scale_B[:, None], jnp.where(is_mask, 2.0, 1.0))
  return jnp.clip(weight, low, high)


def udlm_loss(
    apply_fn: ApplyFn,
    params: Any,
    key: Array,
    x_BxL: Array,
    *,
    process: Uniform,
    maskable_BxL: Array | None = None,
    t_min: float = 1e-5,
) -> tuple[Array, dict[str, Array]]:
  """UDLM's continuous-time NELBO (as DUO trains with it) of a batch under uniform noise, in
  nats per sequence: `gidd_loss(..., weighting="elbo")` with a `Uniform` process, whose
  integrand is UDLM's term by term (module docstring). Returns (loss, aux) as `gidd_loss`."""
  errors.check(isinstance(process, Uniform), "process", process,
               "a mdjax.noise.Uniform process (UDLM's loss is uniform noise's)")
  return gidd_loss(apply_fn, params, key, x_BxL, process=process, maskable_BxL=maskable_BxL,
                   t_min=t_min)
