"""The denoiser value (`mdjax.denoiser.Denoiser`) and its bound form inside the program."""

import jax.numpy as jnp
import numpy as np

from mdjax import diffusion, sampling
from mdjax.denoiser import Denoiser
from mdjax.sampling.base import BoundDenoiser


def _plain(params, tokens_BxL, t_B, valid_BxL=None):
  shift = 0 if valid_BxL is None else valid_BxL.sum(-1, keepdims=True)
  return jnp.zeros(tokens_BxL.shape + (3,)) + (tokens_BxL + shift)[..., None]


def test_a_function_is_wrapped_once_and_equal_wrappers_share_programs():
  denoiser = Denoiser.of(_plain)
  assert Denoiser.of(denoiser) is denoiser
  assert denoiser == Denoiser.of(_plain) and hash(denoiser) == hash(Denoiser.of(_plain))
  assert not denoiser.offers_cache and denoiser.block_size is None


def test_it_is_called_like_the_function():
  tokens = jnp.array([[0, 1]])
  denoiser = Denoiser.of(_plain)
  np.testing.assert_array_equal(denoiser(None, tokens, jnp.ones(1)),
                                _plain(None, tokens, jnp.ones(1)))
  valid = jnp.array([[False, True]])
  np.testing.assert_array_equal(denoiser(None, tokens, jnp.ones(1), valid_BxL=valid),
                                _plain(None, tokens, jnp.ones(1), valid))


def test_a_cached_denoiser_is_kept_as_it_is():
  denoiser = Denoiser(
      _plain, prefill=lambda params, tokens, t_B: (_plain(params, tokens, t_B), tokens),
      decode=lambda params, cache, tokens, start, t_B: (_plain(params, tokens, t_B), cache),
      block_size=2)
  assert denoiser.offers_cache and denoiser.block_size == 2 and denoiser.block_pair is None
  assert sampling.recompute_cache(denoiser) is denoiser  # already cached


def test_max_len_is_carried_but_no_part_of_its_identity():
  """A wrapper keeps the length; denoisers that differ only in it share programs."""
  bounded = Denoiser(_plain, max_len=8)
  assert Denoiser(bounded).max_len == 8 and Denoiser.of(_plain).max_len is None
  assert bounded == Denoiser.of(_plain) and hash(bounded) == hash(Denoiser.of(_plain))


def test_adapters_keep_every_capability():
  oracle = diffusion.block_causal(_plain, 1)
  cached = sampling.recompute_cache(oracle)
  assert cached.offers_cache and cached.block_size == 1 and cached.block_pair is oracle.block_pair
  assert sampling.recompute_cache(oracle) is cached


def test_bound_rows_follow_the_contexts():
  valid_BxL = jnp.array([[True, False], [True, True]])
  bound = BoundDenoiser(Denoiser.of(_plain), None, valid_BxL=valid_BxL)
  np.testing.assert_array_equal(bound.rows_for(4)["valid_BxL"], jnp.tile(valid_BxL, (2, 1)))
  np.testing.assert_array_equal(bound.rows_for(4, row_major=True)["valid_BxL"],
                                jnp.repeat(valid_BxL, 2, axis=0))
  assert BoundDenoiser(Denoiser.of(_plain), None).rows_for(4) == {}
  logits = bound(jnp.zeros((4, 2), jnp.int32), 0.5)
  np.testing.assert_array_equal(logits[:, 0, 0], [1, 2, 1, 2])
