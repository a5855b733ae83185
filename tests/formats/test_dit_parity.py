"""Parity of `mdjax.models.dit` with the published MDLM / BD3-LM code on tiny random checkpoints
in the published layouts.

The fixtures (tests/fixtures/dit/) come from tests/reference/dit.py: mdlm/ and mdlm_time/
in kuleshov-group/mdlm-owt's layout (time_conditioning false / true), bd3lm/ in
kuleshov-group/bd3lm-owt-block_size*'s (block_size 4), every adaLN weight and bias random and
nonzero; the raw float32 logits over V + 1 ids of bd3lms' Hugging Face `BD3LM` (MDLM: with
cross_attn False; BD3-LM: its block-causal sampling pass, and its training pass over
[x_t ; x_0]); the SUBS log-probabilities of the repos' `Diffusion.forward`; and the
distributions their samplers hand to `_sample_categorical` for fixed canvases (MDLM's
ddpm_cache q_xs; BD3-LM's first-hitting p_x0, plain and nucleus-filtered, and its q_xs).
The samplers are compared on their law, not on torch's random numbers. bd3lm_trained/ is a
BD3-LM of bd3lm/'s shapes trained by mdjax (block NELBO, 200 adam steps on Shakespeare's
characters) and written by `mdjax.io.save`; the reference read that folder and recorded
its outputs on masked held-out text. Nothing here needs torch.
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import diffusion, io
from mdjax.models import dit
from mdjax.models.transformer import block_pair_mask

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "fixtures", "dit")
MODELS = ("mdlm", "mdlm_time", "bd3lm")
V, MASK_ID = 40, 40
with open(os.path.join(FIXTURES, "samples.json")) as f:
  CASES = {c["name"]: c for c in json.load(f)}


@functools.cache
def model(name):
  return io.load(os.path.join(FIXTURES, name))


@functools.cache
def reference():
  with np.load(os.path.join(FIXTURES, "reference_logits.npz")) as z:
    return dict(z)


@functools.cache
def _program(config):
  """One compiled program per config (compiling dominates this file; bd3lm_trained shares
  bd3lm's): the raw forward on sigma, the default denoiser on t and, for BD3-LM, its
  training pass on a pair."""
  den = dit.denoiser(config)

  def run(params, tokens_BxL, sigma_B, t_B, pair_xt_BxL, pair_x0_BxL):
    out = {"forward": dit.forward(config, params, tokens_BxL, sigma_B),
           "subs": den(params, tokens_BxL, t_B)}
    if den.block_pair is not None:
      out["pair"] = den.block_pair(params, pair_xt_BxL, pair_x0_BxL, t_B)
    return out

  return jax.jit(run)


def outputs(name, tokens_BxL, t_B, sigma_B=None, pair="bd3lm_pair"):
  """mdjax's outputs on a 2 x 16 canvas (numpy): forward (sigma_B, zeros if None), subs
  (the denoiser at t_B) and, for BD3-LM, pair (`block_pair` on the fixture's `{pair}_xt`,
  `{pair}_x0`)."""
  z, m = reference(), model(name)
  t_B = np.broadcast_to(np.asarray(t_B, np.float32), (2,))
  sigma_B = np.zeros(2, np.float32) if sigma_B is None else sigma_B
  out = _program(m.config)(m.params, jnp.asarray(tokens_BxL, jnp.int32), jnp.asarray(sigma_B),
                           jnp.asarray(t_B), jnp.asarray(z[f"{pair}_xt"]),
                           jnp.asarray(z[f"{pair}_x0"]))
  return {k: np.asarray(v) for k, v in out.items()}


def subs_probs(name, tokens_BxL, t):
  """mdjax's denoiser at t: probabilities over the V real ids (float64)."""
  return np.exp(outputs(name, tokens_BxL, t)["subs"].astype(np.float64))


def assert_subs(got_BxLxV, ref_BxLxV1, tokens_BxL):
  """SUBS: at masked positions the log-softmax over the real ids (within 1e-4); at visible
  ones the one-hot of the token (the reference writes -1e6 for -inf)."""
  ref = ref_BxLxV1[..., :V]
  masked = tokens_BxL == MASK_ID
  np.testing.assert_allclose(got_BxLxV[masked], ref[masked], rtol=0, atol=1e-4)
  visible = ~masked
  np.testing.assert_array_equal(np.exp(got_BxLxV[visible]), np.exp(ref[visible]))
  assert (ref_BxLxV1[..., MASK_ID][masked] < -1e5).all()  # the mask id is never predicted


@pytest.mark.parametrize("name", MODELS)
def test_config(name):
  m = model(name)
  c = m.config
  assert isinstance(c, dit.DiTConfig)
  assert (c.family, c.vocab_size, c.mask_id, c.hidden_dim, c.cond_dim, c.n_blocks, c.n_heads,
          c.model_length, c.mlp_ratio) == ("bd3lm" if name == "bd3lm" else "mdlm", V, MASK_ID,
                                           32, 16, 2, 4, 16, 4)
  assert c.block_size == (4 if name == "bd3lm" else None)
  assert c.time_conditioning == (name == "mdlm_time")
  assert (c.noise_eps, c.rope_base, c.norm_eps) == (1e-3, 10000.0, 1e-5)
  shapes = jax.tree.map(lambda x: tuple(x.shape), m.params)
  assert shapes == dit.param_shapes(c)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.slow
def test_forward_matches_reference(name):
  """The raw logits over V + 1 ids within 1e-4. sigma is what the reference's sampler
  computes from t; the network zeroes it without time_conditioning (as the reference does)."""
  z = reference()
  got = outputs(name, z[f"{name}_tokens"], z[f"{name}_t"], z[f"{name}_sigma"])["forward"]
  ref = z[f"{name}_logits"]
  assert got.shape == ref.shape == (2, 16, V + 1) and got.dtype == np.float32
  np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)
  assert ref[..., :V].std(-1).mean() > 2.0  # the fixture's logits are spread


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.slow
def test_denoiser_matches_reference_subs(name):
  """The denoiser at t (sigma(t) by the log-linear schedule; without time_conditioning the
  folded network) is the reference `Diffusion.forward`'s SUBS output (BD3-LM: its sampling
  pass, block-causal)."""
  z, m = reference(), model(name)
  tokens = z[f"{name}_tokens"]
  got = outputs(name, tokens, z[f"{name}_t"])["subs"]
  assert got.shape == (2, 16, V)
  assert_subs(got, z[f"{name}_subs"], tokens)
  if m.config.time_conditioning:  # t reaches the network as the reference's sigma(t)
    np.testing.assert_allclose(np.asarray(dit.total_noise(m.config, z[f"{name}_t"])),
                               z[f"{name}_sigma"], rtol=1e-6)


