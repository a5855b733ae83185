"""mdjax.accelerators.frontier: the training-free frontier at equal calls and at equal
accuracy, the distance to the exact denoiser's frontier, AUP per method."""

import math

import pytest

from mdjax.accelerators import frontier


def point(method, calls, accuracy, trained=False, se=0.01, teacher="model", **extra):
  return {"task": "t", "teacher": teacher, "temperature": 1.0, "method": method,
          "knobs": {"k": calls}, "trained": trained, "mean_forwards": calls, "tpf": 4.0 / calls,
          "accuracy": accuracy, "accuracy_se": se, **extra}


def test_the_frontier_is_the_upper_concave_hull_in_calls_and_accuracy():
  pts = [point("a", 1.0, 0.5), point("b", 2.0, 0.6), point("c", 3.0, 0.9),
         point("d", 4.0, 0.85), point("e", 4.0, 1.0)]
  # b lies below the chord a-c (0.7 at 2 calls): mixing a and c beats it; d is dominated.
  hull = frontier.hull(pts)
  assert [p["method"] for p in hull] == ["a", "c", "e"]
  at = frontier.at_calls(hull, 2.0)
  assert at["accuracy"] == pytest.approx(0.7) and at["weight"] == pytest.approx(0.5)
  assert at["accuracy_se"] == pytest.approx(math.hypot(0.005, 0.005))
  assert frontier.at_calls(hull, 0.5) is None  # cheaper than any
  assert frontier.at_calls(hull, 9.0)["accuracy"] == 1.0
  # Inverse: 0.7 is reached halfway between a and c; 0.95 halfway between c and e.
  assert frontier.calls_at(hull, 0.7) == pytest.approx(2.0)
  assert frontier.calls_at(hull, 0.95) == pytest.approx(3.5)
  assert frontier.calls_at(hull, 0.3) == 1.0  # the cheapest point is already that accurate
  assert frontier.calls_at(frontier.hull(pts[:3]), 0.95) is None  # never that accurate


def test_equal_calls_compares_each_learned_point_with_its_own_teachers_free_frontier():
  pts = [point("free", 1.0, 0.5), point("free", 3.0, 0.9),
         point("egp_oracle", 1.0, 1.0, uses_answer=True),  # reads the answer: left out
         point("learned", 2.0, 0.8, trained=True),
         # The exact denoiser's points: another teacher, not the learned point's frontier.
         point("free", 1.0, 0.9, teacher="oracle"), point("free", 4.0, 1.0, teacher="oracle")]
  (row,) = frontier.equal_calls(pts, "oracle")
  assert row["training_free"]["accuracy"] == pytest.approx(0.7)
  assert row["difference"] == pytest.approx(0.1)
  assert row["z"] == pytest.approx(0.1 / math.hypot(0.01, math.hypot(0.005, 0.005)))
  # 0.8 is reached at 2.5 calls by mixing the free points: 1.25x the learned point's 2.
  assert row["training_free_calls"] == pytest.approx(2.5)
  assert row["speedup"] == pytest.approx(1.25)
  # The exact frontier at 2 calls: a third of the way from (1, 0.9) to (4, 1.0).
  assert row["to_exact"]["accuracy"] == pytest.approx(0.9 + 0.1 / 3)
  assert row["to_exact"]["difference"] == pytest.approx(0.8 - 0.9 - 0.1 / 3)


def test_aup_by_method_leaves_the_answer_reading_oracle_out_of_y_max():
  # TPF 4 / calls: (TPF 2, 60%) and (TPF 4, 58%), within 5 points of the first, both count.
  pts = [point("free", 1.0, 0.58), point("free", 2.0, 0.6),
         point("egp_oracle", 1.0, 1.0, uses_answer=True)]
  table = frontier.aup_by_method(pts)
  assert set(table["t"]["model"]["1.0"]) == {"free"}
  # y_max = 60: rho_1 y_1 + the trapezoid with weights W(y) = min(exp(-3 (1 - y/60)), 1).
  w = math.exp(-3 * (1 - 58 / 60))
  expected = 2.0 * 60 + 0.5 * (4.0 - 2.0) * (58 * w + 60 * 1.0)
  assert table["t"]["model"]["1.0"]["free"] == pytest.approx(expected)
