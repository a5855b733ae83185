"""Tensor and expert parallelism (`mdjax.models.parallel`'s table, `mdjax.mesh`): the specs,
the refusals, the bytes each device holds, and on four simulated devices the tokens of every
mode equal the unsharded model's, offline and served."""

import json
import os
import textwrap

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mdjax
from mdjax import formats, mesh as mesh_lib
from mdjax.bench import families
from mdjax.errors import ArgumentError
from mdjax.models import parallel, published
from tests.devices import run_on_cpu_devices
from tests.paths import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures")
LLADA2 = os.path.join(FIXTURES, "llada2")
LLADA = os.path.join(FIXTURES, "pretrained", "llada")
DREAM = os.path.join(FIXTURES, "pretrained", "dream")


def _config(folder, dtype="float32", raw=None):
  raw = raw or json.load(open(os.path.join(folder, "config.json")))
  return formats.detect(raw, folder).config_from_hf(raw, dtype)


def test_one_table_places_heads_columns_and_experts_in_every_mode():
  """The tiny LLaDA2 (4 heads, 2 key/value heads, 8 experts of 32, a shared expert of 32,
  vocabulary 320): each mode's spec of each kind of leaf."""
  config = _config(LLADA2)
  spec = lambda key, shape, sizes: parallel.leaf_spec(
      config, key, shape, key.split("/")[0] in parallel.STACKS, sizes)
  experts, q, k = (2, 8, 64, 32), (2, 64, 64), (2, 64, 32)
  expert, tensor, both = {"expert": 4}, {"data": 1, "tensor": 4}, {"expert": 2, "tensor": 2}
  assert spec("moe_layers/experts_gate", experts, expert) == P(None, "expert", None, None)
  assert spec("moe_layers/experts_down", (2, 8, 32, 64), expert) == P(None, "expert", None, None)
  assert spec("moe_layers/q", q, expert) == P(None, None, None)  # pure EP: attention whole
  assert spec("moe_layers/experts_gate", experts, tensor) == P(None, None, None, "tensor")
  assert spec("moe_layers/experts_down", (2, 8, 32, 64), tensor) == P(None, None, "tensor", None)
  assert spec("moe_layers/q", q, tensor) == P(None, None, "tensor")
  assert spec("moe_layers/o", q, tensor) == P(None, "tensor", None)
  assert spec("layers/down", (1, 128, 64), tensor) == P(None, "tensor", None)
  assert spec("moe_layers/shared_up", (2, 64, 32), tensor) == P(None, None, "tensor")
  assert spec("embed", (320, 64), tensor) == P("tensor", None)
  assert spec("head", (64, 320), tensor) == P(None, "tensor")
  # 2 key/value heads on 4 devices: read whole; on 2 they split.
  assert spec("moe_layers/k", k, tensor) == P(None, None, None)
  assert spec("moe_layers/k", k, both) == P(None, None, "tensor")
  assert spec("moe_layers/experts_up", experts, both) == P(None, "expert", None, "tensor")
  # The routing and the norms are computed whole on every device.
  for key, shape in (("moe_layers/router", (2, 64, 8)), ("moe_layers/expert_bias", (2, 8)),
                     ("moe_layers/attn_norm", (2, 64)), ("final_norm", (64,))):
    assert spec(key, shape, both) == P(), key


def test_a_mesh_that_does_not_divide_is_refused_naming_what_is_allowed():
  config = _config(LLADA2)
  with pytest.raises(ArgumentError, match=r"'tensor' axis of 8 devices must divide "
                                          r"num_heads=4; allowed 'tensor' sizes: 1, 2, 4\.") as e:
    parallel.check(config, {"data": 1, "tensor": 8})
  assert e.value.param == "mesh"
  with pytest.raises(ArgumentError, match=r"'expert' axis of 3 devices must divide "
                                          r"num_experts=8; allowed 'expert' sizes: 1, 2, 4, 8"):
    parallel.check(config, {"expert": 3})
  with pytest.raises(ArgumentError, match="no routed experts to split over 'expert'"):
    parallel.check(_config(LLADA), {"expert": 2})
  parallel.check(config, {"expert": 8, "tensor": 4})  # any divisor, on each axis
  with pytest.raises(ArgumentError, match=r"parallel='pipeline' is invalid: it must be one "
                                          r"of fsdp, tensor, expert"):
    mesh_lib.parallel_mesh(1, "pipeline")


def test_only_the_published_transformer_is_split_over_model_axes():
  """A task's oracle, a DiT checkpoint: refused before anything is read."""
  mesh = mesh_lib.parallel_mesh(1, "tensor")
  assert mesh.axis_names == ("data", "tensor") and mesh_lib.splits_model(mesh)
  with pytest.raises(ArgumentError, match=r"'oracle:two_color', a task's exact denoiser, is "
                                          r"not split over 'tensor' or 'expert'") as e:
    mdjax.load("oracle:two_color", mesh=mesh)
  assert e.value.param == "mesh"
  with pytest.raises(ArgumentError, match="a DiTConfig network is not split over 'tensor'"):
    mdjax.load(os.path.join(FIXTURES, "dit", "mdlm"), mesh=mesh)
  assert not mesh_lib.splits_model(mesh_lib.parallel_mesh(1))  # fsdp: today's 'data' mesh


