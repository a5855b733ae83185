"""A bidirectional Transformer denoiser (Flax NNX), a block-causal one, or a causal reference.

Build with `Transformer(TransformerConfig(...), rngs=nnx.Rngs(0))`; compiled
code uses the functional form `make_apply_fn(graphdef)` on `nnx.split` params,
a `mdjax.denoiser.Denoiser` that meets the denoiser contract apply_fn(params, tokens_BxL,
t_B) -> logits_BxLxV and offers the cached one beside it (`apply_fn.prefill`,
`apply_fn.decode`):

  prefill(params, tokens_BxL, t_B) -> (logits_BxLxV, KVCache)
      one full pass that also returns every layer's keys and values (KVCache.layers,
      each a LayerKV of keys_BxHxLxK and values_BxHxLxK);
  decode(params, cache, tokens_BxW, start, t_B) -> (logits_BxWxV, KVCache)
      a pass over the W positions [start, start + W) (start may be traced): their
      queries attend to the cached keys and values of every other position and to
      their own fresh ones, which the returned cache holds in place of the old.

Each takes an optional `valid_BxL` (bool, the whole canvas): padding positions (False)
attend to nothing (their output is zero) and no position attends to them, and positions
are counted from each row's first valid token (cumsum(valid) - 1), so a left-padded row
gives the logits of the same row without its padding.

With `block_size` set (block diffusion, BD3-LM) attention is block-causal: a position
attends to every position of earlier blocks and to all of its own block (blocks counted in
those positions). Such a model also offers `apply_fn.block_pair(params, noisy_BxL,
clean_BxL, t_B) -> logits_BxLxV`: one pass over the noisy and the clean sequence side by
side (2L positions, the clean copy at the same positions 0..L-1), where noisy block b sees
itself and clean blocks < b and clean block b sees clean blocks <= b; the logits are the
noisy half's. Noisy block b's logits are those of a plain pass over [clean blocks < b,
noisy block b, anything after].
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from mdjax.denoiser import Denoiser
from mdjax.models import layers
from mdjax.models.layers import block_pair_mask, rope_table

Array = jax.Array

POSITIONS = ("rope", "sinusoidal")
NORMS = ("rms", "layer")
MLPS = ("swiglu", "gelu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
  """Model shape. The token embedding covers vocab_size + 1 ids (mask = V)."""

  vocab_size: int
  max_len: int
  d_model: int = 128
  num_layers: int = 4
  num_heads: int = 4
  d_ff: int = 512
  positions: str = "rope"
  norm: str = "rms"
  mlp: str = "swiglu"
  time_conditioning: bool = False
  causal: bool = False
  # Block-causal attention (block diffusion): None is full bidirectional attention.
  block_size: int | None = None
  dtype: str = "float32"  # compute dtype; parameters stay float32
  # Rematerialization: each block's activations are recomputed in the backward pass of a
  # full pass instead of kept (the same values and gradients, less memory, more compute).
  remat: bool = False

  def __post_init__(self):
    for name in ("vocab_size", "max_len", "d_model", "num_layers", "num_heads", "d_ff"):
      value = getattr(self, name)
      if not (isinstance(value, int) and value >= 1):
        raise ValueError(f"{name}={value!r} must be an integer >= 1.")
    if self.d_model % self.num_heads:
      raise ValueError(f"d_model={self.d_model} must be divisible by num_heads={self.num_heads}.")
    if self.positions == "rope" and (self.d_model // self.num_heads) % 2:
      raise ValueError(f"rope needs an even head size; d_model / num_heads = "
                       f"{self.d_model // self.num_heads}.")
    for name, allowed in (("positions", POSITIONS), ("norm", NORMS), ("mlp", MLPS)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"{name}={getattr(self, name)!r} must be one of {allowed}.")
    if not isinstance(self.remat, bool):
      raise ValueError(f"remat={self.remat!r} must be True or False.")
    if self.block_size is not None:
      size = self.block_size
      if not (isinstance(size, int) and not isinstance(size, bool) and 1 <= size <= self.max_len):
        raise ValueError(f"block_size={size!r} must be None or an integer in [1, max_len="
                         f"{self.max_len}].")
      if self.causal:
        raise ValueError(f"block_size={size} with causal=True: choose one attention pattern "
                         "(block_size=1 is the block-causal form of a left-to-right model).")
      if self.time_conditioning:
        # The keys of finished blocks must not depend on the time of the block being
        # generated, or they could not be cached exactly.
        raise ValueError(f"block_size={size} needs time_conditioning=False: finished blocks' "
                         "keys and values must not depend on the current block's time.")


def sinusoidal(length: int, dim: int) -> Array:
  """Fixed sinusoidal position table (L x D)."""
  pos = jnp.arange(length)[:, None]
  freq = jnp.exp(-math.log(10_000.0) * jnp.arange(0, dim, 2) / dim)
  angle = pos * freq[None]
  return jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], -1)[:, :dim]


def rope(x_BxLxHxK: Array, positions_L: Array | None = None, max_len: int = 0) -> Array:
  """Rotary position embedding on the head dimension (positions default to 0..L-1; an
  L or B x L array of positions, each below max(L, max_len)), from the host table
  `rope_table`, in x's dtype."""
  length, half = x_BxLxHxK.shape[1], x_BxLxHxK.shape[-1] // 2
  cos_PxK, sin_PxK = rope_table(max(length, max_len), half)
  if positions_L is None:
    cos, sin = cos_PxK[None, :length, None], sin_PxK[None, :length, None]
  else:
    at = lambda table_PxK: jnp.asarray(table_PxK)[positions_L].reshape(
        (-1, length, 1, half))  # [B x] L x K/2 -> (B or 1) x L x 1 x K/2
    cos, sin = at(cos_PxK), at(sin_PxK)
  return layers.rotate(x_BxLxHxK, cos, sin, form="halves_sin_first", float32=False)


