"""LLaDA (GSAI-ML/LLaDA-8B-Base, -Instruct; LLaDA-1.5): model_type "llada",
LLaDAModelLM, an OLMo-derived "llama" block on the published network.

Its reference sampler is LLaDA's `generate.py` (with Fast-dLLM's threshold, factor and KV
caches): the generation cut into blocks decoded left to right, each committing its most
confident proposals (`sampling.ConfidenceSpec`); `mdjax.pretrained.generate` runs it on ids.
"""

from __future__ import annotations

from mdjax import sampling
from mdjax.checkpoints.base import (TORCH_DTYPES, Family, Leaf, build_published_config,
                                    check_choice, check_flag, check_int, check_number,
                                    config_head_dim, config_token_id, config_value, refuse_value,
                                    with_special_ids)
from mdjax.checkpoints.prefix_cache import prefix_cache
from mdjax.denoiser import Denoiser
from mdjax.model import SamplerPlan
from mdjax.models.published import PublishedConfig
from mdjax.sampling.knobs import Knob

# LLaDA's end-of-turn token (<|eot_id|>) is in its tokenizer, not in its config.json.
LLADA_VOCAB = 126464
LLADA_EOT_ID = 126348
LLADA_MASK_ID = 126336

REMASKINGS = ("low_confidence", "random")
KV_CACHES = ("none", "dual", "prefix")


def _eot_id(model):
  """The model's end-of-turn id: a `Model`'s, or `model.config.eot_id` of a bare record."""
  if hasattr(model, "eot_id"):
    return model.eot_id
  return getattr(getattr(model, "config", None), "eot_id", None)


def _excluded(confidence_eos_eot_inf: bool, temperature: float, eos_id, eot_id) -> tuple:
  """The ids LLaDA's `confidence_eos_eot_inf` line leaves out of the confidence softmax:
  EoT, and EOS where the noised logits it writes to are the logits (temperature 0)."""
  if not confidence_eos_eot_inf:
    return ()
  return (eot_id,) + ((eos_id,) if temperature == 0 and eos_id is not None else ())


def plan(model, *, prompt_length: int, gen_length: int, steps: int, block_length: int,
         temperature: float = 0.0, cfg_scale: float = 0.0, remasking: str = "low_confidence",
         logits_eos_inf: bool = False, confidence_eos_eot_inf: bool = False,
         threshold: float | None = None, factor: float | None = None, kv_cache: str = "none",
         length_name: str = "gen_length") -> SamplerPlan:
  """LLaDA's `generate` for `gen_length` new tokens after `prompt_length` (arguments as
  `mdjax.pretrained.generate`'s, checked in its order; `length_name` names gen_length in
  the messages): the ConfidenceSpec and the denoiser (guided, prefix-cached) it samples."""
  check_int(gen_length, length_name, 1)
  check_int(block_length, "block_length", 1)
  check_int(steps, "steps", 1)
  if gen_length % block_length:
    raise ValueError(f"{length_name}={gen_length} must be a multiple of block_length="
                     f"{block_length}.")
  num_blocks = gen_length // block_length
  if steps % num_blocks:
    raise ValueError(f"steps={steps} must be a multiple of the number of blocks "
                     f"{length_name} / block_length = {num_blocks}: each block runs "
                     f"steps / num_blocks steps.")
  check_choice(remasking, "remasking", REMASKINGS)
  check_choice(kv_cache, "kv_cache", KV_CACHES)
  check_number(temperature, "temperature", "must be a finite number >= 0", lambda x: x >= 0)
  check_number(cfg_scale, "cfg_scale", "must be a finite number >= 0", lambda x: x >= 0)
  if threshold is not None:
    check_number(threshold, "threshold", "must be None or lie in (0, 1]", lambda x: 0 < x <= 1)
  if factor is not None:
    check_number(factor, "factor", "must be None or a finite number > 0", lambda x: x > 0)
  if threshold is not None and factor is not None:
    raise ValueError(f"threshold={threshold} and factor={factor}: set one (Fast-dLLM's factor "
                     "rule replaces the threshold).")
  check_flag(logits_eos_inf, "logits_eos_inf")
  check_flag(confidence_eos_eot_inf, "confidence_eos_eot_inf")
  eos_id, eot_id = model.eos_id, _eot_id(model)
  if logits_eos_inf and eos_id is None:
    raise ValueError("logits_eos_inf=True needs the model's EOS id; model.eos_id is None.")
  if confidence_eos_eot_inf and eot_id is None:
    raise ValueError("confidence_eos_eot_inf=True needs the model's EoT id; "
                     "model.eot_id is None.")

  adaptive = threshold is not None or factor is not None
  per_block = block_length if adaptive else steps // num_blocks
  spec = sampling.ConfidenceSpec(
      steps=per_block * num_blocks, block_length=block_length, count_rule="even",
      score="prob" if remasking == "low_confidence" else "random", temperature=float(temperature),
      threshold=threshold, factor=factor,
      banned_ids=(eos_id,) if logits_eos_inf else (),
      score_excluded_ids=_excluded(confidence_eos_eot_inf, temperature, eos_id, eot_id),
      kv_cache="none" if kv_cache == "none" else "dual")
  denoiser = Denoiser.of(model.denoiser)
  if cfg_scale > 0:
    denoiser = sampling.classifier_free(denoiser, float(cfg_scale), prompt_length=prompt_length,
                                        mask_id=model.mask_id)
  if kv_cache != "none" and not denoiser.offers_cache:
    raise ValueError(f"kv_cache={kv_cache!r}: the model offers no cached contract "
                     "(Denoiser.prefill and decode).")
  if kv_cache == "prefix":
    denoiser = prefix_cache(denoiser, prompt_length, block_length)
  return SamplerPlan(denoiser=denoiser, spec=spec)


