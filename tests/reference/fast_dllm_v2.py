"""Regenerates the Fast-dLLM v2 parity fixtures in tests/fixtures/fast_dllm_v2/.

  pip install -e '.[reference]'
  python -m tests.reference.fast_dllm_v2 [--out tests/fixtures/fast_dllm_v2] \
      [--modeling GIT_DIR] [--generation GIT_DIR]

(--modeling: a git directory holding Satgoy152/DualDiffusion's commit below; --generation:
one holding NVlabs/Fast-dLLM's, a clone of NVlabs/Fast-dLLM or of a fork with its history.)

The published code is run as published, imported by path into a temporary package
(nothing of it is committed):

  * the network: `modeling.py` and `configuration.py` of the Hugging Face folder
    Efficient-Large-Model/Fast_dLLM_v2_7B (Fast_dLLM_QwenForCausalLM, model_type
    "Fast_dLLM_Qwen"), read from the copy of that folder committed, with its README,
    config.json, tokenizer files and safetensors index, in github.com/Satgoy152/DualDiffusion
    at commit 189fa7a74a83119647dad36b24363cc4e89370ab (FastDLLM-inferencing/Fast_dLLM_v2_7B/).
    It is taken for the published file because it is a verbatim download of the whole hub
    folder (its README is the hub's model card, its config.json the hub's) and its network
    (attention, masks, caches, RoPE, norms) is line for line the same as the other copies in
    forks of NVlabs/Fast-dLLM; that commit's file differs from the hub's only in
    `Fast_dLLM_QwenForCausalLM.generate`, which gained a `steps` knob and is not used here.
  * the decoder: `Fast_dLLM_QwenForCausalLM.batch_sample` of NVlabs/Fast-dLLM
    v2/generation_functions.py at commit d259b48a570245e4dc3a75db30da44122be990da (unchanged
    up to af42f511f705a2db0d16aa63ebcfcbc26f29181d), read from the fork
    github.com/PunchlineAAAA/Fast-dLLM, whose history holds NVlabs' commits. It is bound to
    the model as eval.py binds it (`types.MethodType`) and called as eval.py calls it (prompts
    right-padded with the mask id, `min_len`, `seq_len`).

What is replaced, none of it touching the computation of the tokens compared:
  * transformers 5 computes unscaled RoPE inline and has no ROPE_INIT_FUNCTIONS["default"],
    which the modeling file looks up: transformers 4.x's unscaled initialisation is
    registered under that name (as tests/reference/pretrained.py does for Dream).
  * transformers 5's `auto_docstring` refuses a class it does not know, which
    generation_functions.py decorates (`class Fast_dLLM_QwenForCausalLM`, a holder of
    `batch_sample`): the decorator is the identity while that file is imported (it only
    writes docstrings).
  * transformers 5's DynamicCache is no longer indexed as (keys, values) per layer and has
    no `key_cache` / `value_cache` lists, which the attention (`past_key_value[i][0]`) and
    batch_sample (dropping finished rows) use: the modeling file's DynamicCache is a
    subclass adding those two reads over the same tensors.
  * a forward hook on `lm_head` sets the mask id's logit to -inf: trained checkpoints never
    predict the mask, random ones would, and mdjax's contract excludes it (the published
    softmax runs over the whole vocabulary, mask included).
  * the tiny checkpoint's config.json carries `mask_token_id` (300): the published one has no
    such key and the code takes 151665, outside a 320-id vocabulary. Every other key is the
    published config.json's.

What the fixtures hold:
  config.json, model-0000{1,2}-of-00002.safetensors + model.safetensors.index.json (the
    published layout, sharded), tokenizer.json, tokenizer_config.json (ChatML template):
    a tiny random float32 checkpoint, bd_size 8, 2 layers, d_model 64, 4 heads, 2 KV heads.
  reference.npz:
    tokens_BxL (2 x 20, mask ids inside) and logits_BxLxV: the published forward with
      `block_size=8` (its inference mask: key block <= query block), its logits shifted by one
      as the decoder reads them (the prediction for position i is the output at i - 1;
      position 0 keeps its own), mask column -inf;
    cached_prefix_BxP (the first 16 tokens) and cached_block_BxW (the next 8) with
      cached_logits_BxWxV: the decoder's denoising pass (one block against the prefix's
      DynamicCache built by a pass with update_past_key_values=True), shifted as mdjax's
      cached pass shifts (window position 0 reads the prefix's last output, which is what
      batch_sample's autoregressive first token of the block reads).
  generations.json: batch_sample at temperature 0 (greedy; `use_block_cache=False`), cases
    below; per case the prompts, the knobs, the published output and each row's generated
    tokens (after its prompt, up to and including the first stop token).

Every decision of every case clears a 1e-4 relative float margin (else the next prompt seed
is tried): the argmax of every proposal of the current sub-block, each masked proposal's
probability against the threshold, the forced commit's probability gap when no proposal
clears the threshold, and the argmax of each block's autoregressive first token.
Self-checks printed by the last run (float32, 1 thread, transformers 5.25 / torch 2.13):

  the cached block pass vs the full pass at the same positions, max |diff|     0
  (and the first two blocks' logits unchanged by a third: block-causal)
  single_tail           seed 100  min margin 0.0011   stops after 10 tokens
  single_aligned        seed 202  min margin 0.00861  stops after 7 (prompt of 2 whole blocks)
  single_one_sub_block  seed 300  min margin 0.0069   stops after 8
  batch                 seed 400  min margin 0.00131  row 0 stops after 12, row 1 runs 22
  batch_ragged          seed 500  min margin 0.000863 prompts of 10 and 13 tokens

and every batch row's tokens are those it gets alone. A rerun writes the same bytes.

Published behaviours the cases keep clear of (the mdjax decoder does the evident thing):
  * a shortest prompt of exactly block_size tokens: batch_sample then skips the prefill
    (`min_len > block_size` is false) and decodes the first block without the prompt;
  * a batch whose longest prompt is a whole number of blocks plus one token, a shorter one
    ending in the block before: that block's autoregressive token overwrites the longer
    prompt's last token (`input_ids = x_t`);
  * temperature > 0 draws with `torch.multinomial(p_1t[0])`: the first row's law for
    every row, so only batch 1 is sampled as intended (its law is checked in
    tests/sampling/test_fast_dllm_v2.py against a transcription of `sample_with_top_p`);
  * `use_block_cache=True` (the sub-block cache, refreshed when any row's sub-block starts
    masked) is an approximation that couples the rows of a batch; it is not reproduced.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import pathlib
import re
import subprocess
import sys
import tempfile
import types

import numpy as np

from tests.reference.pretrained import Margins, fresh_output, save_npz

try:
  import safetensors.torch
  import torch
except ImportError as e:  # the optional extra
  raise SystemExit(f"{e}: install the reference extra: pip install -e '.[reference]'")

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "fast_dllm_v2"
MIRRORS = pathlib.Path("/work/.mirror")
MODELING_GIT = MIRRORS / "Satgoy152+DualDiffusion" / "repo"
MODELING_COMMIT = "189fa7a74a83119647dad36b24363cc4e89370ab"
MODELING_DIR = "FastDLLM-inferencing/Fast_dLLM_v2_7B"
GENERATION_GIT = MIRRORS / "PunchlineAAAA+Fast-dLLM" / "repo"
GENERATION_COMMIT = "d259b48a570245e4dc3a75db30da44122be990da"
GENERATION_FILE = "v2/generation_functions.py"

VOCAB = 320
BOS_ID, IM_START, STOP_ID, MASK_ID = 290, 294, 295, 300  # <|endoftext|>, <|im_start|>, <|im_end|>
BLOCK = 8
MARGIN = 1e-4
MIN_GENERATED = 8  # a case stopping sooner tests little

CHARS = [chr(c) for c in range(32, 127)] + ["\n"]  # ids 0..95
UNK = "<|unk|>"  # id 96
SPECIALS = {BOS_ID: "<|endoftext|>", IM_START: "<|im_start|>", STOP_ID: "<|im_end|>",
            MASK_ID: "|<MASK>|"}
TEMPLATE = (  # Qwen2.5's ChatML, without its default system prompt
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

CONFIG = {  # the published config.json's keys, tiny values (mask_token_id added: docstring)
    "architectures": ["Fast_dLLM_QwenForCausalLM"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                 "AutoModel": "modeling.Fast_dLLM_QwenModel",
                 "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
    "bd_size": BLOCK, "bos_token_id": BOS_ID, "conplemenrary_mask": True,
    "eos_token_id": STOP_ID, "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.02, "intermediate_size": 128,
    "layer_types": ["full_attention", "full_attention"], "mask_token_id": MASK_ID,
    "max_position_embeddings": 4096, "max_window_layers": 2, "model_type": "Fast_dLLM_Qwen",
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "pad_token_id": STOP_ID, "rms_norm_eps": 1e-6, "rope_scaling": None,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "float32", "transformers_version": "4.53.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": VOCAB,
}

# As tests/reference/pretrained.py: spread logits, sharp attention, a small mask embedding;
# the stop token's head row larger so that some cases stop.
EMBED_STD, HEAD_STD, STOP_HEAD_SCALE, BIAS_STD = 1.0, 0.35, 2.2, 0.3
QK_SCALE, VO_SCALE, MASK_EMBED_SCALE = 2.5, 1.5, 0.2

# name: (prompt lengths of the rows, batch_sample knobs)
CASES = {
    "single_tail": ((5,), {"max_new_tokens": 24, "small_block_size": 4, "threshold": 0.9}),
    "single_aligned": ((16,), {"max_new_tokens": 24, "small_block_size": 2, "threshold": 0.5}),
    "single_one_sub_block": ((3,), {"max_new_tokens": 24, "small_block_size": 8,
                                    "threshold": 0.95}),
    "batch": ((11, 11), {"max_new_tokens": 24, "small_block_size": 4, "threshold": 0.7}),
    "batch_ragged": ((10, 13), {"max_new_tokens": 16, "small_block_size": 4, "threshold": 0.8}),
}


# --- tokenizer and checkpoint -------------------------------------------------------------


def build_tokenizer():
  """A char-level WordLevel tokenizer (ids < 96 printable ASCII and newline), the special
  tokens at their config ids, reserved names for the rest of the 320 ids."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
  vocab = {c: i for i, c in enumerate(CHARS)}
  vocab[UNK] = len(CHARS)
  for i in range(len(CHARS) + 1, VOCAB):
    vocab[SPECIALS.get(i, f"<|reserved_{i}|>")] = i
  tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                          for _, s in sorted(SPECIALS.items())])
  return tok


