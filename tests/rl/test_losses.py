"""mdjax.rl's log-probabilities and objectives: parity with d1 on the tiny LLaDA fixture
(tests/reference/d1.py writes tests/fixtures/rl/d1.npz), numpy transcriptions of d1's and
wd1's losses, and the MC-ELBO on an exact oracle."""

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mdjax
from mdjax import rl, sampling
from mdjax.tasks import sudoku4
from tests.paths import REPO

FIXTURES = os.path.join(REPO, "tests", "fixtures")
# Float32 rounding: the transformers and mdjax forwards of the fixture differ by ~1e-5 in a
# logit (tests/formats/test_parity.py allows 1e-4); a log-softmax entry moves by at most
# twice the largest logit difference.
LOGP_ATOL = 1e-4
# A loss is a float32 sum of 40 terms of size ~1 divided by their count: rounding ~1e-7.
LOSS_ATOL = 1e-6


def jitted(fn, **settings):
  """`fn` compiled with its keyword settings static: one program, not an eager op each."""
  return jax.jit(functools.partial(fn, **settings))


@pytest.fixture(scope="module")
def d1():
  with np.load(os.path.join(FIXTURES, "rl", "d1.npz")) as z:
    return {name: z[name] for name in z.files}


@pytest.fixture(scope="module")
def llada():
  return mdjax.load(os.path.join(FIXTURES, "pretrained", "llada"))


# --- d1 parity ------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg_scale, name", [(0.0, "logps"), (0.5, "logps_cfg")])
def test_per_token_logps_matches_d1(llada, d1, cfg_scale, name):
  logps = rl.per_token_logps(llada, d1["ids"], int(d1["prompt_length"]), key=jax.random.key(0),
                             cfg_scale=cfg_scale)
  assert logps.shape == d1[name].shape and logps.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(logps), d1[name], rtol=0, atol=LOGP_ATOL)


def test_prompt_masking_is_one_draw_of_the_key(llada, d1):
  """p_mask_prompt: prompt position l is masked where uniform(key, (B, L))[l] < p; 1 masks the
  whole prompt (the guidance's unconditional pass), 0 none."""
  ids, prompt_length, key = jnp.asarray(d1["ids"]), int(d1["prompt_length"]), jax.random.key(3)
  fn = lambda ids, p: rl.per_token_logps_fn(llada.denoiser, llada.params, ids, prompt_length,
                                            key, mask_id=llada.mask_id, p_mask_prompt=p)
  drawn = (jax.random.uniform(key, ids.shape) < 0.5) & (jnp.arange(ids.shape[1]) < prompt_length)
  bare = ids.at[:, :prompt_length].set(llada.mask_id)
  half, by_hand, full, unconditional = jax.jit(lambda ids: (
      fn(ids, 0.5), fn(jnp.where(drawn, llada.mask_id, ids), 0.0), fn(ids, 1.0),
      fn(bare, 0.0)))(ids)
  assert 0 < int(drawn.sum()) < ids.shape[0] * prompt_length  # the draw masks some, not all
  np.testing.assert_array_equal(np.asarray(half), np.asarray(by_hand))
  np.testing.assert_array_equal(np.asarray(full), np.asarray(unconditional))
  assert np.abs(np.asarray(half) - d1["logps"]).max() > 1e-3  # the masked prompt matters


@pytest.mark.parametrize("case, num_iterations, beta", [("iter1_beta0", 1, 0.0),
                                                        ("iterN_beta", 4, 0.04)])
def test_grpo_loss_matches_d1(d1, case, num_iterations, beta):
  old = d1["old"] if num_iterations > 1 else None
  ref = d1["ref"] if beta else None
  loss, metrics = jitted(rl.grpo_loss, epsilon=float(d1["epsilon"]), beta=beta)(
      d1["logps"], old, ref, d1["advantages"], d1["completion_mask"])
  np.testing.assert_allclose(float(loss), d1[f"{case}_loss"], rtol=0, atol=LOSS_ATOL)
  np.testing.assert_allclose(float(metrics["clip_ratio"]), d1[f"{case}_clip_ratio"], atol=1e-7)
  if beta:
    np.testing.assert_allclose(float(metrics["kl"]), d1[f"{case}_kl"], rtol=0, atol=LOSS_ATOL)
  else:
    assert "kl" not in metrics