def _norm(cfg: TransformerConfig, rngs) -> nnx.Module:
  cls = nnx.RMSNorm if cfg.norm == "rms" else nnx.LayerNorm
  return cls(cfg.d_model, rngs=rngs)


class Block(nnx.Module):
  """Pre-norm attention + MLP, with optional adaLN time modulation."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    d, dtype = cfg.d_model, jnp.dtype(cfg.dtype)
    self.cfg = cfg
    self.norm1, self.norm2 = _norm(cfg, rngs), _norm(cfg, rngs)
    self.qkv = nnx.Linear(d, 3 * d, use_bias=False, dtype=dtype, rngs=rngs)
    self.proj = nnx.Linear(d, d, use_bias=False, dtype=dtype, rngs=rngs)
    hidden = 2 * cfg.d_ff if cfg.mlp == "swiglu" else cfg.d_ff
    self.mlp_in = nnx.Linear(d, hidden, use_bias=False, dtype=dtype, rngs=rngs)
    self.mlp_out = nnx.Linear(cfg.d_ff, d, use_bias=False, dtype=dtype, rngs=rngs)
    if cfg.time_conditioning:
      # shift, scale, gate for both sublayers; zero-init so training starts plain.
      self.ada = nnx.Linear(d, 6 * d, kernel_init=nnx.initializers.zeros, dtype=dtype, rngs=rngs)

  def __call__(self, h_BxWxD: Array, temb_BxD: Array | None, start: Array | int = 0,
               cached: "LayerKV | None" = None, positions_BxW: Array | None = None,
               valid_BxL: Array | None = None,
               visible_WxW: Array | None = None) -> tuple[Array, "LayerKV"]:
    """The block on W positions starting at `start`; returns (h, this layer's keys and
    values). Without `cached` the W positions are the whole sequence, attending where
    `visible_WxW` ([B x] W x W; None: everywhere); with it, the window attends to the cached
    keys and values outside itself and to its own fresh ones."""
    cfg = self.cfg
    batch, width, d = h_BxWxD.shape
    heads, head_dim = cfg.num_heads, d // cfg.num_heads
    if cfg.time_conditioning:
      mods = jnp.split(self.ada(temb_BxD)[:, None], 6, axis=-1)
    else:
      mods = [0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    shift1, scale1, gate1, shift2, scale2, gate2 = mods
    if cfg.time_conditioning:
      gate1, gate2 = 1.0 + gate1, 1.0 + gate2
    x = self.norm1(h_BxWxD) * (1.0 + scale1) + shift1
    q, k, v = jnp.split(self.qkv(x).reshape(batch, width, 3 * heads, head_dim), 3, axis=2)
    if cfg.positions == "rope":
      positions_W = None if cached is None else start + jnp.arange(width)
      if positions_BxW is not None:
        positions_W = positions_BxW
      q, k = rope(q, positions_W, cfg.max_len), rope(k, positions_W, cfg.max_len)
    if cached is None:
      out = _attend(q, k, v, visible_WxW, head_dim, valid_BxL)
      fresh = LayerKV.heads_major(k, v)
    else:
      out = _attend_window(q, k, v, cached, start, cfg, head_dim, valid_BxL)
      fresh = cached.write(k, v, start)
    h_BxWxD = h_BxWxD + gate1 * self.proj(out.reshape(batch, width, d))
    x = self.norm2(h_BxWxD) * (1.0 + scale2) + shift2
    y = self.mlp_in(x)
    if cfg.mlp == "swiglu":
      a, b = jnp.split(y, 2, axis=-1)
      y = jax.nn.silu(a) * b
    else:
      y = jax.nn.gelu(y)
    return h_BxWxD + gate2 * self.mlp_out(y), fresh


@struct.dataclass
class LayerKV:
  """One layer's keys (after RoPE) and values at every position, heads-major so a window's
  queries read them with one batched matmul per head (no transpose per step)."""

  keys_BxHxLxK: Array
  values_BxHxLxK: Array

  @classmethod
  def heads_major(cls, keys_BxLxHxK: Array, values_BxLxHxK: Array) -> "LayerKV":
    return cls(keys_BxHxLxK=keys_BxLxHxK.transpose(0, 2, 1, 3),
               values_BxHxLxK=values_BxLxHxK.transpose(0, 2, 1, 3))

  def write(self, keys_BxWxHxK: Array, values_BxWxHxK: Array, start) -> "LayerKV":
    """The cache with positions [start, start + W) replaced."""
    window = LayerKV.heads_major(keys_BxWxHxK, values_BxWxHxK)
    put = lambda old, new: layers.write_window(old, new, start)
    return LayerKV(keys_BxHxLxK=put(self.keys_BxHxLxK, window.keys_BxHxLxK),
                   values_BxHxLxK=put(self.values_BxHxLxK, window.values_BxHxLxK))


@struct.dataclass
class KVCache:
  """Every layer's keys and values: a tuple of N layers (separate buffers, so a window pass
  reads each layer's in place)."""

  layers: tuple[LayerKV, ...]

  def layer(self, n: int) -> LayerKV:
    return self.layers[n]

  @classmethod
  def stack(cls, layers: list[LayerKV]) -> "KVCache":
    return cls(layers=tuple(layers))

  @property
  def length(self) -> int:
    return self.layers[0].keys_BxHxLxK.shape[2]


