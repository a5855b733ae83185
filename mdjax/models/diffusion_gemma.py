"""DiffusionGemma's network (google-deepmind/gemma `gemma/diffusion`: `DiffusionGemma_26B_A4B`,
a `Gemma4_26B_A4B` with `DiffusionMixin` and a `SelfConditioning` block), in JAX, on the
Gemma 4 blocks of `gemma_blocks`.

One set of weights runs two ways:
- the encoder pass (gemma's plain `Transformer.__call__`): token embeddings times sqrt(D),
  causal attention; it writes the prompt, and each finished canvas, into the key/value cache
  (`encode`);
- the decoder pass (`call_with_self_conditioning`): the canvas's embeddings plus the
  self-conditioning signal (a gated MLP of the RMS-normed previous step's soft embedding,
  `encode_condition`), RMS-normed without scale; attention bidirectional over the canvas and
  to the cache, which it reads without writing (`decode`).
Global layers see every key; local (sliding) layers a key within `sliding_window` positions of
the query, both ways (gemma's block-local mask intersected with its per-position sliding
mask). Logits: final RMSNorm, the tied embedding's transpose, tanh soft-cap at 30.

`forward(..., prompt_length=P)` is both in one pass over [prompt; canvas]: the first P
positions run as the encoder (causal, plain embeddings) and the rest as the decoder; since no
prompt position sees the canvas, its keys and values are those the encoder pass would have
cached, so the canvas's logits equal `decode` after `encode` of the prompt (P = 0: gemma's
sampler without a cache).

Params (gemma's einsum layouts; the layers of each kind stacked in order, so a `lax.scan`
over repeats of the attention pattern keeps compile time flat in depth):

  params = {
    "embed": [V, D],
    "local": {...}, "global": {...},   # `param_shapes`: each leaf [N_kind, ...]
    "final_norm": [D],
    "self_condition": {"pre_norm": [D], "gating": [2, C, D], "linear": [C, D]},
  }

The denoiser is time-free (t_B ignored); `condition_BxLxD` (the self-conditioning input) is
optional and absent means gemma's first step (all zeros).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mdjax.denoiser import Denoiser
from mdjax.models import checks, layers
from mdjax.models import gemma_blocks as blocks

Array = jax.Array

FAMILY = "diffusion_gemma"
KINDS = ("local", "global")
DTYPES = ("float32", "bfloat16")
# gemma's Gemma4_26B_A4B attention pattern: five sliding layers, then a global one.
PUBLISHED_PATTERN = ("local",) * 5 + ("global",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiffusionGemmaConfig:
  """The architecture (frozen: static under jit); the defaults are DiffusionGemma 26B-A4B's
  (gemma's `Gemma4_26B_A4B.config`).

  layer_types: "local" (sliding window) or "global" per layer. Local layers: num_kv_heads
  heads of head_dim, RoPE base local_rope_theta on local_rope_proportion of each head;
  global layers: num_global_kv_heads of global_head_dim, global_rope_theta on
  global_rope_proportion, values from the key projection when k_eq_v_global. num_experts 0:
  a dense MLP of mlp_hidden; else the shared dense MLP of mlp_hidden beside num_experts
  experts of expert_hidden, experts_per_token chosen. condition_hidden: the
  self-conditioning MLP's width (gemma: the config's hidden_dim). dtype: the weights' and
  activations' (softmax, router and logits float32).
  """

  family: str = FAMILY
  vocab_size: int = 262144
  d_model: int = 2816
  layer_types: tuple[str, ...] = PUBLISHED_PATTERN * 5
  num_heads: int = 16
  head_dim: int = 256
  num_kv_heads: int = 8
  global_head_dim: int = 512
  num_global_kv_heads: int = 2
  k_eq_v_global: bool = True
  sliding_window: int = 1024
  local_rope_theta: float = 10_000.0
  global_rope_theta: float = 1_000_000.0
  local_rope_proportion: float = 1.0
  global_rope_proportion: float = 0.25
  mlp_hidden: int = 2112
  num_experts: int = 128
  experts_per_token: int = 8
  expert_hidden: int = 704
  condition_hidden: int = 2112
  final_logit_softcap: float | None = 30.0
  max_len: int = 262144
  dtype: str = "bfloat16"
  pad_id: int = 0
  eos_id: int | None = 1
  eot_id: int | None = 106

  def __post_init__(self):
    checks.check_common(self, (FAMILY,), DTYPES,
                        counts=("vocab_size", "d_model", "num_heads", "head_dim",
                                "num_kv_heads", "global_head_dim", "num_global_kv_heads",
                                "sliding_window", "mlp_hidden", "condition_hidden", "max_len"),
                        positive=("local_rope_theta", "global_rope_theta"))
    if not (isinstance(self.layer_types, tuple) and self.layer_types
            and all(kind in KINDS for kind in self.layer_types)):
      raise ValueError(f"layer_types={self.layer_types!r} must be a non-empty tuple of "
                       f"{KINDS}.")
    for name, groups in (("num_kv_heads", self.num_kv_heads),
                         ("num_global_kv_heads", self.num_global_kv_heads)):
      if self.num_heads % groups:
        raise ValueError(f"{name}={groups} must divide num_heads={self.num_heads}.")
    for name in ("head_dim", "global_head_dim"):
      if getattr(self, name) % 2:
        raise ValueError(f"{name}={getattr(self, name)} must be even (RoPE turns halves).")
    for name in ("local_rope_proportion", "global_rope_proportion"):
      value = getattr(self, name)
      if not (checks.is_number(value) and 0 <= value <= 1):
        raise ValueError(f"{name}={value!r} must be a number in [0, 1].")
    checks.check_count("num_experts", self.num_experts, 0)
    if self.num_experts:
      checks.check_count("expert_hidden", self.expert_hidden)
      if not (checks.is_int(self.experts_per_token)
              and 1 <= self.experts_per_token <= self.num_experts):
        raise ValueError(f"experts_per_token={self.experts_per_token!r} must be an integer in "
                         f"[1, num_experts={self.num_experts}].")
    if not isinstance(self.k_eq_v_global, bool):
      raise ValueError(f"k_eq_v_global={self.k_eq_v_global!r} must be True or False.")
    if self.final_logit_softcap is not None and not (
        checks.is_number(self.final_logit_softcap) and self.final_logit_softcap > 0):
      raise ValueError(f"final_logit_softcap={self.final_logit_softcap!r} must be None or > 0.")
    for name in ("pad_id", "eos_id", "eot_id"):
      value = getattr(self, name)
      if value is not None and not (checks.is_int(value) and 0 <= value < self.vocab_size):
        raise ValueError(f"{name}={value!r} must be an id in [0, vocab_size={self.vocab_size}).")

  @property
  def num_layers(self) -> int:
    return len(self.layer_types)

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  def kind_count(self, kind: str) -> int:
    return self.layer_types.count(kind)

  def rope_of(self, kind: str) -> tuple[float, float]:
    """(base, proportion) of a layer kind's RoPE."""
    if kind == "local":
      return self.local_rope_theta, self.local_rope_proportion
    return self.global_rope_theta, self.global_rope_proportion

  def heads_of(self, kind: str) -> tuple[int, int]:
    """(key/value heads, head size) of a layer kind."""
    if kind == "local":
      return self.num_kv_heads, self.head_dim
    return self.num_global_kv_heads, self.global_head_dim

  def k_eq_v(self, kind: str) -> bool:
    return kind == "global" and self.k_eq_v_global


