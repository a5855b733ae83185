"""EOS at real lengths: what ending rows at EOS saves on a 256-position canvas.

  python experiments/eos_long.py [--workdir=/tmp/models/eos_long] [--out=results]
  # -> results/eos_long.json

Trains (or reuses, from `--workdir`) a small BPE denoiser on Shakespeare speeches, one speech
a 256-token window with EOS after it (`documents="padded"`, LLaDA's SFT layout; a training
speech is 54 tokens on average, 27 at the median, and 2.6% are cut at 256), then generates 8 rows from an empty 256-position
canvas with each sampler family that ends rows at EOS, 128 steps (two positions a step), with
and without the EOS early stop (`spec.eos_id` set or None; the same row keys):

- mean generated length: tokens before the row's first EOS (the canvas without one), in
  both modes;
- nfe: the denoiser calls of the 8-row program (`SampleResult.nfe`, `BlocksResult.nfe`:
  the samplers' own counters), and of each row sampled alone with its own row key
  (`nfe_alone`; the batch's tokens up to near-ties flipped by rounding: `batch_equals_rows`);
- output tokens per second: generated tokens (before EOS) of the 8 rows over the median
  wall time of `--repeats` timed runs after the compiling one (both modes interleaved);
- per row alone, the calls early stop saved (1 - calls with / calls without) against the
  fraction of the canvas after its EOS (`saved_fraction`, `tail_fraction`, means over the
  rows; `saved_over_tail` their ratio), and what the 8-row program saved
  (`batch_saved_fraction`: it calls the denoiser until its last row has ended).

Fixed seed. The training (1,000 steps of 16 windows, a 262,528-parameter model) took 27
minutes on the shared 2-core CPU at 0.6 steps/s with other jobs running; at the 1.7 steps/s of
a quieter stretch it is 10 minutes. The sampling takes 12 to 14 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs import shakespeare_bpe  # noqa: E402
from mdjax import generation, report, sampling  # noqa: E402
from mdjax.bench import timing  # noqa: E402

CANVAS = 256
STEPS = 1000  # training steps
BATCH = 8
SEED = 0
BLOCK = 32  # semi-autoregressive blocks and block-by-block generation (LLaDA's length)
STEPS_PER_CANVAS = 128  # two positions a step


@dataclasses.dataclass(frozen=True)
class Sampler:
  """A family's spec on the canvas; `blocks_of`: generated block by block (sample_blocks)."""

  name: str
  spec: sampling.SamplerSpec
  eos_knobs: tuple = ()  # (name, value) pairs set with the EOS id
  blocks_of: int | None = None


def samplers(canvas: int = CANVAS, block: int = BLOCK, steps: int = STEPS_PER_CANVAS
             ) -> tuple[Sampler, ...]:
  """The samplers, each making `steps` steps over the canvas (block generation: steps * block
  / canvas a block): every family that ends rows at EOS, the block families with LLaDA's
  confidence and with the ancestral kernel inside a block."""
  per_block = steps * block // canvas
  return (
      Sampler("ancestral", sampling.AncestralSpec(steps=steps)),
      Sampler("confidence top-k", sampling.ConfidenceSpec(steps=steps)),
      Sampler("confidence top-k, EOS ranked last", sampling.ConfidenceSpec(steps=steps),
              eos_knobs=(("eos_rank_last", True),)),
      Sampler(f"semi-autoregressive blocks of {block}, confidence",
              sampling.ConfidenceSpec(steps=steps, block_length=block)),
      Sampler(f"semi-autoregressive blocks of {block}, ancestral",
              sampling.AncestralSpec(steps=steps, block_length=block)),
      Sampler(f"block generation, blocks of {block}, ancestral",
              sampling.AncestralSpec(steps=per_block), blocks_of=block),
      Sampler("remdm", sampling.RemaskSpec(steps=steps, eta=0.05)),
  )


