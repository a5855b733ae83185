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

`check_greedy=True` adds LLaDA's `is_check_greedy` test (lm-eval's `is_greedy`): with the
whole continuation masked, does decoding one position per step, the most confident masked
position first with its argmax value, write exactly the continuation?
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.denoiser import Denoiser
from mdjax.models.checks import check_count
from mdjax.sampling.guidance import guided_logits

Array = jax.Array

ESTIMATORS = ("stratified", "antithetic", "iid")


class _Estimate(NamedTuple):
  estimate_B: np.ndarray
  stderr_B: np.ndarray


class LogLikelihood(_Estimate):
  """Per-row estimate of log p(continuation | context) in nats and its standard error.

  `is_greedy_B`: bool per row, whether greedy decoding of the masked continuation gives it
  (None unless asked, `check_greedy=True`). An attribute, not a tuple field: the value
  still unpacks as `estimate_B, stderr_B`.
  """

  def __new__(cls, estimate_B, stderr_B, is_greedy_B=None):
    self = super().__new__(cls, estimate_B, stderr_B)
    self.is_greedy_B = is_greedy_B
    return self

  def __repr__(self):
    return (f"LogLikelihood(estimate_B={self.estimate_B!r}, stderr_B={self.stderr_B!r}, "
            f"is_greedy_B={self.is_greedy_B!r})")


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


def denoiser_logits(apply_fn, params, noisy_NxL, t_N, valid_NxL, num_ctx: int, mask_id: int,
                    cfg_scale: float):
  """float32 logits of the noisy rows, with LLaDA's unsupervised guidance when cfg_scale > 0
  (the same pass with the context masked as well)."""
  call = lambda x, t, v: apply_fn(params, x, t) if v is None else apply_fn(params, x, t,
                                                                           valid_BxL=v)
  if not cfg_scale:
    return call(noisy_NxL, t_N, valid_NxL).astype(jnp.float32)
  bare_NxL = noisy_NxL.at[:, :num_ctx].set(mask_id)
  both = call(jnp.concatenate([noisy_NxL, bare_NxL]), jnp.concatenate([t_N, t_N]),
              None if valid_NxL is None else jnp.concatenate([valid_NxL, valid_NxL]))
  cond, bare = jnp.split(both.astype(jnp.float32), 2)
  return guided_logits(cond, bare, cfg_scale)  # the mask id's -inf stays -inf, not NaN


def _valid_of(context_valid_BxC, length: int):
  """The denoiser's validity mask: the context's, then the continuation (always valid)."""
  if context_valid_BxC is None:
    return None
  return jnp.concatenate([context_valid_BxC,
                          jnp.ones((len(context_valid_BxC), length), bool)], 1)


@functools.partial(jax.jit, static_argnames=("apply_fn", "estimator", "num_samples",
                                             "batch_size", "mask_id", "cfg_scale", "eps"))
def draw_values(apply_fn, params, key, context_BxC, continuation_BxT, context_valid_BxC, *,
                estimator, num_samples, batch_size, mask_id, cfg_scale, eps):
  """Each draw's weighted log-likelihood of each row: [S, B], one compiled program (the
  arguments unchecked: `draws` checks them)."""
  num_rows, num_ctx = context_BxC.shape
  length = continuation_BxT.shape[1]
  x_BxL = jnp.concatenate([context_BxC, continuation_BxT], 1).astype(jnp.int32)
  valid_BxL = _valid_of(context_valid_BxC, length)
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
    valid_NxL = None if valid_BxL is None else jnp.tile(valid_BxL, (batch_size, 1))
    logits_NxLxV = denoiser_logits(apply_fn, params, noisy_NxL, t_N, valid_NxL, num_ctx,
                                   mask_id, cfg_scale)
    logp_NxLxV = jax.nn.log_softmax(logits_NxLxV[:, num_ctx:], -1)
    target_NxT = jnp.broadcast_to(x_BxL[None, :, num_ctx:], (batch_size, num_rows, length))
    logp_NxT = jnp.take_along_axis(logp_NxLxV, target_NxT.reshape(-1, length)[..., None],
                                   -1)[..., 0]
    # where, not a product: a visible position's log-probability may be -inf.
    masked_NxT = mask_KxBxL[..., num_ctx:].reshape(-1, length)
    return jnp.where(masked_NxT, logp_NxT, 0.0).sum(-1).reshape(batch_size, num_rows)

  values_SxB = jax.lax.map(chunk, plan).reshape(num_samples, num_rows)
  return values_SxB * weight_S[:, None]


