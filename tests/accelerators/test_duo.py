"""DUO's consistency distillation (objective 'duo'): the duality's keep probability, the
Gaussian trajectories' argmax, the plug-in weights and the KL by hand, the loss's zero on a
consistent stub, the config checks by field, and (slow) a short run on a tiny uniform-noise
teacher that lowers the loss, resumes bit for bit across a teacher update and trains LoRA
adapters only."""

import functools
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import distill_duo
from experiments.tiny_text import tiny_config, write_corpus
import mdjax
from mdjax import diffusion, noise, tasks, train
from mdjax.accelerators import duo
from mdjax.train import objectives
from mdjax.train.config_checks import ConfigError


def _phi(x):
  return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@pytest.mark.parametrize("gamma", [-3.0, -1.0, 0.0, 2.0])
def test_the_keep_probability_of_two_tokens_in_closed_form(gamma):
  # V = 2: argmax(a e_x0 + s eps) = x0 iff a + s (eps_0 - eps_1) > 0, eps_0 - eps_1 ~ N(0, 2):
  # P = Phi(a / (s sqrt 2)), alpha = (2 P - 1) / (2 - 1).
  a, s = math.sqrt(1 / (1 + math.exp(gamma))), math.sqrt(1 / (1 + math.exp(-gamma)))
  expected = 2 * _phi(a / (s * math.sqrt(2))) - 1
  assert float(duo.usdm_alpha(jnp.float32(gamma), 2)) == pytest.approx(expected, abs=1e-5)


def test_the_default_range_is_the_references_under_gpt2_and_wider_under_few_tokens():
  opts = dict(gamma_min=None, gamma_max=None)
  low, high = duo.gamma_range(opts, duo.REFERENCE_VOCAB)
  assert (low, high) == pytest.approx(duo.REFERENCE_GAMMA, abs=1e-3)
  # Its alphas (0.9987 and 0.0062 under GPT-2's vocabulary) at the 65 characters' own gammas.
  alphas = duo.usdm_alpha(jnp.array(duo.REFERENCE_GAMMA), duo.REFERENCE_VOCAB)
  ends = duo.usdm_alpha(jnp.array(duo.gamma_range(opts, 65)), 65)
  np.testing.assert_allclose(ends, alphas, atol=1e-4)
  assert float(alphas[0]) == pytest.approx(0.9987, abs=1e-4)
  assert float(alphas[1]) == pytest.approx(0.0062, abs=1e-4)
  assert duo.gamma_range(dict(gamma_min=-2.0, gamma_max=1.5), 65) == (-2.0, 1.5)


def test_the_argmax_of_the_gaussian_latent_keeps_x0_with_the_keep_probability():
  # 20,000 positions at one gamma: the share with x_t = x0 is alpha + (1 - alpha) / V; 4
  # binomial standard errors at N = 20,000 are <= 0.0142. Equal gammas: the same latent.
  vocab, gamma = 5, 0.3
  x0 = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (100, 200)), jnp.int32)
  g = jnp.full((100,), gamma)
  x_t, x_s = duo.trajectory_pair(jax.random.key(0), x0, g, g, vocab)
  np.testing.assert_array_equal(x_t, x_s)
  alpha = float(duo.usdm_alpha(jnp.float32(gamma), vocab))
  kept = alpha + (1 - alpha) / vocab
  share = float((x_t == x0).mean())
  assert abs(share - kept) < 4 * math.sqrt(kept * (1 - kept) / x0.size)
  # Far apart on one trajectory: clean at gamma -8 (x0 itself), noisy at gamma 3.
  x_clean, x_noisy = duo.trajectory_pair(jax.random.key(1), x0, g - 8.3, g + 2.7, vocab)
  np.testing.assert_array_equal(x_clean, x0)
  assert float((x_noisy == x0).mean()) < 0.5


@pytest.mark.parametrize("schedule", [diffusion.LinearSchedule(),
                                      diffusion.LogLinearSchedule(),
                                      diffusion.CosineSchedule()])
