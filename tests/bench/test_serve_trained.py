"""mdjax.bench.serve_trained (results/serve.json's `cached_trained` and
`cached_trained_partial`): the task's rows, the trained checkpoint written once and reused, and
each `--parts=` record beside the other records. The training and the measurement themselves are the benchmark's (minutes)."""

import json

import jax
import numpy as np
import pytest

from mdjax.bench import serve as bench
from mdjax.bench import serve_cached, serve_trained


def test_task_rows_count_up_so_the_prompt_decides_the_continuation():
  rows = serve_trained.task_rows(np.random.default_rng(3), 5, alphabet=64)
  assert rows.shape == (5, serve_cached.PROMPT_LEN + serve_cached.MAX_TOKENS)
  assert rows.dtype == np.int32 and rows.min() >= 0 and rows.max() < 64
  assert (np.diff(rows, axis=1) % 64 == 1).all()  # each id the one before plus 1, mod 64
  again = serve_trained.task_rows(np.random.default_rng(3), 5, alphabet=64)
  np.testing.assert_array_equal(rows, again)
  assert len({int(r[0]) for r in serve_trained.task_rows(np.random.default_rng(0), 32, 64)}) > 1


def test_the_checkpoint_is_trained_once_and_a_changed_recipe_trains_again(tmp_path,
                                                                           monkeypatch):
  from mdjax.models import published

  calls = []

  def fake_train(recipe, log=print):  # zero weights of the network's shapes, no step taken
    calls.append(recipe)
    shapes = published.param_shapes(serve_cached.llada_config())
    params = jax.tree.map(lambda s: np.zeros(s, np.float32), shapes,
                          is_leaf=lambda x: isinstance(x, tuple))
    return params, dict(recipe=recipe, seconds=0.0)

  monkeypatch.setattr(serve_trained, "train", fake_train)
  path = tmp_path / "ckpt"
  info = serve_trained.checkpoint(str(path), log=lambda *a: None)
  assert len(calls) == 1 and info["recipe"] == serve_trained.RECIPE
  saved = json.loads((path / "config.json").read_text())
  assert saved["d_model"] == serve_cached.SHAPE["d_model"]
  assert saved["mask_token_id"] == serve_cached.MASK_ID
  assert serve_trained.checkpoint(str(path), log=lambda *a: None) == json.loads(json.dumps(info))
  assert len(calls) == 1  # found, not trained again
  other = dict(serve_trained.RECIPE, steps=serve_trained.RECIPE["steps"] + 1)
  serve_trained.checkpoint(str(path), other, log=lambda *a: None)
  assert calls[-1] == other and len(calls) == 2


def test_cached_trained_part_alone_keeps_the_other_records(tmp_path, monkeypatch):
  out = tmp_path / "serve.json"
  out.write_text(json.dumps({"rows": [1], "notes": "plain", "cached": {"notes": "random"}}))
  seen = {}

  def fake_run(**kwargs):
    seen.update(kwargs)
    return {"notes": "trained notes"}

  monkeypatch.setattr(serve_trained, "run", fake_run)
  result = bench.main([f"--out={out}", "--parts=cached_trained", "--concurrency=1,16"],
                      log=lambda *a: None)
  assert json.loads(out.read_text()) == result
  assert result == {"rows": [1], "notes": "plain", "cached": {"notes": "random"},
                    "cached_trained": {"notes": "trained notes"}}
  assert seen["levels"] == [1, 16] and seen["repeats"] == 3
  assert seen["record"] == "cached_trained"


def test_the_partial_record_is_the_same_recipe_for_fewer_steps_in_a_folder_of_its_own(
    tmp_path, monkeypatch):
  recipe, path = serve_trained.RECORDS["cached_trained_partial"]
  full_recipe, full_path = serve_trained.RECORDS["cached_trained"]
  assert full_recipe == serve_trained.RECIPE and full_path == serve_trained.DEFAULT_PATH
  assert 0 < recipe["steps"] < full_recipe["steps"]
  assert {k: v for k, v in recipe.items() if k != "steps"} == \
      {k: v for k, v in full_recipe.items() if k != "steps"}
  assert path != full_path  # neither checkpoint trains over the other

  out = tmp_path / "serve.json"
  kept = {"rows": [1], "cached": {"notes": "random"}, "cached_trained": {"notes": "full"}}
  out.write_text(json.dumps(kept))
  seen = []
  monkeypatch.setattr(serve_trained, "run",
                      lambda **kwargs: seen.append(kwargs) or {"notes": kwargs["record"]})
  result = bench.main([f"--out={out}", "--parts=cached_trained_partial"], log=lambda *a: None)
  assert [kwargs["record"] for kwargs in seen] == ["cached_trained_partial"]
  assert result == dict(kept, cached_trained_partial={"notes": "cached_trained_partial"})
  assert json.loads(out.read_text()) == result


def test_an_unknown_record_is_refused_before_any_training():
  with pytest.raises(ValueError, match="record='cached_trained_half'.*cached_trained_partial"):
    serve_trained.run(levels=[1], repeats=1, max_batch=1, seed=0, record="cached_trained_half")