@functools.partial(jax.jit, static_argnames=("apply_fn", "mask_id", "cfg_scale"))
def _greedy(apply_fn, params, context_BxC, continuation_BxT, context_valid_BxC, *, mask_id,
            cfg_scale):
  """LLaDA's `suffix_greedy_prediction`: T steps from the masked continuation, each writing
  the argmax value at the most confident masked position (the first on a tie); bool_B."""
  num_rows, num_ctx = context_BxC.shape
  length = continuation_BxT.shape[1]
  valid_BxL = _valid_of(context_valid_BxC, length)
  x_BxL = jnp.concatenate([context_BxC, jnp.full((num_rows, length), mask_id, jnp.int32)], 1)

  def step(i, x_BxL):
    masked_BxT = x_BxL[:, num_ctx:] == mask_id
    # The fraction still masked, as the draws' t = count / T.
    t_B = jnp.full((num_rows,), (length - i) / length, jnp.float32)
    logits_BxLxV = denoiser_logits(apply_fn, params, x_BxL, t_B, valid_BxL, num_ctx, mask_id,
                                   cfg_scale)
    logp_BxTxV = jax.nn.log_softmax(logits_BxLxV[:, num_ctx:], -1)
    value_BxT = jnp.argmax(logp_BxTxV, -1).astype(jnp.int32)
    confidence_BxT = jnp.where(masked_BxT, jnp.max(logp_BxTxV, -1), -jnp.inf)
    write_BxT = masked_BxT & (jnp.arange(length) == jnp.argmax(confidence_BxT, -1)[:, None])
    return x_BxL.at[:, num_ctx:].set(jnp.where(write_BxT, value_BxT, x_BxL[:, num_ctx:]))

  x_BxL = jax.lax.fori_loop(0, length, step, x_BxL)
  return jnp.all(x_BxL[:, num_ctx:] == continuation_BxT, -1)


def _check(context_BxC, continuation_BxT, context_valid_BxC, *, estimator, num_samples,
           batch_size, mask_id, eps, max_len, apply_fn) -> None:
  """The arguments of `loglikelihood`, checked on the host: a ValueError names the bad one."""
  if continuation_BxT.ndim != 2 or continuation_BxT.shape[1] == 0 or len(continuation_BxT) == 0:
    raise ValueError(f"continuation_BxT has shape {continuation_BxT.shape}; expected [B >= 1, "
                     "T >= 1] (an empty continuation has no likelihood to estimate).")
  if context_BxC.ndim != 2 or len(context_BxC) != len(continuation_BxT):
    raise ValueError(f"context_BxC has shape {context_BxC.shape}; expected [B, C] with "
                     f"B = {len(continuation_BxT)} (the continuation's rows; C may be 0).")
  if context_valid_BxC is not None and context_valid_BxC.shape != context_BxC.shape:
    raise ValueError(f"context_valid_BxC has shape {context_valid_BxC.shape}; expected the "
                     f"context's {context_BxC.shape}.")
  if estimator not in ESTIMATORS:
    raise ValueError(f"estimator={estimator!r} is unknown; known estimators: {list(ESTIMATORS)}.")
  check_count("num_samples", num_samples)
  check_count("batch_size", batch_size)
  if num_samples % batch_size:
    raise ValueError(f"num_samples={num_samples} must be a multiple of batch_size={batch_size}.")
  check_count("mask_id", mask_id, 1, " (the vocabulary size V)")
  if not 0.0 < eps < 1.0:
    raise ValueError(f"eps={eps!r} must lie in (0, 1).")
  limit = max_len if max_len is not None else Denoiser.of(apply_fn).max_len
  total = context_BxC.shape[1] + continuation_BxT.shape[1]
  if limit is not None and total > limit:
    raise ValueError(f"context ({context_BxC.shape[1]}) + continuation "
                     f"({continuation_BxT.shape[1]}) = {total} tokens exceed the denoiser's "
                     f"max_len={limit}.")


