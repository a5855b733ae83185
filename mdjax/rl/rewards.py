"""Reward functions: a registry of `fn(prompt: str, completion: str, target) -> float`.

  @rewards.register("my_reward")
  def my_reward(prompt, completion, target): ...
  rewards_B, per_function_BxR = rewards.compute(["countdown"], prompts, completions, targets)

`target` is the row's ground truth, whatever the function reads. Built in:

  sudoku               d1's `sudoku_reward_func`: the digits of the last <answer>...</answer>
                       (padded with 0 / cut to 16) score the fraction of the puzzle's blank
                       cells they fill correctly; target {"puzzle", "solution"} (d1's CSV
                       strings: 16 chars, 0 blank).
  countdown            d1's `countdown_reward_func` (`mdjax.tasks.countdown.reward`): 1 correct,
                       0.1 an answer that is wrong, 0 none; target {"numbers", "target"}.
  gsm8k_xmlcount, gsm8k_soft_format, gsm8k_strict_format, gsm8k_int, gsm8k_correctness
                       d1's five GSM8K rewards, in its order (`D1_GSM8K`): 2.0 when the
                       stripped text of the last <answer> equals target (the string after
                       "####" of the reference answer, `extract_hash_answer`), 0.5 for an
                       integer answer, 0.5 for each format, up to 0.5 for the tags.
  scan_and_add_correct the answer checks (`scan_and_add.checks`'s "correct"): 1 or 0;
                       prompt + completion is the task's decoded row ("VALS 3 1 ..."),
                       target the task's Params (None: the default task).
  two_color_valid      both colors equal (`two_color.invalid_fraction` is 0): 1 or 0.
  permutation_valid    the row is a permutation (`permutation.checks`'s "valid"); target
                       the task's Params (None: the default task).
  list_valid           the list task's check (`lists.checks`'s "valid": the output is the
                       prompt copied, with one item replaced, or shuffled); target the
                       task's Params, whose `kind` says which ('->' is ignored).
  sudoku4_solved       mdjax's 4x4 Sudoku solved (`sudoku4.checks`'s "solved"); prompt +
                       completion the decoded row (its cells in order; '/', '->' ignored).

`TASK_CHECKS` names each id task's exact check (the default reward of an RL run on it).
For the token tasks a trainer passes `model.decode` of the prompt ids and of the completion
ids; the functions read the tokens of the two texts in order. A function that raises or
returns NaN, None, an infinity or a non-number stops `compute` with a `RewardError` naming it,
the row and the completion.
"""

from __future__ import annotations

import math
import numbers as _numbers
import re
from typing import Callable, Sequence

import numpy as np

from mdjax.tasks import countdown, lists, permutation, scan_and_add, sudoku4, two_color

RewardFn = Callable[[str, str, object], float]
_REGISTRY: dict[str, RewardFn] = {}


class RewardError(ValueError):
  """A reward function failed on a row (raised, or returned no finite number)."""


def register(name: str) -> Callable[[RewardFn], RewardFn]:
  """Decorator: registers `fn` under `name` (a name is registered once)."""
  if not (isinstance(name, str) and name):
    raise ValueError(f"name={name!r} must be a non-empty string.")

  def decorate(fn: RewardFn) -> RewardFn:
    if not callable(fn):
      raise ValueError(f"reward {name!r}: {fn!r} is not callable.")
    if name in _REGISTRY and _REGISTRY[name] is not fn:
      raise ValueError(f"reward name={name!r} is already registered ({_REGISTRY[name]!r}).")
    _REGISTRY[name] = fn
    return fn

  return decorate


def get(name: str) -> RewardFn:
  if name not in _REGISTRY:
    raise ValueError(f"reward={name!r} is unknown; registered: {names()}.")
  return _REGISTRY[name]


def names() -> list[str]:
  return sorted(_REGISTRY)


def _short(text, limit: int = 80) -> str:
  text = str(text)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _value(name: str, row: int, completion: str, value) -> float:
  problem = None
  if isinstance(value, (bool, np.bool_)):
    value = float(value)
  if value is None:
    problem = "returned None"
  elif not isinstance(value, _numbers.Real):
    problem = f"returned {type(value).__name__} {_short(repr(value), 40)}, not a number"
  elif not math.isfinite(float(value)):
    problem = f"returned {float(value)}"
  if problem:
    raise RewardError(f"reward {name!r} {problem} at row {row} (completion "
                      f"{_short(completion)!r}); a reward must be a finite number.")
  return float(value)


