"""Fast-dLLM v2 (Efficient-Large-Model/Fast_dLLM_v2_7B, NVlabs/Fast-dLLM v2): model_type
"Fast_dLLM_Qwen", Fast_dLLM_QwenForCausalLM. A Qwen2.5 network (q/k/v biases, untied head)
made block-causal with blocks of `bd_size` (32): a query sees its own block and the blocks
before it, blocks counted from each row's first token; its predictions are shifted by one
(the output at i - 1 predicts position i), as the reference decoder reads them.

Its reference sampler is `batch_sample` (v2/generation_functions.py): blocks of `bd_size`
generated in turn with the exact cache of the finished blocks (`sampling.sample_blocks`),
each block's first token by argmax from the block before, the rest in sub-blocks of
`block_length` (the published `small_block_size`) by threshold commits (`sampling.FastDllmV2Spec`). Its stop token is the
EOS id (<|im_end|>): a row ends with the block that wrote it. The config.json has no mask id:
the code's 151665 (|<MASK>|) unless `mask_token_id` is given.
"""

from __future__ import annotations

from mdjax.formats.base import (TransformersFormat, build_published_config, check_int,
                                check_number, config_token_id, config_value, qwen_config_fields,
                                qwen_config_json, refuse_keys, refuse_value, with_special_ids)
from mdjax.denoiser import Denoiser
from mdjax.model import SamplerPlan
from mdjax.models.published import PublishedConfig
from mdjax.sampling.families.fast_dllm_v2 import FastDllmV2Spec

FAST_DLLM_V2_MASK_ID = 151665
FAST_DLLM_V2_BLOCK = 32
# Keys of other published networks (Qwen3 / SDAR q/k norm, MoE experts, partial RoPE) that
# change the architecture: present and set, they are refused by name.
FOREIGN_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "num_shared_experts", "first_k_dense_replace", "partial_rotary_factor",
                "use_qk_norm", "qk_norm")


