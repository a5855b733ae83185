"""Absorbing, uniform and hybrid noise on character-level Shakespeare at equal training tokens.

  python -m mdjax.bench.noise_text [--steps=400 --workdir=/tmp/noise_text
                                    --out=results/noise_text.json --judge_steps=800
                                    --samples=128]

Trains (or reuses, in WORKDIR/<process>) one model per process, configs/shakespeare_char.py,
shakespeare_uniform.py and shakespeare_hybrid.py, cut to `steps` steps of 64 windows of 64
characters each: the same seed, batches, optimizer and model (time-conditioned for all three:
a canvas without masks does not say its noise level), each trained on its process's NELBO
(GIDD's weighting "elbo"). Then the validation NELBO of each in bits per character under its
own process, on the same WINDOWS held-out windows and TIME_SAMPLES noise draws per window
(`noise.gidd_loss`: for absorbing noise MD4's NELBO, draw for draw), with the standard error
across the draws, and the periodic held-out NELBO of the runs (`val_bits_per_token` against
training tokens).

Generative perplexity against sampling steps (the few-step regime, SAMPLE_STEPS): a causal
judge, configs/shakespeare_causal.py at `judge_steps` steps (WORKDIR/judge, same seed and
corpus), scores `samples` prompt-less 64-character samples per (process, sampler, steps),
drawn by `mdjax.generate` (row i with fold_in(key(SEED), i)), with
`evaluate.generative_perplexity` (its start token first, one window per sample), beside each
sample's unigram entropy (nats) over its characters; the held-out windows are the reference
row (the data's own gen-ppl and entropy; log2 of that gen-ppl is the judge's bits/char).
Written atomically to `out` (JSON) and a PNG beside it (`plot`), seeds fixed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import jax
import numpy as np

import mdjax
from mdjax import evaluate, files, noise, report, sampling, train
from mdjax.bench import timing

PROCESSES = ("absorbing", "uniform", "hybrid")
WINDOWS, TIME_SAMPLES, EVAL_BATCH = 256, 8, 64
SEED = 0
JUDGE_STEPS = 800
SAMPLE_STEPS = (4, 8, 16, 32)
NUM_SAMPLES = 128
# {process: ((label, family, knobs), ...)}: the samplers each process's model runs.
# diffusion_gemma samples uniform noise only (it refuses a hybrid model); its defaults anneal
# the temperature from 0.8 to 0.4, so "diffusion_gemma_T1" (T = 1 throughout) is the row
# comparable with the ancestral samplers' T = 1.
SAMPLERS = {
    "absorbing": (("ancestral", "ancestral", {}), ("confidence", "confidence", {})),
    "uniform": (("uniform_ancestral", "uniform_ancestral", {}),
                ("diffusion_gemma", "diffusion_gemma", {}),
                ("diffusion_gemma_T1", "diffusion_gemma",
                 {"max_temperature": 1.0, "min_temperature": 1.0})),
    "hybrid": (("uniform_ancestral", "uniform_ancestral", {}),),
}


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


def judge_config(steps: int = JUDGE_STEPS):
  """The judge: configs/shakespeare_causal.py (the same corpus, windows and Transformer as the
  three runs, next-character loss) at `steps` steps, the same seed."""
  from configs import shakespeare_causal  # repo root
  config = shakespeare_causal.get_config()
  config.seed = SEED
  config.train.update(num_steps=steps, warmup_steps=min(config.train.warmup_steps, steps // 8))
  config.update(num_eval_samples=0, eval_every=max(steps // 4, 1), log_every=50)
  config.checkpoint.every = steps
  return config


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


def ratio_se(numerators_N: np.ndarray, denominators_N: np.ndarray) -> float:
  """The delta-method standard error of sum(a) / sum(b) over N independent (a_i, b_i):
  sqrt(sum (a_i - r b_i)^2 / (N (N - 1))) / mean(b). With equal b_i it is the standard
  error of the mean of a_i / b_i."""
  n = len(numerators_N)
  ratio = numerators_N.sum() / denominators_N.sum()
  residual_N = numerators_N - ratio * denominators_N
  return float(math.sqrt((residual_N ** 2).sum() / (n * (n - 1))) / denominators_N.mean())


def scored(texts: list[str], judge, sampler_tokens=None) -> dict:
  """gen-ppl and mean entropy of `texts` under `judge`, with their standard errors over the
  N independent texts (the judge fixed): log gen-ppl is the ratio of summed NLLs to summed
  tokens (`ratio_se`), and gen_ppl_se = gen_ppl * that (the delta method); entropy_se is the
  standard error of the per-text entropies' mean."""
  result = evaluate.generative_perplexity(texts, judge, batch_size=256,
                                          sampler_tokens=sampler_tokens)
  tokens_N = result.num_tokens_N.astype(np.float64)
  log_se = ratio_se(result.nll_per_token_N * tokens_N, tokens_N)
  n = len(texts)
  return {"gen_ppl": result.gen_ppl, "gen_ppl_se": result.gen_ppl * log_se,
          "bits_per_char": result.nll_per_token / math.log(2.0),
          "entropy": result.mean_entropy,
          "entropy_se": float(result.entropy_N.std(ddof=1) / math.sqrt(n)), "samples": n,
          "judge": result.judge}


