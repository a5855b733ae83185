"""Monte Carlo log-likelihood of a continuation given its context (multiple-choice scoring).

`loglikelihood` estimates log p(continuation | context) of each row by minus the NELBO with
only the continuation's T positions maskable: a lower bound, tight in expectation for an
exact denoiser. Three estimators of the same bound:

  iid         LLaDA's: the number of masked positions l ~ U{1..T} drawn independently per
              draw, a uniform subset of that size masked, weight T / l;
  stratified  LLaDA's `get_log_likelihood.py`: the draws' counts evenly cover 1..T from one
              random offset (each count still uniform on 1..T), weight T / l;
  antithetic  Dream's eval: times in pairs (t, 1 - t), each position masked with probability
              p = eps + (1 - eps) t, weight (1 - eps) / p (eps bounds the weight, see below).

Every row uses the same draws (common random numbers), so a row's estimate does not depend on
the batch it is in, and differences between candidate continuations of one context are less
noisy than the estimates themselves.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.denoiser import Denoiser

Array = jax.Array

ESTIMATORS = ("stratified", "antithetic", "iid")


class LogLikelihood(NamedTuple):
  """Per-row estimate of log p(continuation | context) in nats and its standard error."""

  estimate_B: np.ndarray
  stderr_B: np.ndarray


def _plan(key: Array, estimator: str, num_samples: int, length: int, eps: float):
  """Masks, weights and times of every draw: (mask_SxT, weight_S, t_S)."""
  k_count, k_perm = jax.random.split(key)
  if estimator == "antithetic":
    u_P = jax.random.uniform(k_count, ((num_samples + 1) // 2,))
    # Draw 2i has time u_i, draw 2i + 1 time 1 - u_i (an odd last draw stays unpaired).
    t_S = jnp.stack([u_P, 1.0 - u_P], -1).reshape(-1)[:num_samples]
    p_S = eps + (1.0 - eps) * t_S
    mask_SxT = jax.random.uniform(k_perm, (num_samples, length)) < p_S[:, None]
    # (1 - eps) is the Jacobian of t -> p: the estimate is the integral over p in [eps, 1].
    return mask_SxT, (1.0 - eps) / p_S, p_S
  if estimator == "iid":
    count_S = jax.random.randint(k_count, (num_samples,), 1, length + 1)
  else:  # stratified: offsets j T / S from one uniform start, wrapped into 1..T
    start = jax.random.randint(k_count, (), 1, length + 1)
    offset_S = jnp.floor(jnp.arange(num_samples) * length / num_samples + 0.5).astype(jnp.int32)
    count_S = (start - 1 + offset_S) % length + 1
  # A uniform subset of `count` positions: those whose random rank is below it.
  rank_SxT = jnp.argsort(jax.random.uniform(k_perm, (num_samples, length)), axis=-1).argsort(-1)
  mask_SxT = rank_SxT < count_S[:, None]
  return mask_SxT, length / count_S, count_S / length


@functools.partial(jax.jit, static_argnames=("apply_fn", "estimator", "num_samples",
                                             "batch_size", "mask_id", "cfg_scale", "eps"))
def _draw_values(apply_fn, params, key, context_BxC, continuation_BxT, *, estimator,
                 num_samples, batch_size, mask_id, cfg_scale, eps):
  """Each draw's weighted log-likelihood of each row: [S, B], one compiled program."""
  num_rows, num_ctx = context_BxC.shape
  length = continuation_BxT.shape[1]
  x_BxL = jnp.concatenate([context_BxC, continuation_BxT], 1).astype(jnp.int32)
  mask_SxT, weight_S, t_S = _plan(key, estimator, num_samples, length, eps)
  chunks = num_samples // batch_size
  plan = (mask_SxT.reshape(chunks, batch_size, length), t_S.reshape(chunks, batch_size))

  def chunk(args):
    mask_KxT, t_K = args
    mask_KxBxL = jnp.concatenate([jnp.zeros((batch_size, num_rows, num_ctx), bool),
                                  jnp.broadcast_to(mask_KxT[:, None], (batch_size, num_rows,
                                                                       length))], -1)
    noisy_NxL = jnp.where(mask_KxBxL, mask_id, x_BxL[None]).reshape(-1, num_ctx + length)
    t_N = jnp.repeat(t_K, num_rows)
    if cfg_scale:
      # LLaDA's unsupervised guidance: the same pass with the context masked as well.
      bare_NxL = noisy_NxL.at[:, :num_ctx].set(mask_id)
      both = apply_fn(params, jnp.concatenate([noisy_NxL, bare_NxL]),
                      jnp.concatenate([t_N, t_N])).astype(jnp.float32)
      cond, bare = jnp.split(both, 2)
      logits_NxLxV = bare + (cfg_scale + 1.0) * (cond - bare)
    else:
      logits_NxLxV = apply_fn(params, noisy_NxL, t_N).astype(jnp.float32)
    logp_NxLxV = jax.nn.log_softmax(logits_NxLxV[:, num_ctx:], -1)
    target_NxT = jnp.broadcast_to(x_BxL[None, :, num_ctx:], (batch_size, num_rows, length))
    logp_NxT = jnp.take_along_axis(logp_NxLxV, target_NxT.reshape(-1, length)[..., None],
                                   -1)[..., 0]
    # where, not a product: a visible position's log-probability may be -inf.
    masked_NxT = mask_KxBxL[..., num_ctx:].reshape(-1, length)
    return jnp.where(masked_NxT, logp_NxT, 0.0).sum(-1).reshape(batch_size, num_rows)

  values_SxB = jax.lax.map(chunk, plan).reshape(num_samples, num_rows)
  return values_SxB * weight_S[:, None]


