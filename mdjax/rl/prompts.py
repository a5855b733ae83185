"""d1's user messages (dllm-reasoning/d1, diffu-grpo/data_utils.py), for RL on a chat model:
render them with `model.render_chat([{"role": "user", "content": text}])`.

  gsm8k(question)            SYSTEM_PROMPT + "\\n\\n" + question (`get_gsm8k_questions`)
  sudoku(puzzle)             SUDOKU_SYSTEM_PROMPT + the puzzle, 16 chars, 0 blank
  countdown(numbers, target) `mdjax.tasks.countdown.prompt_text`
"""

from __future__ import annotations

from mdjax.tasks import countdown as _countdown
from mdjax.tasks import sudoku4

SYSTEM_PROMPT = _countdown.SYSTEM_PROMPT

SUDOKU_SYSTEM_PROMPT = """
Please solve the following 4x4 Sudoku puzzle. The puzzle is provided as a 16-character string reading left-to-right, top-to-bottom, where '0' represents empty cells.

Rules:
- Fill empty cells with digits 1-4
- Each row must contain digits 1-4 exactly once
- Each column must contain digits 1-4 exactly once
- Each 2x2 box must contain digits 1-4 exactly once

Important: Your solution must be a COMPLETE 16-character string with only the digits 1-4, representing your final solved grid.

Respond in this exact format:
<reasoning>
Your step-by-step solving process
</reasoning>
<answer>
[16-character solution string with no spaces or separators]
</answer>
"""  # noqa: E501 (d1's text, its lines as they are)


def gsm8k(question: str) -> str:
  return SYSTEM_PROMPT + "\n\n" + question


def sudoku(puzzle: str) -> str:
  sudoku4.from_d1(puzzle)  # 16 characters of 0-4, else a ValueError naming it
  return f"{SUDOKU_SYSTEM_PROMPT}\n\nSolve the following Sudoku puzzle: {puzzle}\n"


countdown = _countdown.prompt_text
