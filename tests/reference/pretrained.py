"""Regenerates the published-checkpoint parity fixtures in tests/fixtures/pretrained/.

  pip install -e '.[reference]'
  python -m tests.reference.pretrained [--out tests/fixtures/pretrained] \
      [--fast-dllm PATH] [--llada PATH]

Every file is rebuilt from fixed seeds; nothing is downloaded. What it writes:

  llada/, dream/   tiny random float32 checkpoints in the published layouts (LLaDA-8B's
                   `model.transformer.*` names and OLMo-style config.json; Dream-7B's Qwen2
                   names and config.json), with a char-level tokenizer.json and a
                   tokenizer_config.json carrying a chat template.
  reference_logits.npz   per family a 2 x 16 batch (mask ids inside, row 0 left-padded),
                   its valid mask and the float32 logits (Dream's already shifted). NaN marks
                   the entries no implementation defines: padded positions, and Dream's first
                   real position of a padded row (its shifted logit is a padded query's output).
  generations.json the reference loops' outputs at temperature 0 (see CASES below).

The reference forward is `transformers`' LlamaForCausalLM (LLaDA, tensors renamed) and
Qwen2ForCausalLM (Dream) made bidirectional: `is_causal = False` on every attention module,
eager attention, and an explicit additive 4-D mask. LLaDA's positions are 0..L-1 whatever the
padding (its modeling code ignores padding there) and only padded keys are masked; Dream's are
cumsum(valid) - 1 with padding at 1 and its generation code's mask (valid query AND valid key).
The mask id's logit is set to -inf in every reference forward: trained checkpoints never
predict [MASK], random ones would, and mdjax's contract excludes it.

Fast-dLLM's KV-cache passes (`past_key_values`, and `replace_position` for the dual cache) are
not expressible through the transformers forward, so `LladaTorch` below is the smallest torch
forward of Fast-dLLM's LLaDA attention: keys cached before RoPE, a prefix pass's queries at
positions [key_len - T, key_len), a dual pass's block keys written over the cache at the block's
positions and its queries at [block_end - T, block_end). Its full pass agrees with the
transformers forward to float rounding (checked on every run).

Cross-checks against the published code (optional; nothing of it is committed):
`--fast-dllm PATH` (a checkout or git directory of github.com/NVlabs/Fast-dLLM) imports its
llada/model/ and dream/model/ by path into a temporary package; `--llada PATH` (of
github.com/ML-GSAI/LLaDA) imports its generate.py. Under transformers 5.25 / torch 2.13 they
run with three stand-ins, none touching the computation: an `einops` module when it is missing
(only a block type these checkpoints lack uses it), `use_cache=False` passed explicitly
(transformers 5 drops LLaDAConfig's attribute), and transformers 4.x's unscaled RoPE
initialisation registered as "default" for Dream's rotary module. Each checkpoint loads into
LLaDAModelLM / DreamModel with strict=True (every published tensor name and shape). Results,
maximum absolute logit differences (float32, 1 thread):

  LLaDAModelLM full pass vs the transformers forward                    9.7e-06
  LLaDAModelLM prefix-cache pass vs LladaTorch                          0
  LLaDAModelLM dual-cache pass vs LladaTorch                            0
  DreamModel vs the transformers forward, unpadded                      9.1e-06
  DreamModel vs the transformers forward, left-padded, real positions   1.0e-05

and the same tokens for every case that the published loops can run as published:
llada_full, llada_semi_ar and llada_left_padded through LLaDA's generate.py `generate`;
llada_prefix_cache and llada_dual_cache through the transcribed Fast-dLLM loops on
LLaDAModelLM, one row at a time (its dual pass finds the block with replace_position.nonzero()
over the batch, which only works for batch 1); every Dream case through DreamModel's own
`_sample` (diffusion_generate's config plumbing fails under transformers 5 on
DreamGenerationConfig.validate's signature, so `_sample` is called with the settings it would
pass, and a logits hook sets [MASK] to -inf). Fast-dLLM's LLaDA attention passes attn_mask=None
to SDPA, so that file ignores padding; the padded LLaDA rows are checked against the
transformers forward and LLaDA's generate.py only.

The reference loops are transcriptions (ids made parameters; no behaviour changed unless said):
  * LLaDA `generate`, `get_num_transfer_tokens`, `add_gumbel_noise` (ML-GSAI/LLaDA generate.py).
    Deviations: with cfg_scale > 0 and no attention_mask the original reads an unbound
    `attention_mask_`, here None; after the cfg combination the [MASK] column, (-inf) - (-inf),
    is set back to -inf.
  * Fast-dLLM `generate`, `generate_with_prefix_cache`, `generate_with_dual_cache`,
    `get_transfer_index`, `get_transfer_index_dynamic` (NVlabs/Fast-dLLM llada/generate.py, the version with `factor`).
    Deviations: `get_transfer_index_dynamic` skips a row with no masked position left in the
    block (the published loop would index an empty list there; it happens in a batch whose rows
    finish a block at different steps); LladaTorch's dual pass reads the block's positions from
    row 0 of replace_position (see above).
  * Dream `_sample` and `sample_tokens` (Dream's generation_utils.py as copied in Fast-dLLM
    dream/model/), algs origin / maskgit_plus / topk_margin / entropy.

Every decision is checked to be robust to float rounding: at each step the argmax gap of every
transferred position, the confidence gap at the top-k cut, each threshold comparison and Dream's
int() of the transfer count must exceed 1e-4 relative. A case whose prompt seed fails is rerun
with the next seed (the seed used is stored in the case); left-padded cases must also give each
row the tokens it gets alone, the cases in DIFFERS_FROM must be changed by the option they
test, and those in MUST_GENERATE must generate their id.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import math
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile

import numpy as np

try:
  import safetensors.torch
  import torch
  import torch.nn.functional as F
  import transformers
except ImportError as e:  # the optional extra
  raise SystemExit(f"{e}: install the reference extra: pip install -e '.[reference]'")

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "pretrained"

VOCAB = 320
EOS_ID = 290
BOS_ID = 291
MASK_ID = 300
EOT_ID = 310
MARGIN = 1e-4  # relative margin every sampling decision must clear

# --- tokenizer ----------------------------------------------------------------------------

CHARS = [chr(c) for c in range(32, 127)] + ["\n"]  # ids 0..95
UNK = "<|unk|>"  # id 96
SPECIALS = {EOS_ID: "<|endoftext|>", BOS_ID: "<|startoftext|>", 292: "<|start_header_id|>",
            293: "<|end_header_id|>", 294: "<|im_start|>", 295: "<|im_end|>",
            MASK_ID: "<|mdm_mask|>", EOT_ID: "<|eot_id|>"}

# LLaDA-8B-Instruct's template (Llama-3 headers, <|eot_id|> ends a turn).
LLADA_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + "
    "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")
# Dream's (Qwen2 ChatML), without its default system prompt.
DREAM_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def vocab() -> dict[str, int]:
  out = {c: i for i, c in enumerate(CHARS)}
  out[UNK] = len(CHARS)
  for i in range(len(CHARS) + 1, VOCAB):
    out[SPECIALS.get(i, f"<|reserved_{i}|>")] = i
  return out


def build_tokenizer():
  """A char-level WordLevel tokenizer over printable ASCII and newline (ids < 96), the
  special tokens at their config ids, and reserved names for the rest of the 320 ids."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
  tok = Tokenizer(models.WordLevel(vocab(), unk_token=UNK))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                          for _, s in sorted(SPECIALS.items())])
  return tok


def tokenizer_config(template: str) -> dict:
  return {"bos_token": SPECIALS[BOS_ID], "eos_token": SPECIALS[EOS_ID],
          "pad_token": SPECIALS[EOS_ID], "mask_token": SPECIALS[MASK_ID], "unk_token": UNK,
          "chat_template": template, "clean_up_tokenization_spaces": False,
          "model_max_length": 4096, "padding_side": "left",
          "tokenizer_class": "PreTrainedTokenizerFast"}


