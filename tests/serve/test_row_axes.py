"""Where a lane keeps each leaf's slots (`mdjax.serve.row_axes`): a cache stacked over layers
([N, B, ...]) keeps its layers leading and its slots beside its one row, every other leaf
its slots in front; indexing, gathering and the front slots read and write the same rows
whatever the axis. And the CPU allocator setting of the server's process."""

import os
import platform
import subprocess
import sys

import jax.numpy as jnp
import numpy as np

from mdjax.serve.row_axes import RowAxes
from tests.paths import REPO


def _row(batch: int, fill: float = 0.0):
  """A row started on `batch` rows: a cache [N=3, B, H=2], tokens [B, 5], a plan [K=4] and
  a scalar step."""
  return {"cache": jnp.full((3, batch, 2), fill), "tokens": jnp.full((batch, 5), fill),
          "plan": jnp.arange(4.0), "index": jnp.float32(fill)}


def test_each_leaf_keeps_its_slots_on_its_batch_axis():
  axes = RowAxes.of(_row(1), _row(2))
  assert axes.tree() == {"cache": 1, "index": 0, "plan": 0, "tokens": 0}
  rows = axes.stack(_row(1), 4)
  assert rows["cache"].shape == (3, 4, 1, 2) and rows["tokens"].shape == (4, 1, 5)
  assert rows["plan"].shape == (4, 4) and rows["index"].shape == (4,)
  for slot in range(4):  # row s holds s everywhere
    rows = axes.put(rows, slot, _row(1, float(slot)))
  for slot in range(4):
    row = axes.take(rows, slot)
    assert float(row["cache"].mean()) == slot == float(row["index"])
    assert row["cache"].shape == (3, 1, 2) and row["tokens"].shape == (1, 5)
  picked = axes.gather(rows, jnp.array([3, 1]))
  assert picked["cache"][:, :, 0, 0].tolist() == [[3, 1]] * 3
  back = axes.scatter(rows, jnp.array([0, 2]), picked)  # slot 0 <- row 3, slot 2 <- row 1
  assert [float(axes.take(back, s)["index"]) for s in range(4)] == [3, 1, 1, 3]


def test_the_front_slots_of_each_part():
  """Slots split in 2 parts (a 'data' axis of 2): a bucket of 2 is slots 0 and 2."""
  axes = RowAxes.of(_row(1), _row(2))
  rows = axes.stack(_row(1), 4)
  for slot in range(4):
    rows = axes.put(rows, slot, _row(1, float(slot)))
  front = axes.front(rows, split=2, bucket=2)
  assert front["cache"][0, :, 0, 0].tolist() == [0, 2] and front["index"].tolist() == [0, 2]
  front = {k: v + 10 for k, v in front.items()}
  rows = axes.put_front(rows, front, split=2)
  assert [float(axes.take(rows, s)["index"]) for s in range(4)] == [10, 1, 12, 3]
  np.testing.assert_array_equal(rows["cache"][:, 1], np.full((3, 1, 2), 1.0))


def test_the_server_keeps_freed_memory_on_glibc():
  """In a process of its own (it changes the process's allocator): the settings take on
  glibc."""
  path = os.path.join(REPO, "mdjax", "serve", "host_memory.py")
  code = ("import importlib.util as u; s = u.spec_from_file_location('h', %r); "
          "m = u.module_from_spec(s); s.loader.exec_module(m); "
          "print(m.kept(), m.keep_freed_memory(), m.kept())" % path)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, check=True).stdout.split()
  glibc = platform.libc_ver()[0] == "glibc"
  assert out == ["False", str(glibc), str(glibc)]
