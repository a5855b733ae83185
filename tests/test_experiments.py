"""Smoke runs of the research scripts of experiments/: each runs as a command, in a subprocess,
at the sizes of its --smoke flag (experiments/smoke.py), and its results files are checked:
their schema, and the values that are exact or have closed forms. No test imports a script.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from mdjax.tasks import scan_and_add as sa
from tests.paths import REPO

# Every smoke run compiles its sampler programs (a subprocess starts with jax's in-memory
# caches empty; the run's persistent cache, which it inherits through the environment,
# serves the programs its worker compiled before) and starts Python and jax (~3 s).
pytestmark = pytest.mark.slow


def run_script(name: str, *flags: str, timeout: int = 600) -> str:
  """experiments/<name>.py FLAGS as a command from the repository root: its stdout."""
  proc = subprocess.run([sys.executable, os.path.join(REPO, "experiments", f"{name}.py"),
                         *flags], capture_output=True, text=True, cwd=REPO, timeout=timeout)
  assert proc.returncode == 0, f"{name}.py {' '.join(flags)}:\n{proc.stderr[-4000:]}"
  return proc.stdout


def results(out, name: str, figure: bool = True) -> dict:
  """OUT/<name>.json, once the script's markdown (and figure) are found beside it."""
  assert (out / f"{name}.md").stat().st_size > 0
  if figure:
    assert (out / f"{name}.png").stat().st_size > 0
  return json.loads((out / f"{name}.json").read_text())


def test_two_color_experiment_schema_and_theory(tmp_path):
  stdout = run_script("two_color_oracle", "--n=4000", f"--out={tmp_path}")
  data = results(tmp_path, "two_color_oracle")
  assert "# Two-color oracle" in stdout  # the markdown, printed
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
  # Ancestral K = 5 and random order, n = 64, 4,000 NELBO sequences (the script: 40,000):
  # the NELBO check below is in units of the standard error estimated from the same
  # sequences, so its false-alarm rate does not depend on their number; here the s.e. is
  # about 0.34 bits per sequence.
  run_script("scan_and_add_oracle", "--smoke", f"--out={tmp_path}")
  data = results(tmp_path, "scan_and_add_oracle")
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
    assert keys <= set(row) and row["n"] == 64
    assert 0 < row["p_value"] <= 1 and np.isfinite(row["tvt"])
  exact = [r for r in data["samplers"] if r["name"] != "ancestral K=5"]
  assert all(r["correct"] == 1.0 and r["add_count_valid"] == 1.0 for r in exact)
  # Exact analysis figures that have closed forms.
  assert abs(data["independent_command_block"]["p_add_count_not_A"] - (1 - 45 * .04 * .8**8)) < 1e-6
  assert abs(data["entropy_bits"] - (math.log2(45) + 9 * math.log2(10))) < 1e-9
  # NELBO of the exact denoiser agrees with the entropy: 4 standard errors.
  nelbo = data["oracle_nelbo_bits"]
  assert nelbo["n"] == 4000 and abs(nelbo["mean"] - data["entropy_bits"]) < 4 * nelbo["stderr"]


def test_scan_and_add_study_schema_and_exact_orders(tmp_path):
  # M = 9; the exact denoiser stands in for the trained model, so its rows run the programs
  # of the oracle rows and are exact too. Points: two exact orders, one that writes every
  # command at once, confidence and remasking at T = 5; n = 128, 1,000 NELBO sequences.
  run_script("scan_and_add_study", "--smoke", f"--workdir={tmp_path / 'none'}",
             f"--out={tmp_path}")
  data = results(tmp_path, "scan_and_add_study")
  for name in ("scan_and_add_study.png", "scan_and_add_write_order.png"):
    assert (tmp_path / name).stat().st_size > 0
  picked = ["[VOA][v×9]o×10[ht1]", "[VOA]o×10ht1v×9", "[VOA][v×9][o×10][ht1]"]
  assert data["training"] == [] and not (tmp_path / "none").exists()  # nothing trained
  assert len(data["rows"]) == 2 * 5  # model and oracle
  for row in data["rows"]:
    assert {"denoiser", "M", "kind", "order", "group", "steps", "temperature", "n",
            "well_formed", "correct", "add_count_valid", "unique", "tvt", "tvt_floor",
            "p_value"} <= set(row)
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
  assert nelbo["M"] == 9 and nelbo["model"]["n"] == 1000
  assert abs(nelbo["entropy_bits"] - sa.entropy_bits(sa.Params(max_command_id=9))) < 1e-9
  # The exact denoiser's NELBO is the entropy: 4 standard errors of the mean of 1,000
  # sequences (the s.e. estimated from them).
  assert abs(nelbo["model"]["mean"] - nelbo["entropy_bits"]) < 4 * nelbo["model"]["stderr"]


