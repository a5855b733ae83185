"""Two-color oracle: invalid fraction of ancestral sampling against 1/(2K).

  python experiments/two_color_oracle.py [--n=20000] [--out=results]

Writes results/two_color_oracle.{json,md,png}; fixed seed, regenerated from
scratch by this one command.
"""

import math

import jax
import numpy as np

from mdjax import report, sampling
from mdjax.tasks import two_color

STEP_COUNTS = (1, 2, 4, 8, 16, 32)
UNEQUAL_GRID = (1.0, 0.9, 0.6, 0.1, 0.0)


def invalid(spec, n: int, seed: int) -> float:
  result = sampling.sample(two_color.exact_denoiser, None, jax.random.key(seed),
                           two_color.empty_canvas(n), spec)
  return float(two_color.invalid_fraction(result.tokens_BxL))


def run(n: int, seed: int = 0) -> dict:
  rows = [{"K": k, "n": n, "invalid_fraction": invalid(sampling.AncestralSpec(steps=k), n, seed + k),
           "theory": 1.0 / (2 * k)} for k in STEP_COUNTS]
  widths = [round(float(w), 12) for w in -np.diff(UNEQUAL_GRID)]
  unequal = {"widths": widths,
             "invalid_fraction": invalid(sampling.AncestralSpec(steps=len(widths),
                                                                grid=UNEQUAL_GRID), n, seed + 100),
             "theory": 0.5 * sum(w * w for w in widths)}
  sequential = invalid(sampling.RandomOrderSpec(), n, seed + 200)
  return {"ancestral_uniform": rows, "unequal_grid": unequal,
          "sequential_invalid_fraction": sequential}


def write(results: dict, out: str) -> None:
  report.write_json(f"{out}/two_color_oracle.json", results)
  rows = [dict(r, stderr=math.sqrt(r["theory"] * (1 - r["theory"]) / r["n"]))
          for r in results["ancestral_uniform"]]
  text = "# Two-color oracle: ancestral sampling with an exact denoiser\n\n"
  text += report.markdown_table(rows, ["K", "n", "invalid_fraction", "theory", "stderr"])
  u = results["unequal_grid"]
  text += (f"\nUnequal grid, widths {u['widths']}: invalid {u['invalid_fraction']:.4f}, "
           f"theory (1/2) sum w^2 = {u['theory']:.4f}.\n\nExact sequential (random order, "
           f"one position per step): invalid {results['sequential_invalid_fraction']}.\n")
  report.write_text(f"{out}/two_color_oracle.md", text)
  fig, ax = report.new_figure(figsize=(5, 3.5))
  ks = np.array([r["K"] for r in rows])
  ax.errorbar(ks, [r["invalid_fraction"] for r in rows], yerr=[4 * r["stderr"] for r in rows],
              fmt="o", label="ancestral, exact denoiser (±4 s.e.)")
  fine = np.geomspace(1, ks.max(), 100)
  ax.plot(fine, 1 / (2 * fine), "-", label="theory 1/(2K)")
  ax.set(xscale="log", yscale="log", xlabel="steps K", ylabel="invalid fraction",
         title="two-color: 'red blue' / 'blue red' rate")
  ax.legend()
  report.save_figure(fig, f"{out}/two_color_oracle.png")


def main():
  report.experiment_main(__doc__, run, write, "two_color_oracle.md", default_n=20_000)


if __name__ == "__main__":
  main()
