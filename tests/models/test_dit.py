"""Tests of the MDLM / BD3-LM DiT against a float64 numpy reference written from the
kuleshov-group code (models/dit.py, models/hf/modeling_bd3lm.py, diffusion.py)."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mdjax.models import dit
from mdjax.models.transformer import block_pair_mask

V, L, B = 30, 12, 3
BLOCK = 4
SIGMA_B = np.array([0.3, 1.7, 4.0], np.float32)
T_B = np.array([0.2, 0.5, 0.9], np.float32)

BASE = dit.DiTConfig(family="mdlm", vocab_size=V, hidden_dim=32, cond_dim=16, n_blocks=2,
                     n_heads=4, model_length=L)
CONFIGS = {
    "mdlm": BASE,
    "mdlm_time": dataclasses.replace(BASE, time_conditioning=True),
    "bd3lm": dataclasses.replace(BASE, family="bd3lm", block_size=BLOCK),
    "bd3lm_time": dataclasses.replace(BASE, family="bd3lm", block_size=BLOCK,
                                      time_conditioning=True),
}

# One program per (function, config), shared by the tests.
_forward = jax.jit(dit.forward, static_argnums=0)



@functools.partial(jax.jit, static_argnums=0)
def _fold_forward(c, params, tokens_BxL, valid_BxL):
  """(fold's params, forward_folded's logits) in one program."""
  folded = dit.fold(c, params)
  return folded, dit.forward_folded(c, folded, tokens_BxL, valid_BxL)


def _params_of(config, seed=0):
  """Params of init_params' layout (float32, numpy: no device work) with every leaf random:
  norm weights near 1, biases and adaLN weights nonzero, so each term reaches the
  comparisons (the reference zero-inits adaLN)."""
  rng = np.random.default_rng(seed)

  def leaf(path, shape):
    name = jax.tree_util.keystr(path)
    if "norm" in name:
      return (1 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
    scale = 0.2 if ("bias" in name or "'b" in name) else 1 / np.sqrt(shape[-2])
    return (scale * rng.standard_normal(shape) if "embed" not in name
            else rng.standard_normal(shape)).astype(np.float32)

  return jax.tree_util.tree_map_with_path(leaf, dit.param_shapes(config),
                                          is_leaf=lambda x: isinstance(x, tuple))


PARAMS = _params_of(BASE)  # every config here has the same shapes


def _params(config):
  return PARAMS


@functools.lru_cache(maxsize=None)
def _folded():
  """`fold`'s params and the folded logits of (_tokens(), _valid()); fold ignores
  block_size, so these serve every config without time conditioning."""
  return _fold_forward(BASE, PARAMS, _tokens(), _valid())


def _tokens(seed=0, mask_fraction=0.4):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (B, L))
  return np.where(rng.random((B, L)) < mask_fraction, V, tokens).astype(np.int32)


def _valid():
  """Row 0 unpadded, rows 1 and 2 left-padded by one block (blocks stay aligned)."""
  return np.arange(L)[None] >= np.array([0, BLOCK, BLOCK])[:, None]


def _reference(c, params, tokens_BxL, sigma_B, valid_BxL=None, positions_L=None, mask=None):
  """The network in float64 numpy, written from the reference (per row, per head):
  raw logits B x Q x (V + 1). `positions_L` and `mask` (Q x Q) override the positions and
  the attention pattern (the block pair)."""
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  batch, length = tokens_BxL.shape
  heads, k = c.n_heads, c.head_dim
  valid = np.ones((batch, length), bool) if valid_BxL is None else np.asarray(valid_BxL)
  sigma = np.asarray(sigma_B, np.float64) * (1.0 if c.time_conditioning else 0.0)
  half = 128  # TimestepEmbedder: cat(cos, sin) of sigma * exp(-log(10000) * i / half)
  args = sigma[:, None] * np.exp(-math.log(10000) * np.arange(half) / half)[None]
  silu = lambda x: x / (1 + np.exp(-x))
  t_emb = silu(np.concatenate([np.cos(args), np.sin(args)], -1) @ p["sigma_map"]["w1"]
               + p["sigma_map"]["b1"]) @ p["sigma_map"]["w2"] + p["sigma_map"]["b2"]
  cond = silu(t_emb)
  gelu = lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

  def layer_norm(x, w):  # F.layer_norm without affine, then * weight
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + c.norm_eps) * w

  def modulate(x, shift, scale):
    return x * (1 + scale) + shift

  inv_freq = 1.0 / c.rope_base ** (np.arange(0, k, 2) / k)
  out = []
  for b in range(batch):
    if positions_L is not None:
      pos = np.asarray(positions_L)
    else:
      pos = np.maximum(np.cumsum(valid[b]) - 1, 0) if valid_BxL is not None else np.arange(length)
    freqs = pos[:, None] * inv_freq[None]
    emb = np.concatenate([freqs, freqs], -1)
    rotate_half = lambda x: np.concatenate([-x[:, k // 2:], x[:, :k // 2]], -1)
    rotary = lambda x: x * np.cos(emb) + rotate_half(x) * np.sin(emb)
    if mask is not None:
      visible = np.asarray(mask, bool)
    elif c.block_size is not None:
      visible = pos[None] // c.block_size <= pos[:, None] // c.block_size
    else:
      visible = np.ones((length, length), bool)
    visible = visible & valid[b][None]
    x = p["embed"][tokens_BxL[b]]
    for n in range(c.n_blocks):
      blk = {name: value[n] for name, value in p["blocks"].items()}
      shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = np.split(
          cond[b] @ blk["ada"] + blk["ada_bias"], 6)
      x_skip = x
      h = modulate(layer_norm(x, blk["norm1"]), shift_msa, scale_msa)
      qkv = (h @ blk["qkv"]).reshape(len(x), 3, heads, k)  # 'b s (three h d)'
      attn = np.zeros((len(x), heads, k))
      for head in range(heads):
        q, kk, v = rotary(qkv[:, 0, head]), rotary(qkv[:, 1, head]), qkv[:, 2, head]
        scores = np.where(visible, q @ kk.T / np.sqrt(k), -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        attn[:, head] = probs / probs.sum(-1, keepdims=True) @ v
      x = x_skip + gate_msa * (attn.reshape(len(x), -1) @ blk["attn_out"])
      h = modulate(layer_norm(x, blk["norm2"]), shift_mlp, scale_mlp)
      x = x + gate_mlp * (gelu(h @ blk["mlp_in"] + blk["mlp_in_bias"]) @ blk["mlp_out"]
                          + blk["mlp_out_bias"])
    fin = p["final"]
    shift, scale = np.split(cond[b] @ fin["ada"] + fin["ada_bias"], 2)
    out.append(modulate(layer_norm(x, fin["norm"]), shift, scale) @ fin["linear"]
               + fin["linear_bias"])
  return np.stack(out)


def _block_diff_mask(n, block_size):
  """bd3lms' `block_diff_mask` over [x_t ; x_0] (2n x 2n), in numpy."""
  q_idx, kv_idx = np.arange(2 * n)[:, None], np.arange(2 * n)[None]
  x0_q, x0_kv = q_idx >= n, kv_idx >= n
  block_q = np.where(x0_q, (q_idx - n) // block_size, q_idx // block_size)
  block_kv = np.where(x0_kv, (kv_idx - n) // block_size, kv_idx // block_size)
  block_diagonal = (block_q == block_kv) & (x0_q == x0_kv)
  offset_block_causal = (block_q > block_kv) & x0_kv & ~x0_q
  block_causal = (block_q >= block_kv) & x0_kv & x0_q
  return block_diagonal | offset_block_causal | block_causal


def _subs(c, raw_BxLxV1, tokens_BxL):
  """mdlm's `_subs_parameterization` in numpy, -1e6 written as -inf, the mask column dropped."""
  logits = np.array(raw_BxLxV1, np.float64)
  logits[..., c.mask_id] = -np.inf
  top = logits.max(-1, keepdims=True)
  logits = logits - (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))
  unmasked = tokens_BxL != c.mask_id
  logits[unmasked] = -np.inf
  rows, cols = np.nonzero(unmasked)
  logits[rows, cols, tokens_BxL[unmasked]] = 0
  return logits[..., :c.vocab_size]


@pytest.mark.parametrize("name", ["mdlm", "bd3lm_time"])
def test_forward_matches_reference(name):
  """Bidirectional without time conditioning, block-causal with it (the other two pairs:
  test_denoiser_matches_reference and the cache test); rows 1 and 2 left-padded."""
  c = CONFIGS[name]
  params, tokens, valid = _params(c), _tokens(), _valid()
  got = np.asarray(_forward(c, params, tokens, SIGMA_B, valid_BxL=valid))
  assert got.shape == (B, L, V + 1) and got.dtype == np.float32
  want = _reference(c, params, tokens, SIGMA_B, valid)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  # Row 0 has no padding: the reference without a mask (positions 0..L-1) is the same.
  np.testing.assert_allclose(got[:1], _reference(c, params, tokens[:1], SIGMA_B[:1]),
                             rtol=1e-4, atol=1e-4)
  # A left-padded row's real positions are those of the row alone.
  np.testing.assert_allclose(got[1, BLOCK:],
                             _reference(c, params, tokens[1:2, BLOCK:], SIGMA_B[1:2])[0],
                             rtol=1e-4, atol=1e-4)
  # sigma reaches the network only with time conditioning.
  other = _reference(c, params, tokens[:1], SIGMA_B[2:])
  assert (np.abs(other - want[:1]).max() > 1e-3) == c.time_conditioning


def test_folded_equals_unfolded():
  c = CONFIGS["mdlm"]
  params, tokens, valid = _params(c), _tokens(), _valid()
  assert np.abs(params["blocks"]["ada"]).min() > 0 and np.abs(params["final"]["ada_bias"]).min() > 0
  folded = _folded()[1]
  np.testing.assert_allclose(folded, _forward(c, params, tokens, SIGMA_B, valid_BxL=valid),
                             rtol=1e-5, atol=1e-5)
  layout = jax.eval_shape(functools.partial(dit.fold, c), params)
  assert set(layout) == {"embed", "blocks", "final"}
  assert set(layout["blocks"]) == {"norm1", "norm1_bias", "qkv", "attn_out", "norm2",
                                   "norm2_bias", "mlp_in", "mlp_in_bias", "mlp_out",
                                   "mlp_out_bias"}
  assert set(layout["final"]) == {"norm", "norm_bias", "linear", "linear_bias"}
  with pytest.raises(ValueError, match="time_conditioning"):
    dit.fold(CONFIGS["mdlm_time"], params)
  with pytest.raises(ValueError, match="folded=True"):
    dit.denoiser(CONFIGS["mdlm_time"], folded=True)


def _check_subs(c, logits, tokens, t_B, valid=None):
  """The denoiser's logits are mdlm's SUBS of the reference network at sigma(t)."""
  assert logits.shape == tokens.shape + (V,) and not np.isnan(logits).any()
  masked = tokens == V
  assert masked.any() and (~masked).any()
  # Visible positions: the one-hot of the token (0 there, -inf elsewhere).
  one_hot = np.where(np.arange(V) == tokens[..., None], 0.0, -np.inf)
  np.testing.assert_array_equal(logits[~masked], one_hot[~masked])
  # Masked positions: finite log-probabilities over the V ids, those of the reference at
  # sigma(t) = -log1p(-(1 - eps) t).
  assert np.isfinite(logits[masked]).all()
  sigma_B = -np.log1p(-(1 - c.noise_eps) * np.asarray(t_B, np.float64))
  want = _subs(c, _reference(c, PARAMS, tokens, sigma_B, valid), tokens)
  np.testing.assert_allclose(logits[masked], want[masked], rtol=1e-4, atol=1e-4)


def test_denoiser_matches_reference():
  """Time-conditioned and bidirectional: the unfolded network on sigma(t), under SUBS."""
  c = CONFIGS["mdlm_time"]
  den = dit.denoiser(c)
  assert den.block_size is None and den.block_pair is None
  assert den.offers_cache  # the approximate (dual) cache of a bidirectional model
  tokens = _tokens(seed=1)
  _check_subs(c, np.asarray(jax.jit(den)(PARAMS, tokens, T_B)), tokens, T_B)


@pytest.mark.slow
def test_block_causal_denoiser_and_exact_cache():
  """Block-causal without time conditioning: the default denoiser (folding in the program)
  against the reference under SUBS; prefill and decode over windows of two blocks (a
  finished block and the next, as kv_cache='exact' appends) on pre-folded params
  (folded=True): each window's logits and the cache of the finished blocks equal the
  uncached block-causal pass over the canvas as it stands; block_pair."""
  c = CONFIGS["bd3lm"]
  den, pre = dit.denoiser(c), dit.denoiser(c, folded=True)
  assert den.block_size == BLOCK and den.offers_cache and den.block_pair is not None
  assert den == dit.denoiser(c)  # equal values share compiled programs
  folded, valid = _folded()[0], _valid()
  apply, prefill, decode = jax.jit(den.apply), jax.jit(pre.prefill), jax.jit(pre.decode)
  rng = np.random.default_rng(2)
  tokens = _tokens(seed=5)
  _check_subs(c, np.asarray(apply(PARAMS, tokens, T_B, valid)), tokens, T_B, valid)

  canvas = _tokens(seed=3, mask_fraction=0.0)
  canvas[:, BLOCK:] = V
  _, cache = prefill(folded, canvas, T_B, valid)
  for start in (0, BLOCK):
    window = rng.integers(0, V + 1, (B, 2 * BLOCK)).astype(np.int32)
    canvas[:, start:start + 2 * BLOCK] = window
    got, cache = decode(folded, cache, window, start, T_B, valid)
    full = np.asarray(apply(PARAMS, canvas, T_B, valid))
    np.testing.assert_allclose(got, full[:, start:start + 2 * BLOCK], rtol=1e-5, atol=1e-5)
  _, fresh = prefill(folded, canvas, T_B, valid)
  # (Padding's own keys may differ: nothing attends to them.)
  for got, want in ((cache.keys_BxNxHxLxK, fresh.keys_BxNxHxLxK),
                    (cache.values_BxNxHxLxK, fresh.values_BxNxHxLxK)):
    np.testing.assert_allclose(np.asarray(got).transpose(0, 3, 1, 2, 4)[valid],
                               np.asarray(want).transpose(0, 3, 1, 2, 4)[valid],
                               rtol=1e-5, atol=1e-5)
  # Later blocks are invisible: changing them leaves the earlier blocks' logits alone.
  changed = canvas.copy()
  changed[:, 2 * BLOCK:] = 0
  np.testing.assert_array_equal(np.asarray(apply(PARAMS, changed, T_B, valid))[:, :2 * BLOCK],
                                full[:, :2 * BLOCK])

  # block_pair: noisy block b's logits are the plain pass over [clean < b, noisy b, ...].
  clean = _tokens(seed=4, mask_fraction=0.0)
  noisy = np.where(rng.random((B, L)) < 0.5, V, clean).astype(np.int32)
  pair = np.asarray(jax.jit(den.block_pair)(PARAMS, noisy, clean, T_B))
  assert pair.shape == (B, L, V)
  ones = np.ones((B, L), bool)
  for b in range(L // BLOCK):
    blocks = slice(b * BLOCK, (b + 1) * BLOCK)
    mixed = clean.copy()
    mixed[:, blocks] = noisy[:, blocks]
    plain = np.asarray(apply(PARAMS, mixed, T_B, ones))
    np.testing.assert_allclose(pair[:, blocks], plain[:, blocks], rtol=1e-5, atol=1e-5)
  # The pass itself agrees with the reference under BD3-LM's `block_diff_mask` (raw logits,
  # noisy half; both halves at positions 0..L-1).
  mask = _block_diff_mask(L, BLOCK)
  np.testing.assert_array_equal(mask, block_pair_mask(L, BLOCK))
  raw = _reference(c, PARAMS, np.concatenate([noisy, clean], 1), SIGMA_B,
                   positions_L=np.concatenate([np.arange(L)] * 2), mask=mask)[:, :L]
  np.testing.assert_allclose(pair, _subs(c, raw, noisy), rtol=1e-4, atol=1e-4)


def test_time_conditioned_block_model_offers_no_cache():
  # Its finished blocks' keys would depend on the current t.
  timed = dit.denoiser(CONFIGS["bd3lm_time"])
  assert not timed.offers_cache and timed.block_size == BLOCK and timed.block_pair is not None


def test_canvas_longer_than_model_length_is_refused():
  with pytest.raises(ValueError, match="16 positions is longer than model_length=12.*block by"):
    _forward(BASE, PARAMS, np.zeros((1, L + BLOCK), np.int32), np.zeros(1, np.float32))


def test_params_layout():
  c = dataclasses.replace(CONFIGS["bd3lm"], dtype="bfloat16")
  params = jax.eval_shape(functools.partial(dit.init_params, c), jax.random.key(0))
  shapes = jax.tree.map(lambda x: tuple(x.shape), params)
  assert shapes == dit.param_shapes(c) == jax.tree.map(lambda x: x.shape, PARAMS)
  assert shapes["blocks"]["qkv"] == (2, 32, 96) and shapes["final"]["linear"] == (32, V + 1)
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("bfloat16")}
  assert dit.num_params(c) == sum(x.size for x in jax.tree.leaves(PARAMS))


@pytest.mark.parametrize("kw, message", [
    ({"family": "sedd"}, "family='sedd'"),
    ({"dtype": "float16"}, "dtype='float16'"),
    ({"hidden_dim": 30}, "hidden_dim=30 is not divisible by n_heads=4"),
    ({"hidden_dim": 12, "n_heads": 4}, "head_dim=3"),
    ({"block_size": 5}, "block_size=5 must divide model_length=12"),
    ({"block_size": 0}, "block_size=0"),
    ({"n_blocks": 0}, "n_blocks=0"),
    ({"vocab_size": -1}, "vocab_size=-1"),
    ({"cond_dim": 2.5}, "cond_dim=2.5"),
    ({"noise_eps": 1.0}, "noise_eps=1.0"),
    ({"norm_eps": 0.0}, "norm_eps=0.0"),
])
def test_config_errors(kw, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    dataclasses.replace(BASE, **kw)