def test_bytes_per_device_on_llada2_mini_from_shapes():
  """LLaDA2.0-mini's published shape in bfloat16 over 8 devices, counted here leaf by leaf
  from the architecture (independently of the table): experts over 8; heads and columns over
  8 with the 4 key/value heads, the norms and the router whole; FSDP every matrix over 8."""
  entry = families.PUBLISHED["LLaDA2.0-mini"]
  config = _config("LLaDA2.0-mini", "bfloat16", raw=entry["raw"])
  shapes = published.param_shapes(config)
  flat = {f"{group}/{name}" if isinstance(leaves, dict) else group: s
          for group, leaves in shapes.items()
          for name, s in (leaves.items() if isinstance(leaves, dict) else [(None, leaves)])}
  size = {key: 2 * int(np.prod(s)) for key, s in flat.items()}
  total = sum(size.values())
  assert total == 2 * published.num_params(config)
  whole = lambda keys: sum(v for k, v in size.items() if k.split("/")[-1] in keys)
  experts = whole(("experts_gate", "experts_up", "experts_down"))
  vectors = sum(v for k, v in size.items() if len(flat[k]) - (k.split("/")[0] in
                                                               parallel.STACKS) < 2)
  replicated = whole(("k", "v", "router")) + vectors  # router [N, D, E]: a matrix, kept whole
  assert mesh_lib.bytes_per_device(config, "expert", 8) == total - experts + experts // 8
  assert mesh_lib.bytes_per_device(config, "tensor", 8) == (
      replicated + (total - replicated) // 8)
  assert mesh_lib.bytes_per_device(config, "fsdp", 8) == vectors + (total - vectors) // 8
  assert mesh_lib.bytes_per_device(config, "fsdp", 1) == total
  assert 32.4e9 < total < 32.6e9 and experts > 0.94 * total  # 16.26B parameters


@pytest.mark.slow
def test_every_mode_gives_the_unsharded_tokens_offline_and_served_on_four_devices():
  """LLaDA2 with its experts over 4 devices (its reference decoder: block cache and
  threshold), by the FSDP rule, and with the experts over 2 and their columns and the heads
  over 2 more; LLaDA and Dream with heads and columns over 4 (Dream's 2 key/value heads read
  whole): `mdjax.generate` gives the one-device tokens. With the experts alone split, the
  logits are the one-device ones bit for bit. Served (the engine's lanes: a vmap over rows)
  with the rows over 2 devices and the experts over 2, LLaDA2 equals generate."""
  code = textwrap.dedent(f"""
    import jax, numpy as np, mdjax
    from jax.sharding import AxisType, Mesh
    from mdjax import mesh as mesh_lib, sampling
    from mdjax.serve.engine import Engine

    prompts = [[5, 6, 7], [8, 9]]
    confidence = sampling.make_spec("confidence", length=8, steps=4)
    run = lambda model, spec: [c.token_ids.tolist() for c in mdjax.generate(
        model, prompts, max_new_tokens=8, key=jax.random.key(0), spec=spec)]
    both = Mesh(np.array(jax.devices()).reshape(2, 2), ("expert", "tensor"),
                axis_types=(AxisType.Explicit,) * 2)
    cases = [({LLADA2!r}, mesh_lib.parallel_mesh(4, "expert"), None, "experts_gate",
              (None, "expert", None, None), (2, 2, 64, 32)),
             ({LLADA2!r}, mesh_lib.parallel_mesh(4), None, "experts_gate",
              (None, None, "data", None), (2, 8, 16, 32)),
             ({LLADA2!r}, both, confidence, "experts_up", (None, "expert", None, "tensor"),
              (2, 4, 64, 16)),
             ({LLADA!r}, mesh_lib.parallel_mesh(4, "tensor"), confidence, "q",
              (None, None, "tensor"), (2, 64, 16)),
             ({DREAM!r}, mesh_lib.parallel_mesh(4, "tensor"), confidence, "o",
              (None, "tensor", None), (2, 16, 64))]
    alone, want = {{}}, {{}}
    for path, mesh, spec, leaf, placed, local in cases:
      if path not in alone:  # each checkpoint loaded and run unsharded once, not per case
        alone[path] = mdjax.load(path)
      one = alone[path]
      model = mdjax.load(path, mesh=mesh)
      w = model.params["moe_layers" if "moe_layers" in model.params else "layers"][leaf]
      assert tuple(w.sharding.spec) == placed and w.addressable_shards[0].data.shape == local, (
          path, w.sharding, w.addressable_shards[0].data.shape)
      if (path, spec) not in want:
        want[path, spec] = run(one, spec)
      expected = want[path, spec]
      assert run(model, spec) == expected, (path, mesh)
      if mesh.axis_names == ("data", "expert"):
        expert = model
    tokens = np.array([[5, 6, 7, 8, 9, 10, 11, 12]], np.int32)
    one = alone[{LLADA2!r}]
    np.testing.assert_array_equal(expert.denoiser(expert.params, tokens, np.zeros(1)),
                                  one.denoiser(one.params, tokens, np.zeros(1)))
    # Served on 2 x 2 devices: a lane's rows over 'data', the experts over 'expert'.
    rows = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "expert"),
                axis_types=(AxisType.Auto,) * 2)
    engine = Engine(mdjax.load({LLADA2!r}, mesh=rows), max_batch=2, canvas_length=16)
    jobs = [engine.prepare(p, max_new_tokens=8, seed=3 + i, sampler="confidence",
                           knobs=dict(steps=4)) for i, p in enumerate(prompts)]
    got = {{}}
    keep = lambda i: lambda u: u.completion is not None and got.__setitem__(i, u.completion)
    handles = [engine.submit(job, keep(i)) for i, job in enumerate(jobs)]
    while not all(h.done for h in handles):
      engine.run_once()
    assert engine.lanes[0].split == 2
    for i, (prompt, job) in enumerate(zip(prompts, jobs)):
      served, = mdjax.generate(one, [prompt], max_new_tokens=8, key=jax.random.key(job.seed),
                               spec=job.spec)
      np.testing.assert_array_equal(got[i].token_ids, served.token_ids)
    print("PARALLEL OK")
  """)
  run_on_cpu_devices(code, 4, "PARALLEL OK")
