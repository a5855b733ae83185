"""The block diffusion families' benchmark (mdjax/bench/families.py) on tiny settings: the
JSON it writes, the --gpu mode on a tiny stand-in of the published shapes (the timed
decoders: the cached decoder's tokens against the recomputing one), and the published
sizes' parameter counts against their safetensors indexes. The published loops, the parity
figures and the sampler rows need torch or many compiles: the full run covers them."""

import json
import pathlib

import pytest

from mdjax.bench import families
from mdjax.models import diffusion_gemma as network
from tests import paths

TINY = {**families.SMALL, "vocab_size": 64, "d_model": 32, "num_layers": 1, "num_heads": 2,
        "num_kv_heads": 1, "head_dim": 16, "mlp_hidden": 64, "mask_id": 63, "eos_id": 62,
        "max_len": 64}
TINY_SETTINGS = {"prompt_len": 4, "max_new_tokens": 8, "batches": (1,)}
DECODER_KEYS = {"family", "decoder", "batch", "prompt_len", "max_new_tokens", "seconds",
                "denoiser_calls", "tpf", "rows_one_by_one", "generated_lengths",
                "tokens_equal_cached", "tokens_equal_reference"}
TINY_GEMMA = network.DiffusionGemmaConfig(
    vocab_size=64, d_model=16, layer_types=("local", "global"), num_heads=2, head_dim=8,
    num_kv_heads=1, global_head_dim=8, num_global_kv_heads=1, sliding_window=4, mlp_hidden=16,
    num_experts=2, experts_per_token=1, expert_hidden=8, condition_hidden=16, max_len=64,
    dtype="float32", eot_id=None)
TINY_GEMMA_GPU = {"prompt_len": 4, "canvas": 4, "canvases": 2, "steps": 2}
MEMORY_KEYS = {"model", "family", "params", "params_bytes_bf16", "kv_bytes_per_token",
               "devices_80gb", "mesh", "source"}


def _check_decoders(rows, new):
  assert {r["decoder"] for r in rows} == {"mdjax_cached", "mdjax_uncached"}
  for row in rows:
    assert DECODER_KEYS <= set(row), row
    assert row["tokens_equal_cached"] is True, row  # recomputing = the exact block cache
    assert row["tokens_equal_reference"] is None and row["rows_one_by_one"] is False
    assert row["seconds"] > 0 and row["denoiser_calls"] >= 1
    assert row["tpf"] == round(new / row["denoiser_calls"], 3)
    assert all(1 <= n <= new for n in row["generated_lengths"])
  calls = {r["decoder"]: r["denoiser_calls"] for r in rows}
  assert calls["mdjax_cached"] > calls["mdjax_uncached"]  # + a pass appending each block


@pytest.mark.slow
def test_main_writes_every_section(tmp_path, monkeypatch):
  """The small model saved in the published layout and loaded, handed to the decoders (here
  a stand-in: the --gpu test below runs them) with SDAR's greedy knobs."""
  seen = []

  def decoders(model, reference, repeats, settings, knobs):
    seen.append((model.family, model.vocab_size, reference, repeats, settings, knobs))
    return [{"family": model.family, "decoder": "stand-in"}]

  monkeypatch.setattr(families, "FAMILIES", ("sdar",))
  monkeypatch.setattr(families, "SMALL", TINY)
  monkeypatch.setattr(families, "SETTINGS", TINY_SETTINGS)
  monkeypatch.setattr(families, "_reference_loop", lambda family, folder: None)
  monkeypatch.setattr(families, "timed_decoders", decoders)
  monkeypatch.setattr(families, "sampler_rows", lambda model: [{"family": model.family}])
  monkeypatch.setattr(families, "parity_rows", lambda: [{"family": "sdar"}])
  monkeypatch.setattr(families.families_gemma, "diffusion_gemma_rows",
                      lambda repeats: {"rows": [{"repeats": repeats}]})
  families.main(["--out", str(tmp_path), "--repeats=1"])
  assert seen == [("sdar", 64, None, 1, TINY_SETTINGS, {"temperature": 0.0})]
  result = json.loads((tmp_path / "families.json").read_text())
  assert set(result) == {"parity", "decoders", "samplers", "memory", "device", "settings",
                         "repeats", "machine", "torch", "llada21", "diffusion_gemma"}
  assert result["diffusion_gemma"] == {"rows": [{"repeats": 1}]}
  assert result["llada21"] == []  # LLaDA2.1's decoder runs on the llada2 model only
  assert result["decoders"] == [{"family": "sdar", "decoder": "stand-in"}]
  assert result["samplers"] == result["parity"] == [{"family": "sdar"}]
  assert result["settings"]["small"]["vocab_size"] == 64 and result["repeats"] == 1
  assert {r["model"] for r in result["memory"]} == set(families.PUBLISHED)