def weights(seed: int) -> dict[str, np.ndarray]:
  """The published (Qwen2) tensor names, torch Linear [out, in]."""
  c = CONFIG
  d, f, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
  kv = c["num_key_value_heads"] * (d // c["num_attention_heads"])
  rng = np.random.default_rng(seed)

  def normal(shape, std):
    return (rng.standard_normal(shape) * std).astype(np.float32)

  def linear(o, i, scale=1.0):
    return normal((o, i), scale / math.sqrt(i))

  def norm():
    return (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)

  embed = normal((VOCAB, d), EMBED_STD)
  embed[MASK_ID] *= MASK_EMBED_SCALE
  out = {"model.embed_tokens.weight": embed}
  for i in range(n):
    b = f"model.layers.{i}"
    out[f"{b}.input_layernorm.weight"] = norm()
    for p, width, scale in (("q", d, QK_SCALE), ("k", kv, QK_SCALE), ("v", kv, VO_SCALE)):
      out[f"{b}.self_attn.{p}_proj.weight"] = linear(width, d, scale)
      out[f"{b}.self_attn.{p}_proj.bias"] = normal((width,), BIAS_STD)
    out[f"{b}.self_attn.o_proj.weight"] = linear(d, d, VO_SCALE)
    out[f"{b}.post_attention_layernorm.weight"] = norm()
    out[f"{b}.mlp.gate_proj.weight"] = linear(f, d)
    out[f"{b}.mlp.up_proj.weight"] = linear(f, d)
    out[f"{b}.mlp.down_proj.weight"] = linear(d, f)
  out["model.norm.weight"] = norm()
  head = normal((VOCAB, d), HEAD_STD)
  head[STOP_ID] *= STOP_HEAD_SCALE
  out["lm_head.weight"] = head
  return out


def write_checkpoint(folder: pathlib.Path, tensors: dict):
  """config.json, two safetensors shards with their index, the tokenizer files."""
  (folder / "config.json").write_text(json.dumps(CONFIG, indent=2, sort_keys=True) + "\n")
  names = sorted(tensors)
  half = len(names) // 2
  weight_map, total = {}, 0
  for k, part in enumerate((names[:half], names[half:])):
    file = f"model-{k + 1:05d}-of-00002.safetensors"
    safetensors.torch.save_file({n: torch.from_numpy(tensors[n]).contiguous() for n in part},
                                str(folder / file), metadata={"format": "pt"})
    weight_map.update({n: file for n in part})
    total += sum(tensors[n].nbytes for n in part)
  (folder / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2,
      sort_keys=True) + "\n")
  build_tokenizer().save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps({
      "add_bos_token": False, "additional_special_tokens": [SPECIALS[MASK_ID]],
      "bos_token": None, "chat_template": TEMPLATE, "clean_up_tokenization_spaces": False,
      "eos_token": SPECIALS[STOP_ID], "model_max_length": 4096,
      "pad_token": SPECIALS[BOS_ID], "padding_side": "right",
      "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": UNK}, indent=2,
      sort_keys=True) + "\n")


