"""mdjax.bench.eos (results/eos_long.json's rows) on an oracle whose rows end at a random EOS."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from mdjax.bench import eos

pytestmark = pytest.mark.slow

CANVAS, BLOCK = 16, 4
VOCAB, EOS = 6, 1  # ids 0..5, mask 6
FIRST = 5  # no EOS before this position


def oracle(params, tokens_BxL, t_B, valid_BxL=None):
  """Positions (counted from the first valid one) before FIRST never hold EOS; from FIRST on,
  EOS and each other id are equally likely, so rows end at random positions."""
  del params, t_B
  length = tokens_BxL.shape[1]
  if valid_BxL is None:
    pos_BxL = jnp.broadcast_to(jnp.arange(length), tokens_BxL.shape)
  else:
    pos_BxL = jnp.cumsum(valid_BxL, -1) - 1
  eos_V = jnp.arange(VOCAB) == EOS
  return jnp.where((pos_BxL < FIRST)[..., None] & eos_V, -jnp.inf,
                   jnp.zeros(tokens_BxL.shape + (VOCAB,)))


# One row a batch (its rows alone are the batch: one program per mode) and one family, whose
# calls are bounded exactly: two programs compile (each takes seconds).
SAMPLERS = (f"semi-autoregressive blocks of {BLOCK}, confidence",)


SEEDS = range(4)  # rows ending at different positions, one program


@functools.cache
def rows():
  """{(sampler, seed): (row without, row with early stop)}."""
  chosen = [s for s in eos.samplers(CANVAS, BLOCK, steps=CANVAS) if s.name in SAMPLERS]
  return {(s.name, seed): eos.measure(oracle, None, s, eos_id=EOS, mask_id=VOCAB,
                                           canvas=CANVAS, batch=1, repeats=1, seed=seed)
          for s in chosen for seed in SEEDS}


def test_rows_have_the_result_keys_and_early_stop_never_costs_calls():
  for name, (without, with_) in rows().items():
    for row in (without, with_):
      assert {"sampler", "canvas", "eos_early_stop", "mean_generated_length", "nfe",
              "output_tokens_per_s"} <= set(row)
      assert row["canvas"] == CANVAS and row["output_tokens_per_s"] > 0
      assert row["batch_equals_rows"], name
    assert (without["eos_early_stop"], with_["eos_early_stop"]) == (False, True)
    assert with_["nfe"] <= without["nfe"], name
    assert all(a <= b for a, b in zip(with_["nfe_alone"], without["nfe_alone"])), name
    lengths = np.array(with_["generated_lengths"])
    assert ((lengths >= FIRST) & (lengths <= CANVAS)).all(), name
    np.testing.assert_allclose(with_["tail_fraction"], (1 - lengths / CANVAS).mean())


def test_lengths_agree_where_stopping_leaves_the_trajectory_unchanged():
  # Confidence never reopens a written token: a finished row has written every position
  # up to its first EOS, so the run without the stop keeps that prefix (same keys and draws).
  for name, (_, with_) in rows().items():
    assert with_["same_trajectory"] and with_["lengths_agree"], name
  remdm, ranked_last = (s for s in eos.samplers(CANVAS, BLOCK, steps=CANVAS)
                        if s.name in ("remdm", "confidence top-k, EOS ranked last"))
  assert not eos.same_trajectory(remdm) and not eos.same_trajectory(ranked_last)


def test_blocks_save_the_calls_after_the_block_holding_eos():
  # K = CANVAS steps, BLOCK / (CANVAS / K) = 4 a block. A row alone must write every block up
  # to the one holding its first EOS, and in that block the positions up to the EOS; the
  # blocks after it cost nothing. Rows with no EOS run every block.
  steps_per_block = BLOCK
  ends = {with_["generated_lengths"][0] // BLOCK for _, with_ in rows().values()}
  assert len(ends) >= 2, ends  # the seeds end rows in different blocks
  for without, with_ in rows().values():
    assert without["nfe_alone"] == [CANVAS]
    for n, length in zip(with_["nfe_alone"], with_["generated_lengths"]):
      block = length // BLOCK
      if length == CANVAS:
        assert n == CANVAS
      else:
        assert block * steps_per_block + length % BLOCK + 1 <= n <= (block + 1) * steps_per_block
