"""Smoke tests of the benchmarks: tiny sizes, the output's schema (the committed results'
keys), finite positive ratios; the specs they time; the package's one-way imports."""

import ast
import json
import math
import pathlib

import pytest

from configs.bench_cpu import get_config
from mdjax import bench, sampling
from tests import paths
from mdjax.bench import compute, overhead, suite, throughput

REPO = pathlib.Path(paths.REPO)

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
  # The overhead and step-cost sweeps compile every family's program three times (most of
  # this test's time): a step-wise family and a composite one (speculative, whose rounds
  # evaluate padded contexts) show every row kind. That the default sweeps every registered
  # family is test_the_default_sweeps_every_family's.
  c.families = ("ancestral", "speculative")
  return c


def test_the_default_sweeps_every_family():
  assert get_config().families is None
  assert list(overhead.chosen_families()) == sorted(sampling.families())
  assert list(overhead.chosen_families(("speculative", "ancestral"))) == [
      "ancestral", "speculative"]
  config = _tiny_config()
  config.families = ("ancestral", "nope")
  with pytest.raises(ValueError, match=r"families=\['ancestral', 'nope'\] is invalid"):
    suite.check_config(config)


@pytest.mark.slow
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
  assert set(families) == set(config.families)
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
      (name, b) for name in config.families for b in config.step_batches}
  assert all(r["us_per_step"] > 0 for r in data["steps"])
  text = (tmp_path / "bench.md").read_text()
  assert "| sampler | K |" in text and "sample() / program" in text and "µs / step, B=2" in text
  assert (tmp_path / "bench.png").stat().st_size > 0
  assert_same_keys(data, REPO / "results" / "bench_cpu.json")


def key_structure(value):
  """The keys of a JSON value, nested; a list stands for the set of its elements' structures."""
  if isinstance(value, dict):
    return {name: key_structure(item) for name, item in value.items()}
  if isinstance(value, list):
    return sorted({json.dumps(key_structure(item), sort_keys=True) for item in value})
  return None


def assert_same_keys(data: dict, committed_path: pathlib.Path):
  """The keys a run writes are the committed result's (the model's: the committed ones at
  least, since a model config may gain fields after a result was made)."""
  committed = json.loads(committed_path.read_text())
  assert set(committed.pop("model")) <= set(data["model"])
  assert key_structure({k: v for k, v in data.items() if k != "model"}) == key_structure(committed)


@pytest.mark.slow
def test_analytic_flops_match_xla_cost_analysis():
  # Two independent counts of the same forward pass agree where XLA reports FLOPs.
  import jax.numpy as jnp
  config = _tiny_config()
  config.model.update(d_model=64, num_heads=4, d_ff=256)
  config.seq_len = 32
  model_cfg, apply_fn, params = suite.load_model(config, None)
  tokens = jnp.zeros((4, 32), jnp.int32)
  xla = compute.forward_flops(apply_fn, params, tokens, model_cfg)
  analytic = compute.analytic_forward_flops(model_cfg, 4, 32)
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


@pytest.mark.slow
def test_kv_cache_bench_schema(tmp_path):
  from configs.bench_kv_cache import get_config as kv_config
  from mdjax.bench import kv_cache

  config = kv_config()
  config.model.update(d_model=16, num_layers=1, num_heads=2, d_ff=32)
  config.kv_cache.block, config.kv_cache.repeats = 8, 1
  config.kv_cache.cells = ((32, 2, (1 / 4, 1)),)
  result = kv_cache.run(config, log=lambda *_: None)
  kv_cache.write(result, str(tmp_path / "kv"))
  data = json.loads((tmp_path / "kv.json").read_text())
  assert_same_keys(data, REPO / "results" / "bench_kv_cache.json")
  rows = data["rows"]
  assert {(r["K"], r["impl"]) for r in rows} == {(8, "none"), (8, "dual"), (32, "none"),
                                                  (32, "dual")}
  for row in rows:
    assert row["time_s"] > 0 and row["peak_bytes"] > 0 and math.isfinite(row["compile_s"])
  ceiling = {(r["K"], r["impl"]): r["flop_ceiling"] for r in rows}
  # 4 blocks of 8: uncached, every step a full pass (ceiling 1); cached, 4 full passes and
  # K - 4 window passes, so the ceiling grows with K.
  assert ceiling[8, "none"] == ceiling[32, "none"] == 1.0
  assert 1.0 < ceiling[8, "dual"] < ceiling[32, "dual"]
  assert "FLOP ceiling" in (tmp_path / "kv.md").read_text()


def test_timed_specs():
  # The results were measured with these specs: a family's `bench_spec` must keep them.
  at = lambda sampler: throughput.sweep_spec(sampler, 8, 64, 4)
  assert at("ancestral") == sampling.AncestralSpec(steps=8)
  assert at("remask") == sampling.RemaskSpec(steps=8, eta=0.05)
  assert at("blocks") == sampling.ConfidenceSpec(steps=8, block_length=16)
  assert at("confidence_no_skip") == sampling.ConfidenceSpec(steps=8, skip_idle_steps=False)
  with pytest.raises(ValueError, match="must be one of"):
    at("speculative")
  spec = {name: family.bench_spec(8, 16) for name, family in sampling.families().items()}
  assert spec["defer"] == sampling.DeferSpec(steps=8)
  assert spec["ordered"].groups == tuple((2 * i, 2 * i + 1) for i in range(8))
  assert spec["field_order"].counts == ((2, 0),) * 4 + ((0, 2),) * 4
  assert spec["speculative"] == sampling.SpeculativeSpec(k=2)
  assert spec["local_remask"] == sampling.LocalRemaskSpec(
      base=sampling.ConfidenceSpec(steps=4), refill=sampling.AncestralSpec(steps=2), rounds=1)
  assert spec["random_order"] == sampling.RandomOrderSpec()


def test_bench_modules_import_one_way():
  # No module of the package imports one that imports it back, nor another's private name.
  package = REPO / "mdjax" / "bench"
  modules = {path.stem for path in package.glob("*.py")}
  edges = {}
  for name in modules:
    edges[name] = set()
    for node in ast.walk(ast.parse((package / f"{name}.py").read_text())):
      if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mdjax")):
        continue
      assert not [a.name for a in node.names if a.name.startswith("_")], (name, node.module)
      if node.module == "mdjax.bench":
        edges[name] |= {a.name if a.name in modules else "__init__" for a in node.names}
      elif node.module.startswith("mdjax.bench."):
        edges[name].add(node.module.removeprefix("mdjax.bench."))
  done = set()

  def visit(name, path):
    assert name not in path, f"import circle: {' -> '.join(path + (name,))}"
    if name not in done:
      for target in edges[name]:
        visit(target, path + (name,))
      done.add(name)

  for name in modules:
    visit(name, ())