# --- configs and weights in the published layouts -----------------------------------------

LLADA_CONFIG = {
    "architectures": ["LLaDAModelLM"], "model_type": "llada", "activation_type": "silu",
    "alibi": False, "alibi_bias_max": 8.0, "attention_dropout": 0.0,
    "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
    "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama",
    "d_model": 64, "embedding_dropout": 0.0, "embedding_size": VOCAB, "eos_token_id": EOS_ID,
    "eot_token_id": EOT_ID, "flash_attention": False, "include_bias": False,
    "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta",
    "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False,
    "layer_norm_type": "rms", "layer_norm_with_affine": True, "mask_token_id": MASK_ID,
    "max_sequence_length": 4096, "mlp_hidden_size": 128, "mlp_ratio": 4,
    "multi_query_attention": None, "n_heads": 4, "n_kv_heads": 4, "n_layers": 2,
    "pad_token_id": EOS_ID, "precision": "amp_bf16", "residual_dropout": 0.0,
    "rms_norm_eps": 1e-5, "rope": True, "rope_full_precision": True, "rope_theta": 500000.0,
    "scale_logits": False, "torch_dtype": "float32", "use_cache": False, "vocab_size": VOCAB,
    "weight_tying": False,
}

DREAM_CONFIG = {
    "architectures": ["DreamModel"], "model_type": "Dream", "attention_dropout": 0.0,
    "bos_token_id": EOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID,
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 128, "mask_token_id": MASK_ID, "max_position_embeddings": 4096,
    "max_window_layers": 2, "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_scaling": None,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "float32", "use_cache": False, "use_sliding_window": False,
    "vocab_size": VOCAB,
}

# Scales chosen so that logits are well spread (a std-0.02 random model gives near-uniform
# logits whose rankings flip on rounding); EOS and EoT get larger head rows so they are often
# the argmax and the eos/eot options change the outcome.
EMBED_STD, HEAD_STD, SPECIAL_HEAD_SCALE, BIAS_STD = 1.0, 0.35, 2.0, 0.3
# Sharp, strong attention and a small [MASK] embedding, so that masked positions predict
# from their context (position-dependent) rather than all repeating one token.
QK_SCALE, VO_SCALE, MASK_EMBED_SCALE = 2.5, 1.5, 0.2


def _normal(rng, shape, std):
  return (rng.standard_normal(shape) * std).astype(np.float32)


def _linear(rng, out_dim, in_dim, scale=1.0):
  return _normal(rng, (out_dim, in_dim), scale / math.sqrt(in_dim))


def _norm_weight(rng, d):
  return (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)


def _embed(rng, d):
  embed = _normal(rng, (VOCAB, d), EMBED_STD)
  embed[MASK_ID] *= MASK_EMBED_SCALE
  return embed


def _head(rng, d):
  head = _normal(rng, (VOCAB, d), HEAD_STD)
  head[[EOS_ID, EOT_ID]] *= SPECIAL_HEAD_SCALE
  return head


def llada_weights(seed: int) -> dict[str, np.ndarray]:
  """LLaDA's tensors by their published names (torch Linear [out, in])."""
  c = LLADA_CONFIG
  d, f, n = c["d_model"], c["mlp_hidden_size"], c["n_layers"]
  kv = c["n_kv_heads"] * (d // c["n_heads"])
  rng = np.random.default_rng(seed)
  t = "model.transformer"
  out = {f"{t}.wte.weight": _embed(rng, d)}
  for i in range(n):
    b = f"{t}.blocks.{i}"
    out[f"{b}.attn_norm.weight"] = _norm_weight(rng, d)
    out[f"{b}.q_proj.weight"] = _linear(rng, d, d, QK_SCALE)
    out[f"{b}.k_proj.weight"] = _linear(rng, kv, d, QK_SCALE)
    out[f"{b}.v_proj.weight"] = _linear(rng, kv, d, VO_SCALE)
    out[f"{b}.attn_out.weight"] = _linear(rng, d, d, VO_SCALE)
    out[f"{b}.ff_norm.weight"] = _norm_weight(rng, d)
    out[f"{b}.ff_proj.weight"] = _linear(rng, f, d)
    out[f"{b}.up_proj.weight"] = _linear(rng, f, d)
    out[f"{b}.ff_out.weight"] = _linear(rng, d, f)
  out[f"{t}.ln_f.weight"] = _norm_weight(rng, d)
  out[f"{t}.ff_out.weight"] = _head(rng, d)
  return out


def dream_weights(seed: int) -> dict[str, np.ndarray]:
  """Dream's tensors by their published (Qwen2) names."""
  c = DREAM_CONFIG
  d, f, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
  kv = c["num_key_value_heads"] * (d // c["num_attention_heads"])
  rng = np.random.default_rng(seed)
  out = {"model.embed_tokens.weight": _embed(rng, d)}
  for i in range(n):
    b = f"model.layers.{i}"
    out[f"{b}.input_layernorm.weight"] = _norm_weight(rng, d)
    for p, width, scale in (("q", d, QK_SCALE), ("k", kv, QK_SCALE), ("v", kv, VO_SCALE)):
      out[f"{b}.self_attn.{p}_proj.weight"] = _linear(rng, width, d, scale)
      out[f"{b}.self_attn.{p}_proj.bias"] = _normal(rng, (width,), BIAS_STD)
    out[f"{b}.self_attn.o_proj.weight"] = _linear(rng, d, d, VO_SCALE)
    out[f"{b}.post_attention_layernorm.weight"] = _norm_weight(rng, d)
    out[f"{b}.mlp.gate_proj.weight"] = _linear(rng, f, d)
    out[f"{b}.mlp.up_proj.weight"] = _linear(rng, f, d)
    out[f"{b}.mlp.down_proj.weight"] = _linear(rng, d, f)
  out["model.norm.weight"] = _norm_weight(rng, d)
  out["lm_head.weight"] = _head(rng, d)
  return out


def write_checkpoint(folder: pathlib.Path, config: dict, weights: dict, template: str):
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
  tensors = {k: torch.from_numpy(v).contiguous() for k, v in sorted(weights.items())}
  safetensors.torch.save_file(tensors, str(folder / "model.safetensors"),
                              metadata={"format": "pt"})
  build_tokenizer().save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(
      json.dumps(tokenizer_config(template), indent=2, sort_keys=True) + "\n")


def check_tokenizer(folder: pathlib.Path):
  """The files load as a transformers fast tokenizer and the template renders."""
  tok = transformers.PreTrainedTokenizerFast(
      tokenizer_file=str(folder / "tokenizer.json"),
      **{k: v for k, v in tokenizer_config("").items()
         if k.endswith("_token")})
  cfg = json.loads((folder / "tokenizer_config.json").read_text())
  tok.chat_template = cfg["chat_template"]
  text = tok.apply_chat_template([{"role": "user", "content": "Hi!"}],
                                 add_generation_prompt=True, tokenize=False)
  ids = tok(text, add_special_tokens=False)["input_ids"]
  assert tok.decode(ids) == text, (text, tok.decode(ids))
  assert max(tok("Hello, world!\n")["input_ids"]) < len(CHARS)
  assert tok.convert_tokens_to_ids(SPECIALS[MASK_ID]) == MASK_ID


# --- reference forwards -------------------------------------------------------------------

_RENAME_LLADA = {"attn_norm": "input_layernorm", "q_proj": "self_attn.q_proj",
                 "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
                 "attn_out": "self_attn.o_proj", "ff_norm": "post_attention_layernorm",
                 "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "ff_out": "mlp.down_proj"}


def llada_to_llama(weights: dict) -> dict:
  """LLaDA's names -> LlamaForCausalLM's."""
  out = {}
  for name, value in weights.items():
    parts = name.split(".")
    if parts[2] == "blocks":
      out[f"model.layers.{parts[3]}.{_RENAME_LLADA[parts[4]]}.weight"] = value
    else:
      out[{"wte": "model.embed_tokens.weight", "ln_f": "model.norm.weight",
           "ff_out": "lm_head.weight"}[parts[2]]] = value
  return out


def _hf_model(cls, config, weights: dict):
  config._attn_implementation = "eager"
  model = cls(config).eval()
  model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
  for module in model.modules():  # bidirectional
    if hasattr(module, "is_causal"):
      module.is_causal = False
  return model


def _additive(allowed_Bx1xQxK: torch.Tensor) -> torch.Tensor:
  return torch.where(allowed_Bx1xQxK, 0.0, torch.finfo(torch.float32).min)


class Out(types.SimpleNamespace):
  pass


class LladaHF:
  """LLaDA as a bidirectional LlamaForCausalLM, called like LLaDAModelLM:
  model(x, attention_mask=None).logits, unshifted, mask logit -inf."""

  def __init__(self, weights: dict):
    c = LLADA_CONFIG
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=c["d_model"], intermediate_size=c["mlp_hidden_size"],
        num_hidden_layers=c["n_layers"], num_attention_heads=c["n_heads"],
        num_key_value_heads=c["n_kv_heads"], rms_norm_eps=c["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]},
        max_position_embeddings=c["max_sequence_length"], tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False)
    self.model = _hf_model(transformers.LlamaForCausalLM, config, llada_to_llama(weights))
    self.device = torch.device("cpu")  # read by the published generate()

  @torch.no_grad()
  def __call__(self, x, attention_mask=None):
    batch, length = x.shape
    valid = (torch.ones_like(x, dtype=torch.bool) if attention_mask is None
             else attention_mask.bool())
    mask = _additive(valid[:, None, None, :].expand(batch, 1, length, length))
    pos = torch.arange(length)[None].expand(batch, length)
    logits = self.model(input_ids=x, attention_mask=mask, position_ids=pos).logits.float()
    logits[..., MASK_ID] = -torch.inf
    return Out(logits=logits)


class DreamHF:
  """Dream as a bidirectional Qwen2ForCausalLM, called like DreamModel in Dream's `_sample`:
  model(x, attention_mask, tok_idx).logits, unshifted, mask logit -inf. attention_mask is
  "full" or Dream's B x 1 x N x N boolean."""

  def __init__(self, weights: dict):
    c = DREAM_CONFIG
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"], rms_norm_eps=c["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]},
        max_position_embeddings=c["max_position_embeddings"], tie_word_embeddings=False,
        use_sliding_window=False)
    self.model = _hf_model(transformers.Qwen2ForCausalLM, config, weights)

  @torch.no_grad()
  def __call__(self, x, attention_mask="full", position_ids=None):
    batch, length = x.shape
    if isinstance(attention_mask, torch.Tensor):
      mask = _additive(attention_mask.bool())
    else:
      mask = torch.zeros(batch, 1, length, length)
    if position_ids is None:
      position_ids = torch.arange(length)[None].expand(batch, length)
    logits = self.model(input_ids=x, attention_mask=mask, position_ids=position_ids).logits
    logits = logits.float()
    logits[..., MASK_ID] = -torch.inf
    return Out(logits=logits)


