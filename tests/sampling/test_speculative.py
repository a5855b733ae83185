"""The speculative sampler: exact on known joints, fast where positions are independent."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import metrics, sampling
from mdjax.sampling.families import speculative
from mdjax.tasks import scan_and_add as sa
from mdjax.tasks import two_color
from tests import stubs

# A joint over 3 binary positions that is far from a product of its marginals.
JOINT = np.array([0.30, 0.02, 0.05, 0.13, 0.04, 0.16, 0.10, 0.20])
CONFIGS = np.array(list(itertools.product([0, 1], repeat=3)))  # row c: x0 x1 x2 of cell c
MASK = 2
# Chi-square critical value, 7 degrees of freedom, upper tail 0.001.
CHI2_7_AT_0001 = 24.322


def joint_denoiser(unused_params, tokens_BxL, t_B):
  """Exact conditionals of JOINT at every position given the visible ones."""
  del unused_params, t_B
  configs, joint = jnp.asarray(CONFIGS), jnp.asarray(JOINT, jnp.float32)
  visible_BxL = tokens_BxL != MASK
  agree_BxC = jnp.all(~visible_BxL[:, None, :] | (configs[None] == tokens_BxL[:, None, :]), -1)
  weight_BxC = joint[None] * agree_BxC
  probs_BxLxV = jnp.einsum("bc,clv->blv", weight_BxC, jax.nn.one_hot(configs, 2))
  probs_BxLxV /= probs_BxLxV.sum(-1, keepdims=True)
  return jnp.log(probs_BxLxV)


def chi_square(tokens_NxL) -> float:
  cells = np.asarray(tokens_NxL) @ np.array([4, 2, 1])
  counts = np.bincount(cells, minlength=8)
  expected = JOINT * len(cells)
  return float(((counts - expected) ** 2 / expected).sum())


def _sample_joint(spec, n=50_000, seed=0):
  return sampling.sample(joint_denoiser, None, jax.random.key(seed),
                         jnp.full((n, 3), MASK, jnp.int32), spec, mask_id=MASK)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("order", ["max_prob", "lowest_index"])
@pytest.mark.slow
def test_matches_a_dependent_joint(k, order):
  out = _sample_joint(sampling.SpeculativeSpec(k=k, order=order))
  assert chi_square(out.tokens_BxL) < CHI2_7_AT_0001
  if k == 1:
    assert np.all(np.asarray(out.rounds_B) == 3)


@pytest.mark.parametrize("spec", [sampling.AncestralSpec(steps=2), sampling.ConfidenceSpec(steps=2),
                                  sampling.OrderedSpec(groups=((0, 1, 2),))],
                         ids=lambda s: type(s).__name__)
@pytest.mark.slow
def test_the_same_test_rejects_independent_updates(spec):
  assert chi_square(_sample_joint(spec).tokens_BxL) > CHI2_7_AT_0001


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.slow
def test_two_color_never_invalid_and_one_round_from_k_two(k):
  out = sampling.sample(two_color.exact_denoiser, None, jax.random.key(k),
                        two_color.empty_canvas(20_000), sampling.SpeculativeSpec(k=k))
  assert float(two_color.invalid_fraction(out.tokens_BxL)) == 0.0
  rounds = np.asarray(out.rounds_B)
  assert np.all(rounds == (2 if k == 1 else 1))
  # A start-up call, then one context per position in each round.
  assert np.all(np.asarray(out.contexts_B) == 3)
  # Both colours come up: 20,000 fair coin flips, 4 standard errors is 0.014.
  assert abs(float(np.mean(np.asarray(out.tokens_BxL)[:, 0] == two_color.RED)) - 0.5) < 0.014


@pytest.mark.slow
def test_scan_and_add_exact_denoiser_is_indistinguishable_from_data():
  n, repeats = 2000, 200
  out = sampling.sample(sa.exact_denoiser, None, jax.random.key(0), sa.empty_canvas(n),
                        sampling.SpeculativeSpec(k=4))
  tokens = np.asarray(out.tokens_BxL)
  checks = sa.checks(tokens)
  assert checks["add_count_valid"].all() and checks["correct"].all()
  draw = lambda i: np.asarray(sa.sample_data(jax.random.key(900 + i), n))
  null = metrics.noise_floor(draw, n, sa.VOCAB_SIZE + 1, repeats=repeats)
  compared = metrics.compare_to_data(tokens, draw(2 * repeats), null, sa.VOCAB_SIZE + 1)
  assert compared["p_value"] > 0.01, compared
  assert float(np.mean(np.asarray(out.rounds_B))) < sa.LENGTH / 2


def _numpy_verify(p, q, d, valid, u, gumbel):
  batch, k, _ = p.shape
  accepted = np.zeros(batch, np.int32)
  for b in range(batch):
    for j in range(k):
      if not (valid[b, j] and u[b, j] * q[b, j, d[b, j]] < p[b, j, d[b, j]]):
        break
      accepted[b] += 1
  residual = np.maximum(p - q, 0)
  residual /= residual.sum(-1, keepdims=True)
  with np.errstate(divide="ignore"):
    replacement = np.argmax(np.log(residual) + gumbel, -1)
  return accepted, replacement


def test_acceptance_rule_matches_numpy_and_residuals_normalise():
  rng = np.random.default_rng(0)
  batch, k, vocab = 256, 5, 6
  p = rng.dirichlet(np.ones(vocab), (batch, k)).astype(np.float32)
  q = rng.dirichlet(np.ones(vocab), (batch, k)).astype(np.float32)
  d = np.array([[rng.choice(vocab, p=q[b, j] / q[b, j].sum()) for j in range(k)]
                for b in range(batch)])
  valid = np.arange(k)[None] < rng.integers(1, k + 1, batch)[:, None]
  u, gumbel = rng.random((batch, k)), rng.gumbel(size=(batch, k, vocab))
  got = speculative.verify(*map(jnp.asarray, (p, q, d, valid, u, gumbel)))
  want = _numpy_verify(p, q, d, valid, u, gumbel)
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1], want[1])
  residual = np.asarray(speculative.residual_probs(jnp.asarray(p), jnp.asarray(q)))
  np.testing.assert_allclose(residual.sum(-1), 1.0, atol=1e-5)
  assert residual.min() >= 0
  same = np.asarray(speculative.residual_probs(jnp.asarray(p), jnp.asarray(p)))
  np.testing.assert_allclose(same, p)  # no residual mass: p itself (never used)


def test_one_slot_commits_an_exact_draw_of_p():
  # Draft from q, accept or replace from the residual: the committed value follows p.
  n, vocab = 200_000, 5
  p = np.array([0.5, 0.2, 0.15, 0.1, 0.05], np.float32)
  q = np.array([0.1, 0.1, 0.2, 0.3, 0.3], np.float32)
  key_d, key_u, key_g = jax.random.split(jax.random.key(0), 3)
  d = jax.random.categorical(key_d, jnp.log(q), shape=(n, 1))
  accepted, replacement = speculative.verify(
      jnp.broadcast_to(p, (n, 1, vocab)), jnp.broadcast_to(q, (n, 1, vocab)), d,
      jnp.ones((n, 1), bool), jax.random.uniform(key_u, (n, 1)),
      jax.random.gumbel(key_g, (n, 1, vocab)))
  value = np.where(np.asarray(accepted) == 1, np.asarray(d)[:, 0], np.asarray(replacement)[:, 0])
  freq = np.bincount(value, minlength=vocab) / n
  # 4 binomial standard errors per cell.
  np.testing.assert_array_less(np.abs(freq - p), 4 * np.sqrt(p * (1 - p) / n))


@pytest.mark.slow
def test_finished_rows_stop_changing_and_fixed_positions_hold():
  vocab, length, prompt = 6, 12, 4
  params = stubs.stub_params(vocab, length)
  rng = np.random.default_rng(1)
  tokens = np.full((16, length), vocab, np.int32)
  tokens[:, :prompt] = rng.integers(0, vocab, (16, prompt))
  spec = sampling.SpeculativeSpec(k=3, record_trajectory=True, temperature=0.8, top_k=4)
  out = sampling.sample(stubs.stub_denoiser, params, jax.random.key(0), jnp.asarray(tokens), spec)
  final, traj = np.asarray(out.tokens_BxL), np.asarray(out.trajectory_KxBxL)
  rounds, write_step = np.asarray(out.rounds_B), np.asarray(out.write_step_BxL)
  assert traj.shape == (length, 16, length) and not np.any(final == vocab)
  np.testing.assert_array_equal(final[:, :prompt], tokens[:, :prompt])
  assert np.all(write_step[:, :prompt] == -1)
  for b in range(16):
    assert write_step[b].max() == rounds[b] - 1
    assert np.all(traj[rounds[b] - 1:, b] == final[b])  # finished: never changes again
    assert np.all((traj[:rounds[b] - 1, b] == vocab).any(-1))  # not finished before
  assert np.all(rounds <= length - prompt) and np.all(rounds >= (length - prompt) / 3)


@pytest.mark.slow
def test_greedy_is_the_greedy_chain_rule_for_every_k():
  # T = 0: a draft is accepted iff it is the verifier's argmax, else replaced by it.
  vocab, length = 6, 10
  params = stubs.stub_params(vocab, length)
  canvas = jnp.full((8, length), vocab, jnp.int32)
  run = lambda k: np.asarray(sampling.sample(
      stubs.stub_denoiser, params, jax.random.key(k), canvas,
      sampling.SpeculativeSpec(k=k, order="lowest_index", temperature=0.0)).tokens_BxL)
  chain = np.asarray(sampling.sample(stubs.stub_denoiser, params, jax.random.key(0), canvas,
                                     sampling.OrderedSpec.left_to_right(length,
                                                                        temperature=0.0)).tokens_BxL)
  for k in (1, 3, 10):
    np.testing.assert_array_equal(run(k), chain)


@pytest.mark.parametrize("make, match", [
    (lambda: sampling.SpeculativeSpec(k=0), "k=0"),
    (lambda: sampling.SpeculativeSpec(k=2, order="prob"), "order='prob'.*draws"),
    (lambda: sampling.SpeculativeSpec(k=2, order="fixed"), "positions=None"),
    (lambda: sampling.SpeculativeSpec(k=2, positions=(0, 1)), "only used with order='fixed'"),
    (lambda: sampling.SpeculativeSpec(k=2, order="fixed", positions=(0, 0)), "distinct"),
])
def test_bad_specs_raise_clear_errors(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_bad_calls_raise_before_tracing():
  canvas = two_color.empty_canvas(4)
  spec = sampling.SpeculativeSpec(k=2, order="fixed", positions=(1,))
  with pytest.raises(ValueError, match=r"positions miss masked positions \[0\]"):
    sampling.sample(two_color.exact_denoiser, None, jax.random.key(0), canvas, spec)
  with pytest.raises(ValueError, match="use sample"):
    sampling.sample_python_loop(two_color.exact_denoiser, None, jax.random.key(0), canvas,
                                sampling.SpeculativeSpec(k=2))


@pytest.mark.slow
def test_sample_script_runs_the_speculative_family():
  import os
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  proc = subprocess.run(
      [sys.executable, os.path.join(repo, "sample.py"), "--task=two_color", "--oracle",
       "--sampler=speculative", "--k=2", "--num_samples=200", "--batch_size=200"],
      env=dict(os.environ, PYTHONPATH=repo), capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "invalid_fraction 0.0" in " ".join(proc.stdout.split()), proc.stdout
