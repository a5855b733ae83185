"""The CDLM objective: its trajectory states and three terms by hand, its draws enumerated,
the teacher's replayed distributions, the config checks, and (slow) a short LoRA run that
lowers the loss and resumes bit for bit."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import distill_cdlm
from mdjax import tasks, train
from mdjax.accelerators import cdlm
from mdjax.train.config_checks import ConfigError
from tests.accelerators.students import tiny_start, tiny_student, trained_and_resumed


def _softmax(logits_V):
  z = np.asarray(logits_V, np.float64)
  p = np.exp(z - z.max())
  return p / p.sum()


def _kl(p_V, logits_V):
  p, q = np.asarray(p_V, np.float64), _softmax(logits_V)
  return float(sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q) if pi > 0))


# Prompt of 1, 4 generated positions in blocks of 2, written block by block as the teacher
# decodes: block 0 (positions 1, 2) at steps 1, 0; block 1 (positions 3, 4) at steps 3, 2.
WRITES = np.array([[-1, 1, 0, 3, 2]])


@pytest.mark.parametrize("step, masked_y, masked_star", [
    (0, [1, 2, 3, 4], [3, 4]),  # the first block's completion: block 1 still masked
    (1, [1, 3, 4], [3, 4]),
    (2, [3, 4], []),  # the last block: nothing masked at its completion
    (3, [3], [])])
def test_the_trajectory_state_and_its_block_completion(step, masked_y, masked_star):
  y, star = cdlm.trajectory_masks(jnp.asarray(WRITES), jnp.array([step]), 1, 2)
  assert np.flatnonzero(np.asarray(y)[0]).tolist() == masked_y
  assert np.flatnonzero(np.asarray(star)[0]).tolist() == masked_star


def test_the_three_terms_by_hand():
  # Two rows, L = 3 (a prompt of 1), V = 3. Row 0: U = {1}, S = {2}; row 1: U = {1, 2},
  # S = {} (it counts in the distillation mean only).
  rng = np.random.default_rng(0)
  logits_y, logits_star, logits_dlm = (rng.normal(size=(2, 3, 3)).astype(np.float32)
                                       for _ in range(3))
  probs = np.zeros((2, 3, 3), np.float32)
  probs[:, 1:] = rng.dirichlet(np.ones(3), size=(2, 2))
  probs[0, 1] = [0.0, 0.25, 0.75]  # a zero probability: 0 log 0 = 0
  truth = np.array([[0, 2, 1], [0, 0, 2]])
  masked_y = np.array([[False, True, True], [False, True, True]])
  masked_star = np.array([[False, False, True], [False, False, False]])
  dlm_masked = np.array([[False, True, False], [False, True, True]])
  t = np.array([0.5, 0.25], np.float32)
  loss, aux = cdlm.cdlm_terms(logits_y, logits_star, logits_dlm, probs, truth, masked_y,
                              masked_star, dlm_masked, t, generated=2, distill_weight=1.0,
                              consistency_weight=0.5, dlm_weight=0.1)
  distillation = (_kl(probs[0, 1], logits_y[0, 1])
                  + (_kl(probs[1, 1], logits_y[1, 1]) + _kl(probs[1, 2], logits_y[1, 2])) / 2) / 2
  consistency = _kl(_softmax(logits_star[0, 2]), logits_y[0, 2])  # row 1 has no S
  nll = lambda b, i: -math.log(_softmax(logits_dlm[b, i])[truth[b, i]])
  dlm = (nll(0, 1) / (0.5 * 2) + (nll(1, 1) + nll(1, 2)) / (0.25 * 2)) / 2
  assert float(aux["distillation"]) == pytest.approx(distillation, rel=1e-5)
  assert float(aux["consistency"]) == pytest.approx(consistency, rel=1e-5)
  assert float(aux["dlm"]) == pytest.approx(dlm, rel=1e-5)
  assert float(loss) == pytest.approx(distillation + 0.5 * consistency + 0.1 * dlm, rel=1e-5)
  # The consistency target y* is a stop-gradient: no gradient reaches its logits.
  grad = jax.grad(lambda star: cdlm.cdlm_terms(
      logits_y, star, logits_dlm, probs, truth, masked_y, masked_star, dlm_masked, t,
      generated=2)[0])(jnp.asarray(logits_star))
  np.testing.assert_array_equal(grad, 0.0)


# A stub student whose logits depend on the canvas (how many positions are masked), so each
# trajectory state has its own loss.
WEIGHTS_LxV = jnp.array([[0.0, 0.0, 0.0], [1.0, -0.5, 0.2], [0.3, 0.9, -1.0], [-0.4, 0.1, 0.6],
                         [0.2, 0.2, -0.3]])


def _stub(params, tokens_BxL, t_B):
  masked_B = (tokens_BxL == 3).sum(-1).astype(jnp.float32)
  return WEIGHTS_LxV[None] * (1.0 + masked_B)[:, None, None] + 0.1 * t_B[:, None, None]


def test_the_loss_is_its_trajectory_states_enumerated():
  # Without the dlm term the loss of one row is a function of the drawn step k (uniform
  # over the teacher's 4 steps): its mean over N keys is within 4 of its standard errors
  # of the mean over k of the terms at k.
  tokens = jnp.array([[0, 2, 1, 0, 1]])
  probs = jnp.asarray(np.random.default_rng(1).dirichlet(np.ones(3), size=(1, 5)), jnp.float32)
  kw = dict(prompt_length=1, block_size=2, mask_id=3, num_teacher_steps=4, dlm_weight=0.0)

  @jax.jit
  def terms_at(k):
    y, star = cdlm.trajectory_masks(jnp.asarray(WRITES), k[None], 1, 2)
    z = lambda m: jnp.where(m, 3, tokens)
    time = lambda m: m[:, 1:].sum(-1) / 4.0
    return cdlm.cdlm_terms(_stub(None, z(y), time(y)), _stub(None, z(star), time(star)),
                           _stub(None, tokens, time(y)), probs, tokens, y, star,
                           jnp.zeros_like(y), jnp.ones(1), generated=4, dlm_weight=0.0)[0]

  expected = float(np.mean([terms_at(jnp.int32(k)) for k in range(4)]))
  keys = jax.random.split(jax.random.key(2), 2000)
  losses = np.asarray(jax.jit(jax.vmap(lambda key: cdlm.cdlm_loss(
      _stub, None, key, tokens, jnp.asarray(WRITES), probs, tokens, **kw)[0]))(keys), np.float64)
  assert abs(losses.mean() - expected) < 4 * losses.std() / math.sqrt(len(losses))


def test_the_masked_denoising_term_is_unbiased():
  # A uniform student: every masked position costs log V, so the term is
  # log V * masked / (t G); masked ~ Binomial(G, t) makes its expectation log V. Its
  # standard error from the keys' own spread; the bound is 4 of them.
  uniform = lambda params, tokens_BxL, t_B: jnp.zeros(tokens_BxL.shape + (3,))
  tokens = jnp.array([[0, 2, 1, 0, 1]])
  keys = jax.random.split(jax.random.key(3), 4000)
  losses = np.asarray(jax.jit(jax.vmap(lambda key: cdlm.cdlm_loss(
      uniform, None, key, tokens, jnp.asarray(WRITES), jnp.zeros((1, 5, 3)), tokens,
      prompt_length=1, block_size=2, mask_id=3, num_teacher_steps=4, distill_weight=0.0,
      consistency_weight=0.0, dlm_weight=1.0)[0]))(keys), np.float64)
  assert abs(losses.mean() - math.log(3)) < 4 * losses.std() / math.sqrt(len(losses))


def _config(**changes):
  return tiny_student(distill_cdlm, num_prompts=64, **changes)


@pytest.mark.slow
def test_the_pool_keeps_the_teachers_distribution_at_each_write():
  # The sudoku4 oracle as the teacher, greedy, in blocks of 8: each written cell is the
  # argmax of the distribution kept for it (ties: the lower id, as the sampler's), that
  # distribution is the oracle's on the canvas before the write, and the truth rows hold the
  # pool's prompts.
  config = cdlm.resolve_config(_config(**{"distill.num_prompts": 6}))
  task = tasks.from_config(config)
  pool = cdlm.trajectories(config, task, cdlm.options(config))
  tokens, writes, probs = pool["tokens"], pool["writes"], pool["probs"]
  np.testing.assert_array_equal(pool["truth"][:, :16], tokens[:, :16])
  np.testing.assert_array_equal(probs[:, 16:].argmax(-1), tokens[:, 16:])
  np.testing.assert_array_equal(probs[:, :16], 0.0)
  # Blocks in order, one cell a step: row 0's steps 8b..8b+7 write block b.
  np.testing.assert_array_equal(np.sort(writes[0, 16:]), np.arange(16))
  assert (writes[0, 16:].reshape(2, 8) // 8 == np.arange(2)[:, None]).all()
  import mdjax
  oracle = mdjax.load("sudoku4", task_kwargs=config.task_kwargs.to_dict())
  i = int(np.flatnonzero(writes[0] == 9)[0])
  canvas = np.where((np.arange(32) < 16) | (writes[0] < 9), tokens[0], task.mask_id)
  direct = jax.nn.softmax(oracle.denoiser(oracle.params, jnp.asarray(canvas[None]),
                                          jnp.ones(1)))[0, i]
  np.testing.assert_allclose(probs[0, i], direct, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("changes, field", [
    ({"distill.teacher": None}, "distill.teacher"),
    ({"distill.consistency_weight": -1.0}, "distill.consistency_weight"),
    ({"distill.block_lengths": "8,16"}, "distill.block_lengths"),
    ({"model.block_size": None}, "model.block_size"),
    ({"train.init_from": "pretrained:/nowhere"}, "train.init_from"),
])
def test_bad_cdlm_configs_are_refused_by_field(changes, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    cdlm.resolve_config(_config(**changes))


@pytest.mark.parametrize("changes, field", [
    ({"distill.prompt_length": 6}, "distill.prompt_length"),  # mid-block
    ({"model.block_size": 5}, "model.block_size"),  # does not divide 32
    ({"distill.num_prompts": 8}, "distill.num_prompts"),  # under the batch of 16
])
def test_a_layout_the_exact_cache_cannot_serve_is_refused_before_the_teacher_runs(changes,
                                                                                   field):
  config = cdlm.resolve_config(_config(**changes))
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    train.make_loss_fn(config, None, tasks.from_config(config))


def _mean_loss(config, params, apply_fn, task):
  """The loss on 8 fixed keys and batches at the last step's pool order."""
  loss_fn = train.make_loss_fn(config, apply_fn, task)
  params = jax.tree.map(jnp.asarray, params)
  values = [loss_fn(params, jax.random.key(100 + i),
                    jnp.asarray(train.batch_for_step(config, i, task)),
                    step=config.train.num_steps)[0] for i in range(8)]
  return float(np.mean(values))


@pytest.mark.slow
def test_a_short_lora_run_lowers_the_loss_resumes_bit_for_bit_and_keeps_the_base(tmp_path):
  # The start: one NELBO step of a bidirectional model; the student: the same weights under
  # block-causal attention, LoRA adapters only.
  config = _config(**{"train.num_steps": 40, "train.lr": 3e-3, "checkpoint.every": 20,
                      "train.lora.rank": 4, "train.init_from": tiny_start(tmp_path / "start")})
  for name in ("d_model", "num_layers", "num_heads", "d_ff"):
    config.model[name] = None  # the start's
  whole = trained_and_resumed(config, tmp_path / "run")
  resolved = cdlm.resolve_config(config)
  assert resolved.model.block_size == 8 and resolved.model.d_model == 32
  task = tasks.from_config(resolved)
  first, _, apply_fn, _ = train.init_state(resolved, train.make_mesh(), task)
  first = jax.device_get(first)
  assert apply_fn.block_size == 8
  jax.tree.map(np.testing.assert_array_equal, whole.params["base"], first.params["base"])
  before = _mean_loss(resolved, first.params, apply_fn, task)
  after = _mean_loss(resolved, whole.params, apply_fn, task)
  assert after < before - 0.1, (before, after)
