"""Value transforms and categorical draws.

Randomness is drawn per row from that row's key (`fold_in(row_key, tag)`), so a
batch of B rows equals B single-row calls with the same per-row keys. Draws indexed by
position take `shift_B`, each row's first valid position (left padding): position l of
row b gets the draw of position l - shift_b, so a left-padded row draws, at each real
position, what the same row draws alone on a canvas without its padding (jax's default
partitionable threefry makes element i of a draw independent of the draw's length).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mdjax.sampling import threefry
from mdjax.streams import StepStream

Array = jax.Array


def noise_dtype():
  """Gumbel / uniform noise in float64 when x64 is on, else float32.

  Low-precision Gumbel noise is known to distort categorical draws, so noise
  is never drawn in a reduced precision.
  """
  return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32


def _from_first_valid(noise_BxLx: Array, shift_B: Array | None) -> Array:
  """Row b's draws indexed from its first valid position (see the module docstring)."""
  if shift_B is None:
    return noise_BxLx
  return jax.vmap(lambda x, s: jnp.roll(x, s, axis=0))(noise_BxLx, shift_B)


def row_uniform(keys_B: Array, tag: StepStream, shape: tuple[int, ...],
                shift_B: Array | None = None) -> Array:
  """U[0, 1) noise of `shape` per row, from each row's own key (axis 0 indexed by
  position from each row's first valid one when `shift_B` is given)."""
  noise = threefry.uniform(threefry.fold_in(keys_B, tag), shape, noise_dtype())
  return _from_first_valid(noise, shift_B)


def row_gumbel(keys_B: Array, tag: StepStream, shape: tuple[int, ...],
               shift_B: Array | None = None) -> Array:
  """Standard Gumbel noise of `shape` per row, from each row's own key (`shift_B`: as
  `row_uniform`)."""
  noise = threefry.gumbel(threefry.fold_in(keys_B, tag), shape, noise_dtype())
  return _from_first_valid(noise, shift_B)


def transform_logits(logits_BxLxV: Array, temperature: float, top_k: int | None,
                     top_p: float, min_p: float = 0.0) -> Array:
  """softmax(logits / T) restricted to the top-k and to the top-p nucleus.

  Returns logits (-inf outside the kept set). Ties at a cut-off are all kept.
  `temperature` must be > 0 here; T = 0 is the argmax branch of `draw_values`.
  """
  x = logits_BxLxV.astype(noise_dtype())
  if temperature != 1.0:  # x / 1 is x: skip a pass over B x L x V
    x = x / temperature
  if top_k is not None and top_k < x.shape[-1]:
    kth = jax.lax.top_k(x, top_k)[0][..., -1:]
    x = jnp.where(x < kth, -jnp.inf, x)
  if top_p < 1.0:
    sorted_x = jnp.sort(x, axis=-1)[..., ::-1]
    sorted_p = jax.nn.softmax(sorted_x, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first always).
    mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    num_keep = jnp.maximum((mass_before < top_p).sum(-1, keepdims=True), 1)
    cut = jnp.take_along_axis(sorted_x, num_keep - 1, axis=-1)
    x = jnp.where(x < cut, -jnp.inf, x)
  if min_p > 0.0:
    # Keep values with probability >= min_p * the row's largest: log p - log p_max >= log min_p.
    x = jnp.where(x - x.max(-1, keepdims=True) < jnp.log(min_p), -jnp.inf, x)
  return x


def eos_logits(logits_BxLxV: Array, eos_id: int | None, eos_penalty: float = 0.0,
               eos_never: bool = False) -> Array:
  """The EOS knobs: EOS's logit lowered by `eos_penalty`, or -inf with `eos_never`."""
  if eos_id is None or (eos_penalty == 0.0 and not eos_never):
    return logits_BxLxV
  column = logits_BxLxV[..., eos_id]
  column = jnp.full_like(column, -jnp.inf) if eos_never else column - eos_penalty
  return logits_BxLxV.at[..., eos_id].set(column)


def draw_values(keys_B: Array, logits_BxLxV: Array, *, temperature: float,
                top_k: int | None, top_p: float, min_p: float = 0.0, eos_id: int | None = None,
                eos_penalty: float = 0.0, eos_never: bool = False,
                shift_B: Array | None = None, draw=None) -> Array:
  """One categorical draw per position (`draw`: `gumbel_max` unless given, or
  `inverse_cdf`); T = 0 is argmax. The EOS knobs apply first (`eos_logits`)."""
  logits_BxLxV = eos_logits(logits_BxLxV, eos_id, eos_penalty, eos_never)
  if temperature == 0.0:
    return argmax_last(logits_BxLxV)
  x = transform_logits(logits_BxLxV, temperature, top_k, top_p, min_p)
  return (draw or gumbel_max)(keys_B, StepStream.VALUES, x, shift_B)


def gumbel_max(keys_B: Array, tag: StepStream, log_weights_BxNxV: Array,
               shift_B: Array | None = None) -> Array:
  """One categorical draw per slot from unnormalised log-weights (-inf: never drawn)."""
  gumbel_BxNxV = row_gumbel(keys_B, tag, log_weights_BxNxV.shape[1:], shift_B)
  return argmax_last(log_weights_BxNxV + gumbel_BxNxV)


