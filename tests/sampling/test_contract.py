"""What every registered sampler family promises, checked on the family's own examples.

A family joins these tests by being registered (`sampling.register`) with `examples`.
"""

import dataclasses

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import sampling
from mdjax.sampling import driver
from tests import stubs

# One worker runs both files: the golden stub cases are the contract examples.
pytestmark = pytest.mark.xdist_group("stub_samplers")

VOCAB, LENGTH, PROMPT = 6, 12, 4
GENERATED = tuple(range(PROMPT, LENGTH))
FAMILIES = sorted(sampling.families())
EXAMPLES = [(name, spec) for name in FAMILIES
            for spec in sampling.families()[name].examples(GENERATED)]


def _canvas(batch: int) -> jax.Array:
  rng = np.random.default_rng(1)
  tokens = np.full((batch, LENGTH), VOCAB, np.int32)
  tokens[:, :PROMPT] = rng.integers(0, VOCAB, (batch, PROMPT))
  return jnp.asarray(tokens)


def as_run(spec):
  """The example as the invariants test runs it: recording its trajectory where it can."""
  family = sampling.family_of(spec)
  if family.composite and family.name != "speculative":
    return spec
  return dataclasses.replace(spec, record_trajectory=True)


def _sample(spec, batch=4, key=jax.random.key(0), seed=0, **kwargs):
  return sampling.sample(stubs.stub_denoiser, stubs.stub_params(VOCAB, LENGTH, seed), key,
                         _canvas(batch), spec, **kwargs)


def test_every_family_has_examples_of_its_own_spec():
  assert {"ancestral", "confidence", "entropy_bounded", "speculative"} <= set(FAMILIES)
  for name in FAMILIES:
    family = sampling.families()[name]
    examples = family.examples(GENERATED)
    assert examples and all(type(s) is family.spec_type for s in examples), name
    assert sampling.family_of(examples[0]) is family


@pytest.mark.parametrize("name, spec", EXAMPLES, ids=[f"{n}-{i}" for i, (n, _) in
                                                      enumerate(EXAMPLES)])
@pytest.mark.slow
def test_fills_the_canvas_and_never_touches_fixed_positions(name, spec):
  spec = as_run(spec)
  record = spec.record_trajectory
  result = _sample(spec)
  tokens = np.asarray(_canvas(4))
  final = np.asarray(result.tokens_BxL)
  assert np.all((final >= 0) & (final < VOCAB)), "no mask remains after the last step"
  np.testing.assert_array_equal(final[:, :PROMPT], tokens[:, :PROMPT])
  write_step = np.asarray(result.write_step_BxL)
  assert np.all(write_step[:, :PROMPT] == -1) and np.all(write_step[:, PROMPT:] >= 0)
  assert np.all(np.asarray(result.rounds_B) >= 1)
  assert np.all(np.asarray(result.contexts_B) >= np.asarray(result.rounds_B))
  assert int(result.nfe) >= int(np.max(np.asarray(result.rounds_B)))
  if record:
    traj = np.asarray(result.trajectory_KxBxL)
    assert traj.shape[0] == sampling.num_steps(spec, LENGTH)
    assert np.all(traj[:, :, :PROMPT] == tokens[None, :, :PROMPT])
    np.testing.assert_array_equal(traj[-1], final)
    if not sampling.families()[name].rewrites:
      # A visible token never changes, and its write step is the first step it is visible.
      before = np.concatenate([tokens[None], traj[:-1]])
      visible = before != VOCAB
      assert np.all(traj[visible] == before[visible])
      assert int(result.reopened_B.sum()) == 0
      first_visible = np.argmax(traj != VOCAB, axis=0)
      np.testing.assert_array_equal(write_step[:, PROMPT:], first_visible[:, PROMPT:])


def _contract_spec(name):
  return sampling.families()[name].examples(GENERATED)[0]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.slow