class Sampler:
  """LLaDA's `generate` as a model's default sampler: steps and block_length default to
  max_new_tokens (one block, one token a step); greedy unless a temperature is given."""

  knobs = ("steps", "block_length", "temperature", "cfg_scale", "remasking", "logits_eos_inf",
           "confidence_eos_eot_inf", "threshold", "factor", "kv_cache")
  # Its own knobs (the others are the spec knobs of their names, `sampling.knobs`).
  own_knobs = (
      Knob("cfg_scale", float, 0.0, help="LLaDA: classifier-free guidance scale (0: none).",
           minimum=0.0),
      Knob("remasking", str, "low_confidence", choices=REMASKINGS, help="LLaDA: the "
           "confidence that picks the committed positions (low_confidence: the proposal's "
           "probability; random)."),
      Knob("logits_eos_inf", bool, False, help="LLaDA: EOS is never proposed."),
      Knob("confidence_eos_eot_inf", bool, False, help="LLaDA: EoT proposals (and EOS ones at "
           "temperature 0) score 0 (LLaDA's knob)."),
      Knob("kv_cache", str, "none", choices=KV_CACHES, help="LLaDA: Fast-dLLM's KV caches: "
           "'dual' (a full pass a block, then the block's), 'prefix' (the prompt and the "
           "blocks before, cached)."),
  )
  spec_defaults = {"temperature": 0.0}  # the reference's default: greedy

  def plan(self, model, *, prompt_length: int, max_new_tokens: int, **knobs) -> SamplerPlan:
    knobs.setdefault("steps", max_new_tokens)
    knobs.setdefault("block_length", max_new_tokens)
    return plan(model, prompt_length=prompt_length, gen_length=max_new_tokens,
                length_name="max_new_tokens", **knobs)


