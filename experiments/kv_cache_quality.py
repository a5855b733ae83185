"""What the dual KV cache costs in quality: cached against uncached at the same blocks and steps.

  python experiments/kv_cache_quality.py [--n=1000] [--workdir=/tmp/kv_cache_quality]
      [--out=results] [--smoke]

Trains (or reuses, when done) three models in WORKDIR: ScanAndAdd
(configs/scan_and_add_cpu.py), the character-level Shakespeare denoiser
(configs/shakespeare_char.py at 3,000 steps) and its causal reference
(configs/shakespeare_causal.py). Each sampler in blocks then runs
uncached and with the dual cache (one full pass per block, window passes in between), with
the same keys: the cache is the only difference. ScanAndAdd: the task's checks and the exact
probability of the samples (fraction impossible under the true joint). Shakespeare:
generative bits per character under the causal reference and word validity. Both: the
fraction of rows whose tokens equal the uncached run's. Writes
results/kv_cache_quality.{json,md}; fixed seeds.
"""

from __future__ import annotations

import dataclasses
import os
import sys

if __package__ in (None, ""):  # run as a script: configs/ and experiments/ live in the repo root
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from configs import scan_and_add_cpu, shakespeare_causal, shakespeare_char
from experiments import smoke as smoke_run
from mdjax import models, report, sampling, tasks, train
from mdjax.evaluate import elbo
from mdjax.tasks import scan_and_add

CHAR_STEPS = 3000  # the Shakespeare denoiser's training budget (the config's is 7,000)
SA_CONFIG = scan_and_add_cpu  # the ScanAndAdd model: correct 1.0 after its 14,000 steps
SA_BLOCK, SA_STEPS = 5, (10, 25)  # 5 blocks of 5: 2 and 5 steps per block
TEXT_BLOCK, TEXT_STEPS = 16, (16, 64)  # 4 blocks of 16: 4 and 16 steps per block
TEXT_SHARE = 4  # Shakespeare: n / 4 samples per point (a 7x larger model, 2.6x longer rows)
SAMPLERS = {
    "confidence": lambda k, b: sampling.ConfidenceSpec(steps=k, block_length=b),
    "ancestral": lambda k, b: sampling.AncestralSpec(steps=k, block_length=b),
    "entropy_bounded": lambda k, b: sampling.EntropyBoundedSpec(steps=k, block_length=b),
}


def char_config():
  """configs/shakespeare_char.py at CHAR_STEPS."""
  config = shakespeare_char.get_config()
  config.train.num_steps = CHAR_STEPS
  return config


CONFIGS = {"scan_and_add": SA_CONFIG.get_config, "char": char_config,
           "causal": shakespeare_causal.get_config}
UNTRAINED = ()  # models sampled at their initial weights, step 0 (--smoke)


def trained(workdir: str, train_missing: bool = True):
  """{name: (config, apply_fn, params, step)}, each trained first where missing (or, with
  train_missing=False, the newest checkpoint as it is)."""
  out = {}
  for name, get_config in CONFIGS.items():
    config, path = get_config(), os.path.join(workdir, name)
    if name in UNTRAINED:
      _, params, apply_fn = models.init(train.model_config(config, tasks.from_config(config)))
      out[name] = (config, apply_fn, params, 0)
      continue
    if train_missing:
      train.ensure_trained(config, path)
    _, apply_fn, params, step = train.load_for_sampling(path)
    out[name] = (config, apply_fn, params, step)
  return out


def _pairs(task, apply_fn, params, n: int, block: int, steps_list, seed: int, samplers):
  """(sampler, K, {impl: tokens_NxL}) for every sampler and K, the same keys for both."""
  canvas = np.asarray(task.empty_canvas(n))
  key = jax.random.key(seed)
  for name in samplers:
    make = SAMPLERS[name]
    for steps in steps_list:
      spec = make(steps, block)
      yield name, steps, {impl: np.asarray(sampling.sample(
          apply_fn, params, key, canvas, dataclasses.replace(spec, kv_cache=impl),
          mask_id=task.mask_id).tokens_BxL) for impl in ("none", "dual")}


def scan_and_add_rows(model, n: int, seed: int) -> list[dict]:
  config, apply_fn, params, _ = model
  task = tasks.from_config(config)
  rows = []
  for name, steps, runs in _pairs(task, apply_fn, params, n, SA_BLOCK, SA_STEPS, seed,
                                  SAMPLERS):
    same = (runs["dual"] == runs["none"]).all(-1).mean()
    for impl, tokens in runs.items():
      metrics = task.sample_metrics(tokens)
      impossible = np.isneginf(scan_and_add.log_prob(tokens)).mean()
      rows.append(dict(task="scan_and_add", sampler=name, K=steps, L=task.length,
                       block=SA_BLOCK, kv_cache=impl,
                       well_formed=metrics["well_formed"], correct=metrics["correct"],
                       impossible=float(impossible), same_as_uncached=float(same)))
      print(rows[-1], flush=True)
  return rows


