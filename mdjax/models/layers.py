"""The pieces mdjax's three networks share: rotary position embedding, positions counted past
padding, attention masks, attention over parts of the keys, the write of a window into a
key/value cache, and the binder that turns a network's functions into a `Denoiser`'s.

The networks (`transformer`: mdjax's own; `published`: LLaDA, Dream and the causal judges;
`dit`: MDLM / BD3-LM) each follow a reference that orders its float operations its own way
(where the attention scale is applied, how a rotation is summed, the rotary table's
precision). A keyword argument keeps each one's arithmetic here, so the pieces are written
once and every network's numbers stay what its reference computes, to the bit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.models import checks

Array = jax.Array

# A masked attention score: finite, so a query whose every key is masked gets a uniform
# (finite) average instead of NaN.
MASKED = -1e30

ROTATIONS = ("rotate_half", "halves", "halves_sin_first")


# --- rotary position embedding -------------------------------------------------------------


def inverse_frequencies(head_dim: int, theta: float) -> np.ndarray:
  """The rotary inverse frequencies theta^(-2i / K) for i < K/2 (Llama's and flash-attn's
  formula), float64 on the host."""
  return 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))


def llama3_inverse_frequencies(inv_freq_K2: np.ndarray, factor: float, low_freq_factor: float,
                               high_freq_factor: float, original_length: int) -> np.ndarray:
  """Llama 3.1's frequencies (transformers' `_compute_llama3_parameters`): wavelengths above
  original_length / low_freq_factor slowed by `factor`, those below original_length /
  high_freq_factor kept, the ones between interpolated."""
  wavelen_K2 = 2 * np.pi / inv_freq_K2
  scaled_K2 = np.where(wavelen_K2 > original_length / low_freq_factor, inv_freq_K2 / factor,
                       inv_freq_K2)
  smooth_K2 = (original_length / wavelen_K2 - low_freq_factor) / (high_freq_factor -
                                                                   low_freq_factor)
  smoothed_K2 = (1 - smooth_K2) * scaled_K2 / factor + smooth_K2 * scaled_K2
  medium_K2 = ((wavelen_K2 >= original_length / high_freq_factor)
               & (wavelen_K2 <= original_length / low_freq_factor))
  return np.where(medium_K2, smoothed_K2, scaled_K2)


def rotary_cos_sin(positions_BxQ: Array, inv_freq_K2: np.ndarray, *,
                   full_width: bool) -> tuple[Array, Array]:
  """cos and sin of the rotary angles at `positions_BxQ`, computed on the device in float32:
  B x Q x K/2, or B x Q x K with `full_width` (the angles repeated, as Hugging Face's
  rotate_half form reads them)."""
  angle_BxQxK2 = positions_BxQ.astype(jnp.float32)[..., None] * jnp.asarray(
      inv_freq_K2, jnp.float32)
  if full_width:
    angle_BxQxK2 = jnp.concatenate([angle_BxQxK2, angle_BxQxK2], axis=-1)
  return jnp.cos(angle_BxQxK2), jnp.sin(angle_BxQxK2)


@functools.lru_cache(maxsize=64)
def rope_table(length: int, half: int) -> tuple[np.ndarray, np.ndarray]:
  """cos and sin of the rotary angles at positions 0..L-1 (L x K/2, float32), computed on
  the host in float64: a constant of the program, the same on every backend, instead of
  sin and cos that XLA fuses into each layer's rotation and redoes at every call."""
  freq_K = np.exp(-math.log(10_000.0) * np.arange(half) / half)
  angle_LxK = np.arange(length)[:, None] * freq_K[None]
  return np.cos(angle_LxK).astype(np.float32), np.sin(angle_LxK).astype(np.float32)