def compute(names: Sequence[str], prompts: Sequence[str], completions: Sequence[str],
            targets: Sequence, weights: Sequence[float] | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
  """(rewards_B, per_function_BxR), float32: each function of `names` on each row, and their
  weighted sum (weights default 1, as d1's reward_weights)."""
  if isinstance(names, str) or not len(names):
    raise ValueError(f"names={names!r} must be a non-empty list of reward names.")
  fns = [get(name) for name in names]
  rows = len(completions)
  for arg, values in (("prompts", prompts), ("targets", targets)):
    if len(values) != rows:
      raise ValueError(f"{arg} holds {len(values)} rows; completions holds {rows}.")
  if weights is None:
    weights = [1.0] * len(names)
  if len(weights) != len(names) or not all(isinstance(w, _numbers.Real) and math.isfinite(w)
                                           for w in weights):
    raise ValueError(f"weights={list(weights)!r} must be {len(names)} finite numbers (one per "
                     f"reward of {list(names)}).")
  per_function_BxR = np.zeros((rows, len(names)), np.float32)
  for r, (name, fn) in enumerate(zip(names, fns)):
    for i, (prompt, completion, target) in enumerate(zip(prompts, completions, targets)):
      try:
        value = fn(prompt, completion, target)
      except RewardError:
        raise
      except Exception as exc:
        raise RewardError(f"reward {name!r} raised {type(exc).__name__}: {exc} at row {i} "
                          f"(completion {_short(completion)!r}).") from exc
      per_function_BxR[i, r] = _value(name, i, completion, value)
  rewards_B = (per_function_BxR * np.asarray(weights, np.float32)[None]).sum(1)
  return rewards_B.astype(np.float32), per_function_BxR


# --- d1's rewards (dllm-reasoning/d1, diffu-grpo/reward_func.py) --------------------------


def extract_xml_answer(text: str) -> str:
  """The text between the last <answer> and the next </answer>, stripped (d1's)."""
  return text.split("<answer>")[-1].split("</answer>")[0].strip()


def extract_hash_answer(text: str) -> str | None:
  """A GSM8K reference answer's final value: the text after '####' (None without)."""
  return text.split("####")[1].strip() if "####" in text else None


def extract_answer_sudoku(solution_str: str) -> str | None:
  """The digits of the last <answer>...</answer> (None without one)."""
  matches = re.findall(r"<answer>(.*?)</answer>", solution_str, re.DOTALL)
  return "".join(ch for ch in matches[-1].strip() if ch.isdigit()) if matches else None


def _field(target, name: str):
  try:
    return target[name]
  except (KeyError, TypeError, IndexError):
    raise ValueError(f"target={_short(repr(target), 60)} has no {name!r} (this reward reads "
                     "a dict target).") from None


@register("sudoku")
def sudoku(prompt: str, completion: str, target) -> float:
  """d1's sudoku reward: the fraction of the puzzle's blank cells filled correctly."""
  puzzle, solution = _field(target, "puzzle"), _field(target, "solution")
  sudoku4.from_d1(puzzle, solution)  # both 16 characters of 0-4, else a ValueError
  return sudoku4.d1_reward(puzzle, solution, extract_answer_sudoku(completion) or "")


@register("countdown")
def countdown_reward(prompt: str, completion: str, target) -> float:
  """d1's countdown reward (`mdjax.tasks.countdown.reward`)."""
  return countdown.reward(completion, _field(target, "numbers"), _field(target, "target"))


@register("gsm8k_correctness")
def gsm8k_correctness(prompt: str, completion: str, target) -> float:
  """2.0 when the last <answer>'s text equals the reference answer string."""
  return 2.0 if extract_xml_answer(completion) == target else 0.0


@register("gsm8k_int")
def gsm8k_int(prompt: str, completion: str, target) -> float:
  """0.5 when the last <answer>'s text is all digits."""
  return 0.5 if extract_xml_answer(completion).isdigit() else 0.0


@register("gsm8k_strict_format")
def gsm8k_strict_format(prompt: str, completion: str, target) -> float:
  """0.5 for exactly <reasoning>\\n...\\n</reasoning>\\n<answer>\\n...\\n</answer>\\n."""
  pattern = r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n$"
  return 0.5 if re.match(pattern, completion) else 0.0


@register("gsm8k_soft_format")
def gsm8k_soft_format(prompt: str, completion: str, target) -> float:
  """0.5 for <reasoning>...</reasoning> <answer>...</answer> at the start (d1's pattern,
  without re.DOTALL: '.' does not cross a newline, as in d1)."""
  pattern = r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>"
  return 0.5 if re.match(pattern, completion) else 0.0


def count_xml(text: str) -> float:
  """d1's tag count: 0.125 per well-placed tag, less 0.001 per character after the answer."""
  count = 0.0
  if text.count("<reasoning>\n") == 1:
    count += 0.125
  if text.count("\n</reasoning>\n") == 1:
    count += 0.125
  if text.count("\n<answer>\n") == 1:
    count += 0.125
    count -= len(text.split("\n</answer>\n")[-1]) * 0.001
  if text.count("\n</answer>") == 1:
    count += 0.125
    count -= (len(text.split("\n</answer>")[-1]) - 1) * 0.001
  return count


@register("gsm8k_xmlcount")
def gsm8k_xmlcount(prompt: str, completion: str, target) -> float:
  return count_xml(completion)


D1_GSM8K = ("gsm8k_xmlcount", "gsm8k_soft_format", "gsm8k_strict_format", "gsm8k_int",
            "gsm8k_correctness")


# --- the exact tasks: their own checks on the decoded rows --------------------------------


def _task_params(target, params_type, default):
  """An exact check's task parameters: None (the default task), the Params or its kwargs."""
  if target is None:
    return default
  if isinstance(target, params_type):
    return target
  if isinstance(target, dict):
    return params_type(**target)
  raise ValueError(f"target={target!r} must be None, a {params_type.__qualname__} of "
                   f"{params_type.__module__} or its kwargs.")


@register("scan_and_add_correct")
def scan_and_add_correct(prompt: str, completion: str, target) -> float:
  """1 when the row's answer is the sum its commands read (`checks`'s "correct")."""
  params = _task_params(target, scan_and_add.Params, scan_and_add.DEFAULT)
  names = {"VALS": scan_and_add.VALS, "OPS": scan_and_add.OPS, "ANS": scan_and_add.ANS,
           "PAD": scan_and_add.PAD, "?": scan_and_add.MASK_ID}
  words = f"{prompt} {completion}".split()
  ids = [names.get(w, int(w) if w.isdigit() and len(w) == 1 else -1) for w in words]
  if len(ids) != params.length or min(ids, default=-1) < 0:
    return 0.0
  return float(scan_and_add.checks(np.array([ids]), params)["correct"][0])


@register("two_color_valid")
def two_color_valid(prompt: str, completion: str, target) -> float:
  """1 when the two colors are equal (neither masked)."""
  words = f"{prompt} {completion}".split()
  return float(len(words) == two_color.LENGTH and words[0] == words[1] and words[0] != "?")


@register("permutation_valid")
def permutation_valid(prompt: str, completion: str, target) -> float:
  """1 when the row holds each of 0..n-1 once (`permutation.checks`'s "valid")."""
  params = _task_params(target, permutation.Params, permutation.DEFAULT)
  ids = [int(w) if w.isdigit() else -1 for w in f"{prompt} {completion}".split()]
  if len(ids) != params.length:
    return 0.0
  return float(permutation.checks(np.array([ids]), params)["valid"][0])


@register("list_valid")
def list_valid(prompt: str, completion: str, target) -> float:
  """1 when the output is the kind's function of the prompt (`lists.checks`'s "valid")."""
  params = _task_params(target, lists.Params, lists.Params())
  words = [w for w in f"{prompt} {completion}".split() if w != "->"]
  ids = [params.marker if w == "X" else int(w) if w.isdigit() else -1 for w in words]
  if len(ids) != params.length:
    return 0.0
  return float(lists.checks(np.array([ids]), params)["valid"][0])


# Each id task's exact check, by the task's name.
TASK_CHECKS = {"two_color": "two_color_valid", "permutation": "permutation_valid",
               "list_copy": "list_valid", "list_replace": "list_valid",
               "list_shuffle": "list_valid", "sudoku4": "sudoku4_solved",
               "scan_and_add": "scan_and_add_correct"}


@register("sudoku4_solved")
def sudoku4_solved(prompt: str, completion: str, target) -> float:
  """1 when the row's solution is a solved grid agreeing with its givens."""
  cells = {str(d + 1): d for d in range(sudoku4.NUM_DIGITS)}
  cells.update({".": sudoku4.BLANK, "?": sudoku4.MASK_ID})
  ids = [cells[ch] for ch in f"{prompt}{completion}" if ch in cells]
  if len(ids) != sudoku4.LENGTH:
    return 0.0
  return float(sudoku4.checks(np.array([ids]))["solved"][0])
