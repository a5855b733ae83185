"""Classifier-free guidance (`sampling.classifier_free`): the rule, its edge cases, and
sampling with it (plain and KV-cached)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import sampling
from mdjax.sampling import driver, guidance
from tests import stubs
from tests.sampling.common import LENGTH, PROMPT, VOCAB, prompted_canvas

pytestmark = pytest.mark.xdist_group("guidance")

PARAMS = stubs.stub_params(VOCAB, LENGTH)
T_B = jnp.full((2,), 0.5)


def _guided(scale, denoiser=stubs.stub_denoiser):
  return sampling.classifier_free(denoiser, scale, prompt_length=PROMPT, mask_id=VOCAB)


def test_the_rule_by_hand():
  tokens = np.asarray(prompted_canvas(batch=2)).copy()
  tokens[:, PROMPT + 1] = [2, 3]  # a generated position already written
  cond = stubs.stub_logits_np(PARAMS, tokens)
  unconditional = tokens.copy()
  unconditional[:, :PROMPT] = VOCAB  # the prompt masked
  un = stubs.stub_logits_np(PARAMS, unconditional)
  got = np.asarray(_guided(1.5)(PARAMS, jnp.asarray(tokens), T_B))
  np.testing.assert_allclose(got, un + 2.5 * (cond - un), rtol=1e-5, atol=1e-5)
  # Scale 0 is the plain denoiser, exactly.
  np.testing.assert_array_equal(_guided(0.0)(PARAMS, jnp.asarray(tokens), T_B),
                                stubs.stub_denoiser(PARAMS, jnp.asarray(tokens), T_B))


def test_minus_infinity_stays_minus_infinity():
  inf = np.inf
  cond = jnp.array([-inf, 1.0, -inf, 2.0])
  un = jnp.array([-inf, -inf, 0.0, 1.0])
  np.testing.assert_array_equal(guidance.guided_logits(cond, un, 2.0),
                                [-inf, 1.0, -inf, 1.0 + 3.0 * (2.0 - 1.0)])

  def ruled_out(params, tokens_BxL, t_B):  # id 1 ruled out in both passes
    return stubs.stub_denoiser(params, tokens_BxL, t_B).at[..., 1].set(-jnp.inf)

  logits = _guided(3.0, ruled_out)(PARAMS, prompted_canvas(batch=2), T_B)
  assert np.isneginf(np.asarray(logits)[..., 1]).all()
  assert not np.isnan(np.asarray(logits)).any()


def test_one_call_of_twice_the_rows_and_the_validity_mask_follows():
  seen = []

  def recording(params, tokens_BxL, t_B, valid_BxL=None):
    seen.append((tokens_BxL, valid_BxL))
    return stubs.stub_denoiser(params, tokens_BxL, t_B)

  tokens, valid = prompted_canvas(batch=2), jnp.ones((2, LENGTH), bool).at[0, 0].set(False)
  _guided(1.0, recording)(PARAMS, tokens, T_B, valid_BxL=valid)
  (doubled, valid_2BxL), = seen
  np.testing.assert_array_equal(doubled[:2], tokens)
  np.testing.assert_array_equal(doubled[2:, :PROMPT], VOCAB)
  np.testing.assert_array_equal(doubled[2:, PROMPT:], tokens[:, PROMPT:])
  np.testing.assert_array_equal(valid_2BxL, jnp.concatenate([valid, valid]))


def test_equal_arguments_give_equal_denoisers_and_bad_ones_are_refused():
  assert _guided(1.5) == _guided(1.5) and hash(_guided(1.5)) == hash(_guided(1.5))
  assert _guided(1.5) != _guided(2.0)
  assert not _guided(1.0).offers_cache
  assert _guided(1.0, sampling.recompute_cache(stubs.stub_denoiser)).offers_cache
  with pytest.raises(ValueError, match="scale=-1.0 is invalid"):
    _guided(-1.0)
  with pytest.raises(ValueError, match="prompt_length=-1 is invalid"):
    sampling.classifier_free(stubs.stub_denoiser, 1.0, prompt_length=-1, mask_id=VOCAB)


@pytest.mark.slow
def test_confidence_decoding_with_guidance_cached_or_not():
  spec = sampling.ConfidenceSpec(steps=4, block_length=4)
  canvas, key = prompted_canvas(batch=3), jax.random.key(2)
  plain = sampling.sample(_guided(2.0), PARAMS, key, canvas, spec)
  final = np.asarray(plain.tokens_BxL)
  assert ((final >= 0) & (final < VOCAB)).all()
  np.testing.assert_array_equal(final[:, :PROMPT], np.asarray(canvas)[:, :PROMPT])
  compiled = driver._program._cache_size()
  again = sampling.sample(_guided(2.0), stubs.stub_params(VOCAB, LENGTH, seed=1), key, canvas,
                          spec)
  assert driver._program._cache_size() == compiled  # an equal wrapper: no new program
  assert not np.array_equal(again.tokens_BxL, final)
  # The dual cache over 2B rows: with a recomputing cache the tokens are the uncached ones.
  cached = sampling.sample(_guided(2.0, sampling.recompute_cache(stubs.stub_denoiser)), PARAMS,
                           key, canvas, sampling.ConfidenceSpec(steps=4, block_length=4,
                                                                kv_cache="dual"))
  np.testing.assert_array_equal(cached.tokens_BxL, final)