def test_completion_mask_matches_d1(llada, d1):
  completion = d1["ids"][:, int(d1["prompt_length"]):]
  np.testing.assert_array_equal(np.asarray(rl.completion_mask(completion, llada.eos_id)),
                                d1["completion_mask"])
  # Any of a model's stop ids ends a row (end of turn as well as EOS).
  completion = completion.copy()
  completion[1, 4] = llada.eot_id
  assert np.asarray(rl.completion_mask(completion, llada.stop_ids))[1].tolist() == [1] * 5 + [0] * 5


# --- numpy transcriptions ---------------------------------------------------------------------


def d1_loss_numpy(logps, old, ref, adv, mask, epsilon, beta):
  """d1's compute_loss, line by line in float64."""
  coef_1 = np.exp(logps - old)
  coef_2 = np.clip(coef_1, 1 - epsilon, 1 + epsilon)
  loss1, loss2 = coef_1 * adv[:, None], coef_2 * adv[:, None]
  kl = np.exp(ref - logps) - (ref - logps) - 1
  per_token = -np.minimum(loss1, loss2) + beta * kl
  n = mask.sum()
  return ((per_token * mask).sum() / n, (kl * mask).sum() / n,
          ((loss1 < loss2) * mask).sum() / n)


def random_batch(seed, rows=6, cols=5):
  rng = np.random.default_rng(seed)
  logps = -rng.exponential(1.0, (rows, cols))
  lengths = rng.integers(1, cols + 1, rows)
  mask = (np.arange(cols) < lengths[:, None]).astype(np.float64)
  return (logps, logps + rng.normal(0, 0.5, logps.shape), logps + rng.normal(0, 0.5, logps.shape),
          rng.normal(0, 1, rows), mask)


def test_grpo_loss_against_numpy_with_clipping_and_kl():
  logps, old, ref, adv, mask = random_batch(0)
  loss, metrics = jitted(rl.grpo_loss, epsilon=0.2, beta=0.1)(logps, old, ref, adv, mask)
  want_loss, want_kl, want_clip = d1_loss_numpy(logps, old, ref, adv, mask, 0.2, 0.1)
  assert 0.1 < want_clip < 0.9  # both kinds of tokens present
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["kl"]), want_kl, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["clip_ratio"]), want_clip, rtol=1e-6)


def test_grpo_loss_gradient_of_one_iteration():
  """old_logps None (num_iterations 1): the ratio is exp(logps - stop_gradient(logps)) = 1,
  so d loss / d logps = mask (-A + beta (1 - exp(ref - logps))) / sum(mask)."""
  logps, _, ref, adv, mask = random_batch(1)
  grad = jax.jit(jax.grad(lambda lp: rl.grpo_loss(lp, None, ref, adv, mask, epsilon=0.2,
                                                  beta=0.1)[0]))(jnp.asarray(logps, jnp.float32))
  want = mask * (-adv[:, None] + 0.1 * (1 - np.exp(ref - logps))) / mask.sum()
  np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("kl_estimator", ["k3", "k2"])
def test_the_kl_penalty_gradient_in_expectation_over_the_policy(kl_estimator):
  """The penalty is differentiated through logps at tokens the policy drew. Its gradient in
  the policy's logits, averaged over the tokens by their probabilities (enumerated), is
  k3's: the gradient of KL(ref || policy), the mass-covering KL (in a logit, policy - ref: a
  pull that does not vanish as the policy leaves the reference, which stalls mode seeking);
  k2's: the gradient of KL(policy || ref), the KL the objective names."""
  policy_logits_V = jnp.asarray([1.5, -0.3, 0.2, -2.0])
  ref_logp_V = jax.nn.log_softmax(jnp.asarray([0.1, 0.4, -0.2, 0.3]))

  def penalty(logits_V, token):
    logp_V = jax.nn.log_softmax(logits_V)
    loss, _ = rl.grpo_loss(logp_V[token][None, None], None, ref_logp_V[token][None, None],
                           jnp.zeros((1,)), jnp.ones((1, 1)), epsilon=0.2, beta=1.0,
                           kl_estimator=kl_estimator)
    return loss  # advantage 0: the penalty alone

  policy_V = jax.nn.softmax(policy_logits_V)
  expected = sum(policy_V[x] * jax.grad(penalty)(policy_logits_V, x) for x in range(4))
  if kl_estimator == "k3":
    kl = lambda logits: (jnp.exp(ref_logp_V) * (ref_logp_V - jax.nn.log_softmax(logits))).sum()
  else:
    kl = lambda logits: (jax.nn.softmax(logits) * (jax.nn.log_softmax(logits) - ref_logp_V)).sum()
  np.testing.assert_allclose(np.asarray(expected), np.asarray(jax.grad(kl)(policy_logits_V)),
                             rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="kl_estimator='k1' must be one of"):
    rl.grpo_loss(
        jnp.zeros((1, 1)), None, jnp.zeros((1, 1)), jnp.zeros((1,)), jnp.ones((1, 1)),
        epsilon=0.2, beta=1.0, kl_estimator="k1")


