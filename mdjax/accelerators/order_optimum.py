"""The best any unmasking order can do on sudoku4 with its exact oracle, greedy values and
LLaDA's even count of commits a step: the ceiling of a learned order policy at K calls.

At temperature 0 a step's values are the oracle's argmax at every masked cell (ties to the
lowest digit, as `transforms.draw_values`), so a run is a function of the positions chosen,
and a puzzle is solvable in K steps iff some sequence of choices (k_i cells at step i) keeps
the committed cells consistent with one of the 288 grids: the last canvas is then that grid.
`solvable` searches those sequences depth first: a cell every consistent grid agrees on
(determined) is always safe and stays so, so a step chooses j of the ambiguous cells and
fills the rest of its count with determined ones (which does not matter), fewest ambiguous
first; states are memoised. The fraction of solvable puzzles is the exact optimum at K.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from mdjax.tasks import sudoku4


def even_counts(n: int, steps: int) -> list[int]:
  """LLaDA's even count: n // K a step, one more on the first n % K steps."""
  return [n // steps + (i < n % steps) for i in range(steps)]


def _argmax_values(grids_GxC: np.ndarray) -> np.ndarray:
  """The oracle's greedy value at every cell: the most frequent digit, ties to the lowest."""
  counts_CxD = np.stack([(grids_GxC == d).sum(0) for d in range(sudoku4.NUM_DIGITS)], -1)
  return counts_CxD.argmax(-1)


def solvable(puzzle_C: np.ndarray, steps: int, max_nodes: int = 200_000) -> bool | None:
  """Whether some order fills the puzzle's 16 solution cells validly in `steps` greedy steps
  (None when the search passes max_nodes states)."""
  grids = sudoku4.grids()
  given = puzzle_C != sudoku4.BLANK
  start = np.flatnonzero((grids[:, given] == puzzle_C[given]).all(-1))
  counts = even_counts(sudoku4.CELLS, steps)
  seen: dict = {}
  nodes = [0]

  def search(alive: np.ndarray, masked: frozenset, step: int) -> bool:
    if not masked or len(alive) == 1:
      return True  # one grid left: every cell is determined, every commit agrees with it
    key = (alive.tobytes(), masked, step)
    if key in seen:
      return seen[key]
    nodes[0] += 1
    if nodes[0] > max_nodes:
      raise _Budget
    sub = grids[alive]
    values = _argmax_values(sub)
    agree_GxC = sub == values[None]
    ambiguous = [c for c in sorted(masked) if not agree_GxC[:, c].all()]
    determined = [c for c in sorted(masked) if agree_GxC[:, c].all()]
    k = min(counts[step], len(masked))
    found = False
    for j in range(max(0, k - len(determined)), min(k, len(ambiguous)) + 1):
      for chosen in itertools.combinations(ambiguous, j):
        keep = agree_GxC[:, list(chosen)].all(-1)
        if not keep.any():
          continue
        rest = masked - set(chosen) - set(determined[:k - j])
        if search(alive[keep], frozenset(rest), step + 1):
          found = True
          break
      if found:
        break
    seen[key] = found
    return found

  try:
    return search(start, frozenset(range(sudoku4.CELLS)), 0)
  except _Budget:
    return None


class _Budget(Exception):
  """The search passed its node budget."""


def optimum(puzzles_BxC: np.ndarray, steps: int, max_nodes: int = 200_000) -> dict:
  """The exact optimum's accuracy over puzzles at K = steps, its binomial standard error,
  and the per-row answers (undecided rows: the search's budget ran out)."""
  solved = [solvable(np.asarray(p), steps, max_nodes) for p in puzzles_BxC]
  decided = np.array([s for s in solved if s is not None], bool)
  rows = len(solved)
  acc = float(decided.sum() / rows)
  return {"steps": steps, "rows": rows, "accuracy": acc,
          "accuracy_se": float(np.sqrt(acc * (1 - acc) / rows)),
          "undecided": rows - len(decided), "solvable_B": solved}


def optima(puzzles_BxC: np.ndarray, steps: Sequence[int]) -> list[dict]:
  return [optimum(puzzles_BxC, k) for k in steps]
