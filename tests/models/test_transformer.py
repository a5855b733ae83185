"""Tests of the Transformer denoiser: contract, bidirectionality, causal flag."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax import models, sampling

V, L = 7, 10


def _cfg(**kw):
  return models.TransformerConfig(**{**dict(vocab_size=V, max_len=L, d_model=32, num_layers=2,
                                            num_heads=4, d_ff=64), **kw})


@pytest.mark.parametrize("kw", [
    {}, {"positions": "sinusoidal", "norm": "layer", "mlp": "gelu"},
    {"time_conditioning": True}, {"causal": True}])
@pytest.mark.slow
def test_contract_shapes_and_jit(kw):
  _, params, apply_fn = models.init(_cfg(**kw))
  tokens = jax.random.randint(jax.random.key(0), (3, L), 0, V + 1)
  logits = apply_fn(params, tokens, jnp.full((3,), 0.5))
  assert logits.shape == (3, L, V) and logits.dtype == jnp.float32
  np.testing.assert_allclose(jax.jit(apply_fn)(params, tokens, jnp.full((3,), 0.5)), logits,
                             rtol=1e-5, atol=1e-5)
  assert models.count_params(params) > 0


def _input_influence(apply_fn, params, position):
  """How much logits[position] move when each input position changes token."""
  tokens = jnp.full((1, L), V, jnp.int32)
  influence = []
  base = apply_fn(params, tokens, jnp.zeros(1))[0, position]
  for j in range(L):
    changed = apply_fn(params, tokens.at[0, j].set(0), jnp.zeros(1))[0, position]
    influence.append(float(jnp.abs(changed - base).max()))
  return np.array(influence)


@pytest.mark.slow
def test_bidirectional_and_causal_dependence():
  _, params, apply_fn = models.init(_cfg())
  influence = _input_influence(apply_fn, params, position=3)
  assert np.all(influence > 0), influence  # every position sees every other
  _, params, apply_fn = models.init(_cfg(causal=True))
  influence = _input_influence(apply_fn, params, position=3)
  assert np.all(influence[:4] > 0) and np.all(influence[4:] == 0), influence


@pytest.mark.slow
def test_time_conditioning_reads_t_only_when_on():
  tokens = jnp.full((2, L), V, jnp.int32)
  _, params, apply_fn = models.init(_cfg())
  np.testing.assert_array_equal(apply_fn(params, tokens, jnp.zeros(2)),
                                apply_fn(params, tokens, jnp.ones(2)))
  graphdef, params, apply_fn = models.init(_cfg(time_conditioning=True))
  # adaLN is zero-initialised; perturb it so t matters.
  params = jax.tree.map(lambda x: x + 0.01, params)
  assert not np.allclose(apply_fn(params, tokens, jnp.zeros(2)),
                         apply_fn(params, tokens, jnp.ones(2)))


def test_bad_config_raises():
  with pytest.raises(ValueError, match="d_model=30 must be divisible by num_heads=4"):
    models.TransformerConfig(vocab_size=V, max_len=L, d_model=30, num_heads=4)
  with pytest.raises(ValueError, match="positions='alibi'"):
    _cfg(positions="alibi")


@pytest.mark.slow
def test_model_plugs_into_every_sampler():
  # A short canvas and one layer: a sampler program's compile time grows with both.
  length = 4
  _, params, apply_fn = models.init(_cfg(max_len=length, num_layers=1))
  tokens = jnp.full((4, length), V, jnp.int32)
  for spec in (sampling.AncestralSpec(steps=4), sampling.ConfidenceSpec(steps=5),
               sampling.RemaskSpec(steps=4), sampling.RandomOrderSpec()):
    out = sampling.sample(apply_fn, params, jax.random.key(0), tokens, spec)
    assert not np.any(np.asarray(out.tokens_BxL) == V)


def test_rotary_tables_are_program_constants_the_same_on_every_path():
  # The default positions read a host table (float64 angles, rounded once); given positions
  # read the same table, so cached windows and padded rows rotate exactly as the full pass.
  x_BxLxHxK = jax.random.normal(jax.random.key(0), (2, L, 4, 8))
  rope = jax.jit(models.transformer.rope, static_argnums=2)
  default, given = rope(x_BxLxHxK, None, 0), rope(x_BxLxHxK, jnp.arange(L), 2 * L)
  np.testing.assert_array_equal(default, given)
  angle_LxK = np.arange(L)[:, None] * np.exp(-np.log(10_000.0) * np.arange(4) / 4)[None]
  x = np.asarray(x_BxLxHxK, np.float64)
  cos, sin = np.cos(angle_LxK)[None, :, None], np.sin(angle_LxK)[None, :, None]
  want = np.concatenate([x[..., :4] * cos - x[..., 4:] * sin, x[..., :4] * sin + x[..., 4:] * cos],
                        -1)
  np.testing.assert_allclose(default, want, rtol=0, atol=1e-5)  # float32 rounding of |x| < 6
  lowered = jax.jit(lambda x: models.transformer.rope(x)).lower(x_BxLxHxK).as_text()
  assert "sine" not in lowered and "cosine" not in lowered