# --- the published code -------------------------------------------------------------------


def _git_show(git_dir: pathlib.Path, commit: str, path: str) -> str:
  return subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{commit}:{path}"],
                        check=True, capture_output=True, text=True).stdout


def _default_rope(config, device=None, seq_len=None, **kwargs):
  """transformers 4.x's unscaled RoPE initialisation, which the modeling file looks up."""
  del seq_len, kwargs
  dim = config.hidden_size // config.num_attention_heads
  exponent = torch.arange(0, dim, 2, dtype=torch.int64).float().to(device) / dim
  return 1.0 / (config.rope_theta ** exponent), 1.0


class _Layers:
  """transformers 4's `cache.key_cache` / `value_cache` lists over transformers 5's layers."""

  def __init__(self, cache, which: str):
    self.cache, self.which = cache, which

  def __getitem__(self, i):
    return getattr(self.cache.layers[i], self.which)

  def __setitem__(self, i, value):
    setattr(self.cache.layers[i], self.which, value)


def compat_cache(base):
  """transformers 5's DynamicCache with transformers 4's reads the published code makes:
  `cache[i]` -> (keys, values) and `key_cache[i]` / `value_cache[i]` (read and assigned)."""

  class DynamicCache(base):
    def __getitem__(self, i):
      return self.layers[i].keys, self.layers[i].values

    @property
    def key_cache(self):
      return _Layers(self, "keys")

    @property
    def value_cache(self):
      return _Layers(self, "values")

  return DynamicCache