def wd1_numpy(logps, advantages, mask, negative=True):
  """wd1's compute_loss (rev_grpo_trainer.py) on one batch: softmax over dim 0."""
  softmax = lambda a: np.exp(a - a.max()) / np.exp(a - a.max()).sum()
  seq = (logps * mask).sum(-1)
  loss = -(seq * softmax(advantages)).sum()
  return loss + (seq * softmax(-advantages)).sum() if negative else loss


@pytest.mark.parametrize("negative", [True, False])
def test_wd1_loss_against_numpy(negative):
  logps, _, _, rewards, mask = random_batch(2)
  advantages = np.asarray(rl.group_advantages(rewards, 3))
  # group_size = B: the reference's softmax over its whole batch.
  loss, metrics = jitted(rl.wd1_loss, group_size=6, negative=negative)(logps, advantages, mask)
  np.testing.assert_allclose(float(loss), wd1_numpy(logps, advantages, mask, negative), rtol=1e-5)
  # Groups of 3: the reference on each group's batch, summed.
  loss, metrics = jitted(rl.wd1_loss, group_size=3, negative=negative)(logps, advantages, mask)
  want = sum(wd1_numpy(logps[g], advantages[g], mask[g], negative)
             for g in (slice(0, 3), slice(3, 6)))
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["logp"]), (logps * mask).sum(-1).mean(), rtol=1e-5)


def test_group_advantages():
  rewards = np.array([1.0, 0.0, 0.5, 2.0, 2.0, 2.0])
  np.testing.assert_allclose(np.asarray(rl.group_advantages(rewards, 3)),
                             [0.5, -0.5, 0.0, 0.0, 0.0, 0.0], atol=1e-6)
  scaled = np.asarray(rl.group_advantages(rewards, 3, scale_by_std=True))
  np.testing.assert_allclose(scaled[:3], np.array([0.5, -0.5, 0.0]) / (0.5 + 1e-4), rtol=1e-5)
  np.testing.assert_allclose(scaled[3:], 0.0, atol=1e-6)  # a constant group: no signal
  with pytest.raises(ValueError, match="group_size=1 must be an integer >= 2"):
    rl.group_advantages(rewards, 1)
  with pytest.raises(ValueError, match="group_size=4 does not divide the 6 rows"):
    rl.group_advantages(rewards, 4)


def test_bad_input_is_refused_naming_it(llada, d1):
  logps, old, ref, adv, mask = random_batch(3)
  with pytest.raises(ValueError, match="ref_logps is None with beta=0.04"):
    rl.grpo_loss(logps, old, None, adv, mask, epsilon=0.2, beta=0.04)
  with pytest.raises(ValueError, match="ref_logps is given with beta=0"):
    rl.grpo_loss(logps, old, ref, adv, mask, epsilon=0.2, beta=0)
  with pytest.raises(ValueError, match="epsilon=-0.1"):
    rl.grpo_loss(logps, old, None, adv, mask, epsilon=-0.1, beta=0)
  with pytest.raises(ValueError, match=r"advantages has shape \(5,\)"):
    rl.grpo_loss(logps, old, None, adv[:5], mask, epsilon=0.2, beta=0)
  ids, prompt_length = d1["ids"], int(d1["prompt_length"])
  with pytest.raises(ValueError, match="prompt_length=16 must be an integer in"):
    rl.per_token_logps(llada, ids, 16, key=jax.random.key(0))
  with pytest.raises(ValueError, match="p_mask_prompt=1.5"):
    rl.per_token_logps(llada, ids, prompt_length, key=jax.random.key(0), p_mask_prompt=1.5)
  masked = ids.copy()
  masked[0, -1] = llada.mask_id
  with pytest.raises(ValueError, match="hold the mask id 300"):
    rl.per_token_logps(llada, masked, prompt_length, key=jax.random.key(0))


