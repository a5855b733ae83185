"""The published diffusion LMs' Transformer, in JAX: LLaDA (Llama-style), Dream (Qwen2),
SDAR (Qwen3: qk-norm), Fast-dLLM v2 (Qwen2.5) and LLaDA2 (Ling's mixture of experts).

Bidirectional attention (no causal mask), RMSNorm (weight only), SwiGLU, half-split RoPE,
grouped KV heads, optional q/k/v biases, untied output head, and Dream's one-position logit
shift. `block_size` makes attention block-causal (SDAR, Fast-dLLM v2, LLaDA2: a query sees
its own block and the blocks before), which makes the cache of finished blocks exact;
`anneal=(fraction, key)` (forward, prefill, block_pair) narrows a diffusion network's own
pattern towards causal attention, DiffuLLaMA's attention-mask annealing for a network
converted from a causal LM (`layers.anneal_visible`);
`qk_norm` normalises each query and key head before RoPE, `rotary_dim` turns only the first
dims of each head, and `moe` replaces the MLP of the layers from `moe.first_dense_layers` on
by routed and shared experts (`mdjax.models.moe`). With `causal=True` the same network is
Hugging Face's LlamaForCausalLM /
Qwen2ForCausalLM (families "llama", "qwen2": the judges of generative perplexity): each query
attends to the keys at its own position and before, no mask id, no shift (and Llama 3.1's
RoPE frequencies where the checkpoint has them). Pure functions over a params pytree whose
layers are stacked (one `lax.scan` over layers keeps compile time flat in depth):

  params = {
    "embed": [V_embed, D],
    "layers": {                      # every leaf has a leading [num dense layers] axis
      "attn_norm": [N, D], "q": [N, D, H*K], "k": [N, D, G*K], "v": [N, D, G*K],
      "q_bias": [N, H*K], "k_bias": [N, G*K], "v_bias": [N, G*K],   # only with qkv_bias
      "q_norm": [N, K], "k_norm": [N, K],                            # only with qk_norm
      "o": [N, H*K, D], "mlp_norm": [N, D],
      "gate": [N, D, F], "up": [N, D, F], "down": [N, F, D],
    },
    "moe_layers": {...},             # only with moe: the attention leaves above and
                                     # `moe.param_shapes`'s instead of gate/up/down
    "final_norm": [D],
    "head": [D, V_embed],
  }

(H heads, G key/value heads, K = head_dim, F = mlp_hidden; matrices are [in, out], the
transpose of torch's Linear weight.)

Entry points: `forward` (logits), `block_pair` (a block-causal network's training pass over
[noisy; clean]), `prefill` and `decode` (the cached contract of
`mdjax.denoiser`: a full pass that returns every layer's keys and values, and a pass over a
window of W positions against them), `denoiser(config)` (the `Denoiser` value the samplers
take; these models are time-free, so t_B is ignored), `init_params` and `num_params`.

Padding (`valid_BxL`, False on padding): padded keys are attended by nothing; padded queries
still attend to the real keys (finite, unused outputs). Positions for RoPE: LLaDA's (and the
causal families') are always 0..L-1 (their modeling code ignores padding there, so a causal
model's padding goes on the right); Dream's are counted from each row's
first real token, cumsum(valid) - 1, with padded positions set to 1 as Dream's generation
code does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.denoiser import Denoiser
from mdjax.models import checks, layers, moe as moe_layer
from mdjax.models.moe import MoEConfig

Array = jax.Array

FAMILIES = ("llada", "dream", "llama", "qwen2", "sdar", "fast_dllm_v2", "llada2")
CAUSAL_FAMILIES = ("llama", "qwen2")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublishedConfig:
  """The architecture of a published checkpoint (frozen: a static argument under jit).

  vocab_size: rows of the embedding and columns of the head (the checkpoint's own ids;
    LLaDA's `embedding_size`). mask_id lies inside it; its logit is -inf.
  logit_shift: Dream's prediction for position i is the network's output at i - 1.
  causal: attention to the query's own position and before only (the causal families;
    mask_id None: a causal LM has none, and its logits at i predict the token at i + 1).
  rope_scaling: Llama 3.1's RoPE frequencies, (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings); None: unscaled.
  dtype: the weights' and activations' dtype; norms, softmax and logits are float32.
  qk_norm: a per-head RMSNorm of queries and keys before RoPE (Qwen3's, SDAR's, LLaDA2's).
  rotary_dim: RoPE turns the first rotary_dim dims of each head only (LLaDA2's
    partial_rotary_factor); None: the whole head.
  block_size: block-causal attention (SDAR, Fast-dLLM v2, LLaDA2): a query sees the keys of
    its own block and the blocks before, blocks counted from each row's first real token.
  moe: the mixture of experts of the layers from `moe.first_dense_layers` on (LLaDA2);
    None: every MLP is dense.
  """

  family: str
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_hidden: int
  rope_theta: float
  norm_eps: float
  qkv_bias: bool
  logit_shift: bool
  mask_id: int | None
  eos_id: int | None = None
  eot_id: int | None = None  # LLaDA's end-of-turn id (None: none)
  max_len: int = 4096
  dtype: str = "float32"
  causal: bool = False
  rope_scaling: tuple[float, float, float, int] | None = None
  qk_norm: bool = False
  rotary_dim: int | None = None
  block_size: int | None = None
  moe: MoEConfig | None = None

  def __post_init__(self):
    checks.check_common(self, FAMILIES, DTYPES,
                        counts=("vocab_size", "d_model", "num_layers", "num_heads",
                                "num_kv_heads", "head_dim", "mlp_hidden", "max_len"),
                        positive=("rope_theta", "norm_eps"))
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads="
                       f"{self.num_kv_heads} (each key/value head serves a group of query "
                       "heads).")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs of halves).")
    if not isinstance(self.causal, bool) or self.causal != (self.family in CAUSAL_FAMILIES):
      raise ValueError(f"causal={self.causal!r} must be {self.family in CAUSAL_FAMILIES} for "
                       f"family={self.family!r} (causal families: {CAUSAL_FAMILIES}).")
    if self.rope_scaling is not None and not (
        isinstance(self.rope_scaling, tuple) and len(self.rope_scaling) == 4
        and all(checks.is_number(v) and v > 0 for v in self.rope_scaling)
        and self.rope_scaling[2] > self.rope_scaling[1]):
      raise ValueError(f"rope_scaling={self.rope_scaling!r} must be None or (factor, "
                       "low_freq_factor, high_freq_factor, original_max_position_embeddings), "
                       "all > 0, high_freq_factor > low_freq_factor.")
    for name in ("qk_norm",):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}={getattr(self, name)!r} must be True or False.")
    if self.rotary_dim is not None and not (
        checks.is_int(self.rotary_dim) and 2 <= self.rotary_dim <= self.head_dim
        and self.rotary_dim % 2 == 0):
      raise ValueError(f"rotary_dim={self.rotary_dim!r} must be None or an even integer in "
                       f"[2, head_dim={self.head_dim}].")
    if self.block_size is not None:
      checks.check_count("block_size", self.block_size)
      if self.causal:
        raise ValueError(f"block_size={self.block_size} with causal=True: a causal judge has "
                         "one attention pattern.")
    if self.moe is not None:
      if not isinstance(self.moe, MoEConfig):
        raise ValueError(f"moe={self.moe!r} must be None or a MoEConfig.")
      if self.moe.first_dense_layers > self.num_layers:
        raise ValueError(f"moe.first_dense_layers={self.moe.first_dense_layers} exceeds "
                         f"num_layers={self.num_layers}.")
    if self.causal and (self.mask_id is not None or self.logit_shift):
      raise ValueError(f"mask_id={self.mask_id!r}, logit_shift={self.logit_shift!r}: a causal "
                       "model has no mask id and no shift (None and False).")
    for name in ("mask_id", "eos_id", "eot_id"):
      value = getattr(self, name)
      if value is None and (name != "mask_id" or self.causal):
        continue
      if not (checks.is_int(value) and 0 <= value < self.vocab_size):
        raise ValueError(f"{name}={value!r} must be an id in [0, vocab_size={self.vocab_size}).")

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def counts_positions(self) -> bool:
    """Whether positions count from each row's first real token (Dream, the block-causal
    networks) rather than 0..L-1 whatever the padding."""
    return self.family == "dream" or self.block_size is not None

  @property
  def dense_layers(self) -> int:
    """Layers with a dense MLP (params["layers"]); the rest are MoE layers."""
    return self.num_layers if self.moe is None else self.moe.first_dense_layers


@struct.dataclass
class PublishedCache:
  """Every layer's keys (after RoPE) and values, stacked over layers and stored for the G
  key/value heads only (grouped heads are not repeated), heads-major so a window's queries
  read them with one batched matmul per group. `tokens_BxL` is the canvas they were computed
  from: Dream's shifted window needs the token just before the window."""

  keys_NxBxGxLxK: Array
  values_NxBxGxLxK: Array
  tokens_BxL: Array

  @property
  def length(self) -> int:
    return self.keys_NxBxGxLxK.shape[3]


