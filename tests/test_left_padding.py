"""Left-padded prompts: row for row, the tokens each row gives sampled alone, in every family.

Not in the "generation" xdist group: each case compiles its own programs, so the cases
spread over the workers.
"""

import dataclasses

import jax
import numpy as np
import pytest

from mdjax import generation, sampling
from tests.test_generation import V, tiny  # noqa: F401  (the tiny Transformer fixture)

pytestmark = pytest.mark.slow


# Every family at its example settings (random draws), but the specs that name canvas
# positions (ordered, field_order, order_policy's table of positions, speculative with fixed
# positions: a left-padded batch shares one layout), and the block families on the dual KV
# cache.
POSITION_FREE = [family.examples(tuple(range(6)))[0]
                 for name, family in sorted(sampling.families().items())
                 if name not in ("ordered", "field_order", "order_policy")]
# The confidence draws the first example leaves out: random scores, MaskGIT's Gumbel choice.
POSITION_FREE.append(sampling.ConfidenceSpec(steps=6, score="random", gumbel_temperature=1.0))
POSITION_FREE += [dataclasses.replace(spec, block_length=3, kv_cache="dual") for spec in (
    sampling.ConfidenceSpec(steps=6), sampling.AncestralSpec(steps=6),
    sampling.EntropyBoundedSpec(steps=6, gamma=0.5))]


@pytest.mark.parametrize("spec", POSITION_FREE,
                         ids=[f"{type(s).__name__}-{i}" for i, s in enumerate(POSITION_FREE)])
def test_left_padded_batch_equals_rows_alone(tiny, spec):
  """Row for row, the tokens each row gives sampled alone with its own key: positions and
  random draws are counted from each row's first valid token."""
  apply_fn, params = tiny
  # Rows padded by 4, 2 and 0 positions in one batch. The row padded most is sampled alone
  # (each row alone is a program of its own length: one compile a family); that the
  # unpadded row equals itself alone is test_contract's, for every family.
  prompts = [np.array([4], np.int32), np.array([1, 2, 3], np.int32),
             np.array([2, 0, 1, 3, 4], np.int32)]
  gen = 6
  tokens, valid, start = generation.left_padded(prompts, 5 + gen, V, pad_id=0)
  keys_B = sampling.row_keys(jax.random.key(0), len(prompts))
  out = sampling.sample(apply_fn, params, keys_B, tokens, spec, mask_id=V, valid_BxL=valid)
  alone = np.concatenate([prompts[0], np.full(gen, V, np.int32)])[None]
  single = sampling.sample(apply_fn, params, keys_B[:1], alone, spec, mask_id=V)
  np.testing.assert_array_equal(np.asarray(out.tokens_BxL)[0, start:],
                                np.asarray(single.tokens_BxL)[0, len(prompts[0]):])


