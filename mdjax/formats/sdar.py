"""SDAR (JetAstra/SDAR: SDAR-1.7B / 4B / 8B-Chat): model_type "sdar", SDARForCausalLM. Qwen3's
network (per-head RMSNorm of queries and keys before RoPE, grouped KV heads, no biases,
head_dim its own key) with block-causal attention: a query sees its own block and the blocks
before, so the keys and values of finished blocks are exact and generation runs block by
block against them.

Its reference sampler is generate.py's `block_diffusion_generate`: the prompt's whole blocks
prefilled, then one block of `block_length` positions at a time (the prompt's last partial
block first, its prompt tokens fixed), each by `denoising_steps` steps whose counts split the
block's positions evenly (`get_num_transfer_tokens(block_length, steps)`), under one of four
remasking strategies: `low_confidence_static` (the step's count, most confident first),
`low_confidence_dynamic` (every proposal above `confidence_threshold`, at least the step's
count), `sequential` (the step's count, leftmost first) and `entropy_bounded`. Here that is
`sampling.sample_blocks` with the exact block cache (one compiled program) over a
`ConfidenceSpec` (count_rule="even_block", threshold_floor="count", order="position") or an
`EntropyBoundedSpec`; the differences from the published loop are in docs/pretrained.md.
"""

from __future__ import annotations

import dataclasses

from mdjax import sampling
from mdjax.formats.base import (Leaf, TransformersFormat, build_published_config, check_choice,
                                check_int, check_number, config_token_id, config_value,
                                qwen_config_json, refuse_value, with_special_ids)
from mdjax.formats.llama import LLAMA3_KEYS, rope_config
from mdjax.model import SamplerPlan
from mdjax.models import published
from mdjax.models.published import PublishedConfig
from mdjax.sampling.knobs import Knob

QWEN3_VOCAB = 151936  # the published checkpoints' vocabulary
SDAR_MASK_ID = 151669  # <|MASK|> in it
IM_END_ID = 151645  # <|im_end|>: the end of a chat turn (generation_config.json's first EOS)
STRATEGIES = ("low_confidence_dynamic", "low_confidence_static", "sequential",
              "entropy_bounded")
# Keys outside the architecture (training switches) whose source values stand on save.
TRAINING_KEYS = ("attn_implementation", "debug", "ep_size", "fuse_cross_entropy",
                 "micro_forward", "skip_checkpoint", "use_deepep")