@contextlib.contextmanager
def published(modeling_git: pathlib.Path, generation_git: pathlib.Path):
  """(modeling module, configuration module, generation_functions module)."""
  with tempfile.TemporaryDirectory() as tmp:
    pkg = pathlib.Path(tmp) / "_fast_dllm_v2"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("modeling", "configuration"):
      (pkg / f"{name}.py").write_text(
          _git_show(modeling_git, MODELING_COMMIT, f"{MODELING_DIR}/{name}.py"))
    (pkg / "generation_functions.py").write_text(
        _git_show(generation_git, GENERATION_COMMIT, GENERATION_FILE))
    sys.path.insert(0, tmp)
    try:
      modeling = importlib.import_module("_fast_dllm_v2.modeling")
      if "default" not in modeling.ROPE_INIT_FUNCTIONS:
        modeling.ROPE_INIT_FUNCTIONS = dict(modeling.ROPE_INIT_FUNCTIONS, default=_default_rope)
      if not hasattr(modeling.DynamicCache, "key_cache"):
        modeling.DynamicCache = compat_cache(modeling.DynamicCache)
      import transformers.utils
      decorator = transformers.utils.auto_docstring
      transformers.utils.auto_docstring = lambda obj=None, **kwargs: obj
      try:
        generation = importlib.import_module("_fast_dllm_v2.generation_functions")
      finally:
        transformers.utils.auto_docstring = decorator
      yield modeling, importlib.import_module("_fast_dllm_v2.configuration"), generation
    finally:
      sys.path.remove(tmp)


