"""Regenerates the SDAR parity fixtures in tests/fixtures/sdar/ with SDAR's published code.

  pip install -e '.[reference]'
  python -m tests.reference.sdar --sdar PATH [--out tests/fixtures/sdar]

PATH is a checkout or a git directory of github.com/JetAstra/SDAR (read at HEAD; the fixtures
were written from commit c2041a8333333d685f6e15122c84f60f51f85ebd). Nothing is downloaded and
nothing of the published code is committed: its files are copied into a temporary package at
run time. Every file is rebuilt from fixed seeds. What it writes:

  config.json, generation_config.json, special_tokens_map.json, tokenizer_config.json,
  chat_template.jinja   SDAR-4B-Chat's keys and files (training/model/SDAR-4B-Chat/) at a tiny
                   size: 3 layers, hidden 64, 4 query heads and 2 KV heads of head_dim 32 (so
                   heads x head_dim = 128 != hidden, as SDAR-4B's 32 x 128 != 2560), block_size
                   4; the published chat template; a char-level tokenizer.json with SDAR's
                   special tokens at ids of a 320-id vocabulary.
  model-0000{1,2}-of-00002.safetensors, model.safetensors.index.json   random float32
                   weights under the published tensor names (q_norm / k_norm included), in two
                   shards as the published folders are.
  reference.npz    `tokens_BxL` (2 x 16, mask ids inside, row 1 left-padded by 3), `valid_BxL`
                   and `logits_BxLxV`: SDARForCausalLM's float32 logits under the block-causal
                   attention generation uses (blocks of 4 from each row's first real token,
                   positions from it, padded keys masked; NaN at padded queries, which no
                   implementation defines). The cached passes of `block_diffusion_generate`:
                   `prefix_1xP` (P = 8) prefilled with store_kv=True, then `block_1xW` (W = 4,
                   masks inside) with store_kv=False -> `block_logits_1xWxV`; then
                   `block_final_1xW` stored (store_kv=True) and `next_1xW` -> `next_logits_1xWxV`.
                   For the step laws at temperature > 0 (LAW_* below): `law_prefix_1xP`, the
                   cached pass's `law_logits_1xWxV` over a block of 4 masks after it, the
                   distributions generate.py's `sample_with_temperature_topk_topp` draws from
                   (`law_probs_{static,dynamic,filtered}_1xWxV`: its own top_k_logits,
                   top_p_logits and softmax) and the dynamic case's `law_threshold`.
  generations.json `block_diffusion_generate`'s outputs, one case per remasking strategy and
                   knob (CASES below), each with two prompts of different lengths run one at a
                   time (its loop takes batch 1) with config.json's EOS as the stop id (a
                   row of dynamic_b4 stops: `until_stop` is each row before its first EOS),
                   and the error `entropy_bounded` raises.

What was replaced, and why (the published files import flash-attn, Triton and liger-kernel,
which need CUDA, and were written for transformers 4.52):
  * flash_attn.ops.triton.layer_norm.rms_norm_fn, which every SDARRMSNorm (q/k norms included)
    calls: the fallback the file keeps commented out under it (HF's Qwen3RMSNorm: float32,
    x * rsqrt(mean(x^2) + eps), cast back, times the weight).
  * flash_attn.flash_attn_func, which the attention calls when its mask is all true (the
    denoising passes of a block against the cache): torch's scaled_dot_product_attention, not
    causal, the same softmax_scale, KV heads repeated for the query heads.
  * fused_linear_diffusion_cross_entropy.py (imports Triton; training's loss only): a stub.
  * transformers 5 has no `transformers.utils.LossKwargs` (a TypedDict used in a type hint
    only): an empty TypedDict; nor a "default" entry in ROPE_INIT_FUNCTIONS: transformers 4's
    unscaled initialisation, 1 / theta^(2i / head_dim), attention scaling 1.
  * transformers 5's PretrainedConfig no longer defaults `pad_token_id` (None in 4.52), which
    SDARModel reads (the published config.json has none): set to None.
  * transformers 5's DynamicCache cannot be indexed (cache[layer] -> (keys, values) in 4.52),
    which the attention's store_kv=False pass does: generate.py's DynamicCache (and the
    writer's own cached passes') is a subclass that adds the indexing back.
  * liger-kernel is absent, so SDARMLP takes its own unfused branch (its code's fallback).
The mask id's logit is set to -inf on every forward's output: trained checkpoints never predict
the mask, random ones would, and mdjax's contract excludes it (as tests/reference/pretrained.py).

generate.py's `block_diffusion_generate` runs as published except for one patched line in the
copy: `torch.multinomial(probs, num_samples=1)` becomes `torch.argmax(probs, -1, keepdim=True)`
(a greedy draw: with temperature 0 the published loop divides the logits by 0). With
temperature 1, top_k 0 and top_p 1 (the cases' settings) `probs` is the plain softmax, so
each proposal is the argmax and its confidence x0_p the largest probability.

Every decision is checked to clear a 1e-4 relative margin: the argmax gap of every masked
position at every pass, every gap between the sorted confidences of the masked positions (any
top-k cut), each confidence against the threshold. A prompt seed that fails, or whose run
rewrites an already written position (below), is replaced by the next seed.

What the published loop does that mdjax does not (documented in docs/pretrained.md):
  * With denoising_steps < block_length a step's top-k can ask for more positions than are
    still masked (the prompt's last partial block, or low_confidence_dynamic after an early
    threshold commit); its top-k then picks positions of confidence -inf, already written,
    and writes them again with that step's proposal (the prompt tokens of that block
    included). The cases below never hit it (checked at every pass).
  * `entropy_bounded` fails as published: its branch never sets `transfer_index`, so the first
    denoising step raises UnboundLocalError (checked below and printed). Its entropy is also
    not per position: `-(x0_p * log x0_p).sum(-1)` sums the chosen tokens' p log p over the
    block into one number that every masked position then shares.

Self-check figures of the last run (printed by it; float32, 1 thread, transformers 5.25,
torch 2.13 CPU):
  cached block pass vs the full block-causal forward (SDPA with the mask vs the stand-in flash
  call against the cache): max |diff| 3.1e-05 (block 1), 2.4e-05 (block 2), of logits up to
  16 in size;
  smallest decision margin per case (generations.json's min_margin): dynamic_b4 6.6e-04,
  sequential_b4_steps2 2.3e-03, static_b8_steps4 2.7e-04, dynamic_b8_steps4 1.9e-04;
  entropy_bounded as published: UnboundLocalError: cannot access local variable
  'transfer_index' where it is not associated with a value.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import importlib.util
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import types
import typing

import numpy as np

try:
  import safetensors.torch
  import torch
  import torch.nn.functional as F
  import transformers
except ImportError as e:  # the optional extra
  raise SystemExit(f"{e}: install the reference extra: pip install -e '.[reference]'")

from tests.reference.pretrained import (CHARS, UNK, Margins, _linear, _norm_weight, _normal,
                                        save_npz)

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "sdar"
MODEL_DIR = "training/model/SDAR-4B-Chat"

VOCAB = 320
EOS_ID = 290  # <|endoftext|>: SDAR's bos / eos / pad
IM_START_ID, IM_END_ID = 294, 295
MASK_ID = 300  # <|MASK|>
MARGIN = 1e-4
SEEDS = 400  # prompt seeds a case may try
SPECIALS = {EOS_ID: "<|endoftext|>", IM_START_ID: "<|im_start|>", IM_END_ID: "<|im_end|>",
            296: "<think>", 297: "</think>", MASK_ID: "<|MASK|>"}

# SDAR-4B-Chat's config.json, every key, at a tiny size.
CONFIG = {
    "architectures": ["SDARForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig",
                 "AutoModel": "modeling_sdar.SDARModel",
                 "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
    "attention_bias": False, "attention_dropout": 0.0, "attn_implementation": "flex_attention",
    "bos_token_id": EOS_ID, "debug": False, "eos_token_id": EOS_ID, "block_size": 4,
    "mask_token_id": MASK_ID, "ep_size": 1, "fuse_cross_entropy": True, "head_dim": 32,
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 128, "max_position_embeddings": 4096, "max_window_layers": 3,
    "micro_forward": False, "model_type": "sdar", "num_attention_heads": 4,
    "num_hidden_layers": 3, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "skip_checkpoint": False,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "float32",
    "transformers_version": "4.52.4", "use_cache": False, "use_deepep": False,
    "use_sliding_window": False, "vocab_size": VOCAB,
}
GENERATION_CONFIG = {"bos_token_id": EOS_ID, "do_sample": True,
                     "eos_token_id": [IM_END_ID, EOS_ID], "pad_token_id": EOS_ID,
                     "temperature": 0.6, "top_k": 20, "top_p": 0.95}

# Spread logits (a std-0.02 random model's are near uniform and flip on rounding), sharp
# attention through large q/k norm weights, a small mask embedding so that masked positions
# predict from their context.
EMBED_STD, HEAD_STD, QK_NORM_SCALE, VO_SCALE, MASK_EMBED_SCALE = 1.0, 0.5, 3.0, 1.5, 0.2
EOS_HEAD_SCALE = 1.6  # a larger EOS head row: EOS is written, and the stop rule decides


# --- the published code, imported by path ---------------------------------------------------


def read_published(source: pathlib.Path, rel: str) -> str:
  if (source / rel).exists():
    return (source / rel).read_text()
  return subprocess.run(["git", f"--git-dir={source}", "show", f"HEAD:{rel}"], check=True,
                        capture_output=True, text=True).stdout


def published_commit(source: pathlib.Path) -> str:
  for args in (["git", f"--git-dir={source}", "rev-parse", "HEAD"],
               ["git", "-C", str(source), "rev-parse", "HEAD"]):
    done = subprocess.run(args, check=False, capture_output=True, text=True)
    if done.returncode == 0:
      return done.stdout.strip()
  return "unknown"


def _rms_norm_fn(x, weight, bias=None, eps=1e-6, **kwargs):
  """The commented-out fallback under SDARRMSNorm.forward's flash call (HF's Qwen3RMSNorm)."""
  del bias, kwargs
  dtype = x.dtype
  h = x.to(torch.float32)
  h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
  return weight * h.to(dtype)


def _flash_attn_func(q, k, v, causal=False, softmax_scale=None, **kwargs):
  """flash_attn_func's layout ([B, L, H, D]) on torch's SDPA; no mask, grouped KV heads."""
  assert not causal and not kwargs
  q, k, v = (t.transpose(1, 2) for t in (q, k, v))
  groups = q.shape[1] // k.shape[1]
  k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
  out = F.scaled_dot_product_attention(q, k, v, is_causal=False, scale=softmax_scale)
  return out.transpose(1, 2)


class IndexedCache(transformers.cache_utils.DynamicCache):
  """transformers 4's DynamicCache indexing, cache[layer] -> (keys, values), which the
  attention's denoising pass reads (transformers 5 dropped it)."""

  def __getitem__(self, layer: int):
    return self.layers[layer].keys, self.layers[layer].values