@pytest.mark.slow
def test_bd3lm_block_pair_matches_training_pass():
  """BD3-LM's training pass over [x_t ; x_0] (its 2L x 2L mask) under SUBS."""
  z = reference()
  np.testing.assert_array_equal(block_pair_mask(16, 4), z["bd3lm_pair_mask"])
  got = outputs("bd3lm", z["bd3lm_tokens"], z["bd3lm_pair_t"])["pair"]
  assert_subs(got, z["bd3lm_pair_subs"], z["bd3lm_pair_xt"])


def test_trained_bd3lm_matches_reference():
  """A BD3-LM trained and saved by mdjax, read by the published code: `mdjax.io.load` of
  the folder gives the reference's raw logits of its sampling pass (block-causal) within
  1e-4, its SUBS output, and its training pass over [x_t ; x_0] under SUBS."""
  z, name = reference(), "bd3lm_trained"
  assert model(name).config == model("bd3lm").config  # one program serves both
  tokens = z[f"{name}_tokens"]
  got = outputs(name, tokens, z[f"{name}_t"], z[f"{name}_sigma"], pair=f"{name}_pair")
  np.testing.assert_allclose(got["forward"], z[f"{name}_logits"], rtol=0, atol=1e-4)
  assert_subs(got["subs"], z[f"{name}_subs"], tokens)
  assert_subs(got["pair"], z[f"{name}_pair_subs"], z[f"{name}_pair_xt"])