def config():
  """The BPE Shakespeare config with one speech a window, EOS after it, 256 positions, and a
  model small enough to train in minutes on 2 CPU cores."""
  c = shakespeare_bpe.get_config()
  c.task_kwargs.update(documents="padded", length=CANVAS)
  c.batch_size = 16
  c.model.update(d_model=64, num_layers=2, num_heads=4, d_ff=256)
  c.train.update(num_steps=STEPS, warmup_steps=50)
  c.eval_every = 0
  c.eval_batches = 2
  c.num_eval_samples = 0
  c.log_every = 50
  c.checkpoint.update(every=STEPS, keep=1)
  return c


def first_eos(tokens_BxL, eos_id: int) -> np.ndarray:
  """Positions before each row's first EOS (L when it has none)."""
  eos_BxL = np.asarray(tokens_BxL) == eos_id
  return np.where(eos_BxL.any(-1), eos_BxL.argmax(-1), eos_BxL.shape[1])


def same_trajectory(sampler: Sampler) -> bool:
  """Whether stopping leaves each row's tokens up to its first EOS as they are without it, by
  construction: a family that never reopens a written token (a finished row has written every
  position before its EOS) and no EOS knob (the run without the stop cannot have one, so it
  draws differently)."""
  return not sampler.eos_knobs and not isinstance(sampler.spec, sampling.RemaskSpec)


def runner(apply_fn, params, sampler: Sampler, keys_B, *, eos_id: int | None, mask_id: int,
           canvas: int):
  """A call generating `canvas` positions for the rows of `keys_B`: -> (tokens_BxL, nfe)."""
  spec = sampler.spec
  if eos_id is not None:
    spec = generation.with_eos(spec, eos_id, **dict(sampler.eos_knobs))
  batch = keys_B.shape[0]
  if sampler.blocks_of:
    prompt = np.zeros((batch, 0), np.int32)

    def call():
      out = sampling.sample_blocks(apply_fn, params, keys_B, prompt, spec, length=canvas,
                                   blocks_of=sampler.blocks_of,
                                   window=canvas - sampler.blocks_of, mask_id=mask_id,
                                   cached=False)
      return out.tokens_BxT, out.nfe
  else:
    empty = np.full((batch, canvas), mask_id, np.int32)

    def call():
      out = sampling.sample(apply_fn, params, keys_B, empty, spec, mask_id=mask_id)
      return out.tokens_BxL, out.nfe
  return call


