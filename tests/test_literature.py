"""The literature-samplers experiment (the samplers themselves: tests/sampling/)."""

from mdjax.tasks import scan_and_add as sa


def test_literature_experiment_schema(trained, tmp_path, monkeypatch):
  import json
  from tests.scripts import load_script
  ls = load_script("literature_samplers")
  from mdjax import tasks, train
  root, _ = trained
  _, char_apply, char_params, _ = train.load_for_sampling(str(root / "char"))
  config, causal_apply, causal_params, _ = train.load_for_sampling(str(root / "causal"))
  text_models = (tasks.from_config(config), {"char": (char_apply, char_params),
                                             "causal": (causal_apply, causal_params)})
  # Each row is a program to compile. Every family once at one budget on ScanAndAdd (and
  # the speculative sampler, whose budget is what it uses); on text the speculative only.
  monkeypatch.setattr(ls, "BUDGETS", {"scan_and_add": (8,), "shakespeare": ()})
  monkeypatch.setattr(ls, "SPECULATIVE_KS", (4,))
  monkeypatch.setattr(ls, "DEFER_THRESHOLDS", (0.2,))
  monkeypatch.setattr(ls, "ADAPTIVE_DEFER_THRESHOLDS", ())
  # The exact denoiser stands in for the trained model: its rows run the oracle's programs
  # (the compilation cache serves them).
  results = ls.run(64, repeats=5, sa_model=(sa.exact_denoiser, None), text_models=text_models)
  ls.write(results, str(tmp_path))
  data = json.loads((tmp_path / "literature_samplers.json").read_text())
  assert (tmp_path / "literature_samplers.png").stat().st_size > 0
  families = {r["sampler"] for r in data["rows"]}
  assert families == set(ls.FAMILY_ORDER)
  assert {r["task"] for r in data["rows"]} == {"scan_and_add", "shakespeare"}
  for row in data["rows"]:
    assert set(ls.ROW_KEYS) <= set(row)
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
