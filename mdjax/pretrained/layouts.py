"""The published checkpoint layouts: config.json <-> a model config, HF tensors <-> params.

LLaDA (model_type "llada", LLaDAModelLM; an OLMo-derived "llama" block) and Dream
(model_type "Dream", DreamModel; Qwen2 names) map onto `PublishedConfig`, and so do the causal
judges of generative perplexity, Llama (model_type "llama", LlamaForCausalLM) and Qwen2
("qwen2", Qwen2ForCausalLM), with `causal=True` (Dream's tensor names, which are theirs);
MDLM (model_type "mdlm", MDLM: kuleshov-group/mdlm-owt) and BD3-LM (model_type "bd3lm", BD3LM:
kuleshov-group/bd3lm-owt-block_size{4,8,16}) onto `mdjax.models.dit.DiTConfig`. A torch
Linear weight is [out, in] and is transposed to the params' [in, out]; a stacked leaf
("layers" or "blocks") [N, ...] is built from the N per-layer tensors `...{i}...`. A config
key that changes the architecture to one the params cannot express (fused q/k/v, LayerNorm,
ALiBi, biases outside q/k/v, RoPE scaling other than Llama 3.1's, sliding windows;
causal attention in a diffusion layout) is a ValueError naming the key, never a silently
wrong model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from mdjax.models import dit
from mdjax.models.dit import DiTConfig
from mdjax.models.published import PublishedConfig, param_shapes

# LLaDA's end-of-turn token (<|eot_id|>) is in its tokenizer, not in its config.json.
LLADA_VOCAB = 126464
LLADA_EOT_ID = 126348
LLADA_MASK_ID = 126336
DREAM_MASK_ID = 151666

# torch_dtype strings of config.json <-> PublishedConfig dtypes.
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


def depth(config) -> int:
  """The number of stacked layers (blocks) of a config."""
  return config.n_blocks if isinstance(config, DiTConfig) else config.num_layers


def leaf_shape(config, leaf: Leaf) -> tuple[int, ...]:
  """The params leaf's shape (stacked leaves with their leading [num_layers])."""
  shapes = dit.param_shapes(config) if isinstance(config, DiTConfig) else param_shapes(config)
  for part in leaf.path:
    shapes = shapes[part]
  return tuple(shapes)


def hf_shape(config, leaf: Leaf) -> tuple[int, ...]:
  """The shape of one of the leaf's HF tensors (one layer's; torch's [out, in] order)."""
  shape = leaf_shape(config, leaf)[1 if leaf.stacked else 0:]
  return shape[::-1] if leaf.transpose else shape


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


def _with_ids(raw: dict, config: PublishedConfig) -> dict:
  """config.json's special ids (the pad id is EOS, as the published configs have it)."""
  if config.eos_id is not None:
    raw["eos_token_id"] = raw["pad_token_id"] = config.eos_id
  if config.eot_id is not None:
    raw["eot_token_id"] = config.eot_id
  return raw


class Layout:
  """A family's checkpoint layout (see the module docstring)."""

  family: str
  model_types: tuple[str, ...]
  architectures: tuple[str, ...]
  depth_key = "num_hidden_layers"  # config.json's count of stacked layers

  def matches(self, raw: dict) -> bool:
    if raw.get("model_type") is not None:
      return raw["model_type"] in self.model_types
    architectures = raw.get("architectures")
    return isinstance(architectures, list) and any(a in self.architectures for a in architectures)

  def tied(self, raw: dict) -> bool:
    """Whether the checkpoint's head is its embedding (no head tensor is stored)."""
    raise NotImplementedError

  def config_from_hf(self, raw: dict, dtype: str) -> PublishedConfig:
    raise NotImplementedError

  def config_to_hf(self, config: PublishedConfig) -> dict:
    raise NotImplementedError

  def leaves(self, config: PublishedConfig, tied: bool = False) -> list[Leaf]:
    raise NotImplementedError

  # Hooks the DiT layouts fill in: options of `leaves` read from config.json, params leaves
  # a checkpoint does not store (built from the config), tensors stored beside the params
  # (buffers), and config.json keys whose source value stands on save.
  config_type: type = PublishedConfig
  soft_keys: tuple[str, ...] = ()

  def leaf_options(self, raw: dict) -> dict:
    return {}

  def synthesized(self, config, raw: dict) -> dict[str, np.ndarray]:
    return {}

  def buffers(self, config, raw: dict) -> dict[str, np.ndarray]:
    """{name: value} of the non-parameter tensors the reference code stores (and reads
    strictly): written on save, checked on load when present."""
    return {}

  def check_buffer(self, config, name: str, value: np.ndarray, where: str):
    pass

  def _check_writable(self, config: PublishedConfig):
    if config.family != self.family:
      raise ValueError(f"config.family={config.family!r} cannot be written as {self.family}")
    if config.head_dim * config.num_heads != config.d_model:
      raise ValueError(f"head_dim={config.head_dim} * num_heads={config.num_heads} != "
                       f"d_model={config.d_model}: the {self.family} config has no head_dim key "
                       "(its code takes d_model / num_heads)")


