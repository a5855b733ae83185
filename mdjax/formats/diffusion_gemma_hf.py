"""DiffusionGemma's Hugging Face layout (transformers' `DiffusionGemmaForBlockDiffusion`,
model_type "diffusion_gemma"; vLLM's `diffusion_gemma.py` reads the same folder): what its
config.json, tensors and generation_config.json mean for mdjax's DiffusionGemma network
(`mdjax.models.diffusion_gemma`), both ways. Reading and writing the files is
`mdjax.io.diffusion_gemma_hf`.

The layout, as transformers 5.25 writes it (`save_pretrained` after
`convert_diffusion_gemma_weights.py`) and reads it:

- config.json: `text_config` (hidden_size, intermediate_size (the shared dense MLP's and the
  self-conditioning MLP's width), num_hidden_layers, `layer_types` of "sliding_attention" /
  "full_attention", num_attention_heads, num_key_value_heads and head_dim of the sliding
  layers, the full layers' `per_layer_config` {index: {head_dim, num_key_value_heads}} (older
  configs: global_head_dim, num_global_key_value_heads), num_experts, top_k_experts,
  moe_intermediate_size, sliding_window, final_logit_softcapping, `rope_parameters` per
  layer type, max_position_embeddings), `canvas_length`, `vision_config`; vLLM also reads a
  top-level `self_conditioning_size` (default: intermediate_size).
- tensors: one set of text weights that the causal encoder and the bidirectional decoder
  share. transformers ties `model.encoder.language_model.*` to `model.decoder.*` and the head
  to the embedding, so `save_pretrained` stores the decoder's copies, the self-conditioning
  MLP (`model.decoder.self_conditioning.*`) and each layer's `layer_scalar` twice (a buffer,
  not tied); the conversion's state dict holds the encoder's copies too, and `lm_head`.
  Whichever copies a folder holds are read, and copies of one weight must be equal (mdjax's
  network has one set). Full-attention layers have no v_proj: values come from k_proj
  (gemma's k_eq_v). The vision tower (`model.encoder.vision_tower.*`,
  `model.encoder.embed_vision.*`) is not read (text only, as gemma's `text_only=True`).
- generation_config.json (`DiffusionGemmaGenerationConfig`): max_denoising_steps,
  sampler_config {EntropyBoundSamplerConfig: entropy_bound}, t_max / t_min (the linear
  temperature anneal), confidence_threshold (the mean-entropy stop), stability_threshold.

Each transform below is the inverse of the conversion's (`convert_transformer_weights` and
`convert_self_conditioner_weights` of transformers' convert_diffusion_gemma_weights.py): a
Linear weight [out, in] is gemma's einsum weight reshaped and transposed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from mdjax import sampling
from mdjax.errors import ArgumentError
from mdjax.formats import diffusion_gemma as orbax_layout
from mdjax.model import SamplerPlan
from mdjax.models import diffusion_gemma as network
from mdjax.models.diffusion_gemma import DiffusionGemmaConfig
from mdjax.models.gemma_blocks import NORM_EPS

MODEL_TYPE = "diffusion_gemma"
ARCHITECTURE = "DiffusionGemmaForBlockDiffusion"
DECODER = "model.decoder."  # the copies transformers' save_pretrained keeps
ENCODER = "model.encoder.language_model."  # their tied twins (the conversion's names)
SELF_CONDITIONING = DECODER + "self_conditioning."
HEAD = "lm_head.weight"  # tied to the embedding
UNREAD = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")  # the vision encoder
KIND_OF = {"sliding_attention": "local", "full_attention": "global"}
TYPE_OF = {kind: name for name, kind in KIND_OF.items()}
ROPE_TYPES = ("default", "proportional")
ACTIVATION = "gelu_pytorch_tanh"  # gemma's gelu (tanh approximation)
CANVAS = orbax_layout.CANVAS

# One layer's leaves: mdjax leaf -> (its stored tensors, relative to "layers.{i}.", and the
# transform). Transforms: "same"; "T" (a Linear of a [in, out] einsum); "heads" ([n, D, K]
# <- [n*K, D]); "out" ([H, K, D] <- [D, H*K]); "pair" (two Linears stacked: [2, F, D]);
# "pair_heads" (k_proj, v_proj: [2, G, D, K]); "experts_in" ([E, 2, Fe, D] <- [E, 2Fe, D]);
# "experts_out" ([E, Fe, D] <- [E, D, Fe]).
LAYER = {
    "attn_norm": (("input_layernorm.weight",), "same"),
    "q": (("self_attn.q_proj.weight",), "heads"),
    "kv": (("self_attn.k_proj.weight", "self_attn.v_proj.weight"), "pair_heads"),
    "k": (("self_attn.k_proj.weight",), "heads"),
    "q_norm": (("self_attn.q_norm.weight",), "same"),
    "k_norm": (("self_attn.k_norm.weight",), "same"),
    "o": (("self_attn.o_proj.weight",), "out"),
    "post_attn_norm": (("post_attention_layernorm.weight",), "same"),
    "skip_scale": (("layer_scalar",), "same"),
    "pre_ffw2_norm": (("pre_feedforward_layernorm.weight",), "same"),
    "mlp2_gating": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "pair"),
    "mlp2_linear": (("mlp.down_proj.weight",), "T"),
    "post_ffw2_norm": (("post_feedforward_layernorm_1.weight",), "same"),
    "pre_ffw_norm": (("pre_feedforward_layernorm_2.weight",), "same"),
    "router": (("router.proj.weight",), "T"),
    "router_scale": (("router.scale",), "same"),
    "per_expert_scale": (("router.per_expert_scale",), "same"),
    "experts_gating": (("experts.gate_up_proj",), "experts_in"),
    "experts_linear": (("experts.down_proj",), "experts_out"),
    "post_ffw1_norm": (("post_feedforward_layernorm_2.weight",), "same"),
    "post_ffw_norm": (("post_feedforward_layernorm.weight",), "same"),
}
# The top-level leaves: mdjax path -> (stored names, transform, the prefixes a copy may sit
# under). The head is the embedding (tied), so a stored lm_head is one more copy of it.
TOP = {
    ("embed",): (("embed_tokens.weight",), "same", (DECODER, ENCODER)),
    ("final_norm",): (("norm.weight",), "same", (DECODER, ENCODER)),
    ("self_condition", "pre_norm"): (("pre_norm.weight",), "same", (SELF_CONDITIONING,)),
    ("self_condition", "gating"): (("gate_proj.weight", "up_proj.weight"), "pair",
                                   (SELF_CONDITIONING,)),
    ("self_condition", "linear"): (("down_proj.weight",), "T", (SELF_CONDITIONING,)),
}


@dataclasses.dataclass(frozen=True)
class Weight:
  """One params leaf (a layer's, or a top-level one) and where the folder keeps it: `parts`
  are its tensors' names relative to a prefix, `copies` the prefixes one full set of them may
  sit under (decoder, encoder; `extra` whole names that are more copies: the tied head)."""

  path: tuple[str, ...]  # (kind, leaf, index within the kind) or a top-level path
  parts: tuple[str, ...]
  transform: str
  copies: tuple[str, ...]
  shape: tuple[int, ...]  # the params leaf's (one layer's)
  extra: tuple[str, ...] = ()

  def names(self) -> list[tuple[str, ...]]:
    """Every copy's full tensor names, the one `save` writes first."""
    return [tuple(p + n for n in self.parts) for p in self.copies] + [(e,) for e in self.extra]

  def stored_shape(self) -> tuple[int, ...]:
    """The shape of each of its stored tensors."""
    s, t = self.shape, self.transform
    if t in ("same", "T"):
      return s if t == "same" else s[::-1]
    if t in ("heads", "out"):
      return (s[0] * s[2], s[1]) if t == "heads" else (s[2], s[0] * s[1])
    if t in ("pair", "pair_heads"):
      return s[1:] if t == "pair" else (s[1] * s[3], s[2])
    return (s[0], s[1] * s[2], s[3]) if t == "experts_in" else (s[0], s[2], s[1])


def weights(config: DiffusionGemmaConfig) -> list[Weight]:
  """Every params leaf of `config` with its stored tensors, the top-level leaves first, then
  layer by layer."""
  shapes = network.param_shapes(config)
  out = []
  for path, (parts, transform, copies) in TOP.items():
    shape = shapes
    for name in path:
      shape = shape[name]
    out.append(Weight(path, parts, transform, copies, tuple(shape),
                      extra=(HEAD,) if path == ("embed",) else ()))
  seen = {kind: 0 for kind in network.KINDS}
  for i, kind in enumerate(config.layer_types):
    for leaf in orbax_layout.layer_leaves(config, kind):
      parts, transform = LAYER[leaf]
      out.append(Weight((kind, leaf, str(seen[kind])), tuple(f"layers.{i}.{p}" for p in parts),
                        transform, (DECODER, ENCODER), tuple(shapes[kind][leaf][1:])))
    seen[kind] += 1
  return out


def to_params(weight: Weight, stored: list[np.ndarray]) -> np.ndarray:
  """The params leaf from its stored tensors (the conversion's transform, inverted)."""
  n, t = weight.shape, weight.transform
  if t == "same":
    return stored[0]
  if t == "T":
    return stored[0].T
  if t == "heads":
    return stored[0].reshape(n[0], n[2], n[1]).transpose(0, 2, 1)
  if t == "out":
    return stored[0].reshape(n[2], n[0], n[1]).transpose(1, 2, 0)
  if t == "pair":
    return np.stack(stored)
  if t == "pair_heads":
    return np.stack([s.reshape(n[1], n[3], n[2]).transpose(0, 2, 1) for s in stored])
  if t == "experts_in":
    return stored[0].reshape(n)
  return stored[0].transpose(0, 2, 1)  # experts_out


def to_stored(weight: Weight, value: np.ndarray) -> list[np.ndarray]:
  """The stored tensors of a params leaf (the conversion's transform), C-contiguous."""
  n, t = weight.shape, weight.transform
  if t == "same":
    out = [value]
  elif t == "T":
    out = [value.T]
  elif t == "heads":
    out = [value.transpose(0, 2, 1).reshape(n[0] * n[2], n[1])]
  elif t == "out":
    out = [value.transpose(2, 0, 1).reshape(n[2], n[0] * n[1])]
  elif t == "pair":
    out = list(value)
  elif t == "pair_heads":
    out = [v.transpose(0, 2, 1).reshape(n[1] * n[3], n[2]) for v in value]
  elif t == "experts_in":
    out = [value.reshape(n[0], n[1] * n[2], n[3])]
  else:
    out = [value.transpose(0, 2, 1)]
  return [np.ascontiguousarray(v) for v in out]


# --- config.json -> DiffusionGemmaConfig ------------------------------------------------------


def _bad(where: str, key: str, value, why: str) -> ValueError:
  return ValueError(f"{where}: {key}={value!r} {why}")


def _int(raw: dict, key: str, where: str, low: int = 1, default: Any = ...) -> int:
  value = raw.get(key, default)
  if value is ...:
    raise ValueError(f"{where}: missing {key!r}")
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    raise _bad(where, key, value, f"is not an integer >= {low}")
  return value


def _number(raw: dict, key: str, where: str, default: Any = ...) -> float:
  value = raw.get(key, default)
  if value is ...:
    raise ValueError(f"{where}: missing {key!r}")
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise _bad(where, key, value, "is not a finite number")
  return float(value)


def _first_id(value, key: str, where: str) -> int | None:
  ids = value if isinstance(value, list) else [value]
  if value is None or not ids:
    return None
  if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
    raise _bad(where, key, value, "is not a token id or a list of them")
  return ids[0]


def _rope(text: dict, kind: str, where: str) -> tuple[float, float]:
  """(base, proportion) of a layer type's rope_parameters: "default" turns the whole head,
  "proportional" (Gemma 4's) the first partial_rotary_factor of it, as gemma's apply_rope."""
  name = TYPE_OF[kind]
  params = text.get("rope_parameters")
  if not isinstance(params, dict) or not isinstance(params.get(name), dict):
    raise ValueError(f"{where}: text_config.rope_parameters has no {name!r} entry (an object "
                     "with rope_type and rope_theta)")
  entry, key = params[name], f"text_config.rope_parameters.{name}"
  if entry.get("rope_type", "default") not in ROPE_TYPES:
    raise _bad(where, f"{key}.rope_type", entry.get("rope_type"), f"is not supported "
               f"({' or '.join(ROPE_TYPES)}: gemma's RoPE)")
  if entry.get("factor", 1.0) != 1.0:
    raise _bad(where, f"{key}.factor", entry["factor"], "is not supported (gemma's RoPE has "
               "no frequency scaling: 1)")
  unknown = sorted(set(entry) - {"rope_type", "rope_theta", "partial_rotary_factor", "factor"})
  if unknown:
    raise ValueError(f"{where}: {key} has key(s) {', '.join(unknown)} that gemma's RoPE does "
                     "not have")
  base = _number(entry, "rope_theta", f"{where}: {key}")
  proportion = _number(entry, "partial_rotary_factor", f"{where}: {key}", 1.0)
  if entry.get("rope_type", "default") == "default" and proportion != 1.0:
    raise _bad(where, f"{key}.partial_rotary_factor", proportion, "is not supported with "
               "rope_type 'default' (transformers turns the whole head; use 'proportional')")
  return base, proportion


def _global_heads(text: dict, kinds: tuple[str, ...], where: str) -> tuple[int, int]:
  """(global_head_dim, num_global_kv_heads): transformers 5.25's per_layer_config of the
  full-attention layers, or the older global_head_dim / num_global_key_value_heads keys."""
  per_layer = text.get("per_layer_config")
  if per_layer is None:
    dim = _int(text, "global_head_dim", where, default=512)
    groups = _int(text, "num_global_key_value_heads", where,
                  default=_int(text, "num_key_value_heads", where))
    return dim, groups
  if not isinstance(per_layer, dict):
    raise _bad(where, "text_config.per_layer_config", per_layer, "is not an object")
  found = set()
  for index, override in per_layer.items():
    key = f"text_config.per_layer_config[{index!r}]"
    if not (str(index).isdigit() and int(index) < len(kinds) and kinds[int(index)] == "global"):
      raise ValueError(f"{where}: {key} names no full_attention layer (mdjax's layers differ "
                       "only by kind: every override is a full-attention layer's)")
    if not isinstance(override, dict) or set(override) - {"head_dim", "num_key_value_heads"}:
      raise _bad(where, key, override, "is not supported (head_dim and num_key_value_heads "
                 "only)")
    found.add((_int(override, "head_dim", f"{where}: {key}", default=_int(text, "head_dim",
                                                                          where)),
               _int(override, "num_key_value_heads", f"{where}: {key}",
                    default=_int(text, "num_key_value_heads", where))))
  missing = [i for i, kind in enumerate(kinds) if kind == "global" and str(i) not in
             {str(k) for k in per_layer}]
  if missing or len(found) > 1:
    raise ValueError(f"{where}: text_config.per_layer_config must give every full_attention "
                     f"layer the same head_dim and num_key_value_heads (missing layer(s) "
                     f"{missing}, values {sorted(found)})")
  return found.pop() if found else (_int(text, "head_dim", where),
                                    _int(text, "num_key_value_heads", where))


def layer_kinds(text: dict, where: str) -> tuple[str, ...]:
  """The layer kinds of text_config (layer_types; transformers' default when absent: every
  sixth layer full, and the last)."""
  n = _int(text, "num_hidden_layers", where)
  names = text.get("layer_types")
  if names is None:
    names = ["sliding_attention" if (i + 1) % 6 and i < n - 1 else "full_attention"
             for i in range(n)]
  if not isinstance(names, list) or len(names) != n or any(t not in KIND_OF for t in names):
    raise _bad(where, "text_config.layer_types", names, f"must list {n} (num_hidden_layers) of "
               f"{' / '.join(KIND_OF)}")
  if names[-1] != "full_attention":
    raise _bad(where, "text_config.layer_types[-1]", names[-1], "is not supported: "
               "transformers makes the last layer full_attention whatever the config says")
  return tuple(KIND_OF[t] for t in names)


def config_from_hf(raw: dict, where: str, dtype: str = "float32") -> DiffusionGemmaConfig:
  """The network of a DiffusionGemma config.json (module docstring); what the network cannot
  be is a ValueError naming the key."""
  text = raw.get("text_config")
  if not isinstance(text, dict):
    raise ValueError(f"{where}: no text_config object (a DiffusionGemmaConfig's)")
  for key, value in (("tie_word_embeddings", raw.get("tie_word_embeddings", True)),
                     ("text_config.tie_word_embeddings", text.get("tie_word_embeddings", True))):
    if value is not True:
      raise _bad(where, key, value, "is not supported (mdjax's DiffusionGemma ties the head to "
                 "the embedding and the encoder to the decoder, as the published model)")
  fixed = {"hidden_activation": ACTIVATION, "attention_bias": False,
           "use_bidirectional_attention": ("vision", None), "attention_k_eq_v": (True, None),
           "rms_norm_eps": NORM_EPS}
  for key, allowed in fixed.items():
    allowed = allowed if isinstance(allowed, tuple) else (allowed,)
    if text.get(key, allowed[-1] if None in allowed else allowed[0]) not in allowed:
      raise _bad(where, f"text_config.{key}", text[key], f"is not supported (DiffusionGemma's "
                 f"network: {' or '.join(map(repr, allowed))})")
  kinds = layer_kinds(text, where)
  global_dim, global_groups = _global_heads(text, kinds, where)
  local_theta, local_proportion = _rope(text, "local", where)
  global_theta, global_proportion = _rope(text, "global", where)
  if text.get("num_experts") is None:
    raise ValueError(f"{where}: text_config.num_experts is missing (transformers' "
                     "DiffusionGemma layers are all mixture-of-experts)")
  vocab = _int(text, "vocab_size", where)
  cap = text.get("final_logit_softcapping", 30.0)
  eos = _first_id(text.get("eos_token_id", 1), "text_config.eos_token_id", where)
  fields = dict(
      vocab_size=vocab, d_model=_int(text, "hidden_size", where), layer_types=kinds,
      num_heads=_int(text, "num_attention_heads", where), head_dim=_int(text, "head_dim", where),
      num_kv_heads=_int(text, "num_key_value_heads", where), global_head_dim=global_dim,
      num_global_kv_heads=global_groups, k_eq_v_global=True,
      sliding_window=_int(text, "sliding_window", where),
      local_rope_theta=local_theta, global_rope_theta=global_theta,
      local_rope_proportion=local_proportion, global_rope_proportion=global_proportion,
      mlp_hidden=_int(text, "intermediate_size", where),
      num_experts=_int(text, "num_experts", where),
      experts_per_token=_int(text, "top_k_experts", where),
      expert_hidden=_int(text, "moe_intermediate_size", where),
      condition_hidden=_int(raw, "self_conditioning_size", where,
                            default=_int(text, "intermediate_size", where)),
      final_logit_softcap=None if cap is None else _number(text, "final_logit_softcapping",
                                                           where),
      max_len=_int(text, "max_position_embeddings", where, default=131072), dtype=dtype,
      pad_id=_first_id(text.get("pad_token_id", 0), "text_config.pad_token_id", where) or 0,
      eos_id=eos if eos is not None and eos < vocab else None,
      eot_id=orbax_layout.EOT_ID if vocab > orbax_layout.EOT_ID else None)
  try:
    return DiffusionGemmaConfig(**fields)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


def canvas_of(raw: dict, where: str) -> int:
  """config.json's canvas_length (gemma's and transformers' canvas: 256 by default)."""
  return _int(raw, "canvas_length", where, default=CANVAS)


# --- DiffusionGemmaConfig -> config.json ------------------------------------------------------


def check_writable(config: DiffusionGemmaConfig) -> None:
  """A ValueError naming the field transformers' DiffusionGemma cannot express."""
  rules = (
      ("num_experts", config.num_experts > 0, "its layers are all mixture-of-experts"),
      ("k_eq_v_global", config.k_eq_v_global, "its full-attention layers take values from "
       "k_proj"),
      ("condition_hidden", config.condition_hidden == config.mlp_hidden, "its "
       f"self-conditioning MLP is intermediate_size (mlp_hidden={config.mlp_hidden}) wide"),
      ("final_logit_softcap", config.final_logit_softcap is not None, "it always soft-caps"),
      ("layer_types", config.layer_types[-1] == "global", "its last layer is full_attention"),
  )
  for name, ok, why in rules:
    if not ok:
      raise ValueError(f"{name}={getattr(config, name)!r} cannot be written in the Hugging "
                       f"Face DiffusionGemma layout ({why})")


def _rope_entry(base: float, proportion: float, kind: str) -> dict:
  if kind == "local" and proportion == 1.0:
    return {"rope_theta": base, "rope_type": "default"}
  return {"partial_rotary_factor": proportion, "rope_theta": base, "rope_type": "proportional"}


def config_to_hf(config: DiffusionGemmaConfig, base: dict | None = None) -> dict:
  """config.json of `config`: `base` (the source folder's) with the architecture's keys set
  as transformers 5.25 writes them."""
  check_writable(config)
  out = dict(base or {})
  text = dict(out.get("text_config") or {})
  for key in ("global_head_dim", "num_global_key_value_heads", "attention_k_eq_v"):
    text.pop(key, None)  # per_layer_config says it
  text.update({
      "attention_bias": False, "attention_dropout": text.get("attention_dropout", 0.0),
      "bos_token_id": text.get("bos_token_id", 2), "eos_token_id": config.eos_id,
      "final_logit_softcapping": config.final_logit_softcap, "head_dim": config.head_dim,
      "hidden_activation": ACTIVATION, "hidden_size": config.d_model,
      "initializer_range": text.get("initializer_range", 0.02),
      "intermediate_size": config.mlp_hidden,
      "layer_types": [TYPE_OF[k] for k in config.layer_types],
      "max_position_embeddings": config.max_len, "model_type": "diffusion_gemma_text",
      "moe_intermediate_size": config.expert_hidden, "num_attention_heads": config.num_heads,
      "num_experts": config.num_experts, "num_hidden_layers": config.num_layers,
      "num_key_value_heads": config.num_kv_heads, "pad_token_id": config.pad_id,
      "per_layer_config": {str(i): {"head_dim": config.global_head_dim,
                                    "num_key_value_heads": config.num_global_kv_heads}
                           for i, k in enumerate(config.layer_types) if k == "global"},
      "rms_norm_eps": NORM_EPS,
      "rope_parameters": {TYPE_OF[k]: _rope_entry(*config.rope_of(k), k) for k in network.KINDS},
      "sliding_window": config.sliding_window, "tie_word_embeddings": True,
      "top_k_experts": config.experts_per_token,
      "use_bidirectional_attention": text.get("use_bidirectional_attention", "vision"),
      "vocab_size": config.vocab_size})
  out.pop("self_conditioning_size", None)  # it is intermediate_size (check_writable)
  out.update({"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
              "canvas_length": out.get("canvas_length", CANVAS), "dtype": config.dtype,
              "text_config": text, "tie_word_embeddings": True})
  out.pop("torch_dtype", None)
  return out


# --- generation_config.json <-> the default sampler's knobs ----------------------------------


# generation_config.json key -> the knob of gemma's DiffusionSampler (`diffusion_gemma.plan`).
GENERATION_KNOBS = {"max_denoising_steps": "steps", "t_max": "max_temperature",
                    "t_min": "min_temperature", "confidence_threshold": "entropy_stop"}
ENTROPY_SAMPLER = "EntropyBoundSamplerConfig"


def sampler_defaults(raw: dict, where: str) -> dict:
  """The default sampler's knobs a generation_config.json sets: max_denoising_steps (steps),
  sampler_config.entropy_bound, t_max / t_min (max_temperature / min_temperature: the same
  linear anneal), confidence_threshold (entropy_stop) and stability_threshold (early_stop:
  0 off, else gemma's stability stop, which compares the argmax with the canvas at that step
  where transformers compares the last stability_threshold argmaxes). Checked by the
  sampler's own rules; a bad value is a ValueError naming the key."""
  knobs: dict[str, Any] = {}
  for key, knob in GENERATION_KNOBS.items():
    if raw.get(key) is not None:
      knobs[knob] = (_int(raw, key, where) if knob == "steps" else _number(raw, key, where))
  sampler = raw.get("sampler_config")
  if sampler is not None:
    name = sampler.get("_cls_name", ENTROPY_SAMPLER) if isinstance(sampler, dict) else None
    if name != ENTROPY_SAMPLER:
      raise _bad(where, "sampler_config", sampler, f"is not supported (an {ENTROPY_SAMPLER}: "
                 "gemma's entropy-bound sampler)")
    knobs["entropy_bound"] = _number(sampler, "entropy_bound", f"{where}: sampler_config")
  if raw.get("stability_threshold") is not None:
    knobs["early_stop"] = _int(raw, "stability_threshold", where, low=0) > 0
  names = {v: k for k, v in GENERATION_KNOBS.items()}
  names.update(entropy_bound="sampler_config.entropy_bound", early_stop="stability_threshold")
  try:
    sampling.make_spec("diffusion_gemma", **{"steps": 1, **knobs})
  except ArgumentError as e:
    raise ValueError(f"{where}: {names.get(e.param, e.param)}: {e}") from None
  return knobs


def generation_config(knobs: dict, base: dict | None = None) -> dict:
  """generation_config.json of the default sampler's knobs, over `base` (the source's)."""
  out = dict(base or {})
  for key, knob in GENERATION_KNOBS.items():
    if knob in knobs:
      out[key] = knobs[knob]
  if "entropy_bound" in knobs:
    out["sampler_config"] = {"_cls_name": ENTROPY_SAMPLER, "entropy_bound": knobs["entropy_bound"]}
  if "early_stop" in knobs and not (knobs["early_stop"] and out.get("stability_threshold")):
    out["stability_threshold"] = int(knobs["early_stop"])
  return out


# gemma's `Sampler` defaults (the conversion's generation_config.json holds the same values).
PUBLISHED_KNOBS = {"steps": 48, "entropy_bound": 0.1, "max_temperature": 0.8,
                   "min_temperature": 0.4, "early_stop": True, "entropy_stop": 0.005}


@dataclasses.dataclass(frozen=True)
class Sampler:
  """gemma's `DiffusionSampler` (`formats.diffusion_gemma.plan`) with a folder's defaults:
  its generation_config.json's settings and its canvas_length, under the knobs given."""

  defaults: tuple[tuple[str, Any], ...] = ()
  knobs = orbax_layout.Sampler.knobs
  own_knobs = ()
  spec_defaults = {}

  def plan(self, model, *, prompt_length: int, max_new_tokens: int, **knobs) -> SamplerPlan:
    return orbax_layout.plan(model, prompt_length=prompt_length,
                             max_new_tokens=max_new_tokens, **{**dict(self.defaults), **knobs})
