"""Countdown: combine the given numbers, each exactly once, with + - * / into the target.

A reward task for RL on a pretrained text model, in d1's format (dllm-reasoning/d1): the
3-number variant of its training data (Jiayi-Pan/Countdown-Tasks-3to4 filtered to three
numbers) and of its test file dataset/countdown_cd3_test.jsonl ({"input": "30,100,93",
"output": "23"}: numbers 1-100, targets 1-100).

`generate(count, seed)`: puzzles made here, each solvable by construction: three numbers
uniform on [min_number, max_number], a random order, two random operations and a random
bracketing, kept when the value is an integer in [1, max_target] (divisions exact at every
step), else drawn again. `prompt_text(numbers, target)`: d1's user message
(diffu-grpo/data_utils.py `get_countdown_questions`; the chat template is the model's).
`reward(completion, numbers, target)`: d1's `countdown_reward_func` (reward_func.py
`compute_score`): 1.0 for a correct equation in the last <answer>...</answer>, 0.1 (format
credit) when an answer is there but uses other numbers, does not evaluate or misses the
target, 0 without an answer. `solve` finds an equation by brute force.

No `Task` (token-level training) is defined: it is not in `mdjax.tasks.TASKS`.
"""

from __future__ import annotations

import ast
import fractions
import itertools
import math
import operator
import re

import numpy as np

from mdjax import jsonl

# d1's SYSTEM_PROMPT (data_utils.py), shared by its GSM8K and Countdown prompts.
SYSTEM_PROMPT = """
Respond in the following format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>
"""

FORMAT_SCORE, SCORE = 0.1, 1.0  # d1's compute_score defaults
_OPS = ("+", "-", "*", "/")


def prompt_text(numbers, target) -> str:
  """d1's user message for a puzzle (numbers printed as a Python list, as d1 formats
  the dataset's list)."""
  nums = [int(n) for n in numbers]
  return (f"{SYSTEM_PROMPT}\nUsing only the numbers {nums}, create an arithmetic expression "
          f"that evaluates to exactly {int(target)}. You must use all numbers from the list, "
          "and each number must be used exactly once. You may use the operations +, -, *, "
          "and / as needed. After reasoning, provide only your final expression inside "
          "<answer></answer> tags without including an equals sign or the target number. "
          "For example, if the numbers are [2, 3, 4] and the target is 5, a valid answer "
          "is: <answer>\n2*4-3\n</answer>")


def _apply(op: str, a: fractions.Fraction, b: fractions.Fraction):
  if op == "/":
    return None if b == 0 else a / b
  return {"+": a + b, "-": a - b, "*": a * b}[op]


def _values(numbers):
  """(value, expression) of every bracketing of every order and choice of operations of
  `numbers` (exact fractions; a division by zero left out)."""
  if len(numbers) == 1:
    yield fractions.Fraction(numbers[0]), str(numbers[0])
    return
  for split in range(1, len(numbers)):
    for a, ea in _values(numbers[:split]):
      for b, eb in _values(numbers[split:]):
        for op in _OPS:
          value = _apply(op, a, b)
          if value is not None:
            yield value, f"({ea}{op}{eb})"


def solve(numbers, target) -> str | None:
  """An expression of `numbers`, each used once, whose value is `target`, or None."""
  for order in itertools.permutations([int(n) for n in numbers]):
    for value, expression in _values(order):
      if value == target:
        return expression[1:-1] if len(order) > 1 else expression
  return None


def _check(count, num_numbers, min_number, max_number, max_target) -> None:
  for name, value, least in (("count", count, 0), ("num_numbers", num_numbers, 2),
                             ("min_number", min_number, 1), ("max_target", max_target, 1)):
    if not (isinstance(value, (int, np.integer)) and value >= least):
      raise ValueError(f"{name}={value!r} must be an integer >= {least}.")
  if not (isinstance(max_number, (int, np.integer)) and max_number >= min_number):
    raise ValueError(f"max_number={max_number!r} must be an integer >= min_number={min_number}.")


