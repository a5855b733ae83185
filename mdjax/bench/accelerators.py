"""Trained accelerators against the training-free samplers, measured exactly on an oracle task.

`python -m mdjax.bench.accelerators` writes results/accelerators.json (docs/accelerators.md
reads it). On one exact oracle task (sudoku4 by default; its exact denoiser is the teacher,
so no learning error sits in the denoiser), at each temperature (0: the reference's greedy
setting; 1: the law's, as results/parallelism.json):

- Learn2PD's filter trained on the oracle's own rollouts (`mdjax.accelerators.learn2pd`),
  then the `learned_commit` sampler at several accept thresholds (trained: true);
- the training-free families on the same teacher and the same prompts (trained: false):
  confidence thresholds, entropy-bounded, confidence and ancestral at fixed steps;
- the oracle the filter imitates (`egp_oracle`, which reads the teacher's answer: a ceiling,
  not a sampler);

each point with accuracy (the task's exact validity) and TPF (tokens per forward at batch
size 1) with standard errors, in results/parallelism.json's point schema plus `method`,
`trained` and `temperature`; AUP per method; and at the mean calls of each learned point,
the best accuracy the training-free points reach there by mixing two of them (the upper
concave hull in (mean calls, accuracy): a row sampled by one or the other at random), with
the difference in standard errors. Fixed seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from typing import Any, Sequence

import jax
import numpy as np

from mdjax import files, parallelism, report, sampling
from mdjax.bench import order_policy as order_policy_bench
from mdjax.bench import parallelism as bench
from mdjax.accelerators import learn2pd

SEED = 0
ACCEPT_THRESHOLDS = (0.5, 0.9, 0.96, 0.99)
THRESHOLDS = (0.99, 0.9, 0.7, 0.6, 0.5, 0.3)
GAMMAS = (0.1, 0.5, 1.5)
RHOS = (1, 2, 4)


@dataclasses.dataclass(frozen=True)
class Method:
  """One point of the sweep: its method name, knobs and spec; trained or training-free."""

  method: str
  knobs: tuple
  spec: Any
  trained: bool


def methods(n: int, filt, temperature: float, sizes: str) -> list[Method]:
  """Every method's points for `n` generated positions at one temperature."""
  t = dict(temperature=temperature)
  accept = ACCEPT_THRESHOLDS[1:3] if sizes == "tiny" else ACCEPT_THRESHOLDS
  out = [Method("learned_commit", (("accept_threshold", a),),
                sampling.LearnedCommitSpec(steps=n, commit_filter=filt, accept_threshold=a, **t),
                True) for a in accept]
  if sizes == "tiny":
    return out + [Method("confidence_threshold", (("threshold", 0.9),),
                         sampling.ConfidenceSpec(steps=n, threshold=0.9, **t), False),
                  Method("ancestral", (("steps", n),), sampling.AncestralSpec(steps=n, **t),
                         False)]
  out += [Method("confidence_threshold", (("threshold", tau),),
                 sampling.ConfidenceSpec(steps=n, threshold=tau, **t), False) for tau in THRESHOLDS]
  out += [Method("entropy_bounded", (("gamma", g),),
                 sampling.EntropyBoundedSpec(steps=n, gamma=g, **t), False) for g in GAMMAS]
  for rho in RHOS:
    steps = max(1, math.ceil(n / rho))
    out.append(Method("confidence", (("steps", steps),),
                      sampling.ConfidenceSpec(steps=steps, **t), False))
    out.append(Method("ancestral", (("steps", steps),), sampling.AncestralSpec(steps=steps, **t),
                      False))
  return out


def measure(ot: bench.OracleTask, m: Method, canvas: np.ndarray, seed: int,
            temperature: float) -> dict:
  """One point: results/parallelism.json's record, with method, trained and temperature."""
  record, _ = bench.run_point(ot, bench.Point(m.method, m.knobs, m.spec, False), canvas, seed)
  record.update(method=m.method, trained=m.trained, temperature=temperature)
  return record