def rotate(x_BxQxHxK: Array, cos_BxQxC: Array, sin_BxQxC: Array, *, form: str,
           float32: bool) -> Array:
  """The half-split rotary embedding (the first half of each head pairs with the second),
  in x's dtype. cos and sin are per position, the same for every head: B x Q x C, or
  B x Q x 1 x C (B may be 1). `float32`: rotate in float32 (else in x's dtype, promoted by
  the tables'). The same rotation written in each reference's order of operations (`form`;
  they can differ in the last bit):

    "rotate_half": x * cos + rotate_half(x) * sin, tables K wide (Hugging Face Llama)
    "halves": [x1 cos - x2 sin, x2 cos + x1 sin], tables K/2 wide (flash-attn)
    "halves_sin_first": [x1 cos - x2 sin, x1 sin + x2 cos], tables K/2 wide (mdjax)
  """
  if form not in ROTATIONS:
    raise ValueError(f"form={form!r} must be one of {ROTATIONS}.")
  x = x_BxQxHxK.astype(jnp.float32) if float32 else x_BxQxHxK
  half = x.shape[-1] // 2
  per_head = lambda table: table[:, :, None] if table.ndim < x.ndim else table
  if form == "rotate_half":
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * per_head(cos_BxQxC) + rotated * per_head(sin_BxQxC)
    return out.astype(x_BxQxHxK.dtype)
  x1, x2 = x[..., :half], x[..., half:]
  cos, sin = per_head(cos_BxQxC), per_head(sin_BxQxC)
  first = x1 * cos - x2 * sin
  second = x2 * cos + x1 * sin if form == "halves" else x1 * sin + x2 * cos
  return jnp.concatenate([first, second], axis=-1).astype(x_BxQxHxK.dtype)


# --- positions and masks ---------------------------------------------------------------------


def counted_positions(valid_BxL: Array, padding: int | None = None) -> Array:
  """Each position counted from its row's first valid one, cumsum(valid) - 1 (int32, B x L):
  left padding at 0 (the count clamped), or at `padding` for every invalid position."""
  valid_BxL = valid_BxL.astype(bool)
  counted_BxL = jnp.cumsum(valid_BxL, -1, dtype=jnp.int32) - 1
  if padding is None:
    return jnp.maximum(counted_BxL, 0)
  return jnp.where(valid_BxL, counted_BxL, padding)


def visible(query_Q, key_K, *, causal: bool = False, block_size: int | None = None):
  """Whether each query position attends to each key position ([B x] Q x K from positions
  of shape [B x] Q and [B x] K, numpy or jax by the inputs): causal (keys at or before the
  query), block-causal (key blocks at or before the query's), or None when every key is
  visible (bidirectional)."""
  query, key = query_Q[..., :, None], key_K[..., None, :]
  if causal:
    return key <= query
  if block_size is not None:
    return key // block_size <= query // block_size
  return None


def both(a: Array | None, b: Array | None) -> Array | None:
  """a & b for masks where None means every key is visible."""
  return b if a is None else a if b is None else a & b


def outside_window(key_L: Array, start, width: int) -> Array:
  """Whether each key position lies outside the window [start, start + width): the keys a
  window pass reads from the cache (its own it computes afresh)."""
  return (key_L < start) | (key_L >= start + width)


def check_block_pair(block_size: int | None, noisy_BxL, clean_BxL, config_name: str) -> None:
  """The block pair's arguments: a block-causal model (`config_name`.block_size set) and a
  noisy and a clean sequence of one shape."""
  if block_size is None:
    raise ValueError(f"block_pair needs a block-causal model: set {config_name}.block_size.")
  if noisy_BxL.shape != clean_BxL.shape:
    raise ValueError(f"noisy_BxL has shape {noisy_BxL.shape}, clean_BxL {clean_BxL.shape}; "
                     "they must match.")


def block_pair_mask(length: int, block_size: int) -> np.ndarray:
  """The BD3-LM attention mask over [noisy; clean] (2L x 2L): noisy block b sees itself and
  clean blocks < b; clean block b sees clean blocks <= b; no clean position sees noise."""
  block_L = np.arange(length) // block_size
  q, k = block_L[:, None], block_L[None]
  noisy_to_noisy, noisy_to_clean, clean_to_clean = q == k, k < q, k <= q
  top = np.concatenate([noisy_to_noisy, noisy_to_clean], 1)
  bottom = np.concatenate([np.zeros((length, length), bool), clean_to_clean], 1)
  return np.concatenate([top, bottom], 0)


# --- attention ---------------------------------------------------------------------------------


