"""The ELBO of sequences under a denoiser, and exact likelihoods of a causal model.

`nelbo_estimate`: the MD4 NELBO of fixed sequences in bits per token, averaged over a
configurable number of Monte Carlo draws of (time, mask), with the standard error of
that Monte Carlo average. `discrete_nelbo`: MD4's T-step discrete-time NELBO, every one of
the T steps evaluated (no Monte Carlo over time; one mask draw per step).
`windows_nelbo`: the NELBO of a token stream cut into windows,
as MDLM and BD3-LM report it (nats and bits per token, the perplexity bound), with a
standard error over independent batches. `causal_bits`: exact -log2 p(x) of sequences under a causal
(left-to-right) reference model, the "generative bits per character" of samples.
`causal_sample`: ancestral left-to-right samples of such a model.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mdjax import diffusion
from mdjax.evaluate.loglikelihood import standard_error
from mdjax.models.checks import check_count

Array = jax.Array


def _batches(x_NxL: np.ndarray, batch_size: int):
  for start in range(0, len(x_NxL), batch_size):
    yield x_NxL[start:start + batch_size]


def nelbo_estimate(apply_fn, params: Any, x_NxL, *, schedule: diffusion.Schedule, mask_id: int,
                   time_samples: int = 4, batch_size: int = 256, seed: int = 0,
                   block_size: int | None = None) -> dict:
  """NELBO of the rows of `x_NxL`, in bits per token, with its Monte Carlo standard error.

  Each of `time_samples` replicates evaluates every row once at its own (antithetic)
  times and masks; the estimate is the replicates' mean and `se` the standard deviation
  of the replicate means over sqrt(time_samples) (replicates are independent). `se` is the
  estimator's noise for this fixed set of rows, not the sampling error of the rows.
  With `block_size` it is the block-diffusion NELBO (`diffusion.block_nelbo_loss`, the
  full time range) of a block-causal denoiser.
  """
  x_NxL = np.asarray(x_NxL)
  if time_samples < 2:
    raise ValueError(f"time_samples={time_samples!r} must be >= 2 to give a standard error.")
  if x_NxL.ndim != 2 or len(x_NxL) == 0:
    raise ValueError(f"x_NxL has shape {x_NxL.shape}; expected [N >= 1, L].")
  if block_size is None:
    objective = functools.partial(diffusion.nelbo_loss, apply_fn)
  else:
    objective = functools.partial(diffusion.block_nelbo_loss, apply_fn, block_size=block_size)
  loss = jax.jit(lambda p, k, x: objective(p, k, x, schedule=schedule,
                                           mask_id=mask_id)[1]["nelbo_nats_B"])
  replicate_means = []
  for r in range(time_samples):
    key = jax.random.fold_in(jax.random.key(seed), r)
    total = sum(float(loss(params, jax.random.fold_in(key, i), x).sum())
                for i, x in enumerate(_batches(x_NxL, batch_size)))
    replicate_means.append(total / x_NxL.size / math.log(2.0))
  means = np.array(replicate_means)
  return {"bits_per_token": float(means.mean()), "se": float(standard_error(means)),
          "time_samples": time_samples, "sequences": int(len(x_NxL))}


def discrete_nelbo(apply_fn, params: Any, x_NxL, *, schedule: diffusion.Schedule,
                   mask_id: int, num_steps: int, samples: int = 4, batch_size: int = 64,
                   steps_per_call: int = 64, seed: int = 0) -> dict:
  """MD4's discrete-time NELBO of the rows of `x_NxL` with T = `num_steps` steps, in nats.

  The T-step reverse process unmasks from t_i = i / T to s_i = (i - 1) / T; its NELBO is the
  sum over all T steps of (alpha(s_i) - alpha(t_i)) / (1 - alpha(t_i)) times the masked
  tokens' -log p(x_l | z_{t_i}), z_{t_i} ~ q(z_t | x) (the t = 0 reconstruction term is 0,
  alpha(0) = 1; like `diffusion.nelbo_loss` the prior term at t = 1 is left out). Every step
  is evaluated: time is summed exactly, and only the mask z_{t_i} of each step is drawn, one
  independent draw per (row, step, sample). The bound is >= the continuous-time NELBO and
  decreases to it as T grows (tokens unmasked in the same step are predicted independently);
  for an exact denoiser the continuous bound is -log p(x).

  Each of `samples` replicates sums the T steps of every row with its own masks; the row's
  estimate is the replicates' mean and its standard error their standard deviation over
  sqrt(samples). `steps_per_call` steps of `batch_size` rows go through one denoiser call
  (steps_per_call x batch_size rows); the last call of a row batch may hold fewer steps.

  Returns {nelbo_nats_N, se_N (per row), nelbo_nats (mean per sequence), se (of that mean:
  the replicates' row means are independent), bits_per_token, se_bits_per_token, num_steps,
  samples, sequences}. `se` is the estimator's noise for these rows, not their sampling error.
  """
  x_NxL = np.asarray(x_NxL)
  if x_NxL.ndim != 2 or len(x_NxL) == 0 or not np.issubdtype(x_NxL.dtype, np.integer):
    raise ValueError(f"x_NxL has shape {x_NxL.shape} and dtype {x_NxL.dtype}; expected a 2-D "
                     "integer array [N >= 1, L] of token ids.")
  check_count("num_steps", num_steps)
  check_count("samples", samples, 2, " (two replicates give a standard error)")
  check_count("batch_size", batch_size)
  check_count("steps_per_call", steps_per_call)
  check_count("mask_id", mask_id, 1, " (the vocabulary size V)")
  if ((x_NxL < 0) | (x_NxL >= mask_id)).any():
    raise ValueError(f"x_NxL holds ids outside [0, {mask_id}) (mask_id={mask_id}); the rows "
                     "must be clean token ids.")
  schedule = diffusion.as_schedule(schedule)
  # Host plan in float64: step i's weight (alpha(s) - alpha(t)) / (1 - alpha(t)).
  t_T = np.arange(1, num_steps + 1) / num_steps
  oma_t, oma_s = schedule.one_minus_alpha(t_T), schedule.one_minus_alpha(t_T - 1 / num_steps)
  weight_T = ((oma_t - oma_s) / oma_t).astype(np.float32)
  alpha_T = (1.0 - oma_t).astype(np.float32)
  chunk = min(steps_per_call, num_steps)
  pad = -num_steps % chunk  # steps of weight 0 fill the last call of each row batch
  weight_T, alpha_T = np.pad(weight_T, (0, pad)), np.pad(alpha_T, (0, pad), constant_values=1)
  t_T = np.pad(t_T, (0, pad), constant_values=1.0).astype(np.float32)
  loss = _discrete_steps(apply_fn, mask_id)
  per_row_RxN = np.zeros((samples, len(x_NxL)))
  for r in range(samples):
    for b, start in enumerate(range(0, len(x_NxL), batch_size)):
      x_BxL = jnp.asarray(x_NxL[start:start + batch_size])
      key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), r), b)
      total_B = 0.0
      for c in range(0, num_steps + pad, chunk):
        total_B = total_B + np.asarray(loss(params, key, x_BxL, jnp.arange(c, c + chunk),
                                            t_T[c:c + chunk], alpha_T[c:c + chunk],
                                            weight_T[c:c + chunk]), np.float64)
      per_row_RxN[r, start:start + len(x_BxL)] = total_B
  row_se_N = standard_error(per_row_RxN)
  means_R = per_row_RxN.mean(1)
  nats, se = float(means_R.mean()), float(standard_error(means_R))
  per_token = x_NxL.shape[1] * math.log(2.0)
  return {"nelbo_nats_N": per_row_RxN.mean(0), "se_N": row_se_N, "nelbo_nats": nats,
          "se": se, "bits_per_token": nats / per_token, "se_bits_per_token": se / per_token,
          "num_steps": int(num_steps), "samples": int(samples), "sequences": int(len(x_NxL))}


@functools.lru_cache(maxsize=None)
def _discrete_steps(apply_fn, mask_id: int):
  """One compiled call: the weighted masked NLL of S steps of a row batch, summed over them
  ([B]); step i's masks come from fold_in(key, i), so they do not depend on the chunking."""

  @jax.jit
  def loss(params, key, x_BxL, i_S, t_S, alpha_S, weight_S):
    steps, (batch, length) = i_S.shape[0], x_BxL.shape
    keep_SxBxL = jax.vmap(lambda i, a: jax.random.uniform(
        jax.random.fold_in(key, i), (batch, length)) < a)(i_S, alpha_S)
    x_SxBxL = jnp.broadcast_to(x_BxL, (steps, batch, length))
    z = jnp.where(keep_SxBxL, x_SxBxL, mask_id).reshape(steps * batch, length)
    logits = apply_fn(params, z, jnp.repeat(t_S, batch))
    _, nll = diffusion.masked_nll(logits, x_SxBxL.reshape(steps * batch, length), z, mask_id)
    return (weight_S[:, None] * nll.sum(-1).reshape(steps, batch)).sum(0)

  return loss


def windows_nelbo(apply_fn, params: Any, windows_NxL, *, batch_size: int,
                  num_batches: int | None = None, key: Array, schedule: diffusion.Schedule,
                  t_min: float = 1e-3, t_max: float = 1.0, block_size: int | None = None,
                  first_maskable: bool = True) -> dict:
  """The NELBO of `windows_NxL` (rows of token ids), per token, as the papers report it.

  Batch b holds rows [b B, (b + 1) B) and draws its times and masks from fold_in(key, b):
  block_size None: `diffusion.nelbo_loss` (MDLM: antithetic t over the batch in
  [t_min, 1]); else `diffusion.block_nelbo_loss` (BD3-LM: antithetic t over the batch's
  blocks in [t_min, t_max], one pass over [x_t; x_0]). `first_maskable=False` keeps each
  row's first token visible and uncounted (BD3-LM's `ignore_bos`). The estimate is the
  summed NELBO over the counted tokens; the mean of equal-sized batches' per-token values.

  stderr: the batches are independent (disjoint rows, independent keys), so their per-token
  values r_b are i.i.d. estimates of the same mean (rows drawn from the data, times and masks
  from the schedule) and the standard error of their mean is std(r_b) / sqrt(n_batches) (it
  holds both the Monte Carlo and the data's spread; the antithetic times couple the rows of a
  batch, so rows are not independent and per-row errors would be wrong). NaN for 1 batch.

  Returns {nelbo_nats_per_token, bits_per_token, perplexity_bound (exp of the nats),
  num_tokens (counted), num_batches, stderr (nats per token), stderr_bits}.
  """
  x_NxL = np.asarray(windows_NxL)
  if x_NxL.ndim != 2 or not np.issubdtype(x_NxL.dtype, np.integer):
    raise ValueError(f"windows_NxL has shape {x_NxL.shape} and dtype {x_NxL.dtype}; it must be "
                     "a 2-D integer array of token ids.")
  check_count("batch_size", batch_size)
  available = len(x_NxL) // batch_size
  if available < 1:
    raise ValueError(f"batch_size={batch_size} is larger than the {len(x_NxL)} windows.")
  if num_batches is None:
    num_batches = available
  if not (isinstance(num_batches, (int, np.integer)) and 1 <= num_batches <= available):
    raise ValueError(f"num_batches={num_batches!r} must be an integer in [1, {available}] "
                     f"({len(x_NxL)} windows of batch_size={batch_size}).")
  maskable_BxL = np.ones((batch_size, x_NxL.shape[1]), bool)
  if not first_maskable:
    maskable_BxL[:, 0] = False
  if block_size is None:
    objective = functools.partial(diffusion.nelbo_loss, apply_fn, t_min=t_min)
  else:
    objective = functools.partial(diffusion.block_nelbo_loss, apply_fn, block_size=block_size,
                                  t_min=t_min, t_max=t_max)
  loss = jax.jit(lambda p, k, x: objective(p, k, x, schedule=schedule, mask_id=_mask_id(
      apply_fn, p, x), maskable_BxL=maskable_BxL)[1]["nelbo_nats_B"].sum())
  tokens = int(maskable_BxL.sum())
  per_token = np.array([float(loss(params, jax.random.fold_in(key, b),
                                   x_NxL[b * batch_size:(b + 1) * batch_size])) / tokens
                        for b in range(num_batches)])
  nats = float(per_token.mean())
  stderr = float(standard_error(per_token))  # NaN for one batch
  return {"nelbo_nats_per_token": nats, "bits_per_token": nats / math.log(2.0),
          "perplexity_bound": math.exp(nats), "num_tokens": tokens * num_batches,
          "num_batches": int(num_batches), "stderr": stderr,
          "stderr_bits": stderr / math.log(2.0)}


def _mask_id(apply_fn, params, x_BxL) -> int:
  """The mask id V: the denoiser's logits per position (a static shape)."""
  return int(jax.eval_shape(apply_fn, params, x_BxL, jnp.ones(x_BxL.shape[:1])).shape[-1])


def causal_bits(apply_fn, params: Any, x_NxL, *, start_id: int, batch_size: int = 256
                ) -> np.ndarray:
  """-log2 p(x) of each row under a causal model (start_id before the first token)."""
  nll = jax.jit(lambda p, x: diffusion.causal_lm_loss(
      apply_fn, p, None, x, start_id=start_id)[1]["nll_nats_B"])
  return np.concatenate([np.asarray(nll(params, jnp.asarray(x)))
                         for x in _batches(np.asarray(x_NxL), batch_size)]) / math.log(2.0)


@functools.partial(jax.jit, static_argnames=("apply_fn", "batch", "length", "start_id"))
def causal_sample(apply_fn, params: Any, key: Array, *, batch: int, length: int, start_id: int,
                  temperature: float = 1.0) -> Array:
  """Left-to-right ancestral samples of a causal model: one `lax.scan` of `length` calls."""

  def step(inputs_BxL, i):
    logits_BxV = apply_fn(params, inputs_BxL, jnp.zeros((batch,)))[:, i]
    token_B = jax.random.categorical(jax.random.fold_in(key, i), logits_BxV / temperature)
    # Position i's token becomes the input of position i + 1 (dropped after the last).
    nxt_BxL = jax.lax.dynamic_update_slice(
        inputs_BxL, token_B[:, None].astype(inputs_BxL.dtype), (0, jnp.minimum(i + 1, length - 1)))
    return jnp.where(i + 1 < length, nxt_BxL, inputs_BxL), token_B

  inputs_BxL = jnp.full((batch, length), start_id, jnp.int32)
  _, tokens_LxB = jax.lax.scan(step, inputs_BxL, jnp.arange(length))
  return tokens_LxB.T
