"""Trained accelerators against the training-free samplers, measured exactly on an oracle task.

`python -m mdjax.bench.accelerators` writes results/accelerators.json and its figure
(docs/accelerators.md reads them). On one exact oracle task (sudoku4 by default), every
point with accuracy (the task's exact validity) and TPF (tokens per forward at batch size 1)
with standard errors, in results/parallelism.json's point schema plus `method`, `trained`,
`teacher` (the denoiser the sampler or the student derives from) and `temperature`:

- teacher "oracle", the task's exact denoiser (no learning error; the ceiling), at each
  temperature: Learn2PD's filter trained on its rollouts (`learned_commit`, trained: true),
  the training-free families (confidence thresholds, entropy-bounded, confidence and
  ancestral at fixed steps), and the oracle the filter imitates (`egp_oracle`, which reads
  the teacher's answer: a ceiling, not a sampler); on sudoku4 at temperature 0 UPO's learned
  order policy and its untrained start (`mdjax.bench.order_policy`);
- teacher "trained", a model trained here (configs/sudoku4_teacher.py, fixed seed), at
  temperature 0 (the references' greedy setting): the same training-free families and a
  Learn2PD filter on it, its students distilled by 'dparallel', 'd3llm' and 'cdlm'
  (configs/distill_*.py), each decoded with the same confidence thresholds (trained: true),
  CDLM's block-causal one block by block with the exact cache of the finished blocks.

Then AUP per method, and each trained point against the training-free frontier of its own
teacher (`mdjax.accelerators.frontier`): at equal calls (accuracy difference in standard
errors), at equal accuracy (`speedup`, the frontier's calls over the point's), and against
the exact denoiser's frontier at equal calls (`to_exact`). Last, `combined_ratio`: the best
student with a threshold and the KV cache against the teacher one token a step uncached, at
equal exact accuracy, in wall time and in denoiser calls, timed side by side. Fixed seeds;
the models train from scratch unless --workdir holds finished runs; --only=cdlm computes
that student's rows again into the file (the teacher in --workdir checked to be its own).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import tempfile
import time
from typing import Sequence

import jax
import numpy as np

from mdjax import files, report, sampling
from mdjax.accelerators import cdlm, distill, frontier, learn2pd
from mdjax.bench import order_policy as order_policy_bench
from mdjax.bench import parallelism as bench
from mdjax.bench.accelerator_points import (ORACLE, TRAINED, Method, filter_methods,
                                            free_methods, measure, student_points, with_model)

SEED = 0
STUDENTS = distill.NAMES + (cdlm.NAME,)  # the bidirectional ones, then the block-causal


def oracle_point(ot: bench.OracleTask, canvas: np.ndarray, seed: int, temperature: float,
                 cfg: learn2pd.FilterConfig, teacher: str) -> dict:
  """The imitated oracle on the evaluation prompts: the teacher's answer, then commits of the
  proposals equal to it (it reads the answer: a ceiling, not a sampler)."""
  fixed = np.zeros(canvas.shape, bool)
  fixed[:, :ot.prompt_length] = True
  keys = learn2pd.stream_keys(seed)
  answer = sampling.sample(ot.denoiser, ot.denoiser_params, keys["teacher"], canvas,
                           learn2pd.teacher_spec(ot.generated, cfg), fixed,
                           mask_id=ot.task.mask_id)
  final = np.asarray(answer.tokens_BxL)
  bound = sampling.BoundDenoiser(sampling.Denoiser.of(ot.denoiser), ot.denoiser_params)
  out = learn2pd.oracle_examples(bound, canvas, fixed, final, keys["oracle"],
                                 mask_id=ot.task.mask_id, width=ot.generated, blocks=False,
                                 temperature=temperature, num_steps=ot.generated,
                                 max_block_steps=4 * ot.generated)
  valid = ot.valid(final).astype(np.float64)
  calls = out["steps_B"].astype(np.float64)
  rows, acc, mean_calls = len(valid), float(valid.mean()), float(calls.mean())
  return {"task": ot.name, "family": "egp_oracle", "method": "egp_oracle", "trained": False,
          "uses_answer": True, "teacher": teacher, "temperature": temperature, "knobs": {},
          "rows": rows, "generated": ot.generated, "accuracy": acc,
          "accuracy_se": math.sqrt(acc * (1 - acc) / rows),
          "tpf": ot.generated / mean_calls,
          "tpf_se": ot.generated * float(calls.std(ddof=1)) / (math.sqrt(rows) * mean_calls**2),
          "mean_forwards": mean_calls}


def teacher_sweep(ot: bench.OracleTask, canvas: np.ndarray, temperature: float, teacher: str,
                  *, train_rows: int, epochs: int, seed: int, sizes: str, log) -> tuple:
  """On one teacher at one temperature: Learn2PD's filter trained on its rollouts, then the
  filter's points, the training-free points and the imitated oracle: (points, filter)."""
  cfg = learn2pd.FilterConfig(rows=train_rows, temperature=float(temperature), epochs=epochs,
                              seed=seed)
  train_canvas, train_fixed = learn2pd.prompts(ot.task, train_rows, ot.prompt_length,
                                               learn2pd.stream_keys(seed)["prompts"])
  filt, info = learn2pd.train_filter(ot.denoiser, ot.denoiser_params, train_canvas,
                                     train_fixed, cfg, mask_id=ot.task.mask_id,
                                     vocab_size=ot.task.vocab_size, log=log)
  n = ot.generated
  points = [measure(ot, m, canvas, seed, float(temperature), teacher)
            for m in filter_methods(n, filt, float(temperature), sizes)
            + free_methods(n, float(temperature), sizes)]
  points.append(oracle_point(ot, canvas, seed, float(temperature), cfg, teacher))
  return points, {"filter": repr(filt), "teacher": teacher, **info}


