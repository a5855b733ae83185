"""Tests of the published checkpoints' Transformer (LLaDA, Dream; SDAR's qk-norm and
block-causal attention, Fast-dLLM v2's blocks with the shift, LLaDA2's partial rotary and
mixture of experts) against a numpy reference."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax.models import moe, published

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
  elif c.block_size is not None and valid_BxL is not None:  # counted, padding at 0
    pos = np.maximum(np.cumsum(valid, -1) - 1, 0)
  else:
    pos = np.broadcast_to(np.arange(length), (batch, length))
  rd = c.rotary_dim or k
  inv_freq = 1.0 / c.rope_theta ** (np.arange(0, rd, 2) / rd)

  def norm(x, w):
    return w * x / np.sqrt(np.mean(x ** 2, -1, keepdims=True) + c.norm_eps)

  def rope(x, b):  # x: L x K; the first rd dims turn, the rest pass
    freqs = pos[b][:, None] * inv_freq[None]
    emb = np.concatenate([freqs, freqs], -1)
    x, rest = x[:, :rd], x[:, rd:]
    rotated = np.concatenate([-x[:, rd // 2:], x[:, :rd // 2]], -1)
    return np.concatenate([x * np.cos(emb) + rotated * np.sin(emb), rest], -1)

  def head_norm(x, w):  # per head of K
    shape = x.shape
    return norm(x.reshape(*shape[:-1], -1, k), w).reshape(shape)

  def kqv(lay, h):
    x = norm(h, lay["attn_norm"])
    q, kk, v = x @ lay["q"], x @ lay["k"], x @ lay["v"]
    if c.qkv_bias:
      q, kk, v = q + lay["q_bias"], kk + lay["k_bias"], v + lay["v_bias"]
    if c.qk_norm:
      q, kk = head_norm(q, lay["q_norm"]), head_norm(kk, lay["k_norm"])
    return q, kk, v

  def swiglu(x, gate, up, down):
    g = x @ gate
    return (g / (1 + np.exp(-g)) * (x @ up)) @ down

  def experts(lay, x):  # LLaDA2MoeSparseMoeBlock, token by token
    m, out = c.moe, np.zeros_like(x)
    for b in range(batch):
      for i in range(length):
        logits = x[b, i] @ lay["router"]
        scores = (1 / (1 + np.exp(-logits)) if m.score_function == "sigmoid"
                  else np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum())
        biased = scores + lay["expert_bias"]
        groups_scores = np.sort(biased.reshape(m.n_group, -1), -1)[:, -2:].sum(-1)
        kept = np.argsort(-groups_scores, kind="stable")[:m.topk_group]
        allowed = np.repeat(np.isin(np.arange(m.n_group), kept), m.num_experts // m.n_group)
        chosen = np.argsort(-np.where(allowed, biased, -np.inf), kind="stable")[
            :m.experts_per_token]
        weights = scores[chosen]
        if m.norm_topk_prob and m.experts_per_token > 1:
          weights = weights / (weights.sum() + 1e-20)
        weights = weights * m.routed_scaling_factor
        for e, w in zip(chosen, weights):
          out[b, i] += w * swiglu(x[b, i], lay["experts_gate"][e], lay["experts_up"][e],
                                  lay["experts_down"][e])
        if m.num_shared_experts:
          out[b, i] += swiglu(x[b, i], lay["shared_gate"], lay["shared_up"],
                              lay["shared_down"])
    return out

  def attention(q, kk, v):  # B x L x (heads * K), keys and values B x L x (groups * K)
    out = np.zeros((batch, length, heads * k))
    for b in range(batch):
      for head in range(heads):
        g = head // (heads // groups)  # repeat_kv
        scores = rope(q[b, :, head * k:(head + 1) * k], b) @ rope(
            kk[b, :, g * k:(g + 1) * k], b).T / np.sqrt(k)
        scores[:, ~valid[b]] = -np.inf
        if c.block_size is not None:  # block-causal, blocks of the row's positions
          blocks = pos[b] // c.block_size
          scores[blocks[None, :] > blocks[:, None]] = -np.inf
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[b, :, head * k:(head + 1) * k] = probs @ v[b, :, g * k:(g + 1) * k]
    return out

  # The canvas, and with `stale` the old canvas in step (its own exact pass).
  hs = [p["embed"][np.asarray(tokens_BxL)]]
  if stale:
    hs.append(p["embed"][np.asarray(stale[0])])
  dense = c.num_layers if c.moe is None else c.moe.first_dense_layers
  for n in range(c.num_layers):
    routed = n >= dense
    lay = {name: w[n - dense if routed else n]
           for name, w in p["moe_layers" if routed else "layers"].items()}
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
      hs[i] = h + (experts(lay, x) if routed
                   else swiglu(x, lay["gate"], lay["up"], lay["down"]))
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
@pytest.mark.slow
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
@pytest.mark.slow
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
@pytest.mark.slow
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
@pytest.mark.slow
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
@pytest.mark.slow
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
@pytest.mark.slow
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


# --- the block-causal networks: SDAR, Fast-dLLM v2, LLaDA2 ---------------------------------

BLOCK = 4
BLOCK_NETWORKS = {
    "sdar": dict(qk_norm=True),
    "fast_dllm_v2": dict(qkv_bias=True, logit_shift=True),
    "llada2": dict(qk_norm=True, rotary_dim=4, num_layers=3, moe=moe.MoEConfig(
        num_experts=8, experts_per_token=2, expert_hidden=16, num_shared_experts=1,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, first_dense_layers=1)),
}


def _block_config(family, **kw):
  return _config(family, **{"block_size": BLOCK, **BLOCK_NETWORKS[family], **kw})


@pytest.mark.parametrize("family", list(BLOCK_NETWORKS))
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.slow
def test_block_networks_match_numpy_reference(family, padded):
  config, tokens = _block_config(family), _tokens()
  params, valid = _params(config), _left_padded() if padded else None
  logits = _forward(config, params, tokens, valid)
  expected = _reference(config, params, tokens, valid)
  if padded:  # padded queries are nobody's output: compare the real positions
    expected = np.where(valid[..., None], expected, 0)
    logits = np.where(valid[..., None], logits, 0)
  _close(logits, expected, 1e-4)


@pytest.mark.parametrize("family", list(BLOCK_NETWORKS))
@pytest.mark.slow
def test_block_attention_hides_later_blocks_and_padding(family):
  """Changing the tokens of a later block leaves every earlier block's logits as they were,
  and a left-padded row gives the logits of the same row alone (blocks and positions count
  from its first real token)."""
  config, tokens, valid = _block_config(family), _tokens(), _left_padded()
  params = _params(config)
  logits = np.asarray(_forward(config, params, tokens))
  changed = tokens.copy()
  changed[:, 2 * BLOCK:] = (changed[:, 2 * BLOCK:] + 5) % config.mask_id
  later = np.asarray(_forward(config, params, changed))
  # With the shift, position 2 * BLOCK predicts from 2 * BLOCK - 1: still an earlier block.
  seen = 2 * BLOCK + (1 if config.logit_shift else 0)
  np.testing.assert_array_equal(later[:, :seen], logits[:, :seen])
  finite = np.isfinite(logits[:, seen:])  # the mask id's -inf aside
  assert np.abs(later[:, seen:][finite] - logits[:, seen:][finite]).max() > 1e-3
  padded = np.asarray(_forward(config, params, tokens, valid))
  for row in (1, 2):
    pad = 2 * row
    alone = np.asarray(_forward(config, params, tokens[row:row + 1, pad:]))[0]
    first = pad + (1 if config.logit_shift else 0)  # the shifted first reads padding
    _close(padded[row, first:], alone[first - pad:], 1e-5)


@pytest.mark.parametrize("family", list(BLOCK_NETWORKS))
@pytest.mark.slow
def test_block_cache_is_exact(family):
  """A pass over one block against the cache of a stale canvas gives the exact logits of the
  new canvas on that block: no earlier position sees the block or what follows it, so the
  cached keys before it are the exact ones (the block cache of `sample_blocks`)."""
  config, tokens = _block_config(family), _tokens()
  params, valid = _params(config), _left_padded()
  prefilled, cache = _prefill(config, params, tokens, valid)
  _close(prefilled, _forward(config, params, tokens, valid), 1e-5)
  for start in (0, BLOCK, 2 * BLOCK):  # blocks of row 0 (rows 1, 2: counted from padding)
    changed = tokens.copy()
    changed[:, start:] = (tokens[:, start:] + 3) % config.mask_id
    window, new_cache = _decode(config, params, cache, changed[:, start:start + BLOCK],
                                jnp.int32(start), valid)
    exact = np.asarray(_forward(config, params, changed, valid))
    _close(np.asarray(window)[0], exact[0, start:start + BLOCK], 1e-5)
    np.testing.assert_array_equal(new_cache.tokens_BxL[:, start:start + BLOCK],
                                  changed[:, start:start + BLOCK])


@pytest.mark.slow
def test_moe_layers_layout_and_count():
  config = _block_config("llada2")
  params = jax.jit(published.init_params, static_argnums=0)(config, jax.random.key(0))
  assert params["layers"]["gate"].shape == (1, config.d_model, config.mlp_hidden)
  routed = params["moe_layers"]
  assert routed["experts_gate"].shape == (2, 8, config.d_model, 16)
  assert routed["shared_down"].shape == (2, 16, config.d_model)
  assert routed["q_norm"].shape == (2, config.head_dim)
  assert (routed["expert_bias"] == 0).all() and (routed["q_norm"] == 1).all()
  assert published.num_params(config) == sum(x.size for x in jax.tree.leaves(params))
  _, cache = _prefill(config, params, _tokens())
  assert cache.keys_NxBxGxLxK.shape[0] == 3  # every layer, dense then routed


@pytest.mark.parametrize("change, field", [
    (dict(rotary_dim=3), "rotary_dim"), (dict(rotary_dim=10), "rotary_dim"),
    (dict(block_size=0), "block_size"), (dict(qk_norm=1), "qk_norm"),
    (dict(moe=dict(num_experts=6, n_group=4)), "n_group"),
    (dict(moe=dict(topk_group=5)), "topk_group"),
    (dict(moe=dict(experts_per_token=5, topk_group=2)), "experts_per_token"),
    (dict(moe=dict(score_function="relu")), "score_function"),
    (dict(moe=dict(first_dense_layers=4)), "first_dense_layers")])
def test_block_network_refusals_name_the_field(change, field):
  change = dict(change)
  moe_fields = change.pop("moe", None)  # fields of the LLaDA2 test network's MoEConfig
  with pytest.raises(ValueError, match=field):
    if moe_fields is not None:
      change["moe"] = dataclasses.replace(BLOCK_NETWORKS["llada2"]["moe"], **moe_fields)
    _block_config("llada2", **change)


@pytest.mark.parametrize("family", list(BLOCK_NETWORKS))
@pytest.mark.slow
def test_sample_blocks_with_the_block_cache_equals_recomputing(family):
  """`sample_blocks` on the published block networks: the exact block cache gives the tokens
  of recomputing every call over the canvas (a left-padded row included; LLaDA2's cache has
  more layers than the batch has rows, which the per-row inputs must not mistake for rows)."""
  from mdjax import sampling
  config = _block_config(family)
  params, den = _params(config), published.denoiser(config)
  prompt = _tokens(batch=2, length=6) % config.mask_id
  valid = np.ones_like(prompt, bool)
  valid[1, :3] = False
  spec = sampling.ConfidenceSpec(steps=2, temperature=0.0)
  tokens = [np.asarray(sampling.sample_blocks(
      den, params, jax.random.key(0), prompt, spec, length=2 * BLOCK, blocks_of=BLOCK,
      window=3 * BLOCK, mask_id=config.mask_id, valid_BxP=valid, cached=cached).tokens_BxT)
      for cached in (True, False)]
  np.testing.assert_array_equal(tokens[0], tokens[1])
  assert (tokens[0][:, 6:] != config.mask_id).all()


@pytest.mark.parametrize("family", list(BLOCK_NETWORKS))
@pytest.mark.slow
def test_block_pair_is_each_block_decoded_after_the_clean_ones(family):
  """The training pass over [noisy; clean] gives each noisy block the logits of the canvas
  with the clean blocks before it, the block itself noisy and anything after: what the
  block-cached decoder computes (with the shift, a block's first position reads the clean
  previous block's last output)."""
  config = _block_config(family)
  params = _params(config)
  clean = _tokens()
  noisy = np.where(np.random.default_rng(1).random(clean.shape) < 0.5, config.mask_id, clean)
  pair = np.asarray(jax.jit(published.block_pair, static_argnums=0)(config, params, noisy,
                                                                    clean))
  assert pair.shape == (3, L, V)
  for b in range(L // BLOCK):
    block = slice(b * BLOCK, (b + 1) * BLOCK)
    canvas = np.where(np.arange(L) < b * BLOCK, clean, noisy)
    _close(pair[:, block], np.asarray(_forward(config, params, canvas))[:, block], 1e-5)
  den = published.denoiser(config)
  assert den.block_size == BLOCK and den.block_pair is not None
  assert published.denoiser(_config("llada")).block_pair is None
