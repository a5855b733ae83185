"""The Gemma 4 blocks DiffusionGemma is built of (google-deepmind/gemma,
`gemma/gm/nn/gemma4/_modules.py`, `_layers.py`, `_moe.py`,
`gemma/gm/math/_positional_embeddings.py`),
as pure functions over one layer's params dict (the leaves of `diffusion_gemma.param_shapes`
without the leading layer axis; gemma's einsum layouts kept as they are).

RMSNorm: x * rsqrt(mean(x^2) + 1e-6), times the scale itself (not 1 + scale), in x's dtype.
RoPE: half-split rotation; pair (i, i + K/2) turns at base^(-2i/K) for i < int(proportion *
K // 2) and stays put beyond (the global layers' proportion 0.25). Attention: queries and
keys RMS-normed per head (with scale), values RMS-normed without one, keys and queries
turned, scores q.k unscaled, grouped key/value heads (query head h reads h // (H / G)); a
global layer may take its values from the key projection (k_eq_v). The block: pre-norm,
attention, post-norm, residual; then the dense shared MLP (gelu-tanh gated) beside the mixture
of experts (router on the un-normed residual: RMS-normed without scale, times D^-1/2 and
router_scale; softmax over every expert, the top k kept and renormalised; each expert a
gelu-tanh gated MLP times its per_expert_scale; `jax.lax.ragged_dot` over the assignments
sorted by expert), each post-normed, summed, post-normed, residual; the sum times skip_scale.

Softmax and the router run in float32; the rest in the activations' dtype (gemma runs its
softmax in the activations' dtype: the same in float32, a rounding apart in bfloat16).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.models import moe

Array = jax.Array

NORM_EPS = 1e-6  # gemma's RMSNorm epsilon
MASKED = -2.3819763e38  # gemma's K_MASK: a score no key is seen with


def rms_norm(x: Array, scale: Array | None = None) -> Array:
  """gemma's RMSNorm over the last axis (scale None: `with_scale=False`)."""
  normed = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + NORM_EPS)
  return normed if scale is None else normed * scale.astype(x.dtype)


