"""Semi-autoregressive blocks decode left to right."""

import jax
import numpy as np

from mdjax import sampling
from tests import stubs
from tests.sampling.common import (LENGTH, VOCAB, prompted_canvas)


def test_blocks_decode_left_to_right():
  params = stubs.stub_params(VOCAB, LENGTH)
  tokens = prompted_canvas(prompt=4)  # 8 generated positions, blocks of 2
  for spec in (sampling.AncestralSpec(steps=8, block_length=2, record_trajectory=True),
               sampling.ConfidenceSpec(steps=4, block_length=2, record_trajectory=True)):
    result = sampling.sample(stubs.stub_denoiser, params, jax.random.key(0), tokens, spec)
    traj = np.asarray(result.trajectory_KxBxL)
    per_block = spec.steps // 4
    for i in range(spec.steps):
      done_blocks = (i + 1) // per_block
      gen = traj[i][:, 4:].reshape(-1, 4, 2)
      assert not np.any(gen[:, :done_blocks] == VOCAB)  # finished blocks complete
      assert np.all(gen[:, (i // per_block) + 1:] == VOCAB)  # later blocks untouched