# ----------------------------------------------------------------------------
# The teacher and its students, trained here.
# ----------------------------------------------------------------------------


def _configs():
  """configs/ (at the repository root) importable."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if root not in sys.path:
    sys.path.insert(0, root)
  modules = dict(teacher="sudoku4_teacher", dparallel="distill_dparallel",
                 d3llm="distill_d3llm", cdlm="distill_cdlm")
  return {name: importlib.import_module(f"configs.{m}") for name, m in modules.items()}


def _finished(workdir: str, num_steps: int) -> bool:
  """Whether `workdir` holds a run's checkpoint at `num_steps`."""
  from mdjax.train import state_io
  return (os.path.isdir(os.path.join(workdir, "checkpoints")) and num_steps in
          state_io.step_dirs(state_io.checkpoint_manager(workdir, read_only=True)))


def _train(config, workdir: str, log) -> dict:
  """Trains `config` in `workdir` (a finished run there is only loaded, without building its
  loss: a student's teacher pool is the teacher's decodings): its record."""
  from mdjax import train
  started = time.perf_counter()
  if not _finished(workdir, config.train.num_steps):
    train.train(config, workdir, log=lambda *a: None)
  seconds = time.perf_counter() - started
  trained = train.read_train_seconds(workdir)
  log(f"trained {config.objective}: {workdir} ({config.train.num_steps} steps, {trained or 0:.0f} s "
      f"of training; {seconds:.0f} s in this call)")
  # train_seconds: the run's own training clock (its cost, wherever it was trained);
  # this_run_seconds: this call's (a finished run is only loaded).
  record = {"objective": config.objective, "steps": config.train.num_steps,
            "batch_size": config.batch_size, "train_seconds": trained,
            "this_run_seconds": seconds,
            "model": {k: v for k, v in config.model.to_dict().items() if v is not None}}
  if "distill" in config:  # a student: how many of the teacher's decodings it learned from
    record["num_prompts"] = config.distill.num_prompts
  return record


