"""LoRA: low-rank adapters on the matrices of any mdjax model, trained by the train loop.

A targeted matrix W [..., in, out] (leading stacked-layer axes kept) gets adapters
A [..., in, r] (small random) and B [..., r, out] (zeros), and the model runs on

  W' = stop_gradient(W) + (alpha / r) * A @ B

(the merged-weight formulation: the base model's own code runs on W', so every
architecture and every pass it offers is adapted by one code path, exactly). With B = 0 the
adapted model is the base model bit for bit. The base gets no gradient and no optimizer
state; what the formulation costs is the gradient of each targeted W', full-size, formed
once a step and reduced to A's and B's (per-token adapters, x A B beside x W, would avoid
it, but need each model's layers to take them).

Parameters of an adapted model are {"base": base params, "lora": adapters}; the adapters
mirror the base tree down to each targeted matrix, which holds {target: {"a", "b"}} (a
fused matrix, such as mdjax's Transformer's qkv, holds one adapter per target on its
columns).

Targets are names: "q", "k", "v", "o", "gate", "up", "down", and the groups "attention"
(q, k, v, o) and "mlp" (gate, up, down). Each architecture's matrices:

  published (LLaDA, Dream, SDAR, ...)  layers/q, k, v, o, gate, up, down; an MoE layer's
                                       experts_* and shared_* gate, up, down (not the router)
  mdjax's Transformer                  blocks/i/qkv/kernel (q, k, v: thirds of its columns),
                                       proj (o), mlp_in (gate, up: halves for SwiGLU; up for
                                       GELU), mlp_out (down)
  DiT (MDLM, BD3-LM)                   blocks/qkv (thirds), attn_out (o), mlp_in (up), mlp_out

Dropout on the adapters' inputs needs the adapter applied per token (x A B beside x W),
which the merged formulation does not do: `LoraConfig` refuses dropout > 0.

Training (`config.train.lora`, rank 0 = off; `mdjax.train.state`): `init` the adapters,
`adapt` the denoiser, `optimizer` keeps optimizer state for the adapters only. `merge` /
`merged` give plain params of the base layout (the SFT export, `mdjax.load` of a workdir).
`lr_scaled` is the layer-wise learning rate of `config.train.lr_scales`, by the same names
plus "embed", "head" and "norm".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mdjax.denoiser import Denoiser

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
GROUPS = {"attention": ("q", "k", "v", "o"), "mlp": ("gate", "up", "down")}
# The names of `lr_scales`: the targets, their groups and the leaves no target covers.
LR_NAMES = TARGETS + tuple(GROUPS) + ("embed", "head", "norm")
# The adapters' random draw: fold_in(key(seed), LORA_INIT) in `mdjax.train.state`, apart
# from the model's own initialisation and from every sampling and training stream.
LORA_INIT = 0x4C6F5241  # "LoRA"

# Each architecture's matrix names (the key naming a leaf, or a kernel's parent) -> the
# targets on its columns, in order, each taking an equal share (a fused matrix).
_WHOLE = {name: (name,) for name in TARGETS}
_WHOLE.update({f"{kind}_{name}": (name,) for kind in ("experts", "shared")
               for name in ("gate", "up", "down")})
_WHOLE.update(qkv=("q", "k", "v"), proj=("o",), attn_out=("o",), mlp_out=("down",))
_EMBEDS = ("embed", "embedding")
_HEADS = ("head", "linear")  # the published and Transformer head; DiT's final linear


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Adapters of rank `rank` on the `targets` (names or groups), scaled by alpha / rank."""

  rank: int
  alpha: float
  targets: tuple[str, ...]
  dropout: float = 0.0

  def __post_init__(self):
    if not (isinstance(self.rank, (int, np.integer)) and not isinstance(self.rank, bool)
            and self.rank >= 1):
      raise ValueError(f"rank={self.rank!r} must be an integer >= 1.")
    if not (isinstance(self.alpha, (int, float, np.number)) and not isinstance(self.alpha, bool)
            and math.isfinite(self.alpha) and self.alpha > 0):
      raise ValueError(f"alpha={self.alpha!r} must be a finite number > 0.")
    targets = (self.targets,) if isinstance(self.targets, str) else self.targets
    allowed = TARGETS + tuple(GROUPS)
    if not (isinstance(targets, (tuple, list)) and targets
            and all(isinstance(t, str) and t in allowed for t in targets)
            and len(set(targets)) == len(targets)):
      raise ValueError(f"targets={self.targets!r} must be a non-empty tuple of distinct names "
                       f"from {allowed}.")
    if not (isinstance(self.dropout, (int, float, np.number))
            and not isinstance(self.dropout, bool) and self.dropout == 0):
      raise ValueError(f"dropout={self.dropout!r}: only 0 is allowed. The adapters are merged "
                       "into the weights (W + scale * A @ B), which cannot drop an adapter's "
                       "input per token.")
    object.__setattr__(self, "rank", int(self.rank))
    object.__setattr__(self, "alpha", float(self.alpha))
    object.__setattr__(self, "targets", tuple(targets))
    object.__setattr__(self, "dropout", float(self.dropout))

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  @property
  def names(self) -> tuple[str, ...]:
    """The targets with the groups spelled out, in `TARGETS` order."""
    chosen = {n for t in self.targets for n in GROUPS.get(t, (t,))}
    return tuple(n for n in TARGETS if n in chosen)


