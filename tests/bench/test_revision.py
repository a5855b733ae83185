"""`python -m mdjax.bench.revision` at a tiny size: the JSON's rows and the closed forms.

Tolerance: a row's invalid fraction over N independent rows has standard error
sqrt(p(1-p)/N) at the exact p; within 4 of them a fixed-seed check misses with probability
about 6e-5 (normal approximation). The row's own `stderr` is the plug-in estimate, so the
check uses the exact p's.
"""

import json
import math

import pytest

from mdjax.bench import revision

KEYS = {"task", "process", "sampler", "steps", "invalid", "stderr", "exact"}


@pytest.mark.slow
def test_tiny_bench_writes_rows_within_four_standard_errors_of_the_exact_values(tmp_path):
  rows_per_point = 4000
  out = tmp_path / "revision.json"
  revision.main(["--sizes=tiny", f"--rows={rows_per_point}", f"--out={out}"], log=lambda *_: None)
  results = json.loads(out.read_text())
  assert (tmp_path / "revision.png").stat().st_size > 0
  rows = results["rows"]
  assert rows and all(set(r) == KEYS for r in rows)
  closed = [r for r in rows if r["process"] == "uniform" and r["sampler"] == "uniform_ancestral"]
  assert [r["steps"] for r in closed] == [1, 2, 4]
  for r in rows:
    if r["exact"] is None:
      continue
    p = r["exact"]
    assert abs(r["invalid"] - p) <= 4 * math.sqrt(p * (1 - p) / rows_per_point) + 1e-12, r
  for r in closed:
    assert r["exact"] == pytest.approx(float(revision.two_color_uniform_invalid(r["steps"])))
  assert {r["sampler"] for r in rows} >= {"ancestral", "confidence", "remask",
                                          "uniform_ancestral", "diffusion_gemma"}
