"""mdjax.bench.accelerators: the training-free frontier at equal calls, AUP per method, and a
tiny run's schema (results/parallelism.json's points plus method, trained, temperature)."""

import json
import math

import pytest

from mdjax.bench import accelerators


def point(method, calls, accuracy, trained=False, se=0.01, **extra):
  return {"task": "t", "temperature": 1.0, "method": method, "knobs": {"k": calls},
          "trained": trained, "mean_forwards": calls, "tpf": 4.0 / calls, "accuracy": accuracy,
          "accuracy_se": se, **extra}


def test_the_frontier_is_the_upper_concave_hull_in_calls_and_accuracy():
  pts = [point("a", 1.0, 0.5), point("b", 2.0, 0.6), point("c", 3.0, 0.9),
         point("d", 4.0, 0.85), point("e", 4.0, 1.0)]
  # b lies below the chord a-c (0.7 at 2 calls): mixing a and c beats it; d is dominated.
  assert [p["method"] for p in accelerators.hull(pts)] == ["a", "c", "e"]
  at = accelerators.at_calls(accelerators.hull(pts), 2.0)
  assert at["accuracy"] == pytest.approx(0.7) and at["weight"] == pytest.approx(0.5)
  assert at["accuracy_se"] == pytest.approx(math.hypot(0.005, 0.005))
  assert accelerators.at_calls(accelerators.hull(pts), 0.5) is None  # cheaper than any
  assert accelerators.at_calls(accelerators.hull(pts), 9.0)["accuracy"] == 1.0


def test_equal_calls_compares_each_learned_point_with_the_free_frontier_only():
  pts = [point("free", 1.0, 0.5), point("free", 3.0, 0.9),
         point("egp_oracle", 1.0, 1.0, uses_answer=True),  # reads the answer: left out
         point("learned", 2.0, 0.8, trained=True)]
  (row,) = accelerators.equal_calls(pts)
  assert row["training_free"]["accuracy"] == pytest.approx(0.7)
  assert row["difference"] == pytest.approx(0.1)
  assert row["z"] == pytest.approx(0.1 / math.hypot(0.01, math.hypot(0.005, 0.005)))


def test_aup_by_method_leaves_the_answer_reading_oracle_out_of_y_max():
  # TPF 4 / calls: (TPF 2, 60%) and (TPF 4, 58%), within 5 points of the first, both count.
  pts = [point("free", 1.0, 0.58), point("free", 2.0, 0.6),
         point("egp_oracle", 1.0, 1.0, uses_answer=True)]
  table = accelerators.aup_by_method(pts)
  assert set(table["t"]["1.0"]) == {"free"}
  # y_max = 60: rho_1 y_1 + the trapezoid with weights W(y) = min(exp(-3 (1 - y/60)), 1).
  w = math.exp(-3 * (1 - 58 / 60))
  expected = 2.0 * 60 + 0.5 * (4.0 - 2.0) * (58 * w + 60 * 1.0)
  assert table["t"]["1.0"]["free"] == pytest.approx(expected)


SCHEMA = {"task", "accuracy", "accuracy_se", "tpf", "tpf_se", "method", "trained",
          "temperature", "family", "knobs", "rows", "generated", "mean_forwards"}


@pytest.mark.slow
def test_a_tiny_run_writes_the_schema(tmp_path):
  out = tmp_path / "acc.json"
  results = accelerators.main(["--sizes", "tiny", "--task", "permutation", "--rows", "16",
                               "--train_rows", "12", "--epochs", "20", "--temperatures", "1",
                               "--out", str(out)], log=lambda *a: None)
  written = json.loads(out.read_text())
  assert written["config"]["task"] == "permutation" and written["config"]["rows"] == 16
  methods = {p["method"] for p in written["points"]}
  assert methods == {"learned_commit", "confidence_threshold", "ancestral", "egp_oracle"}
  for p in written["points"]:
    assert SCHEMA <= set(p), sorted(SCHEMA - set(p))
    assert p["trained"] == (p["method"] == "learned_commit")
    assert 0 <= p["accuracy"] <= 1 and p["tpf"] >= 1 and p["rows"] == 16
  assert written["filters"]["1.0"]["params"] == 2 * 3 * 32 + 32 + 3
  assert written["filters"]["1.0"]["examples"]["train"] >= 8
  assert len(written["equal_calls"]) == 2 and set(written["aup"]["permutation"]["1.0"]) == {
      "learned_commit", "confidence_threshold", "ancestral"}
  assert results["points"] == written["points"]
  assert (tmp_path / "acc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