def oracle_point(ot: bench.OracleTask, canvas: np.ndarray, seed: int, temperature: float,
                 cfg: learn2pd.FilterConfig) -> dict:
  """The imitated oracle on the evaluation prompts: the teacher's answer, then commits of the
  proposals equal to it (it reads the answer: a ceiling, not a sampler)."""
  fixed = np.zeros(canvas.shape, bool)
  fixed[:, :ot.prompt_length] = True
  keys = learn2pd.stream_keys(seed)
  teacher = sampling.sample(ot.denoiser, ot.denoiser_params, keys["teacher"], canvas,
                            learn2pd.teacher_spec(ot.generated, cfg), fixed,
                            mask_id=ot.task.mask_id)
  final = np.asarray(teacher.tokens_BxL)
  bound = sampling.BoundDenoiser(sampling.Denoiser.of(ot.denoiser), ot.denoiser_params)
  out = learn2pd.oracle_examples(bound, canvas, fixed, final, keys["oracle"],
                                 mask_id=ot.task.mask_id, width=ot.generated, blocks=False,
                                 temperature=temperature, num_steps=ot.generated,
                                 max_block_steps=4 * ot.generated)
  valid = ot.valid(final).astype(np.float64)
  calls = out["steps_B"].astype(np.float64)
  rows, acc, mean_calls = len(valid), float(valid.mean()), float(calls.mean())
  return {"task": ot.name, "family": "egp_oracle", "method": "egp_oracle", "trained": False,
          "uses_answer": True, "temperature": temperature, "knobs": {}, "rows": rows,
          "generated": ot.generated, "accuracy": acc,
          "accuracy_se": math.sqrt(acc * (1 - acc) / rows),
          "tpf": ot.generated / mean_calls,
          "tpf_se": ot.generated * float(calls.std(ddof=1)) / (math.sqrt(rows) * mean_calls**2),
          "mean_forwards": mean_calls}


def hull(points: list[dict]) -> list[dict]:
  """The upper concave hull in (mean calls, accuracy), fewest calls first: what mixing two
  points reaches (each row sampled by one of them at random, the calls and the accuracy
  averaging linearly)."""
  pts = sorted(points, key=lambda p: (p["mean_forwards"], -p["accuracy"]))
  frontier = []
  for p in pts:
    if frontier and p["accuracy"] <= frontier[-1]["accuracy"]:
      continue  # more calls, no more accuracy
    while len(frontier) >= 2:
      a, b = frontier[-2], frontier[-1]
      cross = ((b["mean_forwards"] - a["mean_forwards"]) * (p["accuracy"] - a["accuracy"])
               - (b["accuracy"] - a["accuracy"]) * (p["mean_forwards"] - a["mean_forwards"]))
      if cross < 0:
        break
      frontier.pop()  # b lies on or below the chord a-p
    frontier.append(p)
  return frontier


def at_calls(frontier: list[dict], calls: float) -> dict | None:
  """The frontier's accuracy at `calls` mean calls (linear between its points) with its
  standard error (the two points' binomial errors, weighted); None below its fewest calls."""
  if not frontier or calls < frontier[0]["mean_forwards"]:
    return None
  for a, b in zip(frontier, frontier[1:]):
    if a["mean_forwards"] <= calls <= b["mean_forwards"]:
      f = (calls - a["mean_forwards"]) / (b["mean_forwards"] - a["mean_forwards"])
      return {"accuracy": (1 - f) * a["accuracy"] + f * b["accuracy"],
              "accuracy_se": math.hypot((1 - f) * a["accuracy_se"], f * b["accuracy_se"]),
              "between": [_label(a), _label(b)], "weight": f}
  last = frontier[-1]  # more calls than the costliest: it stays the best
  return {"accuracy": last["accuracy"], "accuracy_se": last["accuracy_se"],
          "between": [_label(last)], "weight": 0.0}


def _label(p: dict) -> str:
  knobs = ", ".join(f"{k}={v}" for k, v in p["knobs"].items())
  return f"{p['method']}({knobs})"


def equal_calls(points: list[dict]) -> list[dict]:
  """Each learned point against the training-free frontier at its mean calls."""
  out = []
  for key in sorted({(p["task"], p["temperature"]) for p in points}):
    here = [p for p in points if (p["task"], p["temperature"]) == key]
    frontier = hull([p for p in here if not p["trained"] and not p.get("uses_answer")])
    for p in (p for p in here if p["trained"]):
      free = at_calls(frontier, p["mean_forwards"])
      row = {"task": key[0], "temperature": key[1], "learned": _label(p),
             "mean_forwards": p["mean_forwards"], "tpf": p["tpf"], "accuracy": p["accuracy"],
             "accuracy_se": p["accuracy_se"], "training_free": free}
      if free is not None:
        se = math.hypot(p["accuracy_se"], free["accuracy_se"])
        row["difference"] = p["accuracy"] - free["accuracy"]
        row["z"] = row["difference"] / se if se > 0 else (0.0 if row["difference"] == 0
                                                           else math.copysign(math.inf,
                                                                              row["difference"]))
      out.append(row)
  return out


