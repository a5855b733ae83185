"""LLaDA2.0 (inclusionAI/LLaDA2.0-mini, -flash; LLaDA2.1's network is the same):
model_type "llada2_moe", LLaDA2MoeModelLM. A block-causal network (blocks of 32 by default:
a query sees its own block and the blocks before, blocks counted from each row's first
token) with a fused query_key_value projection, q/k RMSNorm, RoPE over the first
partial_rotary_factor of each head, and a mixture of experts (`mdjax.models.moe`) in every
layer from `first_k_dense_replace` on: sigmoid router scores with an expert bias for the
choice, group-limited top-k, normalised weights times routed_scaling_factor, shared experts.

Stored otherwise than the params hold them, so mapped by `tensor_view` / `stored_tensors`:
query_key_value [(H + 2G) K, D] is split by rows into q, k, v (its heads are [H, G, G] in
that order), and the experts' model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight
are stacked into [E, in, out].

Its reference sampler is LLaDA2MoeModelLM.generate: blocks of `block_length` generated in
turn (`sampling.sample_blocks`, the exact cache of the finished blocks; the published loop
recomputes them, which block-causal attention makes the same), each by
`sampling.ConfidenceSpec` with the block's schedule of block_length // steps commits a step
(the remainder on the first steps) raised to every proposal whose probability passes
`threshold`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

from mdjax import sampling
from mdjax.errors import ArgumentError
from mdjax.formats.base import (
  TORCH_DTYPES,
  Format,
  Leaf,
  config_bool,
  config_token_id,
  config_value,
  build_published_config,
  refuse_value,
  refuse_keys,
  with_special_ids,
  check_int,
  check_number,
  fuse_rows,
  split_rows,
  stack_parts,
  unstack,
)
from mdjax.model import SamplerPlan
from mdjax.models import published
from mdjax.models.moe import MoEConfig
from mdjax.models.published import PublishedConfig
from mdjax.sampling.knobs import Knob

# The published checkpoints' ids (LLaDA2.0-mini / flash: vocabulary 157184), which their
# config.json does not all carry: `generate`'s defaults.
LLADA2_VOCAB = 157184
LLADA2_MASK_ID = 156895
LLADA2_EOS_ID = 156892
LLADA2_BLOCK = 32  # generate's block_length (the attention's block size)

PROJECTIONS = ("gate", "up", "down")
QKV = ("q", "k", "v")


def plan(model, *, prompt_length: int, max_new_tokens: int, block_length: int | None = None,
         steps: int | None = None, threshold: float | None = None, minimal_topk: int = 1,
         temperature: float = 0.0, top_p: float | None = None, top_k: int | None = None,
         editing_threshold: float | None = None, max_post_steps: int | None = None,
         num_to_transfer: int | None = None) -> SamplerPlan:
  """LLaDA2MoeModelLM.generate for `max_new_tokens` new tokens (gen_length): blocks of
  `block_length` (default the model's block size, 32), min(steps, max_new_tokens //
  minimal_topk) steps a block (steps default 32), the threshold rule (default 0.95) with the
  block's even schedule as floor.

  With `editing_threshold` (or `max_post_steps`): LLaDA2.1's generate instead, its joint
  threshold decoder (`sampling.LLaDA21Spec`: masks written above `threshold`, default 0.95,
  written tokens of the block edited above `editing_threshold`, default 0.9, then up to
  `max_post_steps` edit-only steps, `num_to_transfer` masks a step at least); `steps`, if
  given, bounds a block's steps."""
  block = model.config.block_size if block_length is None else block_length
  check_int(max_new_tokens, "max_new_tokens", 1)
  check_int(block, "block_length", 1)
  if editing_threshold is not None or max_post_steps is not None:
    return _editing_plan(model, prompt_length, max_new_tokens, block, steps, threshold,
                         minimal_topk, temperature, top_p, top_k, editing_threshold,
                         max_post_steps, num_to_transfer)
  if num_to_transfer is not None:
    raise ArgumentError.invalid("num_to_transfer", num_to_transfer, "it is a knob of "
                                "LLaDA2.1's editing decoder: give editing_threshold too")
  steps = 32 if steps is None else steps
  threshold = 0.95 if threshold is None else threshold
  check_int(steps, "steps", 1)
  check_int(minimal_topk, "minimal_topk", 1)
  per_block = min(steps, max_new_tokens // minimal_topk)
  if per_block < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens} // minimal_topk={minimal_topk} = 0 "
                     "steps a block: the reference would write nothing (give minimal_topk <= "
                     "max_new_tokens).")
  check_number(threshold, "threshold", "must lie in [0, 1]", lambda x: 0 <= x <= 1)
  check_number(temperature, "temperature", "must be a finite number >= 0", lambda x: x >= 0)
  if top_p is not None:
    check_number(top_p, "top_p", "must be None or lie in (0, 1]", lambda x: 0 < x <= 1)
  if top_k is not None:
    check_int(top_k, "top_k", 1)
  window = _window(model, prompt_length, max_new_tokens, block)
  spec = sampling.ConfidenceSpec(
      steps=per_block, score="prob", score_transformed=True, count_rule="even_block",
      # The reference commits probabilities strictly above the threshold: at 1.0 none, the
      # plain schedule (mdjax's threshold admits a probability equal to it).
      threshold=None if threshold >= 1 else float(threshold), threshold_floor="count",
      temperature=float(temperature), top_p=1.0 if top_p is None else float(top_p),
      top_k=top_k, eos_id=model.eos_id)
  denoiser = published.denoiser(dataclasses.replace(model.config, block_size=block))
  return SamplerPlan(denoiser=denoiser, spec=spec, blocks_of=block, window=window)