def load_model(modeling, configuration, folder: pathlib.Path, generation):
  """Fast_dLLM_QwenForCausalLM from the folder (strict), mask logit -inf, batch_sample bound."""
  raw = json.loads((folder / "config.json").read_text())
  raw = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "model_type")}
  config = configuration.Fast_dLLM_QwenConfig(**raw)
  config._attn_implementation = "sdpa"
  model = modeling.Fast_dLLM_QwenForCausalLM(config).eval()
  state = {}
  for file in sorted(folder.glob("*.safetensors")):
    state.update(safetensors.torch.load_file(str(file)))
  model.load_state_dict(state, strict=True)

  def no_mask(module, args, output):
    output[..., MASK_ID] = -torch.inf
    return output

  model.lm_head.register_forward_hook(no_mask)
  model.mdm_sample = types.MethodType(generation.Fast_dLLM_QwenForCausalLM.batch_sample, model)
  return model


# --- reference logits ---------------------------------------------------------------------


def _shift(logits):
  return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)


def reference_logits(model) -> dict:
  rng = np.random.default_rng(21)
  tokens = rng.integers(0, len(CHARS), (2, 20))
  tokens[rng.random(tokens.shape) < 0.4] = MASK_ID
  x = torch.from_numpy(tokens)
  with torch.no_grad():
    full = model(input_ids=x, block_size=BLOCK).logits
  # the cached pass runs on a whole block of 8: 4 more tokens make 24
  ext = rng.integers(0, len(CHARS), (2, 4))
  ext[:, 1] = MASK_ID
  x24 = torch.cat([x, torch.from_numpy(ext)], 1)
  with torch.no_grad():
    full24 = model(input_ids=x24, block_size=BLOCK).logits
    prefix = model(input_ids=x24[:, :16], use_cache=True, update_past_key_values=True,
                   block_size=BLOCK)
    # batch_sample's denoising pass: one block against the prefix cache (block_size left
    # at its default, as batch_sample leaves it)
    block = model(input_ids=x24[:, 16:24], use_cache=True,
                  past_key_values=prefix.past_key_values, update_past_key_values=False).logits
  diff = float((block - full24[:, 16:24]).abs()[torch.isfinite(block)].max())
  assert diff < 1e-4, diff
  assert torch.allclose(full24[:, :16], full[:, :16], atol=1e-4), "a later block was seen"
  cached = torch.cat([prefix.logits[:, -1:], block[:, :-1]], dim=1)
  return {"tokens_BxL": tokens.astype(np.int32), "logits_BxLxV": _shift(full).numpy(),
          "cached_prefix_BxP": x24[:, :16].numpy().astype(np.int32),
          "cached_block_BxW": x24[:, 16:24].numpy().astype(np.int32),
          "cached_logits_BxWxV": cached.numpy()}, diff


# --- generations --------------------------------------------------------------------------