def _published(family: str, **fields) -> PublishedConfig:
  """PublishedConfig(**fields); what it refuses is named as config.json's."""
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


class LLaDALayout(Layout):
  """LLaDA-8B's layout (GSAI-ML/LLaDA-8B-Base, -Instruct; the same for LLaDA-1.5)."""

  family = "llada"
  model_types = ("llada",)
  architectures = ("LLaDAModelLM",)
  depth_key = "n_layers"

  def tied(self, raw: dict) -> bool:
    value = raw.get("weight_tying", False)  # ModelConfig's default is True; configs set it
    if not isinstance(value, bool):
      raise ValueError(f"llada config.json: weight_tying={value!r} is not a bool")
    return value

  def config_from_hf(self, raw: dict, dtype: str) -> PublishedConfig:
    f = self.family
    _refuse(raw, f, "block_type", ("llama",), "only the llama block has separate q/k/v and "
            "gate/up projections")
    _refuse(raw, f, "block_group_size", (1,), "grouped blocks are named block_groups")
    _refuse(raw, f, "layer_norm_type", ("rms",), "the norms are RMSNorm")
    _refuse(raw, f, "layer_norm_with_affine", (True,), "the norms have weights")
    _refuse(raw, f, "activation_type", ("silu",), "the MLP is silu(gate) * up")
    _refuse(raw, f, "rope", (True,), "positions are RoPE")
    _refuse(raw, f, "alibi", (False,), "positions are RoPE")
    _refuse(raw, f, "attention_layer_norm", (False,), "there is no q/k norm")
    _refuse(raw, f, "input_emb_norm", (False,), "the embedding is not normed")
    _refuse(raw, f, "scale_logits", (False,), "the logits are not scaled")
    _refuse(raw, f, "include_bias", (False, None), "only q/k/v biases (include_qkv_bias)")
    _refuse(raw, f, "bias_for_layer_norm", (False, None), "the norms have no bias")
    _refuse(raw, f, "rope_scaling", (None,), "RoPE is unscaled")
    d = _get(raw, "d_model", int, f)
    heads = _get(raw, "n_heads", int, f)
    kv = raw.get("n_kv_heads")
    if kv is None:  # ModelConfig.effective_n_kv_heads
      kv = 1 if raw.get("multi_query_attention") is True else heads
    else:
      kv = _get(raw, "n_kv_heads", int, f)
    mlp = raw.get("mlp_hidden_size")
    mlp = (_get(raw, "mlp_ratio", int, f, 4) * d if mlp is None
           else _get(raw, "mlp_hidden_size", int, f))
    vocab = _get(raw, "embedding_size", int, f, None) or _get(raw, "vocab_size", int, f)
    eot = _first_id(raw, "eot_token_id", f)
    if eot is None and vocab == LLADA_VOCAB:
      eot = LLADA_EOT_ID
    return _published(
        f, vocab_size=vocab, d_model=d, num_layers=_get(raw, "n_layers", int, f),
        num_heads=heads, num_kv_heads=kv, head_dim=_head_dim(d, heads, f, "n_heads"),
        mlp_hidden=mlp, rope_theta=_get(raw, "rope_theta", float, f, 10000.0),
        norm_eps=_get(raw, "rms_norm_eps", float, f, 1e-5),
        qkv_bias=bool(raw.get("include_qkv_bias") or False), logit_shift=False,
        mask_id=_get(raw, "mask_token_id", int, f, LLADA_MASK_ID),
        eos_id=_first_id(raw, "eos_token_id", f), eot_id=eot,
        max_len=_get(raw, "max_sequence_length", int, f, 1024), dtype=dtype)

  def config_to_hf(self, config: PublishedConfig) -> dict:
    self._check_writable(config)
    if config.logit_shift:
      raise ValueError("config.logit_shift=True cannot be written as llada (its code does not "
                       "shift logits)")
    raw = {
        "architectures": ["LLaDAModelLM"], "model_type": "llada",
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0,
        "attention_dropout": 0.0, "attention_layer_norm": False,
        "attention_layer_norm_with_affine": True, "bias_for_layer_norm": False,
        "block_group_size": 1, "block_type": "llama", "d_model": config.d_model,
        "embedding_dropout": 0.0, "embedding_size": config.vocab_size,
        "flash_attention": False, "include_bias": False, "include_qkv_bias": config.qkv_bias,
        "init_cutoff_factor": None, "init_device": "meta", "init_fn": "mitchell",
        "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms",
        "layer_norm_with_affine": True, "mask_token_id": config.mask_id,
        "max_sequence_length": config.max_len, "mlp_hidden_size": config.mlp_hidden,
        "mlp_ratio": 4, "multi_query_attention": None, "n_heads": config.num_heads,
        "n_kv_heads": config.num_kv_heads, "n_layers": config.num_layers,
        "precision": "amp_bf16", "residual_dropout": 0.0, "rms_norm_eps": config.norm_eps,
        "rope": True, "rope_full_precision": True, "rope_theta": config.rope_theta,
        "scale_logits": False, "torch_dtype": TORCH_DTYPES[config.dtype], "use_cache": False,
        "vocab_size": config.vocab_size, "weight_tying": False,
    }
    return _with_ids(raw, config)

  def leaves(self, config: PublishedConfig, tied: bool = False) -> list[Leaf]:
    t, b = "model.transformer", "model.transformer.blocks.{i}"
    out = [Leaf(("embed",), f"{t}.wte.weight"),
           Leaf(("layers", "attn_norm"), f"{b}.attn_norm.weight"),
           Leaf(("layers", "q"), f"{b}.q_proj.weight", True),
           Leaf(("layers", "k"), f"{b}.k_proj.weight", True),
           Leaf(("layers", "v"), f"{b}.v_proj.weight", True)]
    if config.qkv_bias:
      out += [Leaf(("layers", f"{p}_bias"), f"{b}.{p}_proj.bias") for p in "qkv"]
    out += [Leaf(("layers", "o"), f"{b}.attn_out.weight", True),
            Leaf(("layers", "mlp_norm"), f"{b}.ff_norm.weight"),
            Leaf(("layers", "gate"), f"{b}.ff_proj.weight", True),
            Leaf(("layers", "up"), f"{b}.up_proj.weight", True),
            Leaf(("layers", "down"), f"{b}.ff_out.weight", True),
            Leaf(("final_norm",), f"{t}.ln_f.weight"),
            Leaf(("head",), f"{t}.wte.weight" if tied else f"{t}.ff_out.weight", True)]
    return out