def test_the_time_of_a_keep_probability_inverts_the_schedule(schedule):
  t = jnp.array([0.01, 0.2, 0.5, 0.9, 1.0])
  back = duo.time_for_alpha(schedule, schedule.alpha(t))
  np.testing.assert_allclose(schedule.alpha(back), schedule.alpha(t), atol=1e-6)
  # The time itself where alpha is not flat (the cosine's alpha'(1) = 0).
  np.testing.assert_allclose(back[:4], t[:4], atol=1e-5)
  assert float(duo.time_for_alpha(schedule, jnp.float32(1.0))) == np.float32(duo.MIN_TIME)


def test_the_plugin_weights_and_both_kls_by_hand():
  # V = 3, one position holding token 1 at t = 0.4 (linear: alpha 0.6): q_t(z | v) = 0.6 [v =
  # 1] + 0.4 / 3; the plug-in weights are the posterior divided by it, renormalised.
  process = noise.Uniform(vocab_size=3)
  logits = np.array([[[0.2, 1.5, -0.7]]], np.float32)
  z, t = jnp.array([[1]]), jnp.array([0.4])
  post = np.exp(logits[0, 0]) / np.exp(logits[0, 0]).sum()
  lik = np.array([0.4 / 3, 0.6 + 0.4 / 3, 0.4 / 3])
  w = post / lik / (post / lik).sum()
  got = np.exp(np.asarray(duo.log_plugin(process, logits, z, t))[0, 0])
  np.testing.assert_allclose(got, w, rtol=1e-5)
  np.testing.assert_allclose(got, np.asarray(process.plugin_from_posterior(
      jnp.asarray(post)[None, None], z, t))[0, 0], rtol=1e-5)
  p, q = np.array([0.5, 0.3, 0.2]), np.array([0.1, 0.6, 0.3])
  kl_pq = float((p * np.log(p / q)).sum())
  kl_qp = float((q * np.log(q / p)).sum())
  log_p, log_q = jnp.log(jnp.asarray(p))[None, None], jnp.log(jnp.asarray(q))[None, None]
  assert float(duo.kl_terms(log_p, log_q, "kl-bwd")[0, 0]) == pytest.approx(kl_pq, rel=1e-5)
  assert float(duo.kl_terms(log_p, log_q, "kl-fwd")[0, 0]) == pytest.approx(kl_qp, rel=1e-5)
  # A zero weight of the first argument adds nothing (0 log 0 = 0).
  zero = jnp.log(jnp.array([[[0.0, 0.5, 0.5]]]))
  assert float(duo.kl_terms(zero, log_q, "kl-bwd")[0, 0]) == pytest.approx(
      0.5 * math.log(0.5 / 0.6) + 0.5 * math.log(0.5 / 0.3), rel=1e-5)


@functools.cache
def _compiled(stub, loss, match):
  process = noise.Uniform(vocab_size=4)
  return jax.jit(lambda key, x0, dt: duo.duo_loss(stub, None, None, key, x0, process=process,
                                                  dt=dt, gamma_min=-3.0, gamma_max=2.0,
                                                  loss=loss, match=match))


def _loss(stub, dt=0.25, loss="kl-bwd", match="plugin"):
  x0 = jnp.asarray(np.random.default_rng(1).integers(0, 4, (8, 6)), jnp.int32)
  return _compiled(stub, loss, match)(jax.random.key(3), x0, jnp.float32(dt))


PROCESS = noise.Uniform(vocab_size=4)
WEIGHTS_V = jnp.array([0.3, -1.0, 0.8, 0.1])


def _same_plugin(params, z_BxL, t_B):
  """Posterior: fixed weights times the position's own evidence: the same plug-in weights
  at every (x, t)."""
  return WEIGHTS_V + jnp.log(PROCESS.likelihood(z_BxL, t_B))


def _drifting_plugin(params, z_BxL, t_B):
  return _same_plugin(params, z_BxL, t_B) + 3.0 * t_B[:, None, None] * WEIGHTS_V


def _same_posterior(params, z_BxL, t_B):
  return jnp.broadcast_to(WEIGHTS_V, z_BxL.shape + (4,))


@pytest.mark.parametrize("match, consistent, inconsistent", [
    ("plugin", _same_plugin, _drifting_plugin), ("posterior", _same_posterior, _same_plugin)])
