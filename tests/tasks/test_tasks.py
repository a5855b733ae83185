"""Tests of the synthetic tasks and their exact denoisers."""

import dataclasses
import itertools
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import diffusion, sampling, tasks
from mdjax.tasks import scan_and_add as sa
from mdjax.tasks import two_color
from tests.paths import REPO
from experiments.tiny_text import write_corpus

SMALL = sa.Params(n=3, max_command_id=3)  # 6 arrangements, 1000 value triples, 2 ids a kind


@pytest.mark.parametrize("name, kwargs", [("two_color", {}), ("scan_and_add", {}),
                                          ("scan_and_add", {"max_command_id": 9}), ("text", None)])
@pytest.mark.slow
def test_every_task_is_a_task_value(name, kwargs, tmp_path):
  if kwargs is None:
    kwargs = {"text_path": write_corpus(tmp_path / "c.txt"), "length": 16}
  task = tasks.get(name, kwargs)
  assert isinstance(task, tasks.Task) and task.name == name
  assert tasks.get(name, kwargs) is task  # built once per parameters
  with pytest.raises(dataclasses.FrozenInstanceError):
    task.length = 3
  assert task.mask_id == task.vocab_size
  canvas_BxL = np.asarray(task.empty_canvas(3))
  assert canvas_BxL.shape == (3, task.length) and np.all(canvas_BxL == task.mask_id)
  for draw in (task.sample_data, task.validation_data):
    x_BxL = np.asarray(draw(jax.random.key(0), 4))
    assert x_BxL.shape == (4, task.length) and 0 <= x_BxL.min() and x_BxL.max() < task.vocab_size
  assert isinstance(task.decode(x_BxL[0]), str)
  assert all(isinstance(v, float) for v in task.sample_metrics(x_BxL).values())
  if name == "text":
    assert task.exact_denoiser is None and task.encode is not None
    assert task.checkpoint_metadata() == {"vocab": task.tokenizer.vocab}
    np.testing.assert_array_equal(task.encode(task.decode(x_BxL[0])), x_BxL[0])
  else:
    assert task.encode is None and task.tokenizer is None and task.checkpoint_metadata() == {}
    logits = task.exact_denoiser(None, canvas_BxL, jnp.ones(3))
    assert logits.shape == (3, task.length, task.vocab_size)


@pytest.mark.slow
def test_task_values_draw_what_the_modules_draw():
  key = jax.random.key(5)
  task = tasks.get("scan_and_add")
  assert task.params == sa.DEFAULT and task.length == sa.LENGTH
  assert task.exact_denoiser is sa.exact_denoiser
  np.testing.assert_array_equal(task.sample_data(key, 8), sa.sample_data(key, 8))
  synonyms = tasks.get("scan_and_add", {"max_command_id": 9})
  np.testing.assert_array_equal(synonyms.sample_data(key, 8),
                                sa.sample_data(key, 8, sa.Params(max_command_id=9)))
  assert tasks.get("two_color").exact_denoiser is two_color.exact_denoiser
  with pytest.raises(ValueError, match="takes no parameters"):
    tasks.get("two_color", {"length": 3})
  with pytest.raises(ValueError, match="unknown"):
    tasks.get("scan_and_add", {"max_commands": 9})
  with pytest.raises(ValueError, match="must equal vocab_size"):
    dataclasses.replace(task, mask_id=3)


@pytest.mark.slow
def test_tasks_do_not_import_the_samplers():
  code = "import mdjax.tasks, sys; assert 'mdjax.sampling' not in sys.modules"
  proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=REPO),
                        capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-2000:]


def test_write_order_fields_give_a_sampler_spec():
  spec = sampling.parse_write_order("[VOA][v×9]o×10[ht1]", sa.write_order_fields(),
                                    temperature=0.5)
  assert spec.steps == 13


def test_two_color_data_and_denoiser():
  x = np.asarray(two_color.sample_data(jax.random.key(0), 1000))
  assert np.all(x[:, 0] == x[:, 1])
  probs = jax.nn.softmax(two_color.exact_denoiser(
      None, jnp.array([[2, 2], [0, 2], [2, 1]]), jnp.zeros(3)), -1)
  # A masked position copies the other one when it is visible, else 1/2 each.
  np.testing.assert_allclose(probs, [[[.5, .5], [.5, .5]], [[.5, .5], [1, 0]], [[0, 1], [.5, .5]]])


