"""What every published family shares: `Leaf` (one params leaf and its Hugging Face tensors),
`Family` (a family's whole knowledge, filled in by its own file), the config.json readers
(`_get`, `_first_id`, `_refuse`, `_bool`) and the shape helpers (`depth`, `leaf_shape`,
`hf_shape`).

A torch Linear weight is [out, in] and is transposed to the params' [in, out]; a stacked leaf
("layers" or "blocks") [N, ...] is built from the N per-layer tensors `...{i}...`. A config
key that changes the architecture to one the params cannot express is a ValueError naming
the key, never a silently wrong model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from mdjax.denoiser import Denoiser
from mdjax.models.checks import check_count
from mdjax.models import dit, published
from mdjax.models.dit import DiTConfig
from mdjax.models.published import PublishedConfig

# torch_dtype strings of config.json <-> the configs' dtypes.
TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One params leaf and the HF tensor(s) it comes from.

  hf: the tensor name; a stacked leaf's has `{i}` for the layer. transpose: a torch Linear
  weight ([out, in]) that the params hold as [in, out].
  """

  path: tuple[str, ...]
  hf: str
  transpose: bool = False

  @property
  def stacked(self) -> bool:
    return self.path[0] in ("layers", "blocks")

  @property
  def key(self) -> str:
    return "/".join(self.path)

  def hf_names(self, num_layers: int) -> list[str]:
    return [self.hf.format(i=i) for i in range(num_layers)] if self.stacked else [self.hf]


# --- shapes -------------------------------------------------------------------------------


def depth(config) -> int:
  """The number of stacked layers (blocks) of a config."""
  return config.n_blocks if isinstance(config, DiTConfig) else config.num_layers


def leaf_shape(config, leaf: Leaf) -> tuple[int, ...]:
  """The params leaf's shape (stacked leaves with their leading [num_layers])."""
  shapes = (dit.param_shapes(config) if isinstance(config, DiTConfig)
            else published.param_shapes(config))
  for part in leaf.path:
    shapes = shapes[part]
  return tuple(shapes)


def hf_shape(config, leaf: Leaf) -> tuple[int, ...]:
  """The shape of one of the leaf's HF tensors (one layer's; torch's [out, in] order)."""
  shape = leaf_shape(config, leaf)[1 if leaf.stacked else 0:]
  return shape[::-1] if leaf.transpose else shape


# --- config.json readers ------------------------------------------------------------------


def _get(raw: dict, key: str, kind, family: str, default: Any = ...):
  """raw[key] checked to be of `kind` (a missing key takes `default`, or is an error)."""
  if key not in raw or raw[key] is None:
    if default is ...:
      raise ValueError(f"{family} config.json: missing {key!r}")
    return default
  value = raw[key]
  ok = (isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float
        else isinstance(value, kind) and not (kind is int and isinstance(value, bool)))
  if not ok:
    raise ValueError(f"{family} config.json: {key}={value!r} is not a{'n' if kind is int else ''} "
                     f"{kind.__name__}")
  if kind is float and not abs(value) < 1e308:  # inf, nan, or an int past float's range
    raise ValueError(f"{family} config.json: {key}={value!r} is not a finite number")
  return kind(value)


def _first_id(raw: dict, key: str, family: str):
  """A token id that some configs give as a list (the first is the canonical one)."""
  value = raw.get(key)
  if isinstance(value, list):
    value = value[0] if value else None
  if value is None:
    return None
  if not isinstance(value, int) or isinstance(value, bool):
    raise ValueError(f"{family} config.json: {key}={value!r} is not a token id")
  return value


def _refuse(raw: dict, family: str, key: str, allowed: tuple, why: str):
  """A present key whose value the params cannot express is an error naming it."""
  if key in raw and raw[key] not in allowed:
    raise ValueError(f"{family} config.json: {key}={raw[key]!r} is not supported ({why}; "
                     f"supported: {', '.join(repr(a) for a in allowed)})")


def _bool(raw: dict, key: str, family: str, default: bool) -> bool:
  value = raw.get(key, default)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise ValueError(f"{family} config.json: {key}={value!r} is not a bool")
  return value


def _with_ids(raw: dict, config: PublishedConfig) -> dict:
  """config.json's special ids (the pad id is EOS, as the published configs have it)."""
  if config.eos_id is not None:
    raw["eos_token_id"] = raw["pad_token_id"] = config.eos_id
  if config.eot_id is not None:
    raw["eot_token_id"] = config.eot_id
  return raw


def _published(family: str, **fields) -> PublishedConfig:
  """PublishedConfig(**fields) of the network `family`; what it refuses is named as
  config.json's."""
  try:
    return PublishedConfig(family=family, **fields)
  except ValueError as e:
    raise ValueError(f"{family} config.json: {e}") from None


def _head_dim(d_model: int, heads: int, family: str, key: str) -> int:
  if heads < 1:
    raise ValueError(f"{family} config.json: {key}={heads} must be >= 1")
  if d_model % heads:
    raise ValueError(f"{family} config.json: the hidden size {d_model} is not a multiple of "
                     f"{key}={heads}")
  return d_model // heads


# --- sampler arguments --------------------------------------------------------------------


def check_int(value, name: str, low: int):
  check_count(name, value, low)


def check_choice(value, name: str, allowed):
  if value not in allowed:
    raise ValueError(f"{name}={value!r} is not supported; one of {allowed}.")


def check_number(value, name: str, rule: str, ok):
  if (isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating))
      or not math.isfinite(value) or not ok(value)):
    raise ValueError(f"{name}={value!r} {rule}.")


