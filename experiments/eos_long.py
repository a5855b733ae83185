"""EOS at real lengths: what ending rows at EOS saves on a 256-position canvas.

  python experiments/eos_long.py [--workdir=/tmp/models/eos_long] [--out=results]
  # -> results/eos_long.json

Trains (or reuses, from `--workdir`) a small BPE denoiser on Shakespeare speeches, one speech
a 256-token window with EOS after it (`documents="padded"`, LLaDA's SFT layout; a training
speech is 54 tokens on average, 27 at the median, and 2.6% are cut at 256), then generates 8 rows from an empty 256-position
canvas with each sampler family that ends rows at EOS, 128 steps (two positions a step), with
and without the EOS early stop (`spec.eos_id` set or None; the same row keys), measured by
`mdjax.bench.eos.measure`:

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
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs import shakespeare_bpe  # noqa: E402
from mdjax import report  # noqa: E402
from mdjax.bench import timing  # noqa: E402
from mdjax.bench.eos import CANVAS, SEED, measure, samplers  # noqa: E402

STEPS = 1000  # training steps


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
    rows += measure(model.denoiser, model.params, sampler, eos_id=task.eos_id,
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