def test_the_loss_is_zero_where_the_matched_outputs_agree_along_the_trajectory(
    match, consistent, inconsistent):
  # Student and teacher agree wherever the compared output does not depend on (x, t): the
  # KL is 0. The plug-in weights of a posterior that holds the position's own evidence
  # differ where x_t and x_s or t and s differ, and the posterior of one with drifting plug-in
  # weights too; with dt = 0 the two sides are one latent at one time.
  for loss in duo.LOSSES:
    value, aux = _loss(consistent, loss=loss, match=match)
    assert abs(float(value)) < 1e-5
  assert float(_loss(inconsistent, match=match)[0]) > 1e-3
  assert 0 < float(aux["moved_fraction"]) < 1  # x_t and x_s differ at some positions
  assert float(_loss(inconsistent, dt=0.0, match=match)[0]) < 1e-5


# ----------------------------------------------------------------------------
# The config checks and the objective through the trainer.
# ----------------------------------------------------------------------------


def _quiet(*args, **kwargs):
  pass


def _tiny_teacher_config(text_path, noise_name="uniform"):
  """The tiny text corpus's character model (1 layer, d_model 32, length 16), 60 steps."""
  config = tiny_config(text_path)
  config.update_from_flattened_dict({
      "noise": noise_name, "model.time_conditioning": True, "num_eval_samples": 0,
      "eval_at_end": False, "train.num_steps": 60, "checkpoint.every": 60,
      "sampler.family": "uniform_ancestral"})
  return config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return write_corpus(tmp_path_factory.mktemp("duo_corpus") / "corpus.txt")


@pytest.fixture(scope="module")
def teacher(corpus, tmp_path_factory):
  """The tiny corpus's model trained under uniform noise."""
  path = str(tmp_path_factory.mktemp("duo") / "teacher")
  train.train(_tiny_teacher_config(corpus), path, log=_quiet)
  return path


def _student(teacher_path, text_path="/nowhere.txt", **changes):
  config = distill_duo.get_config()
  config.task_kwargs.update(text_path=text_path, length=16)
  config.distill.teacher = teacher_path
  config.update_from_flattened_dict({"batch_size": 16, "eval_at_end": False,
                                     "train.warmup_steps": 2, **changes})
  return config


@pytest.mark.parametrize("changes, field", [
    ({"distill.teacher": None}, "distill.teacher"),
    ({"distill.loss": "kl"}, "distill.loss"),
    ({"distill.match": "x0"}, "distill.match"),
    ({"distill.update_teacher_every": 0}, "distill.update_teacher_every"),
    ({"distill.gamma_min": 1.0, "distill.gamma_max": 0.5}, "distill.gamma_min"),
    ({"distill.gamma_max": float("nan")}, "distill.gamma_max"),
    # 500 steps in rounds of 10: 50 rounds, the last step 2^49 / 64 of the time.
    ({"distill.update_teacher_every": 10}, "distill.teacher_steps"),
    ({"distill.teacher": "/nowhere"}, "distill.teacher"),
    ({"distill.teacher": "pretrained:/nowhere"}, "distill.teacher"),
])
def test_bad_duo_configs_are_refused_by_field(changes, field):
  config = _student("/nowhere")
  config.update_from_flattened_dict(changes)
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    duo.resolve_config(config)


def test_each_objective_registered_elsewhere_is_registered_by_its_module():
  # mdjax.load of a saved run imports the module that registers its objective
  # (`objectives.ensure`): DUO's train state holds its teacher, which the objective decides.
  for name, module in objectives.REGISTERED_BY.items():
    objectives.ensure(name)
    assert name in objectives.OBJECTIVES, (name, module)
  assert objectives.get("duo").teacher_copy
  assert not any(objectives.get(name).teacher_copy for name in ("nelbo", "cdlm", "d3llm"))


def test_an_unknown_knob_is_refused():
  config = _student("/nowhere")
  with config.unlocked():
    config.distill.prompt_length = 4
  with pytest.raises(ConfigError, match=r"distill\.prompt_length: unknown to objective 'duo'"):
    duo.resolve_config(config)