def train_models(root: str, *, seed: int, teacher_steps: int | None, student_steps: int | None,
                 students: Sequence[str] = STUDENTS, student_prompts: int | None = None,
                 log=print) -> dict:
  """The teacher (configs/sudoku4_teacher.py) and its students (configs/distill_*.py, from
  the teacher, the teacher's own rollouts; `student_prompts` of them, None the configs'
  3,200): {name: (Model, record)}."""
  import mdjax
  cfgs = _configs()
  config = cfgs["teacher"].get_config()
  config.seed = seed
  if teacher_steps:
    config.train.num_steps = teacher_steps
    config.checkpoint.every = teacher_steps
  teacher_dir = os.path.join(root, "teacher")
  models = {"teacher": (None, _train(config, teacher_dir, log))}
  for name in students:
    config = cfgs[name].get_config()
    config.seed = seed
    config.train.init_from = teacher_dir
    config.distill.teacher = teacher_dir
    config.eval_at_end = False
    if student_steps:
      config.train.num_steps = student_steps
      config.checkpoint.every = student_steps
    if student_prompts:
      config.distill.num_prompts = student_prompts
    models[name] = (None, _train(config, os.path.join(root, name), log))
  return {name: (mdjax.load(os.path.join(root, name)), record)
          for name, (_, record) in models.items()}


# ----------------------------------------------------------------------------
# The combined figure.
# ----------------------------------------------------------------------------


def _seconds(run, repeats: int) -> float:
  """The median wall time of `run()` (it blocks until its result is ready)."""
  times = []
  for _ in range(repeats):
    started = time.perf_counter()
    run()
    times.append(time.perf_counter() - started)
  return float(np.median(times))


def _within(rec: dict, base: dict) -> bool:
  """Equal accuracy: not below the baseline's by more than 2 standard errors of the
  difference."""
  return rec["accuracy"] >= base["accuracy"] - 2 * math.hypot(base["accuracy_se"],
                                                              rec["accuracy_se"])


COMBINED_THRESHOLDS = (0.9, 0.99, 0.999, 0.9999)  # searched upwards: fewest calls first


