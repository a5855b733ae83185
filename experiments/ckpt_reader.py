"""What the restricted .ckpt reader costs on a heavy Lightning checkpoint.

  python experiments/ckpt_reader.py [--reads=7] [--out=results]

Writes results/ckpt_reader.json: a 4 MB data.pkl as torch writes it (a 2,000-tensor state
dict, Adam's two moments per tensor, a 50,000-entry vocabulary and a 2 MB blob in the
hyper-parameters), read by `mdjax.io.lightning.read_ckpt` (pickle's pure-Python
unpickler with the reader's checks) and, side by side, parsed by pickle's C unpickler with
torch's globals and storages resolved to no-ops (a floor: no checks, no tensors). Medians
over `--reads` runs; the file is built the same way each time.
"""

import argparse
import collections
import io
import json
import os
import pickle
import platform
import statistics
import tempfile
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for tests/
from mdjax.io import lightning  # noqa: E402
from tests.io.test_ckpt_attacks import LightningPickler, archive  # noqa: E402
from tests.io.test_dit_load import Call, G, Storage  # noqa: E402

TENSORS = 2000
VOCAB = 50_000
BLOB_BYTES = 2 << 20


def heavy_checkpoint() -> tuple[bytes, dict[str, bytes]]:
  """(data.pkl, storages) of a Lightning checkpoint of TENSORS 2x2 float tensors."""
  def tensor(key):
    return Call(G("torch._utils", "_rebuild_tensor_v2"), Storage(str(key), "FloatStorage", 4),
                0, Call(G("torch", "Size"), (2, 2)), (2, 1), False, collections.OrderedDict())

  state = collections.OrderedDict((f"backbone.blocks.{i // 10}.w{i % 10}.weight", tensor(i))
                                  for i in range(TENSORS))
  state._metadata = collections.OrderedDict([("", {"version": 1})])
  optimizer = {"state": {i: {"exp_avg": tensor(i), "exp_avg_sq": tensor(i)}
                         for i in range(TENSORS)},
               "param_groups": [{"lr": 3e-4, "params": list(range(TENSORS))}]}
  obj = {"epoch": 3, "state_dict": state, "optimizer_states": [optimizer],
         "hyper_parameters": {"vocab": {f"tok{i}": i for i in range(VOCAB)},
                              "blob": b"\x00" * BLOB_BYTES}}
  buf = io.BytesIO()
  LightningPickler(buf, protocol=2).dump(obj)
  return buf.getvalue(), {str(i): b"\x00" * 16 for i in range(TENSORS)}


class _Floor(pickle.Unpickler):
  """The C unpickler with torch's globals no-op callables (containers and builtin values as
  themselves): parsing, with no checks and no tensors built."""

  def find_class(self, module, name):
    if module in ("collections", "builtins", "__builtin__", "_codecs", "copy_reg", "copyreg"):
      return super().find_class(module, name)
    return lambda *args, **kwargs: None

  def persistent_load(self, pid):
    return None


def median_seconds(fn, reads: int) -> float:
  times = []
  for _ in range(reads):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def run(reads: int) -> dict:
  data, storages = heavy_checkpoint()
  with tempfile.TemporaryDirectory() as tmp:
    path = archive(os.path.join(tmp, "heavy.ckpt"), data, storages)
    read = lambda: lightning.state_tensors(lightning.read_ckpt(path), path)
    assert len(read()) == TENSORS
    reader = median_seconds(read, reads)
  floor = median_seconds(lambda: _Floor(io.BytesIO(data)).load(), reads)
  return {"data_pkl_bytes": len(data), "tensors": TENSORS, "vocabulary": VOCAB, "reads": reads,
          "read_ckpt_median_s": round(reader, 4), "c_unpickler_floor_median_s": round(floor, 4),
          "ratio": round(reader / floor, 2),
          "machine": {"processor": platform.processor() or platform.machine(),
                      "cpus": os.cpu_count(), "python": platform.python_version()}}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reads", type=int, default=7)
  parser.add_argument("--out", default="results")
  args = parser.parse_args()
  result = run(args.reads)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "ckpt_reader.json"), "w") as f:
    json.dump(result, f, indent=1)
    f.write("\n")
  print(json.dumps(result))


if __name__ == "__main__":
  main()
