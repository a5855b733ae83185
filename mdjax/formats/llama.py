"""Hugging Face's LlamaForCausalLM (Llama 1-2, TinyLlama, Llama 3.1's RoPE scaling, ...):
model_type "llama", a causal judge of generative perplexity on the published network
(`causal=True`, no mask id, no sampler). Transformers' Llama tensor names; no biases unless
attention_bias, which also puts one on o_proj and is refused; `head_dim` may differ from
hidden_size / heads.
"""

from __future__ import annotations

from mdjax.formats.base import (TORCH_DTYPES, TransformersFormat, build_published_config,
                                config_head_dim, config_token_id, config_value, refuse_value)
from mdjax.models.published import PublishedConfig

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings")


def rope_config(raw: dict, family: str) -> tuple[float, tuple | None]:
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
  theta = config_value(raw, "rope_theta", float, family, 10000.0)
  if scaling is None:
    return theta, None
  kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
  if kind != "llama3":
    raise ValueError(f"{family} config.json: RoPE scaling {scaling!r} is not supported (only "
                     "rope_type 'llama3', Llama 3.1's)")
  return theta, tuple(config_value(scaling, k, int if k.startswith("original") else float, family)
                      for k in LLAMA3_KEYS)


class LlamaFormat(TransformersFormat):
  """LlamaForCausalLM: a causal judge."""

  family = "llama"
  network = "llama"
  model_types = ("llama",)
  architectures = ("LlamaForCausalLM",)
  qkv_bias = False
  default_eps, default_max_len = 1e-6, 2048

  def config_from_hf(self, raw: dict, dtype: str) -> PublishedConfig:
    f = self.family
    refuse_value(raw, f, "hidden_act", ("silu",), "the MLP is silu(gate) * up")
    refuse_value(raw, f, "use_sliding_window", (False,), "attention is over the whole sequence")
    refuse_value(raw, f, "attention_bias", (False,), "only q/k/v biases, never o_proj's")
    theta, scaling = rope_config(raw, f)
    refuse_value(raw, f, "mlp_bias", (False,), "the MLP has no biases")
    d = config_value(raw, "hidden_size", int, f)
    heads = config_value(raw, "num_attention_heads", int, f)
    head_dim = raw.get("head_dim")
    head_dim = (config_head_dim(d, heads, f, "num_attention_heads") if head_dim is None
                else config_value(raw, "head_dim", int, f))
    return build_published_config(
        self.network, vocab_size=config_value(raw, "vocab_size", int, f), d_model=d,
        num_layers=config_value(raw, "num_hidden_layers", int, f), num_heads=heads,
        num_kv_heads=config_value(raw, "num_key_value_heads", int, f, heads), head_dim=head_dim,
        mlp_hidden=config_value(raw, "intermediate_size", int, f), rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=config_value(raw, "rms_norm_eps", float, f, self.default_eps),
        qkv_bias=self.qkv_bias, logit_shift=False, mask_id=None, causal=True,
        eos_id=config_token_id(raw, "eos_token_id", f),
        max_len=config_value(raw, "max_position_embeddings", int, f, self.default_max_len),
        dtype=dtype)

  def config_to_hf(self, config: PublishedConfig) -> dict:
    if config.family != self.network:
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
    raw.update(self._own_keys(config))
    if config.eos_id is not None:
      raw["eos_token_id"] = config.eos_id
    return raw

  def _own_keys(self, config: PublishedConfig) -> dict:
    """The keys of config.json that only this model's code reads."""
    return {"attention_bias": False, "mlp_bias": False}
