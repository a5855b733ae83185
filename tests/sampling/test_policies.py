"""The shared pieces the driver and the composite families ask: the end of a row, the
counters, the idle-step rule."""

import jax
import jax.numpy as jnp
import numpy as np

from mdjax import sampling
from mdjax.sampling import stepping
from mdjax.sampling.base import Context, Core
from mdjax.sampling.end_of_row import EndAtEos, EndOfRow

MASK, EOS = 5, 0


def _ctx(batch=2, length=5):
  return Context(mask_id=MASK, editable_BxL=jnp.ones((batch, length), bool),
                 keys_B=jax.random.split(jax.random.key(0), batch))


def test_without_an_eos_id_the_end_of_a_row_changes_nothing():
  end = EndOfRow.of(sampling.ConfidenceSpec(steps=2))
  assert type(end) is EndOfRow and not end.leaves_idle_steps
  tokens = jnp.array([[1, EOS, MASK, 2, 3], [EOS, 1, 1, 1, 1]])
  ctx, core = _ctx(), Core.start(tokens)
  assert end.open(ctx, tokens) is ctx and end.finish(core, ctx, jnp.int32(0)) is core
  np.testing.assert_array_equal(end.generated_length(tokens, ctx.editable_BxL, MASK), [5, 5])
  assert end.unless_ended(jnp.array([True, True]), lambda: "run", lambda: "idle") == "run"


def test_a_row_ends_at_its_first_eos_once_everything_before_it_is_written():
  end = EndOfRow.of(sampling.ConfidenceSpec(steps=2, eos_id=EOS))
  assert end == EndAtEos(EOS) and end.leaves_idle_steps
  tokens = jnp.array([[1, MASK, EOS, 2, 3], [MASK, EOS, 1, 1, 1], [2, 2, EOS, MASK, 1]])
  ctx = _ctx(batch=3)
  np.testing.assert_array_equal(end.open(ctx, tokens).editable_BxL.all(-1), [True, True, False])
  finished = end.finish(Core.start(tokens), ctx, jnp.int32(4))
  np.testing.assert_array_equal(finished.tokens_BxL[2], [2, 2, EOS, EOS, EOS])
  np.testing.assert_array_equal(finished.tokens_BxL[:2], tokens[:2])
  np.testing.assert_array_equal(end.generated_length(tokens, ctx.editable_BxL, MASK), [2, 1, 2])
  assert bool(end.any_open(tokens, ctx)) and not bool(end.any_open(finished.tokens_BxL[2:],
                                                                    _ctx(batch=1)))
  block, ended = end.after_block(jnp.array([[1, 1], [1, EOS]]), jnp.array([True, False]),
                                 jnp.array([[True, True], [True, True]]))
  np.testing.assert_array_equal(block, [[EOS, EOS], [1, EOS]])
  np.testing.assert_array_equal(ended, [True, True])


def test_counters_add_and_a_sub_run_is_absorbed():
  outer = Core.start(jnp.array([[1, MASK, MASK]])).count(nfe=2, rounds_B=jnp.array([2]))
  inner = Core.start(jnp.array([[1, 4, 3]])).count(nfe=3, contexts_B=jnp.array([3]),
                                                   reopened_B=jnp.array([1]))
  inner = inner.replace(write_step_BxL=jnp.array([[-1, 0, 1]]))
  where_BxL = jnp.array([[False, True, False]])
  merged = outer.absorb(inner, where_BxL, 10)
  np.testing.assert_array_equal(merged.tokens_BxL, inner.tokens_BxL)
  np.testing.assert_array_equal(merged.write_step_BxL, [[-1, 10, -1]])
  assert int(merged.nfe) == 5 and int(merged.rounds_B[0]) == 2
  assert int(merged.contexts_B[0]) == 3 and int(merged.reopened_B[0]) == 1
  doubled = merged.counters + merged.counters
  assert int(doubled.nfe) == 10 and int(doubled.contexts_B[0]) == 6
  assert int(doubled.rounds_B[0]) == 4 and int(doubled.reopened_B[0]) == 2


def test_the_idle_step_rule_inside_a_composite_family():
  families = sampling.families()
  assert stepping.skips_idle_steps(families["ancestral"], sampling.AncestralSpec(steps=4))
  assert not stepping.skips_idle_steps(families["revision"], sampling.RevisionSpec(steps=4))
  assert stepping.skips_idle_steps(families["revision"], sampling.RevisionSpec(steps=4, eos_id=0))
  assert not stepping.skips_idle_steps(families["ancestral"],
                                     sampling.AncestralSpec(steps=4, skip_idle_steps=False))