class Recorder:
  """Margins of batch_sample's decisions, read from its forward and sample_with_top_p calls
  (use_block_cache=False: each denoising pass is the current block, then one sampling)."""

  def __init__(self, model, threshold: float, small: int):
    self.model, self.threshold, self.small = model, threshold, small
    self.margins = Margins()
    self.window = None
    forward, sample = model.forward, model.sample_with_top_p

    def recorded_forward(*args, **kwargs):
      out = forward(*args, **kwargs)
      ids = kwargs["input_ids"]
      if kwargs.get("update_past_key_values"):  # the next block's first token: an argmax
        self.margins.argmax(out.logits[:, -1], "first token")
      else:
        self.window = ids
      return out

    def recorded_sample(logits, top_p=0.95, temperature=0.0):
      x_1, p_1t = sample(logits, top_p=top_p, temperature=temperature)
      masked = self.window == MASK_ID
      sub = next(s for s in range(0, masked.shape[1], self.small)
                 if masked[:, s:s + self.small].any())
      cand = masked[:, sub:sub + self.small]
      for row in range(logits.shape[0]):
        idx = cand[row].nonzero().flatten()
        if not len(idx):
          continue
        self.margins.argmax(logits[row, idx], "proposal argmax")
        p = p_1t[row, idx].gather(-1, x_1[row, idx, None]).squeeze(-1)
        for value in p.tolist():
          self.margins.compare(value, self.threshold)
        if not (p > self.threshold).any():
          self.margins.cut(p, 1, "forced commit")
      return x_1, p_1t

    model.forward, model.sample_with_top_p = recorded_forward, recorded_sample

  def restore(self):
    del self.model.forward, self.model.sample_with_top_p


def run_case(model, prompts: list[list[int]], knobs: dict, threshold_check=True):
  seq_len = [len(p) for p in prompts]
  width = max(seq_len)
  ids = torch.full((len(prompts), width), MASK_ID, dtype=torch.long)
  for row, p in enumerate(prompts):
    ids[row, :len(p)] = torch.tensor(p)
  recorder = Recorder(model, knobs["threshold"], knobs["small_block_size"])
  try:
    with torch.no_grad():
      out = model.mdm_sample(ids, tokenizer=types.SimpleNamespace(pad_token_id=STOP_ID),
                             block_size=BLOCK, min_len=min(seq_len),
                             seq_len=torch.tensor(seq_len), mask_id=MASK_ID, stop_token=STOP_ID,
                             use_block_cache=False, temperature=0.0, **knobs)
  finally:
    recorder.restore()
  rows = [out[i].tolist() for i in range(len(prompts))]
  return rows, recorder.margins


def generated(row: list[int], prompt_length: int) -> list[int]:
  """The tokens after the prompt, up to and including the first stop token."""
  gen = row[prompt_length:]
  return gen[:gen.index(STOP_ID) + 1] if STOP_ID in gen else gen


def make_case(model, name: str, base_seed: int, tries: int = 300) -> dict:
  lengths, knobs = CASES[name]
  for seed in range(base_seed, base_seed + tries):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, len(CHARS), n).tolist() for n in lengths]
    rows, margins = run_case(model, prompts, knobs)
    if margins.min <= MARGIN:
      continue
    gens = [generated(r, len(p)) for r, p in zip(rows, prompts)]
    if min(len(g) for g in gens) < MIN_GENERATED:
      continue
    if any(MASK_ID in g for g in gens):
      raise RuntimeError(f"{name}: the output holds the mask id: {gens}")
    if len(prompts) > 1:  # each row alone gives the same tokens
      alone = [generated(run_case(model, [p], knobs)[0][0], len(p)) for p in prompts]
      if alone != gens:
        continue
    return {"name": name, "seed": seed, "min_margin": float(f"{margins.min:.3g}"),
            "block_size": BLOCK, "temperature": 0.0, "use_block_cache": False,
            "stop_token": STOP_ID, **knobs, "prompts": prompts, "output_rows": rows,
            "generated": gens}
  raise RuntimeError(f"{name}: no seed in [{base_seed}, {base_seed + tries}) clears {MARGIN}")


# --- the published loop on another checkpoint (mdjax/bench/families.py) ---------------------