def config_of(config) -> LoraConfig | None:
  """The `LoraConfig` of a training config's `train.lora` (or of a train section's `lora`);
  None when LoRA is off: no `train.lora` (a config saved before it existed) or rank 0."""
  train = config.get("train") if config.get("train") is not None else config
  lora = train.get("lora")
  if lora is None or not lora.get("rank"):
    return None
  targets = lora.get("targets", GROUPS["attention"])
  return LoraConfig(rank=lora.get("rank"), alpha=lora.get("alpha", 16.0),
                    targets=targets if isinstance(targets, str) else tuple(targets),
                    dropout=lora.get("dropout", 0.0))


# ----------------------------------------------------------------------------
# The matrices of a params tree.
# ----------------------------------------------------------------------------


def _key(entry) -> Any:
  for name in ("key", "idx", "name"):
    if hasattr(entry, name):
      return getattr(entry, name)
  raise ValueError(f"params: unexpected tree node {entry!r}.")


def _flat(tree) -> dict[tuple, Any]:
  """{path as a tuple of keys: leaf}."""
  return {tuple(_key(e) for e in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _owner(path: tuple) -> Any:
  """The name of a leaf: its key, or its parent's for an nnx kernel, bias or embedding."""
  return path[-2] if path[-1] in ("kernel", "bias", "embedding", "scale") and len(path) > 1 \
      else path[-1]


def _segments(path: tuple, leaf, flat: dict) -> list[tuple[str, int, int]]:
  """[(target, first column, end column)] of a matrix; [] for any other leaf."""
  if len(leaf.shape) < 2 or path[-1] in ("bias", "embedding", "scale"):
    return []
  owner = _owner(path)
  names = _WHOLE.get(owner)
  if owner == "mlp_in":  # SwiGLU's [gate | up], or GELU's up: read from mlp_out's rows
    out = flat.get(tuple("mlp_out" if p == "mlp_in" else p for p in path))
    fused = out is not None and len(out.shape) >= 2 and leaf.shape[-1] == 2 * out.shape[-2]
    names = ("gate", "up") if fused else ("up",)
  if names is None:
    return []
  width = leaf.shape[-1]
  if width % len(names):
    raise ValueError(f"params: matrix {_show(path)} of {width} columns does not split into "
                     f"{names}.")
  share = width // len(names)
  return [(name, i * share, (i + 1) * share) for i, name in enumerate(names)]


def _show(path: tuple) -> str:
  return "/".join(str(p) for p in path)


def _matrices(params) -> dict[tuple, list[tuple[str, int, int]]]:
  """{path: [(target, first column, end column)]} of every matrix a target names."""
  flat = _flat(params)
  found = {}
  for path, leaf in flat.items():
    segments = _segments(path, leaf, flat)
    if segments:
      found[path] = segments
  return found


def _listing(matrices: dict) -> str:
  """The targetable matrices, layer indices folded: 'q: blocks/*/qkv/kernel[0:16]'."""
  seen = {}
  for path, segments in matrices.items():
    shown = _show(tuple("*" if isinstance(p, int) else p for p in path))
    for name, lo, hi in segments:
      whole = len(segments) == 1
      seen.setdefault(f"{name}: {shown}" + ("" if whole else f"[..., {lo}:{hi}]"),
                      TARGETS.index(name))
  return ", ".join(sorted(seen, key=lambda text: seen[text])) or "none"


def _check_adapted(params) -> None:
  if not is_adapted(params):
    keys = sorted(params) if isinstance(params, Mapping) else type(params).__name__
    raise ValueError(f"params: an adapted model's are {{'base', 'lora'}}, got {keys} (LoRA "
                     "params come from mdjax.lora.init, or a LoRA run's train state).")


def _nest(flat: dict[tuple, Any]) -> dict:
  tree = {}
  for path, leaf in flat.items():
    node = tree
    for p in path[:-1]:
      node = node.setdefault(p, {})
    node[path[-1]] = leaf
  return tree


# ----------------------------------------------------------------------------
# Adapters.
# ----------------------------------------------------------------------------


def init(params, lora_config: LoraConfig, key: jax.Array) -> dict:
  """The adapters of `params`' targeted matrices: A [..., in, r] ~ N(0, 1/in) (kaiming's
  scale, so x A keeps x's size), B [..., r, out] zeros, float32. A ValueError naming a
  target that matches no matrix, with the matrices there are."""
  matrices = _matrices(params)
  present = {name for segments in matrices.values() for name, _, _ in segments}
  for target in lora_config.targets:
    if not set(GROUPS.get(target, (target,))) & present:
      raise ValueError(f"targets={lora_config.targets!r}: {target!r} matches no matrix of "
                       f"these params; their matrices: {_listing(matrices)}.")
  wanted = set(lora_config.names)
  flat = _flat(params)
  adapters = {}
  for index, (path, segments) in enumerate(matrices.items()):
    leaf, r = flat[path], lora_config.rank
    *lead, fan_in, _ = leaf.shape
    for name, lo, hi in segments:
      if name not in wanted:
        continue
      k = jax.random.fold_in(jax.random.fold_in(key, index), TARGETS.index(name))
      a = jax.random.normal(k, (*lead, fan_in, r), jnp.float32) / math.sqrt(fan_in)
      adapters[path + (name, "a")] = a
      adapters[path + (name, "b")] = jnp.zeros((*lead, r, hi - lo), jnp.float32)
  return _nest(adapters)


def _merge(params, lora_config: LoraConfig, frozen: bool):
  """The base params with every adapter's scale * A @ B added, in each matrix's dtype;
  `frozen`: the base behind stop_gradient (training)."""
  _check_adapted(params)
  base, flat_lora = params["base"], _flat(params["lora"])
  matrices = _matrices(base)
  flat = _flat(base)
  by_matrix = {}
  for path in flat_lora:
    by_matrix.setdefault(path[:-2], set()).add(path[-2])
  unknown = [p for p in by_matrix if p not in matrices]
  if unknown:
    raise ValueError(f"params['lora']: adapters on {_show(unknown[0])}, not a matrix of "
                     f"params['base'] ({_listing(matrices)}).")
  merged = {}
  for path, leaf in flat.items():
    w = jax.lax.stop_gradient(leaf) if frozen else leaf
    for name, lo, hi in matrices.get(path, ()):
      if name not in by_matrix.get(path, ()):
        continue
      a, b = flat_lora[path + (name, "a")], flat_lora[path + (name, "b")]
      delta = lora_config.scale * jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32),
                                             precision=jax.lax.Precision.HIGHEST)
      if hi - lo == w.shape[-1]:
        w = w + delta.astype(w.dtype)
      else:
        w = w.at[..., lo:hi].add(delta.astype(w.dtype))
    merged[path] = w
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(base),
                                      [merged[p] for p in flat])