def _default_rope(config, device=None, seq_len=None, **kwargs):
  """transformers 4's unscaled RoPE initialisation over head_dim."""
  del seq_len, kwargs
  dim = config.head_dim
  exponent = torch.arange(0, dim, 2, dtype=torch.int64).float().to(device) / dim
  return 1.0 / (float(config.rope_theta) ** exponent), 1.0


def _with_indexed_cache(name: str):
  module = importlib.import_module(name)
  module.DynamicCache = IndexedCache
  return module


@contextlib.contextmanager
def published_modules(source: pathlib.Path):
  """(modeling_sdar, configuration_sdar, generate) of the published repository, with the
  stand-ins of the module docstring."""
  stubs = {"flash_attn": types.ModuleType("flash_attn"),
           "flash_attn.bert_padding": types.ModuleType("flash_attn.bert_padding"),
           "flash_attn.ops": types.ModuleType("flash_attn.ops"),
           "flash_attn.ops.triton": types.ModuleType("flash_attn.ops.triton"),
           "flash_attn.ops.triton.layer_norm": types.ModuleType("flash_attn.ops.triton.layer_norm")}
  stubs["flash_attn"].flash_attn_func = _flash_attn_func
  stubs["flash_attn"].flash_attn_varlen_func = None  # training's packed path only
  for name in ("index_first_axis", "pad_input", "unpad_input"):
    setattr(stubs["flash_attn.bert_padding"], name, None)
  stubs["flash_attn.ops.triton.layer_norm"].rms_norm_fn = _rms_norm_fn
  # transformers probes for flash_attn with find_spec while its modules import: import them
  # before the stand-ins exist.
  for name in ("activations", "cache_utils", "generation", "integrations",
               "integrations.flex_attention", "modeling_attn_mask_utils",
               "modeling_flash_attention_utils", "modeling_layers", "modeling_outputs",
               "modeling_rope_utils", "modeling_utils", "processing_utils"):
    importlib.import_module(f"transformers.{name}")
  saved = {name: sys.modules.get(name) for name in stubs}
  sys.modules.update(stubs)
  if not hasattr(transformers.utils, "LossKwargs"):
    transformers.utils.LossKwargs = typing.TypedDict("LossKwargs", {}, total=False)
  with tempfile.TemporaryDirectory() as tmp:
    package = pathlib.Path(tmp) / "_sdar_published"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("configuration_sdar", "modeling_sdar"):
      (package / f"{name}.py").write_text(read_published(source, f"{MODEL_DIR}/{name}.py"))
    (package / "fused_linear_diffusion_cross_entropy.py").write_text(
        "class FusedLinearDiffusionCrossEntropyLoss:  # stand-in: training's Triton loss\n"
        "  pass\n")
    generate_py = read_published(source, "generate.py")
    draw = "token = torch.multinomial(probs, num_samples=1)"
    assert generate_py.count(draw) == 1, "generate.py changed: update the greedy patch"
    (package / "generate_greedy.py").write_text(
        generate_py.replace(draw, "token = torch.argmax(probs, dim=-1, keepdim=True)"))
    (package / "generate_published.py").write_text(generate_py)
    sys.path.insert(0, tmp)
    try:
      modeling = importlib.import_module("_sdar_published.modeling_sdar")
      if "default" not in modeling.ROPE_INIT_FUNCTIONS:
        modeling.ROPE_INIT_FUNCTIONS = dict(modeling.ROPE_INIT_FUNCTIONS, default=_default_rope)
      yield types.SimpleNamespace(
          modeling=modeling,
          configuration=importlib.import_module("_sdar_published.configuration_sdar"),
          greedy=_with_indexed_cache("_sdar_published.generate_greedy"),
          published=_with_indexed_cache("_sdar_published.generate_published"),
          chat_template=read_published(source, f"{MODEL_DIR}/chat_template.jinja"))
    finally:
      sys.path.remove(tmp)
      for name in [n for n in sys.modules if n.startswith("_sdar_published")]:
        del sys.modules[name]
      for name, module in saved.items():
        if module is None:
          sys.modules.pop(name, None)
        else:
          sys.modules[name] = module


