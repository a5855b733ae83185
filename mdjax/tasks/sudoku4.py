"""4x4 Sudoku: a prompt of given cells, then the solved grid.

The law: a grid uniform on the 288 solved 4x4 grids (rows, columns and 2x2 boxes each
hold 1-4 once), and each cell given in the prompt independently with probability
`given_probability` (else shown as BLANK). Layout (L = 32): positions 0-15 the prompt
(row-major cells: a digit, or BLANK), 16-31 the solution (digits). Ids: 0-3 the digits
1-4, BLANK 4, MASK 5. A sample is valid (`solved`) when its solution is a solved grid
that agrees with every given cell; a puzzle may have several solutions, and each counts.

The exact denoiser enumerates the 288 grids: at any partial state the posterior on grids
is uniform on those consistent with the visible givens and solution cells (a visible
BLANK says nothing of the grid), so every conditional is exact. A masked prompt cell is
BLANK with probability 1 - given_probability, else the grid's digit there. At an
impossible state (no consistent grid, a BLANK in the solution, a digit out of place)
the masked positions get the all-masked marginals; `is_impossible` flags the row.

d1's format (its CSV's `Puzzle` and `Solution` columns: 16 characters, digits 1-4, 0 for
a blank): `to_d1` / `from_d1`, and `d1_reward` scores an answer as d1's RL reward does
(the fraction of the puzzle's blank cells the answer fills correctly).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.noise import exact
from mdjax.tasks.base import Task

NUM_DIGITS = 4
BLANK, MASK_ID = 4, 5
VOCAB_SIZE = 5
CELLS = 16
LENGTH = 2 * CELLS
PROMPT = np.arange(CELLS)
SOLUTION = np.arange(CELLS, LENGTH)


@functools.lru_cache(maxsize=1)
def grids() -> np.ndarray:
  """The 288 solved 4x4 grids (288 x 16, ids 0-3), row-major: every choice of four row
  permutations, kept where columns and boxes are full."""
  rows_Rx4 = np.array(list(itertools.permutations(range(NUM_DIGITS))))
  choice_Nx4 = np.stack(np.meshgrid(*[np.arange(len(rows_Rx4))] * 4, indexing="ij"), -1)
  candidates = rows_Rx4[choice_Nx4.reshape(-1, 4)].reshape(-1, CELLS)
  return candidates[is_solved(candidates)].astype(np.int32)


def is_solved(grid_BxC) -> np.ndarray:
  """Whether each row of 16 cells is a solved grid (numpy bool_B)."""
  g = np.asarray(grid_BxC).reshape(-1, 4, 4)
  boxes = g.reshape(-1, 2, 2, 2, 2).transpose(0, 1, 3, 2, 4).reshape(-1, 4, 4)
  full = lambda a: np.all(np.sort(a, -1) == np.arange(NUM_DIGITS), -1).all(-1)
  return full(g) & full(g.transpose(0, 2, 1)) & full(boxes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Params:
  """Task parameters (hashable: static under jit)."""

  given_probability: float = 0.5  # each cell is a given with this probability

  def __post_init__(self):
    p = self.given_probability
    if not (isinstance(p, (int, float)) and not isinstance(p, bool) and 0.0 < p < 1.0):
      raise ValueError(f"given_probability={p!r} must lie in (0, 1) (exclusive: a "
                       "probability of 0 or 1 makes prompt cells deterministic).")


DEFAULT = Params()


@functools.partial(jax.jit, static_argnames=("batch", "params"))
def sample_data(key: jax.Array, batch: int, params: Params = DEFAULT) -> jax.Array:
  """Draws `batch` (prompt, solution) rows (tokens_BxL)."""
  k_grid, k_given = jax.random.split(key)
  grid_BxC = jnp.asarray(grids())[jax.random.randint(k_grid, (batch,), 0, len(grids()))]
  given_BxC = jax.random.bernoulli(k_given, params.given_probability, (batch, CELLS))
  prompt_BxC = jnp.where(given_BxC, grid_BxC, BLANK)
  return jnp.concatenate([prompt_BxC, grid_BxC], 1).astype(jnp.int32)


def _posterior(tokens_BxL: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Weights of the 288 grids (B x G, uniform on the consistent ones) and a consistency
  flag of the visible tokens that the grids cannot see (ids in range)."""
  table_GxC = jnp.asarray(grids())
  prompt_BxC, sol_BxC = tokens_BxL[:, :CELLS], tokens_BxL[:, CELLS:]
  given_BxC = prompt_BxC < NUM_DIGITS  # a visible digit; BLANK and MASK constrain nothing
  sol_visible_BxC = sol_BxC != MASK_ID
  agree_BxGxC = ((~given_BxC[:, None] | (table_GxC[None] == prompt_BxC[:, None]))
                 & (~sol_visible_BxC[:, None] | (table_GxC[None] == sol_BxC[:, None])))
  consistent_BxG = agree_BxGxC.all(-1)
  ids_ok_B = (jnp.all((prompt_BxC >= 0) & (prompt_BxC <= MASK_ID), -1)
              & jnp.all((sol_BxC >= 0) & ((sol_BxC < NUM_DIGITS) | ~sol_visible_BxC), -1))
  return consistent_BxG.astype(jnp.float32), ids_ok_B


