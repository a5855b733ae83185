"""Smoke tests of the experiment scripts: schema and values at small sizes."""

import json
import math

import numpy as np

from experiments import scan_and_add_oracle, two_color_oracle
from mdjax import sampling


def test_two_color_experiment_schema_and_theory(tmp_path):
  results = two_color_oracle.run(n=4000)
  two_color_oracle.write(results, str(tmp_path))
  data = json.loads((tmp_path / "two_color_oracle.json").read_text())
  assert (tmp_path / "two_color_oracle.png").stat().st_size > 0
  assert [r["K"] for r in data["ancestral_uniform"]] == [1, 2, 4, 8, 16, 32]
  for row in data["ancestral_uniform"]:
    assert set(row) == {"K", "n", "invalid_fraction", "theory"}
    # 4 binomial standard errors.
    tol = 4 * math.sqrt(row["theory"] * (1 - row["theory"]) / row["n"])
    assert abs(row["invalid_fraction"] - row["theory"]) < tol
  assert set(data["unequal_grid"]) == {"widths", "invalid_fraction", "theory"}
  assert data["sequential_invalid_fraction"] == 0.0


def test_scan_and_add_experiment_schema(tmp_path):
  specs = [("ancestral K=5", sampling.AncestralSpec(steps=5)),
           ("random order", sampling.RandomOrderSpec())]
  results = scan_and_add_oracle.run(n=64, repeats=5, specs=specs)
  scan_and_add_oracle.write(results, str(tmp_path))
  data = json.loads((tmp_path / "scan_and_add_oracle.json").read_text())
  for m in ("M1", "M9"):
    assert set(data["all_masked"][m]) == {"a2", "a1", "a0", "value", "command"}
    for stats in data["all_masked"][m].values():
      assert {"max_prob", "entropy_bits"} <= set(stats)
  assert set(data["tc_bits"]) == {"command_block", "answer_digits"}
  assert set(data["independent_command_block"]) == {"p_add_count_not_A", "p_add_count_0_or_ge4"}
  assert set(data["oracle_nelbo_bits"]) >= {"mean", "stderr"}
  assert set(data["exact_schedule"]) == {"mean_steps", "min_steps", "max_steps", "speedup"}
  keys = {"name", "steps", "n", "well_formed", "correct", "add_count_valid", "unique", "tvt",
          "tvt_floor", "p_value"}
  assert len(data["samplers"]) == 3
  for row in data["samplers"]:
    assert keys <= set(row)
    assert 0 < row["p_value"] <= 1 and np.isfinite(row["tvt"])
  exact = [r for r in data["samplers"] if r["name"] != "ancestral K=5"]
  assert all(r["correct"] == 1.0 and r["add_count_valid"] == 1.0 for r in exact)
  # Exact analysis figures that have closed forms.
  assert abs(data["independent_command_block"]["p_add_count_not_A"] - (1 - 45 * .04 * .8**8)) < 1e-6
  assert abs(data["entropy_bits"] - (math.log2(45) + 9 * math.log2(10))) < 1e-9
  # NELBO of the exact denoiser agrees with the entropy: 4 standard errors.
  nelbo = data["oracle_nelbo_bits"]
  assert abs(nelbo["mean"] - data["entropy_bits"]) < 4 * nelbo["stderr"]
