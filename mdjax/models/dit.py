"""The MDLM / BD3-LM diffusion Transformer (DiT), in JAX.

The network of kuleshov-group/mdlm `models/dit.py` and kuleshov-group/bd3lms: token
embedding over V + 1 ids (the mask id is V, as in mdjax), a noise embedding of the total noise
sigma (256 frequency features, cos before sin, Linear -> SiLU -> Linear, then SiLU), blocks of
LayerNorm (weight only, float32) -> adaLN modulate -> packed-qkv attention with half-split
rotary (base 10000; v not rotated) -> gated residual, LayerNorm -> modulate -> MLP (GELU tanh)
-> gated residual, and a final adaLN LayerNorm + linear. Bidirectional attention (MDLM) or
block-causal with `block_size` (BD3-LM). Pure functions over a params pytree whose blocks are
stacked (one `lax.scan` over blocks):

  params = {
    "embed": [V + 1, D],
    "sigma_map": {"w1": [256, C], "b1": [C], "w2": [C, C], "b2": [C]},
    "blocks": {                     # every leaf has a leading [num_blocks] axis
      "norm1": [N, D], "qkv": [N, D, 3 * D], "attn_out": [N, D, D], "norm2": [N, D],
      "mlp_in": [N, D, R * D], "mlp_in_bias": [N, R * D],
      "mlp_out": [N, R * D, D], "mlp_out_bias": [N, D],
      "ada": [N, C, 6 * D], "ada_bias": [N, 6 * D],
    },
    "final": {"norm": [D], "ada": [C, 2 * D], "ada_bias": [2 * D],
              "linear": [D, V + 1], "linear_bias": [V + 1]},
  }

(D hidden_dim, C cond_dim, R mlp_ratio (4), N n_blocks; matrices are [in, out], the transpose
of torch's Linear weight; qkv's output columns are packed (three, heads, head_dim) as the
reference's rearrange 'b s (three h d)'.)

Entry points: `forward` (the network's raw logits over V + 1 ids, conditioned on sigma),
`fold` and `forward_folded` (the same network with every adaLN term folded into the norms
and output matrices: exact when time_conditioning is False, as in the released checkpoints),
`prefill` and `decode` (the cached contract's passes on the network), `denoiser(config)` (the
`Denoiser` the samplers and losses take: logits over the V real ids under MDLM's SUBS
parameterization), `init_params`, `param_shapes` and `num_params`.

Positions: 0..L-1 as in the reference; with `valid_BxL` (False on padding) they are counted
from each row's first real token (cumsum(valid) - 1, padding at 0), as mdjax's Transformer
does, and so are BD3-LM's blocks, so a left-padded row gives the logits of the row without
its padding. Padded keys are attended by nothing; padded queries still attend to the real
keys (finite, unused outputs). A canvas holds at most model_length positions (a ValueError at
trace time past it); longer sequences are generated block by block (`sampling.sample_blocks`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.denoiser import Denoiser
from mdjax.models import checks, layers
from mdjax.models.layers import block_pair_mask

Array = jax.Array

FAMILIES = ("mdlm", "bd3lm")
DTYPES = ("float32", "bfloat16")
FREQUENCY_FEATURES = 256


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiTConfig:
  """The architecture of an MDLM / BD3-LM checkpoint (frozen: a static argument under jit).

  vocab_size: V real ids; the embedding and the output have V + 1 rows (the mask id V).
  block_size: BD3-LM's block-causal attention (None: bidirectional, MDLM).
  time_conditioning: False (the released checkpoints): sigma is zeroed, so every adaLN term
    is a constant and the folded fast path applies.
  noise_eps: the log-linear schedule's eps: the denoiser maps t in [0, 1] to
    sigma(t) = -log(1 - (1 - eps) t).
  dtype: the matmuls' dtype (accumulated in float32); the residual stream, norms, softmax
    and logits are float32.
  """

  family: str
  vocab_size: int
  hidden_dim: int
  cond_dim: int
  n_blocks: int
  n_heads: int
  model_length: int
  mlp_ratio: int = 4
  block_size: int | None = None
  time_conditioning: bool = False
  noise_eps: float = 1e-3
  rope_base: float = 10000.0
  norm_eps: float = 1e-5
  dtype: str = "float32"

  def __post_init__(self):
    checks.check_common(self, FAMILIES, DTYPES,
                        counts=("vocab_size", "hidden_dim", "cond_dim", "n_blocks", "n_heads",
                                "model_length", "mlp_ratio"),
                        positive=("rope_base", "norm_eps"))
    if self.hidden_dim % self.n_heads:
      raise ValueError(f"hidden_dim={self.hidden_dim} is not divisible by n_heads="
                       f"{self.n_heads}.")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} (hidden_dim / n_heads) must be even (the "
                       "rotary embedding rotates pairs of halves).")
    if self.block_size is not None:
      size = self.block_size
      if not (checks.is_int(size) and size >= 1):
        raise ValueError(f"block_size={size!r} must be None or an integer >= 1.")
      if self.model_length % size:
        raise ValueError(f"block_size={size} must divide model_length={self.model_length}.")
    if not isinstance(self.time_conditioning, (bool, np.bool_)):
      raise ValueError(f"time_conditioning={self.time_conditioning!r} must be True or False.")
    if not (checks.is_number(self.noise_eps) and 0 <= self.noise_eps < 1):
      raise ValueError(f"noise_eps={self.noise_eps!r} must be a number in [0, 1).")

  @property
  def mask_id(self) -> int:
    return self.vocab_size

  @property
  def head_dim(self) -> int:
    return self.hidden_dim // self.n_heads

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)


@struct.dataclass
class DiTCache:
  """Every block's keys (after rotary) and values, rows first (samplers hand each row its
  cache as a per-row input: `sampling.sample_blocks`), then stacked over blocks, heads-major
  so a window's queries read them with one batched matmul per head."""

  keys_BxNxHxLxK: Array
  values_BxNxHxLxK: Array

  @property
  def length(self) -> int:
    return self.keys_BxNxHxLxK.shape[3]

  @classmethod
  def of_blocks(cls, keys_NxBxHxLxK: Array, values_NxBxHxLxK: Array) -> "DiTCache":
    """From the scan over blocks' stacked outputs (blocks first)."""
    return cls(keys_BxNxHxLxK=jnp.moveaxis(keys_NxBxHxLxK, 0, 1),
               values_BxNxHxLxK=jnp.moveaxis(values_NxBxHxLxK, 0, 1))

  def blocks_first(self) -> tuple[Array, Array]:
    """(keys_NxBxHxLxK, values_NxBxHxLxK): the scan over blocks reads them so."""
    return jnp.moveaxis(self.keys_BxNxHxLxK, 1, 0), jnp.moveaxis(self.values_BxNxHxLxK, 1, 0)