class DreamLayout(Layout):
  """Dream-7B's layout (Dream-org/Dream-v0-Base-7B, -Instruct-7B): Qwen2 names."""

  family = "dream"
  model_types = ("Dream",)
  architectures = ("DreamModel",)

  def tied(self, raw: dict) -> bool:
    value = raw.get("tie_word_embeddings", False)
    if not isinstance(value, bool):
      raise ValueError(f"{self.family} config.json: tie_word_embeddings={value!r} is not a bool")
    return value

  def config_from_hf(self, raw: dict, dtype: str) -> PublishedConfig:
    f = self.family
    _refuse(raw, f, "hidden_act", ("silu",), "the MLP is silu(gate) * up")
    _refuse(raw, f, "rope_scaling", (None,), "RoPE is unscaled")
    _refuse(raw, f, "use_sliding_window", (False,), "attention is over the whole sequence")
    d = _get(raw, "hidden_size", int, f)
    heads = _get(raw, "num_attention_heads", int, f)
    return _published(
        f, vocab_size=_get(raw, "vocab_size", int, f), d_model=d,
        num_layers=_get(raw, "num_hidden_layers", int, f), num_heads=heads,
        num_kv_heads=_get(raw, "num_key_value_heads", int, f, heads),
        head_dim=_head_dim(d, heads, f, "num_attention_heads"),
        mlp_hidden=_get(raw, "intermediate_size", int, f),
        rope_theta=_get(raw, "rope_theta", float, f, 10000.0),
        norm_eps=_get(raw, "rms_norm_eps", float, f, 1e-6), qkv_bias=True, logit_shift=True,
        mask_id=_get(raw, "mask_token_id", int, f, DREAM_MASK_ID),
        eos_id=_first_id(raw, "eos_token_id", f), eot_id=_first_id(raw, "eot_token_id", f),
        max_len=_get(raw, "max_position_embeddings", int, f, 32768), dtype=dtype)

  def config_to_hf(self, config: PublishedConfig) -> dict:
    self._check_writable(config)
    if not (config.qkv_bias and config.logit_shift):
      raise ValueError(f"config.qkv_bias={config.qkv_bias}, logit_shift={config.logit_shift} "
                       "cannot be written as dream (its code has q/k/v biases and shifts logits)")
    raw = {
        "architectures": ["DreamModel"], "model_type": "Dream", "attention_dropout": 0.0,
        "hidden_act": "silu", "hidden_size": config.d_model, "initializer_range": 0.02,
        "intermediate_size": config.mlp_hidden, "mask_token_id": config.mask_id,
        "max_position_embeddings": config.max_len, "max_window_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_hidden_layers": config.num_layers,
        "num_key_value_heads": config.num_kv_heads, "rms_norm_eps": config.norm_eps,
        "rope_scaling": None, "rope_theta": config.rope_theta, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": TORCH_DTYPES[config.dtype],
        "use_cache": False, "use_sliding_window": False, "vocab_size": config.vocab_size,
    }
    return _with_ids(raw, config)

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


LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings")


def _rope(raw: dict, family: str) -> tuple[float, tuple | None]:
  """(rope_theta, rope_scaling) of a transformers config: rope_theta at the top level and a
  rope_scaling dict (transformers 4), or both in rope_parameters (transformers 5). The only
  scaling expressed is Llama 3.1's "llama3" (PublishedConfig.rope_scaling); others are refused."""
  params = raw.get("rope_parameters")
  scaling = raw.get("rope_scaling")
  if isinstance(params, dict):
    if "rope_theta" in params and "rope_theta" not in raw:
      raw = {**raw, "rope_theta": params["rope_theta"]}
    if params.get("rope_type", "default") != "default":
      scaling = params
  theta = _get(raw, "rope_theta", float, family, 10000.0)
  if scaling is None:
    return theta, None
  kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
  if kind != "llama3":
    raise ValueError(f"{family} config.json: RoPE scaling {scaling!r} is not supported (only "
                     "rope_type 'llama3', Llama 3.1's)")
  return theta, tuple(_get(scaling, k, int if k.startswith("original") else float, family)
                      for k in LLAMA3_KEYS)


class LlamaLayout(DreamLayout):
  """Hugging Face's LlamaForCausalLM (Llama 1-2, TinyLlama, ...): a causal judge. The
  tensor names are Dream's (both are transformers' Llama names); no biases unless
  attention_bias, which also puts one on o_proj and is refused; `head_dim` may differ from
  hidden_size / heads."""

  family = "llama"
  model_types = ("llama",)
  architectures = ("LlamaForCausalLM",)
  qkv_bias = False
  default_eps, default_max_len = 1e-6, 2048

  def config_from_hf(self, raw: dict, dtype: str) -> PublishedConfig:
    f = self.family
    _refuse(raw, f, "hidden_act", ("silu",), "the MLP is silu(gate) * up")
    _refuse(raw, f, "use_sliding_window", (False,), "attention is over the whole sequence")
    _refuse(raw, f, "attention_bias", (False,), "only q/k/v biases, never o_proj's")
    theta, scaling = _rope(raw, f)
    _refuse(raw, f, "mlp_bias", (False,), "the MLP has no biases")
    d = _get(raw, "hidden_size", int, f)
    heads = _get(raw, "num_attention_heads", int, f)
    head_dim = raw.get("head_dim")
    head_dim = (_head_dim(d, heads, f, "num_attention_heads") if head_dim is None
                else _get(raw, "head_dim", int, f))
    return _published(
        f, vocab_size=_get(raw, "vocab_size", int, f), d_model=d,
        num_layers=_get(raw, "num_hidden_layers", int, f), num_heads=heads,
        num_kv_heads=_get(raw, "num_key_value_heads", int, f, heads), head_dim=head_dim,
        mlp_hidden=_get(raw, "intermediate_size", int, f), rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=_get(raw, "rms_norm_eps", float, f, self.default_eps),
        qkv_bias=self.qkv_bias, logit_shift=False, mask_id=None, causal=True,
        eos_id=_first_id(raw, "eos_token_id", f),
        max_len=_get(raw, "max_position_embeddings", int, f, self.default_max_len), dtype=dtype)

  def config_to_hf(self, config: PublishedConfig) -> dict:
    if config.family != self.family:
      raise ValueError(f"config.family={config.family!r} cannot be written as {self.family}")
    scaling = None if config.rope_scaling is None else {
        "rope_type": "llama3", **dict(zip(LLAMA3_KEYS, config.rope_scaling))}
    raw = {
        "architectures": list(self.architectures), "model_type": self.model_types[0],
        "attention_dropout": 0.0, "head_dim": config.head_dim, "hidden_act": "silu",
        "hidden_size": config.d_model, "initializer_range": 0.02,
        "intermediate_size": config.mlp_hidden,
        "max_position_embeddings": config.max_len, "num_attention_heads": config.num_heads,
        "num_hidden_layers": config.num_layers, "num_key_value_heads": config.num_kv_heads,
        "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": None if config.rope_scaling is None else scaling,
        "rope_parameters": {**(scaling or {"rope_type": "default"}),
                            "rope_theta": config.rope_theta},  # transformers 5 reads these
        "tie_word_embeddings": False, "torch_dtype": TORCH_DTYPES[config.dtype],
        "use_cache": True, "vocab_size": config.vocab_size,
    }
    if self.family == "llama":
      raw.update(attention_bias=False, mlp_bias=False)
    else:
      raw.update(use_sliding_window=False, sliding_window=None,
                 max_window_layers=config.num_layers)
    if config.eos_id is not None:
      raw["eos_token_id"] = config.eos_id
    return raw


