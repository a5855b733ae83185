"""What every published format shares: `Leaf` (one params leaf and its Hugging Face tensors),
`Format` (a family's whole knowledge, filled in by its own file), the config.json readers
(`config_value`, `config_token_id`, `config_bool`, `refuse_value`, ...), the shape helpers
(`depth`, `leaf_shape`, `hf_shape`) and what the reference samplers on ids share
(`check_prompt_ids`, `prompt_valid`, `sample_on_ids`).

A torch Linear weight is [out, in] and is transposed to the params' [in, out]; a stacked leaf
("layers" or "blocks") [N, ...] is built from the N per-layer tensors `...{i}...`. A config
key that changes the architecture to one the params cannot express is a ValueError naming
the key, never a silently wrong model.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import numpy as np

from mdjax import sampling
from mdjax.denoiser import Denoiser
from mdjax.errors import ArgumentError
from mdjax.lazy import Lazy
from mdjax.models import dit, published
from mdjax.models.checks import check_count
from mdjax.models.dit import DiTConfig
from mdjax.models.published import PublishedConfig

# torch_dtype strings of config.json <-> the configs' dtypes.
TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One params leaf and the HF tensor(s) it comes from.

  hf: the tensor name; a stacked leaf's has `{i}` for the layer. transpose: a torch Linear
  weight ([out, in]) that the params hold as [in, out]. layers: the (first, stop) layer
  indices of a stacked leaf whose stack covers only some layers (LLaDA2's "layers" of dense
  layers and "moe_layers" of the rest); None: all of them.
  """

  path: tuple[str, ...]
  hf: str
  transpose: bool = False
  layers: tuple[int, int] | None = None

  @property
  def stacked(self) -> bool:
    return self.path[0] in STACKS

  @property
  def key(self) -> str:
    return "/".join(self.path)

  def hf_names(self, num_layers: int) -> list[str]:
    if not self.stacked:
      return [self.hf]
    first, stop = (0, num_layers) if self.layers is None else self.layers
    return [self.hf.format(i=i) for i in range(first, stop)]


# The params subtrees whose leaves stack one entry per layer.
STACKS = ("layers", "blocks", "moe_layers")


@dataclasses.dataclass(frozen=True)
class TensorView:
  """A tensor the params read that a checkpoint stores otherwise, for the loader as if it
  were stored (the name, path, dtype, shape and nbytes of a `tensors.TensorInfo`; `read`
  gives its values): rows [begin, end) of one stored tensor (`rows`: a part of a fused
  projection), or the stack of several (`parts`: per-expert matrices), each transposed
  (`transpose_parts`: torch's [out, in] to the params' [in, out]) before stacking."""

  name: str
  parts: tuple[Any, ...]
  rows: tuple[int, int] | None = None
  transpose_parts: bool = False

  @property
  def path(self) -> str:
    return self.parts[0].path

  @property
  def dtype(self) -> str:
    return self.parts[0].dtype

  @property
  def shape(self) -> tuple[int, ...]:
    first = tuple(self.parts[0].shape)
    if self.rows is not None:
      return (self.rows[1] - self.rows[0],) + first[1:]
    return (len(self.parts),) + (first[::-1] if self.transpose_parts else first)

  @property
  def nbytes(self) -> int:
    if self.rows is not None:
      return self.parts[0].nbytes // max(self.parts[0].shape[0], 1) * self.shape[0]
    return sum(p.nbytes for p in self.parts)

  def read(self, read_part) -> np.ndarray:
    """Its values, each stored part read by `read_part(info)` (the loader's reader)."""
    if self.rows is not None:
      return read_part(self.parts[0])[self.rows[0]:self.rows[1]]
    return np.stack([read_part(p).T if self.transpose_parts else read_part(p)
                     for p in self.parts])


def split_rows(infos: dict, name: str, parts: dict[str, int], where: str) -> dict:
  """`infos` with the stored tensor `name` replaced by one `TensorView` per part, named
  f"{name}[{label}]" and holding the next `rows` rows of it ({label: rows}, in order). A
  tensor of another row count is a ValueError naming it (a missing one is left for the
  loader's missing-tensor error, which names the part)."""
  if name not in infos:
    return infos
  info = infos[name]
  total = sum(parts.values())
  if not info.shape or info.shape[0] != total:
    raise ValueError(f"{where}: tensor {name!r} has shape {list(info.shape)}, expected "
                     f"{total} rows ({' + '.join(f'{n} {k}' for k, n in parts.items())})")
  out = {k: v for k, v in infos.items() if k != name}
  begin = 0
  for label, rows in parts.items():
    out[f"{name}[{label}]"] = TensorView(f"{name}[{label}]", (info,), rows=(begin, begin + rows))
    begin += rows
  return out