def _rope(t, pos_sin, pos_cos):
  half = t.shape[-1] // 2
  rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
  return t * pos_cos + rotated * pos_sin


class LladaTorch:
  """Fast-dLLM's LLaDA forward with its cache arguments (see the module docstring):
  model(x, past_key_values=None, use_cache=False, replace_position=None)."""

  def __init__(self, weights: dict):
    self.w = {k: torch.from_numpy(v) for k, v in weights.items()}
    c = LLADA_CONFIG
    self.heads, self.kv_heads, self.layers = c["n_heads"], c["n_kv_heads"], c["n_layers"]
    self.head_dim = c["d_model"] // c["n_heads"]
    self.eps, self.theta = c["rms_norm_eps"], c["rope_theta"]

  def _norm(self, x, weight):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    return weight * x

  def _sin_cos(self, length):
    dim = self.head_dim
    inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = torch.einsum("i , j -> i j", torch.arange(length, dtype=torch.float), inv_freq)
    positions = torch.cat((freqs, freqs), dim=-1)
    return positions.sin()[None, None], positions.cos()[None, None]

  @torch.no_grad()
  def __call__(self, x, past_key_values=None, use_cache=False, replace_position=None):
    w, t = self.w, "model.transformer"
    batch, length = x.shape
    h = F.embedding(x, w[f"{t}.wte.weight"])
    presents = []
    for i in range(self.layers):
      b = f"{t}.blocks.{i}"
      xn = self._norm(h, w[f"{b}.attn_norm.weight"])
      q = F.linear(xn, w[f"{b}.q_proj.weight"]).view(batch, length, self.heads, -1)
      k = F.linear(xn, w[f"{b}.k_proj.weight"]).view(batch, length, self.kv_heads, -1)
      v = F.linear(xn, w[f"{b}.v_proj.weight"]).view(batch, length, self.kv_heads, -1)
      q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
      if past_key_values is not None:
        past_key, past_value = past_key_values[i]
        if replace_position is None:
          k, v = torch.cat((past_key, k), dim=-2), torch.cat((past_value, v), dim=-2)
        else:  # written into the cache in place, as Fast-dLLM does
          # Fast-dLLM takes nonzero() over the whole batch, which repeats the block once per
          # row and only works for batch 1; every row's block is the same, so read row 0's.
          replace_indices = replace_position[:1].nonzero(as_tuple=True)[1]
          past_key[:, :, replace_indices] = k
          past_value[:, :, replace_indices] = v
          k, v = past_key, past_value
      presents.append((k, v))  # before RoPE, as Fast-dLLM caches them
      key_len = k.shape[-2]
      pos_sin, pos_cos = self._sin_cos(key_len)
      q_end = key_len if replace_position is None else int(replace_indices.max()) + 1
      q = _rope(q, pos_sin[:, :, q_end - length:q_end], pos_cos[:, :, q_end - length:q_end])
      k = _rope(k, pos_sin, pos_cos)
      if self.kv_heads != self.heads:
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
      att = F.scaled_dot_product_attention(q, k, v, is_causal=False)
      att = att.transpose(1, 2).reshape(batch, length, -1)
      h = h + F.linear(att, w[f"{b}.attn_out.weight"])
      xn = self._norm(h, w[f"{b}.ff_norm.weight"])
      y = F.silu(F.linear(xn, w[f"{b}.ff_proj.weight"])) * F.linear(xn, w[f"{b}.up_proj.weight"])
      h = h + F.linear(y, w[f"{b}.ff_out.weight"])
    logits = F.linear(self._norm(h, w[f"{t}.ln_f.weight"]), w[f"{t}.ff_out.weight"])
    logits[..., MASK_ID] = -torch.inf
    return Out(logits=logits, past_key_values=presents if use_cache else None)


# --- decision margins ---------------------------------------------------------------------


class Margins:
  """The smallest relative margin of any decision a loop took (see the module docstring)."""

  def __init__(self):
    self.min = math.inf
    self.where = None

  def _note(self, gap, scale, what):
    rel = float(gap) / max(float(scale), 1e-12)
    if rel < self.min:
      self.min, self.where = rel, what

  def argmax(self, logits_NxV: torch.Tensor, what="argmax"):
    if logits_NxV.numel() == 0:
      return
    top2 = torch.topk(logits_NxV.double(), 2, dim=-1).values
    for a, b in top2.tolist():
      self._note(a - b, max(abs(a), abs(b), 1.0), what)

  def cut(self, values: torch.Tensor, k: int, what="top-k cut"):
    """Choosing the k largest of `values` (-inf entries are not candidates)."""
    v = values.double()
    v = torch.sort(v[torch.isfinite(v)], descending=True).values.tolist()
    if 0 < k < len(v):
      self._note(v[k - 1] - v[k], max(abs(v[k - 1]), abs(v[k])), what)

  def compare(self, value, threshold, what="threshold"):
    self._note(abs(float(value) - float(threshold)), max(abs(float(threshold)), 1e-3), what)

  def integer(self, value, what="int()"):
    frac = float(value) - math.floor(float(value))
    self._note(min(frac, 1.0 - frac), 1.0, what)