@pytest.mark.slow
def test_a_start_other_than_the_teacher_and_other_noise_are_refused(corpus, teacher,
                                                                     tmp_path):
  with pytest.raises(ConfigError, match=r"train\.init_from"):
    duo.resolve_config(_student(teacher, corpus, **{"train.init_from": str(tmp_path)}))
  with pytest.raises(ConfigError, match=r"config field noise="):
    duo.resolve_config(_student(teacher, corpus, noise="hybrid"))
  with pytest.raises(ConfigError, match=r"model\.d_model"):
    duo.resolve_config(_student(teacher, corpus, **{"model.d_model": 64}))
  absorbing = str(tmp_path / "absorbing")
  absorbing_config = _tiny_teacher_config(corpus, "absorbing")
  absorbing_config.update_from_flattened_dict({"train.num_steps": 1, "checkpoint.every": 1,
                                               "sampler.family": "ancestral"})
  train.train(absorbing_config, absorbing, log=_quiet)
  with pytest.raises(ConfigError, match=r"distill\.teacher=.*noise is 'absorbing'"):
    duo.resolve_config(_student(absorbing, corpus, noise="absorbing"))
  resolved = duo.resolve_config(_student(teacher, corpus))
  assert resolved.train.init_from == teacher and resolved.model.d_model == 32


def _losses(config, params, teacher_params, apply_fn, task):
  """The loss of round 0 on 8 fixed keys and batches, the teacher fixed: one per batch."""
  loss_fn = train.make_loss_fn(config, apply_fn, task)
  values = [loss_fn(jax.tree.map(jnp.asarray, params), jax.random.key(100 + i),
                    jnp.asarray(train.batch_for_step(config, i, task)), step=0,
                    teacher_params=jax.tree.map(jnp.asarray, teacher_params))[0]
            for i in range(8)]
  return np.asarray(values, np.float64)


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_short_run_lowers_the_loss_resumes_bit_for_bit_and_trains_lora(corpus, teacher,
                                                                          tmp_path, lora_rank):
  # 12 steps in rounds of 4 (T = 8: steps 1/8, 2/8, 4/8), checkpoints at 6 and 12: the
  # resume from 6 runs round 1's last steps with the teacher of step 4 read back.
  config = _student(teacher, corpus, **{
      "train.num_steps": 12, "distill.update_teacher_every": 4, "distill.teacher_steps": 8,
      "checkpoint.every": 6, "train.lr": 3e-3, "train.lora.rank": lora_rank})
  workdir = tmp_path / "run"
  whole = jax.device_get(train.train(config, str(workdir), log=_quiet))
  shutil.rmtree(workdir / "checkpoints" / "12")
  resumed = jax.device_get(train.train(config, str(workdir), log=_quiet))
  jax.tree.map(np.testing.assert_array_equal, resumed, whole)
  assert mdjax.load(str(workdir)).step == 12  # its state (with the teacher) read back
  resolved = duo.resolve_config(config)
  task = tasks.from_config(resolved)
  first, _, apply_fn, _ = train.init_state(resolved, train.make_mesh(), task)
  first = jax.device_get(first)
  trained = (lambda p: p["lora"]) if lora_rank else (lambda p: p)
  # The teacher kept is the student's copy at step 8, not the start.
  assert not all(np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(whole.teacher_params), jax.tree.leaves(trained(first.params))))
  if lora_rank:  # only the adapters moved
    jax.tree.map(np.testing.assert_array_equal, whole.params["base"], first.params["base"])
  # One round of 24 steps over half the time (T = 2), the start the teacher throughout
  # (update_teacher_every past the run): its loss on 8 fixed batches and keys falls.
  one_round = _student(teacher, corpus, **{
      "train.num_steps": 24, "distill.update_teacher_every": 100, "distill.teacher_steps": 2,
      "train.lr": 3e-3, "train.lora.rank": lora_rank, "checkpoint.every": 24,
      "train.lora.targets": ("q", "k", "v", "o", "gate", "up", "down")})
  final = jax.device_get(train.train(one_round, str(tmp_path / "one"), log=_quiet))
  resolved = duo.resolve_config(one_round)
  before = _losses(resolved, first.params, first.params, apply_fn, task)
  after = _losses(resolved, final.params, first.params, apply_fn, task)
  # Paired over the 8 batches (same keys): the mean fall is over 3 of its standard errors.
  fall = before - after
  assert fall.mean() > 3 * fall.std(ddof=1) / math.sqrt(len(fall)), (before, after)
