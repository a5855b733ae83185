"""The reward registry, d1's rewards on hand-made answers, the exact tasks' rewards, and the
Countdown generator (every puzzle solvable, found by an independent brute force)."""

import fractions
import hashlib
import itertools
import math

import numpy as np
import pytest

from mdjax import rl
from mdjax.rl import prompts, rewards
from mdjax.tasks import countdown, scan_and_add, sudoku4, two_color


def one(name, completion, target=None, prompt=""):
  return rewards.get(name)(prompt, completion, target)


# --- d1's rewards ------------------------------------------------------------------------------

PUZZLE, SOLUTION = "2010003002004100", "2314143232414123"  # d1's CSV format, 0 = blank


def test_sudoku_is_d1s_fraction_of_blank_cells():
  target = {"puzzle": PUZZLE, "solution": SOLUTION}
  assert one("sudoku", f"<reasoning>\nok\n</reasoning>\n<answer>\n{SOLUTION}\n</answer>",
             target) == 1.0
  # One of the 10 blanks wrong (cell 1: 4 for 3); a given cell wrong does not count.
  wrong = "24" + SOLUTION[2:]
  assert one("sudoku", f"<answer>{wrong}</answer>", target) == pytest.approx(0.9)
  assert one("sudoku", f"<answer>4{SOLUTION[1:]}</answer>", target) == 1.0
  # Digits only, the last answer read; a short answer is padded with 0s (the first 8 cells
  # hold blanks 1, 3, 4, 5, 7: 5 of 10 right).
  assert one("sudoku", f"<answer>a</answer><answer>{SOLUTION[:4]} {SOLUTION[4:8]}</answer>",
             target) == pytest.approx(0.5)
  assert one("sudoku", SOLUTION, target) == 0.0  # no answer tags
  assert one("sudoku", "<answer>none</answer>", target) == 0.0
  with pytest.raises(ValueError, match="puzzle='123' must be 16 characters"):
    one("sudoku", "<answer>1</answer>", {"puzzle": "123", "solution": SOLUTION})


def test_countdown_is_d1s_score():
  target = {"numbers": [30, 100, 93], "target": 23}  # the first line of d1's test file
  assert one("countdown", "<answer>\n30-(100-93)\n</answer>", target) == 1.0
  assert one("countdown", "<answer>30 - 100 + 93</answer>", target) == 1.0
  assert one("countdown", "<answer>30-100+93</answer> <answer>100-93</answer>", target) == 0.1
  assert one("countdown", "<answer>30+100-93</answer>", target) == 0.1  # evaluates to 37
  assert one("countdown", "<answer>30/(100-100)</answer>", target) == 0.1  # numbers wrong
  assert one("countdown", "<answer>30-(100-93)=23</answer>", target) == 0.1  # '=' not allowed
  assert one("countdown", "30-(100-93)", target) == 0.0  # no answer
  # Division by zero and powers d1's eval would never finish are both not evaluable.
  assert one("countdown", "<answer>30/(100-100)+93</answer>",
             {"numbers": [30, 100, 100, 93], "target": 23}) == 0.1
  assert one("countdown", "<answer>99**99**99</answer>",
             {"numbers": [99, 99, 99], "target": 1}) == 0.1
  assert one("countdown", "<answer>(7-6)**99**99</answer>",
             {"numbers": [7, 6, 99, 99], "target": 1}) == 1.0
  assert one("countdown", "<answer>8/(3-8/3)</answer>",
             {"numbers": [8, 3, 8, 3], "target": 24}) == 1.0  # float within 1e-5


GSM_GOOD = "<reasoning>\nThree plus four.\n</reasoning>\n<answer>\n7\n</answer>\n"


def test_gsm8k_rewards_are_d1s():
  assert rewards.extract_hash_answer("3 + 4 = <<3+4=7>>7\n#### 7") == "7"
  assert rewards.D1_GSM8K == ("gsm8k_xmlcount", "gsm8k_soft_format", "gsm8k_strict_format",
                              "gsm8k_int", "gsm8k_correctness")
  good = [one(name, GSM_GOOD, "7") for name in rewards.D1_GSM8K]
  # soft_format's '.' does not cross the newlines (d1's re.match without DOTALL): 0 here.
  assert good == [0.5, 0.0, 0.5, 0.5, 2.0]
  assert one("gsm8k_soft_format", "<reasoning>a</reasoning> <answer>7</answer>") == 0.5
  assert one("gsm8k_correctness", GSM_GOOD, "8") == 0.0
  assert one("gsm8k_int", GSM_GOOD.replace("\n7\n", "\n7.5\n"), "7") == 0.0
  assert one("gsm8k_strict_format", "x" + GSM_GOOD) == 0.0
  # Text after the answer costs 0.001 a character in the tag count.
  assert one("gsm8k_xmlcount", GSM_GOOD + "abc") == pytest.approx(0.5 - 0.003 - 0.003)


