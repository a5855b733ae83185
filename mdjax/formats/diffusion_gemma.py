"""DiffusionGemma (google/diffusiongemma-26B-A4B-it; google-deepmind/gemma `gemma/diffusion`):
a uniform-noise diffusion LM on Gemma 4 26B-A4B's network (`mdjax.models.diffusion_gemma`).

Its published checkpoint is gemma's params checkpoint (orbax; `gm.ckpts.load_params` /
`save_params`, `CheckpointPath.DIFFUSIONGEMMA_26B_A4B_IT`): the nested tree `model.init`
makes, {embedder, layer_0 .. layer_29, final_norm, self_conditioner, vision_encoder}, each
weight under its module's path in gemma's einsum layout (`TREE`). It holds no config: the
sizes are read from the tree's shapes (`config_from_shapes`) and the rest (the attention
pattern, the sliding window, the RoPE bases and proportions, the soft-cap) are the published
model's (`DiffusionGemmaConfig`'s defaults) unless a config is given. The vision encoder's
weights are left unread (text only, as gemma's `text_only=True`). Transformers and vLLM read
a Hugging Face conversion (model_type "diffusion_gemma", DiffusionGemmaForBlockDiffusion):
`formats.diffusion_gemma_hf` and `mdjax.io.diffusion_gemma_hf` read and write it.

The noise is uniform over the V tokens; there is no mask token, so generated positions are
marked with the id V (past the vocabulary, as mdjax's own models place their mask) until the
sampler draws them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mdjax import noise as noise_lib
from mdjax import sampling
from mdjax.errors import ArgumentError
from mdjax.formats.base import Format
from mdjax.model import SamplerPlan
from mdjax.models import diffusion_gemma as network
from mdjax.models.diffusion_gemma import DiffusionGemmaConfig

FAMILY = network.FAMILY
# gemma's tokenizer (Gemma 4: `gm.text.Gemma4Tokenizer`): pad, EOS, end of turn (<turn|>),
# begin of tool response (its `Sampler` ends a generation at any of the last three).
PAD_ID, EOS_ID, EOT_ID, TOOL_RESPONSE_ID = 0, 1, 106, 50
CANVAS = 256  # gemma's `Sampler.canvas_length`

# One layer's leaves: mdjax's name -> gemma's path under layer_{i}. A path ending in "w" may
# be stored without it (gemma's nn.share_scope leaves: mlp2's, a dense mlp's), and the
# other way round; both read.
ATTENTION = {
    "attn_norm": ("pre_attention_norm", "scale"), "q": ("attn", "q_einsum", "w"),
    "kv": ("attn", "kv_einsum", "w"), "k": ("attn", "k_einsum", "w"),
    "q_norm": ("attn", "query_norm", "scale"), "k_norm": ("attn", "key_norm", "scale"),
    "o": ("attn", "attn_vec_einsum", "w"), "post_attn_norm": ("post_attention_norm", "scale"),
    "skip_scale": ("skip_scale",),
}
MOE = {
    "pre_ffw2_norm": ("pre_ffw2_norm", "scale"), "mlp2_gating": ("mlp2", "gating_einsum"),
    "mlp2_linear": ("mlp2", "linear"), "post_ffw2_norm": ("post_ffw2_norm", "scale"),
    "pre_ffw_norm": ("pre_ffw_norm", "scale"), "router": ("mlp", "router_logits", "w"),
    "router_scale": ("mlp", "router_scale"), "per_expert_scale": ("mlp", "per_expert_scale"),
    "experts_gating": ("mlp", "gating_einsum", "w"), "experts_linear": ("mlp", "linear", "w"),
    "post_ffw1_norm": ("post_ffw1_norm", "scale"), "post_ffw_norm": ("post_ffw_norm", "scale"),
}
DENSE = {
    "pre_ffw_norm": ("pre_ffw_norm", "scale"), "mlp_gating": ("mlp", "gating_einsum"),
    "mlp_linear": ("mlp", "linear"), "post_ffw_norm": ("post_ffw_norm", "scale"),
}
TOP = {
    ("embed",): ("embedder", "input_embedding"), ("final_norm",): ("final_norm", "scale"),
    ("self_condition", "pre_norm"): ("self_conditioner", "pre_norm", "scale"),
    ("self_condition", "gating"): ("self_conditioner", "ffw", "gating_einsum"),
    ("self_condition", "linear"): ("self_conditioner", "ffw", "linear"),
}
# Subtrees of the published checkpoint mdjax does not read (gemma's text_only=True).
UNREAD = ("vision_encoder", "audio_encoder")


def layer_leaves(config: DiffusionGemmaConfig, kind: str) -> dict[str, tuple[str, ...]]:
  """{mdjax leaf: gemma path under layer_{i}} of a layer of `kind`."""
  own = {k: v for k, v in ATTENTION.items() if k != ("kv" if config.k_eq_v(kind) else "k")}
  return {**own, **(MOE if config.num_experts else DENSE)}


def tree_paths(config: DiffusionGemmaConfig) -> dict[tuple[str, ...], tuple[str, ...]]:
  """{mdjax params path: gemma tree path} of every leaf, layers one by one (a layer's
  mdjax path is (kind, leaf, str(index within the kind)))."""
  out = dict(TOP)
  seen = {kind: 0 for kind in network.KINDS}
  for i, kind in enumerate(config.layer_types):
    for leaf, path in layer_leaves(config, kind).items():
      out[(kind, leaf, str(seen[kind]))] = (f"layer_{i}",) + path
    seen[kind] += 1
  return out


def find(shapes: dict, path: tuple[str, ...]):
  """The stored key of `path` in {tree path: value}: itself, or with a trailing "w" added
  or dropped (nn.share_scope); None when absent."""
  for key in (path, path + ("w",), path[:-1] if path[-1] == "w" else None):
    if key is not None and key in shapes:
      return key
  return None


# --- the config from the tree's shapes -----------------------------------------------------


def _shape(shapes: dict, path: tuple[str, ...], where: str) -> tuple[int, ...]:
  key = find(shapes, path)
  if key is None:
    raise ValueError(f"{where}: no {'/'.join(path)} in the params tree (not a DiffusionGemma "
                     "params checkpoint?)")
  return tuple(shapes[key][0])


def config_from_shapes(shapes: dict, where: str, given: Any = None) -> DiffusionGemmaConfig:
  """The architecture of a params tree ({tree path: (shape, dtype)}): its sizes read from the
  shapes, the rest from `given` (a DiffusionGemmaConfig, or a dict of its fields) or the
  published model's; a size `given` contradicts is a ValueError naming the field."""
  fields = dataclasses.asdict(given) if isinstance(given, DiffusionGemmaConfig) else dict(
      given or {})
  unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(DiffusionGemmaConfig)})
  if unknown:
    raise ValueError(f"config: unknown field(s) {', '.join(unknown)} of DiffusionGemmaConfig")
  n = 0
  while any(key[0] == f"layer_{n}" for key in shapes):
    n += 1
  if n == 0 or any(key[0].startswith("layer_") and int(key[0][6:]) >= n for key in shapes
                   if key[0][6:].isdigit()):
    raise ValueError(f"{where}: the layers are not layer_0 .. layer_{{N-1}}")
  vocab, d = _shape(shapes, TOP[("embed",)], where)
  heads_of = [_shape(shapes, (f"layer_{i}",) + ATTENTION["q"], where) for i in range(n)]
  shared_kv = [find(shapes, (f"layer_{i}",) + ATTENTION["k"]) is not None for i in range(n)]
  if "layer_types" in fields:
    kinds = tuple(fields["layer_types"])
  elif any(shared_kv) or len({q[2] for q in heads_of}) > 1:
    smallest = min(q[2] for q in heads_of)
    kinds = tuple("global" if shared or q[2] > smallest else "local"
                  for shared, q in zip(shared_kv, heads_of))
  else:
    kinds = tuple((network.PUBLISHED_PATTERN * n)[:n])
  if len(kinds) != n:
    raise ValueError(f"config: layer_types has {len(kinds)} layers, the tree {n}")
  read: dict[str, Any] = {"vocab_size": vocab, "d_model": d, "layer_types": kinds,
                          "num_heads": heads_of[0][0]}
  for i, kind in enumerate(kinds):
    layer = (f"layer_{i}",)
    k = heads_of[i][2]
    if shared_kv[i]:
      groups = _shape(shapes, layer + ATTENTION["k"], where)[0]
    else:
      groups = _shape(shapes, layer + ATTENTION["kv"], where)[1]
    names = (("head_dim", "num_kv_heads") if kind == "local"
             else ("global_head_dim", "num_global_kv_heads"))
    for name, value in zip(names, (k, groups)):
      if read.setdefault(name, value) != value:
        raise ValueError(f"{where}: layer_{i} ({kind}) has {name} {value}, another layer "
                         f"{read[name]}")
    if kind == "global":
      read.setdefault("k_eq_v_global", shared_kv[i])
    elif shared_kv[i]:
      raise ValueError(f"{where}: layer_{i} is local (layer_types) but stores k_einsum, a "
                       "global layer's shared key/value projection")
  router = find(shapes, ("layer_0",) + MOE["router"])
  if router is not None:
    read["num_experts"] = shapes[router][0][1]
    read["expert_hidden"] = _shape(shapes, ("layer_0",) + MOE["experts_gating"], where)[2]
    read["mlp_hidden"] = _shape(shapes, ("layer_0",) + MOE["mlp2_gating"], where)[1]
  else:
    read["num_experts"] = 0
    read["mlp_hidden"] = _shape(shapes, ("layer_0",) + DENSE["mlp_gating"], where)[1]
  read["condition_hidden"] = _shape(shapes, TOP[("self_condition", "gating")], where)[1]
  dtype = str(shapes[find(shapes, TOP[("embed",)])][1])
  read["dtype"] = dtype if dtype in network.DTYPES else "float32"
  for name, value in read.items():
    if name in fields and name != "dtype" and fields[name] != value:
      raise ValueError(f"config: {name}={fields[name]!r} but the params tree has {value!r}")
  merged = {**fields, **{k: v for k, v in read.items() if not (k == "dtype" and k in fields)}}
  if merged.get("experts_per_token", 8) > merged["num_experts"] > 0:
    merged.setdefault("experts_per_token", merged["num_experts"])
  for name in ("eos_id", "eot_id"):
    if name not in fields and vocab <= (EOS_ID if name == "eos_id" else EOT_ID):
      merged[name] = None  # a vocabulary smaller than gemma's ids
  try:
    return DiffusionGemmaConfig(**merged)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None


