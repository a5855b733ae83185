"""Confidence decoding: scheduled counts, scores, thresholds."""

import jax
import numpy as np

from mdjax import diffusion, sampling
from tests import stubs
from tests.sampling.common import (LENGTH, VOCAB, prompted_canvas)
from tests.sampling.common import np_score, np_top_k, softmax


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