def combined(teacher_ot: bench.OracleTask, students: dict, points: list[dict],
             canvas: np.ndarray, seed: int, *, repeats: int = 5, latency_rows: int = 32,
             thresholds: Sequence[float] = COMBINED_THRESHOLDS, labels: Sequence[str] | None = None,
             previous: dict | None = None, log=print) -> dict:
  """The best bidirectional student (most AUP at temperature 0) with a confidence threshold,
  with the dual KV cache and without it, and the block-causal student (CDLM's, when given)
  block by block with the exact cache, against the teacher one position a step, uncached:
  for each, the lowest threshold of `thresholds` whose accuracy is within 2 standard errors
  of the teacher's; then each timed side by side with the baseline (interleaved, median of
  `repeats`) on all rows in one batch and on `latency_rows` rows one at a time (batch size
  1, where TPF is counted). The teacher's own threshold (no training) found the same way is
  the training-free reference; `exact_cache`: the block-causal student at its reference's
  threshold with the exact cache against itself without it. `labels`: only these
  variants, the others kept from `previous` (a former result)."""
  n = teacher_ot.generated
  here = [p for p in points if p["teacher"] == TRAINED and p["temperature"] == 0.0]
  aup = frontier.aup_by_method(here)[teacher_ot.name][TRAINED]["0.0"]
  name = max(distill.NAMES, key=lambda s: aup.get(s, -1.0))
  spec_of = lambda tau, kv, block: sampling.ConfidenceSpec(
      steps=n, threshold=tau, temperature=0.0, kv_cache=kv, block_length=block)
  candidates = [("none", name, "none", None), ("dual", name, "dual", n),
                ("teacher_threshold", "teacher", "none", None)]
  if cdlm.NAME in students:
    block = students[cdlm.NAME].denoiser.block_size
    candidates.append(("exact", cdlm.NAME, "exact", block))
  base_spec = sampling.ConfidenceSpec(steps=n, score="prob", count_rule="even", temperature=0.0)
  base = measure(teacher_ot, Method("teacher", (("steps", n),), base_spec, False), canvas, seed,
                 0.0, TRAINED)
  out = dict(previous or {}, student=name, baseline=base, repeats=repeats,
             latency_rows=latency_rows, thresholds=list(thresholds))
  out["variants"] = dict(out.get("variants") or {})
  tried = [r for r in out.get("searched") or [] if labels is not None
           and r["variant"] not in labels]
  searched = {}
  for label, method, kv, block in candidates:
    if labels is not None and label not in labels:
      continue
    ot = teacher_ot if method == "teacher" else with_model(teacher_ot, students[method])
    knobs = (("block_length", block),) if block and block < n else ()
    for tau in thresholds:
      spec = spec_of(tau, kv, block)
      rec = measure(ot, Method(method, (("threshold", tau), ("kv_cache", kv)) + knobs, spec,
                               method != "teacher"), canvas, seed, 0.0, TRAINED)
      tried.append(dict(rec, variant=label))
      if _within(rec, base):
        searched[label] = (ot, spec, rec)
        break
  out["searched"] = tried
  key = jax.random.key(seed)

  def runner(ot, spec, rows):
    return lambda: np.asarray(sampling.sample(ot.denoiser, ot.denoiser_params, key, rows, spec,
                                              mask_id=ot.task.mask_id).tokens_BxL)

  latency_rows = min(latency_rows, len(canvas))

  def one_by_one(ot, spec):
    calls = [runner(ot, spec, canvas[i:i + 1]) for i in range(latency_rows)]
    return lambda: [c() for c in calls]

  def paired(slow_ot, slow_spec, ot, spec):
    seconds = {}
    for size, (slow, fast) in {
        "batch": (runner(slow_ot, slow_spec, canvas), runner(ot, spec, canvas)),
        "batch1": (one_by_one(slow_ot, slow_spec), one_by_one(ot, spec))}.items():
      slow(), fast()  # compiled and warm
      pairs = [(_seconds(slow, 1), _seconds(fast, 1)) for _ in range(repeats)]
      seconds[size] = {"baseline": float(np.median([a for a, _ in pairs])),
                       "combined": float(np.median([b for _, b in pairs]))}
    return seconds

  if cdlm.NAME in students and (labels is None or "exact" in labels):
    ot, tau = with_model(teacher_ot, students[cdlm.NAME]), cdlm.THRESHOLD
    bare, cached = (spec_of(tau, kv, block) for kv in ("none", "exact"))
    seconds = paired(ot, bare, ot, cached)
    out["exact_cache"] = {"threshold": tau, "block_length": block, "seconds": seconds,
                          "same_tokens": bool((runner(ot, bare, canvas)()
                                               == runner(ot, cached, canvas)()).all()),
                          **{f"wall_ratio_{k}": v["baseline"] / v["combined"]
                             for k, v in seconds.items()}}
  for label, (ot, spec, rec) in searched.items():
    seconds = paired(teacher_ot, base_spec, ot, spec)
    variant = {"model": rec["method"], "kv_cache": spec.kv_cache, "threshold": spec.threshold,
               "block_length": spec.block_length, "point": rec, "seconds": seconds,
               "calls_ratio": base["mean_forwards"] / rec["mean_forwards"],
               "wall_ratio_batch": seconds["batch"]["baseline"] / seconds["batch"]["combined"],
               "wall_ratio_batch1": (seconds["batch1"]["baseline"]
                                     / seconds["batch1"]["combined"])}
    out["variants"][label] = variant
    log(f"combined: {rec['method']} threshold {spec.threshold}, kv_cache {spec.kv_cache}, "
        f"block {spec.block_length}: accuracy {rec['accuracy']:.3f} ± {rec['accuracy_se']:.3f} "
        f"at {rec['mean_forwards']:.2f} calls; teacher one a step {base['accuracy']:.3f} ± "
        f"{base['accuracy_se']:.3f}: calls {variant['calls_ratio']:.2f}x, wall "
        f"{variant['wall_ratio_batch1']:.2f}x at batch 1, {variant['wall_ratio_batch']:.2f}x "
        f"at batch {len(canvas)}")
  if any(k != "teacher_threshold" for k in out["variants"]):
    label, best = max(((k, v) for k, v in out["variants"].items() if k != "teacher_threshold"),
                      key=lambda kv: kv[1]["wall_ratio_batch1"])
    out.update(best=best["kv_cache"], best_variant=label, calls_ratio=best["calls_ratio"],
               wall_ratio_batch1=best["wall_ratio_batch1"],
               wall_ratio_batch=best["wall_ratio_batch"])
  return out