# --- the checkpoint -----------------------------------------------------------------------


def vocab() -> dict[str, int]:
  out = {c: i for i, c in enumerate(CHARS)}
  out[UNK] = len(CHARS)
  for i in range(len(CHARS) + 1, VOCAB):
    out[SPECIALS.get(i, f"<|reserved_{i}|>")] = i
  return out


def build_tokenizer():
  """A char-level WordLevel tokenizer (ids < 96 printable ASCII and newline), SDAR's special
  tokens at their config ids, reserved names for the rest of the 320 ids."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
  tok = Tokenizer(models.WordLevel(vocab(), unk_token=UNK))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                          for _, s in sorted(SPECIALS.items())])
  return tok


def tokenizer_config(template: str) -> dict:
  """SDAR-4B-Chat's tokenizer_config.json keys (its added_tokens_decoder aside)."""
  return {"add_bos_token": False, "add_prefix_space": False,
          "additional_special_tokens": [SPECIALS[i] for i in (IM_START_ID, IM_END_ID, MASK_ID)],
          "bos_token": None, "chat_template": template, "clean_up_tokenization_spaces": False,
          "eos_token": SPECIALS[EOS_ID], "errors": "replace", "model_max_length": 4096,
          "pad_token": SPECIALS[EOS_ID], "split_special_tokens": False,
          "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": None}


