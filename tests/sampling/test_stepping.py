"""The public stepping door: `prepare`, `Stepper` and `Carry` give `sample`'s tokens when a
caller drives the steps itself, rows at different steps included (what a served lane does)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import sampling
from tests import stubs

VOCAB, LENGTH, PROMPT = 6, 12, 4
GENERATED = tuple(range(PROMPT, LENGTH))
STEPPED = sorted(name for name, family in sampling.families().items() if family.python_loop)


def _canvas(batch: int) -> jax.Array:
  rng = np.random.default_rng(1)
  tokens = np.full((batch, LENGTH), VOCAB, np.int32)
  tokens[:, :PROMPT] = rng.integers(0, VOCAB, (batch, PROMPT))
  return jnp.asarray(tokens)


def _spec(name):
  return sampling.families()[name].examples(GENERATED)[0]


@pytest.mark.parametrize("name", STEPPED)
@pytest.mark.slow
def test_rows_started_at_different_ticks_equal_sample(name):
  """Row b joins b ticks late, each row steps at its own index (a vmap of `Stepper.step`,
  as a lane runs it): every row ends as `sample` leaves it, written at the same steps."""
  spec, params, canvas = _spec(name), stubs.stub_params(VOCAB, LENGTH), _canvas(4)
  key = jax.random.key(3)
  whole = sampling.sample(stubs.stub_denoiser, params, key, canvas, spec)
  prepared = sampling.prepare(stubs.stub_denoiser, params, key, canvas, spec)
  stepper, bound, num_steps = prepared.stepper, prepared.bind(), prepared.num_steps
  keys_B = sampling.row_keys(key, 4)
  rows = [stepper.start(bound, keys_B[b:b + 1], canvas[b:b + 1]) for b in range(4)]
  carry = jax.tree.map(lambda *leaves: jnp.stack(leaves), *rows)

  @jax.jit
  def tick(carry, index_B):
    def one(row, index):
      new = stepper.step(bound, row, jnp.clip(index, 0, num_steps - 1), prepared.plan)
      run = (index >= 0) & ~stepper.done(row, index)[0]
      return jax.tree.map(lambda n, o: jnp.where(run, n, o), new, row)
    return jax.vmap(one)(carry, index_B)

  for t in range(num_steps + 4):
    carry = tick(carry, t - jnp.arange(4))
  assert bool(jax.vmap(lambda row: stepper.done(row, num_steps)[0])(carry).all())
  np.testing.assert_array_equal(carry.tokens_BxL[:, 0], whole.tokens_BxL)
  np.testing.assert_array_equal(carry.state.core.write_step_BxL[:, 0], whole.write_step_BxL)


def test_by_hand_equals_sample_counters_included():
  spec = sampling.ConfidenceSpec(steps=4)
  params, canvas, key = stubs.stub_params(VOCAB, LENGTH), _canvas(3), jax.random.key(8)
  prepared = sampling.prepare(stubs.stub_denoiser, params, key, canvas, spec)
  step = jax.jit(prepared.stepper.step)
  carry = prepared.start()
  for i in range(prepared.num_steps):
    carry = step(prepared.bind(), carry, i, prepared.plan)
  out = prepared.stepper.result(carry)
  whole = sampling.sample(stubs.stub_denoiser, params, key, canvas, spec)
  for field in ("tokens_BxL", "write_step_BxL", "nfe", "contexts_B", "rounds_B",
                "invalid_B", "unfilled_B", "generated_length_B"):
    np.testing.assert_array_equal(getattr(out, field), getattr(whole, field), err_msg=field)


def test_prepared_is_a_named_frozen_record_and_its_stepper_a_static_value():
  spec, params = sampling.AncestralSpec(steps=5), stubs.stub_params(VOCAB, LENGTH)
  first = sampling.prepare(stubs.stub_denoiser, params, jax.random.key(0), _canvas(2), spec)
  again = sampling.prepare(stubs.stub_denoiser, params, jax.random.key(1), _canvas(2), spec)
  assert first.stepper == again.stepper and hash(first.stepper) == hash(again.stepper)
  assert (first.stepper.mask_id, first.stepper.vocab_size) == (VOCAB, VOCAB)
  assert first.num_steps == 5 and first.plan.t.shape == (5,)
  assert first.kv_plan is None and first.spec is spec
  with pytest.raises(dataclasses.FrozenInstanceError):
    first.plan = None


def test_done_is_per_row():
  spec, params = sampling.ConfidenceSpec(steps=2), stubs.stub_params(VOCAB, LENGTH)
  canvas = np.asarray(_canvas(2)).copy()
  canvas[1, PROMPT:] = 0  # row 1 holds no mask: nothing to write
  prepared = sampling.prepare(stubs.stub_denoiser, params, jax.random.key(0), canvas, spec)
  carry = prepared.start()
  np.testing.assert_array_equal(prepared.stepper.done(carry, 0), [False, True])
  np.testing.assert_array_equal(prepared.stepper.done(carry, 2), [True, True])


def test_a_composite_family_is_refused_by_start():
  spec = sampling.families()["local_remask"].examples(GENERATED)[0]
  prepared = sampling.prepare(stubs.stub_denoiser, stubs.stub_params(VOCAB, LENGTH),
                              jax.random.key(0), _canvas(2), spec)
  with pytest.raises(ValueError, match="use sample"):
    prepared.start()


def test_prepare_refuses_bad_input_before_compiling():
  spec, params = sampling.ConfidenceSpec(steps=2), stubs.stub_params(VOCAB, LENGTH)
  with pytest.raises(ValueError, match="tokens_BxL has shape"):
    sampling.prepare(stubs.stub_denoiser, params, jax.random.key(0), np.zeros(3, np.int32),
                     spec)
  with pytest.raises(ValueError, match="key holds 3 row keys"):
    sampling.prepare(stubs.stub_denoiser, params, jax.random.split(jax.random.key(0), 3),
                     _canvas(2), spec)