# --- building blocks -------------------------------------------------------------------


def _matmul(x: Array, w: Array, dtype) -> Array:
  """x @ w in `dtype`, accumulated and returned in float32."""
  return jnp.einsum("...i,io->...o", x.astype(dtype), w.astype(dtype),
                    preferred_element_type=jnp.float32)


def _layer_norm(x_BxQxD: Array, weight_D: Array, bias_D: Array | None, eps: float) -> Array:
  """The reference's LayerNorm (F.layer_norm without affine, in float32, times the weight);
  the folded path adds a bias."""
  x = x_BxQxD.astype(jnp.float32)
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  x = (x - mean) * jax.lax.rsqrt(var + eps) * weight_D.astype(jnp.float32)
  return x if bias_D is None else x + bias_D.astype(jnp.float32)


def timestep_embedding(sigma_B: Array) -> Array:
  """The 256 frequency features of sigma (cos before sin), B x 256, float32."""
  half = FREQUENCY_FEATURES // 2
  freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
  args = jnp.asarray(sigma_B, jnp.float32)[:, None] * freqs[None]
  return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


def conditioning(config: DiTConfig, params: dict, sigma_B: Array) -> Array:
  """c = SiLU(TimestepEmbedder(sigma)), B x C in float32; sigma is zeroed without
  time_conditioning, as the reference's `_process_sigma` does."""
  sigma_B = jnp.asarray(sigma_B, jnp.float32).reshape(-1)
  if not config.time_conditioning:
    sigma_B = jnp.zeros_like(sigma_B)
  m = params["sigma_map"]
  h = jax.nn.silu(_matmul(timestep_embedding(sigma_B), m["w1"], jnp.float32)
                  + m["b1"].astype(jnp.float32))
  return jax.nn.silu(_matmul(h, m["w2"], jnp.float32) + m["b2"].astype(jnp.float32))