def aup_by_method(points: list[dict]) -> dict:
  """AUP per task, temperature and method; y_max the best accuracy there over the samplers
  (the answer-reading oracle left out)."""
  table = {}
  for task, temperature in sorted({(p["task"], p["temperature"]) for p in points}):
    here = [p for p in points if p["task"] == task and p["temperature"] == temperature
            and not p.get("uses_answer")]
    y_max = 100.0 * max(p["accuracy"] for p in here)
    per = {}
    for method in sorted({p["method"] for p in here}):
      pts = [p for p in here if p["method"] == method]
      per[method] = (parallelism.aup([p["tpf"] for p in pts],
                                     [100.0 * p["accuracy"] for p in pts], y_max)
                     if y_max > 0 else 0.0)
    table.setdefault(task, {})[str(temperature)] = per
  return table


def run(*, task: str = "sudoku4", temperatures: Sequence[float] = (0.0, 1.0), rows: int = 1000,
        train_rows: int = 2000, epochs: int = 4000, seed: int = SEED, sizes: str = "full",
        log=print) -> dict:
  """The whole bench as one dict (results/accelerators.json)."""
  started = time.perf_counter()
  by_name = {t.name: t for t in bench.oracle_tasks(sizes)}
  if task not in by_name:
    raise ValueError(f"task={task!r} must be one of {sorted(by_name)} (sizes={sizes!r}).")
  ot = by_name[task]
  canvas = bench.canvas_of(ot, rows, seed)  # results/parallelism.json's prompts
  points, filters = [], {}
  for temperature in temperatures:
    cfg = learn2pd.FilterConfig(rows=train_rows, temperature=float(temperature), epochs=epochs,
                                seed=seed)
    train_canvas, train_fixed = learn2pd.prompts(ot.task, train_rows, ot.prompt_length,
                                                 learn2pd.stream_keys(seed)["prompts"])
    filt, info = learn2pd.train_filter(ot.denoiser, ot.denoiser_params, train_canvas,
                                       train_fixed, cfg, mask_id=ot.task.mask_id,
                                       vocab_size=ot.task.vocab_size, log=log)
    filters[str(float(temperature))] = {"filter": repr(filt), **info}
    t0 = time.perf_counter()
    for m in methods(ot.generated, filt, float(temperature), sizes):
      points.append(measure(ot, m, canvas, seed, float(temperature)))
    points.append(oracle_point(ot, canvas, seed, float(temperature), cfg))
    log(f"{ot.name} T={temperature}: {len(points)} points so far "
        f"({time.perf_counter() - t0:.0f} s)")
  if task == "sudoku4" and 0.0 in temperatures:  # UPO's learned order: bench/order_policy.py
    points += order_policy_bench.accelerator_points(ot, canvas, seed, sizes, log)
  return {
      "config": {"seed": seed, "rows": rows, "train_rows": train_rows, "epochs": epochs,
                 "sizes": sizes, "task": task, "temperatures": [float(t) for t in temperatures],
                 "generated": ot.generated, "prompt_length": ot.prompt_length,
                 "jax": jax.__version__, "backend": jax.default_backend()},
      "filters": filters,
      "points": points,
      "aup": aup_by_method(points),
      "equal_calls": equal_calls(points),
      "seconds": time.perf_counter() - started,
  }


def table(results: dict) -> str:
  """The points as a markdown table, grouped by temperature."""
  lines = ["| T | method | knobs | trained | accuracy | TPF |", "|---|---|---|---|---|---|"]
  for p in results["points"]:
    knobs = ", ".join(f"{k}={v}" for k, v in p["knobs"].items())
    lines.append(f"| {p['temperature']:g} | {p['method']} | {knobs} | {str(p['trained']).lower()}"
                 f" | {p['accuracy']:.3f} ± {p['accuracy_se']:.3f} | {p['tpf']:.2f} ± "
                 f"{p['tpf_se']:.2f} |")
  return "\n".join(lines) + "\n"