# --- the exact tasks ------------------------------------------------------------------------------


def decoded(module, tokens_L, prompt_length, **kw):
  return module.decode(tokens_L[:prompt_length], **kw), module.decode(tokens_L[prompt_length:],
                                                                     **kw)


def scan_and_add_rows(count, seed, p=scan_and_add.DEFAULT):
  """Rows built by hand: n digits, a random order of 2 adds (id 0) and n - 1 rights (id 1),
  the sum the adds read (the head starts on value 0, each right moves it one on)."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(count):
    values = rng.integers(0, 10, p.n)
    commands = rng.permutation([0] * 2 + [1] * (p.n - 1))
    total = sum(values[np.sum(commands[:i] == 1)] for i in range(len(commands))
                if commands[i] == 0)
    rows.append([scan_and_add.VALS, *values, scan_and_add.ANS, total // 100, total // 10 % 10,
                 total % 10, scan_and_add.OPS, *commands])
  return np.array(rows)


def test_exact_task_rewards_are_the_tasks_checks():
  x = scan_and_add_rows(4, 0)
  p = scan_and_add.DEFAULT
  for row in x:
    prompt, completion = decoded(scan_and_add, row, p.n + 1)
    assert one("scan_and_add_correct", completion, None, prompt) == 1.0
    bad = row.copy()
    bad[p.answer_pos[2]] = (bad[p.answer_pos[2]] + 1) % 10  # the ones digit off by one
    prompt, completion = decoded(scan_and_add, bad, p.n + 1)
    assert one("scan_and_add_correct", completion, None, prompt) == 0.0
  masked = x[0].copy()
  masked[-1] = scan_and_add.MASK_ID
  assert one("scan_and_add_correct", scan_and_add.decode(masked)) == 0.0
  assert one("two_color_valid", "red", None, "red") == 1.0
  assert one("two_color_valid", two_color.decode(np.array([1, 0]))) == 0.0
  assert one("two_color_valid", "? ?") == 0.0
  rng = np.random.default_rng(1)
  solutions = sudoku4.grids()[rng.integers(0, 288, 4)]
  givens = np.where(rng.random(solutions.shape) < 0.5, solutions, sudoku4.BLANK)
  for row in np.concatenate([givens, solutions], 1):
    prompt, completion = decoded(sudoku4, row, 16)
    assert one("sudoku4_solved", completion, None, prompt) == 1.0
    broken = row.copy()
    broken[[16, 17]] = broken[[17, 16]]  # two cells of a row swapped: its columns break
    assert one("sudoku4_solved", sudoku4.decode(broken)) == 0.0


# --- the registry -----------------------------------------------------------------------------


def test_compute_weights_and_per_function_columns():
  target = {"numbers": [30, 100, 93], "target": 23}
  completions = ["<answer>30-(100-93)</answer>", "<answer>1</answer>", "no"]
  total, per = rewards.compute(["countdown", "gsm8k_int"], ["q"] * 3, completions,
                               [target] * 3, weights=[2.0, 1.0])
  np.testing.assert_allclose(per, [[1.0, 0.0], [0.1, 0.5], [0.0, 0.0]])
  np.testing.assert_allclose(total, [2.0, 0.7, 0.0], rtol=1e-6)
  assert total.dtype == per.dtype == np.float32


def test_a_failing_reward_names_the_function_and_the_row():
  values = {"fine": 1.0, "nan_row": math.nan, "none_row": None, "text_row": "high"}

  @rewards.register("test_bad_reward")
  def bad(prompt, completion, target):
    if target == "raise_row":
      raise KeyError("no such field")
    return values[target]

  texts, completions = ["p"] * 2, ["fine completion", "x" * 500]
  for row_target, problem in (("nan_row", "returned nan"), ("none_row", "returned None"),
                              ("text_row", "returned str 'high', not a number"),
                              ("raise_row", "raised KeyError: 'no such field'")):
    with pytest.raises(rl.RewardError, match=f"reward 'test_bad_reward' {problem} at row 1 "
                       r"\(completion 'xxx+\.\.\.'\)") as info:
      rewards.compute(["test_bad_reward"], texts, completions, ["fine", row_target])
    assert isinstance(info.value, ValueError) and len(str(info.value)) < 300
  with pytest.raises(ValueError, match="reward name='test_bad_reward' is already registered"):
    rewards.register("test_bad_reward")(lambda p, c, t: 0.0)
  with pytest.raises(ValueError, match="reward='nope' is unknown"):
    rewards.compute(["nope"], ["p"], ["c"], [None])
  with pytest.raises(ValueError, match="targets holds 1 rows; completions holds 2"):
    rewards.compute(["gsm8k_int"], texts, completions, [None])
  with pytest.raises(ValueError, match="weights"):
    rewards.compute(["gsm8k_int"], texts, completions, [None] * 2, weights=[1.0, 2.0])


# --- Countdown ------------------------------------------------------------------------------------


def brute_force_values(numbers):
  """Every value of every expression using each number once with + - * / and any bracketing
  (exact fractions), written independently of mdjax.tasks.countdown."""
  if len(numbers) == 1:
    return {fractions.Fraction(numbers[0])}
  out = set()
  for k in range(1, len(numbers)):
    for left in itertools.combinations(range(len(numbers)), k):
      rest = [n for i, n in enumerate(numbers) if i not in left]
      for a in brute_force_values([numbers[i] for i in left]):
        for b in brute_force_values(rest):
          out |= {a + b, a - b, a * b} | ({a / b} if b else set())
  return out


def test_countdown_puzzles_are_solvable_and_seeded():
  puzzles = countdown.generate(20, seed=0)
  assert puzzles == countdown.generate(20, seed=0) != countdown.generate(20, seed=1)
  for puzzle in puzzles:
    numbers, target = puzzle["numbers"], puzzle["target"]
    assert len(numbers) == 3 and all(1 <= n <= 100 for n in numbers) and 1 <= target <= 100
    assert target in brute_force_values(numbers), puzzle
    expression = countdown.solve(numbers, target)
    completion = f"<reasoning>\n...\n</reasoning>\n<answer>\n{expression}\n</answer>"
    assert countdown.reward(completion, numbers, target) == 1.0
  assert countdown.solve([2, 2, 2], 100) is None  # at most 8
  # d1's test file's lines read back; its prompt text.
  line = '{"input": "30,100,93", "output": "23"}'
  assert countdown.from_d1(line) == {"numbers": [30, 100, 93], "target": 23}
  assert countdown.to_d1(countdown.from_d1(line)) == {"input": "30,100,93", "output": "23"}
  text = countdown.prompt_text([30, 100, 93], 23)
  assert text.startswith(countdown.SYSTEM_PROMPT + "\nUsing only the numbers [30, 100, 93], "
                         "create an arithmetic expression that evaluates to exactly 23.")
  with pytest.raises(ValueError, match="max_number=0 must be an integer >= min_number=1"):
    countdown.generate(2, seed=0, max_number=0)


def test_a_deep_countdown_line_is_one_line_naming_it():
  """A d1 test-file line nested 100,000 deep: a RecursionError traceback before (issue 55);
  now one ValueError naming the line (`where`) and the bound."""
  deep = "[" * 100_000 + "]" * 100_000
  with pytest.raises(ValueError) as error:
    countdown.from_d1(deep)
  assert str(error.value) == ("countdown record: nests 100,000 levels of JSON arrays and "
                              "objects; at most 256 are read.")
  with pytest.raises(ValueError, match=r"^countdown_cd3_test.jsonl line 2: nests 100,000 "):
    countdown.from_d1(deep, "countdown_cd3_test.jsonl line 2")


def test_prompts_are_d1s_text():
  """sha256 prefixes of the texts d1's data_utils.py builds for these inputs (computed once
  from its code at commit 837888f): a changed character fails."""
  digest = lambda text: hashlib.sha256(text.encode()).hexdigest()[:16]
  assert digest(prompts.gsm8k("Q?")) == "c50297784e94c471"
  assert digest(prompts.sudoku(PUZZLE)) == "a95d404955f52233"
  assert digest(prompts.countdown([30, 100, 93], 23)) == "bc134344e840aa8c"