# --- building blocks -------------------------------------------------------------------


def _rms_norm(x_BxLxD: Array, weight_D: Array, eps: float) -> Array:
  """HF's LlamaRMSNorm: normalized in float32, cast back, then scaled by the weight."""
  x = x_BxLxD.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return weight_D * x.astype(x_BxLxD.dtype)


def _matmul(x: Array, w: Array) -> Array:
  """x @ w in the weights' dtype (accumulated in float32 by the backend)."""
  return jnp.einsum("...i,io->...o", x, w.astype(x.dtype))


def positions(config: PublishedConfig, valid_BxL: Array | None, length: int) -> Array:
  """Each position's RoPE position, B x L (1 x L without padding). Dream counts from each
  row's first real token and puts padding at 1, the block-causal networks count the same
  way with padding at 0; the others always count 0..L-1."""
  if valid_BxL is None or not config.counts_positions:
    return jnp.arange(length, dtype=jnp.int32)[None]
  return layers.counted_positions(valid_BxL, padding=1 if config.family == "dream" else None)


def _rope_cos_sin(config: PublishedConfig, positions_BxQ: Array) -> tuple[Array, Array]:
  """cos and sin of Llama's rotary angles, B x Q x K, in float32 (Llama 3.1's frequencies
  with `rope_scaling`)."""
  inv_freq_K2 = layers.inverse_frequencies(config.rotary_dim or config.head_dim,
                                           config.rope_theta)
  if config.rope_scaling is not None:
    inv_freq_K2 = layers.llama3_inverse_frequencies(inv_freq_K2, *config.rope_scaling)
  return layers.rotary_cos_sin(positions_BxQ, inv_freq_K2, full_width=True)