class Qwen2Layout(LlamaLayout):
  """Hugging Face's Qwen2ForCausalLM (Qwen1.5, Qwen2, Qwen2.5): a causal judge with q/k/v
  biases; the small ones tie the head to the embedding (tie_word_embeddings)."""

  family = "qwen2"
  model_types = ("qwen2",)
  architectures = ("Qwen2ForCausalLM",)
  qkv_bias = True
  default_eps, default_max_len = 1e-6, 32768

  def config_from_hf(self, raw: dict, dtype: str) -> PublishedConfig:
    _refuse(raw, self.family, "attention_bias", (True, None),
            "Qwen2's q/k/v projections always have biases")
    raw = {k: v for k, v in raw.items() if k not in ("attention_bias", "mlp_bias")}
    return super().config_from_hf(raw, dtype)


# The reference DiT's fixed choices, which config.json has no key for.
DIT_FIXED = {"mlp_ratio": 4, "rope_base": 10000.0, "norm_eps": 1e-5}
# attn_backend values: each names a torch kernel of the same attention, so each is read and
# ignored without a word (the reference's own configs carry one).
ATTN_BACKENDS = ("sdpa", "flex", "flash_attn", "flash", "flash_attn_2")
INV_FREQ = "backbone.rotary_emb.inv_freq"