# --- LLaDA generate.py (ML-GSAI/LLaDA) ----------------------------------------------------


def add_gumbel_noise(logits, temperature):
  if temperature == 0:
    return logits
  logits = logits.to(torch.float64)
  noise = torch.rand_like(logits, dtype=torch.float64)
  gumbel_noise = (- torch.log(noise)) ** temperature
  return logits.exp() / gumbel_noise


def get_num_transfer_tokens(mask_index, steps):
  mask_num = mask_index.sum(dim=1, keepdim=True)
  base = mask_num // steps
  remainder = mask_num % steps
  num_transfer_tokens = torch.zeros(mask_num.size(0), steps, dtype=torch.int64) + base
  for i in range(mask_num.size(0)):
    num_transfer_tokens[i, :remainder[i]] += 1
  return num_transfer_tokens


@torch.no_grad()
def llada_generate(model, prompt, attention_mask=None, steps=128, gen_length=128,
                   block_length=128, temperature=0., cfg_scale=0., remasking='low_confidence',
                   mask_id=MASK_ID, logits_eos_inf=False, confidence_eos_eot_inf=False,
                   eos_id=EOS_ID, eot_id=EOT_ID, margins=None):
  x = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id, dtype=torch.long)
  x[:, :prompt.shape[1]] = prompt.clone()
  if attention_mask is not None:
    attention_mask = torch.cat([attention_mask, torch.ones((prompt.shape[0], gen_length),
                                                           dtype=attention_mask.dtype)], dim=-1)
  prompt_index = (x != mask_id)
  assert gen_length % block_length == 0
  num_blocks = gen_length // block_length
  assert steps % num_blocks == 0
  steps = steps // num_blocks
  for num_block in range(num_blocks):
    block_mask_index = (x[:, prompt.shape[1] + num_block * block_length:
                          prompt.shape[1] + (num_block + 1) * block_length] == mask_id)
    num_transfer_tokens = get_num_transfer_tokens(block_mask_index, steps)
    for i in range(steps):
      mask_index = (x == mask_id)
      if cfg_scale > 0.:
        un_x = x.clone()
        un_x[prompt_index] = mask_id
        x_ = torch.cat([x, un_x], dim=0)
        attention_mask_ = None  # unbound in the original when attention_mask is None
        if attention_mask is not None:
          attention_mask_ = torch.cat([attention_mask, attention_mask], dim=0)
        logits = model(x_, attention_mask=attention_mask_).logits
        logits, un_logits = torch.chunk(logits, 2, dim=0)
        logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
        logits[:, :, mask_id] = -torch.inf  # (-inf) - (-inf) is NaN: keep [MASK] excluded
      else:
        logits = model(x, attention_mask=attention_mask).logits
      if logits_eos_inf:
        logits[:, :, eos_id] = -torch.inf
      logits_with_noise = add_gumbel_noise(logits, temperature=temperature)
      x0 = torch.argmax(logits_with_noise, dim=-1)
      argmax_logits = logits_with_noise.clone()
      if confidence_eos_eot_inf:
        logits_with_noise[:, :, eos_id] = logits[:, :, eot_id] = -torch.inf
      if remasking == 'low_confidence':
        p = F.softmax(logits, dim=-1)
        x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)
      elif remasking == 'random':
        x0_p = torch.rand((x0.shape[0], x0.shape[1]))
      else:
        raise NotImplementedError(remasking)
      x0_p[:, prompt.shape[1] + (num_block + 1) * block_length:] = -np.inf
      x0 = torch.where(mask_index, x0, x)
      confidence = torch.where(mask_index, x0_p, -np.inf)
      transfer_index = torch.zeros_like(x0, dtype=torch.bool)
      for j in range(confidence.shape[0]):
        _, select_index = torch.topk(confidence[j], k=num_transfer_tokens[j, i])
        transfer_index[j, select_index] = True
        if margins is not None:
          margins.cut(confidence[j], int(num_transfer_tokens[j, i]))
          margins.argmax(argmax_logits[j, select_index])
      x[transfer_index] = x0[transfer_index]
  return x


# --- Fast-dLLM llada/generate.py (NVlabs/Fast-dLLM) ---------------------------------------


@torch.no_grad()
def fast_generate(model, prompt, steps=128, gen_length=128, block_length=128, temperature=0.,
                  remasking='low_confidence', mask_id=MASK_ID, threshold=None, factor=None,
                  margins=None):
  x = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id, dtype=torch.long)
  x[:, :prompt.shape[1]] = prompt.clone()
  assert gen_length % block_length == 0
  num_blocks = gen_length // block_length
  assert steps % num_blocks == 0
  steps_per_block = steps // num_blocks
  nfe = 0
  for num_block in range(num_blocks):
    start = prompt.shape[1] + num_block * block_length
    end = start + block_length
    block_mask_index = (x[:, start:end] == mask_id)
    num_transfer_tokens = get_num_transfer_tokens(block_mask_index, steps_per_block)
    i = 0
    while True:
      nfe += 1
      mask_index = (x == mask_id)
      logits = model(x).logits
      mask_index[:, end:] = 0
      if factor is None:
        x0, transfer_index = get_transfer_index(
            logits, temperature, remasking, mask_index, x,
            num_transfer_tokens[:, i] if threshold is None else None, threshold, margins)
      else:
        x0, transfer_index = get_transfer_index_dynamic(
            logits, temperature, remasking, mask_index, x, None, factor, margins)
      x[transfer_index] = x0[transfer_index]
      i += 1
      if (x[:, start:end] == mask_id).sum() == 0:
        break
  return x, nfe


@torch.no_grad()
def generate_with_prefix_cache(model, prompt, steps=128, gen_length=128, block_length=128,
                               temperature=0., remasking='low_confidence', mask_id=MASK_ID,
                               threshold=None, factor=None, margins=None):
  x = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id, dtype=torch.long)
  x[:, :prompt.shape[1]] = prompt.clone()
  assert gen_length % block_length == 0
  num_blocks = gen_length // block_length
  assert steps % num_blocks == 0
  steps_per_block = steps // num_blocks
  nfe = 0
  for num_block in range(num_blocks):
    start = prompt.shape[1] + num_block * block_length
    end = start + block_length
    block_mask_index = (x[:, start:end] == mask_id)
    num_transfer_tokens = get_num_transfer_tokens(block_mask_index, steps_per_block)
    output = model(x, use_cache=True)
    past_key_values = output.past_key_values
    mask_index = (x == mask_id)
    mask_index[:, end:] = 0
    if factor is None:
      x0, transfer_index = get_transfer_index(
          output.logits, temperature, remasking, mask_index, x,
          num_transfer_tokens[:, 0] if threshold is None else None, threshold, margins)
    else:
      x0, transfer_index = get_transfer_index_dynamic(
          output.logits, temperature, remasking, mask_index, x, None, factor, margins)
    x[transfer_index] = x0[transfer_index]
    # keep only the prefix cache
    new_past_key_values = []
    for i in range(len(past_key_values)):
      new_past_key_values.append(())
      for j in range(len(past_key_values[i])):
        new_past_key_values[i] += (past_key_values[i][j][:, :, :start],)
    past_key_values = new_past_key_values
    nfe += 1
    i = 1
    while True:
      if (x[:, start:end] == mask_id).sum() == 0:
        break
      nfe += 1
      mask_index = (x[:, start:] == mask_id)
      mask_index[:, block_length:] = 0
      logits = model(x[:, start:], past_key_values=past_key_values, use_cache=True).logits
      if factor is None:
        x0, transfer_index = get_transfer_index(
            logits, temperature, remasking, mask_index, x[:, start:],
            num_transfer_tokens[:, i] if threshold is None else None, threshold, margins)
      else:
        x0, transfer_index = get_transfer_index_dynamic(
            logits, temperature, remasking, mask_index, x[:, start:], None, factor, margins)
      x[:, start:][transfer_index] = x0[transfer_index]
      i += 1
  return x, nfe