def merge(params, lora_config: LoraConfig):
  """Plain params of the base layout: base + scale * A @ B, in the base's dtype."""
  return _merge(params, lora_config, frozen=False)


def is_adapted(params) -> bool:
  """Whether `params` are an adapted model's, {"base", "lora"}."""
  return isinstance(params, Mapping) and set(params) == {"base", "lora"}


def merged(config, params):
  """`params` as plain params of the base layout: themselves when `config` trains no LoRA
  (`config_of` is None) or they are plain already (a LoRA workdir's `mdjax.load`), else
  `merge`d. What an export or a start point of another run reads."""
  lora_config = config_of(config)
  return params if lora_config is None or not is_adapted(params) else merge(params, lora_config)


@dataclasses.dataclass(frozen=True)
class _Adapted:
  """A pass of the base denoiser on merged weights: fn(params, ...) with params
  {"base", "lora"}. Frozen and hashable: equal adaptations share compiled programs."""

  fn: Callable
  lora_config: LoraConfig

  def __call__(self, params, *args, **kwargs):
    return self.fn(_merge(params, self.lora_config, frozen=True), *args, **kwargs)


def adapt(apply_fn, lora_config: LoraConfig) -> Denoiser:
  """The denoiser over params {"base", "lora"}: every pass of `apply_fn` (apply, prefill,
  decode, block_pair, encode_condition; its block size) on W' = stop_gradient(W) + scale * A @ B."""
  return Denoiser.of(apply_fn).map_passes(lambda fn: _Adapted(fn, lora_config))


