"""RL on Sudoku 4x4: what diffu-GRPO and wd1 add to a small model decoding in 4 steps.

  python experiments/rl.py [--workdir=/tmp/mdjax_rl] [--out=results]

A small model is trained here by the existing loop (the NELBO) on Sudoku 4x4 (each cell given
with probability 0.7) to a modest solve rate when it decodes the 16 cells in 4 steps (d1's
sampler: low-confidence, 4 cells a step, temperature 1). diffu-GRPO (d1's loss) and wd1 then
fine-tune it for the same fixed budget (`configs/grpo.py`'s recipe, reward: the exact check
the exact check 'sudoku4_solved'), each with d1's one-step log-probabilities, with the
MC-ELBO, and with the rollout's own trajectory (each token under the canvas of the step that
wrote it). Each model, the exact oracle under the same sampler and the optimum (1.0:
every puzzle has a solution, and a policy may put all its mass on one) are scored on the same
EVAL_PUZZLES fresh puzzles (drawn from a key no training step reads); stderr is binomial,
sqrt(p (1 - p) / n). Writes results/rl.json (`rows`) and results/rl.png (reward per RL step).
Fixed seed; the workdir's runs are reused when finished (`train.train` resumes them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mdjax  # noqa: E402
from configs import grpo as grpo_config  # noqa: E402
from configs.base import base_config  # noqa: E402
from mdjax import jsonl, report, sampling, train  # noqa: E402
from mdjax.rl import trainer  # noqa: E402,F401  (registers 'grpo' and 'wd1')
from mdjax.tasks import sudoku4  # noqa: E402

SEED = 0
GIVEN_PROBABILITY = 0.7
EVAL_PUZZLES = 2000
EVAL_KEY = 20261206  # the evaluation puzzles' key: no training step folds it
SAMPLER = dict(family="confidence", steps=4, score="prob", count_rule="even", temperature=1.0)
PRETRAIN = dict(num_steps=600, batch_size=64, lr=3e-3, warmup_steps=100,
                model=dict(d_model=64, num_layers=2, num_heads=4, d_ff=128))
RL_STEPS = 100
RL = dict(batch_size=64, lr=2e-4, num_generations=8, num_iterations=4, beta=0.04, epsilon=0.5,
          p_mask_prompt=0.15, elbo_samples=4)
# (objective, estimator): d1's one-step log-probabilities, and the MC-ELBO. With the ELBO a
# row's log-probability is one number (the completion's), whose k3 KL to the reference is
# a sequence-level quantity of several nats: beta = 0 there (the clip alone keeps the
# updates near the rollout policy).
RUNS = (("grpo", "one_step", RL_STEPS), ("grpo", "elbo", RL_STEPS), ("wd1", "one_step", RL_STEPS),
        ("wd1", "elbo", RL_STEPS),
        # The one that gained within the budget, run 3x as long (its own workdir).
        ("grpo", "elbo", 3 * RL_STEPS),
        # Each completion token scored under the canvas of the rollout step that wrote it:
        # the log-probability of the 4-step parallel decode itself (one pass a step).
        ("grpo", "trajectory", RL_STEPS), ("wd1", "trajectory", RL_STEPS))


def pretrain_config():
  c = base_config()
  c.seed = SEED
  c.task = "sudoku4"
  c.task_kwargs.given_probability = GIVEN_PROBABILITY
  c.batch_size = PRETRAIN["batch_size"]
  c.model.update(**PRETRAIN["model"])
  c.train.update(num_steps=PRETRAIN["num_steps"], lr=PRETRAIN["lr"],
                 warmup_steps=PRETRAIN["warmup_steps"])
  c.checkpoint.update(every=PRETRAIN["num_steps"], keep=1)
  c.log_every = 100
  c.eval_batches = 1
  c.num_eval_samples = 0
  c.sampler = SAMPLER
  return c


def rl_config(objective: str, estimator: str, start: str, steps: int):
  c = grpo_config.get_config()
  c.seed = SEED
  c.objective = objective
  c.task_kwargs.given_probability = GIVEN_PROBABILITY
  c.batch_size = RL["batch_size"]
  c.train.update(init_from=start, num_steps=steps, lr=RL["lr"])
  c.checkpoint.update(every=steps, keep=1)
  c.rl.update(num_generations=RL["num_generations"], num_iterations=RL["num_iterations"],
              beta=RL["beta"] if estimator != "elbo" else 0.0, epsilon=RL["epsilon"],
              p_mask_prompt=RL["p_mask_prompt"], estimator=estimator,
              elbo_samples=RL["elbo_samples"])
  c.sampler = SAMPLER
  return c


def eval_canvas():
  """The evaluation puzzles, their solution cells masked."""
  params = sudoku4.Params(given_probability=GIVEN_PROBABILITY)
  rows = np.asarray(sudoku4.sample_data(jax.random.key(EVAL_KEY), EVAL_PUZZLES, params))
  canvas = rows.copy()
  canvas[:, sudoku4.CELLS:] = sudoku4.MASK_ID
  return canvas, params


def solve_rate(apply_fn, params, canvas, task_params) -> dict:
  spec = sampling.make_spec(SAMPLER["family"], **{k: v for k, v in SAMPLER.items()
                                                  if k != "family"})
  out = sampling.sample(apply_fn, params, jax.random.key(EVAL_KEY + 1), canvas, spec,
                        mask_id=sudoku4.MASK_ID)
  solved = sudoku4.checks(np.asarray(out.tokens_BxL), task_params)["solved"]
  p = float(solved.mean())
  return {"reward": p, "stderr": math.sqrt(p * (1 - p) / len(solved))}


def metrics_of(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  with open(path, encoding="utf-8") as f:
    return list(jsonl.log_rows(f, path))  # as the run's own readers: a bad line skipped


def run(workdir: str, out: str) -> dict:
  start_time = time.time()
  canvas, task_params = eval_canvas()
  start = os.path.join(workdir, "start")
  train.train(pretrain_config(), start)
  base = mdjax.load(start)
  before = solve_rate(base.denoiser, base.params, canvas, task_params)
  oracle = solve_rate(sudoku4.make_exact_denoiser(task_params), None, canvas, task_params)
  print(f"start: solved {before['reward']:.3f} +- {before['stderr']:.3f}; oracle "
        f"{oracle['reward']:.3f}", flush=True)
  rows, curves = [], {}
  for objective, estimator, steps in RUNS:
    name = f"{objective}_{estimator}" + ("" if steps == RL_STEPS else f"_{steps}")
    folder = os.path.join(workdir, name)
    t0 = time.time()
    train.train(rl_config(objective, estimator, start, steps), folder)
    tuned = mdjax.load(folder)
    after = solve_rate(tuned.denoiser, tuned.params, canvas, task_params)
    logged = [m for m in metrics_of(folder) if "reward_mean" in m]
    curves[name] = [(m["step"], m["reward_mean"]) for m in logged]
    rollout = sum(m["rollout_seconds"] for m in logged[1:])  # step 1 compiles: left out
    update = sum(m["update_seconds"] for m in logged[1:])
    gain = after["reward"] - before["reward"]
    se = math.sqrt(before["stderr"] ** 2 + after["stderr"] ** 2)
    rows.append({
        "task": "sudoku4", "objective": objective, "estimator": estimator,
        "start": f"nelbo, {PRETRAIN['num_steps']} steps", "steps": steps,
        "reward_before": before["reward"], "reward_after": after["reward"],
        "stderr_before": before["stderr"], "stderr_after": after["stderr"],
        "rollout_fraction": rollout / max(rollout + update, 1e-9),
        "gain": gain, "gain_in_stderr": gain / se if se else None,
        "oracle_reward": oracle["reward"], "optimum": 1.0,
        "gap_to_optimum_closed": gain / (1.0 - before["reward"]),
        "train_seconds": train.read_train_seconds(folder),  # over resumed runs too
        "seconds": time.time() - t0})
    print(json.dumps(rows[-1]), flush=True)
  results = {
      "config": {"seed": SEED, "given_probability": GIVEN_PROBABILITY,
                 "eval_puzzles": EVAL_PUZZLES, "sampler": SAMPLER, "pretrain": PRETRAIN,
                 "rl_steps": RL_STEPS, "rl": RL, "reward": "sudoku4_solved",
                 "stderr": "binomial sqrt(p (1 - p) / n) over the eval puzzles; gain_in_stderr "
                           "divides the gain by sqrt(se_before^2 + se_after^2) (the same "
                           "puzzles score both: a paired comparison, for which this is "
                           "conservative when the outcomes correlate)",
                 "jax": jax.__version__, "backend": jax.default_backend()},
      "oracle": oracle, "optimum": 1.0, "rows": rows, "curves": curves,
      "pretrain_train_seconds": train.read_train_seconds(start),
      # The training wall time of every run (over resumed invocations): with the
      # evaluations, what the command costs from an empty workdir; "seconds" is this
      # invocation's (finished runs are reused).
      "train_seconds_total": train.read_train_seconds(start) + sum(
          r["train_seconds"] for r in rows),
      "seconds": time.time() - start_time}
  report.write_json(os.path.join(out, "rl.json"), results)
  try:
    fig, ax = report.new_figure(figsize=(5.5, 3.5))
    for name, curve in curves.items():
      steps, values = zip(*curve)
      window = 10
      smooth = np.convolve(values, np.ones(window) / window, mode="valid")
      ax.plot(steps[window - 1:], smooth, label=f"{name} (rollouts, mean of 10 steps)")
    ax.axhline(before["reward"], color="gray", ls=":", label="start (eval)")
    ax.axhline(oracle["reward"], color="black", ls="--", label="exact oracle, same sampler")
    ax.set(xlabel="RL step", ylabel="solved fraction", ylim=(0, 1.02),
           title="Sudoku 4x4, 4 decoding steps")
    ax.legend(fontsize=7, loc="upper right", bbox_to_anchor=(1.0, 0.93))
    report.save_figure(fig, os.path.join(out, "rl.png"))
  except ImportError:
    print("matplotlib missing: no rl.png", flush=True)
  return results


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", default="/tmp/mdjax_rl")
  parser.add_argument("--out", default="results")
  args = parser.parse_args()
  run(args.workdir, args.out)


if __name__ == "__main__":
  main()