@torch.no_grad()
def generate_with_dual_cache(model, prompt, steps=128, gen_length=128, block_length=128,
                             temperature=0., remasking='low_confidence', mask_id=MASK_ID,
                             threshold=None, factor=None, margins=None):
  x = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id, dtype=torch.long)
  x[:, :prompt.shape[1]] = prompt.clone()
  assert gen_length % block_length == 0
  num_blocks = gen_length // block_length
  assert steps % num_blocks == 0
  steps_per_block = steps // num_blocks
  nfe = 0
  for num_block in range(num_blocks):
    start = prompt.shape[1] + num_block * block_length
    end = start + block_length
    block_mask_index = (x[:, start:end] == mask_id)
    num_transfer_tokens = get_num_transfer_tokens(block_mask_index, steps_per_block)
    output = model(x, use_cache=True)
    past_key_values = output.past_key_values
    mask_index = (x == mask_id)
    mask_index[:, end:] = 0
    if factor is None:
      x0, transfer_index = get_transfer_index(
          output.logits, temperature, remasking, mask_index, x,
          num_transfer_tokens[:, 0] if threshold is None else None, threshold, margins)
    else:
      x0, transfer_index = get_transfer_index_dynamic(
          output.logits, temperature, remasking, mask_index, x, None, factor, margins)
    x[transfer_index] = x0[transfer_index]
    nfe += 1
    i = 1
    replace_position = torch.zeros_like(x, dtype=torch.bool)
    replace_position[:, start:end] = 1
    while True:
      if (x[:, start:end] == mask_id).sum() == 0:
        break
      nfe += 1
      mask_index = (x[:, start:end] == mask_id)
      logits = model(x[:, start:end], past_key_values=past_key_values, use_cache=True,
                     replace_position=replace_position).logits
      if factor is None:
        x0, transfer_index = get_transfer_index(
            logits, temperature, remasking, mask_index, x[:, start:end],
            num_transfer_tokens[:, i] if threshold is None else None, threshold, margins)
      else:
        x0, transfer_index = get_transfer_index_dynamic(
            logits, temperature, remasking, mask_index, x[:, start:end], None, factor, margins)
      x[:, start:end][transfer_index] = x0[transfer_index]
      i += 1
  return x, nfe


def get_transfer_index(logits, temperature, remasking, mask_index, x, num_transfer_tokens,
                       threshold=None, margins=None):
  logits_with_noise = add_gumbel_noise(logits, temperature=temperature)
  x0 = torch.argmax(logits_with_noise, dim=-1)
  if remasking == 'low_confidence':
    p = F.softmax(logits.to(torch.float64), dim=-1)
    x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)
  elif remasking == 'random':
    x0_p = torch.rand((x0.shape[0], x0.shape[1]))
  else:
    raise NotImplementedError(remasking)
  x0 = torch.where(mask_index, x0, x)
  confidence = torch.where(mask_index, x0_p, -np.inf)
  transfer_index = torch.zeros_like(x0, dtype=torch.bool)
  if threshold is not None:
    num_transfer_tokens = mask_index.sum(dim=1, keepdim=True)
  for j in range(confidence.shape[0]):
    _, select_index = torch.topk(confidence[j], k=num_transfer_tokens[j])
    transfer_index[j, select_index] = True
    if threshold is not None:
      for k in range(1, num_transfer_tokens[j]):
        if confidence[j, select_index[k]] < threshold:
          transfer_index[j, select_index[k]] = False
    if margins is not None:
      n = int(num_transfer_tokens[j])
      if threshold is None:
        margins.cut(confidence[j], n)
      else:
        for k in range(1, n):
          margins.compare(confidence[j, select_index[k]], threshold)
        if n > 1 and confidence[j, select_index[1]] < threshold:  # which one is first matters
          margins.cut(confidence[j], 1)
      margins.argmax(logits_with_noise[j, transfer_index[j]])
  return x0, transfer_index


def get_transfer_index_dynamic(logits, temperature, remasking, mask_index, x,
                               num_transfer_tokens, factor=1, margins=None):
  logits_with_noise = add_gumbel_noise(logits, temperature=temperature)
  x0 = torch.argmax(logits_with_noise, dim=-1)
  if remasking == 'low_confidence':
    p = F.softmax(logits.to(torch.float64), dim=-1)
    x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)
  elif remasking == 'random':
    x0_p = torch.rand((x0.shape[0], x0.shape[1]))
  else:
    raise NotImplementedError(remasking)
  x0 = torch.where(mask_index, x0, x)
  confidence = torch.where(mask_index, x0_p, -np.inf)
  transfer_index = torch.zeros_like(x0, dtype=torch.bool)
  num_transfer_tokens = mask_index.sum(dim=1, keepdim=True)
  for j in range(confidence.shape[0]):
    if int(num_transfer_tokens[j]) == 0:  # a finished row (see the module docstring)
      continue
    ns = list(range(1, num_transfer_tokens[j] + 1))
    es = [factor / (n + 1) for n in ns]
    threshs = [1 - e for e in es]
    # always transfer at least one token
    threshs[0] = -1
    sorted_conf = torch.sort(confidence[j][mask_index[j]], dim=-1, descending=True)[0]
    assert len(sorted_conf) == len(threshs)
    for top_i in range(len(threshs)):
      if margins is not None and top_i > 0:
        margins.compare(sorted_conf[top_i], threshs[top_i])
      if sorted_conf[top_i] < threshs[top_i]:
        break
    if top_i == 0 or top_i == len(threshs) - 1:
      top_i += 1
    _, select_index = torch.topk(confidence[j], k=top_i)
    transfer_index[j, select_index] = True
    if margins is not None:
      margins.cut(confidence[j], top_i)
      margins.argmax(logits_with_noise[j, select_index])
  return x0, transfer_index


# --- Dream generation_utils.py (_sample, sample_tokens) -----------------------------------


def sample_tokens(logits, temperature=0.0, top_p=None, top_k=None, margin_confidence=False,
                  neg_entropy=False):
  if temperature > 0:
    logits = logits / temperature
  if top_p is not None and top_p < 1:
    raise NotImplementedError("top_p")  # not used by the fixtures
  if top_k is not None:
    raise NotImplementedError("top_k")
  probs = torch.softmax(logits, dim=-1)
  if temperature > 0:
    x0 = torch.distributions.Categorical(probs=probs).sample()
    confidence = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
  else:
    confidence, x0 = probs.max(dim=-1)
  if margin_confidence:
    sorted_probs, _ = torch.sort(probs, dim=-1, descending=True)
    top1_probs = sorted_probs[:, 0]
    top2_probs = sorted_probs[:, 1]
    confidence = top1_probs - top2_probs
  if neg_entropy:
    epsilon = 1e-10
    log_probs = torch.log(probs + epsilon)
    confidence = torch.sum(probs * log_probs, dim=-1)
  return confidence, x0


