"""Block diffusion on character-level Shakespeare: likelihood, cached sampling, long samples.

  python experiments/block_diffusion.py            # -> results/block_diffusion.{json,md,png}
  python experiments/block_diffusion.py --workdir=/tmp/models
  python experiments/block_diffusion.py --smoke --workdir=/tmp/smoke --out=/tmp/smoke

Trains (or reuses, in WORKDIR/block{1,4,16,64} and WORKDIR/causal1000) five models of
configs/shakespeare_char.py's size, all at the same budget of 1,000 steps (batch 64, 64
characters): the block-causal denoisers of configs/shakespeare_block.py at block sizes 1, 4
and 16 (the block NELBO), the full-sequence MD4 denoiser (block 64 = L: the block NELBO at
block L is MD4's NELBO draw for draw) and the causal reference (configs/shakespeare_causal.py).
Then, with a fixed seed:

- nelbo: validation bits per character by block size (256 held-out windows, 8 Monte Carlo
  replicates, the standard error across replicates), beside the causal reference's exact
  bits per character on the same windows;
- samples: 64 characters from nothing, block by block (`sampling.sample_blocks`: ancestral
  decoding inside each block, window 64 - block) at several steps per block, cached and not;
  the full-sequence model sampled without a cache at the same total steps. Generative bits
  per character under the causal reference, word validity, wall time (median of 3 runs of
  the compiled program, this CPU);
- long: 256 characters (4 x the training length) from the block-16 model, window 48:
  generative bits per character of each 64-character segment, scored alone.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs import shakespeare_block, shakespeare_causal, shakespeare_char  # noqa: E402
from experiments import smoke as smoke_run  # noqa: E402
import mdjax  # noqa: E402
from mdjax import report, sampling, train  # noqa: E402
from mdjax.evaluate import elbo  # noqa: E402

STEPS = 1000  # every model's training budget
BLOCKS = (1, 4, 16, 64)
LENGTH = 64  # the training length
NELBO_WINDOWS, NELBO_TIME_SAMPLES = 256, 8
TOKENS_PER_STEP = (4, 2, 1)  # steps per block = block / these
LONG_BLOCK, LONG_SEGMENTS = 16, 4
TIMED_RUNS = 3
CONFIGS = {"block": shakespeare_block.get_config, "char": shakespeare_char.get_config,
           "causal": shakespeare_causal.get_config}


def configs() -> dict:
  out = {}
  for block in BLOCKS[:-1]:
    c = CONFIGS["block"]()
    c.model.block_size = block
    out[f"block{block}"] = c
  out[f"block{LENGTH}"] = CONFIGS["char"]()
  out["causal1000"] = CONFIGS["causal"]()
  for c in out.values():
    c.train.num_steps = STEPS
  return out


def trained(workdir: str) -> dict:
  models = {}
  for name, config in configs().items():
    path = os.path.join(workdir, name)
    train.ensure_trained(config, path)
    models[name] = mdjax.load(path)
  return models


def nelbo_rows(models, windows, seed) -> list[dict]:
  rows = []
  for block in BLOCKS:
    model = models[f"block{block}"]
    est = elbo.nelbo_estimate(
        model.denoiser, model.params, windows, schedule=train.masking_schedule(model.config),
        mask_id=model.task.mask_id, time_samples=NELBO_TIME_SAMPLES, seed=seed,
        block_size=None if block == LENGTH else block)
    rows.append({"block": block, "bits_per_char": est["bits_per_token"], "stderr": est["se"]})
    print(rows[-1], flush=True)
  return rows


def _timed(call):
  """(result, median seconds of TIMED_RUNS runs after the compiling one)."""
  out = call()
  jax.block_until_ready(out)
  seconds = []
  for _ in range(TIMED_RUNS):
    begin = time.perf_counter()
    out = call()
    jax.block_until_ready(out)
    seconds.append(time.perf_counter() - begin)
  return out, statistics.median(seconds)


def _scores(tokens_NxL, causal, task) -> dict:
  bits_N = elbo.causal_bits(causal.denoiser, causal.params, tokens_NxL,
                                  start_id=task.mask_id)
  return {"gen_bits_per_char": float(bits_N.mean() / tokens_NxL.shape[1]),
          "word_validity": task.sample_metrics(tokens_NxL)["word_validity"]}


def sample_rows(models, n: int, seed: int) -> tuple[list[dict], dict]:
  causal = models["causal1000"]
  rows, examples = [], {}
  key = jax.random.key(seed)
  for block in BLOCKS:
    model = models[f"block{block}"]
    task = model.task
    for per_step in TOKENS_PER_STEP:
      steps_per_block = max(block // per_step, 1)
      if block == 1 and per_step > 1:
        continue  # one token per block: one step
      total_steps = steps_per_block * (LENGTH // block)
      for cached in ((True, False) if block < LENGTH else (False,)):
        if block == LENGTH:  # the full-sequence model: one canvas, no cache
          canvas = np.asarray(task.empty_canvas(n))
          call = lambda: sampling.sample(model.denoiser, model.params, key, canvas,
                                         sampling.AncestralSpec(steps=total_steps),
                                         mask_id=task.mask_id).tokens_BxL
        else:
          call = lambda: sampling.sample_blocks(
              model.denoiser, model.params, key, np.zeros((n, 0), np.int32),
              sampling.AncestralSpec(steps=steps_per_block), length=LENGTH, blocks_of=block,
              window=LENGTH - block, mask_id=task.mask_id, cached=cached).tokens_BxT
        tokens, seconds = _timed(call)
        tokens = np.asarray(tokens)
        rows.append({"block": block, "steps_per_block": steps_per_block, "cached": cached,
                     "total_steps": total_steps, **_scores(tokens, causal, task),
                     "time_s": seconds})
        examples[f"block {block}, {steps_per_block} steps/block"] = task.decode(tokens[0])
        print(rows[-1], flush=True)
  return rows, examples


def long_rows(models, n: int, seed: int) -> tuple[list[dict], str]:
  model, causal = models[f"block{LONG_BLOCK}"], models["causal1000"]
  task = model.task
  out = sampling.sample_blocks(
      model.denoiser, model.params, jax.random.key(seed + 1), np.zeros((n, 0), np.int32),
      sampling.AncestralSpec(steps=LONG_BLOCK), length=LONG_SEGMENTS * LENGTH,
      blocks_of=LONG_BLOCK, window=LENGTH - LONG_BLOCK, mask_id=task.mask_id)
  tokens = np.asarray(out.tokens_BxT)
  rows = []
  for segment in range(LONG_SEGMENTS):
    part = tokens[:, segment * LENGTH:(segment + 1) * LENGTH]
    rows.append({"segment": segment, **_scores(part, causal, task)})
    print(rows[-1], flush=True)
  return rows, task.decode(tokens[0])


def run(n: int, workdir: str = "/tmp/models", seed: str = "0") -> dict:
  seed = int(seed)
  models = trained(workdir)
  task = models["causal1000"].task
  windows = task.validation_windows(NELBO_WINDOWS)
  causal = models["causal1000"]
  causal_bits = elbo.causal_bits(causal.denoiser, causal.params, windows,
                                       start_id=task.mask_id)
  samples, examples = sample_rows(models, n, seed)
  long, long_example = long_rows(models, n, seed)
  return {"nelbo": nelbo_rows(models, windows, seed),
          "causal_bits_per_char": float(causal_bits.mean() / LENGTH),
          "samples": samples,
          "long": [{"segment": r["segment"], "gen_bits_per_char": r["gen_bits_per_char"]}
                   for r in long],
          "long_word_validity": [r["word_validity"] for r in long],
          "train_steps": STEPS, "n": n, "seed": seed, "examples": examples,
          "long_example": long_example}


def write(results: dict, out: str) -> None:
  report.write_json(os.path.join(out, "block_diffusion.json"), results)
  lines = ["# Block diffusion on character-level Shakespeare", "",
           f"Every model: {results['train_steps']} training steps, batch 64, 64 characters, "
           "1.07M parameters. Validation bits per character (256 held-out windows; ± one "
           "Monte Carlo standard error):", "",
           report.markdown_table(results["nelbo"], ("block", "bits_per_char", "stderr")),
           f"Causal reference, same windows, exact: {results['causal_bits_per_char']:.4f} "
           "bits per character.", "",
           f"## Samples ({results['n']} x 64 characters from nothing; ancestral inside each "
           "block; time: median of 3 runs of the compiled program)", "",
           report.markdown_table(results["samples"], (
               "block", "steps_per_block", "total_steps", "cached", "gen_bits_per_char",
               "word_validity", "time_s")),
           f"## Past the training length (block {LONG_BLOCK}, window {LENGTH - LONG_BLOCK}, "
           f"{LONG_SEGMENTS * LENGTH} characters)", "",
           report.markdown_table(results["long"], ("segment", "gen_bits_per_char")),
           "Examples:", ""]
  lines += [f"- {name}: `{text!r}`" for name, text in results["examples"].items()]
  lines += [f"- long: `{results['long_example']!r}`"]
  report.write_text(os.path.join(out, "block_diffusion.md"), "\n".join(lines) + "\n")
  fig, (left, right) = report.new_figure(ncols=2, figsize=(10, 4))
  nelbo = results["nelbo"]
  left.errorbar([r["block"] for r in nelbo], [r["bits_per_char"] for r in nelbo],
                yerr=[r["stderr"] for r in nelbo], marker="o", label="block NELBO")
  left.axhline(results["causal_bits_per_char"], color="gray", ls="--", label="causal reference")
  left.set_xscale("log", base=2)
  left.set_xlabel("block size")
  left.set_ylabel("validation bits / char")
  left.legend()
  for cached in (True, False):
    rows = [r for r in results["samples"] if r["cached"] == cached]
    right.scatter([r["time_s"] for r in rows], [r["gen_bits_per_char"] for r in rows],
                  label="cached blocks" if cached else "no cache")
    for r in rows:
      right.annotate(f"b{r['block']}/K{r['total_steps']}", (r["time_s"], r["gen_bits_per_char"]),
                     fontsize=7)
  right.set_xscale("log")
  right.set_xlabel("seconds per batch")
  right.set_ylabel("generative bits / char (causal ref.)")
  right.legend()
  report.save_figure(fig, os.path.join(out, "block_diffusion.png"))


def smoke(workdir: str, seed: str) -> dict:
  """Blocks of 4 and 16 (= L) on the tiny models of experiments/smoke.py, 30 steps each,
  trained in WORKDIR where missing; 2 steps a block, 8 NELBO windows, one timed run."""
  global STEPS, BLOCKS, LENGTH, LONG_BLOCK, NELBO_WINDOWS, NELBO_TIME_SAMPLES, TIMED_RUNS
  global TOKENS_PER_STEP
  STEPS, BLOCKS, LENGTH, LONG_BLOCK = 30, (4, 16), 16, 4
  NELBO_WINDOWS, NELBO_TIME_SAMPLES, TIMED_RUNS, TOKENS_PER_STEP = 8, 2, 1, (2,)
  CONFIGS.update(block=lambda: smoke_run.text_config(workdir),
                 char=lambda: smoke_run.text_config(workdir),
                 causal=lambda: smoke_run.text_config(workdir, causal=True))
  return {"workdir": workdir, "seed": seed}


if __name__ == "__main__":
  smoke_run.experiment_main(__doc__, run, write, "block_diffusion.md", default_n=64,
                            options={"workdir": ("/tmp/models", "where the models are trained"),
                                     "seed": ("0", "PRNG seed")},
                            smoke=smoke, smoke_n=4)