def summary(results: dict, log=print) -> None:
  """The figures a reader checks first."""
  log(table(results))
  for row in results["equal_calls"]:
    free = row["training_free"]
    if free is None:
      log(f"T={row['temperature']:g} {row['learned']}: {row['accuracy']:.3f} at "
          f"{row['mean_forwards']:.3f} calls; no training-free point is that cheap")
      continue
    log(f"T={row['temperature']:g} {row['learned']}: {row['accuracy']:.3f} ± "
        f"{row['accuracy_se']:.3f} at {row['mean_forwards']:.3f} calls; training-free "
        f"{free['accuracy']:.3f} ± {free['accuracy_se']:.3f} ({' + '.join(free['between'])}); "
        f"difference {row['difference']:+.3f} (z {row['z']:+.1f})")
  for task, temps in results["aup"].items():
    for temperature, per in temps.items():
      log(f"AUP {task} T={temperature}: " + ", ".join(
          f"{m} {v:.0f}" for m, v in sorted(per.items(), key=lambda kv: -kv[1])))
  log(f"total {results['seconds']:.0f} s")


def plot(results: dict, path: str) -> str:
  """Accuracy against tokens per forward, one panel per temperature: each method's points
  with standard errors (trained methods filled, training-free hollow), the oracle ceiling a
  star."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  points = results["points"]
  temperatures = sorted({p["temperature"] for p in points})
  fig, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 4.2),
                           squeeze=False, sharey=True)
  for ax, temperature in zip(axes.flat, temperatures):
    here = [p for p in points if p["temperature"] == temperature]
    for i, method in enumerate(sorted({p["method"] for p in here})):
      pts = sorted((p for p in here if p["method"] == method), key=lambda p: p["tpf"])
      color, trained = plt.cm.tab10(i % 10), pts[0]["trained"]
      marker = "*" if method == "egp_oracle" else "o"
      ax.errorbar([p["tpf"] for p in pts], [p["accuracy"] for p in pts],
                  xerr=[p["tpf_se"] for p in pts], yerr=[p["accuracy_se"] for p in pts],
                  ls="-" if trained else ":", marker=marker, ms=8 if marker == "*" else 4,
                  mfc=color if trained else "none", color=color, lw=1, capsize=2,
                  label=f"{method}{' (trained)' if trained else ''}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per forward (mean, log scale)")
    ax.set_title(f"{here[0]['task']}, temperature {temperature:g}")
    ax.legend(fontsize=7)
  axes.flat[0].set_ylabel("accuracy (exact checks)")
  fig.tight_layout()
  with files.atomic_write(path) as f:
    fig.savefig(f, format="png", dpi=110)
  plt.close(fig)
  return path


def main(argv: Sequence[str] | None = None, log=print) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="results/accelerators.json")
  parser.add_argument("--task", default="sudoku4")
  parser.add_argument("--temperatures", default="0,1", help="comma-separated")
  parser.add_argument("--rows", type=int, default=1000)
  parser.add_argument("--train_rows", type=int, default=2000)
  parser.add_argument("--epochs", type=int, default=4000)
  parser.add_argument("--sizes", default="full", choices=("full", "tiny"))
  parser.add_argument("--seed", type=int, default=SEED)
  args = parser.parse_args(argv)
  if args.rows < 2:
    raise ValueError(f"--rows={args.rows} must be >= 2 (standard errors).")
  results = run(task=args.task, temperatures=[float(t) for t in args.temperatures.split(",")],
                rows=args.rows, train_rows=args.train_rows, epochs=args.epochs, seed=args.seed,
                sizes=args.sizes, log=log)
  summary(results, log)
  report.write_json(args.out, results)
  figure = plot(results, os.path.splitext(args.out)[0] + ".png")
  log(f"wrote {args.out} and {figure}")
  return results


def _fast_cpu_compile() -> None:
  """As `mdjax.bench.parallelism` does on the CPU (the sweep is compile-bound: dozens of tiny
  programs, each run once): LLVM at -O0 and, on jaxlib 0.10, XLA:CPU's elemental emitters.
  The points are exact draws, not timings: they come out the same. Flags given stand."""
  import importlib.metadata
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_backend_optimization_level" not in flags:
    flags += " --xla_backend_optimization_level=0"
  if ("--xla_cpu_use_fusion_emitters" not in flags
      and importlib.metadata.version("jaxlib").startswith("0.10.")):
    flags += " --xla_cpu_use_fusion_emitters=false"
  os.environ["XLA_FLAGS"] = flags.strip()


if __name__ == "__main__":
  if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    _fast_cpu_compile()
  main()
