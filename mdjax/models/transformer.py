"""A bidirectional Transformer denoiser (Flax NNX), or a causal reference model.

Build with `Transformer(TransformerConfig(...), rngs=nnx.Rngs(0))`; compiled
code uses the functional form `make_apply_fn(graphdef)` on `nnx.split` params,
which meets the denoiser contract apply_fn(params, tokens_BxL, t_B) -> logits_BxLxV.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

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
  dtype: str = "float32"  # compute dtype; parameters stay float32

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


def sinusoidal(length: int, dim: int) -> Array:
  """Fixed sinusoidal position table (L x D)."""
  pos = jnp.arange(length)[:, None]
  freq = jnp.exp(-math.log(10_000.0) * jnp.arange(0, dim, 2) / dim)
  angle = pos * freq[None]
  return jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], -1)[:, :dim]


def rope(x_BxLxHxK: Array) -> Array:
  """Rotary position embedding on the head dimension."""
  length, half = x_BxLxHxK.shape[1], x_BxLxHxK.shape[-1] // 2
  freq = jnp.exp(-math.log(10_000.0) * jnp.arange(half) / half)
  angle = jnp.arange(length)[:, None] * freq[None]  # L x K/2
  cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
  x1, x2 = x_BxLxHxK[..., :half], x_BxLxHxK[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x_BxLxHxK.dtype)


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

  def __call__(self, h_BxLxD: Array, temb_BxD: Array | None) -> Array:
    cfg = self.cfg
    batch, length, d = h_BxLxD.shape
    heads, head_dim = cfg.num_heads, d // cfg.num_heads
    if cfg.time_conditioning:
      mods = jnp.split(self.ada(temb_BxD)[:, None], 6, axis=-1)
    else:
      mods = [0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    shift1, scale1, gate1, shift2, scale2, gate2 = mods
    if cfg.time_conditioning:
      gate1, gate2 = 1.0 + gate1, 1.0 + gate2
    x = self.norm1(h_BxLxD) * (1.0 + scale1) + shift1
    q, k, v = jnp.split(self.qkv(x).reshape(batch, length, 3 * heads, head_dim), 3, axis=2)
    if cfg.positions == "rope":
      q, k = rope(q), rope(k)
    logits_BxHxLxL = jnp.einsum("blhk,bmhk->bhlm", q, k) / math.sqrt(head_dim)
    if cfg.causal:
      causal_LxL = jnp.tril(jnp.ones((length, length), bool))
      logits_BxHxLxL = jnp.where(causal_LxL, logits_BxHxLxL, -1e30)
    attn = jax.nn.softmax(logits_BxHxLxL.astype(jnp.float32), -1).astype(v.dtype)
    out = jnp.einsum("bhlm,bmhk->blhk", attn, v).reshape(batch, length, d)
    h_BxLxD = h_BxLxD + gate1 * self.proj(out)
    x = self.norm2(h_BxLxD) * (1.0 + scale2) + shift2
    y = self.mlp_in(x)
    if cfg.mlp == "swiglu":
      a, b = jnp.split(y, 2, axis=-1)
      y = jax.nn.silu(a) * b
    else:
      y = jax.nn.gelu(y)
    return h_BxLxD + gate2 * self.mlp_out(y)


class Transformer(nnx.Module):
  """tokens_BxL (ids 0..V, V = mask), t_B -> logits_BxLxV over the real vocabulary."""

  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dtype = jnp.dtype(cfg.dtype)
    self.embed = nnx.Embed(cfg.vocab_size + 1, cfg.d_model, dtype=dtype, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = _norm(cfg, rngs)
    self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dtype, rngs=rngs)
    if cfg.time_conditioning:
      self.time_mlp = nnx.Linear(cfg.d_model, cfg.d_model, dtype=dtype, rngs=rngs)

  def __call__(self, tokens_BxL: Array, t_B: Array) -> Array:
    cfg = self.cfg
    length = tokens_BxL.shape[1]
    if length > cfg.max_len:
      raise ValueError(f"sequence length {length} exceeds max_len={cfg.max_len}.")
    h_BxLxD = self.embed(tokens_BxL)
    if cfg.positions == "sinusoidal":
      h_BxLxD = h_BxLxD + sinusoidal(length, cfg.d_model).astype(h_BxLxD.dtype)[None]
    temb_BxD = None
    if cfg.time_conditioning:
      temb_BxD = jax.nn.silu(self.time_mlp(_time_features(t_B, cfg.d_model)))
    for block in self.blocks:
      h_BxLxD = block(h_BxLxD, temb_BxD)
    return self.head(self.final_norm(h_BxLxD)).astype(jnp.float32)


def _time_features(t_B: Array, dim: int) -> Array:
  """Sinusoidal features of t in [0, 1] (scaled to a 1000-step clock)."""
  half = dim // 2
  freq = jnp.exp(-math.log(10_000.0) * jnp.arange(half) / half)
  angle = 1000.0 * t_B[:, None] * freq[None]
  feats = jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], -1)
  return jnp.pad(feats, ((0, 0), (0, dim - feats.shape[-1])))


def make_apply_fn(graphdef):
  """The denoiser contract for a split model: apply_fn(params, tokens_BxL, t_B)."""

  def apply_fn(params, tokens_BxL, t_B):
    return nnx.merge(graphdef, params)(tokens_BxL, t_B)

  return apply_fn


def init(cfg: TransformerConfig, seed: int = 0):
  """Builds the model and returns (graphdef, params, apply_fn)."""
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  graphdef, params = nnx.split(model, nnx.Param)
  return graphdef, params, make_apply_fn(graphdef)


def count_params(params) -> int:
  return int(sum(x.size for x in jax.tree.leaves(params)))
