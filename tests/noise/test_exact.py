"""Exact denoisers under any noise process (`mdjax.noise.exact`, `mdjax.load(..., noise=)`)
against numpy brute-force posteriors, and under absorbing noise against the tasks' own."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from mdjax import errors, loader, noise, tasks
from mdjax.tasks import scan_and_add
from tests.noise import reference

NAMES = ("absorbing", "uniform", "hybrid")


def _list_sequences(kind, n, m):
  prompts = [list(p) for p in itertools.permutations(range(m), n)]
  if kind == "copy":
    return [p + p for p in prompts]
  if kind == "shuffle":
    return [p + list(o) for p in prompts for o in itertools.permutations(p)]
  return [p + [m if i == j else p[i] for i in range(n)] for p in prompts for j in range(n)]


def _scan_and_add_sequences(params):
  """Every sequence of ScanAndAdd with max_command_id = 1 (one id per command kind), from the
  task's definition."""
  p = params
  seqs = []
  for c1, c2 in itertools.combinations(range(p.num_commands), 2):
    for values in itertools.product(range(10), repeat=p.n):
      total = values[c1] % p.modulus + values[c2 - 1] % p.modulus
      cmds = [0 if c in (c1, c2) else 1 for c in range(p.num_commands)]
      seqs.append([scan_and_add.VALS, *values, scan_and_add.ANS, total // 100 % 10,
                   total // 10 % 10, total % 10, scan_and_add.OPS, *cmds])
  return seqs


# (task, task_kwargs, every sequence of the law, each equally likely)
SMALL = [
    ("two_color", {}, [[0, 0], [1, 1]]),
    ("permutation", {"n": 3}, [list(p) for p in itertools.permutations(range(3))]),
    ("list_copy", {"n": 2, "m": 3}, _list_sequences("copy", 2, 3)),
    ("list_replace", {"n": 2, "m": 3}, _list_sequences("replace", 2, 3)),
    ("list_shuffle", {"n": 2, "m": 3}, _list_sequences("shuffle", 2, 3)),
    ("scan_and_add", {"n": 2}, _scan_and_add_sequences(scan_and_add.Params(n=2))),
]


def _canvases(task, name, rng, batch=24):
  """Corrupted data at random times, a few arbitrary canvases, and the mask id here and there
  (unobserved under uniform noise)."""
  x = np.asarray(task.sample_data(jax.random.key(int(rng.integers(1 << 30))), batch))
  t = rng.uniform(0.05, 0.95, batch)
  proc = noise.get(name, task.vocab_size)
  z = np.array(proc.corrupt(jax.random.key(int(rng.integers(1 << 30))), jnp.asarray(x),
                            jnp.asarray(t)))
  z[:4] = rng.integers(0, task.vocab_size + proc.has_mask, z[:4].shape)
  if not proc.has_mask:
    z[4:8, 0] = task.mask_id
  return z, t


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("task_name,kwargs,seqs", SMALL, ids=[c[0] for c in SMALL])
def test_exact_posterior_matches_brute_force(task_name, kwargs, seqs, name):
  task = tasks.get(task_name, kwargs)
  seqs = np.array(seqs)
  law = task.support()
  assert len({tuple(s) for s in seqs}) == len(seqs)
  data = np.asarray(task.sample_data(jax.random.key(0), 64))
  assert {tuple(r) for r in data} <= {tuple(s) for s in seqs}
  rng = np.random.default_rng(0)
  z, t = _canvases(task, name, rng)
  # The enumerator, and the loaded model (for absorbing noise: the task's own oracle).
  enumerated = noise.exact_denoiser(noise.get(name, task.vocab_size))(
      law.arrays, jnp.asarray(z), jnp.asarray(t))
  model = mdjax.load(task_name, task_kwargs=kwargs, noise=name)
  loaded = model.denoiser(model.params, jnp.asarray(z), jnp.asarray(t))
  # two_color's own oracle predicts a visible position from the other one.
  read = (z == task.mask_id) if (name, task_name) == ("absorbing", "two_color") else z >= 0
  probs = np.full(len(seqs), 1.0 / len(seqs))
  assert law.probs_S.sum() == pytest.approx(1.0)
  for logits, positions in ((enumerated, z >= 0), (loaded, read)):
    got = np.asarray(jax.nn.softmax(logits))
    for b in range(len(z)):
      want = reference.posterior(name, t[b], task.vocab_size, seqs, probs, z[b])
      if np.isfinite(want).all():  # else a state the law cannot produce (absorbing noise)
        np.testing.assert_allclose(got[b][positions[b]], want[positions[b]], atol=2e-5,
                                   err_msg=f"row {b}: {z[b]}")


def test_sudoku4_matches_its_mixture_brute_force():
  """Sudoku's law is a mixture over the 288 grids of product laws (prompt cells given or
  blank): the posterior by explicit products over the other positions, in float64."""
  task = tasks.get("sudoku4")
  law = task.support()
  laws, probs = law.laws_SxLxV.astype(np.float64), law.probs_S.astype(np.float64)
  rng = np.random.default_rng(1)
  for name in NAMES:
    model = mdjax.load("sudoku4", noise=name)
    z, t = _canvases(task, name, rng, batch=6)
    got = np.exp(np.asarray(model.denoiser(model.params, jnp.asarray(z), jnp.asarray(t))))
    for b in range(4, 6):  # corrupted data: states the law can produce
      m = reference.evidence_matrix(name, t[b], task.vocab_size)
      lik_LxV = m[:, z[b]].T  # q_t(z_i | v)
      comp_SxL = np.einsum("slv,lv->sl", laws, lik_LxV)
      want = np.zeros((task.length, task.vocab_size))
      for i in range(task.length):
        others = np.prod(np.delete(comp_SxL, i, 1), 1) * probs
        want[i] = others @ laws[:, i] * lik_LxV[i]
      want /= want.sum(-1, keepdims=True)
      np.testing.assert_allclose(got[b], want, atol=2e-5)


@pytest.mark.parametrize("a", [0.0, 0.3, 0.6, 0.9, 1.0])
def test_two_color_uniform_closed_form(a):
  """Issue 57's acceptance: keep-probability a (else a uniform draw of the 2 colors), then
  p(x0_1 = c | x_t = (c, c)) = ((1+a)/2)^2 / (((1+a)/2)^2 + ((1-a)/2)^2)."""
  model = mdjax.load("oracle:two_color", noise="uniform")
  t_B = jnp.full((2,), 1.0 - a)  # the linear schedule: alpha(t) = 1 - t
  probs = np.exp(np.asarray(model.denoiser(model.params, jnp.array([[0, 0], [1, 1]]), t_B)))
  keep, flip = ((1 + a) / 2)**2, ((1 - a) / 2)**2
  want = keep / (keep + flip)
  np.testing.assert_allclose([probs[0, 0, 0], probs[1, 0, 1], probs[0, 1, 0]], want, atol=1e-6)


@pytest.mark.parametrize("task_name", ["two_color", "permutation", "sudoku4", "list_copy",
                                       "list_replace", "list_shuffle", "scan_and_add"])
def test_absorbing_agrees_with_the_tasks_own_oracle(task_name):
  """At masked positions (what samplers and losses read) on any canvas, impossible ones
  included; and at visible ones (one-hot) except two_color's, which predicts a visible
  position from the other one."""
  task = tasks.get(task_name)
  den = noise.exact_denoiser(noise.get("absorbing", task.vocab_size))
  rng = np.random.default_rng(2)
  x = np.asarray(task.sample_data(jax.random.key(3), 16))
  z = np.where(rng.random(x.shape) < rng.random((16, 1)), x, task.mask_id)
  z[:4] = np.where(rng.random((4, x.shape[1])) < 0.5,
                   rng.integers(0, task.vocab_size, (4, x.shape[1])), task.mask_id)
  t_B = jnp.full((16,), 0.5)
  got = np.exp(np.asarray(den(task.support().arrays, jnp.asarray(z), t_B)))
  want = np.asarray(jax.nn.softmax(task.exact_denoiser(None, jnp.asarray(z), t_B)))
  read = (z == task.mask_id) if task_name == "two_color" else np.ones(z.shape, bool)
  err = np.where(read, np.abs(got - want).max(-1), 0.0)
  assert err.max() < 1e-5, (err.max(), z[err.max(-1).argmax()])


def test_load_spelling_and_refusals():
  model = mdjax.load("two_color", noise="hybrid")
  assert model.noise == noise.Hybrid(vocab_size=2) and model.family == "oracle"
  assert mdjax.load("two_color").noise is None
  assert mdjax.load("two_color", noise="absorbing").denoiser.apply is tasks.two_color.exact_denoiser
  custom = noise.Uniform(vocab_size=6, schedule=mdjax.CosineSchedule())
  assert mdjax.load("oracle:permutation", noise=custom).noise is custom
  with pytest.raises(errors.ArgumentError) as info:
    mdjax.load("permutation", task_kwargs={"n": 9}, noise="uniform")
  assert info.value.param == "noise" and "too large to enumerate" in str(info.value)
  with pytest.raises(errors.ArgumentError) as info:
    mdjax.load("two_color", noise="gaussian")
  assert info.value.param == "noise" and "'gaussian'" in str(info.value)
  no_law = dataclasses.replace(tasks.get("two_color"), support=None)
  with pytest.raises(errors.ArgumentError, match="no enumerable law"):
    loader.oracle_model(no_law, "two_color", "uniform")