def _window(model, prompt_length: int, max_new_tokens: int, block: int) -> int:
  """The positions the prompt and the whole generation take in whole blocks (the reference
  attends to every block before the current one); a ValueError past the model's length."""
  window = -(-(prompt_length + max_new_tokens) // block) * block
  if window + block > model.config.max_len:
    raise ValueError(f"prompt_length={prompt_length} + max_new_tokens={max_new_tokens} does "
                     f"not fit the model's max_len={model.config.max_len} (in blocks of "
                     f"block_length={block}, one more for the last).")
  return window


def _editing_plan(model, prompt_length, max_new_tokens, block, steps, threshold,
                  minimal_topk, temperature, top_p, top_k, editing_threshold,
                  max_post_steps, num_to_transfer) -> SamplerPlan:
  """LLaDA2.1's generate (`plan`'s docstring): the llada21 family block by block, on the
  same block-causal network and exact cache as LLaDA2.0's decoder."""
  if minimal_topk != 1:  # LLaDA2.1's generate computes it and never reads it
    raise ArgumentError.invalid("minimal_topk", minimal_topk, "LLaDA2.1's editing decoder "
                                "(editing_threshold) does not read it: leave it at 1")
  knobs = dict(threshold=threshold, editing_threshold=editing_threshold,
               max_post_steps=max_post_steps, num_to_transfer=num_to_transfer, steps=steps,
               top_p=None if top_p is None else float(top_p), top_k=top_k)
  spec = sampling.LLaDA21Spec(temperature=float(temperature), eos_id=model.eos_id,
                              **{k: v for k, v in knobs.items() if v is not None})
  window = _window(model, prompt_length, max_new_tokens, block)
  denoiser = published.denoiser(dataclasses.replace(model.config, block_size=block))
  return SamplerPlan(denoiser=denoiser, spec=spec, blocks_of=block, window=window)


class Sampler:
  """LLaDA2MoeModelLM.generate as a model's default sampler: its defaults (blocks of 32,
  32 steps, threshold 0.95), greedy unless a temperature is given; LLaDA2.1's editing
  generate with `editing_threshold` (`plan`)."""

  knobs = ("block_length", "steps", "threshold", "minimal_topk", "temperature", "top_p",
           "top_k", "editing_threshold", "max_post_steps", "num_to_transfer")
  # Its own knobs (the others are the spec knobs of their names, `sampling.knobs`).
  own_knobs = (Knob("minimal_topk", int, 1, minimum=1, help="LLaDA2: a block runs "
                    "min(steps, max_new_tokens // minimal_topk) steps."),)
  spec_defaults: ClassVar[dict] = {"temperature": 0.0}  # the reference's greedy branch

  def plan(self, model, *, prompt_length: int, max_new_tokens: int, **knobs) -> SamplerPlan:
    return plan(model, prompt_length=prompt_length, max_new_tokens=max_new_tokens, **knobs)


# Keys of other published networks that change the architecture: refused by name.
FOREIGN_KEYS = ("bd_size", "attention_bias")


class LLaDA2Format(Format):
  """LLaDA2.0-mini's layout: LLaDA2MoeModelLM's state_dict names."""

  family = "llada2"
  network = "llada2"
  model_types = ("llada2_moe",)
  architectures = ("LLaDA2MoeModelLM",)
  sampler = Sampler()
  padding_invariant = True  # positions count from the first real token (block-causal)

  def tied(self, raw: dict) -> bool:
    return config_bool(raw, "tie_word_embeddings", self.family, False)

  def config_from_hf(self, raw: dict, dtype: str) -> PublishedConfig:
    f = self.family
    refuse_keys(raw, f, FOREIGN_KEYS, "another network's key: LLaDA2's blocks are "
                "generate's block_length, its projections have no bias")
    refuse_value(raw, f, "hidden_act", ("silu",), "the MLPs are silu(gate) * up")
    refuse_value(raw, f, "rope_scaling", (None,), "RoPE is unscaled")
    refuse_value(raw, f, "use_bias", (False,), "the attention's output projection has no bias "
                 "(the configuration's default is True: the published checkpoints set false)")
    refuse_value(raw, f, "use_sliding_window", (False,), "attention is over whole blocks")
    refuse_value(raw, f, "use_linear_attention", (False,), "every layer is softmax attention")
    # The published code reads neither key: sigmoid scores, weights normalised over the
    # chosen experts whenever more than one is chosen. Another value would be a model that
    # code does not run.
    refuse_value(raw, f, "score_function", ("sigmoid",), "the published router computes sigmoid "
                 "scores whatever this key says")
    refuse_value(raw, f, "norm_topk_prob", (True,), "the published router normalises the chosen "
                 "experts' weights whatever this key says")
    d = config_value(raw, "hidden_size", int, f)
    heads = config_value(raw, "num_attention_heads", int, f)
    kv = config_value(raw, "num_key_value_heads", int, f, heads)
    if kv < 1:
      raise ValueError(f"{f} config.json: num_key_value_heads={kv} must be >= 1 (the "
                       "published attention divides by it)")
    if heads < 1 or d % heads and "head_dim" not in raw:
      raise ValueError(f"{f} config.json: num_attention_heads={heads} must divide "
                       f"hidden_size={d} when there is no head_dim")
    head_dim = config_value(raw, "head_dim", int, f, d // heads)
    # the configuration's default
    factor = config_value(raw, "partial_rotary_factor", float, f, 0.5)
    rotary = int(head_dim * factor)
    if not (2 <= rotary <= head_dim and rotary % 2 == 0):
      raise ValueError(f"{f} config.json: partial_rotary_factor={factor!r} turns "
                       f"int({head_dim} * {factor}) = {rotary} dims of each head: RoPE needs "
                       f"an even count in [2, head_dim={head_dim}]")
    num_layers = config_value(raw, "num_hidden_layers", int, f)
    experts = raw.get("num_experts")
    moe = None
    if experts is not None:
      shared = raw.get("num_shared_experts")
      if shared is not None and config_value(raw, "num_shared_experts", int, f) < 1:
        raise ValueError(f"{f} config.json: num_shared_experts={shared!r} is not supported "
                         "(None: no shared experts; the code makes 0 a zero-width MLP)")
      first_dense = config_value(raw, "first_k_dense_replace", int, f, 0)
      try:
        moe = MoEConfig(
            num_experts=config_value(raw, "num_experts", int, f),
            experts_per_token=config_value(raw, "num_experts_per_tok", int, f, 2),
            expert_hidden=config_value(raw, "moe_intermediate_size", int, f),
            num_shared_experts=0 if shared is None else int(shared),
            n_group=config_value(raw, "n_group", int, f, 8),
            topk_group=config_value(raw, "topk_group", int, f, 4),
            routed_scaling_factor=config_value(raw, "routed_scaling_factor", float, f, 2.5),
            score_function="sigmoid", norm_topk_prob=True,
            first_dense_layers=min(max(first_dense, 0), num_layers))
      except ValueError as e:  # MoEConfig names its field; config.json's key is said here
        raise ValueError(f"{f} config.json (num_experts, num_experts_per_tok, "
                         f"moe_intermediate_size, n_group, topk_group, ...): {e}") from None
      if moe.num_experts // moe.n_group < 2:
        raise ValueError(f"{f} config.json: n_group={moe.n_group} leaves one expert a group; "
                         "the published router takes each group's two best scores")
    dense = num_layers if moe is None else moe.first_dense_layers
    mlp_hidden = (config_value(raw, "intermediate_size", int, f) if dense
                  else config_value(raw, "intermediate_size", int, f, None) or moe.expert_hidden)
    vocab = config_value(raw, "vocab_size", int, f)
    published_ids = vocab == LLADA2_VOCAB
    mask = config_value(raw, "mask_token_id", int, f, LLADA2_MASK_ID if published_ids else None)
    if mask is None:
      raise ValueError(f"{f} config.json: no mask_token_id (and vocab_size={vocab} is not the "
                       f"published {LLADA2_VOCAB}, whose mask id {LLADA2_MASK_ID} is known)")
    eos = config_token_id(raw, "eos_token_id", f)
    if eos is None and published_ids:
      eos = LLADA2_EOS_ID
    block = config_value(raw, "block_size", int, f, LLADA2_BLOCK)
    return build_published_config(
        self.network, vocab_size=vocab, d_model=d, num_layers=num_layers, num_heads=heads,
        num_kv_heads=kv, head_dim=head_dim, mlp_hidden=mlp_hidden,
        rope_theta=config_value(raw, "rope_theta", float, f, 10000.0),
        norm_eps=config_value(raw, "rms_norm_eps", float, f, 1e-5),
        qkv_bias=config_bool(raw, "use_qkv_bias", f, False), logit_shift=False, mask_id=mask,
        eos_id=eos, max_len=config_value(raw, "max_position_embeddings", int, f, 16384),
        dtype=dtype,
        qk_norm=config_bool(raw, "use_qk_norm", f, True),
        rotary_dim=None if rotary == head_dim else rotary, block_size=block, moe=moe)

  def config_to_hf(self, config: PublishedConfig) -> dict:
    if not isinstance(config, PublishedConfig) or config.family != self.network:
      raise ValueError(f"config.family={getattr(config, 'family', None)!r} cannot be written "
                       f"as {self.family}")
    if config.logit_shift or config.block_size is None:
      raise ValueError(f"config.logit_shift={config.logit_shift}, block_size="
                       f"{config.block_size} cannot be written as {self.family} (its code "
                       "does not shift and attends block-causally)")
    rotary = config.rotary_dim or config.head_dim
    if int(config.head_dim * (rotary / config.head_dim)) != rotary:
      raise ValueError(f"rotary_dim={rotary} is not int(head_dim * factor) for any "
                       f"partial_rotary_factor of head_dim={config.head_dim}")
    moe = config.moe
    if moe is not None and (moe.score_function != "sigmoid" or not moe.norm_topk_prob):
      raise ValueError(f"moe.score_function={moe.score_function!r}, norm_topk_prob="
                       f"{moe.norm_topk_prob} cannot be written as {self.family} (its router "
                       "is sigmoid and normalises)")
    raw = {
        "architectures": list(self.architectures), "model_type": self.model_types[0],
        "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                     "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                     "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
        "attention_dropout": 0.0, "embedding_dropout": 0.0, "output_dropout": 0.0,
        "head_dim": config.head_dim, "hidden_act": "silu", "hidden_size": config.d_model,
        "initializer_range": 0.02, "intermediate_size": config.mlp_hidden,
        "mask_token_id": config.mask_id, "max_position_embeddings": config.max_len,
        "max_window_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_hidden_layers": config.num_layers, "num_key_value_heads": config.num_kv_heads,
        "partial_rotary_factor": rotary / config.head_dim, "rms_norm_eps": config.norm_eps,
        "rope_scaling": None, "rope_theta": config.rope_theta, "tie_word_embeddings": False,
        "torch_dtype": TORCH_DTYPES[config.dtype], "use_bias": False, "use_cache": False,
        "use_qk_norm": config.qk_norm, "use_qkv_bias": config.qkv_bias,
        "use_sliding_window": False, "vocab_size": config.vocab_size,
        "num_experts": None if moe is None else moe.num_experts,
    }
    if config.block_size != LLADA2_BLOCK:
      raw["block_size"] = config.block_size
    if moe is not None:
      raw.update({
          "first_k_dense_replace": moe.first_dense_layers, "moe_intermediate_size":
          moe.expert_hidden, "n_group": moe.n_group, "norm_topk_prob": True,
          "num_experts_per_tok": moe.experts_per_token,
          "num_shared_experts": moe.num_shared_experts or None,
          "routed_scaling_factor": moe.routed_scaling_factor, "score_function": "sigmoid",
          "topk_group": moe.topk_group})
    return with_special_ids(raw, config)

  def leaves(self, config: PublishedConfig, tied: bool = False) -> list[Leaf]:
    b = "model.layers.{i}"
    qkv = f"{b}.attention.query_key_value"
    out = [Leaf(("embed",), "model.word_embeddings.weight")]
    dense = config.dense_layers
    stacks = [("layers", 0, dense)]
    if config.moe is not None and config.num_layers > dense:
      stacks.append(("moe_layers", dense, config.num_layers))
    for group, first, stop in stacks:
      if stop <= first:
        continue
      span = (first, stop)
      leaf = lambda name, hf, transpose=False, g=group, s=span: Leaf((g, name), hf, transpose, s)
      out += [leaf("attn_norm", f"{b}.input_layernorm.weight")]
      out += [leaf(p, f"{qkv}.weight[{p}]", True) for p in QKV]
      if config.qkv_bias:
        out += [leaf(f"{p}_bias", f"{qkv}.bias[{p}]") for p in QKV]
      if config.qk_norm:
        out += [leaf("q_norm", f"{b}.attention.query_layernorm.weight"),
                leaf("k_norm", f"{b}.attention.key_layernorm.weight")]
      out += [leaf("o", f"{b}.attention.dense.weight", True),
              leaf("mlp_norm", f"{b}.post_attention_layernorm.weight")]
      if group == "layers":
        out += [leaf(p, f"{b}.mlp.{p}_proj.weight", True) for p in PROJECTIONS]
        continue
      out += [leaf("router", f"{b}.mlp.gate.weight", True),
              leaf("expert_bias", f"{b}.mlp.gate.expert_bias")]
      # The stacked views are [E, in, out] already (`tensor_view`): no transpose here.
      out += [leaf(f"experts_{p}", f"{b}.mlp.experts.{p}_proj.weight") for p in PROJECTIONS]
      if config.moe.num_shared_experts:
        out += [leaf(f"shared_{p}", f"{b}.mlp.shared_experts.{p}_proj.weight", True)
                for p in PROJECTIONS]
    out += [Leaf(("final_norm",), "model.norm.weight"),
            Leaf(("head",), "model.word_embeddings.weight" if tied else "lm_head.weight", True)]
    return out

  # --- the stored layout <-> the leaves' tensors ---

  def tensor_view(self, infos: dict, raw: dict, where: str) -> dict:
    """query_key_value split into its q, k, v rows; each layer's per-expert matrices
    stacked (a layer missing some expert's tensor is a ValueError naming it)."""
    config = self.config_from_hf(raw, "float32")
    hk, gk = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    rows = {"q": hk, "k": gk, "v": gk}
    expert = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
    layers_with_experts = sorted({int(m.group(1)) for n in infos
                                  if (m := expert.fullmatch(n))})
    count = config.moe.num_experts if config.moe is not None else 0
    for i in layers_with_experts:
      for p in PROJECTIONS:
        names = [f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight" for e in range(count)]
        infos = stack_parts(infos, f"model.layers.{i}.mlp.experts.{p}_proj.weight", names,
                            where, transpose=True)
    fused = re.compile(r"model\.layers\.\d+\.attention\.query_key_value\.(weight|bias)")
    for name in [n for n in infos if fused.fullmatch(n)]:
      infos = split_rows(infos, name, rows, where)
    return infos

  def stored_tensors(self, tensors: dict, config) -> dict:
    for i in range(config.num_layers):
      for kind in ("weight", "bias"):
        name = f"model.layers.{i}.attention.query_key_value.{kind}"
        if f"{name}[q]" in tensors:
          tensors = fuse_rows(tensors, name, list(QKV))
      for p in PROJECTIONS:
        name = f"model.layers.{i}.mlp.experts.{p}_proj.weight"
        if name in tensors:
          parts = [f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight"
                   for e in range(config.moe.num_experts)]
          tensors = unstack(tensors, name, parts, transpose=True)
    return tensors