def stack_parts(infos: dict, name: str, part_names: list[str], where: str,
                transpose: bool = False) -> dict:
  """`infos` with the stored tensors `part_names` (all present, of one shape and dtype)
  replaced by one `TensorView` named `name` stacking them. A missing part while others are
  present, or parts that differ, is a ValueError naming the tensor."""
  present = [n for n in part_names if n in infos]
  if not present:
    return infos
  missing = [n for n in part_names if n not in infos]
  if missing:
    raise ValueError(f"{where}: missing tensor(s) {', '.join(missing[:5])}"
                     f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}")
  first = infos[part_names[0]]
  for n in part_names[1:]:
    if (tuple(infos[n].shape), infos[n].dtype) != (tuple(first.shape), first.dtype):
      raise ValueError(f"{infos[n].path}: tensor {n!r} is {list(infos[n].shape)} "
                       f"{infos[n].dtype}, not {list(first.shape)} {first.dtype} as "
                       f"{part_names[0]!r}")
  out = {k: v for k, v in infos.items() if k not in set(part_names)}
  out[name] = TensorView(name, tuple(infos[n] for n in part_names), transpose_parts=transpose)
  return out


def fuse_rows(tensors: dict, name: str, labels: list[str]) -> dict:
  """The inverse of `split_rows` on save: the tensors f"{name}[{label}]" (lazy or not)
  concatenated along rows into one lazy tensor `name`."""
  parts = [tensors[f"{name}[{label}]"] for label in labels]
  shape = (sum(p.shape[0] for p in parts),) + tuple(parts[0].shape[1:])
  out = {k: v for k, v in tensors.items() if k not in {f"{name}[{lb}]" for lb in labels}}
  out[name] = Lazy(shape, parts[0].dtype,
                   lambda: np.concatenate([np.asarray(p) for p in parts]))
  return out


def unstack(tensors: dict, name: str, part_names: list[str], transpose: bool = False) -> dict:
  """The inverse of `stack_parts` on save: the stacked tensor `name` written as the lazy
  tensors `part_names`. The stack is computed once and dropped after its last part is
  written (the writer asks for tensors in name order, so a layer's stacks are held at once
  while their parts interleave)."""
  stacked = tensors[name]
  held: dict[str, Any] = {}
  left = [len(part_names)]

  def part(index: int):
    if "value" not in held:
      held["value"] = np.asarray(stacked)
    value = held["value"][index]
    left[0] -= 1
    if not left[0]:
      held.clear()
    return np.ascontiguousarray(value.T if transpose else value)

  shape = tuple(stacked.shape[1:])
  shape = shape[::-1] if transpose else shape
  out = {k: v for k, v in tensors.items() if k != name}
  for index, n in enumerate(part_names):
    out[n] = Lazy(shape, stacked.dtype, functools.partial(part, index))
  return out


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


def config_value(raw: dict, key: str, kind, family: str, default: Any = ...):
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


def config_token_id(raw: dict, key: str, family: str):
  """A token id that some configs give as a list (the first is the canonical one)."""
  value = raw.get(key)
  if isinstance(value, list):
    value = value[0] if value else None
  if value is None:
    return None
  if not isinstance(value, int) or isinstance(value, bool):
    raise ValueError(f"{family} config.json: {key}={value!r} is not a token id")
  return value


def refuse_value(raw: dict, family: str, key: str, allowed: tuple, why: str):
  """A present key whose value the params cannot express is an error naming it."""
  if key in raw and raw[key] not in allowed:
    raise ValueError(f"{family} config.json: {key}={raw[key]!r} is not supported ({why}; "
                     f"supported: {', '.join(repr(a) for a in allowed)})")


def config_bool(raw: dict, key: str, family: str, default: bool) -> bool:
  """raw[key] checked to be a bool (missing or null: `default`)."""
  value = raw.get(key, default)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise ValueError(f"{family} config.json: {key}={value!r} is not a bool")
  return value


def qwen_config_fields(raw: dict, family: str) -> dict:
  """The PublishedConfig fields of a Qwen2-style config.json (Dream, Fast-dLLM v2): its
  sizes, heads (head_dim = hidden / heads), RoPE base and norm epsilon."""
  d = config_value(raw, "hidden_size", int, family)
  heads = config_value(raw, "num_attention_heads", int, family)
  return dict(vocab_size=config_value(raw, "vocab_size", int, family), d_model=d,
              num_layers=config_value(raw, "num_hidden_layers", int, family), num_heads=heads,
              num_kv_heads=config_value(raw, "num_key_value_heads", int, family, heads),
              head_dim=config_head_dim(d, heads, family, "num_attention_heads"),
              mlp_hidden=config_value(raw, "intermediate_size", int, family),
              rope_theta=config_value(raw, "rope_theta", float, family, 10000.0),
              norm_eps=config_value(raw, "rms_norm_eps", float, family, 1e-6))


def qwen_config_json(config: PublishedConfig) -> dict:
  """The config.json keys the Qwen-style published configs (Dream, SDAR, Fast-dLLM v2) share:
  a dense SwiGLU network of `config`, unscaled full attention, untied head."""
  return {
      "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": config.d_model,
      "initializer_range": 0.02, "intermediate_size": config.mlp_hidden,
      "max_position_embeddings": config.max_len, "max_window_layers": config.num_layers,
      "num_attention_heads": config.num_heads, "num_hidden_layers": config.num_layers,
      "num_key_value_heads": config.num_kv_heads, "rms_norm_eps": config.norm_eps,
      "rope_scaling": None, "rope_theta": config.rope_theta, "sliding_window": None,
      "tie_word_embeddings": False, "torch_dtype": TORCH_DTYPES[config.dtype],
      "use_sliding_window": False, "vocab_size": config.vocab_size}