def attend(q: Array, parts: list[tuple[Array, Array, Array | None]], *,
           scale_by_reciprocal: bool, float32_values: bool) -> Array:
  """Attention of the queries over the concatenation of key parts, each (keys, values,
  visible or None: every key), under one float32 softmax; the parts are never concatenated
  (a window pass reads the cache in place). Returns B x Q x (heads * K).

  q is B x Q x H x K (keys and values B x H x S x K, visible B x Q x S or broadcastable) or,
  for grouped key/value heads, B x Q x G x R x K (R query heads read each of the G key/value
  heads: keys and values B x G x S x K). Scores are q.k in float32, scaled by
  `* (1 / sqrt(K))` or `/ sqrt(K)` (`scale_by_reciprocal`); the weighted values come out in
  float32 with `float32_values`, else in q's dtype.
  """
  grouped = q.ndim == 5
  score_spec, value_spec = (("bqgrk,bgsk->bgrqs", "bgrqs,bgsk->bqgrk") if grouped
                            else ("bqhk,bhsk->bhqs", "bhqs,bhsk->bqhk"))
  batch, width, k = q.shape[0], q.shape[1], q.shape[-1]
  dtype = q.dtype
  scores = []
  for keys, _, visible_BxQxS in parts:
    s = jnp.einsum(score_spec, q, keys.astype(dtype), preferred_element_type=jnp.float32)
    s = s * (1.0 / np.sqrt(k)) if scale_by_reciprocal else s / math.sqrt(k)
    if visible_BxQxS is not None:
      s = jnp.where(visible_BxQxS[:, None, None] if grouped else visible_BxQxS[:, None], s,
                    MASKED)
    scores.append(s)
  sizes = np.cumsum([s.shape[-1] for s in scores])[:-1]
  probs = jnp.split(jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1), sizes, axis=-1)
  out_type = jnp.float32 if float32_values else None
  out = sum(jnp.einsum(value_spec, p.astype(dtype), values.astype(dtype),
                       preferred_element_type=out_type)
            for p, (_, values, _) in zip(probs, parts))
  return out.reshape(batch, width, int(np.prod(q.shape[2:])))


# --- the key/value cache -----------------------------------------------------------------------


def write_window(cached: Array, window: Array, start) -> Array:
  """`cached` with the positions [start, start + W) of its second-last axis (every cache
  layout keeps positions there) replaced by `window`, cast to the cache's dtype."""
  return jax.lax.dynamic_update_slice_in_dim(cached, window.astype(cached.dtype), start,
                                             axis=cached.ndim - 2)


def check_window(width: int, length: int) -> None:
  if width > length:
    raise ValueError(f"window of {width} positions is longer than the cache ({length}).")


def check_length(length: int, max_len: int) -> None:
  if length > max_len:
    raise ValueError(f"sequence length {length} exceeds max_len={max_len}.")


# --- the denoiser's functions ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Bound:
  """A module-level function with its leading arguments (a config, a mode) bound: equal
  (and equally hashed) for equal arguments, so equal Denoisers share compiled programs
  (functools.partial compares by identity)."""

  fn: Callable
  args: tuple

  def __call__(self, *args, **kwargs):
    return self.fn(*self.args, *args, **kwargs)


def bind(fn: Callable, *args) -> Bound:
  """`fn` with `args` bound first (see `Bound`)."""
  return Bound(fn, args)


def anneal_visible(anneal, length: int) -> jax.Array | None:
  """The L x L keys a query may see under attention-mask annealing (DiffuLLaMA's
  `get_anneal_attn_mask`): its own position and before, and each later key with probability
  `fraction`, one draw from `key` shared by the batch and the layers (a training step's).
  `anneal` is (fraction, key): fraction 0 is causal attention, 1 the network's own pattern
  (the result is intersected with it); key may be None only for a Python fraction 0 or 1.
  None: no annealing."""
  if anneal is None:
    return None
  if not (isinstance(anneal, tuple) and len(anneal) == 2):
    raise ValueError(f"anneal={anneal!r} must be None or (fraction, key).")
  fraction, key = anneal
  causal_LxL = np.arange(length)[None, :] <= np.arange(length)[:, None]
  if key is None:
    if not (checks.is_number(fraction) and fraction in (0, 1)):
      raise ValueError(f"anneal=({fraction!r}, None): a fraction other than 0 or 1 draws its "
                       "later keys from a PRNG key; pass (fraction, key).")
    return jnp.asarray(causal_LxL | (fraction == 1))
  # uniform < 0 is never true and uniform < 1 always (uniform lies in [0, 1)).
  drawn_LxL = jax.random.uniform(key, (length, length)) < jnp.asarray(fraction, jnp.float32)
  return jnp.asarray(causal_LxL) | drawn_LxL