def test_speculative_experiment_schema(tmp_path):
  # k = 4, lowest index first; the exact denoiser stands in for the trained model; timed:
  # the chain rule, k = 4 and left to right (programs the rows compile anyway).
  run_script("speculative", "--smoke", f"--out={tmp_path}")
  data = results(tmp_path, "speculative")
  keys = {"denoiser", "sampler", "k", "order", "n", "mean_rounds", "mean_evals", "well_formed",
          "correct", "add_count_valid", "tvt", "tvt_floor", "p_value"}
  assert len(data["rows"]) == 2 * 4  # chain rule, speculative, confidence, ancestral
  for row in data["rows"]:
    assert keys <= set(row) and 0 < row["p_value"] <= 1 and row["n"] == 128
  oracle = {r["sampler"]: r for r in data["rows"] if r["denoiser"] == "oracle"}
  model = {r["sampler"]: r for r in data["rows"] if r["denoiser"] == "model"}
  for exact in ("chain rule", "speculative"):
    for rows in (oracle, model):
      assert rows[exact]["correct"] == 1.0 and rows[exact]["add_count_valid"] == 1.0
  assert oracle["chain rule"]["mean_rounds"] == 25
  assert oracle["speculative"]["mean_rounds"] < 25 / 2
  depth = round(oracle["speculative"]["mean_rounds"] + 1)
  assert oracle["confidence"]["mean_rounds"] == depth == oracle["ancestral"]["mean_rounds"]
  assert [r["sampler"] for r in data["wall_time_model"]] == [
      "chain rule (k = 1)", "speculative k = 4", "left to right (OrderedSpec)"]
  assert data["wall_time_model"][0]["ratio_to_chain_rule"] == 1.0


def test_literature_experiment_schema(trained, tmp_path):
  # Every family once at a budget of 8 on ScanAndAdd (the exact denoiser standing in for the
  # model), the speculative sampler only on the `trained` tiny text models (reused).
  root, _ = trained
  run_script("literature_samplers", "--smoke", f"--text_workdir={root}", f"--out={tmp_path}")
  data = results(tmp_path, "literature_samplers")
  families = {r["sampler"] for r in data["rows"]}
  assert families == {"ancestral", "confidence", "remask", "defer", "revision",
                      "local_remask", "speculative"}
  assert {r["task"] for r in data["rows"]} == {"scan_and_add", "shakespeare"}
  for row in data["rows"]:
    assert {"task", "denoiser", "sampler", "knobs", "n", "calls_per_sample", "correct",
            "add_count_valid", "tvt", "tvt_floor", "p_value", "gen_bits_per_char",
            "word_validity"} <= set(row)
    assert row["denoiser"] in ("oracle", "model") and row["calls_per_sample"] > 0
    if row["task"] == "scan_and_add":
      assert row["gen_bits_per_char"] is None and 0 <= row["correct"] <= 1
      if row["budget"] is not None:
        assert row["calls_per_sample"] <= 1.25 * row["budget"], row  # matched budgets
    else:
      assert row["correct"] is None and row["gen_bits_per_char"] > 0
  # The exact sampler is exact with the exact denoiser: every sample correct.
  exact = [r for r in data["rows"] if r["sampler"] == "speculative" and r["denoiser"] == "oracle"]
  assert exact and all(r["correct"] == 1.0 for r in exact)


def test_text_quality_experiment_schema(trained, tmp_path):
  # The `trained` tiny models (reused); one row per sampler at K = 4, n = 8: the ancestral
  # row runs the program of the fixture's evaluation samples.
  root, _ = trained
  run_script("text_quality", "--smoke", f"--workdir={root}", f"--out={tmp_path}")
  data = results(tmp_path, "text_quality")
  assert isinstance(data["bits_per_char"], float) and data["train_minutes"] > 0
  assert [r["sampler"] for r in data["rows"]] == ["ancestral", "confidence", "remask", "blocks"]
  for row in data["rows"]:
    assert {"sampler", "K", "gen_bits_per_char", "word_validity", "distinct_2"} <= set(row)
    assert row["K"] == 4 and row["calls"] <= row["K"]
  held_out = data["references"][0]
  assert held_out["sampler"] == "held-out text" and held_out["word_validity"] > 0.9


def test_kv_cache_quality_experiment_schema(trained, tmp_path):
  # An untrained ScanAndAdd model and the `trained` tiny text models (reused); K = 5 and 4.
  root, _ = trained
  run_script("kv_cache_quality", "--smoke", f"--workdir={root}", f"--out={tmp_path}")
  data = results(tmp_path, "kv_cache_quality", figure=False)
  assert data["scan_and_add_train_steps"] == 0 and data["char_train_steps"] == 30
  # Every sampler at every K, uncached and dual, with the same keys.
  assert len(data["scan_and_add"]) == 3 * 2
  assert len(data["shakespeare_char"]) == 2 * 2
  for row in data["scan_and_add"] + data["shakespeare_char"]:
    assert row["kv_cache"] in ("none", "dual") and 0.0 <= row["same_as_uncached"] <= 1.0
  for row in data["shakespeare_char"]:
    assert math.isfinite(row["gen_bits_per_char"]) and row["gen_bits_per_char"] > 0
  assert "rows equal" in (tmp_path / "kv_cache_quality.md").read_text()


