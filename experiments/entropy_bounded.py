"""The entropy-bounded sampler on exact denoisers, beside confidence decoding at equal calls.

  python experiments/entropy_bounded.py [--n=2000] [--out=results]

Two-color (exact denoiser): the invalid fraction for gamma below and above ln 2. ScanAndAdd
M = 1 (exact denoiser, no learning error): for several gamma (steps = L bounds the run),
correctness, add-count validity, TVT against the data with its noise floor and p-value, and
the mean sequential calls per sample; beside it confidence decoding (max_prob, linear
counts) with K = that mean rounded. Writes results/entropy_bounded.{json,md}; fixed seeds.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script: configs/ and experiments/ live in the repo root
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import time

import jax
import numpy as np

from mdjax import metrics, report, sampling
from mdjax.tasks import scan_and_add as sa
from mdjax.tasks import two_color

GAMMAS = (0.001, 0.01, 0.1, 0.3, 1.0, 3.0)
TWO_COLOR_GAMMAS = (0.5, 1.0)  # below and above ln 2 = 0.693


def _row(sampler: str, knobs: dict, result, score) -> dict:
  return {"sampler": sampler, **knobs,
          "mean_calls": float(np.mean(np.asarray(result.rounds_B))),
          "max_calls": int(result.nfe), **score(np.asarray(result.tokens_BxL))}


def run(n: int, seed: int = 0, repeats: int = 200) -> dict:
  start = time.perf_counter()
  two_color_rows = []
  for i, gamma in enumerate(TWO_COLOR_GAMMAS):
    out = sampling.sample(two_color.exact_denoiser, None, jax.random.key(seed + i),
                          two_color.empty_canvas(10 * n),
                          sampling.EntropyBoundedSpec(steps=2, gamma=gamma))
    two_color_rows.append({"gamma": gamma, "n": 10 * n,
                           "invalid": float(two_color.invalid_fraction(out.tokens_BxL))})
  draw = lambda i: np.asarray(sa.sample_data(jax.random.key(90_000 + i), n))
  null_tvt = metrics.noise_floor(draw, n, sa.VOCAB_SIZE + 1, repeats=repeats)
  reference = draw(2 * repeats)

  def score(tokens):
    checks = sa.sample_metrics(tokens)
    return {"correct": checks["correct"], "add_count_valid": checks["add_count_valid"],
            **metrics.compare_to_data(tokens, reference, null_tvt, sa.VOCAB_SIZE + 1)}

  rows = []
  canvas = sa.empty_canvas(n)
  for i, gamma in enumerate(GAMMAS):
    key = jax.random.key(seed + 100 + i)
    eb = sampling.sample(sa.exact_denoiser, None, key, canvas,
                         sampling.EntropyBoundedSpec(steps=sa.LENGTH, gamma=gamma))
    rows.append(_row("entropy_bounded", {"gamma": gamma}, eb, score))
    steps = max(1, int(round(rows[-1]["mean_calls"])))
    conf = sampling.sample(sa.exact_denoiser, None, key, canvas,
                           sampling.ConfidenceSpec(steps=steps))
    rows.append(_row("confidence", {"steps": steps}, conf, score))
    print(rows[-2], rows[-1], flush=True)
  return {"two_color": two_color_rows, "rows": rows, "n": n,
          "seconds": round(time.perf_counter() - start, 1)}


def write(results: dict, out: str) -> None:
  report.write_json(os.path.join(out, "entropy_bounded.json"), results)
  text = ("# The entropy-bounded sampler (exact denoisers)\n\n"
          "Two-color, steps = 2 (invalid fraction; 0 means the two positions were never "
          "written together):\n\n"
          + report.markdown_table(results["two_color"], ["gamma", "n", "invalid"])
          + f"\n\nScanAndAdd M = 1, exact denoiser, {results['n']} samples a row; `mean_calls` "
          "is the mean number of sequential denoiser calls per sample (each row stops when "
          "its canvas is full), `max_calls` the batch's; confidence decoding runs K = "
          "mean_calls rounded:\n\n"
          + report.markdown_table(results["rows"], ["sampler", "gamma", "steps", "mean_calls",
                                                    "max_calls", "correct", "add_count_valid",
                                                    "tvt", "tvt_floor", "p_value"])
          + f"\n\nRun time: {results['seconds']} s.\n")
  report.write_text(os.path.join(out, "entropy_bounded.md"), text)


if __name__ == "__main__":
  report.experiment_main(__doc__, run, write, "entropy_bounded.md", default_n=2000)
