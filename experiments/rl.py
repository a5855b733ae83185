"""RL on three exact-check tasks: what each objective after d1 adds, against rejection-sampling
fine-tuning at the same number of rollouts, the exact oracle and the optimum.

  python experiments/rl.py [--workdir=/tmp/mdjax_rl] [--out=results] [--tasks=sudoku4,...]

Three tasks whose exact check is the reward (experiments/rl_tasks.py: their settings, and
how a model is scored), chosen to pull apart the two things RL can teach a parallel decoder.
**Sudoku 4x4** (each cell given with probability 0.7; d1's sampler: low-confidence, 4 cells a
step, temperature 1): the start's own errors dominate (it solves 0.68 one cell a step where
the oracle solves 1.0), so a gain is task knowledge. **list_replace** (n = 6 items of 12, the
output copies the prompt with exactly one item replaced by a marker; 2 decoding steps of 3
positions): the start is near the exact oracle (parallel draws of the marker position collide
or miss), and the optimum 1.0 is reached only by decoding in parallel differently (one agreed
position), so a gain is parallel decoding. **ScanAndAdd** (n = 2 values; the completion
writes the answer and the 3 commands it must agree with; 3 decoding steps): both at once,
the start far from the task (it solves 0.2 at 3 steps and one position a step alike) and the
oracle short of the optimum under 3 steps (0.67).

Per task a small model is trained here by the NELBO (`PRETRAIN`); then every row fine-tunes
it for the task's `rl_steps` steps of `RL` (8 prompts x G = 8 rollouts a step, the same
prompts in every row, one update a step, beta 0, one constant lr): rejection-sampling
fine-tuning (objective 'rft': SFT on the correct rollouts, by the NELBO and by the rollout's
own trajectory), diffu-GRPO with d1's one-step
log-probabilities, with the rollout's own trajectory and with coupled-GRPO's mask pairs, SPG,
wd1, IGPO (diffu-GRPO on the trajectory with hints for groups that all fail) and MDPO. Each
model, the start and the exact oracle are scored on the same EVAL_PROMPTS fresh prompts
(a key no training step reads) with the same sampler key, at the training sampler's steps and
at one position a step: binomial s.e. sqrt(p (1 - p) / n) per figure; a gain's s.e. both
unpaired, sqrt(se_before^2 + se_after^2), and paired, the s.e. of the per-prompt difference
(the same prompts and draws score both); every `eval_every` steps a checkpoint is scored
too (`eval_curve`: is the row still rising?), and the start and each row at colder
temperatures (how much of a gain sharpening alone buys); beside the reward's check, every
check of the task is kept (`start_checks`, `oracle_checks`, `checks_after`: ScanAndAdd's
reward does not look at the number of adds, `add_count_valid` does). Diagnostics (Sudoku):
the start's per-cell against whole-puzzle errors, the reward variance within groups, the
solve rate along the large-batch policy gradient at several step lengths (why the learning
rate matters), and `gradient_snr`: each update's per-batch signal-to-noise and the angles between
their expected gradients. Both RFT rows and diffu-GRPO on the trajectory run again under two
more seeds (`REPEAT_SEEDS`): the spread of runs, beside the evaluation's s.e.; every row
also compares itself with both RFT rows, paired (`vs_rft`, `vs_rft_trajectory`).

Writes results/rl.json (with each run's reward per RL step) and results/rl.png (each row's
solve rate, and at its checkpoints). Fixed seeds; finished runs in the workdir are reused
(`train.train` resumes them), so a second invocation only evaluates. `--tasks=NAME,...`, a
subset, replaces only those tasks' summaries, rows and curves in an existing OUT/rl.json and
keeps the other tasks' as they are (the default, every task, writes it from scratch). The
CPU is 2 cores shared with other jobs; the whole command takes about 1.5 hours of training
there (docs/rl.md gives the times).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mdjax  # noqa: E402
from configs import grpo as grpo_config  # noqa: E402
from configs.base import base_config  # noqa: E402
from experiments.rl_diagnostics import diagnostics  # noqa: E402
from experiments.rl_tasks import (CHECKS, EVAL_PROMPTS, RL, SAMPLER, SEED, TASKS,  # noqa: E402
                                  eval_canvas, fractions, gain, outcomes, rate, solved)
from mdjax import jsonl, report, train  # noqa: E402
from mdjax.rl import trainer  # noqa: E402,F401  (registers the RL objectives)

MODEL = dict(d_model=64, num_layers=2, num_heads=4, d_ff=128)
PRETRAIN = dict(num_steps=600, batch_size=64, lr=3e-3, warmup_steps=100)
# Pilots at 120 Sudoku steps (docs/rl.md), none better than this setting: diffu-GRPO on the
# trajectory 0.483; with lr 3e-4 0.489, with scale_by_std 0.481, with num_iterations 2 0.469
# (RFT with 2: 0.477), on the MC-ELBO 0.465; RFT at 3e-4 0.485 (at 480 steps 0.481: its
# plateau is not the learning rate's).
# One constant learning rate for every row, tuned on Sudoku (docs/rl.md): diffu-GRPO with 4
# inner updates at 1e-3 collapsed to 0 within 4 steps, at 2e-4 and 5e-4 wandered at or below
# the start, at 3e-5 rose steadily (`diagnostics` shows why: the solve rate falls once a step
# along the true gradient passes ~0.05 in parameter norm, while Adam moves every parameter by
# about lr per update); with one update a step 1e-4 matches it. RFT at 1e-4 and 2e-4, one
# update a step: 0.458 and 0.458 after 60 steps, 2e-4 falling to 0.376 first.
LR = {}
LR_DEFAULT = 1e-4
COLD_TEMPERATURES = (0.6, 0.2)  # the start and each row also scored at these
# Rows run again under other seeds (other prompts and rollouts, the same start): how far apart
# two runs of one objective land, beside the evaluation's own s.e.
REPEAT_ROWS, REPEAT_SEEDS = ("rft", "rft_trajectory", "grpo_trajectory"), (1, 2)
# (name, objective, estimator, extra rl fields). Two RFT rows: on the NELBO the start was
# trained with ("rft", the baseline of `vs_rft`), and on the rollout's own trajectory
# ("rft_trajectory", `vs_rft_trajectory`), the log-probabilities diffu-GRPO's best row reads:
# with them the two updates have the same expected gradient (docs/rl.md).
ROWS = (("rft", "rft", "elbo", {}),
        ("rft_trajectory", "rft", "trajectory", {}),
        ("grpo_one_step", "grpo", "one_step", {}),
        ("grpo_trajectory", "grpo", "trajectory", {}),
        ("grpo_coupled", "grpo", "coupled", {}),
        ("spg", "spg", None, {}),
        ("wd1", "wd1", "one_step", {}),
        ("igpo", "grpo", "trajectory", {"igpo": True}),
        ("mdpo", "mdpo", None, {}))


def _quiet(*args, **kwargs):
  del args, kwargs


def pretrain_config(name: str):
  c = base_config()
  c.seed = SEED
  c.task = name
  c.task_kwargs.update(**TASKS[name]["task_kwargs"])
  c.batch_size = PRETRAIN["batch_size"]
  c.model.update(**MODEL)
  c.train.update(num_steps=PRETRAIN["num_steps"], lr=PRETRAIN["lr"],
                 warmup_steps=PRETRAIN["warmup_steps"])
  c.checkpoint.update(every=PRETRAIN["num_steps"], keep=1)
  c.log_every = 100
  c.eval_batches = 1
  c.num_eval_samples = 0
  c.sampler = dict(SAMPLER, steps=TASKS[name]["steps"])
  return c


def rl_config(name: str, row, start: str, seed: int = SEED):
  _, objective, estimator, extra = row
  steps = TASKS[name]["rl_steps"]
  c = grpo_config.get_config()
  c.seed = seed
  c.task = name
  c.objective = objective
  c.task_kwargs.update(**TASKS[name]["task_kwargs"])
  c.batch_size = RL["batch_size"]
  c.train.update(init_from=start, num_steps=steps, lr=LR.get(objective, LR_DEFAULT))
  every = TASKS[name]["eval_every"]
  c.checkpoint.update(every=every, keep=steps // every + 1)
  c.rl.update(num_generations=RL["num_generations"], num_iterations=RL["num_iterations"],
              beta=RL["beta"], epsilon=RL["epsilon"], p_mask_prompt=RL["p_mask_prompt"],
              elbo_samples=RL["elbo_samples"], rewards=None, **extra)
  if estimator is not None:
    c.rl.estimator = estimator
  c.sampler = dict(SAMPLER, steps=TASKS[name]["steps"])
  return c


def _model_at(folder: str, step: int):
  """(denoiser, params) of a run's checkpoint at `step`."""
  model = mdjax.load(folder, step=step, log=_quiet)
  return model.denoiser, model.params


