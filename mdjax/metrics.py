"""Distribution-level metrics: token TV against a noise floor, p-values.

Per-sample checks (well-formed, correct) can all read 1.0 while the sampled
distribution is far from the data's; these statistics compare sets.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def token_histogram(tokens_NxL, vocab_size: int) -> np.ndarray:
  """The pooled token-id histogram (all positions pooled), normalised."""
  counts = np.bincount(np.asarray(tokens_NxL).reshape(-1), minlength=vocab_size)
  return counts / counts.sum()


def tvt(tokens_NxL, reference_MxL, vocab_size: int) -> float:
  """TVT: total variation between pooled token histograms of two sets."""
  h = token_histogram(tokens_NxL, vocab_size) - token_histogram(reference_MxL, vocab_size)
  return 0.5 * float(np.abs(h).sum())


def tvt_exact(tokens_NxL, marginals_LxV) -> float:
  """TVT against the exact pooled marginal (the mean of per-position laws)."""
  pooled = np.asarray(marginals_LxV, np.float64).mean(0)
  h = token_histogram(tokens_NxL, pooled.shape[-1]) - pooled
  return 0.5 * float(np.abs(h).sum())


def per_position_tv(tokens_NxL, reference_MxL, vocab_size: int) -> float:
  """Total variation of each position's histogram, averaged over positions."""
  x, r = np.asarray(tokens_NxL), np.asarray(reference_MxL)
  tvs = []
  for pos in range(x.shape[1]):
    hx = np.bincount(x[:, pos], minlength=vocab_size) / len(x)
    hr = np.bincount(r[:, pos], minlength=vocab_size) / len(r)
    tvs.append(0.5 * np.abs(hx - hr).sum())
  return float(np.mean(tvs))


def uniqueness(tokens_NxL) -> float:
  """Fraction of distinct rows."""
  x = np.asarray(tokens_NxL)
  return len({row.tobytes() for row in x}) / len(x)


def noise_floor(draw_data: Callable[[int], np.ndarray], n: int, vocab_size: int,
                repeats: int = 50, statistic=tvt) -> np.ndarray:
  """The statistic between pairs of independent data draws of size n.

  `draw_data(i)` returns the i-th independent data set of n rows. Returns the
  `repeats` values: their mean and spread are the floor a perfect sampler
  reaches with n samples.
  """
  return np.array([statistic(draw_data(2 * i), draw_data(2 * i + 1), vocab_size)
                   for i in range(repeats)])


def bootstrap_null(reference_MxL, n: int, vocab_size: int, repeats: int = 200,
                   seed: int = 0, statistic=tvt) -> np.ndarray:
  """The statistic between two size-n resamples (with replacement) of a reference.

  The bootstrap null for tasks with data but no generator; with a generator,
  `noise_floor` on fresh draws is the parametric form of the same null.
  """
  reference = np.asarray(reference_MxL)
  rng = np.random.default_rng(seed)
  pick = lambda: reference[rng.integers(0, len(reference), n)]
  return np.array([statistic(pick(), pick(), vocab_size) for _ in range(repeats)])


def p_value(observed: float, null_values: np.ndarray) -> float:
  """Monte Carlo p-value of `observed` under the null draws (larger = worse).

  (1 + #{null >= observed}) / (1 + R): the p-value for "the generated set is
  a fresh draw of the data", valid at any number R of null draws.
  """
  null_values = np.asarray(null_values)
  return float((1 + np.sum(null_values >= observed)) / (1 + len(null_values)))


def compare_to_data(tokens_NxL, reference_NxL, null_tvt: np.ndarray,
                    vocab_size: int) -> dict[str, float]:
  """TVT of a generated set against a data set, its floor and p-value."""
  observed = tvt(tokens_NxL, reference_NxL, vocab_size)
  return {
      "tvt": observed,
      "tvt_floor": float(np.mean(null_tvt)),
      "tvt_floor_std": float(np.std(null_tvt)),
      "p_value": p_value(observed, null_tvt),
  }