def inv_freq(config: DiTConfig) -> np.ndarray:
  """The reference's rotary buffer, 1 / base^(arange(0, K, 2) / K) in float32 (the power in
  float64: within one float32 ulp of torch's, which `save` keeps when the model has it)."""
  k = config.head_dim
  exponent = (np.arange(0, k, 2, dtype=np.float32) / np.float32(k)).astype(np.float64)
  return np.float32(1.0) / np.power(np.float64(config.rope_base), exponent).astype(np.float32)


def _bool(raw: dict, key: str, family: str, default: bool) -> bool:
  value = raw.get(key, default)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise ValueError(f"{family} config.json: {key}={value!r} is not a bool")
  return value


class DiTLayout(Layout):
  """The MDLM / BD3-LM DiT (kuleshov-group/mdlm models/dit.py, bd3lms models/hf): every
  tensor under `backbone.`, config keys hidden_dim, cond_dim, n_blocks, n_heads,
  model_length, vocab_size (V + 1: the mask id V included), time_conditioning."""

  config_type = DiTConfig
  depth_key = "n_blocks"
  soft_keys = ("dropout", "return_dict", "attn_backend", "var_min", "sampling_eps_min",
               "sampling_eps_max")

  def tied(self, raw: dict) -> bool:
    return False

  def leaf_options(self, raw: dict) -> dict:
    return {"adaln": _bool(raw, "adaln", self.family, True)}

  def _block_size(self, raw: dict, model_length: int) -> int | None:
    return None

  def config_from_hf(self, raw: dict, dtype: str) -> DiTConfig:
    f = self.family
    _refuse(raw, f, "causal", (False, None), "the DiT's attention is bidirectional or "
            "block-causal; causal is the autoregressive baseline")
    _refuse(raw, f, "mlp_ratio", (4, None), "the reference's MLP is 4 x hidden_dim")
    backend = raw.get("attn_backend")
    if backend is not None and backend not in ATTN_BACKENDS:
      raise ValueError(f"{f} config.json: attn_backend={backend!r} is not one of the "
                       f"reference's ({', '.join(map(repr, ATTN_BACKENDS))})")
    vocab = _get(raw, "vocab_size", int, f)
    if vocab < 2:
      raise ValueError(f"{f} config.json: vocab_size={vocab} must count the V real ids and "
                       "the mask id (>= 2)")
    hidden = _get(raw, "hidden_dim", int, f)
    heads = _get(raw, "n_heads", int, f)
    if heads < 1 or hidden % heads:
      raise ValueError(f"{f} config.json: hidden_dim={hidden} is not divisible by "
                       f"n_heads={heads}")
    length = _get(raw, "model_length", int, f)
    block_size = self._block_size(raw, length)
    try:
      return DiTConfig(
          family=f, vocab_size=vocab - 1, hidden_dim=hidden, cond_dim=_get(raw, "cond_dim", int, f),
          n_blocks=_get(raw, "n_blocks", int, f), n_heads=heads, model_length=length,
          block_size=block_size,
          time_conditioning=_bool(raw, "time_conditioning", f, False), dtype=dtype)
    except ValueError as e:
      raise ValueError(f"{f} config.json: {e}") from e

  def _check_writable(self, config):
    if not isinstance(config, DiTConfig) or config.family != self.family:
      raise ValueError(f"config {type(config).__name__}(family={getattr(config, 'family', None)!r}) "
                       f"cannot be written as {self.family} (a DiTConfig of that family)")
    for name, value in DIT_FIXED.items():
      if getattr(config, name) != value:
        raise ValueError(f"config.{name}={getattr(config, name)!r} cannot be written as "
                         f"{self.family}: the reference code fixes it at {value!r} (no "
                         "config.json key)")

  def _common_hf(self, config: DiTConfig) -> dict:
    return {"vocab_size": config.vocab_size + 1, "model_length": config.model_length,
            "hidden_dim": config.hidden_dim, "cond_dim": config.cond_dim,
            "n_blocks": config.n_blocks, "n_heads": config.n_heads, "dropout": 0.1,
            "time_conditioning": bool(config.time_conditioning), "return_dict": False,
            "torch_dtype": TORCH_DTYPES[config.dtype]}

  def leaves(self, config: DiTConfig, tied: bool = False, adaln: bool = True) -> list[Leaf]:
    g, b, o = "backbone", "backbone.blocks.{i}", "backbone.output_layer"
    out = [Leaf(("embed",), f"{g}.vocab_embed.embedding")]
    if adaln:
      out += [Leaf(("sigma_map", "w1"), f"{g}.sigma_map.mlp.0.weight", True),
              Leaf(("sigma_map", "b1"), f"{g}.sigma_map.mlp.0.bias"),
              Leaf(("sigma_map", "w2"), f"{g}.sigma_map.mlp.2.weight", True),
              Leaf(("sigma_map", "b2"), f"{g}.sigma_map.mlp.2.bias")]
    out += [Leaf(("blocks", "norm1"), f"{b}.norm1.weight"),
            Leaf(("blocks", "qkv"), f"{b}.attn_qkv.weight", True),
            Leaf(("blocks", "attn_out"), f"{b}.attn_out.weight", True),
            Leaf(("blocks", "norm2"), f"{b}.norm2.weight"),
            Leaf(("blocks", "mlp_in"), f"{b}.mlp.0.weight", True),
            Leaf(("blocks", "mlp_in_bias"), f"{b}.mlp.0.bias"),
            Leaf(("blocks", "mlp_out"), f"{b}.mlp.2.weight", True),
            Leaf(("blocks", "mlp_out_bias"), f"{b}.mlp.2.bias")]
    if adaln:
      out += [Leaf(("blocks", "ada"), f"{b}.adaLN_modulation.weight", True),
              Leaf(("blocks", "ada_bias"), f"{b}.adaLN_modulation.bias")]
    out += [Leaf(("final", "norm"), f"{o}.norm_final.weight")]
    if adaln:
      out += [Leaf(("final", "ada"), f"{o}.adaLN_modulation.weight", True),
              Leaf(("final", "ada_bias"), f"{o}.adaLN_modulation.bias")]
    out += [Leaf(("final", "linear"), f"{o}.linear.weight", True),
            Leaf(("final", "linear_bias"), f"{o}.linear.bias")]
    return out

  def synthesized(self, config: DiTConfig, raw: dict) -> dict[str, np.ndarray]:
    """adaln=False (no sigma_map, no adaLN tensors: plain norms, gates 1) as the params'
    adaLN terms: zero weights, so ada(c) is its bias exactly, with shift 0, scale 0, gate 1
    (the reference's adaln=False forward, bit for bit)."""
    if self.leaf_options(raw)["adaln"]:
      return {}
    dtype = np.dtype(config.jnp_dtype)
    shapes = dit.param_shapes(config)
    # Only cond_dim sizes them and no tensor bounds it: no more values than the stored weights.
    built = sum(math.prod(s) for s in (*shapes["sigma_map"].values(), shapes["blocks"]["ada"],
                                     shapes["final"]["ada"]))
    stored = sum(math.prod(leaf_shape(config, leaf)) for leaf in self.leaves(config, adaln=False))
    if built > max(stored, 2**24):
      raise ValueError(f"{self.family} config.json: cond_dim={config.cond_dim} with adaln false "
                       f"builds {built:,} zero adaLN values, more than the checkpoint's "
                       f"{stored:,} weights")
    zeros = lambda shape: np.zeros(shape, dtype)
    d = config.hidden_dim
    gates = np.zeros((6, d), dtype)
    gates[[2, 5]] = 1  # (shift, scale, gate) for attention, then for the MLP
    out = {f"sigma_map/{k}": zeros(v) for k, v in shapes["sigma_map"].items()}
    out["blocks/ada"] = zeros(shapes["blocks"]["ada"])
    out["blocks/ada_bias"] = np.broadcast_to(gates.reshape(-1),
                                             shapes["blocks"]["ada_bias"]).copy()
    out["final/ada"] = zeros(shapes["final"]["ada"])
    out["final/ada_bias"] = zeros(shapes["final"]["ada_bias"])
    return out

  def buffers(self, config: DiTConfig, raw: dict) -> dict[str, np.ndarray]:
    return {INV_FREQ: inv_freq(config)}

  def check_buffer(self, config: DiTConfig, name: str, value: np.ndarray, where: str):
    if name == INV_FREQ:
      want = inv_freq(config)
      if value.shape != want.shape or not np.allclose(value.astype(np.float32), want,
                                                      rtol=1e-5, atol=0):
        raise ValueError(f"{where}: tensor {name!r} is not the rotary table of base "
                         f"{config.rope_base} and head_dim {config.head_dim} (the reference's "
                         "fixed RoPE)")


