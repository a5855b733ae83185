"""Strict JSON out (mdjax.jsonl): every file mdjax writes parses under a strict reader."""

import json

import pytest

from mdjax import jsonl, report
from mdjax.errors import ArgumentError


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


DEEP = "[" * 100_000 + "]" * 100_000  # Python's parser: a RecursionError near 1,000 levels


@pytest.mark.parametrize("text,depth", [
    ("", 0), ("1", 0), ("{}", 1), ('{"a": [1, {"b": []}]}', 4),
    ('{"a": "[[[[{{{{", "b": ["\\"[[["]}', 2),  # brackets in strings, escaped quotes
    ('["\\\\", ["\\\\\\"[[", {}]]', 3),  # an escaped backslash ends no string
    ('["unclosed [[[[', 1), (DEEP, 100_000),
])
def test_json_depth_counts_arrays_and_objects_outside_strings(text, depth):
  assert jsonl.json_depth(text) == jsonl.json_depth(text.encode()) == depth


def test_json_depth_is_linear_in_the_text():
  # An unclosed string of escaped quotes: the server's earlier regex took 5 s for 40 kB and
  # 4x that for twice the text (a 1 MB body: about an hour); pairing quotes is linear.
  import time
  text = b'"' + b'\\"' * 500_000 + b"[" * 300
  start = time.perf_counter()
  assert jsonl.json_depth(text) == 0
  assert time.perf_counter() - start < 2.0


def test_a_deep_row_is_one_line_naming_the_file_line_and_bound(tmp_path):
  path = tmp_path / "rows.jsonl"
  path.write_text('{"text": "a"}\n\n' + DEEP + "\n")
  with pytest.raises(ArgumentError, match=rf"^input='{path}' line 3: nests 100,000 levels of "
                     rf"JSON arrays and objects; at most {jsonl.MAX_DEPTH} are read\.$") as error:
    list(jsonl.read_rows(str(path), "input"))
  assert error.value.param == "input"
  # At the bound a row reads; one level more is refused, without recursing.
  deepest = "[" * jsonl.MAX_DEPTH + "]" * jsonl.MAX_DEPTH
  path.write_text(deepest + "\n")
  assert len(list(jsonl.read_rows(str(path), "input"))) == 1
  path.write_text("[" + deepest + "]\n")
  with pytest.raises(ArgumentError, match=f"line 1: nests {jsonl.MAX_DEPTH + 1} levels"):
    list(jsonl.read_rows(str(path), "input"))


def test_log_rows_skip_every_line_that_is_no_row():
  # A log a run appends to (metrics.jsonl): a line cut short by a kill, nested too deep (a
  # RecursionError before, issue 55) or not an object is one lost row, never a stop.
  lines = ['{"step": 1}\n', "\n", DEEP + "\n", "[1, 2]\n", "null\n", '{"step": 2}\n',
           '{"step": 3, "lo']
  assert list(jsonl.log_rows(lines, "metrics.jsonl")) == [{"step": 1}, {"step": 2}]