def reveal_probability(t, dt):
  """(alpha(s) - alpha(t)) / (1 - alpha(t)) at s = t - dt, the ancestral family's reveal
  probability; with MDLM's and BD3-LM's samplers' move chance t it is LinearSchedule's."""
  schedule = diffusion.LinearSchedule()
  return float((schedule.alpha(t - dt) - schedule.alpha(t)) / schedule.one_minus_alpha(t))


def step_law(probs_BxLxV, t, dt):
  """The ancestral step's law at a masked position: reveal v with reveal * p(v), stay
  masked with 1 - reveal (the mask id last)."""
  reveal = reveal_probability(t, dt)
  stay = np.full(probs_BxLxV.shape[:-1] + (1,), 1.0 - reveal)
  return np.concatenate([reveal * probs_BxLxV, stay], axis=-1)


@pytest.mark.parametrize("name", ["mdlm_ddpm_cache", "mdlm_time_ddpm_cache"])
def test_mdlm_ddpm_cache_step_law(name):
  """MDLM's `_ddpm_caching_update` draws each masked position from q_xs (normalised)."""
  case = CASES[name]
  x = np.asarray(case["x_BxL"])
  q_xs = np.asarray(case["q_xs_BxLxV"])
  ref = q_xs / q_xs.sum(-1, keepdims=True)
  got = step_law(subs_probs(case["model"], x, case["t"]), case["t"], case["dt"])
  masked = x == MASK_ID
  assert masked.sum() >= 8
  np.testing.assert_allclose(got[masked], ref[masked], rtol=0, atol=1e-5)


def bd3lm_nucleus(probs_BxKxV, p):
  """bd3lms' `_nucleus_sample`: keep the sorted prefix whose cumulative mass (the value's
  own included) is <= p, and always the first; renormalise. (It drops the value that
  crosses p, which top-p in mdjax.sampling.transforms keeps.)"""
  if p == 1.0:
    return probs_BxKxV
  order = np.argsort(-probs_BxKxV, axis=-1, kind="stable")
  sorted_p = np.take_along_axis(probs_BxKxV, order, -1)
  keep = np.cumsum(sorted_p, -1) <= p
  keep[..., 0] = True
  kept = np.zeros_like(probs_BxKxV)
  np.put_along_axis(kept, order, sorted_p * keep, -1)
  return kept / kept.sum(-1, keepdims=True)


@pytest.mark.parametrize("name", ["bd3lm_first_hitting", "bd3lm_first_hitting_nucleus"])
def test_bd3lm_first_hitting_probabilities(name):
  """First hitting reveals one masked position of the last block, drawn uniformly, with its
  value from p_x0: the denoiser's SUBS probabilities over the block-causal canvas, after
  the nucleus filter."""
  case = CASES[name]
  x = np.asarray(case["x_BxL"])
  k = case["block_size"]
  ref = np.asarray(case["p_x0_BxKxV"])
  got = bd3lm_nucleus(subs_probs("bd3lm", x, case["t"])[:, -k:], case["nucleus_p"])
  np.testing.assert_array_equal(ref[..., MASK_ID], 0.0)
  np.testing.assert_allclose(got, ref[..., :V], rtol=0, atol=1e-5)
  masked = x[:, -k:] == MASK_ID
  assert masked.sum() >= 4
  if case["nucleus_p"] < 1.0:  # the filter cut something at every masked position
    assert ((ref[..., :V] > 0).sum(-1)[masked] < V).all()


def test_bd3lm_ddpm_step_law():
  """Without first hitting BD3-LM's step is the ancestral one on the last block."""
  case = CASES["bd3lm_ddpm"]
  x = np.asarray(case["x_BxL"])
  k = case["block_size"]
  ref = np.asarray(case["q_xs_BxKxV"])
  got = step_law(subs_probs("bd3lm", x, case["t"])[:, -k:], case["t"], case["dt"])
  masked = x[:, -k:] == MASK_ID
  np.testing.assert_allclose(got[masked], ref[masked], rtol=0, atol=1e-5)
