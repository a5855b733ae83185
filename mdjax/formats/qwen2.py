"""Hugging Face's Qwen2ForCausalLM (Qwen1.5, Qwen2, Qwen2.5): model_type "qwen2", a causal
judge with q/k/v biases; the small ones tie the head to the embedding (tie_word_embeddings).
Llama's mapping otherwise (`mdjax.formats.llama`).
"""

from __future__ import annotations

from mdjax.formats.base import refuse_value
from mdjax.formats.llama import LlamaFormat
from mdjax.models.published import PublishedConfig


class Qwen2Format(LlamaFormat):
  """Qwen2ForCausalLM: a causal judge."""

  family = "qwen2"
  network = "qwen2"
  model_types = ("qwen2",)
  architectures = ("Qwen2ForCausalLM",)
  qkv_bias = True
  default_eps, default_max_len = 1e-6, 32768

  def config_from_hf(self, raw: dict, dtype: str) -> PublishedConfig:
    refuse_value(raw, self.family, "attention_bias", (True, None),
                 "Qwen2's q/k/v projections always have biases")
    raw = {k: v for k, v in raw.items() if k not in ("attention_bias", "mlp_bias")}
    return super().config_from_hf(raw, dtype)

  def _own_keys(self, config: PublishedConfig) -> dict:
    return {"use_sliding_window": False, "sliding_window": None,
            "max_window_layers": config.num_layers}