def refuse_keys(raw: dict, family: str, keys: tuple[str, ...], why: str):
  """Another network's architecture keys in this family's config.json, named if set."""
  for key in keys:
    if raw.get(key) not in (None, False):
      raise ValueError(f"{family} config.json: {key}={raw[key]!r} is not supported ({why})")


def with_special_ids(raw: dict, config: PublishedConfig) -> dict:
  """config.json's special ids (the pad id is EOS, as the published configs have it)."""
  if config.eos_id is not None:
    raw["eos_token_id"] = raw["pad_token_id"] = config.eos_id
  if config.eot_id is not None:
    raw["eot_token_id"] = config.eot_id
  return raw


def build_published_config(family: str, **fields) -> PublishedConfig:
  """PublishedConfig(**fields) of the network `family`; what it refuses is named as
  config.json's."""
  try:
    return PublishedConfig(family=family, **fields)
  except ValueError as e:
    raise ValueError(f"{family} config.json: {e}") from None


def config_head_dim(d_model: int, heads: int, family: str, key: str) -> int:
  """d_model / heads, checked to divide (`key`: the config.json key that gave `heads`)."""
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
    raise ArgumentError(name, f"{name}={value!r} is not supported; one of {allowed}.")


def check_number(value, name: str, rule: str, ok):
  if (isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating))
      or not math.isfinite(value) or not ok(value)):
    raise ArgumentError(name, f"{name}={value!r} {rule}.")


def check_flag(value, name: str):
  if not isinstance(value, bool):
    raise ArgumentError(name, f"{name}={value!r} must be True or False.")


# --- the reference samplers on ids --------------------------------------------------------


def sample_on_ids(model, denoiser: Denoiser, prompt_BxP: np.ndarray, gen_length: int, spec,
                  valid_BxL, key) -> jax.Array:
  """The canvas [prompt, gen_length masks] sampled with `spec`: its final ids (the
  reference samplers on ids: `llada.generate`, `dream.diffusion_generate`)."""
  batch, _ = prompt_BxP.shape
  canvas_BxL = np.concatenate(
      [prompt_BxP, np.full((batch, gen_length), model.mask_id, np.int32)], axis=1)
  key = jax.random.key(0) if key is None else key
  result = sampling.sample(denoiser, model.params, key, canvas_BxL, spec,
                           mask_id=model.mask_id, valid_BxL=valid_BxL)
  return result.tokens_BxL


def check_prompt_ids(model, prompt_BxP) -> np.ndarray:
  """prompt_BxP as int32 ids: a 2-D integer array without the mask id."""
  prompt = np.asarray(prompt_BxP)
  if prompt.ndim != 2 or not np.issubdtype(prompt.dtype, np.integer) or 0 in prompt.shape:
    raise ValueError(f"prompt_BxP has shape {prompt.shape} and dtype {prompt.dtype}; it must "
                     "be a 2-D integer array with at least one row and one position.")
  if (prompt == model.mask_id).any():
    row, pos = np.argwhere(prompt == model.mask_id)[0]
    raise ValueError(f"prompt_BxP holds the mask id {model.mask_id} (row {row}, position "
                     f"{pos}); a prompt is given tokens (pad with another id).")
  return prompt.astype(np.int32)


def prompt_valid(attention_mask, batch: int, prompt_length: int, gen_length: int):
  """valid_BxL: the attention mask [B, P] (1 real, 0 left padding) extended with ones over
  the generation (None: none)."""
  if attention_mask is None:
    return None
  mask = np.asarray(attention_mask)
  if mask.shape != (batch, prompt_length):
    raise ValueError(f"attention_mask has shape {mask.shape}; prompt_BxP has "
                     f"{(batch, prompt_length)}.")
  if not np.isin(mask, (0, 1)).all():
    raise ValueError("attention_mask must hold 1 (a real token) and 0 (padding) only.")
  return np.concatenate([mask.astype(bool), np.ones((batch, gen_length), bool)], axis=1)


# --- the format ---------------------------------------------------------------------------


class Format:
  """A published model format (a checkpoint family's): everything mdjax knows of it, in its
  own file.

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

  def tensor_view(self, infos: dict, raw: dict, where: str) -> dict:
    """The checkpoint's tensors as the leaves name them ({name: TensorInfo or TensorView}):
    a family that stores a leaf otherwise (a fused projection, per-expert matrices) maps its
    stored tensors here, before anything is read; the others keep them as they are."""
    return infos

  def stored_tensors(self, tensors: dict, config) -> dict:
    """The inverse of `tensor_view` on save: {leaf tensor name: array or Lazy} -> the
    tensors the checkpoint stores."""
    return tensors

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


class TransformersFormat(Format):
  """A format stored under transformers' Llama tensor names (model.embed_tokens,
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