def _window(config: PublishedConfig, block: int, prompt_length: int, max_new_tokens: int):
  """The context before each block: the whole prompt and generation (the reference's cache
  holds everything), in whole blocks; past the model's length it slides (its last
  max_len - block positions)."""
  needed = block * (-(-(prompt_length + max_new_tokens) // block)) + block
  room = (config.max_len - block) // block * block
  return max(block, min(needed, room))


def plan(model, *, prompt_length: int, max_new_tokens: int, block_length: int | None = None,
         denoising_steps: int | None = None, temperature: float = 1.0, top_k: int = 0,
         top_p: float = 1.0, remasking_strategy: str = "low_confidence_dynamic",
         confidence_threshold: float = 0.85, eb_threshold: float = 0.35) -> SamplerPlan:
  """`block_diffusion_generate` with generate.py's defaults (block_length: the config's
  block_size, 4 in the published ones; denoising_steps: block_length): its spec, the network
  block-causal in blocks of `block_length` (the loop's attention mask, whatever config.json's
  block_size), and the blocks with their window of context."""
  config = model.config
  block = config.block_size if block_length is None else block_length
  check_int(block, "block_length", 1)
  steps = block if denoising_steps is None else denoising_steps
  check_int(steps, "denoising_steps", 1)
  check_int(max_new_tokens, "max_new_tokens", 1)
  check_number(temperature, "temperature", "must be a finite number >= 0", lambda x: x >= 0)
  check_int(top_k, "top_k", 0)
  check_number(top_p, "top_p", "must lie in (0, 1]", lambda x: 0 < x <= 1)
  check_choice(remasking_strategy, "remasking_strategy", STRATEGIES)
  check_number(confidence_threshold, "confidence_threshold", "must lie in [0, 1]",
               lambda x: 0 <= x <= 1)
  check_number(eb_threshold, "eb_threshold", "must be a finite number >= 0", lambda x: x >= 0)
  # eos_id: a row ends with the block that writes EOS (generate.py stops at config.json's
  # EOS once a block holds it; the tokens before it are the same).
  draw = {"temperature": float(temperature), "top_k": top_k or None, "top_p": float(top_p),
          "eos_id": model.eos_id}
  if remasking_strategy == "entropy_bounded":
    spec = sampling.EntropyBoundedSpec(steps=steps, gamma=float(eb_threshold), **draw)
  else:
    dynamic = remasking_strategy == "low_confidence_dynamic"
    spec = sampling.ConfidenceSpec(
        steps=steps, score="prob", count_rule="even_block", score_transformed=True,
        threshold=float(confidence_threshold) if dynamic else None, threshold_floor="count",
        order="position" if remasking_strategy == "sequential" else "score", **draw)
  denoiser = model.denoiser
  if block != config.block_size:
    denoiser = published.denoiser(dataclasses.replace(config, block_size=block))
  return SamplerPlan(denoiser=denoiser, spec=spec, blocks_of=block,
                     window=_window(config, block, prompt_length, max_new_tokens))


class Sampler:
  """`block_diffusion_generate` as a model's default sampler, with generate.py's defaults
  (it samples: temperature 1)."""

  knobs = ("block_length", "denoising_steps", "temperature", "top_k", "top_p",
           "remasking_strategy", "confidence_threshold", "eb_threshold")
  # Its own knobs (the others are the spec knobs of their names, `sampling.knobs`).
  own_knobs = (
      Knob("denoising_steps", int, None, optional=True, minimum=1,
           help="SDAR: steps a block (default: block_length)."),
      Knob("top_k", int, 0, minimum=0, help="SDAR: keep the k most likely values (0: all)."),
      Knob("remasking_strategy", str, "low_confidence_dynamic", choices=STRATEGIES,
           help="SDAR: every proposal above confidence_threshold, at least the step's count "
           "(low_confidence_dynamic); the step's count, most confident first (_static) or "
           "leftmost first (sequential); or entropy_bounded (eb_threshold)."),
      Knob("confidence_threshold", float, 0.85, minimum=0.0, maximum=1.0,
           help="SDAR: low_confidence_dynamic's threshold."),
      Knob("eb_threshold", float, 0.35, minimum=0.0,
           help="SDAR: entropy_bounded's bound in nats."),
  )
  spec_defaults: dict = {}  # the reference's temperature 1 is every spec's default

  def plan(self, model, *, prompt_length: int, max_new_tokens: int, **knobs) -> SamplerPlan:
    return plan(model, prompt_length=prompt_length, max_new_tokens=max_new_tokens, **knobs)


class SDARFormat(TransformersFormat):
  """SDAR's layout: Qwen3's tensor names (q_norm / k_norm per attention)."""

  family = "sdar"
  network = "sdar"
  model_types = ("sdar",)
  architectures = ("SDARForCausalLM",)
  soft_keys = TRAINING_KEYS
  sampler = Sampler()
  padding_invariant = True  # positions count from each row's first real token

  def config_from_hf(self, raw: dict, dtype: str) -> PublishedConfig:
    f = self.family
    refuse_value(raw, f, "hidden_act", ("silu",), "the MLP is silu(gate) * up")
    refuse_value(raw, f, "attention_bias", (False, None), "SDAR's attention_bias puts biases on "
                 "q, k, v and o_proj; the network has none on o_proj")
    refuse_value(raw, f, "use_sliding_window", (False, None), "SDAR's attention never applies a "
                 "sliding window")
    theta, scaling = rope_config(raw, f)
    d = config_value(raw, "hidden_size", int, f)
    heads = config_value(raw, "num_attention_heads", int, f)
    # SDARConfig's defaults: head_dim 128, 32 KV heads when the key is absent (heads when
    # it is null), rope_theta 10000, eps 1e-6; the published configs give them all.
    kv = config_value(raw, "num_key_value_heads", int, f, 32 if "num_key_value_heads" not in raw
                      else heads)
    block = config_value(raw, "block_size", int, f, 4)
    if block < 1:
      raise ValueError(f"{f} config.json: block_size={block} must be >= 1 (the attention's "
                       "blocks)")
    vocab = config_value(raw, "vocab_size", int, f)
    eot = config_token_id(raw, "eot_token_id", f)
    if eot is None and vocab == QWEN3_VOCAB:
      eot = IM_END_ID
    return build_published_config(
        self.network, vocab_size=vocab, d_model=d,
        num_layers=config_value(raw, "num_hidden_layers", int, f), num_heads=heads, num_kv_heads=kv,
        head_dim=config_value(raw, "head_dim", int, f, 128),
        mlp_hidden=config_value(raw, "intermediate_size", int, f), rope_theta=theta,
        rope_scaling=scaling, norm_eps=config_value(raw, "rms_norm_eps", float, f, 1e-6),
        qkv_bias=False, logit_shift=False, qk_norm=True, block_size=block,
        mask_id=config_value(raw, "mask_token_id", int, f,
                             SDAR_MASK_ID if vocab == QWEN3_VOCAB else ...),
        eos_id=config_token_id(raw, "eos_token_id", f), eot_id=eot,
        max_len=config_value(raw, "max_position_embeddings", int, f, 32768), dtype=dtype)

  def config_to_hf(self, config: PublishedConfig) -> dict:
    if not isinstance(config, PublishedConfig) or config.family != self.network:
      raise ValueError(f"config.family={getattr(config, 'family', None)!r} cannot be written "
                       f"as {self.family}")
    if config.qkv_bias or config.logit_shift or not config.qk_norm or config.block_size is None:
      raise ValueError(f"config.qkv_bias={config.qkv_bias}, logit_shift={config.logit_shift}, "
                       f"qk_norm={config.qk_norm}, block_size={config.block_size} cannot be "
                       f"written as {self.family} (its code has q/k norms, block-causal "
                       "attention, no biases and no shift)")
    scaling = None if config.rope_scaling is None else {
        "rope_type": "llama3", **dict(zip(LLAMA3_KEYS, config.rope_scaling))}
    raw = {
        "architectures": list(self.architectures), "model_type": self.model_types[0],
        **qwen_config_json(config), "attention_bias": False, "block_size": config.block_size,
        "fuse_cross_entropy": True,  # SDARForCausalLM.forward reads it, also at inference
        "head_dim": config.head_dim, "mask_token_id": config.mask_id, "rope_scaling": scaling,
        "use_cache": False,
    }
    raw = with_special_ids(raw, config)
    if config.eos_id is not None:
      raw["bos_token_id"] = config.eos_id  # as the published configs have it
    return raw

  def leaves(self, config: PublishedConfig, tied: bool = False) -> list[Leaf]:
    out = super().leaves(config, tied)
    b = "model.layers.{i}.self_attn"
    at = next(i for i, leaf in enumerate(out) if leaf.path == ("layers", "o"))
    return out[:at] + [Leaf(("layers", "q_norm"), f"{b}.q_norm.weight"),
                       Leaf(("layers", "k_norm"), f"{b}.k_norm.weight")] + out[at:]