def pattern(layer_types: tuple[str, ...]) -> tuple[tuple[str, ...], int]:
  """(the shortest pattern the layer kinds repeat, whole repeats): the layers are the
  pattern `repeats` times, then its first len(layer_types) - repeats * len(pattern)."""
  n = len(layer_types)
  for period in range(1, n + 1):
    if all(layer_types[i] == layer_types[i % period] for i in range(n)):
      return layer_types[:period], n // period
  raise AssertionError("unreachable: the whole tuple is a period")


# --- parameters ---------------------------------------------------------------------------


def _layer_shapes(config: DiffusionGemmaConfig, kind: str, n: int) -> dict:
  d, heads = config.d_model, config.num_heads
  groups, k = config.heads_of(kind)
  shapes = {"attn_norm": (n, d), "q": (n, heads, d, k), "q_norm": (n, k), "k_norm": (n, k),
            "o": (n, heads, k, d), "post_attn_norm": (n, d), "skip_scale": (n, 1)}
  if config.k_eq_v(kind):
    shapes["k"] = (n, groups, d, k)
  else:
    shapes["kv"] = (n, 2, groups, d, k)
  f = config.mlp_hidden
  if not config.num_experts:
    shapes.update(pre_ffw_norm=(n, d), mlp_gating=(n, 2, f, d), mlp_linear=(n, f, d),
                  post_ffw_norm=(n, d))
    return shapes
  e, fe = config.num_experts, config.expert_hidden
  shapes.update(pre_ffw2_norm=(n, d), mlp2_gating=(n, 2, f, d), mlp2_linear=(n, f, d),
                post_ffw2_norm=(n, d), pre_ffw_norm=(n, d), router=(n, d, e),
                router_scale=(n, d), per_expert_scale=(n, e), experts_gating=(n, e, 2, fe, d),
                experts_linear=(n, e, fe, d), post_ffw1_norm=(n, d), post_ffw_norm=(n, d))
  return shapes