def _max_len(apply_fn) -> int | None:
  for fn in (apply_fn, getattr(apply_fn, "apply", None)):
    value = getattr(fn, "max_len", None)
    if isinstance(value, (int, np.integer)):
      return int(value)
  return None


def loglikelihood(apply_fn, params: Any, context_BxC, continuation_BxT, *,
                  estimator: str = "stratified", num_samples: int = 64, batch_size: int = 8,
                  key: Array, mask_id: int, cfg_scale: float = 0.0, max_len: int | None = None,
                  eps: float = 1e-3) -> LogLikelihood:
  """Estimate of log p(continuation | context) per row (a lower bound) and its standard error.

  Only continuation positions are masked; `num_samples` draws per row, `batch_size` draws per
  denoiser call (each call sees batch_size x B rows). `cfg_scale` > 0: LLaDA's unsupervised
  classifier-free guidance. `max_len` (default: the denoiser's `max_len` attribute, if any)
  bounds C + T. `eps`: the antithetic estimator's smallest masking probability (Dream's
  `sampling_eps`): without it the weight 1/t gives the estimate infinite variance wherever a
  lone masked token has a nonzero loss; it leaves out the bound's integral over [0, eps],
  at most eps times the summed single-position losses.

  stderr: the sample standard deviation of the draws over sqrt(num_samples) (NaN for one
  draw): exact for "iid"; for "stratified" and "antithetic" the draws are negatively
  correlated when a draw's value is monotone in its count or time, and it is then an upper
  bound on the error.
  """
  context_BxC, continuation_BxT = np.asarray(context_BxC), np.asarray(continuation_BxT)
  if continuation_BxT.ndim != 2 or continuation_BxT.shape[1] == 0 or len(continuation_BxT) == 0:
    raise ValueError(f"continuation_BxT has shape {continuation_BxT.shape}; expected [B >= 1, "
                     "T >= 1] (an empty continuation has no likelihood to estimate).")
  if context_BxC.ndim != 2 or len(context_BxC) != len(continuation_BxT):
    raise ValueError(f"context_BxC has shape {context_BxC.shape}; expected [B, C] with "
                     f"B = {len(continuation_BxT)} (the continuation's rows; C may be 0).")
  if estimator not in ESTIMATORS:
    raise ValueError(f"estimator={estimator!r} is unknown; known estimators: {list(ESTIMATORS)}.")
  for name, value in (("num_samples", num_samples), ("batch_size", batch_size)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name}={value!r} must be an integer >= 1.")
  if num_samples % batch_size:
    raise ValueError(f"num_samples={num_samples} must be a multiple of batch_size={batch_size}.")
  if not isinstance(mask_id, (int, np.integer)) or isinstance(mask_id, bool) or mask_id < 1:
    raise ValueError(f"mask_id={mask_id!r} must be an integer >= 1 (the vocabulary size V).")
  if not 0.0 < eps < 1.0:
    raise ValueError(f"eps={eps!r} must lie in (0, 1).")
  limit = max_len if max_len is not None else _max_len(apply_fn)
  total = context_BxC.shape[1] + continuation_BxT.shape[1]
  if limit is not None and total > limit:
    raise ValueError(f"context ({context_BxC.shape[1]}) + continuation "
                     f"({continuation_BxT.shape[1]}) = {total} tokens exceed the denoiser's "
                     f"max_len={limit}.")
  values_SxB = np.asarray(_draw_values(
      Denoiser.of(apply_fn), params, key, jnp.asarray(context_BxC, jnp.int32),
      jnp.asarray(continuation_BxT, jnp.int32), estimator=estimator,
      num_samples=int(num_samples), batch_size=int(batch_size), mask_id=int(mask_id),
      cfg_scale=float(cfg_scale), eps=float(eps)), np.float64)
  with np.errstate(invalid="ignore"):  # an impossible continuation: -inf, stderr NaN
    stderr_B = (values_SxB.std(0, ddof=1) / math.sqrt(num_samples) if num_samples > 1
                else np.full(values_SxB.shape[1], np.nan))
  return LogLikelihood(values_SxB.mean(0), stderr_B)
