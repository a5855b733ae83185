"""Named random streams: every `fold_in` tag used by sampling and training, in one table.

Keys are split by `jax.random.fold_in(key, tag)`. Two levels use tags:

- a *row key* (one per sampled row, or the training seed's key) is folded with a step
  index 0, 1, ..., K-1 for each sampler step or training step, and with the row-level
  streams below for everything that is not a step; step indices stay below
  `MAX_STEPS`, so they never reach a row-level stream;
- a *step key* (row key folded with a step index) is folded with the step-level
  streams to separate the draws of one step.

The values are part of the samples' identity: changing one changes every sample drawn
with it, so they are fixed here and never written as bare integers elsewhere.
"""

from __future__ import annotations

import enum

from mdjax.errors import ArgumentError

# Step indices folded into a row key stay below this; row-level streams lie above it.
MAX_STEPS = 1 << 28


class StepStream(enum.IntEnum):
  """Draws within one sampler step (folded into the step key)."""

  REVEAL = 0  # which masked positions a step reveals (ancestral, remasking)
  VALUES = 1  # the values' draws (Gumbel-max, or one uniform each for inverse-CDF draws)
  REMASK = 2  # which committed positions return to the mask
  SELECT = 3  # Gumbel noise of MaskGIT's choice temperature
  SCORE = 4  # the `random` confidence score
  ORDER = 5  # a random write order (drawn once, from the INIT key)
  RENOISE = 6  # uniform tokens that re-noise the positions a step does not keep
  DRAFT = 10  # speculative drafts
  ACCEPT = 11  # speculative acceptance tests
  RESIDUAL = 12  # speculative residual draws


class RowStream(enum.IntEnum):
  """Row-level streams beside the step indices (folded into a row key or a seed key)."""

  TRAIN_NOISE = 1 << 29  # training: the masking noise of step s is fold_in(this, s)
  EVAL_DATA = 1 << 30  # training: held-out batches, never a training step's batch
  LOCAL_ROUND = 0x3FFFFFFF  # localized remasking: round r uses LOCAL_ROUND - r
  LOCAL_CHOICE = 0x7FFFFFFE  # localized remasking: the remask choice within a round
  INIT = 0x7FFFFFFF  # sampling: draws made once before the loop (a random order, a prior canvas)


def check_steps(num_steps: int) -> None:
  """Refuses a step count whose indices would reach the row-level streams."""
  if num_steps >= MAX_STEPS:
    raise ArgumentError("steps", f"steps={num_steps} must be below {MAX_STEPS} (random "
                        "streams).")
