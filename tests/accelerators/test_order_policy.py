"""UPO's GRPO on the order policy: the gradient's sign, the trainer's rollouts against the
sampler, the exact optimum's search, and the command."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from mdjax import sampling
from mdjax.accelerators import order_optimum
from mdjax.accelerators import order_policy as trainer
from mdjax.sampling import order_policy, stepping
from mdjax.tasks import sudoku4


@pytest.mark.slow
def test_grpo_raises_the_rewarded_choice_and_lowers_the_other():
  # One step, a group of two rows on the same features: row 0 chose position 0 (reward 1),
  # row 1 chose position 1 (reward 0). The update must make row 0's choice likelier and
  # row 1's less likely; with the rewards swapped, the reverse.
  arrays = order_policy.init_arrays(jax.random.key(0), 4, 3, 3)
  feats = jnp.broadcast_to(jax.random.uniform(jax.random.key(1), (4, order_policy.NUM_FEATURES)),
                           (1, 2, 4, order_policy.NUM_FEATURES))
  rank = jnp.array([[[0, 4, 4, 4], [4, 0, 4, 4]]], jnp.int32)
  record = dict(features=feats, candidates=jnp.ones((1, 2, 4), bool), rank=rank,
                target=jnp.zeros((1, 2, 4)))
  cfg = trainer.PolicyConfig(iterations=4, beta=0.0, lr=1e-2)
  before = trainer.step_log_probs(arrays, record, 1.0)[0]
  for rewards, sign in (([1.0, 0.0], 1), ([0.0, 1.0], -1)):
    adv = jnp.asarray(trainer.group_advantages(np.array(rewards), 2))
    after_arrays, *_ = trainer.update(arrays, trainer.optimizer(cfg).init(arrays), record, adv,
                                      cfg=cfg)
    after = trainer.step_log_probs(after_arrays, record, 1.0)[0]
    assert sign * (after[0] - before[0]) > 0 and sign * (after[1] - before[1]) < 0


def test_group_advantages_center_each_group():
  np.testing.assert_allclose(trainer.group_advantages(np.array([1, 0, 0, 1, 1, 1.0]), 3),
                             [2 / 3, -1 / 3, -1 / 3, 0, 0, 0], atol=1e-6)


@pytest.mark.slow
def test_the_trainer_s_rollouts_are_the_sampler_s():
  model = mdjax.load("sudoku4")
  canvas = np.array(model.task.sample_data(jax.random.key(2), 6), np.int32)
  canvas[:, 16:] = model.mask_id
  editable = np.zeros(canvas.shape, bool)
  editable[:, 16:] = True
  policy = order_policy.example_policy(32, dim=8, hidden=8, seed=3)
  keys = stepping.row_keys(jax.random.key(5), 6)
  spec = sampling.OrderPolicySpec(steps=4, policy=policy, temperature=0.0)
  out = sampling.sample(model.denoiser, model.params, keys, canvas, spec, mask_id=model.mask_id)
  bound = sampling.BoundDenoiser(sampling.Denoiser.of(model.denoiser), model.params)
  record = trainer.rollout(bound, {k: jnp.asarray(v) for k, v in policy.arrays().items()},
                           jnp.asarray(canvas), jnp.asarray(editable), keys, steps=4,
                           mask_id=model.mask_id, temperature=0.0, policy_temperature=1.0)
  np.testing.assert_array_equal(np.asarray(record["tokens"]), np.asarray(out.tokens_BxL))
  assert (np.asarray(record["rank"]) < 32).sum(-1).tolist() == [[4] * 6] * 4


def test_the_optimum_at_one_step_is_whether_the_argmax_grid_is_solved():
  # K = 1 leaves no choice: the 16 greedy values at once, valid iff that grid is solved.
  rows = np.array(sudoku4.sample_data(jax.random.key(7), 40))[:, :16]
  for puzzle in rows:
    given = puzzle != sudoku4.BLANK
    alive = sudoku4.grids()[(sudoku4.grids()[:, given] == puzzle[given]).all(-1)]
    grid = order_optimum._argmax_values(alive) if len(alive) > 1 else alive[0]
    expect = bool((alive == grid).all(-1).any())
    assert order_optimum.solvable(puzzle, 1) == expect
  assert order_optimum.even_counts(16, 3) == [6, 5, 5]


@pytest.mark.slow
def test_the_command_writes_a_policy_the_sampler_reads(tmp_path):
  out = str(tmp_path / "policy.json")
  info = trainer.main(["--out", out, "--batches", "2", "--steps", "4", "--prompts", "2",
                       "--group", "2", "--iterations", "2", "--dim", "4", "--hidden", "4"],
                      log=lambda *a: None)
  policy = order_policy.load_policy(out)
  assert order_policy.read_info(out)["history"] == info["history"] and len(info["history"]) == 2
  assert policy.length == 32 and policy.dim == 4