@torch.no_grad()
def dream_sample(model, input_ids, attention_mask=None, *, max_new_tokens, steps, eps=1e-3,
                 alg="origin", alg_temp=None, temperature=0.0, top_p=None, top_k=None,
                 mask_token_id=MASK_ID, margins=None):
  max_length = input_ids.shape[1] + max_new_tokens
  x = F.pad(input_ids, (0, max_length - input_ids.shape[1]), value=mask_token_id)
  if attention_mask is not None and torch.any(attention_mask == 0.0):
    # we do not mask the [MASK] tokens so value = 1.0
    attention_mask = F.pad(attention_mask, (0, max_length - attention_mask.shape[1]), value=1.0)
    tok_idx = attention_mask.long().cumsum(-1) - 1
    tok_idx.masked_fill_(attention_mask == 0, 1)
    attention_mask = torch.logical_and(
        attention_mask.unsqueeze(1).unsqueeze(-2),
        attention_mask.unsqueeze(1).unsqueeze(-1),
    )
  else:
    tok_idx = None
    attention_mask = "full"
  timesteps = torch.linspace(1, eps, steps + 1)
  for i in range(steps):
    mask_index = (x == mask_token_id)
    logits = model(x, attention_mask, tok_idx).logits
    logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    mask_logits = logits[mask_index]
    t = timesteps[i]
    s = timesteps[i + 1]
    if alg == 'origin':
      p_transfer = 1 - s / t if i < steps - 1 else 1
      x0 = torch.zeros_like(x[mask_index], dtype=torch.long) + mask_token_id
      transfer_index_t_s = torch.rand(*x0.shape) < p_transfer
      _, x0[transfer_index_t_s] = sample_tokens(mask_logits[transfer_index_t_s],
                                                temperature=temperature, top_p=top_p,
                                                top_k=top_k)
      x[mask_index] = x0.clone()
      if margins is not None:
        margins.argmax(mask_logits[transfer_index_t_s])
    else:
      if alg == 'maskgit_plus':
        confidence, x0 = sample_tokens(mask_logits, temperature=temperature, top_p=top_p,
                                       top_k=top_k)
      elif alg == 'topk_margin':
        confidence, x0 = sample_tokens(mask_logits, temperature=temperature, top_p=top_p,
                                       top_k=top_k, margin_confidence=True)
      elif alg == 'entropy':
        confidence, x0 = sample_tokens(mask_logits, temperature, top_p=top_p, top_k=top_k,
                                       neg_entropy=True)
      else:
        raise RuntimeError(f"Unknown alg: {alg}")
      num_mask_token = mask_index.sum() / mask_index.shape[0]
      number_transfer_tokens = (int(num_mask_token * (1 - s / t)) if i < steps - 1
                                else int(num_mask_token))
      if margins is not None and i < steps - 1:
        margins.integer(num_mask_token * (1 - s / t))
      full_confidence = torch.full_like(x, -torch.inf, dtype=logits.dtype)
      full_confidence[mask_index] = confidence
      if number_transfer_tokens > 0:
        if alg_temp is None or alg_temp == 0:
          _, transfer_index = torch.topk(full_confidence, number_transfer_tokens)
        else:
          full_confidence = full_confidence / alg_temp
          full_confidence = F.softmax(full_confidence, dim=-1)
          transfer_index = torch.multinomial(full_confidence, num_samples=number_transfer_tokens)
        x_ = torch.zeros_like(x, dtype=torch.long) + mask_token_id
        x_[mask_index] = x0.clone()
        row_indices = torch.arange(x.size(0)).unsqueeze(1).expand_as(transfer_index)
        x[row_indices, transfer_index] = x_[row_indices, transfer_index]
        if margins is not None:
          for j in range(x.shape[0]):
            margins.cut(full_confidence[j], number_transfer_tokens)
            margins.argmax(logits[j, transfer_index[j]])
  return x


# --- cases --------------------------------------------------------------------------------

BATCH, PROMPT, GEN = 2, 6, 8
PAD_ROW0 = 2  # left padding of row 0 in the padded cases

# name: (family, mdjax fn, mdjax kwargs, reference loop name, left-padded)
CASES = {
    "llada_full": ("llada", "generate",
                   dict(steps=8, gen_length=8, block_length=8), "llada", False),
    "llada_semi_ar": ("llada", "generate",
                      dict(steps=8, gen_length=8, block_length=4), "llada", False),
    "llada_cfg": ("llada", "generate",
                  dict(steps=8, gen_length=8, block_length=8, cfg_scale=1.0), "llada", False),
    "llada_eos_eot": ("llada", "generate",
                      dict(steps=8, gen_length=8, block_length=8, logits_eos_inf=True,
                           confidence_eos_eot_inf=True), "llada", False),
    # At temperature 0 add_gumbel_noise returns the logits tensor itself, so LLaDA's
    # `logits_with_noise[:, :, eos] = logits[:, :, eot] = -inf` excludes both EOS and EoT from
    # the confidence (at temperature > 0 only EoT): this case has an EOS in its output.
    "llada_confidence_eos_eot": ("llada", "generate",
                                 dict(steps=8, gen_length=8, block_length=8,
                                      confidence_eos_eot_inf=True), "llada", False),
    "llada_left_padded": ("llada", "generate",
                          dict(steps=8, gen_length=8, block_length=4), "llada", True),
    "llada_threshold": ("llada", "generate",
                        dict(steps=8, gen_length=8, block_length=4, threshold=0.3),
                        "fast", False),
    "llada_factor": ("llada", "generate",
                     dict(steps=8, gen_length=8, block_length=4, factor=1.0), "fast", False),
    "llada_prefix_cache": ("llada", "generate",
                           dict(steps=8, gen_length=8, block_length=4, kv_cache="prefix"),
                           "prefix", False),
    "llada_dual_cache": ("llada", "generate",
                         dict(steps=8, gen_length=8, block_length=4, kv_cache="dual",
                              threshold=0.3), "dual", False),
    "dream_maskgit_plus": ("dream", "diffusion_generate",
                           dict(max_new_tokens=8, steps=4, alg="maskgit_plus"), "dream", False),
    "dream_topk_margin": ("dream", "diffusion_generate",
                          dict(max_new_tokens=8, steps=4, alg="topk_margin"), "dream", False),
    "dream_entropy": ("dream", "diffusion_generate",
                      dict(max_new_tokens=8, steps=4, alg="entropy"), "dream", False),
    # origin transfers each masked position with probability 1 - s/t drawn from torch's RNG,
    # except at the last step where it is 1: with steps=1 every position is transferred at
    # once (argmax at temperature 0), the only origin setting that does not depend on the RNG.
    "dream_origin_one_step": ("dream", "diffusion_generate",
                              dict(max_new_tokens=8, steps=1, alg="origin"), "dream", False),
    "dream_left_padded": ("dream", "diffusion_generate",
                          dict(max_new_tokens=8, steps=4, alg="maskgit_plus"), "dream", True),
}

# Options a case exists to test must change its outcome: the case's output must differ from
# the one with these kwargs replaced (a seed whose output does not is skipped).
DIFFERS_FROM = {
    "llada_semi_ar": dict(block_length=8),
    "llada_eos_eot": dict(logits_eos_inf=False, confidence_eos_eot_inf=False),
    "llada_confidence_eos_eot": dict(confidence_eos_eot_inf=False),
}
# ... and these must generate the id somewhere.
MUST_GENERATE = {"llada_confidence_eos_eot": EOS_ID}

REFERENCES = {
    "llada": "ML-GSAI/LLaDA generate.py generate (transformers Llama, bidirectional)",
    "fast": "NVlabs/Fast-dLLM llada/generate.py generate (transformers Llama, bidirectional)",
    "prefix": "NVlabs/Fast-dLLM llada/generate.py generate_with_prefix_cache (LladaTorch)",
    "dual": "NVlabs/Fast-dLLM llada/generate.py generate_with_dual_cache (LladaTorch)",
    "dream": "Dream generation_utils.py _sample (transformers Qwen2, bidirectional, shifted)",
}


def _full_kwargs(fn: str, kwargs: dict) -> dict:
  """The case's mdjax kwargs with temperature (and Dream's eps) spelled out."""
  out = dict(kwargs, temperature=0.0)
  if fn == "diffusion_generate":
    out.setdefault("eps", 1e-3)
  return out


def run_reference(loop: str, models: dict, kwargs: dict, prompt, attention_mask, margins):
  """The reference loop's output ids for one case."""
  kw = {k: v for k, v in kwargs.items() if k not in ("kv_cache",)}
  if loop == "llada":
    return llada_generate(models["llada_hf"], prompt, attention_mask, margins=margins, **kw)
  if loop in ("fast", "prefix", "dual"):
    assert attention_mask is None
    fn = {"fast": fast_generate, "prefix": generate_with_prefix_cache,
          "dual": generate_with_dual_cache}[loop]
    model = models["llada_hf"] if loop == "fast" else models["llada_torch"]
    return fn(model, prompt, margins=margins, **kw)[0]
  if loop == "dream":
    return dream_sample(models["dream_hf"], prompt, attention_mask, margins=margins, **kw)
  raise ValueError(loop)


