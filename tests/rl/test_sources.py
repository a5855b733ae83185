"""The RL trainer's prompt source on every id task with an exact oracle (`sources.IdTaskSource`,
prompted or not), each scored by the task's own exact check (`rewards.TASK_CHECKS`): the
prompts are the data's, a data row scores 1, any row scores what the task's check says, and
the exact oracle's one-step rollouts score the known closed forms. No training: the oracles
are the policies."""

import math

import jax
import numpy as np
import pytest

from configs import grpo as grpo_config
from mdjax import sampling, tasks
from mdjax.rl import rewards, sources, trainer
from mdjax.tasks import lists, permutation, two_color
from mdjax.train.config_checks import ConfigError

# task -> (prompt length, the name of its check in task.checks, one-step ancestral validity of
# the exact oracle (prompt given) in closed form or None where none is known).
TASKS = {
    "two_color": (0, None, 0.5),
    "permutation": (0, "valid", float(permutation.ancestral_valid_probability(6, 1))),
    "list_copy": (4, "valid", float(lists.ancestral_valid_probability("copy", 4, 1))),
    "list_replace": (4, "valid", float(lists.ancestral_valid_probability("replace", 4, 1))),
    "list_shuffle": (4, "valid", float(lists.ancestral_valid_probability("shuffle", 4, 1))),
    "sudoku4": (16, "solved", None),
    "scan_and_add": (10, "correct", None),
}


def _check(task, ids_BxL) -> np.ndarray:
  """The task's exact check of whole rows, as floats."""
  name = TASKS[task.name][1]
  if name is None:  # two_color: no checks field; its invalid_fraction per row
    return np.array([1.0 - float(two_color.invalid_fraction(row[None])) for row in ids_BxL])
  return task.checks(ids_BxL)[name].astype(float)


def _scores(source, task, prompts, group, ids_BxL):
  mask = np.ones((len(ids_BxL), source.completion_length), np.float32)
  rewards_B, means = trainer.score(source, (rewards.TASK_CHECKS[task.name],), None, prompts,
                                   group, ids_BxL, mask)
  assert set(means) == {f"reward_{rewards.TASK_CHECKS[task.name]}"}
  return rewards_B


@pytest.mark.parametrize("name", sorted(TASKS))
def test_prompts_and_rewards_are_the_tasks(name):
  task = tasks.get(name)
  source = sources.IdTaskSource(task)
  prompt_length = TASKS[name][0]
  assert (source.prompt_length, source.completion_length) == (
      prompt_length, task.length - prompt_length)
  key = jax.random.key(3)
  prompts = source.draw(key, 8)
  rows = np.asarray(task.sample_data(key, 8))
  np.testing.assert_array_equal(prompts.ids_PxLp, rows[:, :prompt_length])
  # The data's own completions pass the check.
  np.testing.assert_array_equal(_scores(source, task, prompts, 1, rows), 1.0)
  # Any completion scores what the task's check says: 4 random ones per prompt (ids drawn
  # from the task's real ids, mostly invalid), and the data's with two cells swapped.
  group = 4
  rng = np.random.default_rng(0)
  random_rows = np.repeat(rows, group, axis=0)
  random_rows[:, prompt_length:] = rng.integers(0, task.vocab_size,
                                                (len(random_rows), source.completion_length))
  swapped = rows.copy()
  swapped[:, [-1, -2]] = swapped[:, [-2, -1]]
  for ids, g in ((random_rows, group), (swapped, 1)):
    np.testing.assert_array_equal(_scores(source, task, prompts, g, ids), _check(task, ids))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TASKS))
def test_oracle_rollouts_score_the_closed_form(name):
  """The trainer's rollout (one ancestral step, G per prompt) of the exact oracle: rewards
  equal the checks row by row, and their mean is within 4 binomial standard errors,
  sqrt(p (1 - p) / n), of the closed form (n = 256 rows; copy's is exactly 1)."""
  task = tasks.get(name)
  source = sources.IdTaskSource(task)
  prompts = source.draw(jax.random.key(1), 16)
  spec = sampling.make_spec("ancestral", length=task.length, steps=1)
  group = 16
  ids, write_steps, _ = trainer.rollout(task.exact_denoiser, None, jax.random.key(2), prompts,
                                        group, source.completion_length, spec, task.mask_id)
  np.testing.assert_array_equal(ids[:, :source.prompt_length],
                                np.repeat(prompts.ids_PxLp, group, axis=0))
  assert (write_steps[:, source.prompt_length:] == 0).all()  # one step wrote the completion
  rewards_B = _scores(source, task, prompts, group, ids)
  np.testing.assert_array_equal(rewards_B, _check(task, ids))
  closed_form = TASKS[name][2]
  if closed_form is not None:
    se = math.sqrt(closed_form * (1 - closed_form) / len(ids))
    assert abs(rewards_B.mean() - closed_form) <= 4 * se, (rewards_B.mean(), closed_form)


def _options(task, **rl):
  c = grpo_config.get_config()
  c.task = task
  c.rl.rewards = rl.pop("rewards", c.rl.rewards)
  return trainer.rl_options(c)


def test_the_default_reward_is_the_tasks_exact_check_and_another_is_refused():
  for name, check in rewards.TASK_CHECKS.items():
    c = grpo_config.get_config()
    c.task = name
    del c.rl["rewards"]  # unset: DEFAULTS' None
    assert trainer.rl_options(c)["rewards"] == (check,)
  assert _options("list_copy", rewards=("list_valid", "sudoku"))["rewards"] == (
      "list_valid", "sudoku")  # a text reward beside the check is the user's call
  with pytest.raises(ConfigError, match="'sudoku4_solved' is the exact check of another task; "
                     "task 'permutation''s is 'permutation_valid'"):
    _options("permutation")  # configs/grpo.py's Sudoku reward on another task
  c = grpo_config.get_config()
  c.task = "sft"
  del c.rl["rewards"]
  with pytest.raises(ConfigError, match="task 'sft' has no exact check: name the reward"):
    trainer.rl_options(c)
  with pytest.raises(ConfigError, match="RL prompts come from the id tasks"):
    sources.IdTaskSource(tasks.get("text"))