# ----------------------------------------------------------------------------
# The bench.
# ----------------------------------------------------------------------------


def run(*, task: str = "sudoku4", temperatures: Sequence[float] = (0.0, 1.0), rows: int = 1000,
        train_rows: int = 2000, epochs: int = 4000, seed: int = SEED, sizes: str = "full",
        teacher_steps: int | None = None, student_steps: int | None = None,
        student_prompts: int | None = None, workdir: str | None = None, log=print) -> dict:
  """The whole bench as one dict (results/accelerators.json). teacher_steps 0: no trained
  teacher (the oracle's part alone)."""
  started = time.perf_counter()
  by_name = {t.name: t for t in bench.oracle_tasks("full")}
  by_name.update({t.name: t for t in bench.oracle_tasks(sizes)})  # tiny: the smaller ones
  if task not in by_name:
    raise ValueError(f"task={task!r} must be one of {sorted(by_name)} (sizes={sizes!r}).")
  ot = by_name[task]
  canvas = bench.canvas_of(ot, rows, seed)  # results/parallelism.json's prompts
  points, filters, trained, combined_out = [], {}, None, None
  sweep = dict(train_rows=train_rows, epochs=epochs, seed=seed, sizes=sizes, log=log)
  for temperature in temperatures:
    t0 = time.perf_counter()
    pts, filters[f"{ORACLE} {float(temperature)}"] = teacher_sweep(ot, canvas, temperature,
                                                                   ORACLE, **sweep)
    points += pts
    log(f"{ot.name} oracle T={temperature}: {len(pts)} points ({time.perf_counter() - t0:.0f} s)")
  if task == "sudoku4" and 0.0 in temperatures:  # UPO's learned order: bench/order_policy.py
    points += [dict(p, teacher=ORACLE) for p in order_policy_bench.accelerator_points(
        ot, canvas, seed, sizes, log)]
  if teacher_steps != 0:
    if task != "sudoku4":
      raise ValueError(f"task={task!r}: the trained teacher is sudoku4's "
                       "(configs/sudoku4_teacher.py); --teacher_steps=0 runs the oracle alone.")
    with tempfile.TemporaryDirectory() as tmp:
      models = train_models(workdir or tmp, seed=seed, teacher_steps=teacher_steps,
                            student_steps=student_steps, student_prompts=student_prompts,
                            log=log)
      teacher_ot = with_model(ot, models["teacher"][0])
      t0 = time.perf_counter()
      pts, filters[f"{TRAINED} 0.0"] = teacher_sweep(teacher_ot, canvas, 0.0, TRAINED, **sweep)
      points += pts
      for name in STUDENTS:
        points += student_points(ot, models[name][0], name, canvas, seed, sizes)
      log(f"{ot.name} trained teacher and students: ({time.perf_counter() - t0:.0f} s)")
      combined_out = combined(teacher_ot, {s: models[s][0] for s in STUDENTS}, points, canvas,
                              seed, repeats=3 if sizes == "tiny" else 5, log=log,
                              thresholds=(0.9,) if sizes == "tiny" else COMBINED_THRESHOLDS)
      trained = {name: record for name, (_, record) in models.items()}
  return {
      "config": {"seed": seed, "rows": rows, "train_rows": train_rows, "epochs": epochs,
                 "sizes": sizes, "task": task, "temperatures": [float(t) for t in temperatures],
                 "trained_temperatures": [0.0] if trained else [],
                 "generated": ot.generated, "prompt_length": ot.prompt_length,
                 "jax": jax.__version__, "backend": jax.default_backend()},
      "models": trained,
      "filters": filters,
      "points": points,
      "aup": frontier.aup_by_method(points),
      "equal_calls": frontier.equal_calls(points, ORACLE),
      "combined": combined_out,
      "combined_ratio": (combined_out or {}).get("wall_ratio_batch1"),
      "combined_calls_ratio": (combined_out or {}).get("calls_ratio"),
      "seconds": time.perf_counter() - started,
  }


