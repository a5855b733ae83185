"""DiffusionGemma's and LLaDA2.1's rows of the families benchmark (mdjax/bench/families_gemma.py)
on tiny settings: mdjax's side timed, gemma's figures read from the reference script's JSON
(here a stand-in file) and set beside them, the tiny model's row 0 compared with gemma's
tokens; LLaDA2.1's editing decoder cached against recomputing."""

import json

import numpy as np
import pytest

from mdjax.bench import families, families_gemma
from tests.bench.test_families import TINY, TINY_GEMMA, TINY_SETTINGS


@pytest.mark.slow
def test_diffusion_gemma_rows_set_gemmas_figures_beside_mdjaxs(tmp_path, monkeypatch):
  monkeypatch.setattr(families_gemma, "SMALL", TINY_GEMMA)
  monkeypatch.setattr(families_gemma, "MODELS", {"tiny": (9, 8, 2, 2), "small": (4, 4, 2, 2)})
  monkeypatch.setattr(families_gemma, "BATCHES", (1,))
  # Without the reference file: mdjax's rows alone, and how to make gemma's.
  monkeypatch.setattr(families_gemma, "REFERENCE", str(tmp_path / "none.json"))
  alone = families_gemma.diffusion_gemma_rows(1)
  assert "tests/reference/diffusion_gemma_bench.py" in alone["reference"]
  assert "--gpu" in alone["gpu_command"]
  tiny = alone["rows"][0]
  assert (tiny["model"], tiny["batch"]) == ("tiny", 1)
  # The prompt's pass, 2 steps a canvas, the first canvas's append (unless it ended the row).
  assert tiny["denoiser_calls"] in (1 + 2, 1 + 2 + 1 + 2)
  assert len(tiny["tokens_row0"]) == 16 and "gemma_seconds" not in tiny
  # With it: gemma's seconds, the speed-up, and row 0's tokens compared up to an end token.
  reference = tmp_path / "reference.json"
  gemma_tokens = families_gemma.until_stop(tiny["tokens_row0"]) + [0] * 3
  reference.write_text(json.dumps({"rows": [
      {"model": "tiny", "batch": 1, "seconds": 2 * tiny["seconds"],
       "tokens_row0": gemma_tokens[:16]},
      {"model": "small", "batch": 1, "seconds": 1.0, "tokens_row0": []}], "device": "cpu"}))
  monkeypatch.setattr(families_gemma, "REFERENCE", str(reference))
  out = families_gemma.diffusion_gemma_rows(1)
  rows = {r["model"]: r for r in out["rows"]}
  assert rows["tiny"]["tokens_equal_gemma"] is True
  assert rows["tiny"]["speedup_vs_gemma"] > 0 and rows["small"]["gemma_seconds"] == 1.0
  assert "tokens_equal_gemma" not in rows["small"]  # other weights than gemma's
  assert out["reference"] == {"device": "cpu"}


def test_until_stop_keeps_the_end_token():
  assert families_gemma.until_stop([5, 7, 106, 3]) == [5, 7, 106]
  assert families_gemma.until_stop([5, 50, 1]) == [5, 50]
  assert families_gemma.until_stop([5, 7]) == [5, 7]


@pytest.mark.slow
def test_llada21_rows_cached_equal_recomputing(tmp_path, monkeypatch):
  monkeypatch.setattr(families, "SMALL", TINY)
  networks = {**families.SMALL_NETWORKS,
              "llada2": {**families.SMALL_NETWORKS["llada2"], "rotary_dim": 8}}
  monkeypatch.setattr(families, "SMALL_NETWORKS", networks)
  model = families.small_model("llada2", str(tmp_path / "llada2"))
  rows = families_gemma.llada21_rows(model, families.timed_decoders, 1, TINY_SETTINGS)
  assert {r["decoder"] for r in rows} == {"mdjax_cached", "mdjax_uncached"}
  for row in rows:
    assert row["decoder_mode"].startswith("llada21") and row["tokens_equal_cached"] is True
    assert row["seconds"] > 0 and np.all(np.asarray(row["generated_lengths"]) >= 1)