def rope(x_BxQxHxK: Array, pos_BxQ: Array, base: float, proportion: float) -> Array:
  """gemma's `apply_rope`: the first int(proportion * K // 2) of the K/2 half-split pairs
  turned at base^(-2i/K), the others left as they are."""
  head_dim = x_BxQxHxK.shape[-1]
  turned = int(proportion * head_dim // 2)
  exponents = (2.0 / head_dim) * jnp.arange(turned, dtype=jnp.float32)
  timescale = jnp.pad(base ** exponents, (0, head_dim // 2 - turned), constant_values=jnp.inf)
  angle_BxQx1xC = (pos_BxQ[..., None] / timescale)[..., None, :]
  sin, cos = jnp.sin(angle_BxQx1xC), jnp.cos(angle_BxQx1xC)
  first, second = jnp.split(x_BxQxHxK, 2, axis=-1)
  out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  return out.astype(x_BxQxHxK.dtype)


def gated_mlp(x: Array, gating_2xFxD: Array, linear_FxD: Array) -> Array:
  """gemma's FeedForward: gelu_tanh(x W0^T) * (x W1^T), then the linear projection."""
  gate = jnp.einsum("...d,nfd->...nf", x, gating_2xFxD.astype(x.dtype))
  return jnp.einsum("...f,fd->...d", jax.nn.gelu(gate[..., 0, :]) * gate[..., 1, :],
                    linear_FxD.astype(x.dtype))


def projections(layer: dict, x_BxQxD: Array, pos_BxQ: Array, base: float, proportion: float,
                k_eq_v: bool) -> tuple[Array, Array, Array]:
  """Queries B x Q x H x K, keys and values B x G x Q x K (normed; queries and keys
  turned)."""
  q = jnp.einsum("btd,ndh->btnh", x_BxQxD, layer["q"].astype(x_BxQxD.dtype))
  q = rope(rms_norm(q, layer["q_norm"]), pos_BxQ, base, proportion)
  if k_eq_v:
    k = v = jnp.einsum("bsd,kdh->bskh", x_BxQxD, layer["k"].astype(x_BxQxD.dtype))
  else:
    k, v = jnp.einsum("bsd,ckdh->cbskh", x_BxQxD, layer["kv"].astype(x_BxQxD.dtype))
  k = rope(rms_norm(k, layer["k_norm"]), pos_BxQ, base, proportion)
  v = rms_norm(v)
  return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def attend(q_BxQxHxK: Array, parts: list[tuple[Array, Array, Array]]) -> Array:
  """Unscaled attention of the queries over key parts, each (keys_BxGxSxK, values_BxGxSxK,
  visible_BxQxS), under one float32 softmax. Returns B x Q x H x K."""
  batch, width, heads, k = q_BxQxHxK.shape
  groups = parts[0][0].shape[1]
  q = q_BxQxHxK.reshape(batch, width, groups, heads // groups, k)
  scores = []
  for keys, _, visible_BxQxS in parts:
    s = jnp.einsum("bqgrk,bgsk->bgrqs", q, keys.astype(q.dtype),
                   preferred_element_type=jnp.float32)
    scores.append(jnp.where(visible_BxQxS[:, None, None], s, MASKED))
  splits = np.cumsum([s.shape[-1] for s in scores])[:-1]
  probs = jnp.split(jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1), splits, axis=-1)
  out = sum(jnp.einsum("bgrqs,bgsk->bqgrk", p.astype(q.dtype), values.astype(q.dtype))
            for p, (_, values, _) in zip(probs, parts))
  return out.reshape(batch, width, heads, k)


def route(layer: dict, h_TxD: Array, experts_per_token: int) -> tuple[Array, Array]:
  """gemma's MoERagged router on the un-normed residual: (chosen experts T x k, their
  weights T x k float32: the softmax over every expert renormalised over the chosen)."""
  d = h_TxD.shape[-1]
  x = rms_norm(h_TxD) * jax.lax.rsqrt(jnp.array(d, h_TxD.dtype))
  x = x * layer["router_scale"].astype(x.dtype)
  logits_TxE = jnp.einsum("td,de->te", x, layer["router"].astype(x.dtype)).astype(jnp.float32)
  probs_TxE = jax.nn.softmax(logits_TxE, axis=-1)
  _, experts_Txk = jax.lax.approx_max_k(logits_TxE, k=experts_per_token)
  chosen_Txk = jnp.take_along_axis(probs_TxE, experts_Txk, axis=-1)
  total_Tx1 = chosen_Txk.sum(-1, keepdims=True)
  return experts_Txk, chosen_Txk / jnp.where(total_Tx1 > 0, total_Tx1, 1.0)


def experts(layer: dict, x_TxD: Array, experts_Txk: Array, weights_Txk: Array) -> Array:
  """The chosen experts' weighted outputs, T x D: the T * k assignments sorted by expert,
  each expert's gated MLP over its run of rows (`jax.lax.ragged_dot`), times its
  per_expert_scale, unsorted and weighted. Safe under `jax.vmap` (a served lane vmaps the
  network over its rows; `ragged_dot` has no batching rule): a vmap over rows folds them
  into the tokens, one call over every row's tokens as a batch runs (`moe.over_tokens`)."""
  weights = tuple(layer[name].astype(x_TxD.dtype)  # dense (a quantized weight answers)
                  for name in ("experts_gating", "experts_linear", "per_expert_scale"))
  return moe.over_tokens(_experts, 3)(x_TxD, experts_Txk, weights_Txk, *weights)


def _experts(x_TxD: Array, experts_Txk: Array, weights_Txk: Array, gating_Ex2xFxD: Array,
             linear_ExFxD: Array, scale_E: Array) -> Array:
  tokens, d = x_TxD.shape
  k = experts_Txk.shape[1]
  gating_Ex2xFxD = gating_Ex2xFxD.astype(x_TxD.dtype)
  num_experts, _, hidden, _ = gating_Ex2xFxD.shape
  expert_A = experts_Txk.reshape(-1)  # A = T * k assignments, token-major
  order_A = jnp.argsort(expert_A, stable=True)
  sizes_E = jnp.bincount(expert_A, length=num_experts).astype(jnp.int32)
  rows_AxD = x_TxD[order_A // k]
  w_ExDx2F = gating_Ex2xFxD.transpose(0, 3, 1, 2).reshape(num_experts, d, 2 * hidden)
  gate_Ax2xF = jax.lax.ragged_dot(rows_AxD, w_ExDx2F, sizes_E).reshape(-1, 2, hidden)
  act_AxF = jax.nn.gelu(gate_Ax2xF[:, 0]) * gate_Ax2xF[:, 1]
  out_AxD = jax.lax.ragged_dot(act_AxF, linear_ExFxD.astype(x_TxD.dtype), sizes_E)
  out_AxD = out_AxD * scale_E.astype(out_AxD.dtype)[expert_A[order_A], None]
  unsorted_TxkxD = jnp.zeros_like(out_AxD).at[order_A].set(out_AxD).reshape(tokens, k, d)
  return jnp.einsum("tkd,tk->td", unsorted_TxkxD, weights_Txk.astype(x_TxD.dtype))


def feed_forward(layer: dict, h_BxQxD: Array, experts_per_token: int | None) -> Array:
  """The block's FFW output (before the residual): the dense MLP, or the shared dense MLP
  beside the experts (`experts_per_token`), each post-normed, summed and post-normed."""
  if experts_per_token is None:
    x = rms_norm(h_BxQxD, layer["pre_ffw_norm"])
    return rms_norm(gated_mlp(x, layer["mlp_gating"], layer["mlp_linear"]),
                    layer["post_ffw_norm"])
  dense = gated_mlp(rms_norm(h_BxQxD, layer["pre_ffw2_norm"]), layer["mlp2_gating"],
                    layer["mlp2_linear"])
  dense = rms_norm(dense, layer["post_ffw2_norm"])
  batch, width, d = h_BxQxD.shape
  h_TxD = h_BxQxD.reshape(-1, d)
  chosen_Txk, weights_Txk = route(layer, h_TxD, experts_per_token)
  x_TxD = rms_norm(h_TxD, layer["pre_ffw_norm"])
  routed = experts(layer, x_TxD, chosen_Txk, weights_Txk).reshape(batch, width, d)
  routed = rms_norm(routed, layer["post_ffw1_norm"])
  return rms_norm(dense + routed, layer["post_ffw_norm"])


def block_out(layer: dict, h_BxQxD: Array, attn_BxQxHxK: Array,
              experts_per_token: int | None) -> Array:
  """The block after its attention: output projection, post-norm, residual, FFW, residual,
  times skip_scale."""
  attn = jnp.einsum("btnh,nhd->btd", attn_BxQxHxK, layer["o"].astype(attn_BxQxHxK.dtype))
  h_BxQxD = h_BxQxD + rms_norm(attn, layer["post_attn_norm"])
  out = h_BxQxD + feed_forward(layer, h_BxQxD, experts_per_token)
  return out * layer["skip_scale"].astype(out.dtype)