ONLY = (cdlm.NAME,)  # the students `--only` trains (or loads) and measures again


def update(path: str, names: Sequence[str], *, workdir: str | None,
           student_steps: int | None = None, log=print) -> dict:
  """The file's results with the students `names` (points, model records, combined
  variants) computed again, AUP and equal calls recomputed, the rest kept. The teacher in
  `workdir` must be the file's: its threshold-0.9 point is measured again to the bit."""
  if set(names) - set(ONLY):
    raise ValueError(f"--only={','.join(names)}: not students it computes again ({ONLY}).")
  started, results = time.perf_counter(), files.read_json(path)
  cfg = results["config"]
  ot = {t.name: t for t in bench.oracle_tasks("full")}[cfg["task"]]
  canvas, seed = bench.canvas_of(ot, cfg["rows"], cfg["seed"]), cfg["seed"]
  with tempfile.TemporaryDirectory() as tmp:
    models = train_models(workdir or tmp, seed=seed, students=names, log=log,
                          teacher_steps=results["models"]["teacher"]["steps"],
                          student_steps=student_steps)
    teacher_ot = with_model(ot, models["teacher"][0])
    again = measure(teacher_ot, free_methods(ot.generated, 0.0, "full")[1], canvas, seed, 0.0,
                    TRAINED)
    if [(p["accuracy"], p["mean_forwards"]) for p in results["points"]
        if p["teacher"] == TRAINED and p["method"] == again["method"]
        and p["knobs"] == again["knobs"]] != [(again["accuracy"], again["mean_forwards"])]:
      raise ValueError(f"the teacher in {workdir} is not the one {path} was measured on "
                       "(its threshold-0.9 point differs); regenerate the whole file.")
    points = [p for p in results["points"] if p["method"] not in names]
    for name in names:
      points += student_points(ot, models[name][0], name, canvas, seed, cfg["sizes"])
      results["models"][name] = models[name][1]
    results["combined"] = combined(
        teacher_ot, {s: models[s][0] for s in names}, points, canvas, seed,
        repeats=results["combined"]["repeats"], thresholds=results["combined"]["thresholds"],
        labels=("exact", "blocks"), previous=results["combined"], log=log)
  results.update(points=points, aup=frontier.aup_by_method(points),
                 equal_calls=frontier.equal_calls(points, ORACLE),
                 combined_ratio=results["combined"].get("wall_ratio_batch1"),
                 combined_calls_ratio=results["combined"].get("calls_ratio"),
                 updated={"only": list(names), "seconds": time.perf_counter() - started})
  return results


def table(results: dict) -> str:
  """The points as a markdown table, grouped by teacher and temperature."""
  lines = ["| teacher | T | method | knobs | trained | accuracy | TPF |",
           "|---|---|---|---|---|---|---|"]
  for p in results["points"]:
    knobs = ", ".join(f"{k}={v}" for k, v in p["knobs"].items())
    lines.append(f"| {p['teacher']} | {p['temperature']:g} | {p['method']} | {knobs} | "
                 f"{str(p['trained']).lower()} | {p['accuracy']:.3f} ± {p['accuracy_se']:.3f} | "
                 f"{p['tpf']:.2f} ± {p['tpf_se']:.2f} |")
  return "\n".join(lines) + "\n"


def summary(results: dict, log=print) -> None:
  """The figures a reader checks first."""
  log(table(results))
  for row in results["equal_calls"]:
    free = row["training_free"]
    head = (f"[{row['teacher']} T={row['temperature']:g}] {row['learned']}: "
            f"{row['accuracy']:.3f} ± {row['accuracy_se']:.3f} at {row['mean_forwards']:.3f} "
            "calls; ")
    if free is None:
      log(head + "no training-free point is that cheap")
      continue
    speed = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
    exact = row.get("to_exact")
    log(head + f"training-free {free['accuracy']:.3f} ({' + '.join(free['between'])}), "
        f"z {row['z']:+.1f}; speedup at equal accuracy {speed}"
        + ("" if exact is None else f"; exact frontier {exact['accuracy']:.3f} "
           f"(z {exact['z']:+.1f})"))
  for task, teachers in results["aup"].items():
    for teacher, temps in teachers.items():
      for temperature, per in temps.items():
        log(f"AUP {task} [{teacher}] T={temperature}: " + ", ".join(
            f"{m} {v:.0f}" for m, v in sorted(per.items(), key=lambda kv: -kv[1])))
  if results.get("combined_ratio"):
    log(f"combined_ratio (wall, batch 1) {results['combined_ratio']:.2f}; calls "
        f"{results['combined_calls_ratio']:.2f}")
  log(f"total {results['seconds']:.0f} s")