def total_noise(config: DiTConfig, t_B: Array) -> Array:
  """MDLM's log-linear schedule: sigma(t) = -log(1 - (1 - eps) t)."""
  return -jnp.log1p(-(1.0 - config.noise_eps) * jnp.asarray(t_B, jnp.float32))


def positions(valid_BxL: Array | None, length: int) -> Array:
  """Each position's rotary (and block) position: 1 x L of 0..L-1, or B x L counted from
  each row's first real token (padding at 0)."""
  if valid_BxL is None:
    return jnp.arange(length, dtype=jnp.int32)[None]
  return layers.counted_positions(valid_BxL)


def _rotary(config: DiTConfig, positions_BxQ: Array) -> tuple[Array, Array]:
  """cos and sin of the rotary angles, B x Q x K/2 (float32)."""
  inv_freq_K2 = layers.inverse_frequencies(config.head_dim, config.rope_base)
  return layers.rotary_cos_sin(positions_BxQ, inv_freq_K2, full_width=False)


def _qkv(config: DiTConfig, layer: dict, x_BxQxD: Array, cos, sin):
  """Queries B x Q x H x K and keys, values B x H x Q x K (q and k rotated in float32 in
  flash-attn's order, v not)."""
  batch, width, _ = x_BxQxD.shape
  qkv = _matmul(x_BxQxD, layer["qkv"], config.jnp_dtype)
  qkv = qkv.reshape(batch, width, 3, config.n_heads, config.head_dim)  # (three h d)
  rotate = lambda x: layers.rotate(x, cos, sin, form="halves", float32=True)
  q, k = rotate(qkv[:, :, 0]), rotate(qkv[:, :, 1])
  dtype = config.jnp_dtype
  return (q.astype(dtype), k.transpose(0, 2, 1, 3).astype(dtype),
          qkv[:, :, 2].transpose(0, 2, 1, 3).astype(dtype))


def _attend(q_BxQxHxK: Array, parts) -> Array:
  """Attention of the queries over key parts, each (keys_BxHxSxK, values_BxHxSxK,
  visible_BxQxS or broadcastable, or None: all), under one float32 softmax
  (`layers.attend`: scores divided by sqrt(K), values weighted into float32). Returns
  B x Q x D."""
  return layers.attend(q_BxQxHxK, parts, scale_by_reciprocal=False, float32_values=True)


def _modulation(config: DiTConfig, ada: Array, ada_bias: Array, c_BxC: Array | None,
                parts: int) -> list:
  """adaLN's `parts` chunks of ada(c), each B x 1 x D (None for folded params)."""
  if c_BxC is None:
    return [None] * parts
  mods = _matmul(c_BxC, ada, config.jnp_dtype) + ada_bias.astype(jnp.float32)
  return jnp.split(mods[:, None], parts, axis=-1)


def _modulate(x: Array, shift, scale) -> Array:
  return x if shift is None else x * (1.0 + scale) + shift


def _gated(gate, x: Array) -> Array:
  return x if gate is None else gate * x


