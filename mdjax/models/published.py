"""The published diffusion LMs' Transformer (LLaDA: Llama-style; Dream: Qwen2-style), in JAX.

Bidirectional attention (no causal mask), RMSNorm (weight only), SwiGLU, half-split RoPE,
grouped KV heads, optional q/k/v biases, untied output head, and Dream's one-position logit
shift. Pure functions over a params pytree whose layers are stacked (one `lax.scan` over
layers keeps compile time flat in depth):

  params = {
    "embed": [V_embed, D],
    "layers": {                      # every leaf has a leading [num_layers] axis
      "attn_norm": [N, D], "q": [N, D, H*K], "k": [N, D, G*K], "v": [N, D, G*K],
      "q_bias": [N, H*K], "k_bias": [N, G*K], "v_bias": [N, G*K],   # only with qkv_bias
      "o": [N, H*K, D], "mlp_norm": [N, D],
      "gate": [N, D, F], "up": [N, D, F], "down": [N, F, D],
    },
    "final_norm": [D],
    "head": [D, V_embed],
  }

(H heads, G key/value heads, K = head_dim, F = mlp_hidden; matrices are [in, out], the
transpose of torch's Linear weight.)
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

FAMILIES = ("llada", "dream")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublishedConfig:
  """The architecture of a published checkpoint (frozen: a static argument under jit).

  vocab_size: rows of the embedding and columns of the head (the checkpoint's own ids;
    LLaDA's `embedding_size`). mask_id lies inside it; its logit is -inf.
  logit_shift: Dream's prediction for position i is the network's output at i - 1.
  dtype: the weights' and activations' dtype; norms, softmax and logits are float32.
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
  mask_id: int
  eos_id: int | None = None
  eot_id: int | None = None  # LLaDA's end-of-turn id (None: none)
  max_len: int = 4096
  dtype: str = "float32"

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)
