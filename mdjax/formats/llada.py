"""LLaDA (GSAI-ML/LLaDA-8B-Base, -Instruct; LLaDA-1.5): model_type "llada",
LLaDAModelLM, an OLMo-derived "llama" block on the published network.

Its reference sampler is LLaDA's `generate.py` (with Fast-dLLM's threshold, factor and KV
caches): the generation cut into blocks decoded left to right, each committing its most
confident proposals (`sampling.ConfidenceSpec`). `generate` runs it on ids as one compiled
program (`sampling.sample`), its arguments checked before anything compiles.
"""

from __future__ import annotations

import jax

from mdjax import sampling
from mdjax.denoiser import Denoiser
from mdjax.errors import ArgumentError
from mdjax.formats.base import (TORCH_DTYPES, Format, Leaf, build_published_config,
                                check_choice, check_flag, check_int, check_number,
                                check_prompt_ids, config_head_dim, config_token_id,
                                config_value, prompt_valid, refuse_value, sample_on_ids,
                                with_special_ids)
from mdjax.formats.prefix_cache import prefix_cache
from mdjax.model import SamplerPlan
from mdjax.models.published import PublishedConfig
from mdjax.sampling.knobs import Knob

Array = jax.Array

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
  `generate`'s, checked in its order; `length_name` names gen_length in
  the messages): the ConfidenceSpec and the denoiser (guided, prefix-cached) it samples."""
  check_int(gen_length, length_name, 1)
  check_int(block_length, "block_length", 1)
  check_int(steps, "steps", 1)
  if gen_length % block_length:
    raise ValueError(f"{length_name}={gen_length} must be a multiple of block_length="
                     f"{block_length}.")
  num_blocks = gen_length // block_length
  if steps % num_blocks:
    raise ArgumentError("steps", f"steps={steps} must be a multiple of the number of "
                        f"blocks {length_name} / block_length = {num_blocks}: each block "
                        "runs steps / num_blocks steps.")
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


def generate(model, prompt_BxP, *, steps: int, gen_length: int, block_length: int,
             temperature: float = 0.0, cfg_scale: float = 0.0,
             remasking: str = "low_confidence", logits_eos_inf: bool = False,
             confidence_eos_eot_inf: bool = False, attention_mask=None, key=None,
             threshold: float | None = None, factor: float | None = None,
             kv_cache: str = "none") -> Array:
  """LLaDA's `generate`: ids [B, P + gen_length], the prompt then the generation.

  The generation is cut into gen_length / block_length blocks decoded left to right, each
  in steps / num_blocks steps (steps must be a multiple of the number of blocks). Each step
  proposes x0 at every masked position of the block (argmax at temperature 0; at T > 0 a
  draw from softmax(logits / T), the law of LLaDA's float64 Gumbel noise, from mdjax's
  random streams, so not torch's numbers) and commits the most confident: confidence is the
  proposal's probability under softmax(logits) (`remasking="low_confidence"`) or uniform
  noise (`"random"`). A block of N masked positions commits N // S per step for its S
  steps, the remainder one more each on the first steps (`get_num_transfer_tokens`).
  Nothing ends a row early: EOS is a token like any other.

  Args:
    model: a loaded checkpoint (`mdjax.io.load`: a `mdjax.model.Model`) or anything with
      its fields: `denoiser` (a `Denoiser`), `params`, `mask_id`, `eos_id` and `eot_id` (or
      `config.eot_id`). Its logits cover the checkpoint's vocabulary, the mask id inside it
      (its logit -inf).
    prompt_BxP: int ids, no mask id among them; left-padded rows with `attention_mask`.
    steps, gen_length, block_length: as LLaDA's.
    temperature: >= 0.
    cfg_scale: classifier-free guidance, un + (cfg_scale + 1)(cond - un), the whole prompt
      [0, P) masked in the unconditional rows (`sampling.classifier_free`); 0: none.
    remasking: "low_confidence" or "random".
    logits_eos_inf: the EOS logit is -inf (never proposed; confidence renormalised
      without it), as LLaDA sets it before the noise and the softmax.
    confidence_eos_eot_inf: as LLaDA's code does it: after x0 is drawn, the EoT logit
      (`model.eot_id`) is -inf in the softmax the confidence reads, so an EoT
      proposal scores 0 (below every other proposal) and the other proposals'
      probabilities are renormalised without it. The same line sets EOS to -inf in the
      noised logits, which at temperature 0 are the logits themselves (the noise function
      returns its input): so at T = 0 EOS is excluded from that softmax too, and at T > 0
      it is not (nothing reads the noised logits after x0). No effect with
      remasking="random".
    attention_mask: [B, P], 1 real and 0 padding (left padding); the generation is real.
    key: a PRNG key (default key(0)); only T > 0 and random remasking read it.
    threshold: Fast-dLLM's `get_transfer_index`: each step commits the most confident
      proposal and every other one of the block with confidence >= threshold, in (0, 1].
    factor: Fast-dLLM's `get_transfer_index_dynamic` (`ConfidenceSpec.factor`), > 0.
      With threshold or factor a block runs until it has no mask, which takes at most
      block_length steps: that is the bound, and steps only has to meet the rule above.
    kv_cache: "none"; "dual" (Fast-dLLM's DualCache: a full pass at each block's first step
      gives that step's logits and caches every position's keys and values, then passes
      over the block attend to the cached prefix and suffix); "prefix" (Fast-dLLM's
      `generate_with_prefix_cache`: the later passes run over the block and everything
      after it, attending to the cached keys and values of the positions before the block).
  """
  prompt_BxP = check_prompt_ids(model, prompt_BxP)
  batch, prompt_length = prompt_BxP.shape
  chosen = plan(
      model, prompt_length=prompt_length, gen_length=gen_length, steps=steps,
      block_length=block_length, temperature=temperature, cfg_scale=cfg_scale,
      remasking=remasking, logits_eos_inf=logits_eos_inf,
      confidence_eos_eot_inf=confidence_eos_eot_inf, threshold=threshold, factor=factor,
      kv_cache=kv_cache)
  valid_BxL = prompt_valid(attention_mask, batch, prompt_length, gen_length)
  return sample_on_ids(model, chosen.denoiser, prompt_BxP, gen_length, chosen.spec, valid_BxL, key)


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


class LLaDAFormat(Format):
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
