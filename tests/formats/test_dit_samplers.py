"""MDLM's and BD3-LM's samplers (their laws against numpy transcriptions of the reference
updates), their entry points on a tiny DiT, and the likelihood estimators against exact
values."""

import dataclasses
import math

import jax
import numpy as np
import pytest

from mdjax import diffusion, sampling
from mdjax.evaluate import elbo
from mdjax.evaluate import perplexity as perplexity_lib
from mdjax.formats.bd3lm import bd3lm_sample
from mdjax.formats.mdlm import mdlm_sample
from mdjax.models import dit
from mdjax.sampling import transforms
from mdjax.sampling.families import bd3lm, mdlm
from mdjax.streams import StepStream
from mdjax.tasks import two_color
from tests import stubs
from tests.sampling.common import LENGTH, PROMPT, VOCAB, binomial_tol, prompted_canvas

ROWS = 4000  # identical rows: each row's draw is one sample of the step's law


def _p_x0(params, canvas_L):
  """The stub's SUBS probabilities over the V real ids on one canvas (float64)."""
  logits = stubs.stub_logits_np(params, canvas_L[None])[0].astype(np.float64)
  e = np.exp(logits - logits.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _reference_nucleus(p_x0_KxV, p):
  """bd3lms `_nucleus_sample`, transcribed: sorted descending, kept while cumsum <= p (the
  first always), renormalised."""
  if p == 1.0:
    return p_x0_KxV
  order = np.argsort(-p_x0_KxV, axis=-1, kind="stable")
  sorted_p = np.take_along_axis(p_x0_KxV, order, -1)
  keep = np.cumsum(sorted_p, -1) <= p
  keep[..., 0] = True
  out = np.zeros_like(p_x0_KxV)
  np.put_along_axis(out, order, sorted_p * keep, -1)
  return out / out.sum(-1, keepdims=True)


def _first_step(spec, seed=0):
  """The canvas before and after step 0 for ROWS identical rows (the stub denoiser)."""
  params = stubs.stub_params(VOCAB, LENGTH)
  canvas = np.repeat(np.asarray(prompted_canvas(batch=1)), ROWS, 0)
  out = sampling.sample(stubs.stub_denoiser, params, jax.random.key(seed), canvas,
                        dataclasses.replace(spec, record_trajectory=True))
  return params, canvas[0], np.asarray(out.trajectory_KxBxL[0]), out


def _assert_frequencies(after_BxL, expected_LxW, positions):
  """The frequency of each outcome (values 0..V-1, then the mask) at each position within 4
  binomial standard errors of its probability."""
  for l in positions:
    for w, prob in enumerate(expected_LxW[l]):
      freq = float((after_BxL[:, l] == w).mean())
      assert abs(freq - prob) <= binomial_tol(prob, ROWS) + 1e-9, (l, w, freq, prob)


def test_mdlm_plan_is_the_reference_grid():
  spec = sampling.MDLMSpec(steps=5)
  plan = sampling.families()["mdlm"].plan(spec, None)
  timesteps = np.linspace(1, 1e-5, 6)  # _sample: linspace(1, eps, num_steps + 1)
  np.testing.assert_allclose(plan.t, np.append(timesteps[:-1], 1e-5), rtol=1e-6)
  # _ddpm_caching_update: a masked position stays masked with probability s / t.
  np.testing.assert_allclose(plan.reveal_p[:-1], 1 - timesteps[1:] / timesteps[:-1], rtol=1e-6)
  assert plan.reveal_p[-1] == 1.0 and plan.final.tolist() == [False] * 5 + [True]
  no_removal = sampling.families()["mdlm"].plan(
      sampling.MDLMSpec(steps=5, noise_removal=False), None)
  assert len(no_removal.t) == 5 and no_removal.reveal_p[-1] == 1.0


@pytest.mark.slow
def test_mdlm_step_law_is_the_reference_q_xs():
  # steps=2, eps=0.5: step 0 runs t = 1 -> s = 0.75.
  params, before_L, after_BxL, _ = _first_step(sampling.MDLMSpec(steps=2, eps=0.5))
  t, dt = 1.0, 0.25
  p_x0 = _p_x0(params, before_L)
  # _ddpm_caching_update: q_xs = p_x0 (t - s), q_xs[mask] = s (SUBS: p_x0[mask] = 0),
  # normalised by its sum t.
  q_xs = np.concatenate([p_x0 * dt, np.full((LENGTH, 1), t - dt)], -1)
  q_xs /= q_xs.sum(-1, keepdims=True)
  _assert_frequencies(after_BxL, q_xs, range(PROMPT, LENGTH))
  np.testing.assert_array_equal(after_BxL[:, :PROMPT], np.broadcast_to(before_L[:PROMPT],
                                                                        (ROWS, PROMPT)))


@pytest.mark.slow
def test_mdlm_cache_saves_the_calls_of_unchanged_canvases_and_noise_removal_is_argmax():
  params = stubs.stub_params(VOCAB, LENGTH)
  canvas = prompted_canvas(batch=1)
  spec = sampling.MDLMSpec(steps=40, eps=0.3, record_trajectory=True, skip_idle_steps=False)
  cached = sampling.sample(stubs.stub_denoiser, params, jax.random.key(3), canvas, spec)
  plain = sampling.sample(stubs.stub_denoiser, params, jax.random.key(3), canvas,
                          dataclasses.replace(spec, cache=False))
  np.testing.assert_array_equal(cached.tokens_BxL, plain.tokens_BxL)
  traj = np.concatenate([np.asarray(canvas)[None], np.asarray(cached.trajectory_KxBxL)])
  changed = (traj[1:] != traj[:-1]).any(axis=(1, 2))  # step i changed the canvas
  # MDLM's rule: step i calls iff it is the first or step i - 1 changed the canvas.
  assert int(cached.nfe) == 1 + int(changed[:-1].sum())
  assert int(cached.nfe) + int(cached.saved_calls) == 41 and int(plain.nfe) == 41
  # The noise-removal step (index 40, t = eps) writes the argmax of what is still masked.
  last = np.asarray(cached.write_step_BxL)[0] == 40
  best = stubs.stub_logits_np(params, traj[40])[0].argmax(-1)
  np.testing.assert_array_equal(np.asarray(cached.tokens_BxL)[0][last], best[last])
  assert last.any()  # eps = 0.3 leaves masks for the last step (seeded)


def test_bd3lm_nucleus_is_the_reference_filter():
  rng = np.random.default_rng(0)
  probs = rng.dirichlet(np.full(30, 0.3), size=(5, 4))
  for p in (0.5, 0.9, 1.0):
    ours = jax.nn.softmax(bd3lm.nucleus_logits(np.log(probs), p), -1)
    np.testing.assert_allclose(ours, _reference_nucleus(probs, p), atol=1e-6)


@pytest.mark.slow
def test_bd3lm_first_hitting_law():
  spec = sampling.BD3LMSpec(nucleus_p=0.6)
  params, before_L, after_BxL, out = _first_step(spec)
  written_BxL = after_BxL != before_L
  assert (written_BxL.sum(-1) == 1).all()  # one hitting event: exactly one position
  num_masked = LENGTH - PROMPT
  # _ddpm_caching_update(first_hitting): ind uniform among the masked positions, its value
  # from the nucleus-filtered p_x0; the rest copied.
  nucleus = _reference_nucleus(_p_x0(params, before_L), 0.6)
  expected = np.concatenate([nucleus / num_masked, np.full((LENGTH, 1), 1 - 1 / num_masked)], -1)
  after_or_mask = np.where(written_BxL, after_BxL, VOCAB)
  _assert_frequencies(after_or_mask, expected, range(PROMPT, LENGTH))
  # steps=None: one step per position (12); the 4 after the 8 masked are idle, skipped.
  assert (int(out.nfe), int(out.saved_calls)) == (num_masked, 4) and not (np.asarray(out.tokens_BxL) == VOCAB).any()


def test_bd3lm_ddpm_grid_is_the_reference_and_caches():
  t_K, reveal_p = bd3lm.ddpm_grid(5)
  timesteps, dt = np.linspace(1, 0, 5), 1 / 5  # _semi_ar_sampler without first hitting
  mask_prob = (timesteps[:-1] - dt) / timesteps[:-1]  # move_chance_s / move_chance_t
  np.testing.assert_allclose(reveal_p[:-1], 1 - mask_prob)
  assert reveal_p[-1] == 1.0 and t_K[-1] == 0.0
  params = stubs.stub_params(VOCAB, LENGTH)
  out = sampling.sample(stubs.stub_denoiser, params, jax.random.key(0), prompted_canvas(1),
                        sampling.BD3LMSpec(steps=24, first_hitting=False, nucleus_p=0.9))
  assert not (np.asarray(out.tokens_BxL) == VOCAB).any()
  # 8 positions over 24 steps: steps that reveal nothing reuse the last call.
  assert int(out.nfe) + int(out.saved_calls) == 24 and int(out.nfe) <= 9


@pytest.mark.slow
def test_inverse_cdf_draw_law_and_zero_weights():
  # 150 values: three blocks of the two-level search (64, 64, 22), the middle one all zero;
  # zeros also inside the first block (id 1) and at the end (148, 149).
  p = np.zeros(150)
  p[[0, 2, 130, 140, 147]] = [0.15, 0.1, 0.3, 0.25, 0.15]
  p[10:20] = 0.005
  log_w = np.where(p > 0, np.log(np.maximum(p, 1e-300)), -np.inf).astype(np.float32)
  rows, slots = 2000, 8
  keys = jax.random.split(jax.random.key(0), rows)
  drawn = np.asarray(transforms.inverse_cdf(keys, StepStream.VALUES,
                                            np.broadcast_to(log_w, (rows, slots, 150))))
  assert (p[drawn] > 0).all()  # a zero weight is never drawn
  # Value v is drawn iff cum_(v-1) <= u total < cum_v, u ~ U[0, 1): probability p_v. The
  # slots hold independent uniforms, so each count is Binomial(rows * slots, p_v); 4 standard
  # errors fail with probability ~6e-5 per value (15 values checked).
  n = rows * slots
  for v in np.flatnonzero(p):
    assert abs((drawn == v).mean() - p[v]) <= binomial_tol(p[v], n), (v, (drawn == v).mean())
  # Rounding: a target at (or past) the rounded total gives the last positive weight, and a
  # zero weight is skipped even where a rounded cumulative sum rises over it.
  cum = np.array([[0.5, 0.5000001, 1.0, 1.0]], np.float32)
  w = np.array([[0.5, 0.0, 0.5, 0.0]], np.float32)
  for target, want in ((1.0, 2), (1.5, 2), (0.5, 2), (0.49, 0), (0.0, 0)):
    got = int(transforms._first_above(cum, w, np.array([target], np.float32))[0])
    assert got == want, (target, got)


def test_bad_specs():
  with pytest.raises(ValueError, match="nucleus_p"):
    sampling.BD3LMSpec(nucleus_p=0.0)
  with pytest.raises(ValueError, match="eps"):
    sampling.MDLMSpec(steps=4, eps=0.0)
  with pytest.raises(ValueError, match="steps=3 is invalid: first_hitting"):
    sampling.sample(stubs.stub_denoiser, stubs.stub_params(VOCAB, LENGTH), jax.random.key(0),
                    prompted_canvas(2), sampling.BD3LMSpec(steps=3))


# --- the entry points on a tiny DiT -----------------------------------------------------------

V, MODEL_LENGTH, BLOCK = 11, 8, 4


@dataclasses.dataclass(frozen=True)
class TinyModel:
  params: dict
  config: dit.DiTConfig
  denoiser: object = None


def _tiny(family, block_size=None):
  config = dit.DiTConfig(family=family, vocab_size=V, hidden_dim=16, cond_dim=8, n_blocks=1,
                         n_heads=2, model_length=MODEL_LENGTH, block_size=block_size)
  return TinyModel(params=dit.init_params(config, jax.random.key(1)), config=config)


@pytest.mark.slow
def test_mdlm_sample_on_a_dit():
  model = _tiny("mdlm")
  out = mdlm_sample(model, num_samples=1, steps=16, key=jax.random.key(0))
  tokens = np.asarray(out.tokens_BxL)
  assert tokens.shape == (1, MODEL_LENGTH) and tokens.max() < V
  # A call only after a step that changed the canvas: at most 1 + 8 of the 17 steps.
  assert int(out.nfe) + int(out.saved_calls) == 17 and int(out.nfe) <= MODEL_LENGTH + 1
  with pytest.raises(ValueError, match="bd3lm_sample"):
    mdlm_sample(model, num_samples=1, steps=4, length=9, key=jax.random.key(0))


@pytest.mark.slow
def test_bd3lm_sample_past_the_model_length():
  model = _tiny("bd3lm", BLOCK)
  out = bd3lm_sample(model, num_samples=2, length=16, bos_id=3,
                                  key=jax.random.key(0))
  tokens = np.asarray(out.tokens_BxT)
  assert tokens.shape == (2, 16) and tokens.max() < V and (tokens[:, 0] == 3).all()
  # First hitting: one call per masked position (3 in BOS's block, 4 in each of the three
  # others), plus the cache's pass over each block after the first.
  assert int(out.nfe) == 3 + 3 * (BLOCK + 1)
  with pytest.raises(ValueError, match="multiple of the model's block_size=4"):
    bd3lm_sample(model, num_samples=1, length=10, key=jax.random.key(0))
  with pytest.raises(ValueError, match="mdlm_sample"):
    bd3lm_sample(_tiny("mdlm"), num_samples=1, length=8, key=jax.random.key(0))


# --- likelihood -------------------------------------------------------------------------------


@pytest.mark.slow
def test_windows_nelbo_on_the_two_color_oracle_is_exact():
  """With the exact denoiser a masked position's -log p is ln 2 when its partner is masked
  too and 0 when the partner is visible. Positions are masked independently with
  probability m(t), so one sequence's NELBO is E_t[w(t) m(t)^2] 2 ln 2:
    MDLM, m = (1 - eps) t, w = 1 / t, t ~ U[t_min, 1]: (1 - eps)^2 (1 + t_min) ln 2;
    BD3-LM in blocks of 1, m = t, w = 1 / t: block 0 is masked alone (-log p = ln 2,
    E[w m] = 1), block 1 sees clean block 0 (0): exactly ln 2 = -log p(x) for any range.
  The estimator is the mean of i.i.d. batch values, so it lies within 4 of its standard
  errors of these expectations (the CLT: a failure has probability < 1e-4)."""
  x_NxL = np.asarray(two_color.sample_data(jax.random.key(0), 64 * 40))
  eps, t_min = 1e-3, 1e-3
  mdlm_out = elbo.windows_nelbo(
      two_color.exact_denoiser, None, x_NxL, batch_size=64, key=jax.random.key(1),
      schedule=diffusion.LogLinearSchedule(eps=eps), t_min=t_min)
  exact = (1 - eps) ** 2 * (1 + t_min) * math.log(2) / 2  # per token
  assert abs(mdlm_out["nelbo_nats_per_token"] - exact) < 4 * mdlm_out["stderr"], mdlm_out
  assert mdlm_out["num_tokens"] == x_NxL.size and mdlm_out["num_batches"] == 40
  assert 0 < mdlm_out["stderr"] < 0.02
  block = diffusion.block_causal(two_color.exact_denoiser, 1)
  bd3_out = elbo.windows_nelbo(block, None, x_NxL, batch_size=64, key=jax.random.key(2),
                                     schedule=diffusion.LinearSchedule(), t_min=t_min,
                                     block_size=1)
  assert abs(bd3_out["nelbo_nats_per_token"] - math.log(2) / 2) < 4 * bd3_out["stderr"], bd3_out
  # A worse model is far above: the uniform denoiser's NELBO.
  worse = elbo.windows_nelbo(
      two_color.uniform_denoiser, None, x_NxL, batch_size=64, key=jax.random.key(1),
      schedule=diffusion.LogLinearSchedule(eps=eps), t_min=t_min)
  assert worse["nelbo_nats_per_token"] > exact + 10 * worse["stderr"]


@pytest.mark.slow
def test_perplexity_reads_token_files_and_uses_each_models_estimator(tmp_path):
  x = np.asarray(two_color.sample_data(jax.random.key(0), 64 * 8)).reshape(-1)
  npy, raw = tmp_path / "val.npy", tmp_path / "val.bin"
  np.save(npy, x.astype(np.int32))
  x.astype(np.uint16).tofile(raw)
  config = dict(vocab_size=2, hidden_dim=8, cond_dim=8, n_blocks=1, n_heads=2, model_length=2)
  mdlm_model = TinyModel(params=None, config=dit.DiTConfig(family="mdlm", **config),
                         denoiser=two_color.exact_denoiser)
  a = perplexity_lib.perplexity(mdlm_model, str(npy), batch_size=64, key=jax.random.key(1))
  b = perplexity_lib.perplexity(mdlm_model, str(raw), batch_size=64, key=jax.random.key(1))
  assert a == {**b} and a["windows"] == 64 * 8 and a["model"] == "mdlm"
  exact = (1 - 1e-3) ** 2 * (1 + 1e-3) * math.log(2) / 2
  assert abs(a["nelbo_nats_per_token"] - exact) < 4 * a["stderr"]
  assert a["perplexity_bound"] == pytest.approx(math.exp(a["nelbo_nats_per_token"]))
  # BD3-LM keeps the first token visible and uncounted (ignore_bos): on two-color the second
  # is then a copy, so the NELBO is exactly 0 over the L - 1 counted tokens.
  bd3_model = TinyModel(params=None,
                        config=dit.DiTConfig(family="bd3lm", block_size=1, **config),
                        denoiser=diffusion.block_causal(two_color.exact_denoiser, 1))
  c = perplexity_lib.perplexity(bd3_model, x, batch_size=64, num_batches=4,
                                key=jax.random.key(1))
  assert c["nelbo_nats_per_token"] == 0.0 and c["num_tokens"] == 64 * 4
  assert (c["t_min"], c["t_max"]) == (1e-3, 1.0)
  with pytest.raises(ValueError, match="clipped=True needs"):
    perplexity_lib.perplexity(bd3_model, x, batch_size=64, key=jax.random.key(1), clipped=True)
  with pytest.raises(ValueError, match="holds id 5"):
    perplexity_lib.perplexity(mdlm_model, np.array([0, 5, 1, 1]), batch_size=1,
                              key=jax.random.key(1))
