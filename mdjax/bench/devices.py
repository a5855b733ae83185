"""A model over devices: parameter bytes per device of each mode (FSDP, tensor, expert), and
on simulated CPU devices the tokens, the logit change and a short timing of each.

  python -m mdjax.bench.devices [--out=results/devices.json --devices=4 --repeats=3]

bytes: `mdjax.mesh.bytes_per_device` (from shapes, `jax.eval_shape`: no weights) for the
tiny LLaDA2 fixture (float32, as stored) and LLaDA2.0-mini / -flash's published shapes
(bfloat16, `mdjax.bench.families.PUBLISHED`) over 1, 2, 4 and 8 devices; a mode the shape
refuses (a count the devices do not divide) records the ArgumentError's message.

run: on `--devices` devices (with fewer, the module runs itself again in a process with
that many simulated CPU devices, XLA_FLAGS=--xla_force_host_platform_device_count), the
LLaDA2 fixture in every mode and the LLaDA fixture (dense) by FSDP and tensor: whether
`mdjax.generate` (the reference decoder, PROMPTS x NEW_TOKENS) gives the one-device tokens,
the largest |logit - one-device logit| on a canvas, and the median seconds of the generate
call (modes interleaved round by round, `timing.interleaved_medians`). Simulated devices
share the host's cores: the timing shows what the collectives cost in a program on a CPU,
nothing of a GPU's or TPU's speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

import mdjax
from mdjax import formats, mesh as mesh_lib, report
from mdjax.bench import families, timing
from mdjax.errors import ArgumentError

FIXTURES = {"llada2": "tests/fixtures/llada2", "llada": "tests/fixtures/pretrained/llada"}
PUBLISHED = ("LLaDA2.0-mini", "LLaDA2.0-flash")
DEVICE_COUNTS = (1, 2, 4, 8)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]
NEW_TOKENS = 32
SEED = 0


def _config(raw: dict, where: str, dtype: str):
  return formats.detect(raw, where).config_from_hf(raw, dtype)


def bytes_rows() -> list[dict]:
  """Bytes per device of every mode and device count, for the fixture and the published
  shapes."""
  models = {"llada2 fixture": (json.load(open(os.path.join(FIXTURES["llada2"],
                                                           "config.json"))), "float32")}
  models.update({name: (families.PUBLISHED[name]["raw"], "bfloat16") for name in PUBLISHED})
  rows = []
  for name, (raw, dtype) in models.items():
    config = _config(raw, name, dtype)
    for mode in mesh_lib.MODES:
      for n in DEVICE_COUNTS:
        row = {"model": name, "dtype": dtype, "mode": mode, "devices": n}
        try:
          row["bytes_per_device"] = mesh_lib.bytes_per_device(config, mode, n)
        except ArgumentError as error:
          row["refused"] = str(error)
        rows.append(row)
  return rows


def _meshes(family: str, count: int) -> dict:
  meshes = {"one device": None, f"fsdp {count}": mesh_lib.parallel_mesh(count),
            f"tensor {count}": mesh_lib.parallel_mesh(count, "tensor")}
  if family == "llada2":
    meshes[f"expert {count}"] = mesh_lib.parallel_mesh(count, "expert")
    if count % 2 == 0 and count > 2:
      shape = (count // 2, 2)
      meshes[f"expert {shape[0]} x tensor 2"] = Mesh(
          np.array(jax.devices()[:count]).reshape(shape), ("expert", "tensor"),
          axis_types=(AxisType.Auto,) * 2)
  return meshes


def run_rows(count: int, repeats: int) -> list[dict]:
  """Tokens, logit change and time of each mode on `count` devices."""
  rows = []
  canvas = np.array([[5, 6, 7, 8, 9, 10, 11, 12] * 4], np.int32)
  for family, path in FIXTURES.items():
    models = {name: mdjax.load(path, mesh=mesh) for name, mesh in _meshes(family, count).items()}
    generate = lambda model: [c.token_ids.tolist() for c in mdjax.generate(
        model, PROMPTS, max_new_tokens=NEW_TOKENS, key=jax.random.key(SEED))]
    one = models["one device"]
    want, logits = generate(one), np.asarray(one.denoiser(one.params, canvas, np.zeros(1)))
    finite = np.isfinite(logits)
    seconds = timing.interleaved_medians({name: (lambda m=m: generate(m))
                                          for name, m in models.items()}, repeats)
    for name, model in models.items():
      got = np.asarray(model.denoiser(model.params, canvas, np.zeros(1)))
      rows.append({"model": f"{family} fixture", "mode": name,
                   "tokens_equal": generate(model) == want,
                   "max_logit_change": float(np.abs(got[finite] - logits[finite]).max()),
                   "seconds": seconds[name]})
  return rows


def run(count: int, repeats: int) -> dict:
  return {"bytes": bytes_rows(), "runs": run_rows(count, repeats), "devices": count,
          "prompts": PROMPTS, "new_tokens": NEW_TOKENS, "seed": SEED, "repeats": repeats,
          "machine": timing.machine_info(),
          "notes": [
              "bytes: parameter bytes on each device, from the shapes alone; the key/value "
              "heads, norms, router and expert bias are whole on every device in the tensor "
              "and expert modes, the embedding and head too in the expert mode.",
              "runs: simulated CPU devices share the host's cores, so their seconds show "
              "the collectives' cost in a CPU program, nothing of a GPU's or TPU's speed."]}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="results/devices.json")
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  if jax.device_count() < args.devices:  # XLA reads the device count once, at start-up
    flags = os.environ.get("XLA_FLAGS", "")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
        f"{flags} --xla_force_host_platform_device_count={args.devices}").strip())
    subprocess.run([sys.executable, "-m", "mdjax.bench.devices", *(argv or sys.argv[1:])],
                   env=env, check=True)
    return
  report.write_json(args.out, run(args.devices, args.repeats))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
