"""The RL table's tasks and shared settings (experiments/rl.py), and how a model is scored on
them: each task's exact check on EVAL_PROMPTS fresh prompts under the table's sampler, with
binomial standard errors and paired gains.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from mdjax import sampling, tasks
from mdjax.rl import sources

SEED = 0
EVAL_PROMPTS = 2000
EVAL_KEY = 20261206  # the evaluation prompts' key: no training step folds it
# rl_steps: Sudoku runs 480 steps because at 120 every row was still rising and RFT and
# diffu-GRPO were level (0.482 and 0.483); from 120 to 480 RFT stays at 0.48-0.50 while
# diffu-GRPO on the trajectory climbs to 0.53 (docs/rl.md). eval_every: the checkpoints
# scored on the evaluation prompts (each row's `eval_curve`).
# ScanAndAdd: n = 2 values (3 commands, 2 of them adds; the completion ANS, 3 answer digits,
# OPS and the commands, 8 positions) because the start learns little of the sum at larger n
# (pilots, 600-3000 NELBO steps at n = 3 and 4: 0.06-0.12 solved at 3 decoding steps,
# 0.07-0.22 one position a step); at n = 2 it solves 0.21 at 3 steps, where the oracle
# solves 0.67 (0.26 at 2 steps, 0.87 at 4): far below the oracle, above zero, and a sampler
# under which parallel decoding still costs the oracle a third. 240 RL steps: in pilots diffu-GRPO on
# the trajectory and RFT were still rising at 120 (0.558 and 0.539) and apart at 240 (0.760
# and 0.628); the task's 15 runs take about 9 minutes of training (docs/rl.md).
TASKS = {
    "sudoku4": dict(task_kwargs=dict(given_probability=0.7), steps=4, sequential_steps=16,
                    rl_steps=480, eval_every=60),
    "list_replace": dict(task_kwargs=dict(n=6, m=12), steps=2, sequential_steps=6,
                         rl_steps=60, eval_every=30),
    "scan_and_add": dict(task_kwargs=dict(n=2), steps=3, sequential_steps=8,
                         rl_steps=240, eval_every=30),
}
# Each task's exact check (the field of `task.checks`; rewards.TASK_CHECKS's).
CHECKS = {"sudoku4": "solved", "list_replace": "valid", "scan_and_add": "correct"}
SAMPLER = dict(family="confidence", score="prob", count_rule="even", temperature=1.0)
# One update per rollout batch (TRL's default num_iterations; d1 runs 12): on Sudoku 60 steps
# of diffu-GRPO (trajectory) at lr 1e-4 reached what 4 inner updates at 3e-5 reach (0.463
# against 0.465 and 0.448-0.464), at a quarter of the update time.
RL = dict(batch_size=64, num_generations=8, num_iterations=1, beta=0.0, epsilon=0.5,
          p_mask_prompt=0.15, elbo_samples=4)

def eval_canvas(name: str):
  """(canvas, fixed, task, check): the evaluation prompts, their completions masked."""
  task = tasks.get(name, TASKS[name]["task_kwargs"])
  rows = np.asarray(task.sample_data(jax.random.key(EVAL_KEY), EVAL_PROMPTS))
  prompt = sources.PROMPT_LENGTHS[name](task.params)
  canvas = rows.copy()
  canvas[:, prompt:] = task.mask_id
  fixed = np.zeros(canvas.shape, bool)
  fixed[:, :prompt] = True
  check = lambda x: task.checks(x)[CHECKS[name]]  # noqa: E731
  return canvas, fixed, task, check


def outcomes(apply_fn, params, name: str, steps: int, temperature: float | None = None
             ) -> dict[str, np.ndarray]:
  """Every check of the task (the fields of `task.checks`, bool [EVAL_PROMPTS] each) on the
  evaluation prompts under the sampler at `steps` (and `temperature`, default the training
  sampler's)."""
  canvas, fixed, task, _ = eval_canvas(name)
  knobs = {k: v for k, v in SAMPLER.items() if k != "family"}
  if temperature is not None:
    knobs["temperature"] = temperature
  spec = sampling.make_spec(SAMPLER["family"], steps=steps, **knobs)
  out = sampling.sample(apply_fn, params, jax.random.key(EVAL_KEY + 1), canvas, spec, fixed,
                        mask_id=task.mask_id)
  return {k: np.asarray(v, bool) for k, v in task.checks(np.asarray(out.tokens_BxL)).items()}


def solved(apply_fn, params, name: str, steps: int, temperature: float | None = None
           ) -> np.ndarray:
  """Each evaluation prompt's outcome, the task's exact check (bool [EVAL_PROMPTS])."""
  return outcomes(apply_fn, params, name, steps, temperature)[CHECKS[name]]


def fractions(checks: dict) -> dict:
  """The fraction of the evaluation prompts passing each check."""
  return {k: float(v.mean()) for k, v in checks.items()}


def rate(outcomes) -> dict:
  p = float(np.mean(outcomes))
  return {"reward": p, "stderr": math.sqrt(p * (1 - p) / len(outcomes))}


def gain(before, after) -> dict:
  """The gain and its s.e., unpaired and paired (the per-prompt difference's)."""
  b, a = np.asarray(before, float), np.asarray(after, float)
  diff = a.mean() - b.mean()
  unpaired = math.sqrt(rate(b)["stderr"] ** 2 + rate(a)["stderr"] ** 2)
  paired = float((a - b).std(ddof=1) / math.sqrt(len(a)))
  return {"gain": float(diff), "gain_in_stderr": diff / unpaired if unpaired else None,
          "gain_in_paired_stderr": diff / paired if paired else None}


