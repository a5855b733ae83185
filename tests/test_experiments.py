"""Smoke tests of the research scripts of experiments/: schema and values at small sizes."""

import json
import math

import numpy as np
import pytest

from mdjax import sampling, tasks
from mdjax.tasks import scan_and_add as sa
from tests.scripts import load_script


def test_two_color_experiment_schema_and_theory(tmp_path):
  two_color_oracle = load_script("two_color_oracle")
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


# With tests/tasks/test_tasks.py's total correlation test: the same oracle programs.
@pytest.mark.xdist_group("scan_and_add_oracle")
def test_scan_and_add_experiment_schema(tmp_path):
  scan_and_add_oracle = load_script("scan_and_add_oracle")
  specs = [("ancestral K=5", sampling.AncestralSpec(steps=5)),
           ("random order", sampling.RandomOrderSpec())]
  # 4,000 NELBO sequences (the script: 40,000): the check below is in units of the
  # standard error estimated from the same sequences, so its false-alarm rate does not
  # depend on their number; here the s.e. is about 0.34 bits per sequence.
  results = scan_and_add_oracle.run(n=64, repeats=5, specs=specs, nelbo_sequences=4000)
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


def test_scan_and_add_study_schema_and_exact_orders(tmp_path, monkeypatch):
  study = load_script("scan_and_add_study")
  # The exact denoiser stands in for the trained model: its rows run the programs of the
  # oracle rows (the compilation cache serves them), and are exact too.
  exact_model = tasks.get("scan_and_add", {"max_command_id": 9}).exact_denoiser
  picked = ["[VOA][v×9]o×10[ht1]", "[VOA]o×10ht1v×9", "[VOA][v×9][o×10][ht1]"]
  point_list = [p for p in study.points() if p["order"] in picked]
  point_list += [p for p in study.points() if p["kind"] == "confidence" and p["steps"] == 5
                 and p["temperature"] == 1.0]
  # The realised write order at T = 5: the program of the confidence point above, which the
  # compilation cache serves (the study clears jax's in-memory caches after every point).
  monkeypatch.setattr(study, "WRITE_ORDER_STEPS", (5,))
  results = study.run(128, workdir=str(tmp_path / "none"), repeats=5,
                      models={9: (exact_model, None)}, point_list=point_list,
                      nelbo_sequences=1000)
  study.write(results, str(tmp_path))
  data = json.loads((tmp_path / "scan_and_add_study.json").read_text())
  for name in ("scan_and_add_study.png", "scan_and_add_write_order.png", "scan_and_add_study.md"):
    assert (tmp_path / name).stat().st_size > 0
  assert len(data["rows"]) == 2 * len(point_list)  # model and oracle
  for row in data["rows"]:
    assert set(study.ROW_KEYS) <= set(row)
    assert row["M"] == 9 and row["n"] == 128 and 0 < row["p_value"] <= 1
    assert row["kind"] in ("order", "confidence") and row["denoiser"] in ("model", "oracle")
    assert (row["order"] is None) == (row["kind"] == "confidence")
  # One position per step, or point masses in parallel: exact, so every row is correct.
  # All commands in one step: the add count is wrong with probability 0.698.
  for denoiser in ("oracle", "model"):
    rows = {r["order"]: r for r in data["rows"] if r["denoiser"] == denoiser}
    for exact in picked[:2]:
      assert rows[exact]["correct"] == 1.0 and rows[exact]["add_count_valid"] == 1.0
    assert rows[picked[2]]["add_count_valid"] < 0.5
  assert [w["steps"] for w in data["write_order"]] == [5, 5]  # model, oracle
  for w in data["write_order"]:
    for name in ("values", "commands", "answer"):
      assert len(w[name]) == w["steps"] and w[name][-1] == 1.0
      assert np.all(np.diff(w[name]) >= 0)
  nelbo = data["nelbo"][0]
  assert nelbo["M"] == 9 and abs(nelbo["entropy_bits"] - sa.entropy_bits(sa.Params(max_command_id=9))) < 1e-9
  # The exact denoiser's NELBO is the entropy: 4 standard errors of the mean of 1,000
  # sequences (the s.e. estimated from them).
  assert abs(nelbo["model"]["mean"] - nelbo["entropy_bits"]) < 4 * nelbo["model"]["stderr"]


def test_speculative_experiment_schema(tmp_path, monkeypatch):
  speculative = load_script("speculative")
  monkeypatch.setattr(speculative, "KS", (4,))
  monkeypatch.setattr(speculative, "ORDER_RULES", ("lowest_index",))
  # Timed: the chain rule, and two programs the rows compile anyway (k = 4, left to right).
  chain, k4, _, left_to_right = speculative.TIMED
  monkeypatch.setattr(speculative, "TIMED", (chain, k4, left_to_right))
  # The exact denoiser stands in for the trained model: the model rows and the timed calls
  # run the programs of the oracle rows (compiled once), and are exact too.
  results = speculative.run(128, repeats=5, model=(sa.exact_denoiser, None))
  speculative.write(results, str(tmp_path))
  data = json.loads((tmp_path / "speculative.json").read_text())
  assert (tmp_path / "speculative.png").stat().st_size > 0
  keys = {"denoiser", "sampler", "k", "order", "n", "mean_rounds", "mean_evals", "well_formed",
          "correct", "add_count_valid", "tvt", "tvt_floor", "p_value"}
  assert len(data["rows"]) == 2 * 4  # chain rule, speculative, confidence, ancestral
  for row in data["rows"]:
    assert keys <= set(row) and 0 < row["p_value"] <= 1
  oracle = {r["sampler"]: r for r in data["rows"] if r["denoiser"] == "oracle"}
  model = {r["sampler"]: r for r in data["rows"] if r["denoiser"] == "model"}
  for exact in ("chain rule", "speculative"):
    for rows in (oracle, model):
      assert rows[exact]["correct"] == 1.0 and rows[exact]["add_count_valid"] == 1.0
  assert oracle["chain rule"]["mean_rounds"] == 25
  assert oracle["speculative"]["mean_rounds"] < 25 / 2
  depth = round(oracle["speculative"]["mean_rounds"] + 1)
  assert oracle["confidence"]["mean_rounds"] == depth == oracle["ancestral"]["mean_rounds"]
  assert [r["sampler"] for r in data["wall_time_model"]][0] == "chain rule (k = 1)"
  assert data["wall_time_model"][0]["ratio_to_chain_rule"] == 1.0