def visible(cfg: TransformerConfig, query_Q, key_K):
  """Whether each query position attends to each key position ([B x] Q x K from positions
  of shape [B x] Q and [B x] K, numpy or jax by the inputs); None when every key is
  visible (bidirectional)."""
  return layers.visible(query_Q, key_K, causal=cfg.causal, block_size=cfg.block_size)


def _per_head(mask):
  """A [B x] Q x K mask broadcast against B x H x Q x K logits."""
  return mask[:, None] if mask.ndim == 3 else mask


def _attend(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, visible_LxL, head_dim: int,
            valid_BxL: Array | None = None) -> Array:
  """Full self-attention over L positions, where `visible_LxL` ([B x] L x L; None: every
  key); padding (not `valid_BxL`) is attended by nothing and attends to nothing."""
  logits_BxHxLxL = jnp.einsum("blhk,bmhk->bhlm", q_BxLxHxK, k_BxLxHxK) / math.sqrt(head_dim)
  if visible_LxL is not None:
    logits_BxHxLxL = jnp.where(_per_head(visible_LxL), logits_BxHxLxL, layers.MASKED)
  if valid_BxL is not None:
    logits_BxHxLxL = jnp.where(valid_BxL[:, None, None, :], logits_BxHxLxL, layers.MASKED)
  attn = jax.nn.softmax(logits_BxHxLxL.astype(jnp.float32), -1).astype(v_BxLxHxK.dtype)
  out_BxLxHxK = jnp.einsum("bhlm,bmhk->blhk", attn, v_BxLxHxK)
  if valid_BxL is not None:
    out_BxLxHxK = jnp.where(valid_BxL[:, :, None, None], out_BxLxHxK, 0)
  return out_BxLxHxK