def reference_row(task, judge, windows_NxL: np.ndarray) -> dict:
  """The held-out text scored as samples are: the data's own gen-ppl and entropy."""
  return {"process": "held-out text", "sampler": None, "knobs": {}, "steps": None,
          **scored([task.decode(row) for row in windows_NxL], judge),
          "example": task.decode(windows_NxL[0])}


def gen_ppl_rows(models: dict, judge, steps=SAMPLE_STEPS, num_samples: int = NUM_SAMPLES,
                 length: int = 64, samplers=None, log=print) -> list[dict]:
  """A row per (process, sampler, steps): `num_samples` prompt-less samples of `length`
  tokens from models[process] (`mdjax.generate`, key SEED) scored by `judge` (`scored`)."""
  samplers = SAMPLERS if samplers is None else samplers
  rows = []
  for process, model in models.items():
    for label, family, knobs in samplers[process]:
      for k in steps:
        start = time.perf_counter()
        spec = sampling.make_spec(family, steps=k, **knobs)
        out = mdjax.generate(model, [""] * num_samples, max_new_tokens=length,
                             key=jax.random.key(SEED), spec=spec)
        row = {"process": process, "sampler": label, "knobs": knobs, "steps": k,
               **scored(out.texts, judge, [ids.tolist() for ids in out.token_ids]),
               "nfe": out.nfe,
               "seconds": round(time.perf_counter() - start, 2), "example": out.texts[0]}
        log(table_line(row))
        rows.append(row)
  return rows


def table_line(row: dict) -> str:
  steps = "" if row["steps"] is None else row["steps"]
  return (f"{row['process']:13s} {row['sampler'] or '':18s} {steps:>5} "
          f"{row['gen_ppl']:8.2f} ± {row['gen_ppl_se']:5.2f} "
          f"{row['entropy']:6.3f} ± {row['entropy_se']:5.3f}")


TABLE_HEADER = (f"{'process':13s} {'sampler':18s} {'steps':>5} {'gen-ppl':>8}   {'se':>5} "
                f"{'entropy':>6}   {'se':>5}")