class MDLMLayout(DiTLayout):
  """MDLM's layout (kuleshov-group/mdlm-owt): bidirectional, no block_size key."""

  family = "mdlm"
  model_types = ("mdlm",)
  architectures = ("MDLM",)

  def config_to_hf(self, config: DiTConfig) -> dict:
    self._check_writable(config)
    if config.block_size is not None:
      raise ValueError(f"config.block_size={config.block_size} cannot be written as mdlm "
                       "(its attention is bidirectional): save it as bd3lm")
    return {"architectures": ["MDLM"], "model_type": "mdlm", **self._common_hf(config)}


class BD3LMLayout(DiTLayout):
  """BD3-LM's layout (kuleshov-group/bd3lm-owt-block_size{4,8,16}): block-causal attention
  with block_size when cross_attn is true (its default); with cross_attn false the
  reference attends bidirectionally and block_size is unused (DiTConfig.block_size None)."""

  family = "bd3lm"
  model_types = ("bd3lm",)
  architectures = ("BD3LM",)

  def _block_size(self, raw: dict, model_length: int) -> int | None:
    f = self.family
    if not _bool(raw, "cross_attn", f, True):
      return None
    size = _get(raw, "block_size", int, f, 1)
    if size < 1 or model_length % size:
      raise ValueError(f"{f} config.json: block_size={size} does not divide "
                       f"model_length={model_length}")
    return size

  def config_to_hf(self, config: DiTConfig) -> dict:
    self._check_writable(config)
    blocks = config.block_size is not None
    return {"architectures": ["BD3LM"], "model_type": "bd3lm",
            "block_size": config.block_size if blocks else config.model_length,
            "cross_attn": blocks, "adaln": True, "attn_backend": "sdpa", "causal": False,
            "var_min": True, "sampling_eps_min": 1e-3, "sampling_eps_max": 0.999,
            **self._common_hf(config)}

  def buffers(self, config: DiTConfig, raw: dict) -> dict[str, np.ndarray]:
    out = super().buffers(config, raw)
    if _bool(raw, "var_min", self.family, True):  # BD3LM registers them with var_min
      for key, default in (("sampling_eps_min", 1e-3), ("sampling_eps_max", 0.999)):
        out[key] = np.asarray(_get(raw, key, float, self.family, default), np.float32)
    return out