def _attend_window(q_BxWxHxK, k_BxWxHxK, v_BxWxHxK, cached: LayerKV, start,
                   cfg: TransformerConfig, head_dim: int,
                   valid_BxL: Array | None = None) -> Array:
  """The window's queries over the cached keys outside [start, start + W) and the window's
  own fresh keys, under one softmax. The cache is only read: writing the window into it
  first would copy it at every step."""
  width, length = q_BxWxHxK.shape[1], cached.keys_BxHxLxK.shape[2]
  query_W = start + jnp.arange(width)
  key_L = jnp.arange(length)
  visible_WxL = layers.outside_window(key_L, start, width)[None]
  own_WxW = jnp.ones((width, width), bool)
  if cfg.block_size is not None and valid_BxL is not None:
    # Blocks are counted in each row's positions (from its first valid token).
    key_L = layers.counted_positions(valid_BxL)
    query_W = jax.lax.dynamic_slice_in_dim(key_L, start, width, axis=1)
  pattern_WxL = visible(cfg, query_W, key_L)
  if pattern_WxL is not None:
    visible_WxL = visible_WxL & pattern_WxL
    own_WxW = visible(cfg, query_W, query_W)
  visible_BxWxL = visible_WxL if visible_WxL.ndim == 3 else visible_WxL[None]
  own_BxWxW = own_WxW if own_WxW.ndim == 3 else own_WxW[None]
  if valid_BxL is not None:  # padding is attended by nothing
    valid_BxW = jax.lax.dynamic_slice_in_dim(valid_BxL, start, width, axis=1)
    visible_BxWxL = visible_BxWxL & valid_BxL[:, None, :]
    own_BxWxW = own_BxWxW & valid_BxW[:, None, :]
  dtype = v_BxWxHxK.dtype
  q_BxHxWxK = q_BxWxHxK.transpose(0, 2, 1, 3) / math.sqrt(head_dim)
  cached_BxHxWxL = jnp.einsum("bhwk,bhlk->bhwl", q_BxHxWxK, cached.keys_BxHxLxK.astype(dtype))
  own_BxHxWxW = jnp.einsum("bhwk,buhk->bhwu", q_BxHxWxK, k_BxWxHxK)
  cached_BxHxWxL = jnp.where(visible_BxWxL[:, None], cached_BxHxWxL.astype(jnp.float32),
                             layers.MASKED)
  own_BxHxWxW = jnp.where(own_BxWxW[:, None], own_BxHxWxW.astype(jnp.float32), layers.MASKED)
  # One softmax over [cached keys, own keys], without concatenating the cached values.
  top_BxHxW = jnp.maximum(cached_BxHxWxL.max(-1), own_BxHxWxW.max(-1))[..., None]
  p_cached = jnp.exp(cached_BxHxWxL - top_BxHxW)
  p_own = jnp.exp(own_BxHxWxW - top_BxHxW)
  total_BxHxW = p_cached.sum(-1) + p_own.sum(-1)
  out_BxHxWxK = (jnp.einsum("bhwl,bhlk->bhwk", p_cached.astype(dtype),
                            cached.values_BxHxLxK.astype(dtype))
                 + jnp.einsum("bhwu,buhk->bhwk", p_own.astype(dtype), v_BxWxHxK))
  out_BxHxWxK = out_BxHxWxK / total_BxHxW[..., None].astype(dtype)
  out_BxWxHxK = out_BxHxWxK.transpose(0, 2, 1, 3)
  if valid_BxL is not None:  # padding attends to nothing
    out_BxWxHxK = jnp.where(valid_BxW[:, :, None, None], out_BxWxHxK, 0)
  return out_BxWxHxK


