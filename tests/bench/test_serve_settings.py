"""mdjax.bench.serve_settings (results/serve_settings.json) end to end on the tiny Dream
checkpoint of tests/fixtures with three settings: the JSON's keys, every new setting served
(compile) or refused (refuse), the lanes dropped past max_programs."""

import json
import os

import pytest

from mdjax.bench import serve_settings as bench
from tests.paths import REPO

DREAM = os.path.join(REPO, "tests", "fixtures", "pretrained", "dream")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.slow
def test_serve_settings_bench_writes_every_key(tmp_path):
  out = tmp_path / "serve_settings.json"
  result = bench.main([f"--model={DREAM}", f"--out={out}", "--settings=3", "--max_programs=2",
                       "--max_batch=1", "--max_tokens=4", "--steps=4", "--quiet_s=1",
                       "--canvas_length=32"],
                      log=lambda *a: None)
  assert json.loads(out.read_text()) == json.loads(json.dumps(result))
  compile_row, refuse_row = result["modes"]
  assert compile_row["mode"] == "compile" and refuse_row["mode"] == "refuse"
  assert compile_row["statuses"] == {"200": 3}
  # The default lane and three new ones through two places: each built, the rest dropped.
  # (The steady client's requests keep the default lane the most recently used; when a new
  # setting comes in a gap between them, as on a loaded machine, the default lane can be the
  # one dropped and the next request builds it again: 5 built, 3 dropped. What is held stays
  # the bound.)
  assert compile_row["lanes_built"] >= 4
  assert compile_row["lanes_built"] - compile_row["lanes_evicted"] == compile_row["lanes_held"]
  assert compile_row["lanes_held"] == 2 and len(compile_row["rss_mb_after_setting"]) == 3
  assert set(refuse_row["statuses"]) == {"400"} and refuse_row["statuses"]["400"] >= 3
  assert refuse_row["lanes_built"] == 1 and refuse_row["lanes_evicted"] == 0
  for row in result["modes"]:
    for phase in ("quiet", "during"):
      assert row[phase]["requests"] > 0 and row[phase]["p99_s"] >= row[phase]["median_s"]
    assert row["p99_ratio"] == row["during"]["p99_s"] / row["quiet"]["p99_s"]
    assert row["rss_peak_mb"] >= row["rss_before_mb"] > 0
