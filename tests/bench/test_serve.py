"""mdjax.bench.serve (results/serve.json) end to end on the tiny Dream checkpoint of
tests/fixtures, at two concurrencies and a few tokens: the JSON's keys, exactness, the bad
requests all answered 4xx, no compile while measuring."""

import json
import os

import pytest

from mdjax.bench import serve as bench
from tests.paths import REPO

DREAM = os.path.join(REPO, "tests", "fixtures", "pretrained", "dream")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.slow
def test_serve_bench_writes_every_key_and_the_served_rows_are_the_offline_ones(tmp_path):
  out = tmp_path / "serve.json"
  result = bench.main([f"--model={DREAM}", f"--out={out}", "--concurrency=1,4", "--requests=4",
                       "--max_tokens=4", "--steps=4", "--repeats=1", "--max_batch=4",
                       "--parts=plain"],
                      log=lambda *a: None)
  assert json.loads(out.read_text()) == json.loads(json.dumps(result))
  assert [row["concurrency"] for row in result["rows"]] == [1, 4]
  for row in result["rows"]:
    assert set(row) == {"concurrency", "requests", "tokens_per_s", "p50_s", "p99_s"}
    assert row["requests"] == 4 and row["tokens_per_s"] > 0 and row["p99_s"] >= row["p50_s"]
  assert result["served_equals_offline"] is True, result["mismatches"]
  assert result["served_checked"] == 4 + 4 + 1  # both levels and the request after the bad ones
  bad = result["bad_requests"]
  assert bad["sent"] >= 20 and bad["answered_4xx"] == bad["sent"], bad["answers"]
  assert bad["server_alive_after"] is True
  statuses = {a["request"]: a["status"] for a in bad["answers"]}
  assert statuses["no Authorization header"] == 401 and statuses["malformed JSON"] == 400
  assert result["compiles"]["grew"] is False and result["compiles"]["before"] > 0
  assert result["offline_batch_tokens_per_s"] > 0
  assert result["sequential_tokens_per_s"] == result["rows"][0]["tokens_per_s"]
  assert result["ratio_16_to_offline"] is None  # no concurrency-16 row in this run
  assert result["model"]["d_model"] == 64 and result["model"]["layers"] == 2
  assert result["settings"]["canvas_length"] == max(result["settings"]["prompt_lengths"]) + 4
  assert "Compiles" in result["notes"] and result["device"]["platform"]


def test_request_plan_gives_every_request_its_own_seed():
  plan = bench.request_plan(4, 8, bench.PROMPTS, seed=0)
  assert [r["prompt"] for r in plan] == list(bench.PROMPTS[:8])
  assert len({r["seed"] for r in plan}) == 8
  other = bench.request_plan(16, 16, bench.PROMPTS, seed=0)
  assert not {r["seed"] for r in plan} & {r["seed"] for r in other}


def test_cached_part_alone_keeps_the_other_records(tmp_path, monkeypatch):
  """--parts=cached runs serve_cached alone and writes its record beside --out's others."""
  from mdjax.bench import serve_cached

  out = tmp_path / "serve.json"
  out.write_text(json.dumps({"rows": [1], "notes": "plain"}))
  seen = {}

  def fake_run(**kwargs):
    seen.update(kwargs)
    return {"notes": "cached notes", "rows": {}}

  monkeypatch.setattr(serve_cached, "run", fake_run)
  result = bench.main([f"--out={out}", "--parts=cached", "--concurrency=1,16",
                       "--cached_shape=LLaDA2.0-mini"], log=lambda *a: None)
  assert json.loads(out.read_text()) == result
  assert result == {"rows": [1], "notes": "plain", "cached": {"notes": "cached notes",
                                                               "rows": {}}}
  assert seen["levels"] == [1, 16] and seen["shape"] == "LLaDA2.0-mini"