def unadapted(apply_fn) -> Denoiser:
  """The base denoiser of an `adapt`ed one (itself, as a Denoiser, when not adapted)."""
  adapted = Denoiser.of(apply_fn)
  if not isinstance(adapted.apply, _Adapted):
    return adapted
  return adapted.map_passes(lambda fn: fn.fn)


# ----------------------------------------------------------------------------
# Optimizers.
# ----------------------------------------------------------------------------


def optimizer(base_optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
  """`base_optimizer` on the adapters only: its state holds "lora" leaves, the base's
  updates are zeros (set_to_zero keeps no state)."""

  def labels(params):
    _check_adapted(params)
    return {"base": jax.tree.map(lambda _: "frozen", params["base"]),
            "lora": jax.tree.map(lambda _: "train", params["lora"])}

  return optax.multi_transform({"train": base_optimizer, "frozen": optax.set_to_zero()}, labels)


def _lr_segments(path: tuple, leaf, flat: dict) -> list[tuple[str | None, int, int]]:
  """[(name, first column, end column)] of a leaf under `lr_scales`' names (name None: no
  name covers it). Adapters take their target's name; a matrix's bias its matrix's."""
  width = leaf.shape[-1] if leaf.shape else 1
  if len(path) >= 2 and path[-1] in ("a", "b") and path[-2] in TARGETS:  # an adapter
    return [(path[-2], 0, width)]
  segments = _segments(path, leaf, flat)
  if segments:
    return segments
  owner = _owner(path)
  if isinstance(owner, str) and owner.endswith("_bias") and leaf.shape:
    matrix = path[:-1] + (owner[:-len("_bias")],)
    segments = _segments(matrix, flat[matrix], flat) if matrix in flat else []
    if segments:
      return segments
  if path[-1] == "bias" and len(path) >= 2:  # an nnx Linear's bias: its kernel's
    kernel = path[:-1] + ("kernel",)
    if kernel in flat:
      segments = _segments(kernel, flat[kernel], flat)
      if segments:
        return segments
  if any(isinstance(p, str) and "norm" in p for p in path):
    return [("norm", 0, width)]
  if owner in _EMBEDS:
    return [("embed", 0, width)]
  if owner in _HEADS or (len(path) >= 2 and path[-2] == "final" and path[-1] in (
      "linear", "linear_bias")):
    return [("head", 0, width)]
  return [(None, 0, width)]


def check_lr_scales(scales: Mapping[str, float]) -> dict[str, float]:
  """`scales` as a dict; a ValueError naming an unknown name or a value not finite >= 0."""
  scales = dict(scales)
  for name, value in scales.items():
    if name not in LR_NAMES:
      raise ValueError(f"lr_scales: name {name!r} is unknown; allowed: {LR_NAMES}.")
    if not (isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0):
      raise ValueError(f"lr_scales.{name}={value!r} must be a finite number >= 0.")
  return scales


def _scale_of(name: str | None, scales: dict) -> float:
  """A name's scale: its own, else its group's, else 1."""
  if name is None:
    return 1.0
  if name in scales:
    return float(scales[name])
  group = next((g for g, members in GROUPS.items() if name in members), None)
  return float(scales.get(group, 1.0))


def _plain(scales: Mapping[str, float] | None) -> bool:
  """No scales, or every one 1: one learning rate."""
  return not scales or all(float(v) == 1.0 for v in dict(scales).values())


def lr_state_key(scales: Mapping[str, float] | None):
  """What of `scales` decides the optimizer state's structure: None without scales (or all
  1: the plain optimizer), else the names frozen (scale 0). A run resumes only under the
  same key; other values may change."""
  if _plain(scales):
    return None
  scales = dict(scales)
  return tuple(n for n in TARGETS + ("embed", "head", "norm") if _scale_of(n, scales) == 0)


def lr_scale_tree(params, scales: Mapping[str, float]):
  """Each leaf's learning-rate multiplier: a float, or a float32 array over the last axis
  where a fused matrix's column blocks differ (mdjax's qkv with q and v apart)."""
  scales = check_lr_scales(scales)
  flat = _flat(params)
  adapted = is_adapted(params)
  # An adapted model's base leaves are named as plain params, its adapters by their target.
  base = {p[1:]: v for p, v in flat.items() if p[0] == "base"} if adapted else flat
  out = []
  for path, leaf in flat.items():
    in_base = adapted and path[0] == "base"
    segments = _lr_segments(path[1:], leaf, base) if in_base else _lr_segments(path, leaf, flat)
    factors = [(_scale_of(n, scales), lo, hi) for n, lo, hi in segments]
    if len({f for f, _, _ in factors}) == 1:
      out.append(factors[0][0])
    else:
      column = np.ones(leaf.shape[-1], np.float32)
      for f, lo, hi in factors:
        column[lo:hi] = f
      out.append(column)
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), out)


