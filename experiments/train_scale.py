"""Training as several processes against one: throughput, MFU, input wait, equal curves.

  python experiments/train_scale.py [--out=results] [--repeats=5] [--steps=40]

A corpus of random words (fixed seed, character tokens, `mdjax.prepare_data`) is trained
with configs/corpus.py's pipeline (grain over the token shards, each process reading its
own rows) on a small MDLM-like denoiser, the same global work in two layouts of 2 CPU
devices: 1 process x 2 devices, and 2 processes x 1 device (gloo between the processes,
`train.py --coordinator`). Settings: sequence length 128 in float32, and 1024 in bfloat16
compute (float32 parameters). Each run is a real `train.py` launch; the layouts alternate
(A, B, A, B, ...) for --repeats rounds so that load on the machine falls on both alike.
tokens_per_s, mfu and input_wait_fraction are medians of a run's logged rows (the loop's
windows leave out the compiling first step, checkpoints and evaluation), then the median
over the rounds. mfu is the loop's (mdjax.train.flops: PaLM's model FLOPs per token) over one peak for all
runs, `flops.measure_peak_flops` of a float32 matmul on the 2 devices of one process (a CPU
has no datasheet figure; measured in each run, the 2-process layout would time one device
alone on both cores and double its peak);
input_wait_fraction the share of step time the loop blocked on its data source
(mdjax.data.InputWait).

multiprocess_equals_single: the float32 runs' logged losses agree between the layouts to
rtol 1e-5 (the same batches, noise and program; only the order of the gradient all-reduce
differs: see tests/train/test_multiprocess.py). resume_exact: the corpus pipeline's resume
check (tests/data/test_resume.py: a run stopped mid-epoch and resumed reads the same
batches and ends with the same parameters, bit for bit) passes.

Writes results/train_scale.json (with the machine's load average at the start and the end:
other jobs on the 2 cores distort the timings); fixed seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # run as a script: experiments/ lives in the repo root
  sys.path.insert(0, REPO)

import numpy as np

WORDS = ("thou", "art", "the", "king", "and", "queen", "of", "night", "fair", "love", "sweet",
         "shall", "not", "with", "my", "heart", "be", "to", "his", "her")
DEVICES = 2  # the devices of every layout: this machine's 2 cores
# (name, seq_len, global_batch, dtype)
SETTINGS = (("seq128_f32", 128, 16, "float32"), ("seq1024_bf16", 1024, 4, "bfloat16"))
LAYOUTS = ((1, DEVICES), (DEVICES, 1))  # (processes, devices per process)
RTOL = 1e-5


def write_corpus(root: str) -> str:
  """A prepared character corpus of about 2 MB of random words (seed 0)."""
  from mdjax.prepare_data import prepare
  rng = np.random.default_rng(0)
  text = "\n\n".join(" ".join(rng.choice(WORDS, rng.integers(20, 200))).capitalize() + "."
                     for _ in range(4000))
  source = os.path.join(root, "words.txt")
  with open(source, "w", encoding="utf-8") as f:
    f.write(text)
  out = os.path.join(root, "corpus")
  prepare([source], "char", out, validation_fraction=0.01, documents="paragraph")
  return out


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def measured_peak() -> float:
  """Peak FLOP/s per device: a float32 matmul on 2 simulated devices sharing the cores."""
  code = "from mdjax.train import flops; print(flops.measure_peak_flops())"
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, text=True,
                       capture_output=True,
                       env=dict(os.environ, PYTHONPATH=REPO, JAX_NUM_CPU_DEVICES=str(DEVICES)))
  return float(out.stdout.strip().splitlines()[-1])


def run(workdir: str, data_dir: str, setting, layout, steps: int, peak: float) -> list[dict]:
  """One train.py job in `layout`; its metrics rows."""
  name, seq_len, batch, dtype = setting
  processes, devices = layout
  flags = ["--config=configs/corpus.py", f"--workdir={workdir}",
           f"--config.task_kwargs.data_dir={data_dir}", f"--config.task_kwargs.length={seq_len}",
           f"--config.batch_size={batch}", f"--config.model.dtype={dtype}",
           "--config.model.d_model=128", "--config.model.num_layers=2",
           "--config.model.num_heads=4", "--config.model.d_ff=512",
           f"--config.train.num_steps={steps}", "--config.train.warmup_steps=5",
           "--config.train.ema_decay=0.0", f"--config.train.peak_flops={peak}",
           f"--config.checkpoint.every={steps}", "--config.log_every=5",
           "--config.eval_every=0", "--config.eval_batches=1", "--config.num_eval_samples=0",
           "--config.data.verify=size"]
  env = dict(os.environ, PYTHONPATH=REPO, JAX_NUM_CPU_DEVICES=str(devices))
  address = f"127.0.0.1:{_free_port()}"
  procs = []
  for i in range(processes):
    extra = ([f"--coordinator={address}", f"--num_processes={processes}", f"--process_id={i}"]
             if processes > 1 else [])
    procs.append(subprocess.Popen([sys.executable, "train.py", *flags, *extra], cwd=REPO,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True))
  outputs = [p.communicate(timeout=1800)[0] for p in procs]
  for p, out in zip(procs, outputs):
    if p.returncode:
      raise RuntimeError(f"{name} {layout}: train.py failed:\n{out[-3000:]}")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _median(rows, key):
  values = [r[key] for r in rows if r.get(key) is not None]
  return statistics.median(values) if values else None


def resume_check() -> bool:
  """The corpus pipeline's stop-and-resume test, run as it is in CI."""
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
       "tests/data/test_resume.py::"
       "test_stopped_mid_epoch_and_resumed_matches_the_uninterrupted_run"],
      cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True)
  print(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:])
  return proc.returncode == 0


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="results")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--steps", type=int, default=40)
  args = parser.parse_args()
  rows, equal = [], []
  load_start = os.getloadavg()[0]
  with tempfile.TemporaryDirectory(prefix="train-scale-") as root:
    data_dir = write_corpus(root)
    peak = measured_peak()
    print(f"peak FLOP/s per device (float32 matmul): {peak:.3g}", flush=True)
    for setting in SETTINGS:
      per_layout = {layout: [] for layout in LAYOUTS}
      for r in range(args.repeats):
        for layout in LAYOUTS:
          workdir = os.path.join(root, f"{setting[0]}-{layout[0]}x{layout[1]}-{r}")
          start = time.perf_counter()
          metrics = run(workdir, data_dir, setting, layout, args.steps, peak)
          per_layout[layout].append([m for m in metrics if "loss" in m])
          print(f"{setting[0]} {layout[0]} process(es) x {layout[1]} device(s), round {r}: "
                f"{_median(per_layout[layout][-1], 'tokens_per_s'):.0f} tokens/s "
                f"({time.perf_counter() - start:.0f} s)", flush=True)
      name, seq_len, batch, dtype = setting
      for layout, runs in per_layout.items():
        rows.append(dict(
            setting=f"{name}_{layout[0]}x{layout[1]}", processes=layout[0],
            devices_per_process=layout[1], seq_len=seq_len, global_batch=batch, dtype=dtype,
            tokens_per_s=statistics.median(_median(m, "tokens_per_s") for m in runs),
            mfu=_median([{"mfu": _median(m, "mfu")} for m in runs], "mfu"),
            input_wait_fraction=statistics.median(
                _median(m, "input_wait_fraction") or 0.0 for m in runs)))
      if dtype == "float32":  # bf16 rounding amplifies the reduction order's differences
        one, two = (per_layout[layout][0] for layout in LAYOUTS)
        a = np.array([m["loss"] for m in one])
        b = np.array([m["loss"] for m in two])
        equal.append(len(a) == len(b) and bool(np.allclose(b, a, rtol=RTOL, atol=0)))
        print(f"{name}: losses of the layouts, max relative difference "
              f"{np.max(np.abs(b - a) / np.abs(a)):.2e}", flush=True)
  resume_exact = resume_check()
  base = {r["seq_len"]: r["tokens_per_s"] for r in rows if r["processes"] == 1}
  result = dict(rows=rows, resume_exact=resume_exact,
                multiprocess_equals_single=all(equal) and bool(equal),
                two_process_over_one={f"seq_len_{r['seq_len']}": r["tokens_per_s"]
                                      / base[r["seq_len"]] for r in rows if r["processes"] > 1},
                peak_flops_per_device=peak, steps=args.steps, repeats=args.repeats,
                # 1-minute load averages: other jobs on the 2 cores distort the timings.
                load_average=dict(start=load_start, end=os.getloadavg()[0]))
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "train_scale.json"), "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result, indent=1))


if __name__ == "__main__":
  main()
