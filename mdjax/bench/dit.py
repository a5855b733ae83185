"""MDLM's and BD3-LM's samplers in mdjax against the reference PyTorch sampler loops, on CPU.

  pip install -e '.[reference]'
  python -m mdjax.bench.dit --bd3lms PATH [--out results/dit.json] [--repeats 3]

Run from the repository root: the torch side is tests/reference/ (tests/reference/dit_loops.py,
the reference loops transcribed, on bd3lms' network as tests/reference/dit.py builds it).
PATH: a checkout or git directory of github.com/kuleshov-group/bd3lms (its Hugging Face BD3LM
network runs the torch side; MDLM is the same class with cross_attn False). Writes
{"parity": [...], "rows": [...]}:

  parity: max |logit difference| of mdjax's DiT against the reference network: the fixtures'
    recorded logits (tests/fixtures/dit/reference_logits.npz, MDLM, MDLM time-conditioned,
    BD3-LM's sampling pass, BD3-LM's [x_t; x_0] training pass), and the benchmark models.
  rows: one per (model, sampler): wall time of one sampling run (median of --repeats, after
    a warm-up run that compiles), nfe (network passes) and saved_calls (steps whose pass was
    skipped or reused). The torch loops: mdlm `Diffusion._sample` (ddpm_cache) and bd3lms
    `Diffusion._semi_ar_sampler` (first hitting, nucleus, its KV cache). The reference's first
    hitting needs batch 1 (`.item()`), so its rows are batch 1; mdjax's are batch 1 and 8.
  Both sides sample a tiny random DiT (float32, 4 blocks of width 128, 2048 ids, 128
  positions; BD3-LM block 4) built once by `mdjax.models.dit.init_params` and copied into the
  reference's state dict. The torch side lives in tests/reference/ (the `[reference]` extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib

import jax
import numpy as np

from mdjax.bench import timing
from mdjax.formats import bd3lm, mdlm
from mdjax.models import dit

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository (tests/ beside mdjax/)
FIXTURES = ROOT / "tests" / "fixtures" / "dit"
V, HIDDEN, COND, BLOCKS, HEADS, LENGTH, BLOCK = 2048, 128, 64, 4, 4, 128, 4
BOS = 0


@dataclasses.dataclass(frozen=True)
class Model:
  params: dict
  config: dit.DiTConfig
  apply_fn: object = None


def reference_loops():
  """tests/reference/dit_loops.py (torch), from a checkout with the `[reference]` extra."""
  try:
    from tests.reference import dit_loops
  except ImportError as e:
    raise SystemExit(f"{e}: run from the repository root, with the reference extra: "
                     "pip install -e '.[reference]'")
  return dit_loops


def block(x):
  return jax.block_until_ready(x)


def parity_rows() -> list[dict]:
  from mdjax import io
  ref = np.load(FIXTURES / "reference_logits.npz")
  rows = []
  for name in ("mdlm", "mdlm_time", "bd3lm"):
    model = io.load(str(FIXTURES / name))
    cfg = model.config
    ours = dit.forward(cfg, model.params, ref[f"{name}_tokens"], ref[f"{name}_sigma"])
    setting = "sampling pass (block-causal)" if cfg.block_size else "forward"
    rows.append({"model": f"fixture {name}", "setting": setting,
                 "max_abs_logit_diff": float(np.abs(np.asarray(ours) - ref[f"{name}_logits"]).max())})
    if cfg.block_size:
      subs_ours = np.asarray(model.denoiser.block_pair(model.params, ref["bd3lm_pair_xt"],
                                                        ref["bd3lm_pair_x0"], ref["bd3lm_pair_t"]))
      theirs = ref["bd3lm_pair_subs"][..., :cfg.vocab_size]
      finite = np.isfinite(subs_ours) & (theirs > -1e5)
      rows.append({"model": "fixture bd3lm", "setting": "[x_t; x_0] training pass, SUBS log-probs",
                   "max_abs_logit_diff": float(np.abs(subs_ours - theirs)[finite].max())})
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--bd3lms", type=pathlib.Path, required=True)
  parser.add_argument("--out", type=pathlib.Path, default=ROOT / "results" / "dit.json")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--mdlm_steps", type=int, default=128)
  parser.add_argument("--bd3lm_length", type=int, default=2 * LENGTH)
  # As many torch threads as XLA's pool uses (every core) on a quiet machine; on a shared
  # one, torch's threads suffer far more from contention (single passes up to 40x slower):
  # pass --torch_threads=1 there and say so.
  parser.add_argument("--torch_threads", type=int, default=os.cpu_count() or 1)
  args = parser.parse_args(argv)
  loops = reference_loops()
  torch_version = loops.setup(args.torch_threads)
  bd3 = loops.Bd3lms(args.bd3lms)
  parity = parity_rows()
  rows = []
  for family in ("mdlm", "bd3lm"):
    cfg = dit.DiTConfig(family=family, vocab_size=V, hidden_dim=HIDDEN, cond_dim=COND,
                        n_blocks=BLOCKS, n_heads=HEADS, model_length=LENGTH,
                        block_size=BLOCK if family == "bd3lm" else None)
    model = Model(params=dit.init_params(cfg, jax.random.key(0)), config=cfg)
    net = loops.reference_net(bd3, cfg, model.params)
    tokens = np.random.default_rng(0).integers(0, V + 1, (2, LENGTH))
    theirs = loops.forward(net, tokens, sample_mode=family == "bd3lm")
    ours = dit.forward(cfg, model.params, tokens, np.zeros(2))
    parity.append({"model": f"bench {family}", "setting": "forward on 2 x 128 tokens",
                   "max_abs_logit_diff": float(np.abs(np.asarray(ours) - theirs).max())})
    if family == "mdlm":
      for batch in (1, 8):
        steps = args.mdlm_steps
        seconds, out = timing.median_run(lambda: block(mdlm.mdlm_sample(
            model, num_samples=batch, steps=steps, key=jax.random.key(1))), args.repeats)
        rows.append({"model": "mdlm", "sampler": "mdjax mdlm_sample (MDLMSpec, ddpm_cache)",
                     "steps": steps, "batch": batch, "length": LENGTH,
                     "time_s": seconds, "nfe": int(out.nfe), "saved_calls": int(out.saved_calls)})
        seconds, (_, nfe) = timing.median_run(lambda: loops.mdlm_reference(
            net, batch=batch, steps=steps, length=LENGTH, mask_index=V), args.repeats)
        rows.append({"model": "mdlm", "sampler": "torch reference _sample (ddpm_cache)",
                     "steps": steps, "batch": batch, "length": LENGTH, "time_s": seconds,
                     "nfe": nfe, "saved_calls": steps + 1 - nfe})
    else:
      length = args.bd3lm_length
      for batch in (1, 8):
        seconds, out = timing.median_run(lambda: block(bd3lm.bd3lm_sample(
            model, num_samples=batch, length=length, bos_id=BOS, nucleus_p=0.9,
            key=jax.random.key(1))), args.repeats)
        rows.append({"model": "bd3lm", "sampler": "mdjax bd3lm_sample (first hitting, "
                     "nucleus 0.9, exact KV cache)", "steps": "first hitting",
                     "batch": batch, "length": length, "time_s": seconds,
                     "nfe": int(out.nfe), "saved_calls": int(out.saved_calls)})
      rng = np.random.default_rng(0)
      for kv in (True, False):
        seconds, (_, nfe) = timing.median_run(lambda: loops.bd3lm_reference(
            net, seqlen=length, nucleus_p=0.9, mask_index=V, block_size=BLOCK,
            context_size=LENGTH, bos_id=BOS, kv_cache=kv, rng=rng), args.repeats)
        rows.append({"model": "bd3lm", "sampler": "torch reference _semi_ar_sampler "
                     f"(first hitting, nucleus 0.9, kv_cache={kv})", "steps": "first hitting",
                     "batch": 1, "length": length, "time_s": seconds, "nfe": nfe,
                     "saved_calls": 0})
  result = {"device": f"CPU, {os.cpu_count()} cores, shared; jax {jax.__version__}, "
                      f"{torch_version}",
            "parity": parity, "rows": rows}
  args.out.write_text(json.dumps(result, indent=1) + "\n")
  for row in parity + rows:
    print(row)


if __name__ == "__main__":
  main()