def make_case(name: str, models: dict, base_seed: int, tries: int = 200) -> dict:
  family, fn, kwargs, loop, padded = CASES[name]
  kwargs = _full_kwargs(fn, kwargs)
  for seed in range(base_seed, base_seed + tries):
    rng = np.random.default_rng(seed)
    prompt = torch.from_numpy(rng.integers(0, len(CHARS), (BATCH, PROMPT)))
    attention_mask = None
    if padded:
      attention_mask = torch.ones(BATCH, PROMPT, dtype=torch.long)
      attention_mask[0, :PAD_ROW0] = 0
      prompt[0, :PAD_ROW0] = EOS_ID  # the tokenizers' pad token
    margins = Margins()
    out = run_reference(loop, models, kwargs, prompt, attention_mask, margins)
    if margins.min <= MARGIN:
      continue
    if name in MUST_GENERATE and MUST_GENERATE[name] not in out[:, PROMPT:]:
      continue
    if name in DIFFERS_FROM:
      plain = run_reference(loop, models, {**kwargs, **DIFFERS_FROM[name]}, prompt,
                            attention_mask, None)
      if torch.equal(plain, out):
        continue
    if padded:  # each row alone gives the same tokens
      alone = run_reference(loop, models, kwargs, prompt[:1, PAD_ROW0:], None, margins)
      if margins.min <= MARGIN or not torch.equal(alone[0, PROMPT - PAD_ROW0:], out[0, PROMPT:]):
        continue
    return {"name": name, "family": family, "fn": fn, "kwargs": kwargs,
            "reference": REFERENCES[loop], "seed": seed, "min_margin": float(f"{margins.min:.3g}"),
            "prompt_BxP": prompt.tolist(),
            "attention_mask_BxP": None if attention_mask is None else attention_mask.tolist(),
            "output_BxT": out.tolist()}
  raise RuntimeError(f"{name}: no seed in [{base_seed}, {base_seed + tries}) clears margin "
                     f"{MARGIN}")


# --- reference logits ---------------------------------------------------------------------

LOGITS_LEN, LOGITS_PAD = 16, 3


def logits_batch(seed: int):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, len(CHARS), (2, LOGITS_LEN))
  tokens[rng.random((2, LOGITS_LEN)) < 0.4] = MASK_ID
  valid = np.ones((2, LOGITS_LEN), bool)
  valid[0, :LOGITS_PAD] = False
  tokens[~valid] = EOS_ID
  return torch.from_numpy(tokens), torch.from_numpy(valid)


def reference_logits(family: str, models: dict, tokens, valid) -> np.ndarray:
  """B x L x V float32 logits (Dream shifted), NaN where undefined."""
  if family == "llada":
    logits = models["llada_hf"](tokens, attention_mask=valid.long()).logits
    defined = valid
  else:
    attn = torch.logical_and(valid[:, None, None, :], valid[:, None, :, None])
    tok_idx = valid.long().cumsum(-1) - 1
    tok_idx.masked_fill_(~valid, 1)
    logits = models["dream_hf"](tokens, attn, tok_idx).logits
    logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    before = torch.cat([valid[:, :1], valid[:, :-1]], dim=1)
    defined = valid & before
  out = logits.numpy().astype(np.float32)
  out[~defined.numpy()] = np.nan
  return out


def save_npz(path: pathlib.Path, arrays: dict):
  """np.savez_compressed with fixed member timestamps, so a rerun writes the same bytes."""
  with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
    for name, array in arrays.items():
      info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
      info.compress_type = zipfile.ZIP_DEFLATED
      with zf.open(info, "w") as f:
        np.lib.format.write_array(f, np.asanyarray(array), allow_pickle=False)


# --- cross-checks ---------------------------------------------------------------------------


def check_llada_torch(models: dict, tokens):
  """LladaTorch's full pass is the transformers forward (to float rounding)."""
  a = models["llada_torch"](tokens).logits
  b = models["llada_hf"](tokens).logits
  fin = torch.isfinite(b)
  assert torch.equal(fin, torch.isfinite(a))
  diff = float((a[fin] - b[fin]).abs().max())
  assert diff < 1e-4, diff
  return diff


def _read_file(source: pathlib.Path, rel: str) -> str:
  if (source / rel).exists():
    return (source / rel).read_text()
  return subprocess.run(["git", f"--git-dir={source}", "show", f"HEAD:{rel}"], check=True,
                        capture_output=True, text=True).stdout


@contextlib.contextmanager
def fast_dllm_modules(source: pathlib.Path):
  """Fast-dLLM's llada/model and dream/model as temporary packages."""
  with tempfile.TemporaryDirectory() as tmp:
    for pkg, files in (("llada", ("configuration_llada", "modeling_llada")),
                       ("dream", ("configuration_dream", "modeling_dream",
                                  "generation_utils"))):
      folder = pathlib.Path(tmp) / f"_fast_dllm_{pkg}"
      folder.mkdir()
      (folder / "__init__.py").write_text("")
      for f in files:
        (folder / f"{f}.py").write_text(_read_file(source, f"{pkg}/model/{f}.py"))
    if importlib.util.find_spec("einops") is None:
      sys.modules["einops"] = types.SimpleNamespace(rearrange=None)
    sys.path.insert(0, tmp)
    try:
      yield (importlib.import_module("_fast_dllm_llada.modeling_llada"),
             importlib.import_module("_fast_dllm_llada.configuration_llada"),
             importlib.import_module("_fast_dllm_dream.modeling_dream"),
             importlib.import_module("_fast_dllm_dream.configuration_dream"))
    finally:
      sys.path.remove(tmp)


def _default_rope(config, device=None, seq_len=None, **kwargs):
  """transformers 4.x's unscaled RoPE initialisation, which Dream's modeling file looks up."""
  del seq_len, kwargs
  theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
  dim = config.hidden_size // config.num_attention_heads
  exponent = torch.arange(0, dim, 2, dtype=torch.int64).float().to(device) / dim
  return 1.0 / (theta ** exponent), 1.0


