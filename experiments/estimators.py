"""Log-likelihood estimators against exact log-likelihoods, with exact denoisers.

  python experiments/estimators.py [--repeats=32] [--out=results]

For two-color (log p in closed form) and ScanAndAdd (log p of sampled sequences by the exact
denoiser's chain rule, checked against the law's closed form), each estimator of
`mdjax.evaluate.loglikelihood` at 1, 8 and 64 draws estimates log p(continuation | context)
of a fixed set of sequences, `repeats` times with independent keys; the continuation is the
whole sequence or its second half (the first half as context). A 32-token continuation, at
64 draws only (the sample count for 0.1 nat): two independent ScanAndAdd sequences side by
side (50 tokens; the exact denoiser of each half is the pair's, log p the sum), its last 32
tokens given the first 18. Writes results/estimators.json; fixed seed. About 2 minutes on a
2-core CPU.
"""

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from mdjax import evaluate, report, tasks
from mdjax.tasks import scan_and_add

SAMPLE_COUNTS = (1, 8, 64)
SEED = 0


def chain_rule_logp(tokens_NxL, first: int, params=scan_and_add.DEFAULT) -> np.ndarray:
  """log p(x[first:] | x[:first]) in nats: positions revealed left to right, each scored by
  the exact conditional given everything revealed so far (exact for an exact denoiser)."""
  x_NxL = np.asarray(tokens_NxL)
  canvas_NxL = x_NxL.copy()
  canvas_NxL[:, first:] = scan_and_add.MASK_ID
  logp_N = np.zeros(len(x_NxL))
  for pos in range(first, x_NxL.shape[1]):
    probs_NxLxV, _ = scan_and_add.exact_probs(jnp.asarray(canvas_NxL), params)
    logp_N += np.log(np.asarray(probs_NxLxV, np.float64)[np.arange(len(x_NxL)), pos,
                                                          x_NxL[:, pos]])
    canvas_NxL[:, pos] = x_NxL[:, pos]
  return logp_N


def pair_denoiser(unused_params, tokens_BxL, t_B):
  """The exact denoiser of two independent ScanAndAdd sequences side by side: each half's
  own (the halves share nothing, so a position's conditional reads only its half)."""
  batch, length = tokens_BxL.shape
  halves = tokens_BxL.reshape(batch * 2, length // 2)
  logits = scan_and_add.exact_denoiser(unused_params, halves, jnp.repeat(t_B, 2))
  return logits.reshape(batch, length, -1)


def measure(task, x_NxL, first, exact_N, repeats, name, continuation,
            sample_counts=SAMPLE_COUNTS, denoiser=None):
  """One row per (estimator, num_samples): mean estimate, exact, bias / stderr, variance."""
  rows = []
  for estimator in evaluate.ESTIMATORS:
    for num_samples in sample_counts:
      est_RxN = np.stack([evaluate.loglikelihood(
          denoiser or task.exact_denoiser, None, x_NxL[:, :first], x_NxL[:, first:],
          estimator=estimator,
          num_samples=num_samples, batch_size=min(num_samples, 8),
          key=jax.random.fold_in(jax.random.key(SEED), r), mask_id=task.mask_id).estimate_B
          for r in range(repeats)])
      # The repeats are independent (own keys); the rows of one repeat share its draws, so the
      # error of the mean is taken over the repeats' row-averaged errors.
      err_R = (est_RxN - exact_N[None]).mean(1)
      stderr = float(err_R.std(ddof=1) / math.sqrt(repeats))
      rows.append({
          "task": name, "denoiser": "exact", "estimator": estimator,
          "num_samples": num_samples, "continuation": continuation,
          "continuation_tokens": int(x_NxL.shape[1] - first), "sequences": int(len(x_NxL)),
          "repeats": repeats, "mean_estimate": float(est_RxN.mean()),
          "exact": float(exact_N.mean()), "stderr": stderr,
          "bias_over_stderr": float(err_R.mean() / stderr) if stderr > 0 else None,
          # Variance of one row's estimate times the draws: one draw's worth of variance.
          "variance_per_sample": float(num_samples * est_RxN.var(0, ddof=1).mean())})
  return rows


def run(repeats: int) -> dict:
  start = time.time()
  rows = []
  two_color = tasks.get("two_color")
  x_Nx2 = np.asarray(two_color.sample_data(jax.random.key(SEED), 8))
  # Two-color: log p(x) = -ln 2; the second color given the first is certain.
  rows += measure(two_color, x_Nx2, 0, np.full(len(x_Nx2), -math.log(2.0)), repeats,
                  "two_color", "whole")
  rows += measure(two_color, x_Nx2, 1, np.zeros(len(x_Nx2)), repeats, "two_color",
                  "second_half")
  sa = tasks.get("scan_and_add")
  x_NxL = np.asarray(sa.sample_data(jax.random.key(SEED + 1), 16))
  half = sa.length // 2
  whole_N, second_N = chain_rule_logp(x_NxL, 0), chain_rule_logp(x_NxL, half)
  # The law is uniform on its support: the chain rule must give its closed form.
  np.testing.assert_allclose(whole_N, scan_and_add.log_prob(x_NxL), rtol=1e-4)
  rows += measure(sa, x_NxL, 0, whole_N, repeats, "scan_and_add", "whole")
  rows += measure(sa, x_NxL, half, second_N, repeats, "scan_and_add", "second_half")
  # Pairs: the rows above with the next row after them; the last 32 tokens are the first
  # sequence's last 7 and the whole second one.
  length = sa.length
  pairs_Nx2L = np.concatenate([x_NxL, np.roll(x_NxL, -1, 0)], 1)
  first = 2 * length - 32
  pair_N = chain_rule_logp(x_NxL, first) + scan_and_add.log_prob(np.roll(x_NxL, -1, 0))
  rows += measure(sa, pairs_Nx2L, first, pair_N, repeats, "scan_and_add_pair", "last_32",
                  sample_counts=(64,), denoiser=pair_denoiser)
  return {"seed": SEED, "seconds": round(time.time() - start, 1), "rows": rows}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=32, help="independent keys per point")
  parser.add_argument("--out", default="results", help="output directory")
  args = parser.parse_args()
  results = run(args.repeats)
  report.write_json(f"{args.out}/estimators.json", results)
  columns = ["task", "continuation", "estimator", "num_samples", "mean_estimate", "exact",
             "stderr", "bias_over_stderr", "variance_per_sample"]
  print(report.markdown_table(results["rows"], columns))
  print(f"{results['seconds']} s")


if __name__ == "__main__":
  main()
