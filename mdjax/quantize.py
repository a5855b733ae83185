"""Weight-only quantization: `mdjax.load(..., quantize="int8")` (or "int4").

Each matrix a network multiplies by becomes a `QuantizedWeight`: symmetric integers and
float32 scales, stored in the params pytree in place of the float matrix, so the weights
sit on the device as int8 (int4) and every jitted call dequantizes them where they are
used. The networks are not touched: they read each matrix as `w.astype(x.dtype)` (the
published networks, the DiT, the MoE experts' `ragged_dot`) or through `jnp.asarray`
(flax's `nnx.Linear` in mdjax's own Transformer), and a `QuantizedWeight` answers both
with its dense weight, `values * scale` in float32 rounded once to the compute dtype. In
XLA that is a convert and a multiply feeding the dot (fusable into it), inside the
`lax.scan` over layers: one layer's dense weight at a time, never the whole network's.
Unquantized params are untouched arrays, so their arithmetic is what it was, bit for bit.

Scales: int8 per output channel (the max |w| of each column over the input axis / 127);
int4 per group of INT4_GROUP input rows of each column (/ 7). Rounding to nearest, clipped
to +-127 (+-7), so each weight moves by at most half its scale.

Kept in float, by name (`QUANTIZED`): the embedding (a row gather, not a matmul), every
norm weight and bias (vectors read in float32, a rounding there shifts whole activations),
the MoE routers, their scales and expert biases (a top-k choice: a rounded score can switch
which experts run), DiffusionGemma's tied embedding (also its head), and the DiT's noise
embedding (`sigma_map`, small). A time-free DiT (MDLM, BD3-LM as published) is folded
first (`dit.fold`: the adaLN terms into the norms and the output matrices) and quantized
folded, as its reference sampler runs it.

Why not Google's qwix (docs/serving.md, "Quantized weights"): its model API quantizes Flax
modules it intercepts (rules match module paths; PTQ finds a weight among the current
module's params), which the published and DiT networks (functions over dicts) do not have,
and on an NNX model it intercepts one method while a `Denoiser` runs four (apply, prefill,
decode, block_pair). Its core `QArray` would need every matmul rewritten as `qwix.einsum`
(its `astype` returns a QArray), and for float activations its dot dequantizes the weight
first, which is what this module does.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.errors import ArgumentError
from mdjax.model import WORKDIR_FAMILY, Model
from mdjax.models import dit
from mdjax.models.diffusion_gemma import DiffusionGemmaConfig
from mdjax.models.dit import DiTConfig
from mdjax.models.published import PublishedConfig

Array = jax.Array

MODES = {"int8": 8, "int4": 4}  # mode -> bits
# Input rows sharing an int4 scale (its gcd with the input size when that is no multiple).
INT4_GROUP = 32

# The matrices each network multiplies by (the last name of the leaf's path); nothing else is
# quantized (module docstring: what stays float and why).
QUANTIZED = {
    "published": ("q", "k", "v", "o", "gate", "up", "down", "head", "experts_gate",
                  "experts_up", "experts_down", "shared_gate", "shared_up", "shared_down"),
    "dit": ("qkv", "attn_out", "mlp_in", "mlp_out", "ada", "linear"),
    "mdjax": ("kernel",),  # every nnx.Linear: qkv, proj, mlp_in, mlp_out, head, ada, time_mlp
    # gemma's einsum layouts: the scale runs along axis -2 whichever axis it is (per output
    # channel for q, k, kv, the linears; per input channel of the gatings, [.., 2, F, D]).
    "diffusion_gemma": ("q", "k", "kv", "o", "mlp_gating", "mlp_linear", "mlp2_gating",
                        "mlp2_linear", "experts_gating", "experts_linear", "gating", "linear"),
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """A matrix [..., I, O] as integers `values` (int8 or int4, its shape) and float32 `scale`
  [..., G, O] (G groups of I / G input rows; G = 1: per output channel). `float_dtype` is
  the float matrix's: its `dtype`, what `__jax_array__` gives."""

  values: Array
  scale: Array
  float_dtype: str = dataclasses.field(metadata=dict(static=True))

  @property
  def dtype(self):
    return jnp.dtype(self.float_dtype)

  @property
  def shape(self) -> tuple[int, ...]:
    return self.values.shape

  @property
  def ndim(self) -> int:
    return self.values.ndim

  def astype(self, dtype) -> Array:
    """The dense matrix in `dtype` (`dequantize`)."""
    return dequantize(self, dtype)

  def __jax_array__(self) -> Array:  # jnp.asarray(w, dtype): nnx.Linear's promote_dtype
    return dequantize(self, self.dtype)

  def __getitem__(self, index):
    # nnx.Linear reads its kernel as `kernel[...]`: the whole weight, still quantized (the
    # dequantization happens in its promote_dtype, above).
    if index is not Ellipsis:
      raise TypeError(f"a QuantizedWeight is read whole (w[...] or w.astype(dtype)), not "
                      f"indexed by {index!r}.")
    return self