def plan(model, *, prompt_length: int, max_new_tokens: int, block_length: int = 8,
         threshold: float = 0.9, temperature: float = 0.0, top_p: float = 0.95
         ) -> SamplerPlan:
  """`batch_sample` for `max_new_tokens` new tokens (use_block_cache=False): blocks of the
  model's `bd_size`, each decoded by FastDllmV2Spec with `block_length` sub-blocks (the published
  `small_block_size`)."""
  block = model.config.block_size
  check_int(max_new_tokens, "max_new_tokens", 1)
  # The window holds the prompt and the whole generation (it never slides: the reference
  # keeps every block in its cache), in whole blocks.
  window = -(-(prompt_length + max_new_tokens) // block) * block
  if window + block > model.config.max_len:
    raise ValueError(f"prompt_length={prompt_length} + max_new_tokens={max_new_tokens} does "
                     f"not fit the model's max_len={model.config.max_len} (in blocks of "
                     f"{block}, one more for the last).")
  check_int(block_length, "block_length", 1)
  if block % block_length:
    raise ValueError(f"block_length={block_length} (the sub-blocks, Fast-dLLM v2's "
                     f"small_block_size) must divide the block size "
                     f"bd_size={block}.")
  check_number(threshold, "threshold", "must lie in [0, 1]", lambda x: 0 <= x <= 1)
  check_number(temperature, "temperature", "must be a finite number >= 0", lambda x: x >= 0)
  check_number(top_p, "top_p", "must lie in (0, 1]", lambda x: 0 < x <= 1)
  spec = FastDllmV2Spec(steps=block + 1, threshold=float(threshold), block_size=block,
                        sub_block_length=block_length, temperature=float(temperature),
                        top_p=float(top_p) if temperature > 0 else 1.0, eos_id=model.eos_id)
  return SamplerPlan(denoiser=Denoiser.of(model.denoiser), spec=spec, blocks_of=block,
                     window=window)


class Sampler:
  """`batch_sample` as a model's default sampler: greedy unless a temperature is given."""

  # block_length: the sub-blocks (the published `small_block_size`), under mdjax's name for
  # blocks decoded in order, so sample.py's --block_length reaches it.
  knobs = ("block_length", "threshold", "temperature", "top_p")
  own_knobs = ()  # each is the spec knob of its name (`sampling.knobs`)
  spec_defaults = {"temperature": 0.0}  # the reference's default: greedy

  def plan(self, model, *, prompt_length: int, max_new_tokens: int, **knobs) -> SamplerPlan:
    return plan(model, prompt_length=prompt_length, max_new_tokens=max_new_tokens, **knobs)


class FastDllmV2Format(TransformersFormat):
  """Fast_dLLM_v2_7B's layout: Qwen2 names, bd_size."""

  family = "fast_dllm_v2"
  network = "fast_dllm_v2"
  model_types = ("Fast_dLLM_Qwen",)
  architectures = ("Fast_dLLM_QwenForCausalLM",)
  sampler = Sampler()
  padding_invariant = True  # positions count from the first real token (block-causal)
  soft_keys = ("conplemenrary_mask",)

  def config_from_hf(self, raw: dict, dtype: str) -> PublishedConfig:
    f = self.family
    refuse_value(raw, f, "hidden_act", ("silu",), "the MLP is silu(gate) * up")
    refuse_value(raw, f, "rope_scaling", (None,), "RoPE is unscaled")
    refuse_value(raw, f, "use_sliding_window", (False,), "attention is over whole blocks")
    refuse_keys(raw, f, FOREIGN_KEYS, "a Fast-dLLM v2 network is dense Qwen2.5 with no q/k "
                "norm and RoPE over the whole head")
    layer_types = raw.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list)
                                    or any(t != "full_attention" for t in layer_types)):
      raise ValueError(f"{f} config.json: layer_types={layer_types!r} is not supported "
                       "(every layer attends to whole blocks: 'full_attention')")
    if "head_dim" in raw and raw["head_dim"] is not None:
      d = config_value(raw, "hidden_size", int, f)
      heads = config_value(raw, "num_attention_heads", int, f)
      if config_value(raw, "head_dim", int, f) * heads != d:
        raise ValueError(f"{f} config.json: head_dim={raw['head_dim']!r} is not supported "
                         "(the projections are hidden_size / num_attention_heads wide)")
    block = config_value(raw, "bd_size", int, f, FAST_DLLM_V2_BLOCK)
    if block < 1:
      raise ValueError(f"{f} config.json: bd_size={block} must be >= 1")
    max_len = config_value(raw, "max_position_embeddings", int, f, 32768)
    if max_len % block or max_len < 2 * block:
      raise ValueError(f"{f} config.json: max_position_embeddings={max_len} must be a "
                       f"multiple of bd_size={block} holding at least two blocks")
    return build_published_config(
        self.network, **qwen_config_fields(raw, f), qkv_bias=True, logit_shift=True,
        mask_id=config_value(raw, "mask_token_id", int, f, FAST_DLLM_V2_MASK_ID),
        eos_id=config_token_id(raw, "eos_token_id", f), max_len=max_len, dtype=dtype,
        block_size=block)

  def config_to_hf(self, config: PublishedConfig) -> dict:
    self._check_writable(config)
    if not (config.qkv_bias and config.logit_shift and config.block_size):
      raise ValueError(f"config.qkv_bias={config.qkv_bias}, logit_shift={config.logit_shift}, "
                       f"block_size={config.block_size} cannot be written as {self.family} "
                       "(its code has q/k/v biases, shifted predictions and blocks)")
    raw = {
        "architectures": list(self.architectures), "model_type": self.model_types[0],
        **qwen_config_json(config),
        "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                     "AutoModel": "modeling.Fast_dLLM_QwenModel",
                     "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
        "bd_size": config.block_size, "layer_types": ["full_attention"] * config.num_layers,
        "use_cache": True,
    }
    if config.mask_id != FAST_DLLM_V2_MASK_ID:
      raw["mask_token_id"] = config.mask_id
    return with_special_ids(raw, config)

  def saved_config(self, hf: dict, source: dict, config) -> dict:
    """The source's bos / pad ids and its training keys stand."""
    for key in ("bos_token_id", "pad_token_id", "conplemenrary_mask", "transformers_version"):
      if key in source:
        hf[key] = source[key]
    return hf