def _block(config: DiTConfig, layer: dict, c_BxC: Array | None, h_BxQxD: Array,
           attention: Callable):
  """One DDiT block on the float32 residual stream; `attention(x_BxQxD)` -> (the heads'
  output B x Q x D before attn_out, what the pass keeps). Folded params (c None) carry
  their modulation in the norms' affine terms and the gates in the output matrices."""
  dtype, eps = config.jnp_dtype, config.norm_eps
  shift1, scale1, gate1, shift2, scale2, gate2 = _modulation(
      config, layer.get("ada"), layer.get("ada_bias"), c_BxC, 6)
  x = _modulate(_layer_norm(h_BxQxD, layer["norm1"], layer.get("norm1_bias"), eps),
                shift1, scale1)
  out_BxQxD, kept = attention(x)
  h_BxQxD = h_BxQxD + _gated(gate1, _matmul(out_BxQxD, layer["attn_out"], dtype))
  x = _modulate(_layer_norm(h_BxQxD, layer["norm2"], layer.get("norm2_bias"), eps),
                shift2, scale2)
  y = jax.nn.gelu(_matmul(x, layer["mlp_in"], dtype) + layer["mlp_in_bias"].astype(jnp.float32),
                  approximate=True)
  y = _matmul(y, layer["mlp_out"], dtype) + layer["mlp_out_bias"].astype(jnp.float32)
  return h_BxQxD + _gated(gate2, y), kept


def _final(config: DiTConfig, final: dict, c_BxC: Array | None, h_BxQxD: Array) -> Array:
  """The final layer: norm, modulate, linear with bias; float32 logits over V + 1 ids."""
  shift, scale = _modulation(config, final.get("ada"), final.get("ada_bias"), c_BxC, 2)
  x = _modulate(_layer_norm(h_BxQxD, final["norm"], final.get("norm_bias"), config.norm_eps),
                shift, scale)
  return (_matmul(x, final["linear"], config.jnp_dtype)
          + final["linear_bias"].astype(jnp.float32))


def _embed(params: dict, tokens_BxQ: Array) -> Array:
  return jnp.take(params["embed"], tokens_BxQ, axis=0).astype(jnp.float32)


def _visible(config: DiTConfig, query_BxQ: Array, key_BxS: Array) -> Array | None:
  """Block-causal visibility (query block b sees key blocks <= b), [B x] Q x S; None when
  bidirectional."""
  return layers.visible(query_BxQ, key_BxS, block_size=config.block_size)


# --- the passes on the network -----------------------------------------------------------


def _full_pass(config: DiTConfig, params: dict, c_BxC: Array | None, tokens_BxQ: Array,
               positions_BxQ: Array, visible_BxQxQ: Array | None):
  """Raw logits_BxQx(V+1) of a pass over Q positions where each query sees the keys
  `visible_BxQxQ` says (None: all), and every block's keys and values (N x B x H x Q x K)."""
  cos, sin = _rotary(config, positions_BxQ)

  def body(h_BxQxD, layer):
    def attention(x):
      q, k, v = _qkv(config, layer, x, cos, sin)
      return _attend(q, [(k, v, visible_BxQxQ)]), (k, v)
    return _block(config, layer, c_BxC, h_BxQxD, attention)

  h_BxQxD, (keys, values) = jax.lax.scan(body, _embed(params, tokens_BxQ), params["blocks"])
  return h_BxQxD, keys, values


def _check_length(config: DiTConfig, length: int) -> None:
  """A canvas past model_length: rotary positions and BD3-LM's block mask the model never
  saw (the reference's mask has model_length rows), so refuse it."""
  if length > config.model_length:
    raise ValueError(
        f"a canvas of {length} positions is longer than model_length={config.model_length}; "
        "a BD3-LM model generates longer sequences block by block over windows of "
        "model_length (mdjax.formats.bd3lm.bd3lm_sample, "
        "mdjax.sampling.sample_blocks).")


