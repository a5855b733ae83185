"""Log-likelihood of a token sequence longer than the model: disjoint windows, each given the
tokens before it (perplexity of a token file, lm-eval's `loglikelihood_rolling`).

The N tokens are cut into consecutive windows of `window` tokens (the last one shorter); window
k is scored by `loglikelihood` as the continuation of the `max_len - window` tokens before it
(fewer at the start). The sum is an estimate of

  sum_k ELBO(x_k | x_before_k)  <=  sum_k log p(x_k | x_before_k) = log p_window(x),

a lower bound on the log-likelihood of the sequence under the chain rule over windows, each
window conditioned on at most `max_len - window` preceding tokens (the model's own log p(x)
whenever N <= max_len and window = N). Windows of one shape share their draws (one
`loglikelihood` plan), so their error is that of the per-draw sum; shapes use independent keys.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np

from mdjax.evaluate.loglikelihood import draws, standard_error
from mdjax.models.checks import check_count


class RollingLogLikelihood(NamedTuple):
  """log p of the whole sequence (a lower bound's estimate, nats), its standard error, the
  tokens scored and the windows used."""

  estimate: float
  stderr: float
  num_tokens: int
  num_windows: int

  @property
  def nats_per_token(self) -> float:
    return self.estimate / self.num_tokens


def windows_of(num_tokens: int, max_len: int, window: int) -> list[tuple[int, int, int]]:
  """(context start, window start, window end) of each window: the context is the up to
  `max_len - window` tokens before the window."""
  budget = max_len - window
  return [(max(0, start - budget), start, min(start + window, num_tokens))
          for start in range(0, num_tokens, window)]


def loglikelihood_rolling(apply_fn, params: Any, tokens_N, *, max_len: int,
                          window: int | None = None, key: jax.Array, mask_id: int,
                          estimator: str = "stratified", num_samples: int = 64,
                          batch_size: int = 8, rows: int = 8, cfg_scale: float = 0.0,
                          eps: float = 1e-3) -> RollingLogLikelihood:
  """Estimate of log p(tokens_N) by disjoint windows (module docstring) and its standard error.

  window: the tokens scored per window (default max_len // 2, so every window after the first
  sees max_len // 2 tokens of context); window = max_len scores independent chunks.
  rows: windows per `loglikelihood` call (each denoiser call sees batch_size x rows rows);
  estimator, num_samples, batch_size, cfg_scale, eps: `loglikelihood`'s.
  """
  tokens_N = np.asarray(tokens_N)
  if tokens_N.ndim != 1 or len(tokens_N) == 0 or not np.issubdtype(tokens_N.dtype, np.integer):
    raise ValueError(f"tokens_N has shape {tokens_N.shape} and dtype {tokens_N.dtype}; "
                     "expected a non-empty 1-D array of token ids.")
  check_count("max_len", max_len, 1, " (the model's length)")
  window = max_len // 2 if window is None else window
  if isinstance(window, bool) or not isinstance(window, (int, np.integer)) \
      or not 1 <= window <= max_len:
    raise ValueError(f"window={window!r} must be an integer in [1, max_len={max_len}].")
  check_count("rows", rows)
  spans = windows_of(len(tokens_N), max_len, window)
  by_shape: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
  for span in spans:
    by_shape.setdefault((span[1] - span[0], span[2] - span[1]), []).append(span)
  estimate, variance = 0.0, 0.0
  for index, (shape, group) in enumerate(sorted(by_shape.items())):
    num_ctx, length = shape
    total_S = np.zeros(num_samples)
    for first in range(0, len(group), rows):
      part = group[first:first + rows]
      context = np.stack([tokens_N[c:s] for c, s, _ in part]).reshape(len(part), num_ctx)
      continuation = np.stack([tokens_N[s:e] for _, s, e in part])
      # One key per shape: every call of the group shares the draws.
      values_SxB = draws(apply_fn, params, context, continuation, estimator=estimator,
                         num_samples=num_samples, batch_size=batch_size,
                         key=jax.random.fold_in(key, index), mask_id=mask_id,
                         cfg_scale=cfg_scale, max_len=max_len, eps=eps)
      total_S += values_SxB.sum(1)
    estimate += float(total_S.mean())
    variance += float(standard_error(total_S[:, None])[0]) ** 2
  return RollingLogLikelihood(estimate, math.sqrt(variance), len(tokens_N), len(spans))