def _marginals(tokens_BxL, given_probability: float):
  weight_BxG, ids_ok_B = _posterior(tokens_BxL)
  z_B = weight_BxG.sum(-1)
  possible_B = ids_ok_B & (z_B > 0)
  post_BxG = weight_BxG / jnp.where(z_B > 0, z_B, 1.0)[:, None]
  onehot_GxCxD = jax.nn.one_hot(jnp.asarray(grids()), NUM_DIGITS)
  sol_BxCxD = jnp.einsum("bg,gcd->bcd", post_BxG, onehot_GxCxD)
  pad = jnp.zeros(sol_BxCxD.shape[:2] + (VOCAB_SIZE - NUM_DIGITS,))
  sol_BxCxV = jnp.concatenate([sol_BxCxD, pad], -1)
  prompt_BxCxV = jnp.concatenate(
      [given_probability * sol_BxCxD,
       jnp.full(sol_BxCxD.shape[:2] + (1,), 1.0 - given_probability)], -1)
  return jnp.concatenate([prompt_BxCxV, sol_BxCxV], 1), possible_B


@functools.lru_cache(maxsize=16)
def _prior(params: Params) -> np.ndarray:
  """The all-masked marginals (L x V), computed once (outside any trace: `exact_probs`
  takes it as a constant)."""
  empty = jnp.full((1, LENGTH), MASK_ID, jnp.int32)
  return np.asarray(jax.jit(_marginals, static_argnums=1)(empty, params.given_probability)[0][0])


def exact_probs(tokens_BxL: jax.Array, params: Params = DEFAULT) -> tuple[jax.Array, jax.Array]:
  """Exact conditionals (B x L x V) and `possible_B`; visible positions get a one-hot of
  their token, masked ones of an impossible row the all-masked marginals."""
  return _exact_probs(tokens_BxL, _prior(params), params.given_probability)


@functools.partial(jax.jit, static_argnums=2)
def _exact_probs(tokens_BxL, prior_LxV, given_probability: float):
  probs, possible_B = _marginals(tokens_BxL, given_probability)
  probs = jnp.where(possible_B[:, None, None], probs, prior_LxV[None])
  visible = tokens_BxL != MASK_ID
  onehot = jax.nn.one_hot(jnp.minimum(tokens_BxL, VOCAB_SIZE - 1), VOCAB_SIZE)
  return jnp.where(visible[..., None], onehot, probs), possible_B


@functools.lru_cache(maxsize=4)
def support(params: Params = DEFAULT) -> exact.Support:
  """The law enumerated: one component per solved grid (uniform), each prompt cell its digit
  with probability given_probability else BLANK, each solution cell its digit."""
  grid_GxC = grids()
  digits_GxCxV = np.eye(VOCAB_SIZE, dtype=np.float32)[grid_GxC]
  blank_V = np.eye(VOCAB_SIZE, dtype=np.float32)[BLANK]
  prompt = params.given_probability * digits_GxCxV + (1.0 - params.given_probability) * blank_V
  laws = np.concatenate([prompt, digits_GxCxV], 1).astype(np.float32)
  return exact.Support(laws, np.full(len(grid_GxC), 1.0 / len(grid_GxC), np.float32))


def make_exact_denoiser(params: Params = DEFAULT):
  """The denoiser contract for these parameters (its params and t_B are unused)."""

  prior = _prior(params)

  def exact_denoiser(unused_params, tokens_BxL, t_B):
    del unused_params, t_B
    return jnp.log(_exact_probs(jnp.asarray(tokens_BxL), prior, params.given_probability)[0])

  return exact_denoiser