def weights(seed: int) -> dict[str, np.ndarray]:
  """SDAR's tensors by their published names (torch Linear [out, in])."""
  c = CONFIG
  d, f, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
  q_width, kv_width = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
  rng = np.random.default_rng(seed)
  embed = _normal(rng, (VOCAB, d), EMBED_STD)
  embed[MASK_ID] *= MASK_EMBED_SCALE
  out = {"model.embed_tokens.weight": embed}
  for i in range(c["num_hidden_layers"]):
    b = f"model.layers.{i}"
    out[f"{b}.input_layernorm.weight"] = _norm_weight(rng, d)
    out[f"{b}.self_attn.q_proj.weight"] = _linear(rng, q_width, d)
    out[f"{b}.self_attn.k_proj.weight"] = _linear(rng, kv_width, d)
    out[f"{b}.self_attn.v_proj.weight"] = _linear(rng, kv_width, d, VO_SCALE)
    out[f"{b}.self_attn.o_proj.weight"] = _linear(rng, d, q_width, VO_SCALE)
    out[f"{b}.self_attn.q_norm.weight"] = QK_NORM_SCALE * _norm_weight(rng, hd)
    out[f"{b}.self_attn.k_norm.weight"] = QK_NORM_SCALE * _norm_weight(rng, hd)
    out[f"{b}.post_attention_layernorm.weight"] = _norm_weight(rng, d)
    out[f"{b}.mlp.gate_proj.weight"] = _linear(rng, f, d)
    out[f"{b}.mlp.up_proj.weight"] = _linear(rng, f, d)
    out[f"{b}.mlp.down_proj.weight"] = _linear(rng, d, f)
  out["model.norm.weight"] = _norm_weight(rng, d)
  out["lm_head.weight"] = _normal(rng, (VOCAB, d), HEAD_STD)
  out["lm_head.weight"][EOS_ID] *= EOS_HEAD_SCALE
  return out


def write_checkpoint(folder: pathlib.Path, tensors: dict, template: str):
  """The published layout: two shards and their index, the config and tokenizer files."""
  folder.mkdir(parents=True, exist_ok=True)
  dump = lambda obj: json.dumps(obj, indent=2, sort_keys=True) + "\n"
  (folder / "config.json").write_text(dump(CONFIG))
  (folder / "generation_config.json").write_text(dump(GENERATION_CONFIG))
  first_shard = lambda n: n == "model.embed_tokens.weight" or n.startswith(
      ("model.layers.0.", "model.layers.1."))
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": [n for n in names if first_shard(n)],
            "model-00002-of-00002.safetensors": [n for n in names if not first_shard(n)]}
  weight_map = {}
  for file, members in shards.items():
    safetensors.torch.save_file({n: torch.from_numpy(tensors[n]).contiguous() for n in members},
                                str(folder / file), metadata={"format": "pt"})
    weight_map.update({n: file for n in members})
  total = sum(v.nbytes for v in tensors.values())
  (folder / "model.safetensors.index.json").write_text(
      dump({"metadata": {"total_size": total}, "weight_map": weight_map}))
  build_tokenizer().save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(dump(tokenizer_config(template)))
  (folder / "chat_template.jinja").write_text(template)
  special = lambda s: {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False}
  (folder / "special_tokens_map.json").write_text(dump(
      {"additional_special_tokens": [SPECIALS[i] for i in (IM_START_ID, IM_END_ID, MASK_ID)],
       "eos_token": special(SPECIALS[EOS_ID]), "pad_token": special(SPECIALS[EOS_ID])}))


def check_tokenizer(folder: pathlib.Path):
  """The files load as a transformers fast tokenizer and the chat template renders."""
  tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                             eos_token=SPECIALS[EOS_ID],
                                             pad_token=SPECIALS[EOS_ID])
  tok.chat_template = (folder / "chat_template.jinja").read_text()
  text = tok.apply_chat_template([{"role": "user", "content": "Hi!"}],
                                 add_generation_prompt=True, tokenize=False)
  ids = tok(text, add_special_tokens=False)["input_ids"]
  assert tok.decode(ids) == text, (text, tok.decode(ids))
  assert text == "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n", text
  assert tok.convert_tokens_to_ids(SPECIALS[MASK_ID]) == MASK_ID


