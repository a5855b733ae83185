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
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

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

  @property
  def mask_id(self) -> int:
    return self.vocab_size

  @property
  def head_dim(self) -> int:
    return self.hidden_dim // self.n_heads

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)
