"""The published-checkpoint checks that need an accelerator, as one short script.

  python -m mdjax.bench.pretrained_gpu [--out=/tmp/pretrained_gpu.json]

1. bfloat16 against float32 on the tiny LLaDA and Dream fixtures (tests/fixtures/pretrained):
   the fraction of positions whose top-1 id agrees, and the largest logit difference.
2. `formats.llada.generate` at a 1B-parameter random LLaDA shape (d 2048, 22 layers, 16 heads,
   MLP 5632, 32768 ids) in bfloat16 at batch 8: uncached and with the dual cache, medians of
   3 runs after a compiling run, tokens per second.

Prints one JSON object and writes it to --out. Needs no torch.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import numpy as np

from mdjax import io
from mdjax.bench import timing
from mdjax.formats import llada
from mdjax.io import record
from mdjax.models import published

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "pretrained")  # run from a checkout


def dtype_agreement() -> list[dict]:
  rows = []
  reference = np.load(os.path.join(FIXTURES, "reference_logits.npz"))
  for family in ("llada", "dream"):
    tokens_BxL = reference[f"{family}_tokens"]
    logits = {}
    for dtype in ("float32", "bfloat16"):
      model = io.load(os.path.join(FIXTURES, family), dtype=dtype)
      logits[dtype] = np.asarray(model.denoiser(model.params, tokens_BxL, None))
    finite = np.isfinite(logits["float32"])
    rows.append(dict(family=family, top1_agreement=float(
        (logits["float32"].argmax(-1) == logits["bfloat16"].argmax(-1)).mean()),
        max_abs_logit_diff=float(np.abs(logits["float32"][finite]
                                        - logits["bfloat16"][finite]).max())))
    print(rows[-1], flush=True)
  return rows


def one_billion(repeats: int = 3) -> list[dict]:
  config = published.PublishedConfig(
      family="llada", vocab_size=32768, d_model=2048, num_layers=22, num_heads=16,
      num_kv_heads=16, head_dim=128, mlp_hidden=5632, rope_theta=500000.0, norm_eps=1e-5,
      qkv_bias=False, logit_shift=False, mask_id=32000, eos_id=31999, eot_id=32001,
      dtype="bfloat16")
  params = published.init_params(config, jax.random.key(0))
  model = record.published_model(params=params, config=config, family="llada")
  prompt_BxP = np.random.default_rng(0).integers(0, 31000, (8, 128))
  rows = []
  for kv_cache in ("none", "dual"):
    run = lambda: jax.block_until_ready(llada.generate(
        model, prompt_BxP, steps=256, gen_length=256, block_length=32, kv_cache=kv_cache))
    seconds, _ = timing.median_run(run, repeats)
    rows.append(dict(params=published.num_params(config), kv_cache=kv_cache, batch=8,
                     prompt_len=128, gen_length=256, steps=256, block_length=32,
                     time_s=round(seconds, 3), tokens_per_s=round(8 * 256 / seconds, 1)))
    print(rows[-1], flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="/tmp/pretrained_gpu.json")
  args = parser.parse_args()
  result = dict(device=jax.devices()[0].device_kind, dtypes=dtype_agreement(),
                one_billion=one_billion())
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
