"""The one FSDP rule (`mdjax.mesh`) for training and loading, and a published model loaded
onto a mesh as docs/pretrained.md shows it, then sampled."""

import os
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec

from mdjax import mesh as mesh_lib
from tests.devices import run_on_cpu_devices
from tests.paths import REPO

LLADA = os.path.join(REPO, "tests", "fixtures", "pretrained", "llada")


def test_the_largest_dimension_the_axis_divides_is_split():
  spec = mesh_lib.fsdp_spec
  assert spec((16, 64), "fsdp", 8) == PartitionSpec(None, "fsdp")
  assert spec((64, 64), "fsdp", 8) == PartitionSpec("fsdp", None)  # the first of equal ones
  # GPT-2's vocabulary does not split over 8 devices; the width does.
  assert spec((50258, 768), "fsdp", 8) == PartitionSpec(None, "fsdp")
  assert spec((16, 6), "data", 4) == PartitionSpec("data", None)
  # The layer axis of a stacked leaf is never split, however large; vectors are replicated.
  assert spec((8, 4, 6), "fsdp", 4, stacked=True) == PartitionSpec(None, "fsdp", None)
  assert spec((8, 3, 6), "fsdp", 4, stacked=True) == PartitionSpec()
  assert spec((8, 16), "fsdp", 4, stacked=True) == PartitionSpec()
  assert spec((16,), "data", 4) == PartitionSpec() and spec((), "data", 4) == PartitionSpec()


def test_a_matrix_no_dimension_divides_is_replicated_in_training_refused_in_loading():
  assert mesh_lib.fsdp_spec((6, 10), "data", 4) == PartitionSpec()
  with pytest.raises(ValueError, match=r"tensor head \(6, 10\): dim 1 of size 10 is not "
                                       r"divisible by mesh axis 'fsdp' of size 4, nor is any"):
    mesh_lib.fsdp_spec((6, 10), "fsdp", 4, strict=True, name="head")
  with pytest.raises(ValueError, match="tensor q"):
    mesh_lib.partition_spec("q", (6, 10), "fsdp", 4)


def test_training_and_loading_share_the_rule():
  from mdjax import train
  from mdjax.io.folder import load_spec as loading_rule
  assert train.param_sharding is mesh_lib.param_sharding
  assert train.make_mesh is mesh_lib.make_mesh
  assert loading_rule is mesh_lib.load_spec
  params = {"embed": np.zeros((7, 16)), "scale": np.zeros(16), "head": np.zeros((16, 6))}
  mesh = mesh_lib.make_mesh(1)
  shardings = mesh_lib.param_sharding(mesh, params, fsdp=True)
  assert shardings["embed"].spec == PartitionSpec(None, "data")
  assert shardings["head"].spec == PartitionSpec("data", None)
  assert shardings["scale"].spec == PartitionSpec()
  assert all(s.spec == PartitionSpec()
             for s in jax.tree.leaves(mesh_lib.param_sharding(mesh, params, fsdp=False)))
  # Any mesh: its first axis, as the loader splits (a workdir loaded with mesh=).
  fsdp = Mesh(np.array(jax.devices()[:1]), ("fsdp",), axis_types=(AxisType.Explicit,))
  assert mesh_lib.param_sharding(fsdp, params, fsdp=True)["embed"].spec == PartitionSpec(
      None, "fsdp")


def test_explicit_axes_become_auto():
  explicit = Mesh(np.array(jax.devices()[:1]), ("fsdp",), axis_types=(AxisType.Explicit,))
  auto = mesh_lib.auto_axes(explicit)
  assert auto.axis_types == (AxisType.Auto,) and auto.axis_names == ("fsdp",)
  assert list(auto.devices.flat) == list(explicit.devices.flat)
  assert mesh_lib.auto_axes(auto) is auto


@pytest.mark.slow
def test_documented_mesh_load_then_generate_on_four_devices():
  """docs/pretrained.md's call, `jax.make_mesh` (Explicit axes) and all, over 4 devices: the
  parameters are split and the samples are the unsharded model's, token for token."""
  code = textwrap.dedent(f"""
    import jax, numpy as np
    from mdjax import io
    from mdjax.formats import llada

    assert jax.device_count() == 4
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    model = io.load({LLADA!r}, mesh=mesh)
    embed = model.params["embed"]
    assert embed.sharding.num_devices == 4 and embed.sharding.spec[0] == "fsdp", embed.sharding
    prompt = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9], [3, 3, 3]], np.int32)
    sharded = llada.generate(model, prompt, steps=2, gen_length=4, block_length=4)
    alone = llada.generate(io.load({LLADA!r}), prompt, steps=2, gen_length=4, block_length=4)
    np.testing.assert_array_equal(np.asarray(sharded), np.asarray(alone))
    # The same through the one loader and generate, as the page now writes it.
    import mdjax
    run = lambda model: [c.token_ids.tolist() for c in mdjax.generate(
        model, [[1, 2, 3], [4, 5]], max_new_tokens=4, steps=2, block_length=4,
        key=jax.random.key(0))]
    assert run(mdjax.load({LLADA!r}, mesh=mesh)) == run(mdjax.load({LLADA!r}))
    print("MESH LOAD OK")
  """)
  run_on_cpu_devices(code, 4, "MESH LOAD OK")


# LLaDA2's experts split by the FSDP rule, and by the tensor and expert modes:
# tests/test_mesh_parallel.py (one process of four devices for every mode).
