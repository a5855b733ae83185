"""mdjax against the reference PyTorch loop on a LLaDA-shaped checkpoint; loading memory.

  pip install -e '.[reference]'
  python -m mdjax.bench.pretrained [--out=results] [--repeats=3]   # from the repository root

Sampling: a random LLaDA-shaped model (d 512, 8 layers, 8 heads, MLP 1536, 4096 ids: the
layers of a mid-sized model, a vocabulary cut so the head does not dominate on a CPU) is
saved in the published layout, loaded by `mdjax.io.load`, and sampled at batch 8
side by side with the same weights in PyTorch: LLaDA's `generate.py` loop on transformers'
Llama made bidirectional (the forward tests/reference/pretrained.py checks against
the published modeling code), and mdjax's `formats.llada.generate` uncached and with the dual
cache. Times are medians of --repeats runs after one warm-up run (mdjax's compiles there).
tokens_equal_reference compares the ids with the reference loop's at temperature 0: the
uncached loop for mdjax, Fast-dLLM's `generate_with_dual_cache` for the dual cache.

Loading: a synthetic LLaDA-shaped bfloat16 checkpoint over 1 GB in shards of 256 MB is
loaded in a fresh process, which reads its peak resident memory (the kernel's VmHWM, reset
before the load). On a CPU the loaded arrays are themselves host memory, so peak_host_bytes
is the peak above the resident memory before the load, less the bytes of the arrays
returned: the memory loading needs beyond the model, to compare with the largest shard.

Writes results/pretrained.json; fixed seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import jax
import numpy as np

from mdjax import io
from mdjax.bench import timing
from mdjax.formats import llada
from mdjax.models import published

VOCAB, MASK_ID, EOS_ID, EOT_ID = 4096, 4000, 3999, 4001
SAMPLING = dict(d_model=512, num_layers=8, num_heads=8, mlp_hidden=1536)
LOADING = dict(d_model=2048, num_layers=10, num_heads=16, mlp_hidden=5504)  # 1.05 GB bfloat16
SETTINGS = dict(batch=8, prompt_len=32, gen_length=32, steps=32, block_length=16)


def llada_config(d_model, num_layers, num_heads, mlp_hidden, dtype="float32"):
  return published.PublishedConfig(
      family="llada", vocab_size=VOCAB, d_model=d_model, num_layers=num_layers,
      num_heads=num_heads, num_kv_heads=num_heads, head_dim=d_model // num_heads,
      mlp_hidden=mlp_hidden, rope_theta=500000.0, norm_eps=1e-5, qkv_bias=False,
      logit_shift=False, mask_id=MASK_ID, eos_id=EOS_ID, eot_id=EOT_ID, dtype=dtype)


def spread_params(config, seed: int):
  """Random params whose logits are spread (std 0.02 everywhere gives near-uniform logits,
  whose argmax flips on float rounding between two implementations)."""
  params = published.init_params(config, jax.random.key(seed))
  return {**params, "embed": params["embed"] * 50.0, "head": params["head"] * 17.5}


def reference_module(config):
  """tests/reference/pretrained.py (torch) with its constants set to this model's shape."""
  try:
    from tests.reference import pretrained as ref
  except ImportError as e:
    raise SystemExit(f"{e}: run from the repository root, with the reference extra: "
                     "pip install -e '.[reference]'")
  ref.VOCAB, ref.MASK_ID = VOCAB, MASK_ID
  ref.LLADA_CONFIG = {**ref.LLADA_CONFIG, "d_model": config.d_model,
                      "n_heads": config.num_heads, "n_kv_heads": config.num_kv_heads,
                      "n_layers": config.num_layers, "mlp_hidden_size": config.mlp_hidden,
                      "embedding_size": VOCAB, "vocab_size": VOCAB, "mask_token_id": MASK_ID}
  return ref