def _canvas_pass(config: DiTConfig, params: dict, c_BxC: Array | None, tokens_BxL: Array,
                 valid_BxL: Array | None) -> tuple[Array, DiTCache]:
  """The pass over a whole canvas: raw logits and the cache."""
  tokens_BxL = jnp.asarray(tokens_BxL, jnp.int32)
  length = tokens_BxL.shape[1]
  _check_length(config, length)
  pos_BxL = positions(valid_BxL, length)
  visible = _visible(config, pos_BxL, pos_BxL)
  if valid_BxL is not None:  # padding is attended by nothing
    visible = layers.both(visible, valid_BxL.astype(bool)[:, None, :])
  h_BxLxD, keys, values = _full_pass(config, params, c_BxC, tokens_BxL, pos_BxL, visible)
  return _final(config, params["final"], c_BxC, h_BxLxD), DiTCache.of_blocks(keys, values)


def _window_pass(config: DiTConfig, params: dict, c_BxC: Array | None, cache: DiTCache,
                 tokens_BxW: Array, start, valid_BxL: Array | None):
  """The pass over [start, start + W) against `cache`: the window's queries attend to the
  cached keys outside it and to their own fresh ones (both under the attention pattern),
  under one softmax. Returns (raw logits_BxWx(V+1), the cache with the window written)."""
  tokens_BxW = jnp.asarray(tokens_BxW, jnp.int32)
  batch, width = tokens_BxW.shape
  length = cache.length
  layers.check_window(width, length)
  start = jnp.asarray(start, jnp.int32)
  pos_BxL = jnp.broadcast_to(positions(valid_BxL, length), (batch, length))
  pos_BxW = jax.lax.dynamic_slice_in_dim(pos_BxL, start, width, axis=1)
  key_L = jnp.arange(length)
  cached_vis = layers.outside_window(key_L, start, width)[None, None]
  cached_vis = layers.both(cached_vis, _visible(config, pos_BxW, pos_BxL))
  own_vis = _visible(config, pos_BxW, pos_BxW)
  if valid_BxL is not None:  # padding is attended by nothing
    valid_BxL = valid_BxL.astype(bool)
    cached_vis = cached_vis & valid_BxL[:, None, :]
    own_vis = layers.both(own_vis,
                          jax.lax.dynamic_slice_in_dim(valid_BxL, start, width, 1)[:, None])
  cos, sin = _rotary(config, pos_BxW)

  def body(h_BxWxD, xs):
    layer, cached_keys, cached_values = xs

    def attention(x):
      q, k, v = _qkv(config, layer, x, cos, sin)
      out = _attend(q, [(cached_keys, cached_values, cached_vis), (k, v, own_vis)])
      return out, (k, v)
    return _block(config, layer, c_BxC, h_BxWxD, attention)

  cached_keys, cached_values = cache.blocks_first()
  h_BxWxD, (keys, values) = jax.lax.scan(
      body, _embed(params, tokens_BxW), (params["blocks"], cached_keys, cached_values))
  return _final(config, params["final"], c_BxC, h_BxWxD), DiTCache.of_blocks(
      layers.write_window(cached_keys, keys, start),
      layers.write_window(cached_values, values, start))


def _pair_pass(config: DiTConfig, params: dict, c_BxC: Array | None, noisy_BxL: Array,
               clean_BxL: Array) -> Array:
  """BD3-LM's training pass over [x_t ; x_0] (both at positions 0..L-1) under
  `block_pair_mask`: the noisy half's raw logits."""
  layers.check_block_pair(config.block_size, noisy_BxL, clean_BxL, "DiTConfig")
  length = noisy_BxL.shape[1]
  if length % config.block_size:
    raise ValueError(f"block_pair over {length} positions: block_size={config.block_size} "
                     "must divide it.")
  tokens = jnp.concatenate([noisy_BxL, clean_BxL], axis=1).astype(jnp.int32)
  pos_1x2L = jnp.asarray(np.concatenate([np.arange(length)] * 2), jnp.int32)[None]
  visible = jnp.asarray(block_pair_mask(length, config.block_size))[None]
  h, _, _ = _full_pass(config, params, c_BxC, tokens, pos_1x2L, visible)
  return _final(config, params["final"], c_BxC, h[:, :length])


