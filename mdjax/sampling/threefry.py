"""The per-step draws of `jax.random`, bit for bit, without its loop on the CPU.

jax lowers the Threefry-2x32 hash on the CPU as a rolled `fori_loop` of five rounds (it
compiles faster), so every `fold_in` and every draw of a sampler step becomes a small
while loop that XLA runs iteration by iteration: at batch 1 these loops were about half of
a step's own work (measured by `mdjax.bench`'s step-cost table). Here the same hash is
written out, unrolled, in jnp: XLA fuses it with what reads the bits.

The functions reproduce `jax.random.fold_in`, `uniform` and `gumbel` (mode "low") for
threefry keys with `jax_threefry_partitionable` (jax's default) and float32 noise, the
case every sampler step takes; for anything else (another key implementation, float64
noise) they call `jax.random` itself. tests/sampling/test_threefry.py checks the equality.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)


def _rotate_left(x: Array, d: int) -> Array:
  return (x << np.uint32(d)) | (x >> np.uint32(32 - d))


def hash_2x32(k1: Array, k2: Array, x1: Array, x2: Array) -> tuple[Array, Array]:
  """Threefry-2x32 (20 rounds) of the counter pair (x1, x2) under the key (k1, k2): the
  hash of `jax.random`, unrolled. All uint32, broadcast together."""
  ks = (k1, k2, k1 ^ k2 ^ _PARITY)
  x1, x2 = x1 + ks[0], x2 + ks[1]
  for group in range(5):
    for r in _ROTATIONS[group % 2]:
      x1 = x1 + x2
      x2 = _rotate_left(x2, r) ^ x1
    x1 = x1 + ks[(group + 1) % 3]
    x2 = x2 + ks[(group + 2) % 3] + np.uint32(group + 1)
  return x1, x2


def _fast(keys: Array, dtype=jnp.float32) -> bool:
  """Whether the unrolled path reproduces jax.random for these keys and this dtype."""
  if not jax.config.jax_threefry_partitionable or jnp.dtype(dtype) != jnp.float32:
    return False
  if jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key):
    return str(jax.random.key_impl(keys)) == "threefry2x32"
  return jax.config.jax_default_prng_impl == "threefry2x32" and keys.shape[-1:] == (2,)


def _key_words(keys: Array) -> tuple[Array, Array]:
  data = jax.random.key_data(keys) if jax.dtypes.issubdtype(keys.dtype,
                                                          jax.dtypes.prng_key) else keys
  return data[..., 0], data[..., 1]


def fold_in(keys: Array, data) -> Array:
  """`jax.random.fold_in` of every key of a batch (typed or raw keys, any batch shape)."""
  if not _fast(keys):
    batch_ndim = keys.ndim - (0 if jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key) else 1)
    fold = lambda k: jax.random.fold_in(k, data)
    for _ in range(batch_ndim):
      fold = jax.vmap(fold)
    return fold(keys)
  k1, k2 = _key_words(keys)
  out = jnp.stack(hash_2x32(k1, k2, jnp.uint32(0), jnp.asarray(data, jnp.uint32)), -1)
  if jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(out, impl=jax.random.key_impl(keys))
  return out


def _bits(keys_B: Array, shape: tuple[int, ...]) -> Array:
  """32 random bits of `shape` per row key (B x shape), as `jax.random.bits` draws them:
  the hash of each element's flat index, its two words xor-ed."""
  size = int(np.prod(shape))
  if size >= 2 ** 32:
    raise ValueError(f"shape={shape} holds {size} draws; at most 2**32 - 1 per row.")
  k1, k2 = (w.reshape(w.shape + (1,) * len(shape)) for w in _key_words(keys_B))
  index = jnp.arange(size, dtype=jnp.uint32).reshape(shape)
  bits1, bits2 = hash_2x32(k1, k2, jnp.uint32(0), index)
  return bits1 ^ bits2


def _unit_floats(bits: Array) -> Array:
  """Floats in [0, 1) from the top 23 bits (jax.random.uniform's construction)."""
  one = np.array(1.0, np.float32).view(np.uint32)
  return jax.lax.bitcast_convert_type((bits >> np.uint32(9)) | one, jnp.float32) - 1.0


def uniform(keys_B: Array, shape: tuple[int, ...], dtype=jnp.float32) -> Array:
  """`jax.random.uniform(key, shape, dtype)` for each row key: B x shape."""
  if not _fast(keys_B, dtype):
    return jax.vmap(lambda k: jax.random.uniform(k, shape, dtype))(keys_B)
  return jnp.maximum(0.0, _unit_floats(_bits(keys_B, shape)))


def gumbel(keys_B: Array, shape: tuple[int, ...], dtype=jnp.float32) -> Array:
  """`jax.random.gumbel(key, shape, dtype)` (mode "low") for each row key: B x shape."""
  if not _fast(keys_B, dtype) or jax.config.jax_high_dynamic_range_gumbel:
    return jax.vmap(lambda k: jax.random.gumbel(k, shape, dtype))(keys_B)
  tiny = np.float32(np.finfo(np.float32).tiny)
  u = jnp.maximum(tiny, _unit_floats(_bits(keys_B, shape)) * (np.float32(1.0) - tiny) + tiny)
  return -jnp.log(-jnp.log(u))
