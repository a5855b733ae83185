"""Confidence decoding: scheduled counts, scores, thresholds."""

import jax
import numpy as np
import pytest

from mdjax import diffusion, sampling
from tests import stubs
from tests.sampling.common import (LENGTH, VOCAB, prompted_canvas)
from tests.sampling.common import np_score, np_top_k, softmax


@pytest.mark.slow
def test_confidence_commits_scheduled_top_k_each_step():
  batch, prompt = 32, 3
  params = stubs.stub_params(VOCAB, LENGTH, seed=3)
  tokens = prompted_canvas(batch, prompt)
  steps = 4
  for score in ("max_prob", "margin", "neg_entropy"):
    spec = sampling.ConfidenceSpec(steps=steps, score=score, record_trajectory=True,
                                   count_schedule=diffusion.CosineSchedule())
    result = sampling.sample(stubs.stub_denoiser, params, jax.random.key(0), tokens, spec)
    traj = np.asarray(result.trajectory_KxBxL)
    before = np.concatenate([np.asarray(tokens)[None], traj[:-1]])
    n = LENGTH - prompt
    remaining = np.asarray(diffusion.CosineSchedule().one_minus_alpha(
        1.0 - np.arange(1, steps + 1) / steps))
    remaining[-1] = 0.0
    target = np.floor(n * remaining + 1e-4).astype(int)
    k_expected = np.concatenate([[n], target[:-1]]) - target
    for i in range(steps):
      new = (before[i] == VOCAB) & (traj[i] != VOCAB)
      np.testing.assert_array_equal(new.sum(1), k_expected[i])
      probs = softmax(stubs.stub_logits_np(params, before[i]))
      score_np = np_score(score, probs)
      expected = np_top_k(score_np, before[i] == VOCAB, k_expected[i])
      np.testing.assert_array_equal(new, expected, err_msg=f"{score} step {i}")


def test_confidence_threshold_mode():
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = prompted_canvas()
  spec = sampling.ConfidenceSpec(steps=6, threshold=0.99, record_trajectory=True)
  result = sampling.sample(stubs.stub_denoiser, params, jax.random.key(0), tokens, spec)
  traj = np.asarray(result.trajectory_KxBxL)
  before = np.concatenate([np.asarray(tokens)[None], traj[:-1]])
  new_per_step = ((before == VOCAB) & (traj != VOCAB)).sum(-1)
  still_masked = (before == VOCAB).any(-1)
  assert np.all(new_per_step[still_masked] >= 1)
  assert not np.any(traj[-1] == VOCAB)


# --- SDAR's rules: even_block counts, the scheduled threshold floor, leftmost order, the
# transformed score ---------------------------------------------------------------------


def _steps(spec, batch=16, prompt=3, seed=0):
  """(tokens before each step K x B x L, after each step, the stub's max probabilities
  before each step) of a greedy run on the prompted canvas."""
  params = stubs.stub_params(VOCAB, LENGTH, seed=seed)
  tokens = prompted_canvas(batch, prompt)
  result = sampling.sample(stubs.stub_denoiser, params, jax.random.key(0), tokens, spec)
  after = np.asarray(result.trajectory_KxBxL)
  before = np.concatenate([np.asarray(tokens)[None], after[:-1]])
  conf = np.stack([softmax(stubs.stub_logits_np(params, b)).max(-1) for b in before])
  return before, after, conf


def test_even_block_splits_the_blocks_positions_not_its_masked_count():
  """SDAR's get_num_transfer_tokens(block_length, steps): the canvas's 12 positions over 5
  steps are [3, 3, 2, 2, 2], capped at what is left of the 9 masked: [3, 3, 2, 1, 0] (the
  "even" rule splits the 9: [2, 2, 2, 2, 1]); the most confident first."""
  spec = sampling.ConfidenceSpec(steps=5, score="prob", count_rule="even_block",
                                 temperature=0.0, record_trajectory=True)
  before, after, conf = _steps(spec)
  for i, k in enumerate([3, 3, 2, 1, 0]):
    new = (before[i] == VOCAB) & (after[i] != VOCAB)
    np.testing.assert_array_equal(new.sum(1), k)
    np.testing.assert_array_equal(new, np_top_k(conf[i], before[i] == VOCAB, k))
  # With blocks of 3 editable positions each block holds all its positions: "even"'s counts.
  blocks = sampling.ConfidenceSpec(steps=6, score="prob", count_rule="even_block",
                                   block_length=3, temperature=0.0, record_trajectory=True)
  before, after, _ = _steps(blocks)
  new_per_step = ((before == VOCAB) & (after != VOCAB)).sum(-1)
  np.testing.assert_array_equal(new_per_step, np.repeat([[2], [1]] * 3, 16, axis=1))