def cross_check_fast_dllm(source: pathlib.Path, out: pathlib.Path, models: dict, cases: list):
  """The published modeling files against the reference forwards (see the docstring)."""
  report = {}
  with fast_dllm_modules(source) as (m_llada, c_llada, m_dream, c_dream):
    raw = json.loads((out / "llada" / "config.json").read_text())
    llada = m_llada.LLaDAModelLM(c_llada.LLaDAConfig(**raw)).eval()
    state = safetensors.torch.load_file(str(out / "llada" / "model.safetensors"))
    llada.load_state_dict(state, strict=True)

    class Published:
      @torch.no_grad()
      def __call__(self, x, **kw):
        kw.setdefault("use_cache", False)  # transformers 5 drops the config's use_cache
        o = llada(x, **kw)
        o.logits[..., MASK_ID] = -torch.inf
        return o

    published = Published()
    tokens, _ = logits_batch(11)
    tokens = tokens.clone()
    full = published(tokens).logits
    ref = models["llada_hf"](tokens).logits
    fin = torch.isfinite(ref)
    report["llada full pass vs transformers"] = float((full[fin] - ref[fin]).abs().max())
    start, end = 8, 12
    pub = published(tokens, use_cache=True).past_key_values
    mine = models["llada_torch"](tokens, use_cache=True).past_key_values
    prefix = lambda kv: [tuple(t[:, :, :start] for t in layer) for layer in kv]
    a = published(tokens[:, start:], past_key_values=prefix(pub), use_cache=True).logits
    b = models["llada_torch"](tokens[:, start:], past_key_values=prefix(mine),
                              use_cache=True).logits
    fin = torch.isfinite(b)
    report["llada prefix pass vs LladaTorch"] = float((a[fin] - b[fin]).abs().max())
    rp = torch.zeros_like(tokens[:1], dtype=torch.bool)
    rp[:, start:end] = True
    one = lambda kv: [tuple(t[:1].clone() for t in layer) for layer in kv]
    a = published(tokens[:1, start:end], past_key_values=one(pub), use_cache=True,
                  replace_position=rp).logits
    b = models["llada_torch"](tokens[:1, start:end], past_key_values=one(mine), use_cache=True,
                              replace_position=rp).logits
    fin = torch.isfinite(b)
    report["llada dual pass vs LladaTorch"] = float((a[fin] - b[fin]).abs().max())
    for case in cases:
      loop = {"prefix_cache": generate_with_prefix_cache,
              "dual_cache": generate_with_dual_cache}.get(case["name"].removeprefix("llada_"))
      if loop is None:
        continue
      kw = {k: v for k, v in case["kwargs"].items() if k != "kv_cache"}
      for r, (row, expect) in enumerate(zip(case["prompt_BxP"], case["output_BxT"])):
        got = loop(published, torch.tensor([row]), **kw)[0]
        report[f"{case['name']} row {r} on LLaDAModelLM"] = _same(got[0].tolist(), expect)

    if "default" not in m_dream.ROPE_INIT_FUNCTIONS:  # transformers 5 computes it inline
      m_dream.ROPE_INIT_FUNCTIONS = dict(m_dream.ROPE_INIT_FUNCTIONS, default=_default_rope)
    raw = json.loads((out / "dream" / "config.json").read_text())
    config = c_dream.DreamConfig(**raw)
    config._attn_implementation = "sdpa"
    dream = m_dream.DreamModel(config).eval()
    dream.load_state_dict(safetensors.torch.load_file(str(out / "dream" / "model.safetensors")),
                          strict=True)
    tokens, valid = logits_batch(12)
    with torch.no_grad():
      a = dream(tokens, "full", None).logits
    a[..., MASK_ID] = -torch.inf
    b = models["dream_hf"](tokens).logits
    fin = torch.isfinite(b)
    report["dream unpadded vs transformers"] = float((a[fin] - b[fin]).abs().max())
    attn = torch.logical_and(valid[:, None, None, :], valid[:, None, :, None])
    tok_idx = valid.long().cumsum(-1) - 1
    tok_idx.masked_fill_(~valid, 1)
    with torch.no_grad():
      a = dream(tokens, attn, tok_idx).logits
    a[..., MASK_ID] = -torch.inf
    b = models["dream_hf"](tokens, attn, tok_idx).logits
    keep = valid[..., None] & torch.isfinite(b)
    report["dream padded (real positions) vs transformers"] = float((a[keep] - b[keep]).abs().max())

    def no_mask(step, x, logits):  # the fixtures' contract: [MASK] is never predicted
      logits[..., MASK_ID] = -torch.inf
      return logits

    for case in cases:
      if case["family"] != "dream":
        continue
      mask, kw = case["attention_mask_BxP"], case["kwargs"]
      prompt = torch.tensor(case["prompt_BxP"])
      # diffusion_generate's config plumbing fails under transformers 5
      # (DreamGenerationConfig.validate's signature), so its _sample runs with the settings
      # diffusion_generate would pass.
      settings = types.SimpleNamespace(
          output_history=False, return_dict_in_generate=False, mask_token_id=MASK_ID,
          max_length=prompt.shape[1] + kw["max_new_tokens"], steps=kw["steps"], eps=kw["eps"],
          alg=kw["alg"], alg_temp=None, temperature=kw["temperature"], top_p=None, top_k=None)
      with torch.no_grad(), contextlib.redirect_stdout(None):  # it prints timings
        got = dream._sample(prompt, None if mask is None else torch.tensor(mask), settings,
                            lambda step, x, logits: x, no_mask)
      report[f"{case['name']} on DreamModel._sample"] = _same(got.tolist(), case["output_BxT"])
  return report


def _same(got, expect) -> str:
  return "same tokens" if got == expect else f"DIFFERENT: {got} vs {expect}"


def cross_check_llada_generate(source: pathlib.Path, models: dict, cases: list) -> dict:
  """ML-GSAI/LLaDA generate.py's own `generate` on the transformers forward, for the cases it
  can run as published (no cfg: its NaN [MASK] column and unbound attention_mask_; no
  eos/eot flags: their ids are hard-coded for the 126k vocabulary)."""
  with tempfile.TemporaryDirectory() as tmp:
    path = pathlib.Path(tmp) / "_llada_generate.py"
    path.write_text(_read_file(source, "generate.py"))
    spec = importlib.util.spec_from_file_location("_llada_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  report = {}
  for case in cases:
    kw = case["kwargs"]
    if (case["reference"] != REFERENCES["llada"] or kw.get("cfg_scale")
        or kw.get("logits_eos_inf") or kw.get("confidence_eos_eot_inf")):
      continue
    mask = case["attention_mask_BxP"]
    got = module.generate(models["llada_hf"], torch.tensor(case["prompt_BxP"]),
                          None if mask is None else torch.tensor(mask), mask_id=MASK_ID, **kw)
    report[f"{case['name']} on LLaDA generate.py"] = _same(got.tolist(), case["output_BxT"])
  return report


# --- main -----------------------------------------------------------------------------------


def fresh_output(out: pathlib.Path) -> pathlib.Path:
  """Seeds torch, runs it on one thread (one reduction order) and empties `out`."""
  torch.manual_seed(0)
  torch.set_num_threads(1)
  if out.exists():
    shutil.rmtree(out)
  out.mkdir(parents=True)
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
  parser.add_argument("--fast-dllm", type=pathlib.Path, default=None,
                      help="a checkout or git directory of NVlabs/Fast-dLLM: also cross-check "
                           "its published modeling files")
  parser.add_argument("--llada", type=pathlib.Path, default=None,
                      help="a checkout or git directory of ML-GSAI/LLaDA: also run its "
                           "generate.py on the cases it can run")
  args = parser.parse_args(argv)
  out = fresh_output(args.out)

  weights = {"llada": llada_weights(0), "dream": dream_weights(1)}
  write_checkpoint(out / "llada", LLADA_CONFIG, weights["llada"], LLADA_TEMPLATE)
  write_checkpoint(out / "dream", DREAM_CONFIG, weights["dream"], DREAM_TEMPLATE)
  for family in ("llada", "dream"):
    check_tokenizer(out / family)
  models = {"llada_hf": LladaHF(weights["llada"]), "llada_torch": LladaTorch(weights["llada"]),
            "dream_hf": DreamHF(weights["dream"])}

  arrays = {}
  for family, seed in (("llada", 11), ("dream", 12)):
    tokens, valid = logits_batch(seed)
    arrays[f"{family}_tokens"] = tokens.numpy().astype(np.int32)
    arrays[f"{family}_valid"] = valid.numpy()
    arrays[f"{family}_logits"] = reference_logits(family, models, tokens, valid)
  save_npz(out / "reference_logits.npz", arrays)
  print(f"LladaTorch full pass vs transformers: max |diff| "
        f"{check_llada_torch(models, logits_batch(11)[0]):.2g}")

  cases = []
  for index, name in enumerate(CASES):
    case = make_case(name, models, base_seed=100 * (index + 1))
    cases.append(case)
    print(f"{name}: seed {case['seed']}, min margin {case['min_margin']:.3g}, "
          f"output {case['output_BxT']}")
  text = json.dumps(cases, indent=1)
  # one line per row of ids
  text = re.sub(r"\[\s*((?:-?\d+,\s*)*-?\d+)\s*\]",
                lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)
  (out / "generations.json").write_text(text + "\n")

  report = {}
  if args.llada is not None:
    report.update(cross_check_llada_generate(args.llada, models, cases))
  if args.fast_dllm is not None:
    report.update(cross_check_fast_dllm(args.fast_dllm, out, models, cases))
  for what, value in report.items():
    print(f"cross-check: {what}: {value if isinstance(value, str) else f'{value:.2g}'}")
  if any(isinstance(v, str) and v != "same tokens" for v in report.values()):
    raise SystemExit("a cross-check disagrees")


if __name__ == "__main__":
  main()