def test_a_batch_equals_its_rows_sampled_one_by_one(name):
  # The batched call is the invariants test's program (same spec and shapes): no compile.
  spec = as_run(_contract_spec(name))
  keys = jax.random.split(jax.random.key(11), 4)
  batched = _sample(spec, key=keys)
  for b in range(4):
    single = sampling.sample(stubs.stub_denoiser, stubs.stub_params(VOCAB, LENGTH),
                             keys[b:b + 1], _canvas(4)[b:b + 1], spec)
    for field in ("tokens_BxL", "write_step_BxL"):
      np.testing.assert_array_equal(getattr(single, field)[0], getattr(batched, field)[b])


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.slow
def test_the_python_loop_equals_the_program(name):
  family, spec = sampling.families()[name], _contract_spec(name)
  run = lambda fn: fn(stubs.stub_denoiser, stubs.stub_params(VOCAB, LENGTH),
                      jax.random.key(5), _canvas(4), spec)
  if not family.python_loop:
    with pytest.raises(ValueError, match="use sample"):
      run(sampling.sample_python_loop)
    return
  # Recording the trajectory changes no token: the scan side reuses the invariants program.
  scan = sampling.sample(stubs.stub_denoiser, stubs.stub_params(VOCAB, LENGTH),
                         jax.random.key(5), _canvas(4), as_run(spec))
  loop = run(sampling.sample_python_loop)
  for field in ("tokens_BxL", "write_step_BxL", "nfe", "saved_calls", "contexts_B",
                "rounds_B", "reopened_B"):
    np.testing.assert_array_equal(getattr(loop, field), getattr(scan, field), err_msg=field)


def _denoiser_calls(jaxpr, batch):
  """Call sites of the stub on a (batch, L) canvas, counting a cond's costliest branch."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.params.get("name") == "stub_denoiser_inner":
      total += eqn.invars[-1].aval.shape[0] == batch
      continue
    if eqn.primitive.name == "cond":
      total += max(_denoiser_calls(b.jaxpr, batch) for b in eqn.params["branches"])
      continue
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      total += _denoiser_calls(sub, batch)
  return total


def _loop_body(eqn):
  """The body of a scan or while loop."""
  return (eqn.params.get("jaxpr") or eqn.params["body_jaxpr"]).jaxpr


def _top_loops(jaxpr):
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("scan", "while"):
      found.append(eqn)
    elif eqn.params.get("name") != "stub_denoiser_inner":
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        found += _top_loops(sub)
  return found


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.slow
def test_one_program_and_no_recompilation(name):
  family, spec = sampling.families()[name], _contract_spec(name)
  spec_run = as_run(spec)
  _sample(spec_run, seed=0, key=jax.random.key(0))
  compiled = driver._program._cache_size()
  _sample(spec_run, seed=1, key=jax.random.key(1))
  assert driver._program._cache_size() == compiled, "new parameters and keys must not recompile"
  closed = jax.make_jaxpr(lambda p, k, x: sampling.sample(
      stubs.stub_denoiser, p, k, x, spec, mask_id=VOCAB))(
          stubs.stub_params(VOCAB, LENGTH), jax.random.key(0), _canvas(4))
  loops = [e for e in _top_loops(closed.jaxpr)
           if _denoiser_calls(_loop_body(e), 4 * getattr(spec, "k", 1)) > 0]
  if not family.composite:
    # The whole trajectory is one loop whose body calls the denoiser once on the canvas.
    assert len(loops) == 1, [e.primitive.name for e in loops]
    assert _denoiser_calls(_loop_body(loops[0]), 4) == 1
  else:
    assert 1 <= len(loops) <= 2, "a composite family runs a fixed number of loops"


@pytest.mark.parametrize("name", FAMILIES)
def test_bad_input_raises_before_tracing(name):
  spec = _contract_spec(name)
  traces = []

  def counting(params, tokens_BxL, t_B):
    traces.append(1)
    return stubs.stub_denoiser(params, tokens_BxL, t_B)

  params = stubs.stub_params(VOCAB, LENGTH)
  # (An id above a given mask id needs V, read from one abstract trace: it may be a token.)
  with pytest.raises(ValueError, match="tokens_BxL holds -1"):
    sampling.sample(counting, params, jax.random.key(0), _canvas(2).at[0, 0].set(-1), spec,
                    mask_id=VOCAB)
  with pytest.raises(ValueError, match="2-D integer"):
    sampling.sample(counting, params, jax.random.key(0), _canvas(2)[0], spec, mask_id=VOCAB)
  with pytest.raises(ValueError, match="key holds 3 row keys"):
    sampling.sample(counting, params, jax.random.split(jax.random.key(0), 3), _canvas(2), spec,
                    mask_id=VOCAB)
  assert not traces
