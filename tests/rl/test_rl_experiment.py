"""experiments/rl.py's pieces that need no training: every task of the table has an exact
check that its own data passes and an oracle, and a subset run (`--tasks=NAME`) replaces
only that task's figures in an earlier results/rl.json. (The table itself: `python
experiments/rl.py`, docs/rl.md.)"""

import copy

import jax
import numpy as np
import pytest

from experiments import rl, rl_tasks
from mdjax import tasks
from mdjax.rl import rewards, sources


@pytest.mark.slow  # builds the three tasks and compiles their data laws (~5 s)
def test_every_task_has_its_check_a_prompt_and_an_oracle():
  for name, settings in rl_tasks.TASKS.items():
    task = tasks.get(name, settings["task_kwargs"])
    rows = np.asarray(task.sample_data(jax.random.key(0), 16))
    checks = task.checks(rows)
    # The reward's field exists and the data law passes it (the optimum is 1.0).
    assert checks[rl_tasks.CHECKS[name]].all(), name
    assert name in rewards.TASK_CHECKS and name in sources.PROMPT_LENGTHS
    assert task.exact_denoiser is not None
    # One position a step: the sequential steps are the completion's length.
    completion = task.length - sources.PROMPT_LENGTHS[name](task.params)
    assert settings["sequential_steps"] == completion, name
    assert 1 <= settings["steps"] < completion
    assert settings["rl_steps"] % settings["eval_every"] == 0


def _results(names, tag):
  """A results/rl.json of the tasks `names`, every figure marked with `tag`."""
  return {"tasks": {n: {"start": tag} for n in names},
          "rows": [{"task": n, "name": r, "reward_after": tag} for n in names
                   for r in ("rft", "grpo_trajectory")],
          "curves": {f"{n}/{r}": [[1, tag]] for n in names for r in ("rft", "grpo_trajectory")},
          "config": {"tasks": {n: {"steps": tag} for n in names}}}


def test_a_subset_run_replaces_only_its_tasks():
  names = list(rl_tasks.TASKS)
  previous = _results(names, "old")
  kept = copy.deepcopy(previous)
  new = _results(names[-1:], "new")
  summaries, rows, curves, settings = rl.keep_other_tasks(previous, new["tasks"], new["rows"],
                                                          new["curves"])
  assert previous == kept  # the earlier results are not modified
  assert list(summaries) == names and list(settings) == names  # TASKS' order
  for n in names:
    tag = "new" if n == names[-1] else "old"
    assert summaries[n] == {"start": tag}
    assert [r["reward_after"] for r in rows if r["task"] == n] == [tag, tag]
    assert [v for k, v in curves.items() if k.startswith(f"{n}/")] == [[[1, tag]]] * 2
  assert settings[names[-1]] == rl_tasks.TASKS[names[-1]]
  assert settings[names[0]] == {"steps": "old"}
  # A task the earlier file lacks is added, in TASKS' order.
  summaries, rows, _, _ = rl.keep_other_tasks(_results(names[:1], "old"), new["tasks"],
                                              new["rows"], new["curves"])
  assert list(summaries) == [names[0], names[-1]]
  assert [r["task"] for r in rows] == [names[0]] * 2 + [names[-1]] * 2
