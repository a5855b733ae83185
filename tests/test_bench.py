"""Smoke test of the benchmark: tiny sizes, the output's schema, finite positive ratios."""

import json
import math

import pytest

from configs.bench_cpu import get_config
from mdjax import bench, sampling

ROW_KEYS = {"sampler", "impl", "K", "batch", "seq_len", "params", "compile_s", "time_s",
            "tokens_per_s", "nfe"}


def _tiny_config():
  c = get_config()
  c.model.update(d_model=16, num_layers=1, num_heads=2, d_ff=32)
  c.seq_len, c.batch, c.train_batch, c.matmul_size = 8, 2, 2, 64
  # One step count: each family's programs depend on K, and one K shows every row kind.
  c.steps = (4,)
  c.samplers = ("ancestral", "blocks")  # a flat and a blocked plan; the other rows repeat them
  c.family_steps, c.call_steps, c.step_batches, c.step_length = 4, 4, (2,), 8
  c.overhead_repeats = 5
  return c


def test_bench_schema_and_ratios(tmp_path):
  config = _tiny_config()
  result = bench.run(config, log=lambda *_: None)
  bench.write(result, str(tmp_path / "bench"))
  data = json.loads((tmp_path / "bench.json").read_text())
  assert {"machine", "rows", "train"} <= set(data)
  assert {"platform", "device_kind", "cpu_count", "jax"} <= set(data["machine"])
  impls = {(r["sampler"], r["impl"], r["K"]) for r in data["rows"]}
  for k in config.steps:
    assert ("forward", "forward_only", k) in impls
    for family in config.samplers:
      assert {(family, "scan", k), (family, "python_loop", k)} <= impls
  for row in data["rows"]:
    assert ROW_KEYS <= set(row), row
    assert row["impl"] in bench.IMPLS
    assert 0 < row["nfe"] <= row["K"]
    for name in ("time_s", "tokens_per_s", "compile_s"):
      assert math.isfinite(row[name]) and row[name] >= 0, (name, row)
    assert row["time_s"] > 0 and row["tokens_per_s"] > 0
    if row["impl"] != "forward_only":
      for ratio in ("overhead_vs_forward", "loop_over_scan"):
        assert math.isfinite(row[ratio]) and row[ratio] > 0, (ratio, row)
  train = data["train"]
  for name in ("tokens_per_s", "flops_per_s", "peak_matmul_flops_per_s", "utilisation"):
    assert math.isfinite(train[name]) and train[name] > 0, name
  # The overhead measures: every registered family, both models, every family per batch.
  families = {r["sampler"]: r for r in data["families"]}
  assert set(families) == set(sampling.families())
  for row in families.values():
    assert row["contexts"] >= row["nfe"] >= 1 and row["overhead_vs_forward"] > 0, row
    # Every counted context is a sequence the program evaluated; speculative rounds also
    # evaluate padded contexts (the tiny config drafts 2 of 8 positions a round).
    assert row["evaluated"] >= row["contexts"], row
    assert row["overhead_vs_evaluated"] == pytest.approx(
        row["overhead_vs_forward"] * row["contexts"] / row["evaluated"])
  assert [r["model"] for r in data["calls"]] == ["bench", "tiny"]
  assert all(r["sample_s"] > 0 and r["program_s"] > 0 for r in data["calls"])
  assert {(r["sampler"], r["batch"]) for r in data["steps"]} == {
      (name, b) for name in sampling.families() for b in config.step_batches}
  assert all(r["us_per_step"] > 0 for r in data["steps"])
  text = (tmp_path / "bench.md").read_text()
  assert "| sampler | K |" in text and "sample() / program" in text and "µs / step, B=2" in text
  assert (tmp_path / "bench.png").stat().st_size > 0


def test_analytic_flops_match_xla_cost_analysis():
  # Two independent counts of the same forward pass agree where XLA reports FLOPs.
  import jax.numpy as jnp
  config = _tiny_config()
  config.model.update(d_model=64, num_heads=4, d_ff=256)
  config.seq_len = 32
  model_cfg, apply_fn, params = bench._model(config, None)
  tokens = jnp.zeros((4, 32), jnp.int32)
  xla = bench.forward_flops(apply_fn, params, tokens, model_cfg)
  analytic = bench.analytic_forward_flops(model_cfg, 4, 32)
  # The analytic count keeps only the matmuls; at d_model 64 norms, softmax and
  # activations add about a tenth, so the two agree within 25% unless one is wrong.
  assert 0.8 < xla / analytic < 1.25, (xla, analytic)


@pytest.mark.parametrize("field,value,match", [
    ("repeats", 2, "repeats=2"),
    ("overhead_repeats", 3, "overhead_repeats=3"),
    ("steps", (6,), "not divisible by num_blocks"),
    ("samplers", ("ancestral", "nope"), "unknown"),
    ("batch", 0, "batch=0"),
    ("family_steps", 99, "family_steps=99"),
    ("step_batches", (), "step_batches"),
])
def test_bad_settings_raise_before_compiling(field, value, match):
  config = _tiny_config()
  config[field] = value
  with pytest.raises(ValueError, match=match):
    bench.run(config, log=lambda *_: None)