def plot(results: dict, path: str) -> str:
  """Accuracy against tokens per forward, one panel per (teacher, temperature): each
  method's points with standard errors (trained methods filled, training-free hollow), the
  answer-reading oracle a star."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  points = results["points"]
  panels = sorted({(p["teacher"], p["temperature"]) for p in points})
  fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False,
                           sharey=True)
  methods = sorted({p["method"] for p in points})
  colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
  for ax, (teacher, temperature) in zip(axes.flat, panels):
    here = [p for p in points if (p["teacher"], p["temperature"]) == (teacher, temperature)]
    for method in sorted({p["method"] for p in here}):
      pts = sorted((p for p in here if p["method"] == method), key=lambda p: p["tpf"])
      color, trained = colors[method], pts[0]["trained"]
      marker = "*" if method == "egp_oracle" else "o"
      ax.errorbar([p["tpf"] for p in pts], [p["accuracy"] for p in pts],
                  xerr=[p["tpf_se"] for p in pts], yerr=[p["accuracy_se"] for p in pts],
                  ls="-" if trained else ":", marker=marker, ms=8 if marker == "*" else 4,
                  mfc=color if trained else "none", color=color, lw=1, capsize=2,
                  label=f"{method}{' (trained)' if trained else ''}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per forward (mean, log scale)")
    ax.set_title(f"{here[0]['task']}, teacher {teacher}, temperature {temperature:g}")
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
  parser.add_argument("--temperatures", default="0,1", help="the oracle's, comma-separated")
  parser.add_argument("--rows", type=int, default=1000)
  parser.add_argument("--train_rows", type=int, default=2000)
  parser.add_argument("--epochs", type=int, default=4000)
  parser.add_argument("--sizes", default="full", choices=("full", "tiny"))
  parser.add_argument("--seed", type=int, default=SEED)
  parser.add_argument("--teacher_steps", type=int, default=None,
                      help="the teacher's training steps (default: its config's; 0: no "
                      "trained teacher)")
  parser.add_argument("--student_steps", type=int, default=None,
                      help="each student's steps (default: its config's)")
  parser.add_argument("--student_prompts", type=int, default=None,
                      help="the teacher's decodings each student learns from (default: its "
                      "config's distill.num_prompts, 3,200)")
  parser.add_argument("--workdir", default=None, help="where the teacher and students train "
                      "(finished runs there are loaded); default a temporary folder")
  parser.add_argument("--only", default=None, help="comma-separated students to train (or "
                      f"load) and measure again ({', '.join(ONLY)}) into --out, the rest kept "
                      "as the file has it; the teacher (in --workdir) must be the file's")
  args = parser.parse_args(argv)
  if args.rows < 2:
    raise ValueError(f"--rows={args.rows} must be >= 2 (standard errors).")
  if args.only:
    results = update(args.out, args.only.split(","), workdir=args.workdir,
                     student_steps=args.student_steps, log=log)
  else:
    results = run(task=args.task, temperatures=[float(t) for t in args.temperatures.split(",")],
                  rows=args.rows, train_rows=args.train_rows, epochs=args.epochs,
                  seed=args.seed, sizes=args.sizes, teacher_steps=args.teacher_steps,
                  student_steps=args.student_steps, student_prompts=args.student_prompts,
                  workdir=args.workdir, log=log)
  summary(results, log)
  report.write_json(args.out, results)
  figure = plot(results, os.path.splitext(args.out)[0] + ".png")
  log(f"wrote {args.out} and {figure}")
  return results


if __name__ == "__main__":
  main()