def forward(config: DiTConfig, params: dict, tokens_BxL: Array, sigma_B: Array, *,
            valid_BxL: Array | None = None) -> Array:
  """The network's raw output, logits_BxLx(V+1) in float32, conditioned on sigma (zeroed
  without time_conditioning); `valid_BxL` False on padding."""
  c_BxC = conditioning(config, params, sigma_B)
  return _canvas_pass(config, params, c_BxC, tokens_BxL, valid_BxL)[0]


def forward_folded(config: DiTConfig, folded: dict, tokens_BxL: Array,
                   valid_BxL: Array | None = None) -> Array:
  """`forward` on `fold(config, params)` (no sigma: the network is time-free)."""
  return _canvas_pass(config, folded, None, tokens_BxL, valid_BxL)[0]


def prefill(config: DiTConfig, params: dict, tokens_BxL: Array, sigma_B: Array | None, *,
            valid_BxL: Array | None = None) -> tuple[Array, DiTCache]:
  """One full pass: (raw logits_BxLx(V+1), every block's keys and values). `sigma_B=None`:
  `params` are `fold`'s."""
  c_BxC = None if sigma_B is None else conditioning(config, params, sigma_B)
  return _canvas_pass(config, params, c_BxC, tokens_BxL, valid_BxL)


def decode(config: DiTConfig, params: dict, cache: DiTCache, tokens_BxW: Array, start,
           sigma_B: Array | None, *, valid_BxL: Array | None = None
           ) -> tuple[Array, DiTCache]:
  """A pass over the W positions [start, start + W) (start may be traced) against `cache`:
  (raw logits_BxWx(V+1), the cache with the window's keys and values written in).
  `sigma_B=None`: `params` are `fold`'s."""
  c_BxC = None if sigma_B is None else conditioning(config, params, sigma_B)
  return _window_pass(config, params, c_BxC, cache, tokens_BxW, start, valid_BxL)


# --- folding -----------------------------------------------------------------------------


def fold(config: DiTConfig, params: dict) -> dict:
  """The params with every adaLN term folded in (time_conditioning False: c is a constant):

    blocks: norm1 <- norm1 (1 + scale1), norm1_bias = shift1, attn_out <- attn_out gate1,
            norm2 <- norm2 (1 + scale2), norm2_bias = shift2, mlp_out <- mlp_out gate2,
            mlp_out_bias <- mlp_out_bias gate2 (gates scale the output columns)
    final:  norm <- norm (1 + scale), norm_bias = shift

  no sigma_map or ada leaves. Computed in float32, stored in each leaf's dtype."""
  if config.time_conditioning:
    raise ValueError("fold needs time_conditioning=False: with it the adaLN terms depend on "
                     "sigma and cannot be folded into the weights.")
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  c_C = conditioning(config, params, jnp.zeros((1,), jnp.float32))[0]
  b = params["blocks"]
  mods_Nx6D = jnp.einsum("c,nco->no", c_C, f32(b["ada"])) + f32(b["ada_bias"])
  shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(mods_Nx6D, 6, axis=-1)
  blocks = {
      "norm1": f32(b["norm1"]) * (1 + scale1), "norm1_bias": shift1,
      "qkv": b["qkv"], "attn_out": f32(b["attn_out"]) * gate1[:, None],
      "norm2": f32(b["norm2"]) * (1 + scale2), "norm2_bias": shift2,
      "mlp_in": b["mlp_in"], "mlp_in_bias": b["mlp_in_bias"],
      "mlp_out": f32(b["mlp_out"]) * gate2[:, None],
      "mlp_out_bias": f32(b["mlp_out_bias"]) * gate2,
  }
  fin = params["final"]
  shift, scale = jnp.split(c_C @ f32(fin["ada"]) + f32(fin["ada_bias"]), 2)
  final = {"norm": f32(fin["norm"]) * (1 + scale), "norm_bias": shift,
           "linear": fin["linear"], "linear_bias": fin["linear_bias"]}
  dtype_of = lambda x: jnp.asarray(x).dtype
  blocks = {n: jnp.asarray(x, dtype_of(b.get(n, b["norm1"]))) for n, x in blocks.items()}
  final = {n: jnp.asarray(x, dtype_of(fin.get(n, fin["norm"]))) for n, x in final.items()}
  return {"embed": params["embed"], "blocks": blocks, "final": final}


