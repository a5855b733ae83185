"""Generative perplexity of mdjax samplers on character-level Shakespeare, with entropy.

  python experiments/gen_ppl.py [--workdir=/tmp/text_quality] [--n=256] [--out=results]
      [--char_steps=N --causal_steps=N]

The denoiser of configs/shakespeare_char.py and the causal reference of
configs/shakespeare_causal.py are experiments/text_quality.py's, trained (or reused) in the
same workdirs by its `trained_models`; `--char_steps` / `--causal_steps` train shorter runs
of the same configs (only num_steps changed) in WORKDIR/char_steps{N}, WORKDIR/causal_steps{N}.
N unconditional 64-character samples from each sampler at each step count are decoded to
text and scored by `mdjax.evaluate.generative_perplexity` with the causal model as judge
(its characters, its start token first, one 64-input window per sample), beside the mean
unigram entropy (nats) of each sample's characters. The held-out text itself (N windows of
the plays kept out of training) is the reference row. Writes results/gen_ppl.json (the rows,
and each row's sampling standard errors under "standard_errors"); fixed seeds.
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: configs/ and experiments/ live in the repo root
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import time

import jax
import numpy as np

from configs import shakespeare_causal, shakespeare_char
from experiments import text_quality
from mdjax import evaluate, report, sampling, tasks, train
from mdjax.train import state_io

STEPS = (16, 64)
SAMPLERS = {
    "ancestral": lambda k: sampling.AncestralSpec(steps=k),
    "confidence": lambda k: sampling.ConfidenceSpec(steps=k),
    "remdm": lambda k: sampling.RemaskSpec(steps=k, eta=0.05),  # ReMDM-cap, as text_quality's
}
JUDGE = "mdjax shakespeare_causal"


def configs_and_paths(workdir: str, char_steps: int | None = None,
                      causal_steps: int | None = None) -> dict:
  """{"char": (config, workdir), "causal": ...}: the configs, num_steps (and a warmup of at
  most a tenth of it) changed where asked, in a workdir named by the steps."""
  out = {}
  for name, get_config, steps in (("char", shakespeare_char.get_config, char_steps),
                                  ("causal", shakespeare_causal.get_config, causal_steps)):
    config, path = get_config(), os.path.join(workdir, name)
    if steps is not None:
      config.train.num_steps = steps
      config.train.warmup_steps = min(config.train.warmup_steps, steps // 10)
      path = os.path.join(workdir, f"{name}_steps{steps}")
    out[name] = (config, path)
  return out


def trained_models(workdir: str, char_steps: int | None = None,
                   causal_steps: int | None = None):
  """(task, {"char": (apply_fn, params), ...}, the causal workdir): text_quality's models
  (trained first where missing), or shorter runs of the same configs."""
  if char_steps is None and causal_steps is None:
    task, models = text_quality.trained_models(workdir)
    return task, models, os.path.join(workdir, "causal")
  models = {}
  runs = configs_and_paths(workdir, char_steps, causal_steps)
  for name, (config, path) in runs.items():
    models[name] = train.ensure_trained(config, path)
    print(f"{name}: {config.train.num_steps} steps, trained in "
          f"{train.read_train_seconds(path)} s", flush=True)
  return tasks.from_config(runs["char"][0]), models, runs["causal"][1]


def row(sampler: str, steps, result, n: int) -> dict:
  return {"sampler": sampler, "steps": steps, "judge": JUDGE, "gen_ppl": result.gen_ppl,
          "entropy": result.mean_entropy, "num_samples": n}


def standard_errors(sampler: str, steps, result) -> dict:
  """Sampling standard errors over the N independent samples: of log gen_ppl (every sample
  has the same 64 judge tokens, so it is the mean of the per-sample NLLs; gen_ppl's relative
  error is this), and of the mean entropy."""
  n = len(result.nll_per_token_N)
  se = lambda x: float(np.std(x, ddof=1) / np.sqrt(n))
  return {"sampler": sampler, "steps": steps, "log_gen_ppl_se": se(result.nll_per_token_N),
          "entropy_se": se(result.entropy_N)}


def run(n: int, workdir: str, seed: int = 0, char_steps=None, causal_steps=None) -> dict:
  task, models, causal_dir = trained_models(workdir, char_steps, causal_steps)
  judge = evaluate.load_judge(state_io.load(causal_dir))
  apply_fn, params = models["char"]
  score = lambda tokens_NxL: evaluate.generative_perplexity(
      [task.decode(r) for r in tokens_NxL], judge, batch_size=256,
      sampler_tokens=list(tokens_NxL))

  held_out = task.validation_windows(n)
  result = score(held_out)
  rows, errors = [row("held-out text", None, result, n)], [
      standard_errors("held-out text", None, result)]
  print(rows[-1], errors[-1], flush=True)
  for sampler, make in SAMPLERS.items():
    for k in STEPS:
      start = time.perf_counter()
      out = sampling.sample(apply_fn, params, jax.random.key(seed), task.empty_canvas(n),
                            make(k), mask_id=task.mask_id)
      tokens = np.asarray(out.tokens_BxL)
      result = score(tokens)
      rows.append(row(sampler, k, result, n))
      errors.append(standard_errors(sampler, k, result))
      print(rows[-1], errors[-1], f"({time.perf_counter() - start:.1f} s)", flush=True)
  return {"rows": rows, "standard_errors": errors, "seed": seed, "task": repr(task), "judge_workdir": causal_dir,
          "train_steps": {"char": char_steps or shakespeare_char.get_config().train.num_steps,
                          "causal": causal_steps
                          or shakespeare_causal.get_config().train.num_steps},
          "entropy_unit": "nats", "gen_ppl_unit": "per character (the judge's tokens)"}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--n", type=int, default=256, help="samples per row")
  parser.add_argument("--out", default="results", help="output directory")
  parser.add_argument("--workdir", default="/tmp/text_quality",
                      help="where the denoiser and the judge are trained (text_quality's)")
  parser.add_argument("--char_steps", type=int, default=None,
                      help="train the denoiser for this many steps instead of the config's")
  parser.add_argument("--causal_steps", type=int, default=None,
                      help="train the judge for this many steps instead of the config's")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  for name in ("n", "char_steps", "causal_steps"):
    value = getattr(args, name)
    if value is not None and value < 1:
      parser.error(f"--{name}={value} must be >= 1")
  start = time.perf_counter()
  results = run(args.n, args.workdir, args.seed, args.char_steps, args.causal_steps)
  report.write_json(os.path.join(args.out, "gen_ppl.json"), results)
  print(f"wrote {os.path.join(args.out, 'gen_ppl.json')} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()