def dequantize(weight: QuantizedWeight, dtype) -> Array:
  """values * scale in float32 (each group's scale over its input rows), cast to `dtype`."""
  *lead, rows, cols = weight.values.shape
  groups = weight.scale.shape[-2]
  grouped = weight.values.astype(jnp.float32).reshape(*lead, groups, rows // groups, cols)
  dense = grouped * weight.scale[..., :, None, :]
  return dense.reshape(weight.values.shape).astype(dtype)


def check_mode(quantize) -> None:
  """`quantize` is None or a mode name (else an ArgumentError naming quantize)."""
  if quantize is not None and (not isinstance(quantize, str) or quantize not in MODES):
    raise ArgumentError.invalid("quantize", quantize, f"it must be None (float weights) or "
                                f"one of {', '.join(map(repr, MODES))} (weight-only integers)")


def group_size(rows: int, bits: int) -> int:
  """Input rows per scale: all of them for int8 (per output channel), INT4_GROUP for int4."""
  return rows if bits == 8 else math.gcd(rows, INT4_GROUP)


@functools.partial(jax.jit, static_argnames=("bits",))
def _quantize(w: Array, bits: int) -> tuple[Array, Array]:
  *lead, rows, cols = w.shape
  group = group_size(rows, bits)
  top = 2 ** (bits - 1) - 1  # 127 or 7: symmetric, so -top..top and 0 is exact
  w_grouped = w.astype(jnp.float32).reshape(*lead, rows // group, group, cols)
  scale = jnp.max(jnp.abs(w_grouped), axis=-2) / top
  scale = jnp.where(scale > 0, scale, 1.0)  # an all-zero group: any scale gives zeros
  values = jnp.clip(jnp.round(w_grouped / scale[..., :, None, :]), -top, top)
  return values.astype(jnp.int8 if bits == 8 else jnp.int4).reshape(w.shape), scale


def quantize_weight(w: Array, mode: str) -> QuantizedWeight:
  """The matrix `w` [..., I, O] quantized by `mode` ("int8", "int4")."""
  check_mode(mode)
  values, scale = _quantize(w, MODES[mode])
  return QuantizedWeight(values=values, scale=scale, float_dtype=str(jnp.dtype(w.dtype)))


def network_of(model: Model) -> str:
  """The key of `QUANTIZED` for the model's network; an ArgumentError for one without."""
  if isinstance(model.config, PublishedConfig):
    return "published"
  if isinstance(model.config, DiTConfig):
    return "dit"
  if isinstance(model.config, DiffusionGemmaConfig):
    return "diffusion_gemma"
  if model.family == WORKDIR_FAMILY:
    return "mdjax"
  raise ArgumentError("quantize", f"quantize does not apply to the {model.family!r} model: "
                      "only networks with weight matrices are quantized (a workdir, a "
                      "published checkpoint), not a task's exact denoiser.")


def _leaf_name(path) -> str | None:
  """The last dict key of a params path (an nnx State's Variable adds attribute keys)."""
  names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
  return str(names[-1]) if names else None


def quantize_params(params, names, mode: str):
  """`params` with every float matrix (ndim >= 2) whose leaf name is in `names` quantized."""
  def one(path, leaf):
    if (_leaf_name(path) in names and getattr(leaf, "ndim", 0) >= 2
        and jnp.issubdtype(leaf.dtype, jnp.floating)):
      return quantize_weight(leaf, mode)
    return leaf
  return jax.tree_util.tree_map_with_path(one, params)


def quantize_model(model: Model, mode: str | None) -> Model:
  """`model` with its matrices quantized (None: `model` as it is). A time-free DiT on its
  default (folding) denoiser is folded first and gets the folded denoiser."""
  check_mode(mode)
  if mode is None:
    return model
  network = network_of(model)
  denoiser, params = float_layout(model)
  return model.replace(params=quantize_params(params, QUANTIZED[network], mode),
                       denoiser=denoiser)


def float_layout(model: Model):
  """(denoiser, float params) that `quantize_model` quantizes: the model's own, or for a
  time-free DiT on its default denoiser the folded ones (`dit.fold`)."""
  config = model.config
  if (isinstance(config, DiTConfig) and not config.time_conditioning
      and model.denoiser == dit.denoiser(config)):
    return dit.denoiser(config, folded=True), fold(config, model.params)
  return model.denoiser, model.params


fold = jax.jit(dit.fold, static_argnums=0)  # the DiT's adaLN folded into its weights, once


def is_quantized(params) -> bool:
  """Whether any leaf of `params` is a QuantizedWeight."""
  return any(isinstance(x, QuantizedWeight) for x in
             jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight)))


def param_bytes(params) -> int:
  """The bytes the params take, an int4 value counted as half a byte (XLA packs int4 on GPU
  and TPU; the CPU backend keeps one a byte)."""
  total = 0.0
  for leaf in jax.tree.leaves(params):
    bits = 4 if leaf.dtype == jnp.int4 else 8 * np.dtype(leaf.dtype).itemsize
    total += leaf.size * bits / 8
  return int(math.ceil(total))