# --- the MC-ELBO on an exact oracle ---------------------------------------------------------------


@pytest.mark.slow
def test_elbo_logps_is_the_exact_conditional_on_an_oracle():
  """4x4 Sudoku's exact denoiser: log p(solution | puzzle) = -log(#grids agreeing with the
  givens). The stratified ELBO of an exact denoiser is unbiased for it: sum over counts l of
  (1 / T) (T / l) E[sum of the l masked positions' exact conditionals] is the any-order
  chain rule averaged over orders. A row with a unique solution has every conditional 1:
  every draw is 0, no Monte Carlo error at all.

  Error: each of K keys draws its own plan (shared by the rows: common random numbers), so
  the K per-key means over rows of (estimate - exact) are i.i.d. with mean 0 (unbiased);
  their mean is within 4 standard errors (std / sqrt(K)) unless the estimator is biased (or
  with probability ~1e-3 under a t-distribution with K - 1 = 15 degrees of freedom; the keys
  are fixed, so the outcome is too)."""
  model = mdjax.load("sudoku4", task_kwargs=dict(given_probability=0.3))
  x = np.asarray(model.task.sample_data(jax.random.key(0), 8))
  agree = [np.all((p == sudoku4.BLANK) | (sudoku4.grids() == p), 1).sum() for p in x[:, :16]]
  exact = -np.log(np.array(agree, np.float64))
  assert (exact == 0).any() and (exact < -1).any()  # unique and ambiguous puzzles both
  keys = jax.random.split(jax.random.key(1), 16)
  est = np.asarray(jax.jit(jax.vmap(lambda k: rl.elbo_logps_fn(
      model.denoiser, model.params, x, 16, k, mask_id=model.mask_id, num_samples=8)))(keys),
      np.float64)
  assert est.shape == (16, 8)
  np.testing.assert_allclose(est[:, exact == 0], 0.0, atol=1e-6)
  per_key = (est - exact).mean(1)
  stderr = per_key.std(ddof=1) / math.sqrt(len(per_key))
  assert 0 < stderr < 0.2
  assert abs(per_key.mean()) < 4 * stderr, (per_key.mean(), stderr)


@pytest.mark.slow
def test_trajectory_logps_are_the_chain_rule_on_an_oracle():
  """4x4 Sudoku's exact denoiser decoded one cell a step (confidence, 16 steps): each cell is
  scored under the canvas its step read, so a row's sum is the chain rule along the order the
  sampler chose: exactly log p(solution | puzzle) = -log(#grids agreeing with the givens),
  with no Monte Carlo error. At 4 cells a step the same scoring reads fewer cells per pass;
  it is then the log-probability of the parallel decode, not of the solution."""
  model = mdjax.load("sudoku4", task_kwargs=dict(given_probability=0.3))
  x = np.asarray(model.task.sample_data(jax.random.key(0), 8))
  canvas = np.where(np.arange(32) < 16, x, model.mask_id)
  fixed = np.broadcast_to(np.arange(32) < 16, x.shape)
  spec = sampling.make_spec("confidence", length=32, steps=16)
  out = sampling.sample(model.denoiser, model.params, jax.random.key(1), canvas, spec, fixed,
                        mask_id=model.mask_id)
  tokens, write = np.asarray(out.tokens_BxL), np.asarray(out.write_step_BxL)
  assert (write[:, :16] == -1).all() and (np.sort(write[:, 16:], 1) == np.arange(16)).all()
  agree = [np.all((p == sudoku4.BLANK) | (sudoku4.grids() == s), 1).sum()
           for p, s in zip(tokens[:, :16], tokens[:, 16:])]
  assert all(model.task.checks(tokens)["solved"]) and min(agree) >= 1
  given_agree = [np.all((p == sudoku4.BLANK) | (sudoku4.grids() == p), 1).sum()
                 for p in tokens[:, :16]]
  logps = np.asarray(rl.trajectory_logps_fn(model.denoiser, model.params, tokens, write, 16,
                                            mask_id=model.mask_id, num_steps=16), np.float64)
  assert logps.shape == (8, 16) and (logps <= 1e-6).all()
  np.testing.assert_allclose(logps.sum(1), -np.log(np.array(given_agree, np.float64)),
                             atol=1e-5)
  with pytest.raises(ValueError, match="num_steps=0"):
    rl.trajectory_logps_fn(model.denoiser, model.params, tokens, write, 16,
                           mask_id=model.mask_id, num_steps=0)
