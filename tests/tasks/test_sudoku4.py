"""4x4 Sudoku: the 288 grids, the enumeration oracle against brute force, checks, d1's format."""

import itertools

import jax
import numpy as np
import pytest

from mdjax import sampling, tasks
from mdjax.tasks import sudoku4

RHO = 0.5


def test_the_288_grids_are_distinct_and_solved():
  grids = sudoku4.grids()
  assert grids.shape == (288, 16)
  assert {g.tobytes() for g in grids} == {g.astype(np.int32).tobytes()
                                          for g in all_solved_grids()}
  assert len({g.tobytes() for g in grids}) == 288
  assert sudoku4.is_solved(grids).all()
  broken = grids[:1].copy()
  broken[0, [0, 1]] = broken[0, [1, 0]]  # a swap inside a row breaks its columns
  assert not sudoku4.is_solved(broken)[0]


def all_solved_grids():
  """The solved grids found independently of the module: every 4^16 digit string would be
  too many, so every choice of four rows with distinct digits, kept where each column and
  each 2x2 box holds four distinct digits."""
  rows = np.array(list(itertools.permutations(range(4))))
  pick = np.array(list(itertools.product(range(24), repeat=4)))
  g = rows[pick]  # N x 4 x 4
  cols_ok = np.all(np.sort(g, axis=1) == np.arange(4)[None, :, None], axis=(1, 2))
  boxes = g.reshape(-1, 2, 2, 2, 2).transpose(0, 1, 3, 2, 4).reshape(-1, 4, 4)
  boxes_ok = np.all(np.sort(boxes, -1) == np.arange(4), axis=(1, 2))
  return g[cols_ok & boxes_ok].reshape(-1, 16)


def brute_marginals(state, rho, grids):
  """p(x_i | visible) by summing the law over every (grid, given pattern): a prompt cell
  is the grid's digit w.p. rho, else BLANK, independently of the others."""
  acc, total = np.zeros((32, 5)), 0.0
  for g in grids:
    w = 1.0
    for c in range(16):
      t = state[c]
      if t == sudoku4.MASK_ID:
        continue
      w *= (1 - rho) if t == sudoku4.BLANK else (rho if g[c] == t else 0.0)
    if np.any((state[16:] != sudoku4.MASK_ID) & (state[16:] != g)):
      w = 0.0
    if w == 0:
      continue
    total += w
    acc[16 + np.arange(16), g] += w
    acc[np.arange(16), g] += w * rho
    acc[np.arange(16), sudoku4.BLANK] += w * (1 - rho)
  return acc / total


def test_enumeration_oracle_marginals_match_brute_force():
  params = sudoku4.Params(given_probability=RHO)
  rng = np.random.default_rng(0)
  data = np.array(sudoku4.sample_data(jax.random.key(0), 6, params))
  grids = all_solved_grids()
  for state in data:
    state[rng.random(32) < rng.uniform(0.3, 0.9)] = sudoku4.MASK_ID
    probs, possible = sudoku4.exact_probs(state[None], params)
    assert bool(possible[0])
    masked = state == sudoku4.MASK_ID
    np.testing.assert_allclose(np.asarray(probs[0])[masked], brute_marginals(state, RHO, grids)[masked],
                               atol=1e-5)


def test_impossible_states_and_checks():
  params = sudoku4.DEFAULT
  grid = sudoku4.grids()[0]
  state = np.full(32, sudoku4.MASK_ID, np.int32)
  state[16], state[17] = 0, 0  # two equal digits in one row
  assert sudoku4.is_impossible(state[None])[0]
  good = np.concatenate([np.where(np.arange(16) % 3 == 0, grid, sudoku4.BLANK), grid])[None]
  bad_given = good.copy()
  bad_given[0, 0] = (grid[0] + 1) % 4  # a given the solution contradicts
  checks = sudoku4.checks(np.concatenate([good, bad_given]), params)
  assert checks["solved"].tolist() == [True, False]
  assert checks["well_formed"].tolist() == [True, True]


@pytest.mark.slow
def test_an_exact_sampler_solves_every_puzzle():
  task = tasks.get("sudoku4")
  canvas = np.array(task.sample_data(jax.random.key(1), 64))
  canvas[:, 16:] = task.mask_id
  out = sampling.sample(task.exact_denoiser, None, jax.random.key(2), canvas,
                        sampling.RandomOrderSpec())
  assert task.checks(out.tokens_BxL)["solved"].all()
  assert (np.asarray(out.tokens_BxL)[:, :16] == canvas[:, :16]).all()


def test_d1_format_round_trip_and_reward():
  grid = sudoku4.grids()[5]
  row = np.concatenate([np.where(np.arange(16) < 8, grid, sudoku4.BLANK), grid])
  record = sudoku4.to_d1(row[None])[0]
  assert record["Puzzle"][8:] == "0" * 8 and set(record["Solution"]) == set("1234")
  np.testing.assert_array_equal(sudoku4.from_d1(record["Puzzle"], record["Solution"]), row)
  assert sudoku4.d1_reward(record["Puzzle"], record["Solution"], record["Solution"]) == 1.0
  wrong = record["Solution"][:8] + "".join(str(5 - int(c)) for c in record["Solution"][8:])
  assert sudoku4.d1_reward(record["Puzzle"], record["Solution"], wrong) == 0.0
  assert sudoku4.d1_reward(record["Puzzle"], record["Solution"], "12") == 0.0
  with pytest.raises(ValueError, match="puzzle"):
    sudoku4.from_d1("12")
  with pytest.raises(ValueError, match="given_probability"):
    tasks.get("sudoku4", {"given_probability": 1.0})
