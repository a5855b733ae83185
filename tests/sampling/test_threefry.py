"""The unrolled Threefry draws equal jax.random's bit for bit (mdjax/sampling/threefry.py)."""

import jax
import numpy as np
import pytest

from mdjax.sampling import threefry


def _keys(kind: str):
  keys = jax.random.split(jax.random.key(7), 5)
  return keys if kind == "typed" else jax.random.key_data(keys)


@pytest.mark.parametrize("kind", ["typed", "raw"])
def test_fold_in_equals_jax(kind):
  keys = _keys(kind)
  for data in (0, 1, 12345, 2 ** 31 + 5):
    ours = threefry.fold_in(keys, data)
    theirs = jax.vmap(lambda k: jax.random.fold_in(k, data))(keys)
    if kind == "typed":
      ours, theirs = jax.random.key_data(ours), jax.random.key_data(theirs)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("kind", ["typed", "raw"])
@pytest.mark.parametrize("shape", [(1,), (25,), (3, 7), (64, 15)])
@pytest.mark.slow
def test_draws_equal_jax(kind, shape):
  keys = _keys(kind)
  # Inside a jit as well as eagerly: the sampler's draws are compiled.
  for run in (lambda f: f(), lambda f: jax.jit(f)()):
    for ours, theirs in (
        (lambda: threefry.uniform(keys, shape),
         lambda: jax.vmap(lambda k: jax.random.uniform(k, shape))(keys)),
        (lambda: threefry.gumbel(keys, shape),
         lambda: jax.vmap(lambda k: jax.random.gumbel(k, shape))(keys))):
      np.testing.assert_array_equal(run(ours), run(theirs))


def test_other_key_implementations_use_jax():
  keys = jax.random.split(jax.random.key(3, impl="rbg"), 2)
  folded = threefry.fold_in(keys, 4)
  np.testing.assert_array_equal(
      jax.random.key_data(folded),
      jax.random.key_data(jax.vmap(lambda k: jax.random.fold_in(k, 4))(keys)))
  np.testing.assert_array_equal(threefry.gumbel(keys, (6,)),
                                jax.vmap(lambda k: jax.random.gumbel(k, (6,)))(keys))


def test_the_step_draws_compile_without_a_loop():
  # The point of the module: no while loop (jax's rolled hash on the CPU) in a step's draws.
  keys = jax.random.split(jax.random.key(0), 4)
  text = jax.jit(lambda k: threefry.gumbel(threefry.fold_in(k, 3), (25, 15))).lower(
      keys).as_text()
  assert "stablehlo.while" not in text