class Transformer(nnx.Module):
  """tokens_BxL (ids 0..V, V = mask), t_B -> logits_BxLxV over the real vocabulary."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dtype = jnp.dtype(cfg.dtype)
    self.embed = nnx.Embed(cfg.vocab_size + 1, cfg.d_model, dtype=dtype, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = _norm(cfg, rngs)
    # Logits come out of the matmul in float32 (accumulated there, never rounded to a
    # bfloat16 compute dtype): the softmax and the loss read them at full precision.
    self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dtype,
                           preferred_element_type=jnp.float32, rngs=rngs)
    if cfg.time_conditioning:
      self.time_mlp = nnx.Linear(cfg.d_model, cfg.d_model, dtype=dtype, rngs=rngs)

  def __call__(self, tokens_BxL: Array, t_B: Array, valid_BxL: Array | None = None) -> Array:
    return self._forward(tokens_BxL, t_B, valid_BxL=valid_BxL)[0]

  def prefill(self, tokens_BxL: Array, t_B: Array,
              valid_BxL: Array | None = None) -> tuple[Array, KVCache]:
    """One full pass: (logits_BxLxV, every layer's keys and values)."""
    logits_BxLxV, fresh = self._forward(tokens_BxL, t_B, valid_BxL=valid_BxL)
    return logits_BxLxV, KVCache.stack(fresh)

  def decode(self, cache: KVCache, tokens_BxW: Array, start: Array | int,
             t_B: Array, valid_BxL: Array | None = None) -> tuple[Array, KVCache]:
    """A pass over positions [start, start + W) against `cache`: (logits_BxWxV, the cache
    with the window's keys and values written in)."""
    layers.check_window(tokens_BxW.shape[1], cache.length)
    logits_BxWxV, fresh = self._forward(tokens_BxW, t_B, start, cache, valid_BxL)
    return logits_BxWxV, KVCache.stack(fresh)

  def block_pair(self, noisy_BxL: Array, clean_BxL: Array, t_B: Array) -> Array:
    """Noisy blocks' logits_BxLxV, each conditioned on the clean blocks before it: one pass
    over [noisy; clean] under `block_pair_mask` (BD3-LM's vectorized training pass)."""
    cfg = self.cfg
    layers.check_block_pair(cfg.block_size, noisy_BxL, clean_BxL, "TransformerConfig")
    length = noisy_BxL.shape[1]
    positions_W = np.concatenate([np.arange(length)] * 2)
    logits_BxWxV, _ = self._forward(
        jnp.concatenate([noisy_BxL, clean_BxL], axis=1), t_B, pair_positions_W=positions_W,
        visible_WxW=block_pair_mask(length, cfg.block_size), logits_for=length)
    return logits_BxWxV

  def _forward(self, tokens_BxW: Array, t_B: Array, start: Array | int = 0,
               cache: KVCache | None = None, valid_BxL: Array | None = None,
               pair_positions_W: np.ndarray | None = None,
               visible_WxW: np.ndarray | None = None,
               logits_for: int | None = None) -> tuple[Array, list[LayerKV]]:
    """The pass over W tokens. Full passes take positions 0..W-1 (or counted in
    `valid_BxL`) and the config's attention pattern, unless `pair_positions_W` and
    `visible_WxW` say otherwise (the block pair); logits come for the first `logits_for`
    positions (default all)."""
    cfg = self.cfg
    width = tokens_BxW.shape[1]
    length = width if cache is None else cache.length
    if pair_positions_W is not None:
      length = int(pair_positions_W.max()) + 1
    layers.check_length(length, cfg.max_len)
    h_BxWxD = self.embed(tokens_BxW)
    positions_BxW = None
    if valid_BxL is not None:  # counted from each row's first valid position
      valid_BxL = valid_BxL.astype(bool)
      positions_BxL = layers.counted_positions(valid_BxL)
      positions_BxW = jax.lax.dynamic_slice_in_dim(positions_BxL, start, width, axis=1)
    if cache is None and pair_positions_W is None:
      if positions_BxW is not None and cfg.block_size is not None:
        visible_WxW = visible(cfg, positions_BxW, positions_BxW)  # blocks per row
      else:
        visible_WxW = visible(cfg, np.arange(width), np.arange(width))
    if pair_positions_W is not None:
      positions_BxW = jnp.asarray(pair_positions_W)
    if cfg.positions == "sinusoidal":
      table_WxD = sinusoidal(length, cfg.d_model)
      if positions_BxW is not None:
        # (B x W, or W for the block pair: both broadcast against B x W x D)
        h_BxWxD = h_BxWxD + table_WxD[positions_BxW].astype(h_BxWxD.dtype)
      else:
        if cache is not None:
          table_WxD = jax.lax.dynamic_slice_in_dim(table_WxD, start, width)
        h_BxWxD = h_BxWxD + table_WxD.astype(h_BxWxD.dtype)[None]
    temb_BxD = None
    if cfg.time_conditioning:
      temb_BxD = jax.nn.silu(self.time_mlp(_time_features(t_B, cfg.d_model)))
    fresh = []
    for n, block in enumerate(self.blocks):
      if cfg.remat and cache is None:
        h_BxWxD, layer = _remat_block(block, h_BxWxD, temb_BxD, positions_BxW, valid_BxL,
                                      visible_WxW)
      else:
        h_BxWxD, layer = block(h_BxWxD, temb_BxD, start,
                               None if cache is None else cache.layer(n), positions_BxW,
                               valid_BxL, visible_WxW)
      fresh.append(layer)
    if logits_for is not None:
      h_BxWxD = h_BxWxD[:, :logits_for]
    return self.head(self.final_norm(h_BxWxD)).astype(jnp.float32), fresh


@nnx.remat
def _remat_block(block: Block, h_BxWxD: Array, temb_BxD: Array | None,
                 positions_BxW: Array | None, valid_BxL: Array | None,
                 visible_WxW: Array | None) -> tuple[Array, LayerKV]:
  """A full (uncached) pass of `block` under jax.checkpoint: only its input is kept for
  the backward pass, which recomputes the rest."""
  return block(h_BxWxD, temb_BxD, 0, None, positions_BxW, valid_BxL, visible_WxW)


def _time_features(t_B: Array, dim: int) -> Array:
  """Sinusoidal features of t in [0, 1] (scaled to a 1000-step clock)."""
  half = dim // 2
  freq = jnp.exp(-math.log(10_000.0) * jnp.arange(half) / half)
  angle = 1000.0 * t_B[:, None] * freq[None]
  feats = jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], -1)
  return jnp.pad(feats, ((0, 0), (0, dim - feats.shape[-1])))