def sampling_rows(repeats: int) -> list[dict]:
  import torch
  from safetensors.numpy import load_file
  torch.manual_seed(0)
  config = llada_config(**SAMPLING)
  s = SETTINGS
  with tempfile.TemporaryDirectory() as folder:
    io.save(spread_params(config, seed=0), folder, family="llada", config=config)
    model = io.load(folder)
    weights = load_file(os.path.join(folder, "model.safetensors"))
  ref = reference_module(config)
  torch_uncached, torch_cached = ref.LladaHF(weights), ref.LladaTorch(weights)
  prompt_BxP = np.random.default_rng(0).integers(0, 3900, (s["batch"], s["prompt_len"]))
  knobs = dict(steps=s["steps"], gen_length=s["gen_length"], block_length=s["block_length"])

  def mdjax_run(kv_cache):
    return lambda: np.asarray(jax.block_until_ready(
        llada.generate(model, prompt_BxP, kv_cache=kv_cache, **knobs)))

  torch_prompt = torch.from_numpy(prompt_BxP).long()
  reference = lambda: ref.llada_generate(torch_uncached, torch_prompt, mask_id=MASK_ID,
                                         eos_id=EOS_ID, eot_id=EOT_ID, **knobs).numpy()
  reference_dual = ref.generate_with_dual_cache(torch_cached, torch_prompt, mask_id=MASK_ID,
                                                **knobs)
  reference_dual = (reference_dual[0] if isinstance(reference_dual, tuple)
                    else reference_dual).numpy()
  torch.set_num_threads(os.cpu_count() or 1)
  rows = []
  reference_time, reference_ids = timing.median_run(reference, repeats)
  for impl, run, expected in (("mdjax", mdjax_run("none"), reference_ids),
                              ("mdjax_dual_cache", mdjax_run("dual"), reference_dual),
                              ("reference_torch", reference, reference_ids)):
    seconds, ids = (reference_time, reference_ids) if impl == "reference_torch" else \
        timing.median_run(run, repeats)
    rows.append(dict(family="llada", impl=impl, batch=s["batch"], prompt_len=s["prompt_len"],
                     gen_length=s["gen_length"], steps=s["steps"],
                     block_length=s["block_length"], time_s=round(seconds, 3),
                     tokens_equal_reference=bool(np.array_equal(ids, expected))))
    print(rows[-1], flush=True)
  return rows


LOAD_CHILD = r"""
import json, sys, time
import jax, numpy as np
from mdjax import io
jax.block_until_ready(jax.numpy.zeros(8) + 1)  # the runtime up before the baseline
def status(key):
  for line in open("/proc/self/status"):
    if line.startswith(key):
      return int(line.split()[1]) * 1024
with open("/proc/self/clear_refs", "w") as f:
  f.write("5")  # resets VmHWM to the current resident size
before = status("VmRSS:")
start = time.perf_counter()
model = io.load(sys.argv[1])
jax.block_until_ready(model.params)
seconds = time.perf_counter() - start
params_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
print(json.dumps(dict(seconds=seconds, peak_above_baseline=status("VmHWM:") - before,
                      params_bytes=params_bytes)))
"""


def load_row() -> dict:
  config = llada_config(**LOADING, dtype="bfloat16")
  with tempfile.TemporaryDirectory() as folder:
    io.save(published.init_params(config, jax.random.key(1)), folder, family="llada",
                    config=config, max_shard_bytes=256 << 20)
    shards = [os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
              if f.endswith(".safetensors")]
    child = subprocess.run([sys.executable, "-c", LOAD_CHILD, folder], check=True,
                           capture_output=True, text=True,
                           env={**os.environ, "JAX_PLATFORMS": "cpu"})
  measured = json.loads(child.stdout.strip().splitlines()[-1])
  peak = measured["peak_above_baseline"] - measured["params_bytes"]
  row = dict(params=published.num_params(config), dtype="bfloat16",
             seconds=round(measured["seconds"], 2), peak_host_bytes=int(max(peak, 0)),
             checkpoint_bytes=int(sum(shards)), num_shards=len(shards),
             largest_shard_bytes=int(max(shards)),
             peak_over_largest_shard=round(max(peak, 0) / max(shards), 3))
  print(row, flush=True)
  return row


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="results")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  result = {"rows": sampling_rows(args.repeats), "load": [load_row()]}
  by_impl = {r["impl"]: r["time_s"] for r in result["rows"]}
  result["speedup_vs_reference"] = {
      impl: round(by_impl["reference_torch"] / t, 2) for impl, t in by_impl.items()
      if impl != "reference_torch"}
  result["device"] = jax.devices()[0].device_kind
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "pretrained.json"), "w") as f:
    json.dump(result, f, indent=1)
    f.write("\n")
  print(json.dumps(result["speedup_vs_reference"]))


if __name__ == "__main__":
  main()
