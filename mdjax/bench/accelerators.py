"""Trained accelerators against the training-free samplers, measured exactly on oracle tasks.

`python -m mdjax.bench.accelerators` writes results/accelerators.json and its figure
(docs/accelerators.md reads them). On each exact oracle task of `--task` (sudoku4 and
ScanAndAdd by default, each run in turn and written into the file, the file's other tasks
kept), every point with accuracy (the task's exact validity) and TPF (tokens per forward at
batch size 1) with standard errors, in results/parallelism.json's point schema plus `method`,
`trained`, `teacher` (the denoiser the sampler or the student derives from) and `temperature`:

- teacher "oracle", the task's exact denoiser (no learning error; the ceiling), at each
  temperature: Learn2PD's filter trained on its rollouts (`learned_commit`, trained: true),
  the training-free families (confidence thresholds, entropy-bounded, confidence and
  ancestral at fixed steps), and the oracle the filter imitates (`egp_oracle`, which reads
  the teacher's answer: a ceiling, not a sampler); on sudoku4 at temperature 0 UPO's learned
  order policy and its untrained start (`mdjax.bench.order_policy`);
- teacher "trained", a model trained here (the task's config, fixed seed:
  `accelerator_models.SETTINGS`), at the task's temperature (sudoku4 greedily, the
  references' setting; ScanAndAdd, permutation and the list tasks at 1, their laws'): the
  same training-free families and a Learn2PD filter on it, its students distilled by
  'dparallel', 'd3llm' and 'cdlm' (configs/distill_*.py), each decoded with the same
  confidence thresholds (trained: true), CDLM's block-causal one block by block with the
  exact cache of the finished blocks; on sudoku4 UPO's order policy trained on this teacher.

Then AUP per method, and each trained point against the training-free frontier of its own
teacher (`mdjax.accelerators.frontier`): at equal calls (accuracy difference in standard
errors), at equal accuracy (`speedup`, the frontier's calls over the point's), and against
the exact denoiser's frontier at equal calls (`to_exact`). Last, per task, the combined
figure (`mdjax.bench.accelerator_combined`); the file's `combined_ratio` is the largest over
its tasks (`combined_task`). The file's first task keeps its own keys at the top level
(config, models, filters, combined), the others' are under `tasks`. Fixed seeds; the models
train from scratch unless --workdir holds finished runs; --only=cdlm (that student) or
--only=order_policy (the learned order) computes those rows of the file's first task on its
trained teacher again (the teacher in --workdir checked to be its own).
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from typing import Sequence

import jax
import numpy as np

from mdjax import files, report, sampling
from mdjax.accelerators import cdlm, frontier, learn2pd
from mdjax.bench import accelerator_models as trained_models
from mdjax.bench import order_policy as order_policy_bench
from mdjax.bench import parallelism as bench
from mdjax.bench.accelerator_combined import COMBINED_THRESHOLDS, combined
from mdjax.bench.accelerator_points import (ORACLE, TRAINED, filter_methods, free_methods,
                                            measure, student_points, with_model)
from mdjax.bench.accelerator_models import STUDENTS

SEED = 0


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


def order_points(ot: bench.OracleTask, canvas: np.ndarray, seed: int, sizes: str,
                 teacher: str, log) -> list[dict]:
  """UPO's learned order (`mdjax.bench.order_policy`) trained on the frozen `teacher` and its
  untrained start, at temperature 0 on the evaluation prompts."""
  return [dict(p, teacher=teacher)
          for p in order_policy_bench.accelerator_points(ot, canvas, seed, sizes, log)]


# ----------------------------------------------------------------------------
# The bench.
# ----------------------------------------------------------------------------


def run(*, task: str = "sudoku4", temperatures: Sequence[float] | None = None,
        rows: int = 1000, train_rows: int = 2000, epochs: int = 4000, seed: int = SEED,
        sizes: str = "full", teacher_steps: int | None = None, student_steps: int | None = None,
        student_prompts: int | None = None, workdir: str | None = None, log=print) -> dict:
  """One task's bench as one dict (results/accelerators.json's form). temperatures: the
  oracle's (None: the task's setting, `accelerator_models.SETTINGS`); teacher_steps 0: no
  trained teacher (the oracle's part alone); the models train in `workdir`/<task>."""
  started = time.perf_counter()
  by_name = {t.name: t for t in bench.oracle_tasks("full")}
  by_name.update({t.name: t for t in bench.oracle_tasks(sizes)})  # tiny: the smaller ones
  if task not in by_name:
    raise ValueError(f"task={task!r} must be one of {sorted(by_name)} (sizes={sizes!r}).")
  task_setting = trained_models.setting(task) if teacher_steps != 0 else None
  if temperatures is None:  # a task without a trained setting: both
    temperatures = getattr(trained_models.SETTINGS.get(task), "oracle_temperatures", (0.0, 1.0))
  ot = by_name[task]
  if task_setting is not None:
    trained_models.check_sizes(task_setting, ot.task)
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
    points += order_points(ot, canvas, seed, sizes, ORACLE, log)
  if task_setting is not None:
    temperature = task_setting.temperature
    with tempfile.TemporaryDirectory() as tmp:
      models = trained_models.train_models(
          os.path.join(workdir or tmp, task), task, seed=seed, prompt_length=ot.prompt_length,
          generated=ot.generated, teacher_steps=teacher_steps, student_steps=student_steps,
          student_prompts=student_prompts, log=log)
      teacher_ot = with_model(ot, models["teacher"][0])
      t0 = time.perf_counter()
      pts, filters[f"{TRAINED} {temperature}"] = teacher_sweep(teacher_ot, canvas, temperature,
                                                              TRAINED, **sweep)
      points += pts
      for name in STUDENTS:
        points += student_points(ot, models[name][0], name, canvas, seed, sizes, temperature)
      if task == "sudoku4" and temperature == 0.0:  # the learned order on the trained teacher
        points += order_points(teacher_ot, canvas, seed, sizes, TRAINED, log)
      log(f"{ot.name} trained teacher and students: ({time.perf_counter() - t0:.0f} s)")
      combined_out = combined(teacher_ot, {s: models[s][0] for s in STUDENTS}, points, canvas,
                              seed, repeats=3 if sizes == "tiny" else 5, log=log,
                              thresholds=(0.9,) if sizes == "tiny" else COMBINED_THRESHOLDS,
                              temperature=temperature)
      trained = {name: record for name, (_, record) in models.items()}
  return {
      "config": {"seed": seed, "rows": rows, "train_rows": train_rows, "epochs": epochs,
                 "sizes": sizes, "task": task, "temperatures": [float(t) for t in temperatures],
                 "trained_temperatures": [task_setting.temperature] if trained else [],
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


PER_TASK = ("config", "models", "filters", "combined", "combined_ratio", "combined_calls_ratio",
            "seconds")  # a task's own keys: the file's first task's at the top, others' in `tasks`


def merged(previous: dict | None, results: dict) -> dict:
  """One task's `results` in the file `previous` holds (None: a new file, this task its
  first): that task's points, AUP and equal-calls rows replaced and the other tasks' kept; the
  file's first task's own keys (`PER_TASK`) at the top level as before, every other task's
  under `tasks`; `combined_ratio` and `combined_calls_ratio` the largest wall-time ratio over
  the tasks, `combined_task` naming its task."""
  task = results["config"]["task"]
  if previous is None or previous["config"]["task"] == task:
    out = dict(results, tasks=dict((previous or {}).get("tasks") or {}))
    out["tasks"].pop(task, None)
  else:
    out = dict(previous, tasks=dict(previous.get("tasks") or {}))
    out["tasks"][task] = {k: results[k] for k in PER_TASK}
  if previous is not None:
    kept = lambda rows: [r for r in rows if r["task"] != task]
    out["points"] = kept(previous["points"]) + results["points"]
    out["equal_calls"] = kept(previous["equal_calls"]) + results["equal_calls"]
    out["aup"] = dict(previous["aup"], **results["aup"])
  return with_combined_ratio(out)


def with_combined_ratio(results: dict) -> dict:
  """The file with its top-level `combined_ratio` the largest over its tasks."""
  first = results["config"]["task"]
  per_task = {first: results["combined"], **{t: r["combined"]
                                            for t, r in (results.get("tasks") or {}).items()}}
  ratios = {t: c for t, c in per_task.items() if c and c.get("wall_ratio_batch1")}
  if not ratios:
    return dict(results, combined_ratio=None, combined_calls_ratio=None, combined_task=None)
  best = max(ratios, key=lambda t: ratios[t]["wall_ratio_batch1"])
  return dict(results, combined_ratio=ratios[best]["wall_ratio_batch1"],
              combined_calls_ratio=ratios[best]["calls_ratio"], combined_task=best)


ORDER_POLICY = "order_policy"
# What `--only` computes again on the trained teacher: a student (trained or loaded), or
# sudoku4's learned order (the policy trained again); each with the methods it writes.
ONLY = {cdlm.NAME: (cdlm.NAME,), ORDER_POLICY: (ORDER_POLICY, "order_policy_untrained")}


def update(path: str, names: Sequence[str], *, workdir: str | None,
           student_steps: int | None = None, log=print) -> dict:
  """The file's results with `names` (`ONLY`) of its first task on the trained teacher
  computed again (a student: its points, model record and combined variants; the learned
  order: its points), AUP and equal calls recomputed, the rest kept. The teacher in
  `workdir`/<task> must be the file's: its threshold-0.9 point is measured again to the
  bit."""
  if set(names) - set(ONLY):
    raise ValueError(f"--only={','.join(names)}: not what it computes again ({sorted(ONLY)}).")
  started, results = time.perf_counter(), files.read_json(path)
  cfg = results["config"]
  task, temperature = cfg["task"], trained_models.setting(cfg["task"]).temperature
  if ORDER_POLICY in names and (task, temperature) != ("sudoku4", 0.0):
    raise ValueError(f"--only={ORDER_POLICY}: the learned order is trained on sudoku4 at "
                     f"temperature 0; {path}'s first task is {task!r} at {temperature}.")
  students = [n for n in names if n in STUDENTS]
  ot = {t.name: t for t in bench.oracle_tasks("full")}[task]
  canvas, seed = bench.canvas_of(ot, cfg["rows"], cfg["seed"]), cfg["seed"]
  with tempfile.TemporaryDirectory() as tmp:
    models = trained_models.train_models(
        os.path.join(workdir or tmp, task), task, seed=seed, students=students, log=log,
        prompt_length=ot.prompt_length, generated=ot.generated,
        teacher_steps=results["models"]["teacher"]["steps"], student_steps=student_steps)
    teacher_ot = with_model(ot, models["teacher"][0])
    again = measure(teacher_ot, free_methods(ot.generated, temperature, "full")[1], canvas,
                    seed, temperature, TRAINED)
    if [(p["accuracy"], p["mean_forwards"]) for p in results["points"]
        if p["teacher"] == TRAINED and p["task"] == task and p["method"] == again["method"]
        and p["knobs"] == again["knobs"]] != [(again["accuracy"], again["mean_forwards"])]:
      raise ValueError(f"the teacher in {workdir} is not the one {path} was measured on "
                       "(its threshold-0.9 point differs); regenerate the whole file.")
    replaced = {m for name in names for m in ONLY[name]}
    points = [p for p in results["points"] if not (
        p["task"] == task and p["teacher"] == TRAINED and p["method"] in replaced)]
    for name in students:
      points += student_points(ot, models[name][0], name, canvas, seed, cfg["sizes"],
                               temperature)
      results["models"][name] = models[name][1]
    if ORDER_POLICY in names:
      points += order_points(teacher_ot, canvas, seed, cfg["sizes"], TRAINED, log)
    if students:
      results["combined"] = combined(
          teacher_ot, {s: models[s][0] for s in students}, points, canvas, seed,
          repeats=results["combined"]["repeats"], thresholds=results["combined"]["thresholds"],
          labels=("exact", "blocks"), previous=results["combined"], temperature=temperature,
          log=log)
  results.update(points=points, aup=frontier.aup_by_method(points),
                 equal_calls=frontier.equal_calls(points, ORACLE),
                 updated={"only": list(names), "seconds": time.perf_counter() - started})
  return with_combined_ratio(results)


def table(results: dict) -> str:
  """The points as a markdown table, grouped by task, teacher and temperature."""
  lines = ["| task | teacher | T | method | knobs | trained | accuracy | TPF |",
           "|---|---|---|---|---|---|---|---|"]
  for p in results["points"]:
    knobs = ", ".join(f"{k}={v}" for k, v in p["knobs"].items())
    lines.append(f"| {p['task']} | {p['teacher']} | {p['temperature']:g} | {p['method']} | {knobs} | "
                 f"{str(p['trained']).lower()} | {p['accuracy']:.3f} ± {p['accuracy_se']:.3f} | "
                 f"{p['tpf']:.2f} ± {p['tpf_se']:.2f} |")
  return "\n".join(lines) + "\n"


def summary(results: dict, log=print) -> None:
  """The figures a reader checks first."""
  log(table(results))
  for row in results["equal_calls"]:
    free = row["training_free"]
    head = (f"[{row['task']} {row['teacher']} T={row['temperature']:g}] {row['learned']}: "
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
        f"{results['combined_calls_ratio']:.2f} ({results['combined_task']})")
  seconds = {results["config"]["task"]: results["seconds"],
             **{t: r["seconds"] for t, r in (results.get("tasks") or {}).items()}}
  log("seconds: " + ", ".join(f"{t} {s:.0f}" for t, s in seconds.items()))


def plot(results: dict, path: str) -> str:
  """Accuracy against tokens per forward, one panel per (task, teacher, temperature): each
  method's points with standard errors (trained methods filled, training-free hollow), the
  answer-reading oracle a star."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  points = results["points"]
  panels = sorted({(p["task"], p["teacher"], p["temperature"]) for p in points})
  cols = min(3, len(panels))
  lines = -(-len(panels) // cols)
  fig, axes = plt.subplots(lines, cols, figsize=(6 * cols, 4.2 * lines), squeeze=False,
                           sharey=True)
  methods = sorted({p["method"] for p in points})
  colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
  for ax, panel in zip(axes.flat, panels):
    here = [p for p in points if (p["task"], p["teacher"], p["temperature"]) == panel]
    task, teacher, temperature = panel
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
    ax.set_title(f"{task}, teacher {teacher}, temperature {temperature:g}")
    ax.legend(fontsize=7)
  for ax in axes[:, 0]:
    ax.set_ylabel("accuracy (exact checks)")
  for ax in axes.flat[len(panels):]:
    ax.set_visible(False)
  fig.tight_layout()
  with files.atomic_write(path) as f:
    fig.savefig(f, format="png", dpi=110)
  plt.close(fig)
  return path


def main(argv: Sequence[str] | None = None, log=print) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="results/accelerators.json")
  parser.add_argument("--task", default=",".join(trained_models.SETTINGS),
                      help="comma-separated tasks, each run in turn and written into --out "
                      "(its other tasks kept)")
  parser.add_argument("--temperatures", default=None, help="the oracle's, comma-separated "
                      "(default: each task's, accelerator_models.SETTINGS)")
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
  parser.add_argument("--workdir", default=None, help="where the teachers and students train, "
                      "<workdir>/<task>/<model> (finished runs there are loaded); default a "
                      "temporary folder")
  parser.add_argument("--only", default=None, help="comma-separated parts to compute again "
                      f"on the trained teacher ({', '.join(ONLY)}) into --out, the rest kept "
                      "as the file has it; the teacher (in --workdir) must be the file's")
  args = parser.parse_args(argv)
  if args.rows < 2:
    raise ValueError(f"--rows={args.rows} must be >= 2 (standard errors).")
  temperatures = (None if args.temperatures is None
                  else [float(t) for t in args.temperatures.split(",")])
  if args.only:
    results = update(args.out, args.only.split(","), workdir=args.workdir,
                     student_steps=args.student_steps, log=log)
  for task in [] if args.only else args.task.split(","):
    one = run(task=task, temperatures=temperatures, rows=args.rows, train_rows=args.train_rows,
              epochs=args.epochs, seed=args.seed, sizes=args.sizes,
              teacher_steps=args.teacher_steps, student_steps=args.student_steps,
              student_prompts=args.student_prompts, workdir=args.workdir, log=log)
    # the file as it is now (not as it was when this task started): other runs' writes kept
    results = merged(files.read_json(args.out) if os.path.exists(args.out) else None, one)
    report.write_json(args.out, results)  # each task's results kept as soon as they exist
  summary(results, log)
  report.write_json(args.out, results)
  figure = plot(results, os.path.splitext(args.out)[0] + ".png")
  log(f"wrote {args.out} and {figure}")
  return results


if __name__ == "__main__":
  main()