def make_apply_fn(graphdef, block_size: int | None = None) -> Denoiser:
  """The denoiser of a split model, as a `Denoiser`: `apply_fn(params, tokens_BxL, t_B)`,
  with the cached contract (`prefill`, `decode`; see the module docstring). A block-causal
  model (its config's `block_size`, passed here) also has `block_pair` and `block_size`;
  others have `block_size = None` and no `block_pair`."""

  def apply(params, tokens_BxL, t_B, valid_BxL=None):
    return nnx.merge(graphdef, params)(tokens_BxL, t_B, valid_BxL)

  def prefill(params, tokens_BxL, t_B, valid_BxL=None):
    return nnx.merge(graphdef, params).prefill(tokens_BxL, t_B, valid_BxL)

  def decode(params, cache, tokens_BxW, start, t_B, valid_BxL=None):
    return nnx.merge(graphdef, params).decode(cache, tokens_BxW, start, t_B, valid_BxL)

  def block_pair(params, noisy_BxL, clean_BxL, t_B):
    return nnx.merge(graphdef, params).block_pair(noisy_BxL, clean_BxL, t_B)

  return Denoiser(apply=apply, prefill=prefill, decode=decode, block_size=block_size,
                  block_pair=None if block_size is None else block_pair)


def init(cfg: TransformerConfig, seed: int = 0):
  """Builds the model and returns (graphdef, params, apply_fn): apply_fn is its `Denoiser`."""
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  graphdef, params = nnx.split(model, nnx.Param)
  return graphdef, params, make_apply_fn(graphdef, cfg.block_size)


def count_params(params) -> int:
  return int(sum(x.size for x in jax.tree.leaves(params)))