def draws(apply_fn, params: Any, context_BxC, continuation_BxT, *, estimator: str = "stratified",
          num_samples: int = 64, batch_size: int = 8, key: Array, mask_id: int,
          cfg_scale: float = 0.0, max_len: int | None = None, eps: float = 1e-3,
          context_valid_BxC=None) -> np.ndarray:
  """The weighted draws behind `loglikelihood`'s estimate, float64 [num_samples, B] (their
  mean over draws is the estimate); for sums over rows that share the draws (rolling
  windows), whose standard error needs the draws themselves."""
  context_BxC, continuation_BxT = np.asarray(context_BxC), np.asarray(continuation_BxT)
  if context_valid_BxC is not None:
    context_valid_BxC = np.asarray(context_valid_BxC, bool)
  _check(context_BxC, continuation_BxT, context_valid_BxC, estimator=estimator,
         num_samples=num_samples, batch_size=batch_size, mask_id=mask_id, eps=eps,
         max_len=max_len, apply_fn=apply_fn)
  return np.asarray(draw_values(
      Denoiser.of(apply_fn), params, key, jnp.asarray(context_BxC, jnp.int32),
      jnp.asarray(continuation_BxT, jnp.int32),
      None if context_valid_BxC is None else jnp.asarray(context_valid_BxC),
      estimator=estimator, num_samples=int(num_samples), batch_size=int(batch_size),
      mask_id=int(mask_id), cfg_scale=float(cfg_scale), eps=float(eps)), np.float64)


def standard_error(values_SxB: np.ndarray) -> np.ndarray:
  """The sample standard deviation of S independent draws (axis 0) over sqrt(S), per row
  of the other axes (NaN for one draw): the standard error of their mean."""
  num_samples = len(values_SxB)
  with np.errstate(invalid="ignore"):  # an impossible continuation: -inf, stderr NaN
    return (values_SxB.std(0, ddof=1) / math.sqrt(num_samples) if num_samples > 1
            else np.full(np.shape(values_SxB)[1:], np.nan))


def loglikelihood(apply_fn, params: Any, context_BxC, continuation_BxT, *,
                  estimator: str = "stratified", num_samples: int = 64, batch_size: int = 8,
                  key: Array, mask_id: int, cfg_scale: float = 0.0, max_len: int | None = None,
                  eps: float = 1e-3, check_greedy: bool = False,
                  context_valid_BxC=None) -> LogLikelihood:
  """Estimate of log p(continuation | context) per row (a lower bound) and its standard error.

  Only continuation positions are masked; `num_samples` draws per row, `batch_size` draws per
  denoiser call (each call sees batch_size x B rows). `cfg_scale` > 0: LLaDA's unsupervised
  classifier-free guidance. `max_len` (default: the `Denoiser`'s, e.g. `model.denoiser`'s)
  bounds C + T. `eps`: the antithetic estimator's smallest masking probability (Dream's
  `sampling_eps`): without it the weight 1/t gives the estimate infinite variance wherever a
  lone masked token has a nonzero loss; it leaves out the bound's integral over [0, eps],
  at most eps times the summed single-position losses.

  stderr: the sample standard deviation of the draws over sqrt(num_samples) (NaN for one
  draw): exact for "iid"; for "stratified" and "antithetic" the draws are negatively
  correlated when a draw's value is monotone in its count or time, and it is then an upper
  bound on the error.

  check_greedy: also `is_greedy_B` (LLaDA's `is_check_greedy`, T more denoiser calls on B
  rows): from the continuation all masked, one position a step, the most confident masked
  position takes its argmax value; True where that writes the continuation.
  context_valid_BxC: False on left padding of the context (rows of different context
  lengths in one batch); passed to the denoiser as `valid_BxL`, which must then accept it.
  """
  values_SxB = draws(apply_fn, params, context_BxC, continuation_BxT, estimator=estimator,
                     num_samples=num_samples, batch_size=batch_size, key=key, mask_id=mask_id,
                     cfg_scale=cfg_scale, max_len=max_len, eps=eps,
                     context_valid_BxC=context_valid_BxC)
  is_greedy_B = None
  if check_greedy:
    valid = None if context_valid_BxC is None else jnp.asarray(np.asarray(context_valid_BxC,
                                                                          bool))
    is_greedy_B = np.asarray(_greedy(
        Denoiser.of(apply_fn), params, jnp.asarray(np.asarray(context_BxC), jnp.int32),
        jnp.asarray(np.asarray(continuation_BxT), jnp.int32), valid, mask_id=int(mask_id),
        cfg_scale=float(cfg_scale)))
  return LogLikelihood(values_SxB.mean(0), standard_error(values_SxB), is_greedy_B)
