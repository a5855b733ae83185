"""The jumping loop and the zero-or-one-trip call against what they stand in for."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax.sampling import skipping

NUM_STEPS = 12
# Steps that change the carry; the others leave it as it is (the loop may jump them).
BUSY = np.array([0, 0, 1, 1, 0, 1, 0, 0, 0, 1, 0, 0], bool)


def _step_and_needs(busy):
  """A step that adds i + 1 to the total at the busy steps (and counts its calls)."""
  busy_K = jnp.asarray(busy)

  def step(carry, i):
    total, calls, skipped = carry
    return total + jnp.where(busy_K[i], i + 1, 0), calls + 1, skipped

  return step, lambda carry, i: busy_K[i]


def _count_skipped(carry, lo, hi):
  total, calls, skipped = carry
  return total, calls, skipped + (hi - lo)


@pytest.mark.parametrize("busy", [BUSY, np.zeros(NUM_STEPS, bool), np.ones(NUM_STEPS, bool)],
                         ids=["some", "none", "all"])
def test_the_loop_matches_a_scan_and_calls_only_busy_steps(busy):
  step, needs = _step_and_needs(busy)
  carry0 = (jnp.int32(0), jnp.int32(0), jnp.int32(0))

  def scan_body(carry, i):
    carry = step(carry, i)
    return carry, carry[0]

  (scan_total, _, _), scan_records = jax.lax.scan(scan_body, carry0, jnp.arange(NUM_STEPS))
  run = jax.jit(lambda carry: skipping.loop(step, needs, NUM_STEPS, carry,
                                            skip_range=_count_skipped, record=lambda c: c[0]))
  (total, calls, skipped), records = run(carry0)
  assert int(total) == int(scan_total) == int(np.sum((np.arange(NUM_STEPS) + 1)[busy]))
  assert int(calls) == busy.sum() and int(skipped) == NUM_STEPS - busy.sum()
  np.testing.assert_array_equal(records, scan_records)  # a jumped step records the carry


def test_the_loop_runs_without_jit_on_a_numpy_plan():
  # Plans are numpy arrays indexed by step; the loop must never index step K.
  step, _ = _step_and_needs(BUSY)
  needs = lambda carry, i: BUSY[i]
  with jax.disable_jit():
    (total, calls, skipped), _ = skipping.loop(step, needs, NUM_STEPS, (0, 0, 0),
                                               skip_range=_count_skipped)
  assert int(total) == int(np.sum((np.arange(NUM_STEPS) + 1)[BUSY]))
  assert int(calls) == BUSY.sum() and int(skipped) == NUM_STEPS - BUSY.sum()


@pytest.mark.parametrize("pred", [True, False])
def test_call_if_is_a_cond(pred):
  fn = lambda: (jnp.arange(3.0) * 2, jnp.int32(7))
  otherwise = (jnp.zeros(3), jnp.int32(0))
  got = jax.jit(lambda p: skipping.call_if(p, fn, otherwise))(pred)
  want = jax.lax.cond(pred, fn, lambda: otherwise)
  jax.tree.map(np.testing.assert_array_equal, got, want)