def test_memory_rows_match_the_published_indexes():
  rows = {r["model"]: r for r in families.memory_rows()}
  for row in rows.values():
    assert MEMORY_KEYS <= set(row), row
    devices = row["devices_80gb"]
    assert devices & (devices - 1) == 0 and row["params_bytes_bf16"] == 2 * row["params"]
  for name in ("SDAR-4B-Chat", "SDAR-8B-Chat"):  # model.safetensors.index.json's total_size
    assert rows[name]["matches_index"] is True
    assert rows[name]["params_bytes_bf16"] == rows[name]["index_total_size"]
  assert rows["LLaDA2.0-mini"]["active_params"] < rows["LLaDA2.0-mini"]["params"] / 5


@pytest.mark.slow
def test_gpu_mode_on_a_tiny_stand_in(tmp_path, monkeypatch):
  """--gpu on the SDAR fixture's config.json (3 layers, width 64) instead of the published
  shapes: random bfloat16 weights, the same decoders."""
  raw = json.loads((pathlib.Path(paths.REPO) / "tests/fixtures/sdar/config.json").read_text())
  monkeypatch.setattr(families, "PUBLISHED", {"tiny-sdar": {"family": "sdar", "raw": raw}})
  monkeypatch.setattr(families, "GPU_SHAPES", ("tiny-sdar",))
  monkeypatch.setattr(families, "GPU_SETTINGS", TINY_SETTINGS)
  # DiffusionGemma's published shape, as the tiny random one of tests/bench/test_families_gemma.
  monkeypatch.setattr(families.families_gemma, "GPU_CONFIG", TINY_GEMMA)
  monkeypatch.setattr(families.families_gemma, "GPU", TINY_GEMMA_GPU)
  families.main(["--gpu", "--out", str(tmp_path), "--repeats=1"])
  result = json.loads((tmp_path / "families_gpu.json").read_text())
  assert set(result) == {"decoders", "diffusion_gemma", "device", "settings", "repeats",
                         "machine"}
  assert [r["batch"] for r in result["diffusion_gemma"]] == [1, 8]
  assert all(r["seconds"] > 0 and r["denoiser_calls"] >= 2 for r in result["diffusion_gemma"])
  assert {r["model"] for r in result["decoders"]} == {"tiny-sdar"}
  _check_decoders(result["decoders"], TINY_SETTINGS["max_new_tokens"])


def test_rows_compare_up_to_eos():
  assert families.until_eos([[5, 7, 9, 7], [1, 2, 3, 4]], eos_id=7) == [[5, 7], [1, 2, 3, 4]]
  assert families.first_difference([[1, 2]], [[1, 2]]) is None
  assert families.first_difference([[1, 2], [3, 4]], [[1, 2], [3]]) == {
      "row": 1, "position": 1, "tokens": [4, None]}


def test_bad_repeats_are_refused(tmp_path):
  with pytest.raises(ValueError, match="--repeats=0 must be >= 1"):
    families.main(["--out", str(tmp_path), "--repeats=0"])


def test_only_recomputes_the_sections_named(tmp_path, monkeypatch):
  """--only: the named sections computed again, every other key of families.json kept."""
  (tmp_path / "families.json").write_text(json.dumps({"decoders": [1], "llada21": "old"}))
  monkeypatch.setitem(families.ONLY, "llada21", lambda repeats: [{"repeats": repeats}])
  families.main(["--out", str(tmp_path), "--only=llada21", "--repeats=2"])
  result = json.loads((tmp_path / "families.json").read_text())
  assert result == {"decoders": [1], "llada21": [{"repeats": 2}]}
  with pytest.raises(ValueError, match=r"\['parity'\] are not sections it computes"):
    families.main(["--out", str(tmp_path), "--only=parity"])