def text_rows(model, reference, n: int, seed: int) -> list[dict]:
  config, apply_fn, params, _ = model
  task = tasks.from_config(config)
  ref_apply, ref_params = reference[1:3]
  rows = []
  for name, steps, runs in _pairs(task, apply_fn, params, n, TEXT_BLOCK, TEXT_STEPS, seed,
                                  ("confidence", "ancestral")):
    same = (runs["dual"] == runs["none"]).all(-1).mean()
    for impl, tokens in runs.items():
      bits_N = elbo.causal_bits(ref_apply, ref_params, tokens, start_id=task.mask_id)
      per_char_N = bits_N / task.length
      rows.append(dict(task="shakespeare_char", sampler=name, K=steps, L=task.length,
                       block=TEXT_BLOCK, kv_cache=impl, gen_bits_per_char=float(per_char_N.mean()),
                       gen_bits_per_char_se=float(per_char_N.std(ddof=1) / np.sqrt(n)),
                       word_validity=task.sample_metrics(tokens)["word_validity"],
                       same_as_uncached=float(same)))
      print(rows[-1], flush=True)
  return rows


def run(n: int, workdir: str = "/tmp/kv_cache_quality", train_missing: str = "yes",
        seed: int = 0) -> dict:
  loaded = trained(workdir, train_missing == "yes")
  return {"n": n, "seed": seed, "char_train_steps": loaded["char"][3],
          "causal_train_steps": loaded["causal"][3],
          "scan_and_add_train_steps": loaded["scan_and_add"][3],
          "scan_and_add": scan_and_add_rows(loaded["scan_and_add"], n, seed),
          "shakespeare_char": text_rows(loaded["char"], loaded["causal"], n // TEXT_SHARE,
                                        seed)}


def _table(rows: list[dict], measures: tuple[str, ...]) -> str:
  """One line per (sampler, K): each measure uncached -> cached, and the rows equal."""
  out = []
  for none in (r for r in rows if r["kv_cache"] == "none"):
    dual = next(r for r in rows if r["kv_cache"] == "dual" and r["sampler"] == none["sampler"]
                and r["K"] == none["K"])
    line = {"sampler": none["sampler"], "K": none["K"],
            "steps per block": none["K"] * none["block"] // none["L"]}
    for m in measures:
      line[f"{m} (none → dual)"] = f"{none[m]:.3f} → {dual[m]:.3f}"
    line["rows equal"] = f"{none['same_as_uncached']:.2f}"
    out.append(line)
  return report.markdown_table(out, list(out[0]))


def write(results: dict, out: str) -> None:
  os.makedirs(out, exist_ok=True)
  report.write_json(os.path.join(out, "kv_cache_quality.json"), results)
  text = ("# KV cache: quality cost of the dual cache\n\n"
          f"N = {results['n']} samples per point (Shakespeare: {results['n'] // TEXT_SHARE}), "
          f"seed {results['seed']}; the same keys with and without the cache.\n\n"
          f"## ScanAndAdd (configs/scan_and_add_cpu.py, {results['scan_and_add_train_steps']}"
          f" steps), blocks of {SA_BLOCK}\n\n"
          + _table(results["scan_and_add"], ("well_formed", "correct", "impossible"))
          + f"\n## Character-level Shakespeare (denoiser {results['char_train_steps']} steps, "
          f"causal reference {results['causal_train_steps']}), blocks of {TEXT_BLOCK}\n\n"
          + _table(results["shakespeare_char"], ("gen_bits_per_char", "word_validity"))
          + "\n`rows equal`: fraction of rows whose tokens are the uncached run's.\n")
  report.write_text(os.path.join(out, "kv_cache_quality.md"), text)


def smoke(workdir: str, train_missing: str) -> dict:
  """The ScanAndAdd model untrained (K = 5), the tiny text models of experiments/smoke.py
  (trained in WORKDIR where missing; blocks of 8, K = 4), N samples for both."""
  global SA_STEPS, TEXT_BLOCK, TEXT_STEPS, TEXT_SHARE, UNTRAINED
  SA_STEPS, TEXT_BLOCK, TEXT_STEPS, TEXT_SHARE = (5,), 8, (4,), 1
  UNTRAINED = ("scan_and_add",)
  CONFIGS.update(char=lambda: smoke_run.text_config(workdir),
                 causal=lambda: smoke_run.text_config(workdir, causal=True))
  return {"workdir": workdir, "train_missing": train_missing}


def main():
  smoke_run.experiment_main(__doc__, run, write, "kv_cache_quality.md", default_n=1000,
                            options={"workdir": ("/tmp/kv_cache_quality",
                                                 "where the three models are trained"),
                                     "train_missing": ("yes", "'no': sample the newest "
                                                       "checkpoints as they are")},
                            smoke=smoke, smoke_n=8)


if __name__ == "__main__":
  main()
