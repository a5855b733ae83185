"""Tests of the published checkpoints' Transformer (LLaDA, Dream) against a numpy reference."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax.models import published

V, L = 40, 12

_forward = jax.jit(published.forward, static_argnums=0)
_prefill = jax.jit(published.prefill, static_argnums=0)
_decode = jax.jit(published.decode, static_argnums=0)


def _config(family, **kw):
  dream = family == "dream"
  return published.PublishedConfig(**{**dict(
      family=family, vocab_size=V, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
      head_dim=8, mlp_hidden=48, rope_theta=500.0 if dream else 10_000.0,
      norm_eps=1e-5 if dream else 1e-6, qkv_bias=dream, logit_shift=dream,
      mask_id=V - 3, max_len=64), **kw})


def _params(config, seed=0):
  """Params of init_params' layout (float32, numpy: no device work) with every leaf random
  (norm weights near 1, biases nonzero), so each parameter reaches the comparison."""
  rng = np.random.default_rng(seed)

  def leaf(path, shape):
    if "norm" in jax.tree_util.keystr(path):
      return (1 + 0.3 * rng.standard_normal(shape)).astype(np.float32)
    scale = 0.3 if "bias" in jax.tree_util.keystr(path) else 0.15
    return (scale * rng.standard_normal(shape)).astype(np.float32)

  return jax.tree_util.tree_map_with_path(leaf, published.param_shapes(config),
                                          is_leaf=lambda x: isinstance(x, tuple))


def _tokens(batch=3, length=L, seed=0):
  return np.random.default_rng(seed).integers(0, V, (batch, length)).astype(np.int32)


def _left_padded(batch=3, length=L):
  """Row b has 2 * b padding positions at its start."""
  return np.arange(length)[None] >= 2 * np.arange(batch)[:, None]


def _reference(config, params, tokens_BxL, valid_BxL=None, stale=None):
  """The model in float64 numpy, written from the HF modeling code (per head, per row).
  `stale=(old_tokens_BxL, start, width)`: keys and values outside [start, start + width)
  come from a pass over the old canvas instead (what a window pass over a cache sees)."""
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  c = config
  batch, length = tokens_BxL.shape
  heads, groups, k = c.num_heads, c.num_kv_heads, c.head_dim
  valid = np.ones((batch, length), bool) if valid_BxL is None else np.asarray(valid_BxL)
  if c.family == "dream" and valid_BxL is not None:
    pos = np.where(valid, np.cumsum(valid, -1) - 1, 1)
  else:
    pos = np.broadcast_to(np.arange(length), (batch, length))
  inv_freq = 1.0 / c.rope_theta ** (np.arange(0, k, 2) / k)

  def norm(x, w):
    return w * x / np.sqrt(np.mean(x ** 2, -1, keepdims=True) + c.norm_eps)

  def rope(x, b):  # x: L x K
    freqs = pos[b][:, None] * inv_freq[None]
    emb = np.concatenate([freqs, freqs], -1)
    rotated = np.concatenate([-x[:, k // 2:], x[:, :k // 2]], -1)
    return x * np.cos(emb) + rotated * np.sin(emb)

  def kqv(lay, h):
    x = norm(h, lay["attn_norm"])
    q, kk, v = x @ lay["q"], x @ lay["k"], x @ lay["v"]
    if c.qkv_bias:
      q, kk, v = q + lay["q_bias"], kk + lay["k_bias"], v + lay["v_bias"]
    return q, kk, v

  def attention(q, kk, v):  # B x L x (heads * K), keys and values B x L x (groups * K)
    out = np.zeros((batch, length, heads * k))
    for b in range(batch):
      for head in range(heads):
        g = head // (heads // groups)  # repeat_kv
        scores = rope(q[b, :, head * k:(head + 1) * k], b) @ rope(
            kk[b, :, g * k:(g + 1) * k], b).T / np.sqrt(k)
        scores[:, ~valid[b]] = -np.inf
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[b, :, head * k:(head + 1) * k] = probs @ v[b, :, g * k:(g + 1) * k]
    return out

  # The canvas, and with `stale` the old canvas in step (its own exact pass).
  hs = [p["embed"][np.asarray(tokens_BxL)]]
  if stale:
    hs.append(p["embed"][np.asarray(stale[0])])
  for n in range(c.num_layers):
    lay = {name: w[n] for name, w in p["layers"].items()}
    projected = [kqv(lay, h) for h in hs]
    q, kk, v = projected[0]
    if stale:  # outside the window, the old canvas's keys and values
      _, old_k, old_v = projected[1]
      outside = np.ones((1, length, 1), bool)
      outside[:, stale[1]:stale[1] + stale[2]] = False
      kk, v = np.where(outside, old_k, kk), np.where(outside, old_v, v)
    outs = [attention(q, kk, v)] + [attention(*qkv) for qkv in projected[1:]]
    hs = [h + out @ lay["o"] for h, out in zip(hs, outs)]
    for i, h in enumerate(hs):
      x = norm(h, lay["mlp_norm"])
      gate = x @ lay["gate"]
      hs[i] = h + (gate / (1 + np.exp(-gate)) * (x @ lay["up"])) @ lay["down"]
  logits = norm(hs[0], p["final_norm"]) @ p["head"]
  logits[..., c.mask_id] = -np.inf
  if c.logit_shift:
    logits = np.concatenate([logits[:, :1], logits[:, :-1]], 1)
  return logits


def _close(actual, expected, tol):
  """Equal within tol, with -inf exactly where the other has it."""
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
  finite = np.isfinite(expected)
  np.testing.assert_allclose(actual[finite], expected[finite], rtol=tol, atol=tol)


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("padded", [False, True])
def test_forward_matches_numpy_reference(family, padded):
  config, tokens = _config(family), _tokens()
  params, valid = _params(config), _left_padded() if padded else None
  logits = _forward(config, params, tokens, valid)
  assert logits.shape == (3, L, V) and logits.dtype == jnp.float32
  expected = _reference(config, params, tokens, valid)
  _close(logits, expected, 1e-4)  # padded rows too: their queries see the real keys


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_mask_logit_alone_is_neg_inf_and_no_nan(family):
  config = _config(family)
  valid = _left_padded()
  valid[2] = False  # a row of padding only: its keys are all masked, still finite
  logits = np.asarray(_forward(config, _params(config), _tokens(), valid))
  assert not np.isnan(logits).any()
  assert np.isneginf(logits[..., config.mask_id]).all()
  assert np.isfinite(np.delete(logits, config.mask_id, axis=-1)).all()


def test_dream_shift_reads_the_previous_output():
  config, tokens = _config("dream"), _tokens()
  params = _params(config)
  shifted = np.asarray(_forward(config, params, tokens))
  plain = _reference(dataclasses.replace(config, logit_shift=False), params, tokens)
  _close(shifted[:, 1:], plain[:, :-1], 1e-4)
  _close(shifted[:, 0], plain[:, 0], 1e-4)


def test_dream_left_padding_is_invisible():
  """Dream counts positions from the first real token: a left-padded row gives the logits of
  the same row without padding (from the second real position on: the first one's
  prediction is the output at a padded position, by the shift)."""
  config, tokens, valid = _config("dream"), _tokens(), _left_padded()
  params = _params(config)
  logits = np.asarray(_forward(config, params, tokens, valid))
  for row in (1, 2):
    pad = 2 * row
    alone = _reference(config, params, tokens[row:row + 1, pad:])[0]
    _close(logits[row, pad + 1:], alone[1:], 1e-4)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_prefill_and_decode_on_an_unchanged_canvas(family):
  """A window pass over the canvas the cache holds gives the full pass's logits (rows 1
  and 2 are left-padded, row 0 is not) and writes back the same keys and values."""
  config, tokens = _config(family), _tokens()
  params, valid = _params(config), _left_padded()
  logits = _forward(config, params, tokens, valid)
  prefilled, cache = _prefill(config, params, tokens, valid)
  _close(prefilled, logits, 1e-5)
  groups = config.num_kv_heads
  assert cache.keys_NxBxGxLxK.shape == (config.num_layers, 3, groups, L, config.head_dim)
  assert cache.values_NxBxGxLxK.shape == cache.keys_NxBxGxLxK.shape
  width = 4
  for start in (0, 3, L - width):  # one program: start is traced
    window, new_cache = _decode(config, params, cache, tokens[:, start:start + width],
                                jnp.int32(start), valid)
    _close(window, logits[:, start:start + width], 1e-5)
    for old, new in zip(jax.tree.leaves(cache), jax.tree.leaves(new_cache)):
      np.testing.assert_allclose(new, old, atol=1e-5)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_decode_of_the_whole_canvas_after_a_change_is_exact(family):
  config, tokens = _config(family), _tokens()
  params, valid = _params(config), _left_padded()
  _, cache = _prefill(config, params, tokens, valid)
  changed = tokens.copy()
  changed[:, ::3] = config.mask_id
  window, new_cache = _decode(config, params, cache, changed, jnp.int32(0), valid)
  expected, expected_cache = _prefill(config, params, changed, valid)
  _close(window, expected, 1e-5)
  for new, want in zip(jax.tree.leaves(new_cache), jax.tree.leaves(expected_cache)):
    np.testing.assert_allclose(new, want, atol=1e-5)


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("start", [0, 5])
def test_decode_of_a_window_sees_stale_keys_outside_it(family, start):
  """Outside the window the keys and values are the old canvas's: the reference with those
  stale keys. Dream's first window position reads the output at start - 1, computed against
  the same keys."""
  config, tokens, width = _config(family), _tokens(), 4
  params, valid = _params(config), _left_padded()
  _, cache = _prefill(config, params, tokens, valid)
  changed = tokens.copy()
  changed[:, start:start + width] = (tokens[:, start:start + width] + 7) % config.mask_id
  window, new_cache = _decode(config, params, cache, changed[:, start:start + width],
                              jnp.int32(start), valid)
  expected = _reference(config, params, changed, valid, stale=(tokens, start, width))
  _close(window, expected[:, start:start + width], 1e-4)
  np.testing.assert_array_equal(new_cache.tokens_BxL, changed)
  # ...and the decode differs from the exact pass (the stale keys matter here).
  exact = np.asarray(_forward(config, params, changed, valid))[:, start:start + width]
  finite = np.isfinite(exact)
  assert np.abs(np.asarray(window)[finite] - exact[finite]).max() > 1e-4


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_bfloat16_agrees_with_float32_on_the_top_token(family):
  config = _config(family)
  params = _params(config)
  tokens, valid = _tokens(), _left_padded()
  config16 = dataclasses.replace(config, dtype="bfloat16")
  params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)  # numpy casts
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params16))
  logits32 = np.asarray(_forward(config, params, tokens, valid))
  logits16 = np.asarray(_forward(config16, params16, tokens, valid))
  assert logits16.dtype == np.float32
  # bfloat16 keeps an 8-bit mantissa (relative rounding ~0.4% per op, accumulated over the
  # layers); the top token changes only where the top two float32 logits lie within that
  # error of each other, a few percent of positions on random weights: 90% leaves margin
  # while a real bug (a wrong cast, a lost bias) drops agreement to chance (1/V).
  agree = (logits16.argmax(-1) == logits32.argmax(-1))[valid].mean()
  assert agree >= 0.9, agree


def test_denoiser_is_time_free_hashable_and_cached():
  config = _config("dream")
  params, tokens, valid = _params(config), _tokens(), _left_padded()
  den = published.denoiser(config)
  assert den == published.denoiser(dataclasses.replace(config))
  assert hash(den) == hash(published.denoiser(config))
  assert den != published.denoiser(dataclasses.replace(config, mask_id=1))
  assert den != published.denoiser(_config("llada"))
  assert den.offers_cache and den.block_size is None and den.block_pair is None

  @functools.partial(jax.jit, static_argnums=0)
  def passes(den, t_B):  # the denoiser is a static argument, as in the samplers
    logits = den(params, tokens, t_B, valid_BxL=valid)
    prefilled, cache = den.prefill(params, tokens, t_B, valid)
    window, _ = den.decode(params, cache, tokens[:, 2:6], 2, t_B, valid)
    return logits, prefilled, window

  logits = _forward(config, params, tokens, valid)
  for t in (0.0, 1.0):  # time-free
    applied, prefilled, window = passes(den, jnp.full((3,), t))
    _close(applied, logits, 1e-5)
    _close(prefilled, logits, 1e-5)
    _close(window, logits[:, 2:6], 1e-5)


@pytest.mark.parametrize("family, dtype", [("llada", "float32"), ("dream", "bfloat16")])
def test_init_params_layout_and_count(family, dtype):
  config = _config(family, dtype=dtype)
  params = jax.jit(published.init_params, static_argnums=0)(config, jax.random.key(0))
  c, hk, gk = config, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
  assert params["embed"].shape == (V, c.d_model) and params["head"].shape == (c.d_model, V)
  assert params["layers"]["q"].shape == (c.num_layers, c.d_model, hk)
  assert params["layers"]["k"].shape == (c.num_layers, c.d_model, gk)
  assert params["layers"]["o"].shape == (c.num_layers, hk, c.d_model)
  assert params["layers"]["down"].shape == (c.num_layers, c.mlp_hidden, c.d_model)
  assert ("q_bias" in params["layers"]) == c.qkv_bias
  assert all(x.dtype == jnp.dtype(dtype) for x in jax.tree.leaves(params))
  assert (params["final_norm"] == 1).all() and (params["layers"]["mlp_norm"] == 1).all()
  assert published.num_params(config) == sum(x.size for x in jax.tree.leaves(params))


@pytest.mark.parametrize("change, field", [
    (dict(family="gpt"), "family"), (dict(dtype="float16"), "dtype"),
    (dict(num_kv_heads=3), "num_heads"), (dict(mask_id=V), "mask_id"),
    (dict(mask_id=-1), "mask_id"), (dict(d_model=0), "d_model"),
    (dict(head_dim=7), "head_dim"), (dict(eos_id=V), "eos_id"),
    (dict(rope_theta=0.0), "rope_theta")])
def test_config_refusals_name_the_field(change, field):
  with pytest.raises(ValueError, match=field):
    _config(**{"family": "llada", **change})