def lr_scaled(base_optimizer: optax.GradientTransformation,
              scales: Mapping[str, float]) -> optax.GradientTransformation:
  """`base_optimizer` with each leaf's update times its `lr_scale_tree` multiplier (the
  learning rate times it, weight decay included); leaves whose multiplier is 0 everywhere are
  frozen: zero updates, no optimizer state, out of the gradient clipping's norm. Scales all
  1 (or none) give `base_optimizer` itself."""
  scales = check_lr_scales(scales)
  if _plain(scales):  # one rate: the optimizer itself (the state of a run without scales)
    return base_optimizer

  def frozen(factor) -> bool:
    return not np.any(np.asarray(factor))

  def labels(params):
    return jax.tree.map(lambda f: "frozen" if frozen(f) else "train",
                        lr_scale_tree(params, scales))

  def update(updates, state, params=None):
    del params
    factors = lr_scale_tree(updates, scales)
    return jax.tree.map(lambda u, f: u if isinstance(f, float) and f == 1.0
                        else u * jnp.asarray(f, u.dtype), updates, factors), state

  multiply = optax.GradientTransformation(lambda params: optax.EmptyState(), update)
  return optax.chain(
      optax.multi_transform({"train": base_optimizer, "frozen": optax.set_to_zero()}, labels),
      multiply)


# ----------------------------------------------------------------------------
# The report's helpers.
# ----------------------------------------------------------------------------


def count_bytes(tree) -> int:
  """Bytes of a pytree's arrays (or their shapes: jax.eval_shape's ShapeDtypeStructs)."""
  return int(sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(tree) if hasattr(x, "shape")))


def count_leaves(tree) -> int:
  """Array leaves of a pytree (optax's empty states and masked nodes hold none)."""
  return sum(1 for x in jax.tree.leaves(tree) if hasattr(x, "shape"))