def load_model(code, folder: pathlib.Path):
  """SDARForCausalLM from the folder: its config.json through SDARConfig, every tensor
  loaded strictly."""
  raw = json.loads((folder / "config.json").read_text())
  config = code.configuration.SDARConfig(**raw)
  if not hasattr(config, "pad_token_id"):  # transformers 4's PretrainedConfig default
    config.pad_token_id = None
  model = code.modeling.SDARForCausalLM(config).eval()
  state = {}
  for file in sorted(folder.glob("model-*.safetensors")):
    state.update(safetensors.torch.load_file(str(file)))
  model.load_state_dict(state, strict=True)
  return model


# --- forwards -----------------------------------------------------------------------------


def block_causal(valid_BxL: torch.Tensor, block: int) -> torch.Tensor:
  """[B, 1, L, L] bool: blocks of `block` from each row's first real token, padded keys
  masked; a padded query sees itself only (its output is undefined, but finite)."""
  pos_BxL = valid_BxL.long().cumsum(-1) - 1
  blocks_BxL = torch.where(valid_BxL, pos_BxL // block, -1)
  allowed = (blocks_BxL[:, None, :] <= blocks_BxL[:, :, None]) & valid_BxL[:, None, :]
  allowed = allowed | torch.eye(valid_BxL.shape[1], dtype=torch.bool)[None] & ~valid_BxL[:, :, None]
  return allowed[:, None]


class Wrapped:
  """The published model called as block_diffusion_generate calls it, the mask id's logit
  set to -inf, every decision's margin noted (`watch`), and any rewrite of an already
  written position detected."""

  def __init__(self, model):
    self.model = model
    self.device = torch.device("cpu")
    self.watch = None  # (margins, strategy, threshold, block length, schedule) during a case
    self.reset()

  def reset(self):
    self.calls = self.rewrites = self.floor_decides = self.threshold_decides = 0
    self._last = None
    self._step = 0  # the denoising step within the block

  def eval(self):
    return self

  @torch.no_grad()
  def __call__(self, input_ids, **kwargs):
    out = self.model(input_ids, **kwargs)
    out.logits[..., MASK_ID] = -torch.inf
    if self.watch is not None and input_ids.shape[0] == 1:
      self._check(input_ids[0], kwargs.get("position_ids"), out.logits[0],
                  kwargs.get("store_kv", False))
    return out

  def _check(self, ids_W, position_ids, logits_WxV, store):
    start = int(position_ids[0, 0]) if position_ids is not None else 0
    if self._last is not None and self._last[0] == start:
      before = self._last[1]
      written = before != MASK_ID
      self.rewrites += int((ids_W[written] != before[written]).sum())
    else:
      self._step = 0
    self._last = (start, ids_W.clone())
    margins, strategy, threshold, block, schedule = self.watch
    if store or ids_W.shape[0] != block:  # the prefill and the stores decide nothing
      return
    self.calls += 1
    k = schedule[self._step]
    self._step += 1
    masked = ids_W == MASK_ID
    margins.argmax(logits_WxV[masked], "argmax")
    if strategy == "sequential":
      return
    conf = torch.softmax(logits_WxV[masked].double(), -1).max(-1).values
    for k in range(1, int(masked.sum())):
      margins.cut(conf, k, "confidence cut")
    if strategy == "low_confidence_dynamic":
      for c in conf.tolist():
        margins.compare(c, threshold, "threshold")
      above = int((conf > threshold).sum())
      self.threshold_decides += above > k
      self.floor_decides += above < k and k > 1


def reference_arrays(model, block: int) -> dict:
  """reference.npz: the block-causal forward of a padded batch and the cached passes."""
  rng = np.random.default_rng(11)
  length, pad = 16, 3
  tokens = rng.integers(0, len(CHARS), (2, length))
  tokens[rng.random((2, length)) < 0.4] = MASK_ID
  valid = np.ones((2, length), bool)
  valid[1, :pad] = False
  tokens[~valid] = EOS_ID
  tokens_t, valid_t = torch.from_numpy(tokens), torch.from_numpy(valid)
  positions = (valid_t.long().cumsum(-1) - 1).clamp(min=0)
  with torch.no_grad():
    logits = model(tokens_t, attention_mask=block_causal(valid_t, block),
                   position_ids=positions, use_cache=False).logits.float()
  logits[..., MASK_ID] = -torch.inf
  logits[~valid_t] = torch.nan

  # The cached passes, as block_diffusion_generate makes them (batch 1, positions 0..).
  prefix = torch.from_numpy(rng.integers(0, len(CHARS), (1, 2 * block)))
  blk = torch.from_numpy(rng.integers(0, len(CHARS), (1, block)))
  blk[0, [0, 2]] = MASK_ID
  final = blk.clone()
  final[0, [0, 2]] = torch.from_numpy(rng.integers(0, len(CHARS), 2))
  nxt = torch.full((1, block), MASK_ID)
  nxt[0, 1] = int(rng.integers(0, len(CHARS)))
  cache = IndexedCache()
  ones = lambda q, k: torch.ones(1, q, k)
  pos = lambda a, b: torch.arange(a, b)[None]
  tri = block_causal(torch.ones(1, 2 * block, dtype=torch.bool), block)[:, 0].float()
  with torch.no_grad():
    model(prefix, attention_mask=tri, position_ids=pos(0, 2 * block), past_key_values=cache,
          use_cache=True, store_kv=True)
    block_logits = model(blk, attention_mask=ones(block, 3 * block),
                         position_ids=pos(2 * block, 3 * block), past_key_values=cache,
                         use_cache=True, store_kv=False).logits.float()
    model(final, attention_mask=ones(block, 3 * block), position_ids=pos(2 * block, 3 * block),
          past_key_values=cache, use_cache=True, store_kv=True)
    next_logits = model(nxt, attention_mask=ones(block, 4 * block),
                        position_ids=pos(3 * block, 4 * block), past_key_values=cache,
                        use_cache=True, store_kv=False).logits.float()
    # The same logits from one block-causal pass over the whole sequence.
    whole = torch.cat([prefix, blk], 1)
    full1 = model(whole, attention_mask=block_causal(torch.ones_like(whole, dtype=torch.bool),
                                                     block),
                  position_ids=pos(0, 3 * block), use_cache=False).logits[:, 2 * block:]
    whole = torch.cat([prefix, final, nxt], 1)
    full2 = model(whole, attention_mask=block_causal(torch.ones_like(whole, dtype=torch.bool),
                                                     block),
                  position_ids=pos(0, 4 * block), use_cache=False).logits[:, 3 * block:]
  for logits_ in (block_logits, next_logits):
    logits_[..., MASK_ID] = -torch.inf
  diffs = [float((a[..., :MASK_ID] - b[..., :MASK_ID]).abs().max())
           for a, b in ((block_logits, full1), (next_logits, full2))]
  print(f"cached block pass vs the full block-causal forward: max |diff| {diffs[0]:.2g} "
        f"(block 1), {diffs[1]:.2g} (block 2)")
  assert max(diffs) < 1e-4, diffs
  as_np = lambda t: t.numpy()
  return {"tokens_BxL": tokens.astype(np.int32), "valid_BxL": valid,
          "logits_BxLxV": as_np(logits), "block_size": np.int32(block),
          "prefix_1xP": as_np(prefix).astype(np.int32), "block_1xW": as_np(blk).astype(np.int32),
          "block_logits_1xWxV": as_np(block_logits),
          "block_final_1xW": as_np(final).astype(np.int32),
          "next_1xW": as_np(nxt).astype(np.int32), "next_logits_1xWxV": as_np(next_logits)}


# The step laws at temperature > 0 (tests/formats/test_sdar.py derives the law of one
# step from these distributions): a block of 4 masks after 8 prompt tokens.
LAW_STATIC = {"temperature": 0.7, "top_k": 0, "top_p": 1.0}
LAW_DYNAMIC = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
LAW_FILTERED = {"temperature": 0.7, "top_k": 20, "top_p": 0.9}  # the distribution only


def law_arrays(code, model, block: int) -> dict:
  """The block's logits from the published cached pass and the distributions the published
  `sample_with_temperature_topk_topp` draws from (its own top_k_logits / top_p_logits and
  softmax) at the two law settings; the dynamic case's threshold, the median of the drawn
  tokens' chance to clear it being near 1/2."""
  rng = np.random.default_rng(13)
  prefix = torch.from_numpy(rng.integers(0, len(CHARS), (1, 2 * block)))
  masks = torch.full((1, block), MASK_ID)
  cache = IndexedCache()
  tri = block_causal(torch.ones(1, 2 * block, dtype=torch.bool), block)[:, 0].float()
  with torch.no_grad():
    model(prefix, attention_mask=tri, position_ids=torch.arange(2 * block)[None],
          past_key_values=cache, use_cache=True, store_kv=True)
    logits = model(masks, attention_mask=torch.ones(1, block, 3 * block),
                   position_ids=torch.arange(2 * block, 3 * block)[None],
                   past_key_values=cache, use_cache=True, store_kv=False).logits.float()
  logits[..., MASK_ID] = -torch.inf
  out = {"law_prefix_1xP": prefix.numpy().astype(np.int32), "law_logits_1xWxV": logits.numpy()}
  for name, knobs in (("static", LAW_STATIC), ("dynamic", LAW_DYNAMIC),
                      ("filtered", LAW_FILTERED)):
    x = logits.reshape(-1, VOCAB)  # as sample_with_temperature_topk_topp transforms them
    if knobs["temperature"] != 1.0:
      x = x / knobs["temperature"]
    if knobs["top_k"] > 0:
      x = code.greedy.top_k_logits(x, knobs["top_k"])
    if knobs["top_p"] < 1.0:
      x = code.greedy.top_p_logits(x, knobs["top_p"])
    out[f"law_probs_{name}_1xWxV"] = F.softmax(x, dim=-1).reshape(logits.shape).numpy()
  probs = out["law_probs_dynamic_1xWxV"][0].astype(np.float64)
  # The threshold whose clearing chances (mass of the values above it) are most even.
  candidates = np.linspace(0.05, 0.95, 91)
  spread = [np.abs((probs * (probs > t)).sum(-1) - 0.5).max() for t in candidates]
  out["law_threshold"] = np.float32(candidates[int(np.argmin(spread))])
  return out


# --- generations --------------------------------------------------------------------------

# name: (block_diffusion_generate's keyword arguments, the lengths of its two prompts, whether
# a row must stop). Each prompt runs alone (the loop takes batch 1), with config.json's EOS as
# its stopping_criteria_idx (the block that writes it ends the run); mdjax runs the two as
# one left-padded batch.
# Temperature 1 with the greedy patch: proposals are argmaxes, confidences the largest
# probabilities. The prompts' last partial blocks leave masked counts that the step counts
# divide (a remainder would make the published top-k rewrite a written position). A prompt
# shorter than a block (3) has no whole block to prefill.
CASES = {
    "dynamic_b4": ({"gen_length": 16, "block_length": 4, "denoising_steps": 4,
                    "remasking_strategy": "low_confidence_dynamic",
                    "confidence_threshold": 0.4}, (6, 9), True),
    "sequential_b4_steps2": ({"gen_length": 12, "block_length": 4, "denoising_steps": 2,
                              "remasking_strategy": "sequential"}, (3, 10), False),
    "static_b8_steps4": ({"gen_length": 16, "block_length": 8, "denoising_steps": 4,
                          "remasking_strategy": "low_confidence_static"}, (10, 12), False),
    "dynamic_b8_steps4": ({"gen_length": 16, "block_length": 8, "denoising_steps": 4,
                           "remasking_strategy": "low_confidence_dynamic",
                           "confidence_threshold": 0.4}, (8, 14), False),
}


def run_case(code, wrapped: Wrapped, name: str, base_seed: int) -> dict:
  """The case with the first prompt seed whose two runs clear MARGIN at every decision,
  rewrite no written position and each generate at least 4 distinct ids before any EOS (a
  repetition tests little); in a case that must stop, one row writes EOS after 2 or more
  tokens, inside the generation. In a low_confidence_dynamic case some pass must commit past its scheduled count
  (the threshold decides) and, with counts above 1, some pass must commit its count with
  fewer positions above the threshold (the scheduled floor decides)."""
  kwargs, lengths, must_stop = CASES[name]
  strategy = kwargs["remasking_strategy"]
  steps, block = kwargs["denoising_steps"], kwargs["block_length"]
  schedule = [block // steps + (j < block % steps) for j in range(steps)]
  rejected = collections.Counter()
  for seed in range(base_seed, base_seed + SEEDS):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, len(CHARS), n).tolist() for n in lengths]
    margins = Margins()
    wrapped.watch = (margins, strategy, kwargs.get("confidence_threshold"), block, schedule)
    wrapped.reset()
    outputs, passes = [], []
    for prompt in prompts:
      calls = wrapped.calls
      x = code.greedy.block_diffusion_generate(
          wrapped, {"input_ids": torch.tensor([prompt])}, MASK_ID, temperature=1.0, top_k=0,
          top_p=1.0, stopping_criteria_idx=[EOS_ID], **kwargs)
      outputs.append(x[0].tolist())
      passes.append(wrapped.calls - calls)
      wrapped._last = None
    wrapped.watch = None
    generated = [out[len(p):len(p) + kwargs["gen_length"]] for p, out in zip(prompts, outputs)]
    until_stop = [g[:g.index(EOS_ID)] if EOS_ID in g else g for g in generated]
    for g, before in zip(generated, until_stop):  # masks only after the block that stopped it
      assert MASK_ID not in before and (MASK_ID not in g or EOS_ID in g)
    if margins.min < MARGIN:
      rejected["margin"] += 1
    elif wrapped.rewrites:
      rejected["rewrites a written position"] += 1
    elif min(len(set(g)) for g in until_stop) < 4:
      rejected["repeats a few ids (or stops at once)"] += 1
    elif must_stop and not any(2 <= len(u) < len(g) for u, g in zip(until_stop, generated)):
      rejected["no row stops"] += 1
    elif strategy == "low_confidence_dynamic" and not wrapped.threshold_decides:
      rejected["the threshold decides nothing"] += 1
    elif (strategy == "low_confidence_dynamic" and max(schedule) > 1
          and not wrapped.floor_decides):
      rejected["the scheduled floor decides nothing"] += 1
    else:
      assert all(out[:len(p)] == p for p, out in zip(prompts, outputs))
      return {"name": name, "seed": seed, "kwargs": kwargs, "prompts": prompts,
              "outputs": outputs, "generated": generated, "until_stop": until_stop,
              "denoising_passes": passes,
              "min_margin": margins.min, "tightest": margins.where}
  raise SystemExit(f"{name}: no prompt seed in [{base_seed}, {base_seed + SEEDS}) qualifies: "
                   f"{dict(rejected)}")