def _rope(x_BxQxHxK: Array, cos_BxQxC: Array, sin_BxQxC: Array) -> Array:
  """x * cos + rotate_half(x) * sin (Llama's half-split rotation), in float32 as LLaDA's
  code does it (HF Llama rotates in the compute dtype: the same up to bfloat16 rounding),
  cast back. Tables narrower than the head (C < K: partial rotary) turn its first C dims
  and pass the rest."""
  rotary = cos_BxQxC.shape[-1]
  if rotary == x_BxQxHxK.shape[-1]:
    return layers.rotate(x_BxQxHxK, cos_BxQxC, sin_BxQxC, form="rotate_half", float32=True)
  turned = layers.rotate(x_BxQxHxK[..., :rotary], cos_BxQxC, sin_BxQxC, form="rotate_half",
                         float32=True)
  return jnp.concatenate([turned, x_BxQxHxK[..., rotary:]], axis=-1)


def _qkv(config: PublishedConfig, layer: dict, x_BxQxD: Array, cos_BxQxK: Array,
         sin_BxQxK: Array) -> tuple[Array, Array, Array]:
  """Queries B x Q x G x R x K (R = H / G query heads per key/value head, HF's repeat_kv
  order: query head h reads key/value head h // R), keys and values B x G x Q x K."""
  batch, width, _ = x_BxQxD.shape
  heads, groups, k = config.num_heads, config.num_kv_heads, config.head_dim
  q, kk, v = (_matmul(x_BxQxD, layer[name]) for name in ("q", "k", "v"))
  if config.qkv_bias:
    q = q + layer["q_bias"].astype(q.dtype)
    kk = kk + layer["k_bias"].astype(kk.dtype)
    v = v + layer["v_bias"].astype(v.dtype)
  q_BxQxHxK, k_BxQxGxK = q.reshape(batch, width, heads, k), kk.reshape(batch, width, groups, k)
  if config.qk_norm:  # per head, before RoPE
    q_BxQxHxK = _rms_norm(q_BxQxHxK, layer["q_norm"], config.norm_eps)
    k_BxQxGxK = _rms_norm(k_BxQxGxK, layer["k_norm"], config.norm_eps)
  q_BxQxHxK = _rope(q_BxQxHxK, cos_BxQxK, sin_BxQxK)
  k_BxQxGxK = _rope(k_BxQxGxK, cos_BxQxK, sin_BxQxK)
  v_BxQxGxK = v.reshape(batch, width, groups, k)
  q_BxQxGxRxK = q_BxQxHxK.reshape(batch, width, groups, heads // groups, k)
  return q_BxQxGxRxK, k_BxQxGxK.transpose(0, 2, 1, 3), v_BxQxGxK.transpose(0, 2, 1, 3)


def _attend(q_BxQxGxRxK: Array, parts: list[tuple[Array, Array, Array]]) -> Array:
  """Attention of the grouped queries over key parts, each (keys_BxGxSxK, values_BxGxSxK,
  visible_BxQxS or B x 1 x S), under one float32 softmax (`layers.attend`: scores times
  1/sqrt(K), values weighted in the compute dtype). Returns B x Q x H*K."""
  return layers.attend(q_BxQxGxRxK, parts, scale_by_reciprocal=True, float32_values=False)


def _mlp_and_residuals(config: PublishedConfig, layer: dict, h_BxQxD: Array,
                       attn_BxQxHK: Array, routed: bool) -> Array:
  """The attention output's projection and residual, then the MLP (the SwiGLU, or the
  experts of a `routed` layer) and its residual."""
  h_BxQxD = h_BxQxD + _matmul(attn_BxQxHK, layer["o"])
  x = _rms_norm(h_BxQxD, layer["mlp_norm"], config.norm_eps)
  if routed:
    return h_BxQxD + moe_layer.mlp(config.moe, layer, x)
  y = jax.nn.silu(_matmul(x, layer["gate"])) * _matmul(x, layer["up"])
  return h_BxQxD + _matmul(y, layer["down"])


def _over_layers(config: PublishedConfig, params: dict, h_BxQxD: Array, layer_fn,
                 cached: tuple[Array, Array] | None = None):
  """`layer_fn(h, (layer, cached keys, cached values), routed) -> (h, (keys, values))` over
  the dense layers, then the MoE layers: one `lax.scan` per kind; the keys and values come
  back stacked over every layer (N x ...), in order."""
  dense = config.dense_layers
  stacks = [("layers", False, 0, dense)]
  if config.moe is not None and config.num_layers > dense:
    stacks.append(("moe_layers", True, dense, config.num_layers))
  keys, values = [], []
  for name, routed, first, last in stacks:
    xs = params[name], None, None
    if cached is not None:
      xs = params[name], cached[0][first:last], cached[1][first:last]
    h_BxQxD, (k, v) = jax.lax.scan(functools.partial(layer_fn, routed=routed), h_BxQxD, xs)
    keys.append(k)
    values.append(v)
  if len(stacks) == 1:
    return h_BxQxD, (keys[0], values[0])
  return h_BxQxD, (jnp.concatenate(keys), jnp.concatenate(values))


def _logits(config: PublishedConfig, params: dict, h_BxQxD: Array) -> Array:
  """Final norm and head: float32 logits with the mask id's at -inf (never a prediction)."""
  x = _rms_norm(h_BxQxD, params["final_norm"], config.norm_eps)
  logits_BxQxV = jnp.einsum("bqd,dv->bqv", x, params["head"].astype(x.dtype),
                            preferred_element_type=jnp.float32)
  if config.mask_id is None:  # a causal model
    return logits_BxQxV
  return logits_BxQxV.at[..., config.mask_id].set(-jnp.inf)


def _embed(config: PublishedConfig, params: dict, tokens_BxQ: Array) -> Array:
  return jnp.take(params["embed"], tokens_BxQ, axis=0).astype(config.jnp_dtype)


# --- the passes --------------------------------------------------------------------------


def _full_pass(config: PublishedConfig, params: dict, tokens_BxL: Array,
               valid_BxL: Array | None, anneal=None) -> tuple[Array, Array, Array]:
  """Unshifted logits_BxLxV and every layer's keys and values (N x B x G x L x K)."""
  length = tokens_BxL.shape[1]
  layers.check_length(length, config.max_len)
  pos_BxL = positions(config, valid_BxL, length)
  visible_Bx1xL = (jnp.ones((1, 1, length), bool) if valid_BxL is None
                   else valid_BxL.astype(bool)[:, None, :])
  if config.causal:  # B x L x L: each query sees its own position and before
    visible_Bx1xL = visible_Bx1xL & layers.visible(np.arange(length), np.arange(length),
                                                   causal=True)[None]
  if config.block_size is not None:  # B x L x L: blocks counted in each row's positions
    visible_Bx1xL = visible_Bx1xL & layers.visible(pos_BxL, pos_BxL,
                                                   block_size=config.block_size)
  annealed_LxL = layers.anneal_visible(anneal, length)
  if annealed_LxL is not None:  # B x L x L: later keys only where the draw shows them
    visible_Bx1xL = visible_Bx1xL & annealed_LxL[None]
  h_BxLxD, keys, values = _hidden(config, params, tokens_BxL, pos_BxL, visible_Bx1xL)
  return _logits(config, params, h_BxLxD), keys, values


def _hidden(config: PublishedConfig, params: dict, tokens_BxL: Array, pos_BxL: Array,
            visible_BxLxL: Array) -> tuple[Array, Array, Array]:
  """The last layer's hidden states of a full pass at RoPE positions `pos_BxL` where each
  query sees the keys `visible_BxLxL` allows (B and the query axis may be 1), and every
  layer's keys and values."""
  cos_BxLxK, sin_BxLxK = _rope_cos_sin(config, pos_BxL)

  def layer_fn(h_BxLxD, xs, routed):
    layer = xs[0]
    x = _rms_norm(h_BxLxD, layer["attn_norm"], config.norm_eps)
    q, k_BxGxLxK, v_BxGxLxK = _qkv(config, layer, x, cos_BxLxK, sin_BxLxK)
    attn = _attend(q, [(k_BxGxLxK, v_BxGxLxK, visible_BxLxL)])
    return (_mlp_and_residuals(config, layer, h_BxLxD, attn, routed),
            (k_BxGxLxK, v_BxGxLxK))

  h_BxLxD, (keys, values) = _over_layers(config, params, _embed(config, params, tokens_BxL),
                                         layer_fn)
  return h_BxLxD, keys, values


def block_pair(config: PublishedConfig, params: dict, noisy_BxL: Array,
               clean_BxL: Array, anneal=None) -> Array:
  """The block-diffusion training pass of a block-causal network (`diffusion.
  block_nelbo_loss`): one pass over [noisy; clean] at positions [0..L-1; 0..L-1], where a
  noisy block sees itself and the clean blocks before it and a clean block sees the clean
  blocks up to its own (`layers.block_pair_mask`): each noisy block's logits are those the
  block-cached decoder computes with the clean blocks before it in the cache. With the shift
  (Fast-dLLM v2) a block's first position reads the clean previous block's last output, as
  the decoder's pass over the finished block predicts the next token. Returns the noisy
  positions' logits_BxLxV (rows start at position 0: no padding). `anneal` (`layers.anneal_visible`)
  narrows both halves alike: a key at a later position than the query's is seen only where
  the draw shows it, so at fraction 0 every query sees the causal prefix of its half's
  sequence (the noisy block's after the clean blocks before it)."""
  if config.block_size is None:
    raise ValueError("block_pair needs a block-causal network: config.block_size is None.")
  noisy_BxL, clean_BxL = jnp.asarray(noisy_BxL, jnp.int32), jnp.asarray(clean_BxL, jnp.int32)
  length = noisy_BxL.shape[1]
  layers.check_length(length, config.max_len)
  pos_1x2L = jnp.tile(jnp.arange(length, dtype=jnp.int32), 2)[None]
  visible_1x2Lx2L = jnp.asarray(layers.block_pair_mask(length, config.block_size))[None]
  annealed_LxL = layers.anneal_visible(anneal, length)
  if annealed_LxL is not None:  # the same draw over each half's positions
    visible_1x2Lx2L = visible_1x2Lx2L & jnp.tile(annealed_LxL, (2, 2))[None]
  h_Bx2LxD, _, _ = _hidden(config, params, jnp.concatenate([noisy_BxL, clean_BxL], 1),
                           pos_1x2L, visible_1x2Lx2L)
  noisy_BxLxD, clean_BxLxD = h_Bx2LxD[:, :length], h_Bx2LxD[:, length:]
  if config.logit_shift:
    first_L = (np.arange(length) % config.block_size == 0) & (np.arange(length) > 0)
    noisy_BxLxD = jnp.where(first_L[None, :, None], _shift(clean_BxLxD), _shift(noisy_BxLxD))
  return _logits(config, params, noisy_BxLxD)


def _shift(logits_BxLxV: Array) -> Array:
  """Dream's shift: the prediction for position i is the output at i - 1 (position 0 keeps
  its own)."""
  return jnp.concatenate([logits_BxLxV[:, :1], logits_BxLxV[:, :-1]], axis=1)


def forward(config: PublishedConfig, params: dict, tokens_BxL: Array,
            valid_BxL: Array | None = None, anneal=None) -> Array:
  """logits_BxLxV (float32) of the whole canvas; `valid_BxL` False on padding; `anneal`
  (fraction, key) narrows the attention towards causal (`layers.anneal_visible`)."""
  return prefill(config, params, tokens_BxL, valid_BxL, anneal=anneal)[0]


def prefill(config: PublishedConfig, params: dict, tokens_BxL: Array,
            valid_BxL: Array | None = None, anneal=None) -> tuple[Array, PublishedCache]:
  """One full pass: (logits_BxLxV, the cache of every layer's keys and values)."""
  tokens_BxL = jnp.asarray(tokens_BxL, jnp.int32)
  logits_BxLxV, keys, values = _full_pass(config, params, tokens_BxL, valid_BxL, anneal)
  if config.logit_shift:
    logits_BxLxV = _shift(logits_BxLxV)
  return logits_BxLxV, PublishedCache(keys_NxBxGxLxK=keys, values_NxBxGxLxK=values,
                                      tokens_BxL=tokens_BxL)


def decode(config: PublishedConfig, params: dict, cache: PublishedCache, tokens_BxW: Array,
           start, valid_BxL: Array | None = None) -> tuple[Array, PublishedCache]:
  """A pass over the W positions [start, start + W) (start may be traced) against `cache`:
  their queries attend to the cached keys and values outside the window and to their own
  fresh ones under one softmax. Returns (logits_BxWxV, the cache with the window's keys,
  values and tokens written in).

  With Dream's shift the prediction for window position start + j is the output at
  start + j - 1, so the pass also runs one extra query first, at start - 1 (its token read
  from the cache's canvas; its own key and value stay the cached ones): W + 1 queries, the
  first output kept for window position 0. At start = 0 position 0 predicts itself, and
  the extra query (then a copy of position 0) is dropped.
  """
  tokens_BxW = jnp.asarray(tokens_BxW, jnp.int32)
  batch, width = tokens_BxW.shape
  length = cache.length
  layers.check_window(width, length)
  layers.check_length(length, config.max_len)
  start = jnp.asarray(start, jnp.int32)
  pos_BxL = jnp.broadcast_to(positions(config, valid_BxL, length), (batch, length))
  pos_BxW = jax.lax.dynamic_slice_in_dim(pos_BxL, start, width, axis=1)
  key_L = jnp.arange(length)
  outside_1x1xL = layers.outside_window(key_L, start, width)[None, None]
  own_Bx1xW = jnp.ones((batch, 1, width), bool)
  if valid_BxL is not None:  # padding is attended by nothing
    valid_BxL = valid_BxL.astype(bool)
    outside_1x1xL = outside_1x1xL & valid_BxL[:, None, :]
    own_Bx1xW = jax.lax.dynamic_slice_in_dim(valid_BxL, start, width, axis=1)[:, None]
  if config.causal:  # keys after the window are the future; inside it, the query's past
    outside_1x1xL = outside_1x1xL & (key_L < start)[None, None]
    own_Bx1xW = own_Bx1xW & layers.visible(np.arange(width), np.arange(width),
                                           causal=True)[None]
  tokens_BxQ, pos_BxQ, extra = tokens_BxW, pos_BxW, 0
  if config.logit_shift:
    before = jnp.maximum(start - 1, 0)
    tokens_BxQ = jnp.concatenate(
        [jax.lax.dynamic_slice_in_dim(cache.tokens_BxL, before, 1, axis=1), tokens_BxW], axis=1)
    pos_BxQ = jnp.concatenate(
        [jax.lax.dynamic_slice_in_dim(pos_BxL, before, 1, axis=1), pos_BxW], axis=1)
    extra = 1
  if config.block_size is not None:  # B x Q x L and B x Q x W: the queries' blocks and before
    outside_1x1xL = outside_1x1xL & layers.visible(pos_BxQ, pos_BxL,
                                                   block_size=config.block_size)
    own_Bx1xW = own_Bx1xW & layers.visible(pos_BxQ, pos_BxW, block_size=config.block_size)
  cos_BxQxK, sin_BxQxK = _rope_cos_sin(config, pos_BxQ)

  def layer_fn(h_BxQxD, xs, routed):
    layer, cached_keys_BxGxLxK, cached_values_BxGxLxK = xs
    x = _rms_norm(h_BxQxD, layer["attn_norm"], config.norm_eps)
    q, k_BxGxQxK, v_BxGxQxK = _qkv(config, layer, x, cos_BxQxK, sin_BxQxK)
    k_BxGxWxK, v_BxGxWxK = k_BxGxQxK[:, :, extra:], v_BxGxQxK[:, :, extra:]
    attn = _attend(q, [(cached_keys_BxGxLxK, cached_values_BxGxLxK, outside_1x1xL),
                       (k_BxGxWxK, v_BxGxWxK, own_Bx1xW)])
    return (_mlp_and_residuals(config, layer, h_BxQxD, attn, routed),
            (k_BxGxWxK, v_BxGxWxK))

  h_BxQxD, (keys_NxBxGxWxK, values_NxBxGxWxK) = _over_layers(
      config, params, _embed(config, params, tokens_BxQ), layer_fn,
      cached=(cache.keys_NxBxGxLxK, cache.values_NxBxGxLxK))
  if config.logit_shift:  # window position j reads the output at query j (position start+j-1)
    first_Bx1xD = jnp.where(start > 0, h_BxQxD[:, :1], h_BxQxD[:, 1:2])
    h_BxQxD = jnp.concatenate([first_Bx1xD, h_BxQxD[:, 1:width]], axis=1)
  logits_BxWxV = _logits(config, params, h_BxQxD)
  return logits_BxWxV, PublishedCache(
      keys_NxBxGxLxK=layers.write_window(cache.keys_NxBxGxLxK, keys_NxBxGxWxK, start),
      values_NxBxGxLxK=layers.write_window(cache.values_NxBxGxLxK, values_NxBxGxWxK, start),
      tokens_BxL=jax.lax.dynamic_update_slice_in_dim(cache.tokens_BxL, tokens_BxW, start,
                                                     axis=1))


# --- the Denoiser -------------------------------------------------------------------------


def _apply(config, params, tokens_BxL, t_B, valid_BxL=None):
  del t_B  # time-free
  return forward(config, params, tokens_BxL, valid_BxL)


def _prefill(config, params, tokens_BxL, t_B, valid_BxL=None):
  del t_B
  return prefill(config, params, tokens_BxL, valid_BxL)


def _decode(config, params, cache, tokens_BxW, start, t_B, valid_BxL=None):
  del t_B
  return decode(config, params, cache, tokens_BxW, start, valid_BxL)


def _block_pair(config, params, noisy_BxL, clean_BxL, t_B):
  del t_B
  return block_pair(config, params, noisy_BxL, clean_BxL)


def denoiser(config: PublishedConfig) -> Denoiser:
  """The model as a `Denoiser` (t_B ignored): apply, prefill and decode, and the block size
  and training pass (`block_pair`) of a block-causal network. Its functions are `layers.Bound`: equal for equal configs, so
  equal Denoisers share programs."""
  blocks = config.block_size is not None
  return Denoiser(apply=layers.bind(_apply, config), prefill=layers.bind(_prefill, config),
                  decode=layers.bind(_decode, config), block_size=config.block_size,
                  block_pair=layers.bind(_block_pair, config) if blocks else None)


# --- parameters ---------------------------------------------------------------------------


def param_shapes(config: PublishedConfig) -> dict:
  """The params pytree's shapes (the module docstring's layout)."""
  d, v, f = config.d_model, config.vocab_size, config.mlp_hidden
  hk, gk = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim

  def attention(n):
    shapes = {"attn_norm": (n, d), "q": (n, d, hk), "k": (n, d, gk), "v": (n, d, gk),
              "o": (n, hk, d), "mlp_norm": (n, d)}
    if config.qkv_bias:
      shapes.update(q_bias=(n, hk), k_bias=(n, gk), v_bias=(n, gk))
    if config.qk_norm:
      shapes.update(q_norm=(n, config.head_dim), k_norm=(n, config.head_dim))
    return shapes

  dense = config.dense_layers
  out = {"embed": (v, d),
         "layers": {**attention(dense), "gate": (dense, d, f), "up": (dense, d, f),
                    "down": (dense, f, d)},
         "final_norm": (d,), "head": (d, v)}
  if config.moe is not None and config.num_layers > dense:
    routed = config.num_layers - dense
    out["moe_layers"] = {**attention(routed),
                         **moe_layer.param_shapes(config.moe, d, routed)}
  return out


def init_params(config: PublishedConfig, key: Array) -> dict:
  """Random params in the config's dtype (normal 0.02 matrices, unit norm weights, zero
  biases): for tests and benchmarks."""
  shapes = param_shapes(config)
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
      shapes, is_leaf=lambda x: isinstance(x, tuple))[0]]
  keys = jax.random.split(key, len(leaves))
  dtype = config.jnp_dtype

  def one(path, shape, k):
    if "norm" in path:
      return jnp.ones(shape, dtype)
    if "bias" in path:
      return jnp.zeros(shape, dtype)
    return (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

  return jax.tree.unflatten(treedef, [one(p, s, k) for p, s, k in zip(paths, leaves, keys)])


def num_params(config: PublishedConfig) -> int:
  """The number of parameters (embedding and head counted apart: they are untied)."""
  shapes = jax.tree.leaves(param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
  return int(sum(np.prod(s) for s in shapes))