def generate(count: int, seed: int, *, num_numbers: int = 3, min_number: int = 1,
             max_number: int = 100, max_target: int = 100) -> list[dict]:
  """`count` puzzles {"numbers": [ints], "target": int}, solvable by construction (see the
  module docstring); the same seed gives the same puzzles."""
  _check(count, num_numbers, min_number, max_number, max_target)
  rng = np.random.default_rng(seed)
  puzzles = []
  while len(puzzles) < count:
    numbers = [int(n) for n in rng.integers(min_number, max_number + 1, num_numbers)]
    # A random bracketing: combine two adjacent values with a random operation until one is
    # left (every binary tree over the shuffled numbers is reachable).
    values = [fractions.Fraction(n) for n in numbers]
    while len(values) > 1:
      i = int(rng.integers(len(values) - 1))
      value = _apply(_OPS[int(rng.integers(len(_OPS)))], values[i], values[i + 1])
      if value is None:
        break
      values[i:i + 2] = [value]
    if len(values) == 1 and values[0].denominator == 1 and 1 <= values[0] <= max_target:
      puzzles.append({"numbers": numbers, "target": int(values[0])})
  return puzzles


def to_d1(puzzle: dict) -> dict:
  """A puzzle as a line of d1's test file: {"input": "30,100,93", "output": "23"}."""
  return {"input": ",".join(str(n) for n in puzzle["numbers"]), "output": str(puzzle["target"])}


def from_d1(record: dict | str, where: str = "countdown record") -> dict:
  """A line (or its dict) of d1's test file as {"numbers", "target"}; a line nested deeper
  than `jsonl.MAX_DEPTH` is a ValueError naming `where` (its file and line)."""
  if isinstance(record, str):
    record = jsonl.loads(record, where)
  return {"numbers": [int(n) for n in record["input"].split(",")],
          "target": int(record["output"])}


# --- d1's reward (reward_func.py) ---------------------------------------------------------


def extract_solution(solution_str: str) -> str | None:
  """The last <answer>...</answer>'s text, stripped (None without one)."""
  matches = re.findall(r"<answer>(.*?)</answer>", solution_str, re.DOTALL)
  return matches[-1].strip() if matches else None


def validate_equation(equation_str: str, available_numbers) -> bool:
  """Whether the equation's numbers are exactly the available ones (each once)."""
  numbers_in_eq = [int(n) for n in re.findall(r"\d+", equation_str)]
  return sorted(numbers_in_eq) == sorted(int(n) for n in available_numbers)


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_POWER_BITS = 10_000


def _eval(node):
  if isinstance(node, ast.Expression):
    return _eval(node.body)
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return node.value
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _UNARY[type(node.op)](_eval(node.operand))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _eval(node.left), _eval(node.right)
    if (isinstance(node.op, ast.Pow) and abs(left) > 1
        and abs(right) * math.log2(abs(left)) > _MAX_POWER_BITS):
      # d1 evals `**` as Python does, and a huge power (99**99**99) would not finish: a
      # power of more than 2**10000 is scored as not evaluable (it is no countdown target).
      raise OverflowError("power too large")
    return _BINARY[type(node.op)](left, right)
  raise ValueError(f"unsupported expression node {type(node).__name__}")


def evaluate_equation(equation_str: str):
  """The equation's value as d1 computes it (Python arithmetic on the allowed characters
  digits + - * / ( ) . and spaces), or None where it is not evaluable."""
  if not re.match(r"^[\d+\-*/().\s]+$", equation_str):
    return None
  try:
    return _eval(ast.parse(equation_str.strip(), mode="eval"))
  except Exception:  # d1: any failure (syntax, division by zero) is "not evaluable"
    return None


def reward(completion: str, numbers, target, *, format_score: float = FORMAT_SCORE,
           score: float = SCORE) -> float:
  """d1's `compute_score`: score for a correct answer, format_score for an answer that is
  wrong, 0 for none."""
  equation = extract_solution(completion)
  if equation is None:
    return 0.0
  if not validate_equation(equation, numbers):
    return format_score
  result = evaluate_equation(equation)
  if result is None:
    return format_score
  try:
    return score if abs(result - target) < 1e-5 else format_score
  except Exception:
    return format_score