def param_shapes(config: DiffusionGemmaConfig) -> dict:
  """The params pytree's shapes (the module docstring's layout; a kind without layers is
  left out)."""
  d, c = config.d_model, config.condition_hidden
  out = {"embed": (config.vocab_size, d), "final_norm": (d,),
         "self_condition": {"pre_norm": (d,), "gating": (2, c, d), "linear": (c, d)}}
  for kind in KINDS:
    if config.kind_count(kind):
      out[kind] = _layer_shapes(config, kind, config.kind_count(kind))
  return out


def init_params(config: DiffusionGemmaConfig, key: Array) -> dict:
  """Random params in the config's dtype (normal 0.02 matrices, unit norms and scales): for
  tests and benchmarks."""
  shapes = param_shapes(config)
  flat, treedef = jax.tree_util.tree_flatten_with_path(
      shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(key, len(flat))
  dtype = config.jnp_dtype

  def one(path, shape, k):
    name = jax.tree_util.keystr(path)
    if "norm" in name or "scale" in name:
      return jnp.ones(shape, dtype)
    return (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

  return jax.tree.unflatten(treedef, [one(p, s, k) for (p, s), k in zip(flat, keys)])


def num_params(config: DiffusionGemmaConfig) -> int:
  shapes = jax.tree.leaves(param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
  return int(sum(np.prod(s) for s in shapes))


# --- the layers ---------------------------------------------------------------------------


def _over_layers(config: DiffusionGemmaConfig, params: dict, h: Array, layer_fn,
                 cached: dict | None = None):
  """`layer_fn(h, layer, kind, cached_kv) -> (h, kv)` over the layers in order: a
  `lax.scan` over the repeats of the pattern (the pattern unrolled in its body), then the
  remainder unrolled. `cached`: {kind: (keys, values)} stacked like params[kind], handed to
  each layer as its own. Returns (h, {kind: kv stacked over that kind's layers})."""
  kinds_in, repeats = pattern(config.layer_types)
  per_repeat = {kind: kinds_in.count(kind) for kind in KINDS if kinds_in.count(kind)}

  def stacked(kind, tree, first, count, as_groups):
    def take(x):
      x = jax.lax.slice_in_dim(x, first, first + count * (repeats if as_groups else 1))
      return x.reshape((repeats, count) + x.shape[1:]) if as_groups else x
    return jax.tree.map(take, tree)

  def run(h, sequence, layer_of, cached_of):
    outs = {kind: [] for kind in KINDS}
    seen = {kind: 0 for kind in KINDS}
    for kind in sequence:
      j = seen[kind]
      seen[kind] += 1
      h, kv = layer_fn(h, jax.tree.map(lambda x: x[j], layer_of[kind]), kind,
                       None if cached_of is None else jax.tree.map(lambda x: x[j],
                                                                     cached_of[kind]))
      outs[kind].append(kv)
    return h, {kind: jax.tree.map(lambda *xs: jnp.stack(xs), *v) for kind, v in outs.items()
               if v}

  kv_out = {}
  if repeats:
    xs = ({kind: stacked(kind, params[kind], 0, n, True) for kind, n in per_repeat.items()},
          None if cached is None else
          {kind: stacked(kind, cached[kind], 0, n, True) for kind, n in per_repeat.items()})
    h, kv_groups = jax.lax.scan(lambda h, x: run(h, kinds_in, x[0], x[1]), h, xs)
    kv_out = {kind: jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), kv)
              for kind, kv in kv_groups.items()}
  rest = config.layer_types[repeats * len(kinds_in):]
  if rest:
    done = {kind: repeats * per_repeat.get(kind, 0) for kind in KINDS}
    count = {kind: rest.count(kind) for kind in KINDS if rest.count(kind)}
    layer_of = {kind: stacked(kind, params[kind], done[kind], n, False)
                for kind, n in count.items()}
    cached_of = None if cached is None else {
        kind: stacked(kind, cached[kind], done[kind], n, False) for kind, n in count.items()}
    h, kv_rest = run(h, rest, layer_of, cached_of)
    for kind, kv in kv_rest.items():
      kv_out[kind] = (jax.tree.map(lambda a, b: jnp.concatenate([a, b]), kv_out[kind], kv)
                      if kind in kv_out else kv)
  return h, kv_out


def _embed(config: DiffusionGemmaConfig, params: dict, tokens_BxL: Array) -> Array:
  """gemma's `Embedder.encode`: the embedding row times sqrt(D), in the weights' dtype."""
  x = jnp.take(params["embed"], tokens_BxL, axis=0).astype(config.jnp_dtype)
  return x * jnp.sqrt(config.d_model).astype(x.dtype)


def decoder_inputs(config: DiffusionGemmaConfig, params: dict, tokens_BxL: Array,
                   condition_BxLxD: Array | None) -> Array:
  """The decoder pass's input (gemma's `SelfConditioning`): RMSNorm without scale of the
  embeddings plus the gated MLP of the RMS-normed condition (absent: zeros, whose signal is
  exactly zero)."""
  x = _embed(config, params, tokens_BxL)
  if condition_BxLxD is not None:
    sc = params["self_condition"]
    signal = blocks.gated_mlp(blocks.rms_norm(condition_BxLxD.astype(x.dtype), sc["pre_norm"]),
                              sc["gating"], sc["linear"])
    x = x + signal
  return blocks.rms_norm(x)


def encode_condition(config: DiffusionGemmaConfig, params: dict, shaped_BxLxV: Array) -> Array:
  """gemma's `Embedder.encode_logits`: the next step's self-conditioning input from a step's
  shaped logits, softmax (float32, cast to the logits' dtype) times the embedding, times
  sqrt(D): B x L x D."""
  probs = jax.nn.softmax(shaped_BxLxV.astype(jnp.float32), axis=-1).astype(shaped_BxLxV.dtype)
  x = jnp.einsum("...v,vd->...d", probs, params["embed"].astype(probs.dtype))
  return x * jnp.sqrt(config.d_model).astype(x.dtype)


def _logits(config: DiffusionGemmaConfig, params: dict, h_BxQxD: Array) -> Array:
  """Final norm, the tied head, the tanh soft-cap: float32 logits."""
  x = blocks.rms_norm(h_BxQxD, params["final_norm"])
  logits = jnp.einsum("bqd,vd->bqv", x, params["embed"].astype(x.dtype),
                      preferred_element_type=jnp.float32)
  cap = config.final_logit_softcap
  return logits if cap is None else jnp.tanh(logits / cap) * cap


def _layer(config: DiffusionGemmaConfig, h: Array, layer: dict, kind: str, pos_BxQ: Array,
           parts_of) -> tuple[Array, tuple[Array, Array]]:
  """One block: its attention over `parts_of(kind, keys, values)` (the key parts, this
  pass's fresh keys and values given), then the rest. Returns (h, fresh keys and values)."""
  base, proportion = config.rope_of(kind)
  x = blocks.rms_norm(h, layer["attn_norm"])
  q, k, v = blocks.projections(layer, x, pos_BxQ, base, proportion, config.k_eq_v(kind))
  attn = blocks.attend(q, parts_of(kind, k, v))
  experts = config.experts_per_token if config.num_experts else None
  return blocks.block_out(layer, h, attn, experts), (k, v)


def _sliding(config: DiffusionGemmaConfig, kind: str, pos_q: Array, pos_k: Array) -> Array:
  """B x Q x S: keys within the sliding window of each query, both ways (global: all)."""
  if kind == "global":
    return jnp.ones(pos_q.shape[:1] + pos_q.shape[1:] + pos_k.shape[-1:], bool)
  gap = pos_k[:, None, :] - pos_q[:, :, None]
  return (gap > -config.sliding_window) & (gap < config.sliding_window)


# --- the passes ----------------------------------------------------------------------------


def _positions(valid_BxL: Array | None, length: int, start_B: Array | None = None) -> Array:
  """RoPE positions B x L (1 x L without padding or offset): counted from each row's first
  real token (padding takes its neighbour's; it is never seen), after `start_B`."""
  if valid_BxL is None:
    pos = jnp.arange(length, dtype=jnp.int32)[None]
  else:
    pos = jnp.maximum(jnp.cumsum(valid_BxL.astype(jnp.int32), axis=1) - 1, 0)
  return pos if start_B is None else pos + start_B[:, None]


def forward(config: DiffusionGemmaConfig, params: dict, tokens_BxL: Array,
            valid_BxL: Array | None = None, condition_BxLxD: Array | None = None,
            prompt_length: int = 0) -> Array:
  """logits_BxLxV (float32) of [prompt; canvas]: the first `prompt_length` positions run as
  the encoder (causal, plain embeddings), the others as the decoder (bidirectional, with the
  self-conditioning input `condition_BxLxD`, read at the canvas positions); module
  docstring. `valid_BxL` False on padding (never attended)."""
  tokens_BxL = jnp.asarray(tokens_BxL, jnp.int32)
  batch, length = tokens_BxL.shape
  layers.check_length(length, config.max_len)
  if not (checks.is_int(prompt_length) and 0 <= prompt_length <= length):
    raise ValueError(f"prompt_length={prompt_length!r} must be an integer in [0, {length}].")
  pos_BxL = _positions(valid_BxL, length)
  query_L, key_L = np.arange(length)[:, None], np.arange(length)[None]
  seen_LxL = jnp.asarray((query_L >= prompt_length) | (key_L <= query_L))[None]
  if valid_BxL is not None:
    seen_LxL = seen_LxL & jnp.asarray(valid_BxL, bool)[:, None, :]
  seen = {kind: seen_LxL & _sliding(config, kind, pos_BxL, pos_BxL) for kind in KINDS}
  encoder_Lx1 = jnp.asarray(np.arange(length) < prompt_length)[None, :, None]
  h = jnp.where(encoder_Lx1, _embed(config, params, tokens_BxL),
                decoder_inputs(config, params, tokens_BxL, condition_BxLxD))

  def layer_fn(h, layer, kind, _):
    h, _ = _layer(config, h, layer, kind, pos_BxL, lambda kind, k, v: [(k, v, seen[kind])])
    return h, ()

  h, _ = _over_layers(config, params, h, layer_fn)
  return _logits(config, params, h)


@struct.dataclass
class GemmaCache:
  """The encoder's keys and values, per layer kind stacked over its layers, heads-major
  ({kind: N x B x G x S x K}), with each slot's RoPE position and validity; `end`: the slots
  written (one count for the batch, as gemma's cache); `next_B`: each row's next position.
  The decoder pass reads it without writing."""

  keys: dict
  values: dict
  positions_BxS: Array
  valid_BxS: Array
  end: Array
  next_B: Array

  @property
  def length(self) -> int:
    return self.positions_BxS.shape[1]


def init_cache(config: DiffusionGemmaConfig, batch: int, length: int) -> GemmaCache:
  """An empty cache of `length` slots."""
  layers.check_length(length, config.max_len)
  keys, values = {}, {}
  for kind in KINDS:
    if config.kind_count(kind):
      groups, k = config.heads_of(kind)
      shape = (config.kind_count(kind), batch, groups, length, k)
      keys[kind] = jnp.zeros(shape, config.jnp_dtype)
      values[kind] = jnp.zeros(shape, config.jnp_dtype)
  return GemmaCache(keys=keys, values=values,
                    positions_BxS=jnp.zeros((batch, length), jnp.int32),
                    valid_BxS=jnp.zeros((batch, length), bool), end=jnp.zeros((), jnp.int32),
                    next_B=jnp.zeros((batch,), jnp.int32))


def encode(config: DiffusionGemmaConfig, params: dict, cache: GemmaCache, tokens_BxW: Array,
           valid_BxW: Array | None = None) -> GemmaCache:
  """The encoder pass: the W tokens (the prompt, a finished canvas) attend causally to the
  cache and to each other, and their keys and values are written at slots [end, end + W)
  (gemma's prefill and `append_tokens_to_cache`). Padding (`valid_BxW` False) is written
  but never seen, and takes no position."""
  tokens_BxW = jnp.asarray(tokens_BxW, jnp.int32)
  batch, width = tokens_BxW.shape
  layers.check_window(width, cache.length)
  valid_BxW = (jnp.ones((batch, width), bool) if valid_BxW is None
               else jnp.asarray(valid_BxW, bool))
  pos_BxW = _positions(valid_BxW, width, cache.next_B)
  causal_WxW = jnp.asarray(np.tril(np.ones((width, width), bool)))[None] & valid_BxW[:, None]
  old_Bx1xS = cache.valid_BxS[:, None, :]
  seen = {kind: ((old_Bx1xS & _sliding(config, kind, pos_BxW, cache.positions_BxS)),
                 causal_WxW & _sliding(config, kind, pos_BxW, pos_BxW)) for kind in KINDS}

  def layer_fn(h, layer, kind, cached_kv):
    old_k, old_v = cached_kv
    return _layer(config, h, layer, kind, pos_BxW,
                  lambda kind, k, v: [(old_k, old_v, seen[kind][0]), (k, v, seen[kind][1])])

  _, fresh = _over_layers(config, params, _embed(config, params, tokens_BxW), layer_fn,
                          cached={kind: (cache.keys[kind], cache.values[kind])
                                  for kind in cache.keys})
  write = lambda old, new: layers.write_window(old, new, cache.end)
  return GemmaCache(
      keys={kind: write(cache.keys[kind], fresh[kind][0]) for kind in cache.keys},
      values={kind: write(cache.values[kind], fresh[kind][1]) for kind in cache.keys},
      positions_BxS=jax.lax.dynamic_update_slice_in_dim(cache.positions_BxS, pos_BxW,
                                                        cache.end, axis=1),
      valid_BxS=jax.lax.dynamic_update_slice_in_dim(cache.valid_BxS, valid_BxW, cache.end,
                                                    axis=1),
      end=cache.end + width, next_B=cache.next_B + valid_BxW.sum(-1, dtype=jnp.int32))


def decode(config: DiffusionGemmaConfig, params: dict, cache: GemmaCache, canvas_BxW: Array,
           condition_BxWxD: Array | None = None) -> Array:
  """The decoder pass over the canvas at the positions after the cache's (gemma's
  `call_with_self_conditioning` with the cache): bidirectional over the canvas and to every
  cached key (local layers: within the sliding window), the cache read, not written.
  Returns logits_BxWxV (float32)."""
  canvas_BxW = jnp.asarray(canvas_BxW, jnp.int32)
  batch, width = canvas_BxW.shape
  pos_BxW = _positions(None, width, cache.next_B)
  old_Bx1xS = cache.valid_BxS[:, None, :]
  seen = {kind: (old_Bx1xS & _sliding(config, kind, pos_BxW, cache.positions_BxS),
                 _sliding(config, kind, pos_BxW, pos_BxW)) for kind in KINDS}

  def layer_fn(h, layer, kind, cached_kv):
    old_k, old_v = cached_kv
    h, _ = _layer(config, h, layer, kind, pos_BxW,
                  lambda kind, k, v: [(old_k, old_v, seen[kind][0]), (k, v, seen[kind][1])])
    return h, ()

  h, _ = _over_layers(config, params, decoder_inputs(config, params, canvas_BxW,
                                                     condition_BxWxD), layer_fn,
                      cached={kind: (cache.keys[kind], cache.values[kind])
                              for kind in cache.keys})
  return _logits(config, params, h)


# --- the Denoiser -------------------------------------------------------------------------


def _apply(config, prompt_length, params, tokens_BxL, t_B, valid_BxL=None, condition=None):
  del t_B  # time-free
  return forward(config, params, tokens_BxL, valid_BxL, condition, prompt_length)


def _encode_condition(config, params, shaped_BxLxV):
  return encode_condition(config, params, shaped_BxLxV)


def _real(config: DiffusionGemmaConfig, tokens: Array) -> Array:
  """The tokens with every id outside the vocabulary (a canvas's mask id V) as padding:
  such positions are never seen, but an embedding row past the table would be NaN."""
  tokens = jnp.asarray(tokens, jnp.int32)
  return jnp.where(tokens < config.vocab_size, tokens, config.pad_id)


def _prefill(config, prompt_length, params, tokens_BxL, t_B, valid_BxL=None, condition=None):
  """The full pass over the canvas (`forward`) and the cache its decoder reads: the first
  `prompt_length` positions encoded, room for the rest of the canvas."""
  logits = _apply(config, prompt_length, params, _real(config, tokens_BxL), t_B, valid_BxL,
                  condition)
  cache = init_cache(config, tokens_BxL.shape[0], tokens_BxL.shape[1])
  if prompt_length:
    valid = None if valid_BxL is None else valid_BxL[:, :prompt_length]
    cache = encode(config, params, cache, _real(config, tokens_BxL[:, :prompt_length]), valid)
  return logits, cache


def _decode(config, params, cache, tokens_BxW, start, t_B, valid_BxL=None, condition=None):
  """The canvas's decoder pass against the cache (`decode`), and the cache with the canvas
  encoded after it (`encode`: gemma's `append_tokens_to_cache` of a finished canvas). The
  canvas's positions follow the cache's, so `start` and the padding are the cache's."""
  del start, t_B, valid_BxL
  tokens_BxW = _real(config, tokens_BxW)
  return (decode(config, params, cache, tokens_BxW, condition),
          encode(config, params, cache, tokens_BxW))


def _train_apply(config, vocab, params, tokens_BxL, t_B, valid_BxL=None, condition=None):
  params = jax.tree.map(lambda p: p.astype(config.jnp_dtype), params)
  logits = _apply(config, 0, params, tokens_BxL, t_B, valid_BxL, condition)
  return logits if vocab is None else logits[..., :vocab]


def training_denoiser(config: DiffusionGemmaConfig, vocab: int | None = None) -> Denoiser:
  """The network as a fine-tuning run trains it (`train.init_from` a DiffusionGemma params
  checkpoint): float32 master parameters cast to `config.dtype`, every position a decoder
  position (a sequence noised whole, as the NELBO of `objective='nelbo'` noises it), the
  logits of ids [0, vocab) when the task has fewer ids than the vocabulary (vocab None:
  all, and the self-conditioning input). Equal arguments give equal values."""
  return Denoiser(apply=layers.bind(_train_apply, config, vocab),
                  encode_condition=(None if vocab is not None
                                    else layers.bind(_encode_condition, config)),
                  max_len=config.max_len)


def denoiser(config: DiffusionGemmaConfig, prompt_length: int = 0) -> Denoiser:
  """The model as a `Denoiser` (t_B ignored) whose `apply` takes `condition=` and whose
  `encode_condition` makes it from a step's shaped logits; the first `prompt_length`
  positions of a canvas run as the encoder (`forward`).

  Its cached passes are the encoder and the decoder: `prefill(params, tokens_BxL, t_B,
  valid_BxL)` -> (the canvas's logits, a cache of its first `prompt_length` positions
  encoded, with room for the rest); `decode(params, cache, tokens_BxW, start, t_B,
  condition=)` -> (the W tokens' logits as the decoder reading the cache, the cache with
  them encoded after it). A caller that drops a pass's other output leaves XLA to drop its
  work. Its functions are `layers.Bound`: equal for equal configs, so equal Denoisers share
  programs."""
  return Denoiser(apply=layers.bind(_apply, config, prompt_length),
                  prefill=layers.bind(_prefill, config, prompt_length),
                  decode=layers.bind(_decode, config),
                  encode_condition=layers.bind(_encode_condition, config),
                  max_len=config.max_len)