class LLaDA(Family):
  """LLaDA-8B's layout (the same for LLaDA-1.5)."""

  family = "llada"
  network = "llada"
  model_types = ("llada",)
  architectures = ("LLaDAModelLM",)
  depth_key = "n_layers"
  sampler = Sampler()

  def tied(self, raw: dict) -> bool:
    value = raw.get("weight_tying", False)  # ModelConfig's default is True; configs set it
    if not isinstance(value, bool):
      raise ValueError(f"{self.family} config.json: weight_tying={value!r} is not a bool")
    return value

  def config_from_hf(self, raw: dict, dtype: str) -> PublishedConfig:
    f = self.family
    refuse_value(raw, f, "block_type", ("llama",), "only the llama block has separate q/k/v and "
                 "gate/up projections")
    refuse_value(raw, f, "block_group_size", (1,), "grouped blocks are named block_groups")
    refuse_value(raw, f, "layer_norm_type", ("rms",), "the norms are RMSNorm")
    refuse_value(raw, f, "layer_norm_with_affine", (True,), "the norms have weights")
    refuse_value(raw, f, "activation_type", ("silu",), "the MLP is silu(gate) * up")
    refuse_value(raw, f, "rope", (True,), "positions are RoPE")
    refuse_value(raw, f, "alibi", (False,), "positions are RoPE")
    refuse_value(raw, f, "attention_layer_norm", (False,), "there is no q/k norm")
    refuse_value(raw, f, "input_emb_norm", (False,), "the embedding is not normed")
    refuse_value(raw, f, "scale_logits", (False,), "the logits are not scaled")
    refuse_value(raw, f, "include_bias", (False, None), "only q/k/v biases (include_qkv_bias)")
    refuse_value(raw, f, "bias_for_layer_norm", (False, None), "the norms have no bias")
    refuse_value(raw, f, "rope_scaling", (None,), "RoPE is unscaled")
    d = config_value(raw, "d_model", int, f)
    heads = config_value(raw, "n_heads", int, f)
    kv = raw.get("n_kv_heads")
    if kv is None:  # ModelConfig.effective_n_kv_heads
      kv = 1 if raw.get("multi_query_attention") is True else heads
    else:
      kv = config_value(raw, "n_kv_heads", int, f)
    mlp = raw.get("mlp_hidden_size")
    mlp = (config_value(raw, "mlp_ratio", int, f, 4) * d if mlp is None
           else config_value(raw, "mlp_hidden_size", int, f))
    vocab = (config_value(raw, "embedding_size", int, f, None)
             or config_value(raw, "vocab_size", int, f))
    eot = config_token_id(raw, "eot_token_id", f)
    if eot is None and vocab == LLADA_VOCAB:
      eot = LLADA_EOT_ID
    return build_published_config(
        self.network, vocab_size=vocab, d_model=d, num_layers=config_value(raw, "n_layers", int, f),
        num_heads=heads, num_kv_heads=kv, head_dim=config_head_dim(d, heads, f, "n_heads"),
        mlp_hidden=mlp, rope_theta=config_value(raw, "rope_theta", float, f, 10000.0),
        norm_eps=config_value(raw, "rms_norm_eps", float, f, 1e-5),
        qkv_bias=bool(raw.get("include_qkv_bias") or False), logit_shift=False,
        mask_id=config_value(raw, "mask_token_id", int, f, LLADA_MASK_ID),
        eos_id=config_token_id(raw, "eos_token_id", f), eot_id=eot,
        max_len=config_value(raw, "max_sequence_length", int, f, 1024), dtype=dtype)

  def config_to_hf(self, config: PublishedConfig) -> dict:
    self._check_writable(config)
    if config.logit_shift:
      raise ValueError(f"config.logit_shift=True cannot be written as {self.family} (its code "
                       "does not shift logits)")
    raw = {
        "architectures": list(self.architectures), "model_type": self.model_types[0],
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
    return with_special_ids(raw, config)

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

  def saved_config(self, hf: dict, source: dict, config: PublishedConfig) -> dict:
    """The source's vocab_size stands where it is the tokenizer's size (at most the
    embedding's rows, which embedding_size holds)."""
    vocab = source.get("vocab_size")
    if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab <= config.vocab_size:
      hf["vocab_size"] = vocab
    return hf