# --- the Denoiser -------------------------------------------------------------------------


def subs(config: DiTConfig, logits_BxLxV1: Array, tokens_BxL: Array) -> Array:
  """MDLM's SUBS parameterization over the V real ids (the mask column dropped): the
  log-softmax of the logits with the mask logit at -inf, and at visible (unmasked)
  positions the one-hot of the visible token in log space (0 at it, -inf elsewhere).
  (The reference writes -1e6 for -inf; exp of either is 0 in float32.) mdjax's samplers
  never read visible positions; its losses read only masked ones (`jnp.where` on the
  mask), and the one-hot rows hold no parameter, so no gradient passes through them."""
  v = config.vocab_size
  logp_BxLxV = jax.nn.log_softmax(logits_BxLxV1[..., :v].astype(jnp.float32), axis=-1)
  tokens_BxL = jnp.asarray(tokens_BxL)
  one_hot_BxLxV = jnp.where(jnp.arange(v) == tokens_BxL[..., None], 0.0, -jnp.inf)
  return jnp.where((tokens_BxL != config.mask_id)[..., None], one_hot_BxLxV, logp_BxLxV)


def _network(config: DiTConfig, mode: str, params: dict, t_B: Array):
  """(params of the pass, c_BxC or None for folded params) for the denoiser's `mode`:
  "fold" folds unfolded params in the program, "folded" takes `fold`'s, "plain" runs the
  unfolded network on sigma(t)."""
  if mode == "fold":
    return fold(config, params), None
  if mode == "folded":
    return params, None
  return params, conditioning(config, params, total_noise(config, t_B))


def _apply(config, mode, params, tokens_BxL, t_B, valid_BxL=None):
  net, c_BxC = _network(config, mode, params, t_B)
  logits, _ = _canvas_pass(config, net, c_BxC, tokens_BxL, valid_BxL)
  return subs(config, logits, tokens_BxL)


def _prefill(config, mode, params, tokens_BxL, t_B, valid_BxL=None):
  net, c_BxC = _network(config, mode, params, t_B)
  logits, cache = _canvas_pass(config, net, c_BxC, tokens_BxL, valid_BxL)
  return subs(config, logits, tokens_BxL), cache


def _decode(config, mode, params, cache, tokens_BxW, start, t_B, valid_BxL=None):
  net, c_BxC = _network(config, mode, params, t_B)
  logits, cache = _window_pass(config, net, c_BxC, cache, tokens_BxW, start, valid_BxL)
  return subs(config, logits, tokens_BxW), cache


def _block_pair(config, mode, params, noisy_BxL, clean_BxL, t_B):
  net, c_BxC = _network(config, mode, params, t_B)
  return subs(config, _pair_pass(config, net, c_BxC, noisy_BxL, clean_BxL), noisy_BxL)


