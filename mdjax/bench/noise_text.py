"""Absorbing, uniform and hybrid noise on character-level Shakespeare at equal training tokens.

  python -m mdjax.bench.noise_text [--steps=400 --workdir=/tmp/noise_text
                                    --out=results/noise_text.json]

Trains (or reuses, in WORKDIR/<process>) one model per process, configs/shakespeare_char.py,
shakespeare_uniform.py and shakespeare_hybrid.py, cut to `steps` steps of 64 windows of 64
characters each: the same seed, batches, optimizer and model (time-conditioned for all three:
a canvas without masks does not say its noise level), each trained on its process's NELBO
(GIDD's weighting "elbo"). Then the validation NELBO of each in bits per character under its
own process, on the same WINDOWS held-out windows and TIME_SAMPLES noise draws per window
(`noise.gidd_loss`: for absorbing noise MD4's NELBO, draw for draw), with the standard error
across the draws, and the periodic held-out NELBO of the runs (`val_bits_per_token` against
training tokens). Generative perplexity against sampling steps waits for the uniform and
hybrid samplers (issue 57, item 4). Written atomically to `out` (JSON), seeds fixed.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import jax
import numpy as np

import mdjax
from mdjax import noise, report, train
from mdjax.bench import timing

PROCESSES = ("absorbing", "uniform", "hybrid")
WINDOWS, TIME_SAMPLES, EVAL_BATCH = 256, 8, 64
SEED = 0


def configs(steps: int) -> dict:
  """{process: the run's config}: the Shakespeare configs at `steps` steps, one model."""
  from configs import shakespeare_char, shakespeare_hybrid, shakespeare_uniform  # repo root
  out = {"absorbing": shakespeare_char.get_config(), "uniform": shakespeare_uniform.get_config(),
         "hybrid": shakespeare_hybrid.get_config()}
  for config in out.values():
    config.seed = SEED
    config.model.time_conditioning = True
    config.train.num_steps = steps
    config.train.warmup_steps = min(config.train.warmup_steps, steps // 4)
    config.update(num_eval_samples=0, eval_every=max(steps // 4, 1), log_every=50)
    config.checkpoint.every = steps
  return out


def process_of(model) -> noise.NoiseProcess:
  """The process a workdir's model was trained under (absorbing: `Model.noise` is None)."""
  if model.noise is not None:
    return model.noise
  return noise.Absorbing(vocab_size=model.vocab_size,
                         schedule=train.masking_schedule(model.config))


def validation_nelbo(model, windows_NxL: np.ndarray) -> dict:
  """The NELBO in bits per character of `windows_NxL` under the model's process: the mean
  over TIME_SAMPLES draws per window, and the standard error across the draws' means."""
  process = process_of(model)
  loss = jax.jit(lambda params, key, x: noise.gidd_loss(model.denoiser, params, key, x,
                                                        process=process)[1]["nelbo_nats_B"])
  per_draw = []
  for draw in range(TIME_SAMPLES):
    key = jax.random.fold_in(jax.random.key(SEED + 1), draw)
    nats = [loss(model.params, jax.random.fold_in(key, i), windows_NxL[i:i + EVAL_BATCH])
            for i in range(0, len(windows_NxL), EVAL_BATCH)]
    per_draw.append(float(np.concatenate([np.asarray(n) for n in nats]).mean()))
  bits = np.asarray(per_draw) / windows_NxL.shape[1] / math.log(2.0)
  return {"bits_per_char": float(bits.mean()),
          "stderr": float(bits.std(ddof=1) / math.sqrt(len(bits))),
          "per_draw": [float(b) for b in bits]}


def curve(workdir: str, tokens_per_step: int) -> list[dict]:
  """The run's periodic held-out NELBO (bits/char) against training tokens."""
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return [{"step": r["step"], "tokens": r["step"] * tokens_per_step,
           "val_bits_per_char": r["val_bits_per_token"]}
          for r in rows if "val_bits_per_token" in r]


def run(steps: int, workdir: str) -> dict:
  rows = []
  for name, config in configs(steps).items():
    path = os.path.join(workdir, name)
    train.ensure_trained(config, path)
    model = mdjax.load(path)
    windows = model.task.validation_windows(WINDOWS)
    tokens_per_step = config.batch_size * model.task.length
    row = {"process": name, "noise": repr(process_of(model)),
           "train_tokens": steps * tokens_per_step, **validation_nelbo(model, windows),
           "curve": curve(path, tokens_per_step),
           "train_seconds": train.read_train_seconds(path)}
    print(f"{name:9s} {row['bits_per_char']:.4f} ± {row['stderr']:.4f} bits/char", flush=True)
    rows.append(row)
  return {"rows": rows, "steps": steps, "batch_size": 64, "length": 64, "windows": WINDOWS,
          "time_samples": TIME_SAMPLES, "seed": SEED, "machine": timing.machine_info(),
          "not_measured": "generative perplexity against sampling steps: it needs the uniform "
                          "and hybrid samplers (issue 57, item 4)"}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--workdir", default="/tmp/noise_text")
  parser.add_argument("--out", default="results/noise_text.json")
  args = parser.parse_args(argv)
  result = run(args.steps, args.workdir)
  report.write_json(args.out, result)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
