"""Block diffusion sampling: the exact KV cache of a block-causal model, token for token."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import diffusion, models, sampling
from mdjax.denoiser import Denoiser
from mdjax.sampling import kv_cache
from mdjax.tasks import two_color

V, L, PROMPT, BLOCK = 9, 20, 4, 4  # 16 generated positions: 4 model blocks of 4


def _cfg(**kw):
  return models.TransformerConfig(**{**dict(vocab_size=V, max_len=L, d_model=32, num_layers=2,
                                            num_heads=4, d_ff=64, block_size=BLOCK), **kw})


@pytest.fixture(scope="module")
def block_model():
  _, params, apply_fn = models.init(_cfg(), seed=1)
  return apply_fn, params


def _canvas(batch=4, prompt=PROMPT, suffix=0):
  """`prompt` given tokens, masked positions, then `suffix` fixed tokens."""
  tokens = np.random.default_rng(0).integers(0, V, (batch, L)).astype(np.int32)
  tokens[:, prompt:L - suffix] = V
  return tokens


@pytest.mark.xdist_group("block_model")
@pytest.mark.parametrize("spec", [
    sampling.ConfidenceSpec(steps=8, block_length=4, temperature=0.7),
    sampling.AncestralSpec(steps=8, block_length=8, temperature=0.8),  # 2 model blocks each
    sampling.EntropyBoundedSpec(steps=8, block_length=4, gamma=0.5)],
    ids=lambda s: type(s).__name__)
@pytest.mark.slow
def test_exact_cache_is_the_uncached_sampler(block_model, spec):
  """On a block-causal model the cached keys of finished blocks are final: the exact cache
  (and the dual one, whose refreshes are then exact too) gives the uncached tokens."""
  apply_fn, params = block_model
  key, tokens = jax.random.key(3), _canvas()
  plain = sampling.sample(apply_fn, params, key, tokens, spec)
  modes = ("exact", "dual") if isinstance(spec, sampling.ConfidenceSpec) else ("exact",)
  for mode in modes:
    cached = sampling.sample(apply_fn, params, key, tokens, dataclasses.replace(spec, kv_cache=mode))
    np.testing.assert_array_equal(cached.tokens_BxL, plain.tokens_BxL)
    np.testing.assert_array_equal(cached.write_step_BxL, plain.write_step_BxL)
    assert int(cached.nfe) == int(plain.nfe) and int(cached.unfilled_B.sum()) == 0


def _pass_tagging_denoiser(width):
  """A cached block-causal stub whose full passes propose token 0, block passes (W
  positions) token 1 and append passes (2W positions) token 2."""

  def logits_for(tokens, favoured):
    return jnp.zeros(tokens.shape + (V,)).at[..., favoured].set(5.0)

  def apply_fn(params, tokens_BxL, t_B):
    return logits_for(tokens_BxL, 0)

  return Denoiser(
      apply_fn, prefill=lambda params, tokens, t_B: (logits_for(tokens, 0), jnp.zeros(())),
      decode=lambda params, cache, tokens_BxW, start, t_B: (
          logits_for(tokens_BxW, 1 if tokens_BxW.shape[1] == width else 2), cache),
      block_size=BLOCK)


def test_exact_plan_full_pass_once_then_append_and_block_passes():
  """One full pass (the prompt), an append pass at each later block's first step, block
  passes otherwise; an append skipped at an idle step becomes a full pass at the next call."""
  spec = sampling.ConfidenceSpec(steps=16, block_length=4, temperature=0.0, kv_cache="exact",
                                 skip_idle_steps=True)
  result = sampling.sample(_pass_tagging_denoiser(4), None, jax.random.key(0), _canvas(2), spec)
  written = np.asarray(result.tokens_BxL)[0, PROMPT:].reshape(4, 4)
  steps = np.asarray(result.write_step_BxL)[0, PROMPT:].reshape(4, 4) % 4
  # Linear count schedule: one position per step, the block's first step writes first.
  np.testing.assert_array_equal(steps, np.tile(np.arange(4), (4, 1)))
  np.testing.assert_array_equal(written, [[0, 1, 1, 1], [2, 1, 1, 1], [2, 1, 1, 1],
                                          [2, 1, 1, 1]])
  # A skipped append (an idle step) is owed: the next call makes a full pass, exact on a
  # block-causal model. (Confidence and entropy-bounded steps commit at a block's first
  # step, so this is checked on the call itself.)
  denoiser = sampling.base.Denoiser(_pass_tagging_denoiser(4), None)
  tokens = jnp.asarray(_canvas(1))
  state = kv_cache.init(denoiser, tokens)
  step = kv_cache.KVPlan(refresh=jnp.array(False), start=jnp.array(8), append=jnp.array(True))
  state = kv_cache.skipped(state.replace(stale=jnp.array(False)), step)
  assert bool(state.stale)
  for stale, append, favoured in ((True, True, 0), (False, True, 2), (False, False, 1)):
    logits, after = kv_cache.call(denoiser, state.replace(stale=jnp.array(stale)), tokens, 0.5,
                                  step.replace(append=jnp.array(append)), 4)
    assert int(jnp.argmax(logits[0, 8])) == favoured and not bool(after.stale)
    assert float(jnp.abs(logits[0, :8]).max()) == 0.0 or favoured == 0


def test_block_oracle_samples_two_color_exactly_with_the_cache():
  """Blocks of one token from the exact block-causal oracle are exact chain-rule sampling:
  no invalid pair, with or without the (recomputing) exact cache, the same tokens."""
  oracle = diffusion.block_causal(two_color.exact_denoiser, 1)
  canvas = jnp.full((400, 2), two_color.MASK_ID, jnp.int32)
  spec = sampling.ConfidenceSpec(steps=2, block_length=1)
  key = jax.random.key(1)
  plain = sampling.sample(oracle, None, key, canvas, spec)
  cached = sampling.sample(sampling.recompute_cache(oracle), None, key, canvas,
                           dataclasses.replace(spec, kv_cache="exact"))
  np.testing.assert_array_equal(cached.tokens_BxL, plain.tokens_BxL)
  assert float(two_color.invalid_fraction(plain.tokens_BxL)) == 0.0
  # Both colors appear: 400 fair draws all alike has probability 2^-399.
  assert 0 < int(plain.tokens_BxL[:, 0].sum()) < 400


def test_bad_input(block_model):
  apply_fn, params = block_model
  _, bidirectional_params, bidirectional = models.init(_cfg(block_size=None), seed=1)
  key = jax.random.key(0)
  exact = lambda **kw: sampling.ConfidenceSpec(**{**dict(steps=8, block_length=4,
                                                         kv_cache="exact"), **kw})
  cases = [
      (lambda: sampling.sample(bidirectional, bidirectional_params, key, _canvas(), exact()),
       "no block-causal attention"),
      (lambda: sampling.sample(apply_fn, params, key, _canvas(), exact(block_length=2, steps=8)),
       "block_length=2 is invalid: kv_cache='exact' needs a multiple of the model's block size 4"),
      (lambda: sampling.sample(apply_fn, params, key, _canvas(prompt=2), exact(steps=6,
                                                                               block_length=6)),
       "block_length=6 is invalid"),
      (lambda: sampling.sample(apply_fn, params, key, _canvas(prompt=8), exact(steps=6,
                                                                               block_length=8)),
       "must divide the generation length 12"),
      (lambda: sampling.sample(apply_fn, params, key, _canvas(prompt=2, suffix=2),
                               exact(steps=6, block_length=8)), "prompt holds 2 positions"),
      (lambda: exact(refresh_every=2), "refresh_every=2 is invalid: applies only to the dual"),
      (lambda: sampling.sample(diffusion.block_causal(two_color.exact_denoiser, 1), None, key,
                               jnp.full((2, 2), two_color.MASK_ID, jnp.int32),
                               exact(steps=2, block_length=1)), "offers no cached contract"),
  ]
  for make, needle in cases:
    with pytest.raises(ValueError, match=needle):
      make()