def denoiser(config: DiTConfig, *, folded: bool | None = None) -> Denoiser:
  """The model as a `Denoiser`: apply(params, tokens_BxL, t_B, valid_BxL=None) ->
  logits_BxLxV over the V real ids under SUBS (`subs`), t mapped to sigma(t) by the
  log-linear schedule (`total_noise`).

  folded: None (default): `params` in the unfolded layout; without time_conditioning the
    program folds them (`fold`: one elementwise pass over the output matrices per call)
    and runs the folded network. True: `params` are `fold(config, params)` (fold once, for
    long sampling runs). False: the unfolded network, always.

  Offers the cached contract (prefill, decode; exact for finished blocks when block_size
  is set), and with block_size the `block_size` and `block_pair` fields. A block-causal
  model with time_conditioning offers no cache: its keys would depend on the current t.
  """
  if folded is None:
    mode = "plain" if config.time_conditioning else "fold"
  elif folded:
    if config.time_conditioning:
      raise ValueError("folded=True needs time_conditioning=False (fold refuses "
                       "time-conditioned params).")
    mode = "folded"
  else:
    mode = "plain"
  bound = lambda fn: layers.bind(fn, config, mode)  # equal for equal (config, mode)
  blocks = config.block_size is not None
  cached = not (blocks and config.time_conditioning)
  return Denoiser(apply=bound(_apply),
                  prefill=bound(_prefill) if cached else None,
                  decode=bound(_decode) if cached else None,
                  block_size=config.block_size,
                  block_pair=bound(_block_pair) if blocks else None)


# --- parameters ---------------------------------------------------------------------------


def param_shapes(config: DiTConfig) -> dict:
  """The params pytree's shapes (the module docstring's layout)."""
  n, d, c, v1 = config.n_blocks, config.hidden_dim, config.cond_dim, config.vocab_size + 1
  r = config.mlp_ratio * d
  return {
      "embed": (v1, d),
      "sigma_map": {"w1": (FREQUENCY_FEATURES, c), "b1": (c,), "w2": (c, c), "b2": (c,)},
      "blocks": {"norm1": (n, d), "qkv": (n, d, 3 * d), "attn_out": (n, d, d), "norm2": (n, d),
                 "mlp_in": (n, d, r), "mlp_in_bias": (n, r), "mlp_out": (n, r, d),
                 "mlp_out_bias": (n, d), "ada": (n, c, 6 * d), "ada_bias": (n, 6 * d)},
      "final": {"norm": (d,), "ada": (c, 2 * d), "ada_bias": (2 * d,),
                "linear": (d, v1), "linear_bias": (v1,)},
  }


def init_params(config: DiTConfig, key: Array) -> dict:
  """Random params in the config's dtype: normal matrices (std 1/sqrt(fan in); embedding
  std 1), norm weights 1 + noise, small random biases, and NONZERO adaLN weights and
  biases (the reference zero-inits those; random ones let tests reach every term). One
  normal draw, cut into the leaves (one small program)."""
  shapes = param_shapes(config)
  flat, treedef = jax.tree_util.tree_flatten_with_path(
      shapes, is_leaf=lambda x: isinstance(x, tuple))
  sizes = [int(np.prod(shape)) for _, shape in flat]
  draws = jnp.split(jax.random.normal(key, (sum(sizes),), jnp.float32),
                    np.cumsum(sizes)[:-1])
  dtype = config.jnp_dtype

  def one(path, shape, z):
    name = jax.tree_util.keystr(path)
    z = z.reshape(shape)
    if "norm" in name:
      z = 1.0 + 0.1 * z
    elif "bias" in name or name.endswith("['b1']") or name.endswith("['b2']"):
      z = 0.1 * z
    elif "embed" not in name:
      z = z / np.sqrt(shape[-2])
    return z.astype(dtype)

  return jax.tree.unflatten(treedef, [one(p, s, z) for (p, s), z in zip(flat, draws)])


def num_params(config: DiTConfig) -> int:
  """The number of parameters (of the unfolded layout)."""
  shapes = jax.tree.leaves(param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
  return int(sum(np.prod(s) for s in shapes))