def plot(gen_rows: list[dict], path: str) -> str:
  """gen-ppl and entropy against sampling steps, one curve per (process, sampler), ± SE bars;
  the held-out text's as a dotted line."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  reference = next(r for r in gen_rows if r["steps"] is None)
  sampled = [r for r in gen_rows if r["steps"] is not None]
  curves = list(dict.fromkeys((r["process"], r["sampler"]) for r in sampled))
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for ax, key, label in ((axes[0], "gen_ppl", "generative perplexity (per char)"),
                         (axes[1], "entropy", "unigram entropy of a sample (nats)")):
    for i, (process, sampler) in enumerate(curves):
      pts = [r for r in sampled if (r["process"], r["sampler"]) == (process, sampler)]
      ax.errorbar([r["steps"] for r in pts], [r[key] for r in pts],
                  yerr=[r[key + "_se"] for r in pts], marker="o", ms=3, lw=1, capsize=2,
                  color=plt.cm.tab10(i % 10), label=f"{process}: {sampler}")
    ax.axhline(reference[key], ls=":", color="k", lw=1, label="held-out text")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sampling steps")
    ax.set_ylabel(label)
  axes[0].set_yscale("log")
  axes[0].legend(fontsize=7)
  fig.suptitle(f"Shakespeare, judge {reference['judge']}", fontsize=9)
  fig.tight_layout()
  with files.atomic_write(path) as f:
    fig.savefig(f, format="png", dpi=110)
  plt.close(fig)
  return path


def judge_summary(path: str, steps: int, tokens_per_step: int) -> dict:
  """Where the judge is and how good: its periodic held-out bits/char, the last of them."""
  rows = [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]
  curve_rows = [{"step": r["step"], "val_bits_per_char": r["val_bits_per_token"]}
                for r in rows if "val_bits_per_token" in r]
  return {"config": "configs/shakespeare_causal.py", "workdir": path, "steps": steps,
          "train_tokens": steps * tokens_per_step,
          "val_bits_per_char": curve_rows[-1]["val_bits_per_char"], "curve": curve_rows,
          "train_seconds": train.read_train_seconds(path)}


def run(steps: int, workdir: str, judge_steps: int = JUDGE_STEPS,
        num_samples: int = NUM_SAMPLES) -> dict:
  rows, models = [], {}
  for name, config in configs(steps).items():
    path = os.path.join(workdir, name)
    train.ensure_trained(config, path)
    model = models[name] = mdjax.load(path)
    windows = model.task.validation_windows(WINDOWS)
    tokens_per_step = config.batch_size * model.task.length
    row = {"process": name, "noise": repr(process_of(model)),
           "train_tokens": steps * tokens_per_step, **validation_nelbo(model, windows),
           "curve": curve(path, tokens_per_step),
           "train_seconds": train.read_train_seconds(path)}
    print(f"{name:9s} {row['bits_per_char']:.4f} ± {row['stderr']:.4f} bits/char", flush=True)
    rows.append(row)

  config = judge_config(judge_steps)
  judge_path = os.path.join(workdir, "judge")
  train.ensure_trained(config, judge_path)
  judge = evaluate.load_judge(judge_path)
  judge_row = judge_summary(judge_path, judge_steps, config.batch_size * model.task.length)
  print(f"judge: {judge_row['val_bits_per_char']:.4f} bits/char held out after {judge_steps} "
        f"steps", flush=True)
  print(TABLE_HEADER, flush=True)
  reference = reference_row(model.task, judge, windows)
  print(table_line(reference), flush=True)
  sampled = gen_ppl_rows(models, judge, num_samples=num_samples,
                         log=lambda line: print(line, flush=True))
  return {"rows": rows, "steps": steps, "batch_size": 64, "length": 64, "windows": WINDOWS,
          "time_samples": TIME_SAMPLES, "seed": SEED, "machine": timing.machine_info(),
          "judge": judge_row, "gen_ppl": [reference] + sampled,
          "gen_ppl_units": "gen_ppl: per character (the judge's tokens); entropy: nats, each "
                           "sample's unigram entropy over its characters, averaged; _se: "
                           "standard errors over the samples (judge fixed; scored)",
          "not_sampled": "diffusion_gemma on the hybrid model: the family samples uniform "
                         "noise only (it refuses a hybrid model)"}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--workdir", default="/tmp/noise_text")
  parser.add_argument("--out", default="results/noise_text.json")
  parser.add_argument("--judge_steps", type=int, default=JUDGE_STEPS)
  parser.add_argument("--samples", type=int, default=NUM_SAMPLES, help="samples per point")
  args = parser.parse_args(argv)
  for name in ("steps", "judge_steps"):
    if getattr(args, name) < 1:
      parser.error(f"--{name}={getattr(args, name)} must be >= 1")
  if args.samples < 2:
    parser.error(f"--samples={args.samples} must be >= 2 (a standard error needs two)")
  start = time.perf_counter()
  result = run(args.steps, args.workdir, args.judge_steps, args.samples)
  result["seconds"] = round(time.perf_counter() - start, 1)
  report.write_json(args.out, result)
  path = plot(result["gen_ppl"], os.path.splitext(args.out)[0] + ".png")
  print(f"wrote {args.out} and {path} in {result['seconds']:.0f} s")


if __name__ == "__main__":
  main()