def bench_loop(folder, modeling_git: pathlib.Path = MODELING_GIT,
               generation_git: pathlib.Path = GENERATION_GIT):
  """`batch_sample` (as the fixtures call it: greedy, use_block_cache=False) on the
  Fast_dLLM_QwenForCausalLM in `folder` (`mdjax.io.save`'s layout, loaded strictly),
  as (prompt_BxP numpy, new) -> (new tokens B x new numpy, forward calls). The knobs are
  mdjax's default plan: block_size config.json's bd_size, small_block_size 8, threshold 0.9,
  temperature 0, config.json's EOS as the stop token; the rows of a batch (prompts of one
  length) run together, as batch_sample runs them. A row that stopped is padded with the
  stop token after it."""
  folder = pathlib.Path(folder)
  raw = json.loads((folder / "config.json").read_text())
  mask_id, stop_id, block = raw["mask_token_id"], raw["eos_token_id"], raw["bd_size"]
  with published(modeling_git, generation_git) as (modeling, configuration, generation):
    keys = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "model_type")}
    config = configuration.Fast_dLLM_QwenConfig(**keys)
    config._attn_implementation = "sdpa"
    model = modeling.Fast_dLLM_QwenForCausalLM(config).eval()
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
      state.update(safetensors.torch.load_file(str(file)))
    model.load_state_dict(state, strict=True)
    batch_sample = types.MethodType(generation.Fast_dLLM_QwenForCausalLM.batch_sample, model)

  def no_mask(module, args, output):  # as load_model's hook, with this checkpoint's mask id
    output[..., mask_id] = -torch.inf
    return output

  model.lm_head.register_forward_hook(no_mask)
  calls, forward = [0], model.forward

  def counted_forward(*args, **kwargs):  # batch_sample calls self.forward, past any hook
    calls[0] += 1
    return forward(*args, **kwargs)

  model.forward = counted_forward

  def run(prompt_BxP: np.ndarray, new: int):
    prompt_BxP = np.asarray(prompt_BxP)
    batch, length = prompt_BxP.shape
    calls[0] = 0
    with torch.no_grad():
      out = batch_sample(torch.from_numpy(prompt_BxP.astype(np.int64)),
                         tokenizer=types.SimpleNamespace(pad_token_id=stop_id),
                         block_size=block, max_new_tokens=new, small_block_size=8,
                         min_len=length, seq_len=torch.full((batch,), length),
                         mask_id=mask_id, threshold=0.9, stop_token=stop_id,
                         use_block_cache=False, top_p=0.95, temperature=0.0)
    rows = np.full((batch, new), stop_id, np.int32)
    for i in range(batch):
      generated = out[i][length:length + new].numpy()
      rows[i, :len(generated)] = generated
    return rows, calls[0]

  return run


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
  parser.add_argument("--modeling", type=pathlib.Path, default=MODELING_GIT,
                      help="git directory of Satgoy152/DualDiffusion (the hub folder's copy)")
  parser.add_argument("--generation", type=pathlib.Path, default=GENERATION_GIT,
                      help="git directory holding NVlabs/Fast-dLLM's history")
  args = parser.parse_args(argv)
  out = fresh_output(args.out)
  write_checkpoint(out, weights(7))
  with published(args.modeling, args.generation) as (modeling, configuration, generation):
    model = load_model(modeling, configuration, out, generation)
    arrays, diff = reference_logits(model)
    save_npz(out / "reference.npz", arrays)
    print(f"cached vs full: max |diff| {diff:.2g}")
    cases = []
    for index, name in enumerate(CASES):
      case = make_case(model, name, base_seed=100 * (index + 1))
      cases.append(case)
      print(f"{name}: seed {case['seed']}, min margin {case['min_margin']:.3g}, "
            f"generated {case['generated']}")
  text = json.dumps(cases, indent=1)
  text = re.sub(r"\[\s*((?:-?\d+,\s*)*-?\d+)\s*\]",
                lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)
  (out / "generations.json").write_text(text + "\n")


if __name__ == "__main__":
  main()