def is_impossible(tokens_BxL, params: Params = DEFAULT):
  """True for rows the law can never produce."""
  return ~exact_probs(jnp.asarray(tokens_BxL), params)[1]


def checks(tokens_BxL, params: Params = DEFAULT) -> dict[str, np.ndarray]:
  """solved: the solution is a solved grid agreeing with every given cell; well_formed:
  prompt cells are digits or BLANK and solution cells digits (numpy bool_B)."""
  x = np.asarray(tokens_BxL)
  prompt, sol = x[:, :CELLS], x[:, CELLS:]
  well_formed = np.all((prompt >= 0) & (prompt <= BLANK), 1) & np.all(
      (sol >= 0) & (sol < NUM_DIGITS), 1)
  agrees = np.all((prompt == BLANK) | (prompt == sol), 1)
  return {"well_formed": well_formed,
          "solved": well_formed & agrees & is_solved(np.clip(sol, 0, NUM_DIGITS - 1))}


def sample_metrics(tokens_BxL, params: Params = DEFAULT) -> dict[str, float]:
  """Fractions solved and well-formed."""
  return {name: float(v.mean()) for name, v in checks(tokens_BxL, params).items()}


def decode(tokens_L, params: Params = DEFAULT) -> str:
  """The prompt and the solution as two 4x4 boards ('.' blank, '?' masked)."""
  char = lambda t: "?" if t == MASK_ID else "." if t == BLANK else str(t + 1)
  cells = [char(int(t)) for t in tokens_L]
  board = lambda c: "/".join("".join(c[r * 4:(r + 1) * 4]) for r in range(4))
  return f"{board(cells[:CELLS])} -> {board(cells[CELLS:])}"


def to_d1(tokens_BxL) -> list[dict[str, str]]:
  """Rows as d1's CSV records: {"Puzzle": 16 chars (0 blank), "Solution": 16 chars}."""
  x = np.asarray(tokens_BxL)
  text = lambda cells, blank: "".join(blank if c == BLANK else str(int(c) + 1) for c in cells)
  return [{"Puzzle": text(row[:CELLS], "0"), "Solution": text(row[CELLS:], "?")} for row in x]


def from_d1(puzzle: str, solution: str | None = None) -> np.ndarray:
  """tokens_L of a d1 record (the solution masked when None)."""
  for name, value in (("puzzle", puzzle), ("solution", solution)):
    if value is not None and not (len(value) == CELLS and set(value) <= set("01234")):
      raise ValueError(f"{name}={value!r} must be 16 characters of 0-4 (d1's format).")
  prompt = [BLANK if ch == "0" else int(ch) - 1 for ch in puzzle]
  sol = [MASK_ID] * CELLS if solution is None else [int(ch) - 1 for ch in solution]
  return np.array(prompt + sol, np.int32)


def d1_reward(puzzle: str, solution: str, answer: str) -> float:
  """d1's rule (reward_func.py `validate_sudoku_solution`): the fraction of the puzzle's
  blank cells that `answer`'s digits (cut to 16, padded with 0 to 16) fill with the
  solution's digit; 0 for an answer without digits or a puzzle without blanks."""
  digits = "".join(ch for ch in answer if ch.isdigit())[:CELLS]
  blanks = [i for i, ch in enumerate(puzzle) if ch == "0"]
  if not digits or not blanks:
    return 0.0
  digits = digits.ljust(CELLS, "0")
  return sum(digits[i] == solution[i] for i in blanks) / len(blanks)


def bind(**params_kwargs) -> Task:
  """This task with other parameters (`Params(**params_kwargs)`) as a Task value."""
  fields = {f.name for f in dataclasses.fields(Params)}
  unknown = sorted(set(params_kwargs) - fields)
  if unknown:
    raise ValueError(f"task_kwargs={params_kwargs!r}: unknown {unknown}; sudoku4 takes "
                     f"{sorted(fields)}.")
  return make_task(Params(**params_kwargs))


@functools.lru_cache(maxsize=16)
def make_task(params: Params = DEFAULT) -> Task:
  """The Task value of these parameters (one per parameters: its functions compile once)."""
  bound = lambda fn: functools.partial(fn, params=params)
  return Task(name="sudoku4", length=LENGTH, vocab_size=VOCAB_SIZE, mask_id=MASK_ID,
              sample_data=bound(sample_data), decode=bound(decode),
              sample_metrics=bound(sample_metrics), checks=bound(checks),
              is_impossible=bound(is_impossible), exact_denoiser=make_exact_denoiser(params),
              support=bound(support), params=params)