def entropy_bounded_as_published(code, wrapped: Wrapped) -> str:
  """What the published `entropy_bounded` branch does: the error its first step raises."""
  prompt = torch.arange(5)[None]
  try:
    code.published.block_diffusion_generate(
        wrapped, {"input_ids": prompt}, MASK_ID, gen_length=4, block_length=4,
        denoising_steps=4, remasking_strategy="entropy_bounded", eb_threshold=0.35)
  except Exception as e:  # noqa: BLE001  (what it raises is the finding)
    return f"{type(e).__name__}: {e}"
  return "no error"


# --- the published loop on another checkpoint (mdjax/bench/families.py) ---------------------

BENCH_SOURCE = pathlib.Path("/work/.mirror/JetAstra+SDAR/repo")  # a git directory of SDAR


class _Counted:
  """A published model called as block_diffusion_generate calls it, counting the forward
  calls, the checkpoint's mask id's logit set to -inf (as Wrapped does with the fixtures')."""

  def __init__(self, model, mask_id: int):
    self.model, self.mask_id, self.calls = model, mask_id, 0
    self.device = torch.device("cpu")

  def eval(self):
    return self

  @torch.no_grad()
  def __call__(self, input_ids, **kwargs):
    self.calls += 1
    out = self.model(input_ids, **kwargs)
    out.logits[..., self.mask_id] = -torch.inf
    return out