def noise_of(config: DiffusionGemmaConfig) -> noise_lib.Uniform:
  """The process DiffusionGemma is trained under: uniform over the V tokens, noise
  probability t (gemma's `DiffusionProcess` with its `LinearSchedule`)."""
  return noise_lib.Uniform(vocab_size=config.vocab_size)


def expected_shapes(config: DiffusionGemmaConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
  """{gemma tree path: shape} of every leaf mdjax reads (one layer's, unstacked)."""
  shapes = network.param_shapes(config)
  out = {}
  for path, tree_path in tree_paths(config).items():
    if len(path) == 3:
      out[tree_path] = tuple(shapes[path[0]][path[1]][1:])
    else:
      shape = shapes
      for part in path:
        shape = shape[part]
      out[tree_path] = tuple(shape)
  return out


# --- the format ------------------------------------------------------------------------------


def stop_ids(model) -> tuple[int, ...]:
  """gemma's `Sampler` end tokens: EOS, end of turn and begin of tool response (those the
  vocabulary holds)."""
  ids = (model.eos_id, model.eot_id, TOOL_RESPONSE_ID)
  return tuple(dict.fromkeys(i for i in ids if i is not None and i < model.vocab_size))


def canvases_of(max_new_tokens: int, reference_length) -> tuple[int, int]:
  """(canvas width, canvases) for `max_new_tokens`: one canvas of max_new_tokens up to
  `reference_length`, else whole canvases of it; an ArgumentError names the knob."""
  if isinstance(reference_length, bool) or not isinstance(reference_length, int) \
      or reference_length < 1:
    raise ArgumentError.invalid("reference_length", reference_length, "it must be an integer "
                                ">= 1 (the tokens of each canvas: gemma's canvas_length)")
  if max_new_tokens <= reference_length:
    return max_new_tokens, 1
  if max_new_tokens % reference_length:
    raise ArgumentError("max_new_tokens", f"max_new_tokens={max_new_tokens} spans canvases of "
                        f"reference_length={reference_length} (gemma's canvas_length): give a "
                        f"multiple of {reference_length}, at most {reference_length}, or a "
                        "reference_length that divides it.")
  return reference_length, max_new_tokens // reference_length


def plan(model, *, prompt_length: int, max_new_tokens: int, steps: int = 48,
         entropy_bound: float = 0.1, max_temperature: float = 0.8,
         min_temperature: float = 0.4, exponent: float = 1.0, early_stop: bool = True,
         entropy_stop: float | None = 0.005, reference_length: int = CANVAS) -> SamplerPlan:
  """gemma's `DiffusionSampler` with the defaults of its `Sampler` / `ChatSampler` (canvases
  of 256, 48 steps a canvas, entropy bound 0.1, temperature 0.8 -> 0.4, a canvas stops once
  its argmax is stable and its mean entropy at most 0.005): the `diffusion_gemma_canvases`
  family, the row's key its `rng`, each canvas drawn as `sample_next_canvas` draws it
  (self-conditioning, final re-noising), appended to the cache before the next; a canvas
  holding an end token (EOS, end of turn, begin of tool response) ends the row. Up to
  `reference_length` new tokens run on one canvas of max_new_tokens (gemma denoises a whole
  canvas and cuts it). The prompt runs as the encoder (the left-padded prompt's width)."""
  width, canvases = canvases_of(max_new_tokens, reference_length)
  spec = sampling.make_spec(
      "diffusion_gemma_canvases", steps=steps, entropy_bound=entropy_bound,
      max_temperature=max_temperature, min_temperature=min_temperature, exponent=exponent,
      early_stop=early_stop, entropy_stop=entropy_stop, final_renoise=True,
      self_condition=True, condition_width=model.config.d_model, reference_length=width,
      canvases=canvases, eos_id=model.eos_id,
      stop_ids=stop_ids(model) if model.eos_id is not None else ())
  return SamplerPlan(denoiser=network.denoiser(model.config, prompt_length), spec=spec)


class Sampler:
  """gemma's `DiffusionSampler` as a model's default (`plan`): canvases in turn."""

  knobs = ("steps", "entropy_bound", "max_temperature", "min_temperature", "exponent",
           "early_stop", "entropy_stop", "reference_length")
  own_knobs = ()
  spec_defaults: dict = {}

  def plan(self, model, *, prompt_length: int, max_new_tokens: int, **knobs) -> SamplerPlan:
    return plan(model, prompt_length=prompt_length, max_new_tokens=max_new_tokens, **knobs)


class DiffusionGemmaFormat(Format):
  """DiffusionGemma's published params checkpoint (module docstring); its Hugging Face
  conversion is detected here and read by `mdjax.io.diffusion_gemma_hf`."""

  family = FAMILY
  network = FAMILY
  model_types = ("diffusion_gemma",)
  architectures = ("DiffusionGemmaForBlockDiffusion",)
  config_type = DiffusionGemmaConfig
  sampler = Sampler()
  padding_invariant = True  # positions count from each row's first real token

  def config_from_hf(self, raw: dict, dtype: str):
    raise ValueError("diffusion_gemma config.json: the Hugging Face conversion of "
                     "DiffusionGemma (DiffusionGemmaForBlockDiffusion) is not read by "
                     "mdjax.io.folder.load, which has no table for it: read it with "
                     "mdjax.load or mdjax.io.load (mdjax.io.diffusion_gemma_hf)")

  def tied(self, raw: dict) -> bool:
    return True

  def denoiser(self, config):
    return network.denoiser(config)

  def special_ids(self, config, hf_config):
    # No mask token: generated positions carry the id V until the sampler draws them.
    return config.vocab_size, config.eos_id, config.eot_id, config.pad_id

  def max_len(self, config) -> int:
    return config.max_len