LAYOUTS: dict[str, Layout] = {"llada": LLaDALayout(), "dream": DreamLayout(),
                              "mdlm": MDLMLayout(), "bd3lm": BD3LMLayout(),
                              "llama": LlamaLayout(), "qwen2": Qwen2Layout()}


def optional_buffers(layout: Layout) -> tuple[str, ...]:
  """Buffer names a checkpoint of the layout may hold (checked where they can be, not
  params): the rotary table, and the variance-minimizing eps range BD3-LM's code (and a
  Lightning module of either) registers."""
  if isinstance(layout, DiTLayout):
    return (INV_FREQ, "sampling_eps_min", "sampling_eps_max")
  return ()


def supported() -> str:
  """The supported model_types and architectures, for error messages."""
  return "; ".join(f"{name}: model_type {'/'.join(map(repr, l.model_types))}, architectures "
                   f"{'/'.join(map(repr, l.architectures))}" for name, l in LAYOUTS.items())


def detect(raw: dict, where: str) -> Layout:
  """The layout of a config.json, by model_type (or by architectures when it has none)."""
  for layout in LAYOUTS.values():
    if layout.matches(raw):
      return layout
  raise ValueError(f"{where}: unsupported model_type={raw.get('model_type')!r}, "
                   f"architectures={raw.get('architectures')!r} (supported: {supported()})")