@pytest.mark.parametrize("params", [sa.DEFAULT, sa.Params(max_command_id=9), SMALL])
@pytest.mark.slow
def test_scan_and_add_data_passes_every_check(params):
  x = sa.sample_data(jax.random.key(0), 4000, params)
  assert x.shape == (4000, params.length)
  metrics = sa.sample_metrics(x, params)
  assert metrics["well_formed"] == metrics["correct"] == metrics["add_count_valid"] == 1.0
  assert np.all(np.isfinite(sa.log_prob(x, params)))
  # Each command is an add with probability A / (n + A - 1): 4 binomial s.e.
  cmds = np.asarray(x)[:, params.command_pos]
  p_add = 2 / params.num_commands
  tol = 4 * math.sqrt(p_add * (1 - p_add) / len(cmds))
  assert np.all(np.abs((cmds % 2 == 0).mean(0) - p_add) < tol)
  # Synonyms: every allowed id appears; none above M.
  assert set(np.unique(cmds)) == set(range(params.max_command_id + 1))


def test_layout_matches_the_documented_positions():
  p = sa.DEFAULT
  assert p.length == 25 and list(p.value_pos) == list(range(1, 10))
  assert p.ans_marker_pos == 10 and list(p.answer_pos) == [11, 12, 13]
  assert p.ops_marker_pos == 14 and list(p.command_pos) == list(range(15, 25))


def _brute_force_joint(params):
  """Every sequence of the law with its probability (uniform on the support)."""
  rows = []
  for c1, c2 in sa.arrangements(params):
    for values in itertools.product(range(10), repeat=params.n):
      total = values[c1] % params.modulus + values[c2 - 1] % params.modulus
      for ids in itertools.product(*[params.add_ids if c in (c1, c2) else params.right_ids
                                     for c in range(params.num_commands)]):
        rows.append([sa.VALS, *values, sa.ANS, *sa.answer_digits(total), sa.OPS, *ids])
  return np.array(rows, np.int32)


@pytest.mark.slow
def test_exact_denoiser_matches_brute_force_conditionals():
  support = _brute_force_joint(SMALL)
  assert len(support) == math.comb(4, 2) * 1000 * 2**4
  rng = np.random.default_rng(0)
  x = support[rng.integers(0, len(support), 60)]
  visible = rng.random(x.shape) < rng.random((60, 1))  # a masking rate per row
  z = np.where(visible, x, sa.MASK_ID)
  probs, possible = sa.exact_probs(jnp.asarray(z), SMALL)
  probs = np.asarray(probs, np.float64)
  assert np.all(np.asarray(possible))
  for b in range(len(z)):
    match = np.all((support == z[b]) | (z[b] == sa.MASK_ID), axis=1)
    consistent = support[match]
    for pos in np.flatnonzero(z[b] == sa.MASK_ID):
      expected = np.bincount(consistent[:, pos], minlength=sa.VOCAB_SIZE) / len(consistent)
      np.testing.assert_allclose(probs[b, pos], expected, atol=2e-6, err_msg=f"{b} {pos}")


@pytest.mark.slow
def test_impossible_states_are_flagged_and_well_defined():
  x = np.asarray(sa.sample_data(jax.random.key(0), 1))[0]
  empty = np.full(sa.LENGTH, sa.MASK_ID)
  three_adds = empty.copy()
  three_adds[15:18] = 0
  bad_value = empty.copy()
  bad_value[1] = sa.OPS
  bad_marker = empty.copy()
  bad_marker[0] = 3
  wrong_answer = x.copy()
  wrong_answer[13] = (wrong_answer[13] + 1) % 10
  wrong_answer[12] = sa.MASK_ID
  wrong_answer[11] = 1  # hundreds digit 1 is impossible (max total 18)
  states = jnp.asarray(np.stack([empty, x, three_adds, bad_value, bad_marker, wrong_answer]))
  impossible = np.asarray(sa.is_impossible(states))
  np.testing.assert_array_equal(impossible, [False, False, True, True, True, True])
  probs, _ = sa.exact_probs(states)
  probs = np.asarray(probs)
  assert np.all(np.isfinite(probs))
  np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
  # Masked positions of impossible rows read the all-masked marginals.
  np.testing.assert_allclose(probs[2, 20], probs[0, 20], atol=1e-6)