def test_threshold_floor_count_commits_at_least_the_scheduled_count():
  """SDAR's low_confidence_dynamic: every proposal at or above the threshold, at least the
  step's count ([3, 3, 3, 3] of 12 positions), the most confident first."""
  spec = sampling.ConfidenceSpec(steps=4, score="prob", count_rule="even_block", threshold=0.8,
                                 threshold_floor="count", temperature=0.0,
                                 record_trajectory=True)
  before, after, conf = _steps(spec)
  floor_decided = threshold_decided = 0
  for i in range(4):
    masked = before[i] == VOCAB
    above = (masked & (conf[i] >= 0.8)).sum(1)
    k = np.maximum(above, np.minimum(3, masked.sum(1)))
    floor_decided += int(((above < k) & (k > 1)).sum())
    threshold_decided += int((above > 3).sum())
    new = masked & (after[i] != VOCAB)
    np.testing.assert_array_equal(new, np_top_k(conf[i], masked, k), err_msg=f"step {i}")
  assert floor_decided and threshold_decided  # both rules decide somewhere
  assert not (after[-1] == VOCAB).any()


def test_order_position_commits_the_leftmost_masked_positions():
  """SDAR's sequential: the step's count, leftmost first ([4, 4, 4] of 12, capped)."""
  spec = sampling.ConfidenceSpec(steps=3, count_rule="even_block", order="position",
                                 temperature=0.0, record_trajectory=True)
  before, after, _ = _steps(spec)
  for i in range(3):
    masked = before[i] == VOCAB
    leftmost = masked & (np.cumsum(masked, 1) <= 4)
    np.testing.assert_array_equal((after[i] != VOCAB) & masked, leftmost)


def test_score_transformed_reads_the_drawn_distribution():
  """With top_k=1 the drawn distribution is one-hot: every proposal scores 1, so ties go to
  the lowest positions, where the untransformed score ranks by probability. At temperature 0
  the score reads the untransformed softmax."""
  common = {"steps": 3, "score": "prob", "top_k": 1, "score_transformed": True,
            "record_trajectory": True}
  before, after, conf = _steps(sampling.ConfidenceSpec(temperature=1.0, **common))
  masked = before[0] == VOCAB
  first = (after[0] != VOCAB) & masked  # 3 of the 9 (the linear schedule's first step)
  np.testing.assert_array_equal(first.sum(1), 3)
  np.testing.assert_array_equal(first, masked & (np.cumsum(masked, 1) <= 3))
  by_probability = np_top_k(conf[0], masked, 3)
  assert (by_probability != first).any()  # the untransformed score would choose otherwise
  before, after, conf = _steps(sampling.ConfidenceSpec(temperature=0.0, **common))
  np.testing.assert_array_equal((after[0] != VOCAB) & masked, by_probability)


@pytest.mark.parametrize("kwargs, match", [
    ({"threshold_floor": "two"}, r"threshold_floor='two' is invalid"),
    ({"order": "random"}, r"order='random' is invalid"),
    ({"order": "position", "threshold": 0.5}, r"order='position' is invalid: .* no threshold"),
    ({"score_transformed": 1}, r"score_transformed=1 is invalid"),
    ({"score_transformed": True, "score_excluded_ids": (1,)}, (r"score_transformed=True is "
                                                             r"invalid: with score_excluded_ids")),
    ({"count_rule": "even_blocks"}, r"count_rule='even_blocks' is invalid"),
])
def test_sdar_rules_refuse_bad_values(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sampling.ConfidenceSpec(steps=4, **kwargs)