def test_block_diffusion_experiment_schema(tmp_path):
  """experiments/block_diffusion.py on tiny models: results/block_diffusion.json's keys."""
  # Three tiny models trained here (blocks of 4, the full-sequence denoiser, the causal
  # reference), 30 steps each.
  run_script("block_diffusion", "--smoke", f"--workdir={tmp_path / 'models'}",
             f"--out={tmp_path}")
  data = results(tmp_path, "block_diffusion")
  assert [r["block"] for r in data["nelbo"]] == [4, 16]
  assert all(isinstance(r["bits_per_char"], float) and r["stderr"] >= 0 for r in data["nelbo"])
  assert isinstance(data["causal_bits_per_char"], float)
  # Block 4: cached and not, equal tokens, so equal scores; block 16 = L: one canvas.
  assert [(r["block"], r["steps_per_block"], r["cached"]) for r in data["samples"]] == [
      (4, 2, True), (4, 2, False), (16, 8, False)]
  cached, plain = data["samples"][:2]
  assert cached["gen_bits_per_char"] == plain["gen_bits_per_char"]
  for row in data["samples"]:
    assert {"gen_bits_per_char", "word_validity", "time_s"} <= set(row) and row["time_s"] > 0
  assert [r["segment"] for r in data["long"]] == [0, 1, 2, 3]
  assert all(set(r) == {"segment", "gen_bits_per_char"} for r in data["long"])


def _a2d_rows(curves: dict, seconds: dict) -> list[dict]:
  """experiments/a2d.py's rows from {(method, start): [NELBO at 75, 150, 300, 450 steps]}."""
  rows = []
  for (method, start), values in curves.items():
    for step, value in zip((75, 150, 300, 450), values):
      row = {"method": method, "start": start, "tokens": step * 2048, "steps": step,
             "val_nelbo_bits_per_token": value, "val_nelbo_se": 0.01, "anneal_steps": 0}
      if step == 450:
        row.update(sample_quality={"gen_ppl": 10.0, "entropy": 2.9},
                   train_seconds=seconds.get((method, start), 100.0))
      rows.append(row)
  return rows


def test_a2d_goals_and_report(tmp_path):
  # The goals read off made-up curves and the report, without training (--rows_from).
  curves = {("masked", "ar"): [3.0, 2.9, 2.8, 2.7], ("masked", "scratch"): [4.0, 3.6, 3.2, 3.0],
            ("block", "ar"): [2.95, 2.88, 2.78, 2.6], ("block", "scratch"): [3.9, 3.5, 3.0, 2.85],
            ("masked_anneal", "ar"): [3.1, 2.95, 2.8, 2.75]}
  made_up = {"rows": _a2d_rows(curves, {("masked_anneal", "ar"): 120.0}),
             "ar_bits_per_token": 2.3, "examples": {"x": "y"},
             "reference_quality": {"ar_samples": {}, "held_out_text": {}}}
  (tmp_path / "in.json").write_text(json.dumps(made_up))
  out = tmp_path / "out"
  run_script("a2d", f"--rows_from={tmp_path / 'in.json'}", f"--out={out}",
             f"--workdir={tmp_path / 'none'}")
  goals = results(out, "a2d")["goals"]
  assert not (tmp_path / "none").exists()  # nothing trained
  masked = goals["masked_tokens_to_scratch_final"]
  # 3.0 is first reached at 75 steps, a sixth of the budget; the block run first goes below
  # 2.85 at 300 steps, two thirds.
  assert masked["converted_tokens"] == 75 * 2048 and masked["within_a_third"]
  block = goals["block_tokens_to_scratch_final"]
  assert block["converted_tokens"] == 300 * 2048 and not block["within_a_third"]
  assert goals["block_beats_masked_at_every_budget"]
  assert [round(d["difference"], 6) for d in goals["anneal_minus_direct"]] == [0.1, 0.05, 0.0, 0.05]
  assert goals["anneal_seconds_over_direct"] == 1.2
  assert "| masked | ar | 153600 | 75 |" in (out / "a2d.md").read_text()


def test_a2d_rows_from_a_deep_file_is_one_line(tmp_path):
  """--rows_from naming a file nested 100,000 deep: a RecursionError traceback before (issue
  55); now one usage line naming the flag, the file and the bound, exit status 2."""
  deep = tmp_path / "deep.json"
  deep.write_text("[" * 100_000 + "]" * 100_000)
  proc = subprocess.run([sys.executable, os.path.join(REPO, "experiments", "a2d.py"),
                         f"--rows_from={deep}", f"--out={tmp_path / 'out'}",
                         f"--workdir={tmp_path / 'none'}"],
                        capture_output=True, text=True, cwd=REPO, timeout=120)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.splitlines()[-1] == (
      f"a2d.py: error: rows_from='{deep}': nests 100,000 levels of JSON arrays and objects; "
      "at most 256 are read.")
  assert not (tmp_path / "none").exists() and not (tmp_path / "out").exists()