# The command block's joint compiles the oracle at eight batch shapes (about 7 s); the
# oracle experiment's schema test computes the same joint, so one worker compiles them once.
@pytest.mark.xdist_group("scan_and_add_oracle")
@pytest.mark.slow
def test_all_masked_marginals_and_total_correlation():
  probs, _ = sa.exact_probs(sa.empty_canvas(1))
  probs = np.asarray(probs, np.float64)[0]
  np.testing.assert_allclose(probs[11, 0], 1.0, atol=1e-6)  # hundreds digit is 0
  np.testing.assert_allclose(probs[1, :10], 0.1, atol=1e-6)
  np.testing.assert_allclose(probs[15, :2], [0.2, 0.8], atol=1e-6)
  # Tens digit: 9/45 of arrangements read one value twice (2v >= 10 for half
  # the values), the rest two independent values (x + y >= 10 in 45 of 100).
  np.testing.assert_allclose(probs[12, 1], 0.2 * 0.5 + 0.8 * 0.45, atol=1e-6)
  empty = np.asarray(sa.empty_canvas(1))[0]
  h_add = -(0.2 * math.log2(0.2) + 0.8 * math.log2(0.8))
  tc = sa.total_correlation_bits(empty, list(range(15, 25)))
  np.testing.assert_allclose(tc, 10 * h_add - math.log2(45), atol=1e-4)


@pytest.mark.slow
def test_log_prob_equals_chain_rule_through_the_denoiser():
  params = sa.Params(max_command_id=9)
  x = np.asarray(sa.sample_data(jax.random.key(3), 8, params))
  z = np.full_like(x, sa.MASK_ID)
  total = np.zeros(len(x))
  order = np.random.default_rng(0).permutation(params.length)
  for pos in order:
    probs, _ = sa.exact_probs(jnp.asarray(z), params)
    total += np.log(np.asarray(probs, np.float64)[np.arange(len(x)), pos, x[:, pos]])
    z[:, pos] = x[:, pos]
  np.testing.assert_allclose(total, sa.log_prob(x, params), rtol=1e-5)
  np.testing.assert_allclose(-sa.log_prob(x[:1], params)[0] / math.log(2), sa.entropy_bits(params))


@pytest.mark.slow
def test_oracle_nelbo_equals_entropy():
  batch = 4000
  x = sa.sample_data(jax.random.key(0), batch)
  _, aux = jax.jit(lambda k, x: diffusion.nelbo_loss(
      sa.exact_denoiser, None, k, x, schedule=diffusion.LinearSchedule(),
      mask_id=sa.MASK_ID))(jax.random.key(1), x)
  bits_B = np.asarray(aux["nelbo_nats_B"], np.float64) / math.log(2)
  stderr = bits_B.std() / math.sqrt(batch)
  # 4 Monte Carlo standard errors of the batch mean.
  assert abs(bits_B.mean() - sa.entropy_bits()) < 4 * stderr, (bits_B.mean(), stderr)


@pytest.mark.slow
def test_exact_sequential_sampling_never_violates_and_parallel_commands_do():
  n = 1000
  canvas = sa.empty_canvas(n)
  exact = sampling.sample(sa.exact_denoiser, None, jax.random.key(0), canvas,
                          sampling.RandomOrderSpec())
  metrics = sa.sample_metrics(exact.tokens_BxL)
  assert metrics["correct"] == 1.0 and metrics["add_count_valid"] == 1.0
  groups = ((0, 10, 14, 11), tuple(range(1, 10)), tuple(range(15, 25)), (12, 13))
  parallel = sampling.sample(sa.exact_denoiser, None, jax.random.key(0), canvas,
                             sampling.OrderedSpec(groups=groups))
  violated = 1.0 - sa.sample_metrics(parallel.tokens_BxL)["add_count_valid"]
  # Ten independent Bernoulli(0.2) kinds: P(count != 2) = 1 - C(10,2) .2^2 .8^8.
  theory = 1 - 45 * 0.04 * 0.8**8
  assert abs(violated - theory) < 4 * math.sqrt(theory * (1 - theory) / n), violated