def measure(apply_fn, params, sampler: Sampler, *, eos_id: int, mask_id: int,
            canvas: int = CANVAS, batch: int = BATCH, repeats: int = 3,
            seed: int = SEED) -> list[dict]:
  """The two rows (without, with EOS early stop) of one sampler."""
  keys_B = sampling.row_keys(jax.random.key(seed), batch)
  modes = {stop: runner(apply_fn, params, sampler, keys_B, eos_id=eos_id if stop else None,
                        mask_id=mask_id, canvas=canvas) for stop in (False, True)}
  # The first (compiling) run of each mode gives the tokens; then `repeats` timed rounds,
  # the two modes interleaved so that the machine's load falls on both alike.
  first = {stop: jax.block_until_ready(call()) for stop, call in modes.items()}
  times = {stop: [] for stop in modes}
  for _ in range(repeats):
    for stop, call in modes.items():
      begin = time.perf_counter()
      jax.block_until_ready(call())
      times[stop].append(time.perf_counter() - begin)
  seconds = {stop: statistics.median(t) for stop, t in times.items() if t}
  out = {}
  for stop in modes:
    tokens, nfe = first[stop]
    alone = [(tokens, nfe)] if batch == 1 else [
        runner(apply_fn, params, sampler, keys_B[r:r + 1], eos_id=eos_id if stop else None,
               mask_id=mask_id, canvas=canvas)() for r in range(batch)]
    out[stop] = {"tokens": np.asarray(tokens), "nfe": int(nfe),
                 "alone_tokens": np.concatenate([np.asarray(t) for t, _ in alone]),
                 "nfe_alone_R": np.array([int(n) for _, n in alone])}
  lengths = {stop: first_eos(o["tokens"], eos_id) for stop, o in out.items()}
  # Per row, from its runs alone: the calls the stop saved and the canvas after its EOS.
  alone_lengths = {stop: first_eos(o["alone_tokens"], eos_id) for stop, o in out.items()}
  saved_R = 1.0 - out[True]["nfe_alone_R"] / out[False]["nfe_alone_R"]
  tail_R = 1.0 - alone_lengths[True] / canvas
  rows = []
  for stop in (False, True):
    o = out[stop]
    row = {"sampler": sampler.name, "canvas": canvas, "eos_early_stop": stop,
           "mean_generated_length": float(lengths[stop].mean()), "nfe": o["nfe"],
           "output_tokens_per_s": (float(lengths[stop].sum() / seconds[stop]) if repeats
                                   else None),
           "batch": batch, "seconds_median": seconds.get(stop),
           "generated_lengths": lengths[stop].tolist(),
           "nfe_alone": o["nfe_alone_R"].tolist(),
           "nfe_alone_mean": float(o["nfe_alone_R"].mean()),
           # Whether each row sampled alone (its own key) gave its batch tokens; programs of
           # other batch sizes round differently, which can flip near-ties.
           "batch_equals_rows": bool((o["alone_tokens"] == o["tokens"]).all())}
    if stop:
      row.update({
          "lengths_agree": bool((lengths[True] == lengths[False]).all()
                                and (alone_lengths[True] == alone_lengths[False]).all()),
          "generated_lengths_alone": alone_lengths[True].tolist(),
          "same_trajectory": same_trajectory(sampler),
          "saved_fraction": float(saved_R.mean()), "tail_fraction": float(tail_R.mean()),
          "saved_over_tail": float(saved_R.mean() / tail_R.mean()) if tail_R.mean() else None,
          "batch_saved_fraction": 1.0 - o["nfe"] / out[False]["nfe"]})
    rows.append(row)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default="/tmp/models/eos_long", help="model workdir (reused)")
  parser.add_argument("--out", default=os.path.join(ROOT, "results"), help="output directory")
  parser.add_argument("--repeats", type=int, default=3, help="timed runs per mode")
  args = parser.parse_args()
  import mdjax
  from mdjax import train
  start = time.time()
  train.ensure_trained(config(), args.workdir)
  train_seconds = time.time() - start
  model = mdjax.load(args.workdir)
  task = model.task
  rows = []
  for sampler in samplers():
    rows += measure(model.apply_fn, model.params, sampler, eos_id=task.eos_id,
                    mask_id=task.mask_id, repeats=args.repeats)
    for row in rows[-2:]:
      print({k: row.get(k) for k in ("sampler", "eos_early_stop", "mean_generated_length",
                                     "nfe", "nfe_alone_mean", "output_tokens_per_s",
                                     "saved_fraction", "tail_fraction", "lengths_agree")},
            flush=True)
  # The training's own wall time, as the loop recorded it (this run may have reused it).
  recorded = train.read_train_seconds(args.workdir)
  train_seconds = train_seconds if recorded is None else recorded
  results = {"seed": SEED, "train_steps": int(model.step), "train_seconds": round(
      train_seconds, 1), "seconds": round(time.time() - start, 1),
             "machine": timing.machine_info(), "rows": rows}
  report.write_json(os.path.join(args.out, "eos_long.json"), results)
  columns = ["sampler", "eos_early_stop", "mean_generated_length", "nfe", "nfe_alone_mean",
             "output_tokens_per_s", "saved_fraction", "tail_fraction"]
  print(report.markdown_table(rows, columns))
  print(f"{results['seconds']} s")


if __name__ == "__main__":
  main()
