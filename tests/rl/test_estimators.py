"""The estimators after d1 (`mdjax.rl`): coupled-GRPO's complementary masks (DiffuCoder).

A stub denoiser whose logits are a known function of the canvas lets every pass be recomputed
in numpy: its logit at a position depends on whether that position is masked, on how many
positions of the row are masked, and on the time the pass reads, so a pass that masked the
wrong positions, or a weight on the wrong pass, changes the value.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import rl
from mdjax.rl import logps as logps_lib

V, MASK = 3, 3  # three real ids; the mask id is V (mdjax's models: logits over V ids)


def _stub(params, tokens_BxL, t_B):
  """logits[b, i] = masked_i or visible_i (by whether position i is masked) + count_b * w +
  t_b * u: each pass of a row is told apart."""
  is_mask_BxL = tokens_BxL == MASK
  base = jnp.where(is_mask_BxL[..., None], params["masked"][None], params["visible"][None])
  count_B = is_mask_BxL.sum(-1).astype(jnp.float32)
  return base + count_B[:, None, None] * params["w"] + t_B[:, None, None] * params["u"]


def _params(length, seed=0):
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray(rng.normal(size=shape), jnp.float32)
          for k, shape in (("masked", (length, V)), ("visible", (length, V)), ("w", (V,)),
                           ("u", (V,)))}


def _numpy_stub_logp(params, noisy_BxL, targets_BxC, prompt_length):
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  is_mask = noisy_BxL == MASK
  t = is_mask[:, prompt_length:].mean(-1)
  logits = (np.where(is_mask[..., None], p["masked"][None], p["visible"][None])
            + is_mask.sum(-1)[:, None, None] * p["w"] + t[:, None, None] * p["u"])
  logits = logits[:, prompt_length:]
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return np.take_along_axis(logp, targets_BxC[..., None], -1)[..., 0]


def test_complementary_masks_cover_each_completion_token_exactly_once_per_pair():
  """The canvases the estimator feeds the denoiser: pass 1 masks the whole completion, passes
  2 and 3 mask each completion position exactly once between them, and none masks the
  prompt. The pair's masked fraction is t ~ U[0.2, 0.8] up to sampling error: over B x C =
  4096 positions a binomial fraction has s.e. sqrt(t (1 - t) / 4096) <= 0.0079; 5 s.e. =
  0.04."""
  batch, prompt_length, completion = 64, 2, 64
  seen = []

  def recording(params, tokens_BxL, t_B):
    seen.append(np.asarray(tokens_BxL))
    return _stub(params, tokens_BxL, t_B)

  ids = np.random.default_rng(0).integers(0, V, (batch, prompt_length + completion)).astype(
      np.int32)
  for seed in range(10):
    seen.clear()
    rl.coupled_logps_fn(recording, _params(prompt_length + completion), ids, prompt_length,
                        jax.random.key(seed), mask_id=MASK)
    (canvas,) = seen  # one denoiser call of 3 B rows
    hidden = (canvas == MASK).reshape(3, batch, -1)
    assert not hidden[:, :, :prompt_length].any()
    assert hidden[0, :, prompt_length:].all()
    pair = hidden[1:, :, prompt_length:].astype(int)
    np.testing.assert_array_equal(pair.sum(0), 1)
    _, t = logps_lib.complementary_masks(jax.random.key(seed), batch, completion)
    assert 0.2 <= float(t) <= 0.8
    assert abs(pair[0].mean() - float(t)) < 0.04, (pair[0].mean(), float(t))


def test_coupled_logps_against_a_numpy_transcription_of_diffucoder():
  """DiffuCoder's `selective_log_softmax`: (p0 + where(M, p1 / t, p2 / (1 - t))) / 2, with p0
  the fully masked pass, p1 the pass masking M, p2 the pass masking its complement; the
  prompt never masked. Recomputed from the same key's masks in numpy (float64)."""
  batch, prompt_length, completion = 4, 3, 6
  length = prompt_length + completion
  rng = np.random.default_rng(1)
  ids = rng.integers(0, V, size=(batch, length)).astype(np.int32)
  params = _params(length)
  key = jax.random.key(7)
  got = np.asarray(rl.coupled_logps_fn(_stub, params, ids, prompt_length, key, mask_id=MASK))
  first_BxC, t = logps_lib.complementary_masks(key, batch, completion)
  first, t = np.asarray(first_BxC), float(t)
  assert first.any() and (~first).any()  # both passes mask something here
  targets = ids[:, prompt_length:]
  passes = []
  for hidden in (np.ones_like(first), first, ~first):
    noisy = ids.copy()
    noisy[:, prompt_length:][hidden] = MASK
    passes.append(_numpy_stub_logp(params, noisy, targets, prompt_length))
  want = (passes[0] + np.where(first, passes[1] / t, passes[2] / (1 - t))) / 2
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # Not the one-step estimate: the pair's passes count.
  assert np.abs(got - passes[0]).max() > 0.1


def test_coupled_gradient_raises_the_tokens_of_a_positive_advantage():
  """One GRPO step on the coupled estimate with a positive advantage raises every masked
  pass's log-probability of the completion's tokens (the weights 1 / t, 1 / (1 - t) and 1/2
  are positive), a negative advantage lowers it."""
  batch, prompt_length, completion = 2, 2, 4
  length = prompt_length + completion
  ids = np.random.default_rng(2).integers(0, V, size=(batch, length)).astype(np.int32)
  params = _params(length, seed=3)
  key = jax.random.key(4)
  mask = jnp.ones((batch, completion))

  def loss(p, advantages):
    logps = rl.coupled_logps_fn(_stub, p, ids, prompt_length, key, mask_id=MASK)
    return rl.grpo_loss(logps, None, None, advantages, mask, epsilon=0.2, beta=0.0)[0]

  def value(p):
    return float(rl.coupled_logps_fn(_stub, p, ids, prompt_length, key, mask_id=MASK).sum())

  for sign in (1.0, -1.0):
    advantages = jnp.full((batch,), sign)
    grads = jax.grad(loss)(params, advantages)
    stepped = jax.tree.map(lambda p, g: p - 1e-2 * g, params, grads)
    assert np.sign(value(stepped) - value(params)) == sign


def test_coupled_bad_range_is_refused():
  ids = np.zeros((2, 5), np.int32)
  with pytest.raises(ValueError, match=r"\(t_min, t_max\)=\(0.0, 0.8\)"):
    rl.coupled_logps_fn(_stub, _params(5), ids, 2, jax.random.key(0), mask_id=MASK, t_min=0.0)