def check_flag(value, name: str):
  if not isinstance(value, bool):
    raise ValueError(f"{name}={value!r} must be True or False.")


# --- the family ---------------------------------------------------------------------------


class Family:
  """A published checkpoint family: everything mdjax knows of it, in its own file.

  family: its name (the registry's key, `Model.family`). network: the `mdjax.models`
  network its configs name (`config.family`: "llada", "dream", "llama", "qwen2", "mdlm",
  "bd3lm"), which a new family of an existing network reuses. model_types / architectures:
  the config.json values it is detected by. sampler: its reference sampler (a
  `mdjax.model.DefaultSampler`; None for a causal judge). optional_buffers: stored
  non-parameter tensors a checkpoint may hold. soft_keys: config.json keys outside the
  architecture whose source value stands on save. padding_invariant: its positions count
  from each row's first real token (`Model.padding_invariant`).
  """

  family: str
  network: str
  model_types: tuple[str, ...]
  architectures: tuple[str, ...]
  depth_key = "num_hidden_layers"  # config.json's count of stacked layers
  config_type: type = PublishedConfig
  soft_keys: tuple[str, ...] = ()
  optional_buffers: tuple[str, ...] = ()
  sampler: Any = None
  padding_invariant = False

  def matches(self, raw: dict) -> bool:
    if raw.get("model_type") is not None:
      return raw["model_type"] in self.model_types
    architectures = raw.get("architectures")
    return isinstance(architectures, list) and any(a in self.architectures for a in architectures)

  # --- config.json <-> config <-> tensors ---

  def tied(self, raw: dict) -> bool:
    """Whether the checkpoint's head is its embedding (no head tensor is stored)."""
    raise NotImplementedError

  def config_from_hf(self, raw: dict, dtype: str):
    raise NotImplementedError

  def config_to_hf(self, config) -> dict:
    raise NotImplementedError

  def leaves(self, config, tied: bool = False) -> list[Leaf]:
    raise NotImplementedError

  def leaf_options(self, raw: dict) -> dict:
    """Options of `leaves` read from config.json."""
    return {}

  def synthesized(self, config, raw: dict) -> dict[str, np.ndarray]:
    """Params leaves a checkpoint does not store, built from the config."""
    return {}

  def buffers(self, config, raw: dict) -> dict[str, np.ndarray]:
    """{name: value} of the non-parameter tensors the reference code stores (and reads
    strictly): written on save, checked on load when present."""
    return {}

  def check_buffer(self, config, name: str, value: np.ndarray, where: str):
    pass

  def saved_config(self, hf: dict, source: dict, config) -> dict:
    """config.json as `save` writes it: `hf` (ours) with the family's rules for keys of the
    source's config.json (`source`) that stand."""
    return hf

  # --- the model ---

  def denoiser(self, config) -> Denoiser:
    """The network of `config` as a `Denoiser`."""
    return published.denoiser(config)

  def special_ids(self, config, hf_config: dict | None) -> tuple[Any, Any, Any, int]:
    """(mask, eos, eot, pad): the mask id (None: a causal LM), end of sequence, end of turn,
    and the id left padding carries (EOS, as the reference pads; 0 without one)."""
    eos = config.eos_id
    return config.mask_id, eos, config.eot_id, 0 if eos is None else eos

  def max_len(self, config) -> int:
    return config.max_len

  def _check_writable(self, config: PublishedConfig):
    if not isinstance(config, PublishedConfig) or config.family != self.network:
      raise ValueError(f"config.family={getattr(config, 'family', None)!r} cannot be written "
                       f"as {self.family}")
    if config.head_dim * config.num_heads != config.d_model:
      raise ValueError(f"head_dim={config.head_dim} * num_heads={config.num_heads} != "
                       f"d_model={config.d_model}: the {self.family} config has no head_dim key "
                       "(its code takes d_model / num_heads)")


Layout = Family  # its earlier name


class TransformersFamily(Family):
  """A family stored under transformers' Llama tensor names (model.embed_tokens,
  model.layers.{i}.self_attn.q_proj, ...): Dream, and the Llama / Qwen2 judges."""

  def tied(self, raw: dict) -> bool:
    value = raw.get("tie_word_embeddings", False)
    if not isinstance(value, bool):
      raise ValueError(f"{self.family} config.json: tie_word_embeddings={value!r} is not a bool")
    return value

  def leaves(self, config: PublishedConfig, tied: bool = False) -> list[Leaf]:
    b = "model.layers.{i}"
    out = [Leaf(("embed",), "model.embed_tokens.weight"),
           Leaf(("layers", "attn_norm"), f"{b}.input_layernorm.weight")]
    out += [Leaf(("layers", p), f"{b}.self_attn.{p}_proj.weight", True) for p in "qkv"]
    if config.qkv_bias:
      out += [Leaf(("layers", f"{p}_bias"), f"{b}.self_attn.{p}_proj.bias") for p in "qkv"]
    out += [Leaf(("layers", "o"), f"{b}.self_attn.o_proj.weight", True),
            Leaf(("layers", "mlp_norm"), f"{b}.post_attention_layernorm.weight"),
            Leaf(("layers", "gate"), f"{b}.mlp.gate_proj.weight", True),
            Leaf(("layers", "up"), f"{b}.mlp.up_proj.weight", True),
            Leaf(("layers", "down"), f"{b}.mlp.down_proj.weight", True),
            Leaf(("final_norm",), "model.norm.weight"),
            Leaf(("head",), "model.embed_tokens.weight" if tied else "lm_head.weight", True)]
    return out