# Values per block of `inverse_cdf`: one cumulative sum over all V values costs, on CPU, several
# times the rest of the draw (3x the whole draw at V = 2048); over V / 64 block sums and then
# 64 values it does not.
_CDF_BLOCK = 64


def _first_above(cum_xN: Array, w_xN: Array, target_x: Array) -> Array:
  """Per slot, the first index whose cumulative weight exceeds the target, among the
  positive weights; the last positive one when rounding leaves none above (the target can
  reach the rounded total). A zero weight is never the answer."""
  n = cum_xN.shape[-1]
  hit_xN = (cum_xN > target_x[..., None]) & (w_xN > 0)
  last_x = n - 1 - jnp.argmax(w_xN[..., ::-1] > 0, axis=-1)
  return jnp.where(hit_xN.any(-1), jnp.argmax(hit_xN, axis=-1), last_x).astype(jnp.int32)


def inverse_cdf(keys_B: Array, tag: StepStream, log_weights_BxNxV: Array,
                shift_B: Array | None = None) -> Array:
  """One categorical draw per slot from unnormalised log-weights (-inf: never drawn), by
  inverting the cumulative weights at one uniform per slot: the law of `gumbel_max` from N
  uniforms instead of N x V Gumbel variates (`shift_B`: as `row_uniform`).

  The search runs in two levels: the block of `_CDF_BLOCK` values whose cumulative block sum
  passes u * total, then the value inside it. In exact arithmetic a value is drawn with
  probability w_v / total; in floating point each value's probability is off by about one
  rounding of the cumulative sums (~1e-7 of the total in float32), and a zero weight is never
  drawn.
  """
  x = log_weights_BxNxV.astype(noise_dtype())
  *lead, num_values = x.shape
  w = jnp.exp(x - x.max(-1, keepdims=True))
  width = min(_CDF_BLOCK, num_values)
  num_blocks = -(-num_values // width)
  pad = [(0, 0)] * len(lead) + [(0, num_blocks * width - num_values)]
  w_xCxK = jnp.pad(w, pad).reshape(*lead, num_blocks, width)
  block_w = w_xCxK.sum(-1)
  block_cum = jnp.cumsum(block_w, -1)
  target = row_uniform(keys_B, tag, tuple(lead[1:]), shift_B) * block_cum[..., -1]
  block = _first_above(block_cum, block_w, target)
  inner_w = jnp.take_along_axis(w_xCxK, block[..., None, None], -2)[..., 0, :]
  before = jnp.take_along_axis(block_cum - block_w, block[..., None], -1)[..., 0]
  inner = _first_above(jnp.cumsum(inner_w, -1), inner_w, target - before)
  return block * width + inner


# Below this many values an unrolled argmax beats XLA's variadic reduce on CPU (4x at V = 15).
_UNROLLED_ARGMAX_MAX_V = 64


def argmax_last(x_BxNxV: Array) -> Array:
  """`jnp.argmax(x, -1)` as int32: the first index of the largest value.

  For a small V it runs as V - 1 elementwise compares across the value slices, which
  vectorize over the B x N slots, instead of a reduce along the short minor axis.
  """
  num_values = x_BxNxV.shape[-1]
  if num_values > _UNROLLED_ARGMAX_MAX_V:
    return jnp.argmax(x_BxNxV, axis=-1).astype(jnp.int32)
  x_VxBxN = jnp.moveaxis(x_BxNxV, -1, 0)
  best_BxN, index_BxN = x_VxBxN[0], jnp.zeros(x_VxBxN.shape[1:], jnp.int32)
  for v in range(1, num_values):
    # Strictly greater keeps the first maximum; a NaN is never the best (see nonfinite_count).
    better_BxN = x_VxBxN[v] > best_BxN
    best_BxN = jnp.where(better_BxN, x_VxBxN[v], best_BxN)
    index_BxN = jnp.where(better_BxN, v, index_BxN)
  return index_BxN


def transformed_probs(logits: Array, spec) -> Array:
  """The distribution values are drawn from: the EOS knobs, temperature, top-k, top-p; T = 0
  is one-hot."""
  logits = eos_logits(logits, spec.eos_id, spec.eos_penalty, spec.eos_never)
  if spec.temperature == 0.0:
    return jax.nn.one_hot(argmax_last(logits), logits.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(transform_logits(logits, spec.temperature, spec.top_k, spec.top_p,
                                         spec.min_p), -1)


def proposal_probs(logits_BxLxV: Array, spec) -> Array:
  """The distribution a threshold decoder's proposal is drawn from, whose probabilities its
  thresholds read: the EOS knobs, then temperature, top-k, top-p; T = 0 is the plain
  softmax (the references' greedy branch reads its probabilities, not a one-hot)."""
  logits_BxLxV = eos_logits(logits_BxLxV, spec.eos_id, spec.eos_penalty, spec.eos_never)
  if spec.temperature == 0.0:
    return jax.nn.softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
  return jax.nn.softmax(transform_logits(logits_BxLxV, spec.temperature, spec.top_k,
                                         spec.top_p, spec.min_p), axis=-1)


def value_probs(logits_BxLxV: Array, values_BxL: Array) -> tuple[Array, Array]:
  """Untransformed softmax and the probability of each drawn value."""
  probs_BxLxV = jax.nn.softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
  conf_BxL = jnp.take_along_axis(probs_BxLxV, values_BxL[..., None], axis=-1)[..., 0]
  return probs_BxLxV, conf_BxL
