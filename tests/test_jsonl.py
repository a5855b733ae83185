"""Strict JSON out (mdjax.jsonl): every file mdjax writes parses under a strict reader."""

import json

import pytest

from mdjax import jsonl, report


def _strict(text: str):
  def refuse(constant):
    raise ValueError(f"bare {constant} in JSON")
  return json.loads(text, parse_constant=refuse)


def test_values_that_are_not_finite_become_null_at_any_depth():
  value = {"loss": float("nan"), "rows": [{"tv": float("inf")}, (1.5, float("-inf"))],
           "name": "x", "steps": 3}
  assert _strict(jsonl.dumps(value)) == {"loss": None, "rows": [{"tv": None}, [1.5, None]],
                                         "name": "x", "steps": 3}
  with pytest.raises(ValueError, match="bare NaN"):  # what Python's own json writes
    _strict(json.dumps(value))


def test_results_files_are_strict(tmp_path):
  path = tmp_path / "results" / "x.json"
  report.write_json(str(path), {"rows": [{"p_value": float("nan"), "tvt": 0.1}]})
  assert _strict(path.read_text()) == {"rows": [{"p_value": None, "tvt": 0.1}]}
  assert [p.name for p in path.parent.iterdir()] == ["x.json"]  # no temporary left