def bench_loop(folder, source: pathlib.Path = BENCH_SOURCE):
  """`block_diffusion_generate` of the greedy copy (the fixtures' patched loop) on the
  SDARForCausalLM in `folder` (`mdjax.io.save`'s layout, every tensor loaded
  strictly), as (prompt_BxP numpy, new) -> (new tokens B x new numpy, forward calls). The
  knobs are mdjax's default plan at temperature 0: block_length and denoising_steps the
  config's block_size, low_confidence_dynamic at 0.85, temperature 1 through the greedy draw
  (argmax, the plain softmax's confidence), config.json's EOS as the stop id. The loop takes
  batch 1: the rows run one by one (their calls summed); a row that stopped is padded with its
  canvas' mask ids after the block holding EOS."""
  folder = pathlib.Path(folder)
  raw = json.loads((folder / "config.json").read_text())
  mask_id, eos_id, block = raw["mask_token_id"], raw["eos_token_id"], raw["block_size"]
  with published_modules(pathlib.Path(source)) as code:
    config = code.configuration.SDARConfig(**raw)
    if not hasattr(config, "pad_token_id"):  # transformers 4's PretrainedConfig default
      config.pad_token_id = None
    network = code.modeling.SDARForCausalLM(config).eval()
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
      state.update(safetensors.torch.load_file(str(file)))
    network.load_state_dict(state, strict=True)
    generate = code.greedy.block_diffusion_generate
  model = _Counted(network, mask_id)

  def run(prompt_BxP: np.ndarray, new: int):
    model.calls = 0
    rows = []
    for prompt in np.asarray(prompt_BxP):
      x = generate(model, {"input_ids": torch.from_numpy(prompt[None].astype(np.int64))},
                   mask_id, gen_length=new, block_length=block, denoising_steps=block,
                   temperature=1.0, top_k=0, top_p=1.0,
                   remasking_strategy="low_confidence_dynamic", confidence_threshold=0.85,
                   stopping_criteria_idx=[eos_id])
      rows.append(x[0, len(prompt):len(prompt) + new].numpy())
    return np.stack(rows).astype(np.int32), model.calls

  return run


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sdar", type=pathlib.Path, required=True,
                      help="a checkout or git directory of github.com/JetAstra/SDAR")
  parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
  args = parser.parse_args(argv)
  torch.manual_seed(0)
  torch.set_num_threads(1)
  out = args.out
  out.mkdir(parents=True, exist_ok=True)
  for old in out.iterdir():
    old.unlink()
  commit = published_commit(args.sdar)
  print(f"published code: JetAstra/SDAR @ {commit}")
  with published_modules(args.sdar) as code:
    write_checkpoint(out, weights(0), code.chat_template)
    check_tokenizer(out)
    model = load_model(code, out)
    save_npz(out / "reference.npz", {**reference_arrays(model, CONFIG["block_size"]),
                                     **law_arrays(code, model, CONFIG["block_size"])})
    wrapped = Wrapped(model)
    cases = []
    for index, name in enumerate(CASES):
      case = run_case(code, wrapped, name, base_seed=100 * (index + 1))
      cases.append(case)
      print(f"{name}: seed {case['seed']}, {case['denoising_passes']} passes, min margin "
            f"{case['min_margin']:.3g} ({case['tightest']}), generated {case['generated']}")
    error = entropy_bounded_as_published(code, wrapped)
    print(f"entropy_bounded as published: {error}")
  text = json.dumps({"published": f"JetAstra/SDAR@{commit}", "mask_id": MASK_ID,
                     "entropy_bounded_as_published": error, "cases": cases}, indent=1)
  text = re.sub(r"\[\s*((?:-?\d+,\s*)*-?\d+)\s*\]",
                lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)
  (out / "generations.json").write_text(text + "\n")


if __name__ == "__main__":
  main()