def metrics_of(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  with open(path, encoding="utf-8") as f:
    return list(jsonl.log_rows(f, path))  # as the run's own readers: a bad line skipped


def run_task(name: str, workdir: str, log) -> tuple[dict, list, dict]:
  """(task summary, rows, curves) of one task."""
  spec_steps = (TASKS[name]["steps"], TASKS[name]["sequential_steps"])
  start = os.path.join(workdir, name, "start")
  train.train(pretrain_config(name), start, log=_quiet)
  base = mdjax.load(start, log=_quiet)
  _, _, task, _ = eval_canvas(name)
  oracle = task.exact_denoiser
  start_checks = {s: outcomes(base.denoiser, base.params, name, s) for s in spec_steps}
  oracle_checks = {s: outcomes(oracle, None, name, s) for s in spec_steps}
  before = {s: start_checks[s][CHECKS[name]] for s in spec_steps}
  exact = {s: rate(oracle_checks[s][CHECKS[name]]) for s in spec_steps}
  summary = {"start": {str(s): rate(before[s]) for s in spec_steps},
             # Every check of the task, the reward's and the others (ScanAndAdd's reward
             # does not look at the number of adds: add_count_valid does).
             "start_checks": {str(s): fractions(start_checks[s]) for s in spec_steps},
             "oracle_checks": {str(s): fractions(oracle_checks[s]) for s in spec_steps},
             # How much of a gain sharpening alone buys: the start sampled colder.
             "start_at_temperature": {
                 str(t): rate(solved(base.denoiser, base.params, name, spec_steps[0], t))
                 for t in COLD_TEMPERATURES},
             "oracle": {str(s): exact[s] for s in spec_steps}, "optimum": 1.0,
             "pretrain_train_seconds": train.read_train_seconds(start),
             "steps": TASKS[name]["steps"], "sequential_steps": TASKS[name]["sequential_steps"],
             "rl_steps": TASKS[name]["rl_steps"], "task_kwargs": TASKS[name]["task_kwargs"]}
  log(f"{name}: start {summary['start']}, oracle {summary['oracle']}")
  rows, curves, rft_after = [], {}, {}
  for row in ROWS:
    folder = os.path.join(workdir, name, row[0])
    t0 = time.time()
    config = rl_config(name, row, start)
    train.train(config, folder, log=_quiet)
    tuned = mdjax.load(folder, log=_quiet)
    after_checks = {s: outcomes(tuned.denoiser, tuned.params, name, s) for s in spec_steps}
    after = {s: after_checks[s][CHECKS[name]] for s in spec_steps}
    every = TASKS[name]["eval_every"]
    # The held-out solve rate at every eval_every-th step: is the row still rising at the end?
    eval_curve = ([[0, float(before[spec_steps[0]].mean())]]
                  + [[s, float(solved(*_model_at(folder, s), name, spec_steps[0]).mean())]
                     for s in range(every, TASKS[name]["rl_steps"], every)]
                  + [[TASKS[name]["rl_steps"], float(after[spec_steps[0]].mean())]])
    logged = [m for m in metrics_of(folder) if "reward_mean" in m]
    curves[f"{name}/{row[0]}"] = [(m["step"], m["reward_mean"]) for m in logged]
    rollout = sum(m["rollout_seconds"] for m in logged[1:])  # step 1 compiles: left out
    update = sum(m["update_seconds"] for m in logged[1:])
    main = TASKS[name]["steps"]
    rb, ra = rate(before[main]), rate(after[main])
    record = {
        "task": name, "name": row[0], "objective": row[1],
        "estimator": row[2] if row[2] is not None else row[1], "knobs": row[3],
        "start": f"nelbo, {PRETRAIN['num_steps']} steps", "steps": TASKS[name]["rl_steps"],
        "lr": config.train.lr, "rollouts": int(sum(m.get("rollouts", RL["batch_size"])
                                                   for m in logged)),
        "reward_before": rb["reward"], "reward_after": ra["reward"],
        "stderr_before": rb["stderr"], "stderr_after": ra["stderr"],
        **gain(before[main], after[main]),
        "sequential": {"steps": TASKS[name]["sequential_steps"],
                       "before": rate(before[spec_steps[1]]),
                       "after": rate(after[spec_steps[1]]),
                       **gain(before[spec_steps[1]], after[spec_steps[1]])},
        # Against rejection-sampling fine-tuning at the same rollouts, paired: on the NELBO
        # (ROWS[0]) and on the trajectory.
        "vs_rft": None if row[0] == "rft" else gain(rft_after["rft"], after[main]),
        "vs_rft_trajectory": (None if row[0] in ("rft", "rft_trajectory")
                              else gain(rft_after["rft_trajectory"], after[main])),
        "eval_curve": eval_curve,
        # The same, sampled colder: a gain beyond the start's own at this temperature is
        # more than sharpening.
        "checks_after": {str(s): fractions(after_checks[s]) for s in spec_steps},
        "after_at_temperature": {
            str(t): rate(solved(tuned.denoiser, tuned.params, name, main, t))
            for t in COLD_TEMPERATURES},
        "rollout_fraction": rollout / max(rollout + update, 1e-9),
        "oracle_reward": exact[main]["reward"], "optimum": 1.0,
        "gap_to_optimum_closed": (ra["reward"] - rb["reward"]) / (1.0 - rb["reward"]),
        "train_seconds": train.read_train_seconds(folder),  # over resumed runs too
        "seconds": time.time() - t0}
    rows.append(record)
    if row[1] == "rft":
      rft_after[row[0]] = after[main]
    log(json.dumps({k: record[k] for k in ("task", "name", "reward_before", "reward_after",
                                            "gain_in_stderr", "gain_in_paired_stderr",
                                            "train_seconds")}))
  repeats = {}
  for row in (r for r in ROWS if r[0] in REPEAT_ROWS):
    seed_rewards = [next(r for r in rows if r["name"] == row[0])["reward_after"]]
    seconds = []
    for seed in REPEAT_SEEDS:
      folder = os.path.join(workdir, name, f"{row[0]}_seed{seed}")
      train.train(rl_config(name, row, start, seed), folder, log=_quiet)
      tuned = mdjax.load(folder, log=_quiet)
      seed_rewards.append(rate(solved(tuned.denoiser, tuned.params, name,
                                      TASKS[name]["steps"]))["reward"])
      seconds.append(train.read_train_seconds(folder) or 0.0)
    repeats[row[0]] = {"seeds": [SEED, *REPEAT_SEEDS], "reward_after": seed_rewards,
                       "mean": float(np.mean(seed_rewards)),
                       "std": float(np.std(seed_rewards, ddof=1)), "train_seconds": seconds}
  summary["seed_repeats"] = repeats
  log(f"{name} seed repeats: {json.dumps(repeats)}")
  if name == "sudoku4":
    summary["diagnostics"] = diagnostics(base, name)
    log(f"{name} diagnostics: {json.dumps(summary['diagnostics'])}")
  return summary, rows, curves


def keep_other_tasks(previous: dict, summaries: dict, rows: list, curves: dict
                     ) -> tuple[dict, list, dict, dict]:
  """(summaries, rows, curves, task settings) of a subset run joined with an earlier
  results/rl.json (`previous`): the tasks run now replace theirs, every other task's figures
  stay as they were (with the settings they were run under); tasks in TASKS order."""
  order = sorted(set(previous["tasks"]) | set(summaries),
                 key=lambda n: (list(TASKS).index(n) if n in TASKS else len(TASKS), n))
  new = set(summaries)
  return ({n: (summaries if n in new else previous["tasks"])[n] for n in order},
          [r for n in order for r in (rows if n in new else previous["rows"]) if r["task"] == n],
          {k: v for n in order for k, v in (curves if n in new else previous["curves"]).items()
           if k.split("/")[0] == n},
          {n: (TASKS if n in new else previous["config"]["tasks"])[n] for n in order})


def run(workdir: str, out: str, names) -> dict:
  """Runs the tasks `names` and writes OUT/rl.json and rl.png: every task's from scratch, or
  (a subset, with OUT/rl.json present) those tasks' figures in place of theirs there."""
  start_time = time.time()
  log = lambda message: print(message, flush=True)  # noqa: E731
  summaries, rows, curves = {}, [], {}
  for name in names:
    summaries[name], task_rows, task_curves = run_task(name, workdir, log)
    rows += task_rows
    curves.update(task_curves)
  settings = {name: TASKS[name] for name in names}
  path = os.path.join(out, "rl.json")
  if set(names) != set(TASKS) and os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      summaries, rows, curves, settings = keep_other_tasks(json.load(f), summaries, rows, curves)
    log(f"{path}: {sorted(names)} replaced, the other tasks' figures kept")
  sudoku = summaries.get("sudoku4")
  results = {
      "config": {"seed": SEED, "eval_prompts": EVAL_PROMPTS, "sampler": SAMPLER,
                 "pretrain": dict(PRETRAIN, model=MODEL), "tasks": settings, "rl": RL,
                 "lr": {"default": LR_DEFAULT, **LR}, "rows": [r[0] for r in ROWS],
                 "seed_repeats": {"rows": REPEAT_ROWS, "seeds": REPEAT_SEEDS},
                 "reward": "each task's exact check (rewards.TASK_CHECKS)",
                 "stderr": "binomial sqrt(p (1 - p) / n) over the eval prompts; "
                           "gain_in_stderr divides the gain by sqrt(se_before^2 + "
                           "se_after^2); gain_in_paired_stderr by the s.e. of the per-prompt "
                           "difference (the same prompts and sampler key score both)",
                 "jax": jax.__version__, "backend": jax.default_backend()},
      # Sudoku's at its training steps, as before; every task's in `tasks`.
      "oracle": None if sudoku is None else sudoku["oracle"][str(TASKS["sudoku4"]["steps"])],
      "optimum": 1.0, "tasks": summaries, "rows": rows, "curves": curves,
      "pretrain_train_seconds": sum(s["pretrain_train_seconds"] or 0
                                    for s in summaries.values()),
      # The training wall time of every run (over resumed invocations): with the
      # evaluations, what the command costs from an empty workdir; "seconds" is this
      # invocation's (finished runs are reused).
      "train_seconds_total": sum(s["pretrain_train_seconds"] or 0 for s in summaries.values())
      + sum(r["train_seconds"] or 0 for r in rows)
      + sum(sum(rep["train_seconds"]) for s in summaries.values()
            for rep in s["seed_repeats"].values()),
      "seconds": time.time() - start_time}
  report.write_json(path, results)
  try:
    plot(results, os.path.join(out, "rl.png"))
  except ImportError:
    print("matplotlib missing: no rl.png", flush=True)
  return results


def plot(results: dict, path: str) -> None:
  """Per task: each row's solve rate on the evaluation prompts at the training sampler's
  steps (bars, binomial s.e.) and one position a step (dots), beside the start, the exact
  oracle under the same sampler and RFT; below, each row's solve rate at its checkpoints."""
  names = list(results["tasks"])
  fig, axes = report.new_figure(figsize=(5.5 * len(names), 7.2), ncols=len(names), nrows=2,
                                squeeze=False)
  for ax, name in zip(axes[1], names):  # the held-out solve rate along each run
    summary = results["tasks"][name]
    main = str(summary["steps"])
    for r in (r for r in results["rows"] if r["task"] == name):
      steps, values = zip(*r["eval_curve"])
      ax.plot(steps, values, "-" if r["objective"] == "rft" else "--",
              lw=2 if r["objective"] == "rft" else 1, label=r["name"])
    ax.set(xlabel="RL step", ylabel=f"solved at {main} steps (2000 fresh prompts)",
           title=f"{name} checkpoints (RFT solid; oracle "
                 f"{summary['oracle'][main]['reward']:.3f})")
    ax.legend(fontsize=6, ncol=2)
  for ax, name in zip(axes[0], names):
    summary = results["tasks"][name]
    main, seq = str(summary["steps"]), str(summary["sequential_steps"])
    rows = [r for r in results["rows"] if r["task"] == name]
    labels = ["start"] + [r["name"] for r in rows]
    values = [summary["start"][main]["reward"]] + [r["reward_after"] for r in rows]
    errors = [summary["start"][main]["stderr"]] + [r["stderr_after"] for r in rows]
    sequential = ([summary["start"][seq]["reward"]]
                  + [r["sequential"]["after"]["reward"] for r in rows])
    x = np.arange(len(labels))
    colors = ["gray"] + ["tab:green" if r["objective"] == "rft" else "tab:blue" for r in rows]
    ax.bar(x, values, yerr=errors, color=colors, capsize=2,
           label=f"{main} decoding steps (RFT green)")
    ax.plot(x, sequential, "k.", label=f"{seq} steps (one position a step)")
    ax.axhline(summary["oracle"][main]["reward"], color="black", ls="--",
               label=f"exact oracle, {main} steps")
    ax.axhline(summary["start"][main]["reward"], color="gray", ls=":", lw=1)
    ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=7)
    ax.set(ylabel="solved (2000 fresh prompts)", ylim=(0, 1.3), yticks=np.linspace(0, 1, 6),
           title=f"{name}: {summary['rl_steps']} RL steps x 64 rollouts")
    ax.legend(fontsize=6, loc="upper center", ncol=2)
  report.save_figure(fig, path)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", default="/tmp/mdjax_rl",
                      help="runs are trained here; finished ones are reused")
  parser.add_argument("--out", default="results", help="where rl.json and rl.png go")
  parser.add_argument("--tasks", default=",".join(TASKS),
                      help=f"comma-separated, of {','.join(TASKS)} (default: all, OUT/rl.json "
                           f"written from scratch); a subset replaces only those tasks' "
                           f"summaries, rows and curves in an existing OUT/rl.json and keeps "
                           f"the other tasks' as they are")
  args = parser.parse_args()
  names = [t for t in args.tasks.split(",") if t]
  unknown = sorted(set(names) - set(TASKS))
  if unknown or not names:
    parser.error(f"--tasks={args.tasks!r}: unknown {unknown}; the tasks are {list(TASKS)}")
  run(args.workdir, args.out, sorted(set(names), key=list(TASKS).index))


if __name__ == "__main__":
  main()
