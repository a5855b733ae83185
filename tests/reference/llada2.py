"""Regenerates the LLaDA2 (llada2_moe) parity fixtures in tests/fixtures/llada2/.

  pip install -e '.[reference]'
  python -m tests.reference.llada2 --source SOURCE [--out tests/fixtures/llada2]

SOURCE holds the published modeling code of inclusionAI/LLaDA2.0-mini
(modeling_llada2_moe.py and configuration_llada2_moe.py): a folder with the two files (the
HF folder itself: `huggingface-cli download inclusionAI/LLaDA2.0-mini --include '*.py'`), or
GITDIR@REV:SUBDIR of a git checkout or bare git directory holding a copy. The fixtures were
written from the hub's files as copied into github.com/yks23/Information-Gain-Sampler,
  SOURCE=<git dir>@f1cb636fcd5666afa1c16c4cb12944ecb614eaf2:dllm/dllm/pipelines/llada2/models
(the network and `generate` there match the copy in github.com/sajadn/Megatron-Bridge
modeling_llada2_moe.py at 4fde5488eecca7d672000cf0b49d67a6d17f074b, except that the latter's
`_sample_with_temperature_topk_topp` has the greedy branch used below). Nothing of that code
is committed: the two files are copied into a temporary package at run time.

What it writes (every file from fixed seeds):

  config.json, model-0000{1,2}-of-00002.safetensors, model.safetensors.index.json
      a tiny random float32 LLaDA2MoeModelLM (3 layers, d_model 64, 4 heads / 2 KV heads of
      16, qk-norm, partial rotary 0.5, layer 0 dense, layers 1-2 of 8 experts in 2 groups
      (top-1 group, 2 experts a token, sigmoid scores with a random expert bias) and one
      shared expert), saved by its state_dict names (the expert bias buffer included), in
      two shards. It is loaded into the published class with strict=True first.
  tokenizer.json, tokenizer_config.json
      the char-level tokenizer of tests/reference/pretrained.py with LLaDA2's special token
      names (<|endoftext|> EOS, <|mask|>, <role>, </role>, <|role_end|>) and a Ling-style
      chat template (a simplification of the published one: no default system turn).
  reference.npz
      tokens_BxL / valid_BxL: a 2 x 24 batch with mask ids inside, row 0 left-padded by 3;
      logits_BxLxV: the published forward's float32 logits under block-causal attention of
      block_size (8), positions and blocks counted from each row's first real token, padded
      keys masked (a padded query sees itself only); NaN at padded queries.
      cached_logits_BxWxV: the published forward over row 1's block [16, 24) against the
      DynamicCache of a pass over its [0, 16) (what sample_blocks' cached decoder computes;
      row 1 has no padding, so 16 starts one of its blocks).
  generations.json
      the published `generate` loop's outputs (temperature 0) for CASES: each case's knobs
      and its rows, each row a prompt run alone (the loop takes batch 1).

Stand-ins for transformers 5.25 / torch 2.13, none touching the computation:
`transformers.utils.import_utils.is_torch_fx_available` (gone in transformers 5; the file
only uses it to wrap a mask helper for torch.fx) returns False, and transformers 4.x's
default RoPE initialisation (partial_rotary_factor and head_dim read as 4.x did) is
registered as ROPE_INIT_FUNCTIONS["default"], which transformers 5 dropped. Attention is the
default SDPA path.

The generation loop is a transcription of LLaDA2MoeModelLM.generate (ids made
parameters). Deviations: (1) the hub copy only samples (torch.multinomial); the greedy branch
of the Megatron-Bridge copy is used at temperature 0 (argmax, its probability under the
plain softmax); (2) the block-causal mask is built in float32 (0 / -inf) instead of bfloat16,
which SDPA refuses next to float32 queries; (3) the [MASK] logit is set to -inf before the
draw, as in every fixture of tests/reference/pretrained.py (trained checkpoints never
predict it; mdjax's contract excludes it). eos_early_stop is left False (its default).

Every decision is checked to clear a 1e-4 relative margin: the argmax gap of every
transferred position, each threshold comparison, the top-k cut, and inside the network every
routing choice (each token's top-k_group cut of group scores and top-k cut of expert
scores, in every MoE layer of every forward). A case whose prompt seed fails is rerun with
the next seed; the logits batch likewise.

Self-checks it printed when the fixtures were written (float32, 1 thread):

  threshold: seed 100, min margin 0.0146, steps {'top-k': 4, 'threshold': 3}, 16 tokens
  threshold: seed 1198, min margin 0.00286, steps {'top-k': 3}, 2 tokens
  schedule: seed 200, min margin 0.00401, steps {'top-k': 11}, 16 tokens
  schedule: seed 1200, min margin 0.00572, steps {'top-k': 8}, 16 tokens
  defaults: seed 304, min margin 0.000157, steps {'top-k': 57}, 40 tokens
  defaults: seed 1301, min margin 0.000156, steps {'top-k': 51}, 40 tokens
  cached pass vs the full pass, max |diff|: 1.4e-06
  block-causal vs bidirectional logits, max |diff| (the mask matters): 14
  logits batch: seed, min routing margin: 21, 0.00304
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from tests.reference import pretrained as common

try:
  import safetensors.torch
  import torch
  import torch.nn.functional as F
  import transformers
except ImportError as e:  # the optional extra
  raise SystemExit(f"{e}: install the reference extra: pip install -e '.[reference]'")

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "llada2"

VOCAB = common.VOCAB  # 320
EOS_ID, MASK_ID = 290, 300
ROLE_IDS = {292: "<role>", 293: "</role>", 294: "<|role_end|>"}
MARGIN = common.MARGIN  # 1e-4
BLOCK = 8  # the fixtures' block size (the published default is 32)

CONFIG = {
    "architectures": ["LLaDA2MoeModelLM"],
    "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                 "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                 "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
    "model_type": "llada2_moe", "attention_dropout": 0.0, "embedding_dropout": 0.0,
    "eos_token_id": EOS_ID, "first_k_dense_replace": 1, "head_dim": 16, "hidden_act": "silu",
    "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
    "mask_token_id": MASK_ID, "max_position_embeddings": 512, "max_window_layers": 3,
    "moe_intermediate_size": 32, "moe_router_enable_expert_bias": True, "n_group": 2,
    "norm_head": False, "norm_topk_prob": True, "num_attention_heads": 4,
    "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 3,
    "num_key_value_heads": 2, "num_shared_experts": 1, "output_dropout": 0.0,
    "output_router_logits": False, "pad_token_id": EOS_ID, "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 600000.0,
    "routed_scaling_factor": 2.5, "router_dtype": "fp32", "score_function": "sigmoid",
    "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "float32",
    "use_bias": False, "use_cache": False, "use_qk_norm": True, "use_qkv_bias": False,
    "use_sliding_window": False, "vocab_size": VOCAB,
}

TEMPLATE = (
    "{% for message in messages %}{% set role = message['role'] | lower %}"
    "{% if role == 'user' %}{% set role = 'HUMAN' %}{% endif %}"
    "{{ '<role>' + role | upper + '</role>' + message['content'] + '<|role_end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<role>ASSISTANT</role>' }}{% endif %}")

SPECIALS = {EOS_ID: "<|endoftext|>", MASK_ID: "<|mask|>", **ROLE_IDS}


# --- tokenizer ----------------------------------------------------------------------------


def build_tokenizer():
  """tests/reference/pretrained.py's char-level tokenizer with LLaDA2's special names."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
  vocab = {c: i for i, c in enumerate(common.CHARS)}
  vocab[common.UNK] = len(common.CHARS)
  for i in range(len(common.CHARS) + 1, VOCAB):
    vocab[SPECIALS.get(i, f"<|reserved_{i}|>")] = i
  tok = Tokenizer(models.WordLevel(vocab, unk_token=common.UNK))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                          for _, s in sorted(SPECIALS.items())])
  return tok


def tokenizer_config() -> dict:
  return {"eos_token": SPECIALS[EOS_ID], "pad_token": SPECIALS[EOS_ID],
          "mask_token": SPECIALS[MASK_ID], "unk_token": common.UNK, "chat_template": TEMPLATE,
          "clean_up_tokenization_spaces": False, "model_max_length": 4096,
          "padding_side": "left", "tokenizer_class": "PreTrainedTokenizerFast"}


def check_tokenizer(folder: pathlib.Path):
  tok = transformers.PreTrainedTokenizerFast(
      tokenizer_file=str(folder / "tokenizer.json"),
      **{k: v for k, v in tokenizer_config().items() if k.endswith("_token")})
  tok.chat_template = TEMPLATE
  text = tok.apply_chat_template([{"role": "user", "content": "Hi!"}],
                                 add_generation_prompt=True, tokenize=False)
  assert text == "<role>HUMAN</role>Hi!<|role_end|><role>ASSISTANT</role>", text
  ids = tok(text, add_special_tokens=False)["input_ids"]
  assert tok.decode(ids) == text
  assert tok.convert_tokens_to_ids("<|mask|>") == MASK_ID


# --- weights in the published layout -------------------------------------------------------

# Spread logits and sharp attention, as tests/reference/pretrained.py chooses them; a router
# whose logits have std ~1 (sigmoid scores spread over (0, 1)) and an expert bias of the
# same order, so the bias and the groups both change choices.
ROUTER_STD, EXPERT_BIAS_STD = 1.0, 0.3


def weights(seed: int) -> dict[str, np.ndarray]:
  """Every tensor of the published state_dict by name (torch Linear [out, in])."""
  c = CONFIG
  d, k = c["hidden_size"], c["head_dim"]
  h, g = c["num_attention_heads"], c["num_key_value_heads"]
  e, fe = c["num_experts"], c["moe_intermediate_size"]
  rng = np.random.default_rng(seed)
  lin = lambda out_dim, in_dim, scale=1.0: common._linear(rng, out_dim, in_dim, scale)
  out = {"model.word_embeddings.weight": common._normal(rng, (VOCAB, d), common.EMBED_STD)}
  out["model.word_embeddings.weight"][MASK_ID] *= common.MASK_EMBED_SCALE
  for i in range(c["num_hidden_layers"]):
    b = f"model.layers.{i}"
    out[f"{b}.input_layernorm.weight"] = common._norm_weight(rng, d)
    out[f"{b}.attention.query_key_value.weight"] = np.concatenate(
        [lin(h * k, d, common.QK_SCALE), lin(g * k, d, common.QK_SCALE),
         lin(g * k, d, common.VO_SCALE)])
    out[f"{b}.attention.query_layernorm.weight"] = common._norm_weight(rng, k)
    out[f"{b}.attention.key_layernorm.weight"] = common._norm_weight(rng, k)
    out[f"{b}.attention.dense.weight"] = lin(d, h * k, common.VO_SCALE)
    out[f"{b}.post_attention_layernorm.weight"] = common._norm_weight(rng, d)
    if i < c["first_k_dense_replace"]:
      f = c["intermediate_size"]
      out[f"{b}.mlp.gate_proj.weight"] = lin(f, d)
      out[f"{b}.mlp.up_proj.weight"] = lin(f, d)
      out[f"{b}.mlp.down_proj.weight"] = lin(d, f)
      continue
    out[f"{b}.mlp.gate.weight"] = lin(e, d, ROUTER_STD)
    out[f"{b}.mlp.gate.expert_bias"] = common._normal(rng, (e,), EXPERT_BIAS_STD)
    for j in range(e):
      out[f"{b}.mlp.experts.{j}.gate_proj.weight"] = lin(fe, d)
      out[f"{b}.mlp.experts.{j}.up_proj.weight"] = lin(fe, d)
      out[f"{b}.mlp.experts.{j}.down_proj.weight"] = lin(d, fe)
    s = fe * c["num_shared_experts"]
    out[f"{b}.mlp.shared_experts.gate_proj.weight"] = lin(s, d)
    out[f"{b}.mlp.shared_experts.up_proj.weight"] = lin(s, d)
    out[f"{b}.mlp.shared_experts.down_proj.weight"] = lin(d, s)
  out["model.norm.weight"] = common._norm_weight(rng, d)
  head = common._normal(rng, (VOCAB, d), common.HEAD_STD)
  head[EOS_ID] *= common.SPECIAL_HEAD_SCALE
  out["lm_head.weight"] = head
  return out


def write_checkpoint(folder: pathlib.Path, tensors: dict):
  """config.json, the tensors in two shards with their index, the tokenizer files."""
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(CONFIG, indent=2, sort_keys=True) + "\n")
  names = sorted(tensors)
  halves = [names[:len(names) // 2], names[len(names) // 2:]]
  weight_map, total = {}, 0
  for index, part in enumerate(halves, 1):
    file = f"model-{index:05d}-of-{len(halves):05d}.safetensors"
    safetensors.torch.save_file({n: torch.from_numpy(tensors[n]).contiguous() for n in part},
                                str(folder / file), metadata={"format": "pt"})
    weight_map.update({n: file for n in part})
    total += sum(tensors[n].nbytes for n in part)
  (folder / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2,
      sort_keys=True) + "\n")
  build_tokenizer().save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(
      json.dumps(tokenizer_config(), indent=2, sort_keys=True) + "\n")


# --- the published code ---------------------------------------------------------------------

FILES = ("configuration_llada2_moe.py", "modeling_llada2_moe.py")


def _read_source(source: str, name: str) -> str:
  """One published file from a folder, or from GITDIR@REV:SUBDIR."""
  if "@" in source:
    gitdir, rest = source.split("@", 1)
    rev, sub = rest.split(":", 1)
    return subprocess.run(["git", f"--git-dir={_git_dir(gitdir)}", "show", f"{rev}:{sub}/{name}"],
                          check=True, capture_output=True, text=True).stdout
  return (pathlib.Path(source) / name).read_text()


def _git_dir(path: str) -> str:
  p = pathlib.Path(path)
  return str(p / ".git") if (p / ".git").exists() else str(p)


def _default_rope(config, device=None, seq_len=None, **kwargs):
  """transformers 4.x's `_compute_default_rope_parameters`: inv_freq over
  int(head_dim * partial_rotary_factor) dims, no scaling."""
  del seq_len, kwargs
  head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
  dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
  exponent = torch.arange(0, dim, 2, dtype=torch.int64).float().to(device) / dim
  return 1.0 / (config.rope_theta ** exponent), 1.0


@contextlib.contextmanager
def published_modules(source: str):
  """(configuration module, modeling module) of the published files, imported from a
  temporary package with the module docstring's two stand-ins (undone on exit)."""
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  from transformers.utils import import_utils
  tmp = tempfile.mkdtemp()
  package = pathlib.Path(tmp) / "llada2_published"
  package.mkdir()
  (package / "__init__.py").write_text("")
  for name in FILES:
    (package / name).write_text(_read_source(source, name))
  had_fx = hasattr(import_utils, "is_torch_fx_available")
  had_rope = "default" in ROPE_INIT_FUNCTIONS
  if not had_fx:
    import_utils.is_torch_fx_available = lambda: False
  if not had_rope:
    ROPE_INIT_FUNCTIONS["default"] = _default_rope
  sys.path.insert(0, tmp)
  try:
    yield (importlib.import_module("llada2_published.configuration_llada2_moe"),
           importlib.import_module("llada2_published.modeling_llada2_moe"))
  finally:
    sys.path.remove(tmp)
    for name in list(sys.modules):
      if name.startswith("llada2_published"):
        del sys.modules[name]
    if not had_fx:
      del import_utils.is_torch_fx_available
    if not had_rope:
      del ROPE_INIT_FUNCTIONS["default"]
    shutil.rmtree(tmp)


def published_model(modules, tensors: dict):
  """LLaDA2MoeModelLM of CONFIG with `tensors` loaded strictly (every published name and
  shape, the expert bias buffer included), eval mode, SDPA attention."""
  configuration, modeling = modules
  keys = {k: v for k, v in CONFIG.items() if k not in ("architectures", "auto_map",
                                                       "model_type")}
  config = configuration.LLaDA2MoeConfig(**keys)
  config._attn_implementation = "sdpa"
  model = modeling.LLaDA2MoeModelLM(config).eval()
  state = {k: torch.from_numpy(v) for k, v in tensors.items()}
  model.load_state_dict(state, strict=True)
  assert set(model.state_dict()) == set(tensors)
  return model, modeling


# --- decision margins, the network's routing included --------------------------------------

ACTIVE: list = []  # the Margins that routing decisions are written to (none: not checked)


def _routing_hook(gate, args):
  """Records the margins of LLaDA2MoeGate's choices for every token of the call: the
  topk_group cut of the group scores and the top_k cut of the group-masked scores."""
  if not ACTIVE:
    return
  margins = ACTIVE[-1]
  x = args[0].reshape(-1, args[0].shape[-1]).float()
  scores = torch.sigmoid(F.linear(x, gate.weight.float())) + gate.expert_bias
  grouped = scores.view(len(x), gate.n_group, -1)
  group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
  for t in range(len(x)):
    margins.cut(group_scores[t], gate.topk_group, "routing: group cut")
    kept = torch.zeros(gate.n_group, dtype=torch.bool)
    kept[group_scores[t].topk(gate.topk_group).indices] = True
    masked = torch.where(kept.repeat_interleave(gate.num_experts // gate.n_group),
                         scores[t], -torch.inf)
    margins.cut(masked, gate.top_k, "routing: expert cut")


def add_routing_hooks(model, modeling):
  for module in model.modules():
    if isinstance(module, modeling.LLaDA2MoeGate):
      module.register_forward_pre_hook(_routing_hook)


@contextlib.contextmanager
def checking(margins):
  ACTIVE.append(margins)
  try:
    yield margins
  finally:
    ACTIVE.pop()


# --- reference forwards ---------------------------------------------------------------------


def block_mask(positions_BxL: torch.Tensor, valid_BxL: torch.Tensor, block: int,
               query_positions_BxQ=None, query_index_BxQ=None) -> torch.Tensor:
  """B x 1 x Q x L additive float32 mask: a valid key at a block no later than the query's;
  a padded query sees itself only (so no row of the softmax is empty)."""
  q_pos = positions_BxL if query_positions_BxQ is None else query_positions_BxQ
  allowed = (positions_BxL[:, None, :] // block <= q_pos[:, :, None] // block) \
      & valid_BxL[:, None, :]
  if query_index_BxQ is None:
    query_index_BxQ = torch.arange(positions_BxL.shape[1]).expand_as(q_pos)
  own = query_index_BxQ[:, :, None] == torch.arange(positions_BxL.shape[1])[None, None, :]
  q_valid = torch.gather(valid_BxL, 1, query_index_BxQ)
  allowed = torch.where(q_valid[:, :, None], allowed, own)
  return torch.where(allowed, 0.0, -torch.inf)[:, None]


def counted_positions(valid_BxL: torch.Tensor) -> torch.Tensor:
  return (valid_BxL.long().cumsum(-1) - 1).clamp(min=0)


def forward(model, tokens, mask, position_ids, **kw):
  out = model(tokens, attention_mask=mask, position_ids=position_ids, **kw)
  logits = out.logits.float().clone()
  logits[..., MASK_ID] = -torch.inf
  return logits, out


LOGITS_LEN, LOGITS_PAD, CACHED_FROM = 24, 3, 16


def logits_batch(seed: int):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, len(common.CHARS), (2, LOGITS_LEN))
  tokens[rng.random((2, LOGITS_LEN)) < 0.4] = MASK_ID
  valid = np.ones((2, LOGITS_LEN), bool)
  valid[0, :LOGITS_PAD] = False
  tokens[~valid] = EOS_ID
  return torch.from_numpy(tokens), torch.from_numpy(valid)


def reference_logits(model, seed: int, checks: dict) -> dict:
  """reference.npz's arrays from the first seed whose routing clears the margin."""
  from transformers.cache_utils import DynamicCache
  for s in range(seed, seed + 200):
    tokens, valid = logits_batch(s)
    pos = counted_positions(valid)
    with checking(common.Margins()) as margins:
      full, _ = forward(model, tokens, block_mask(pos, valid, BLOCK), pos)
      # The cached pass over row 1 (no padding: index 16 starts its third block).
      w, row = CACHED_FROM, slice(1, 2)
      _, pre = forward(model, tokens[row, :w], block_mask(pos[row, :w], valid[row, :w], BLOCK),
                       pos[row, :w], past_key_values=DynamicCache(), use_cache=True)
      cached_mask = block_mask(pos[row], valid[row], BLOCK, pos[row, w:],
                               torch.arange(w, LOGITS_LEN)[None])
      cached, _ = forward(model, tokens[row, w:], cached_mask, pos[row, w:],
                          past_key_values=pre.past_key_values, use_cache=True)
    if margins.min <= MARGIN:
      continue
    bidirectional, _ = forward(model, tokens, torch.where(valid, 0.0, -torch.inf)[:, None, None]
                               .expand(-1, 1, LOGITS_LEN, -1).clone(), pos)
    checks["cached pass vs the full pass, max |diff|"] = float(
        (cached - full[row, w:]).abs()[torch.isfinite(cached)].max())
    checks["block-causal vs bidirectional logits, max |diff| (the mask matters)"] = float(
        (bidirectional - full)[:, :w].abs()[torch.isfinite(full[:, :w])].max())
    checks["logits batch: seed, min routing margin"] = f"{s}, {margins.min:.3g}"
    logits = full.numpy().astype(np.float32)
    logits[~valid.numpy()] = np.nan
    return {"tokens_BxL": tokens.numpy().astype(np.int32), "valid_BxL": valid.numpy(),
            "block_size": np.int32(BLOCK), "logits_BxLxV": logits, "cached_from": np.int32(w),
            "cached_row": np.int32(1), "cached_logits_BxWxV": cached.numpy().astype(np.float32)}
  raise RuntimeError("no logits batch seed clears the routing margin")


# --- LLaDA2MoeModelLM.generate, transcribed ------------------------------------------------


def get_num_transfer_tokens(block_length, steps):
  if steps == 0:
    return torch.tensor([], dtype=torch.int64)
  base = block_length // steps
  remainder = block_length % steps
  num_transfer_tokens = torch.full((steps,), base, dtype=torch.int64)
  num_transfer_tokens[:remainder] += 1
  return num_transfer_tokens


def sample_greedy(logits):
  """The temperature-0 branch of `_sample_with_temperature_topk_topp` (Megatron-Bridge's
  copy): the argmax and its probability under the plain softmax."""
  probs = F.softmax(logits, dim=-1)
  token = logits.argmax(dim=-1, keepdim=True)
  return token.squeeze(-1), probs.gather(-1, token).squeeze(-1)


def llada2_generate(model, inputs, *, temperature=0.0, block_length=32, steps=32,
                    gen_length=2048, minimal_topk=1, threshold=0.95, eos_id=EOS_ID,
                    mask_id=MASK_ID, margins=None, branches=None):
  """LLaDA2MoeModelLM.generate (module docstring's deviations); returns the generated ids
  (1 x T, up to and including the first EOS), as the published one does."""
  assert temperature == 0.0
  steps = min(steps, gen_length // minimal_topk)
  prompt_length = inputs.shape[1]
  num_blocks = (prompt_length + gen_length + block_length - 1) // block_length
  total_length = num_blocks * block_length
  block_mask_ = torch.tril(torch.ones(num_blocks, num_blocks))
  attention = (block_mask_.repeat_interleave(block_length, dim=0)
               .repeat_interleave(block_length, dim=1).unsqueeze(0).unsqueeze(0)).log()
  position_ids = torch.arange(total_length).unsqueeze(0)
  x = torch.full((1, total_length), mask_id, dtype=torch.long)
  x[:, :prompt_length] = inputs.clone()
  prefill_blocks = prompt_length // block_length
  schedule = get_num_transfer_tokens(block_length, steps)
  for num_block in range(prefill_blocks, num_blocks):
    end = (num_block + 1) * block_length
    cur_x = x[:, :end]
    for step in range(steps):
      active = cur_x[:, -block_length:] == mask_id
      if active.sum() == 0:
        break
      logits, _ = forward(model, cur_x, attention[:, :, :end, :end], position_ids[:, :end])
      active_logits = logits[:, -block_length:, :]
      x0, x0_p = sample_greedy(active_logits)
      num_to_transfer = schedule[step].item()
      transfer = torch.zeros_like(x0, dtype=torch.bool)
      confidence = torch.where(active, x0_p, -torch.inf)
      high = confidence[0] > threshold
      num_high = high.sum().item()
      if margins is not None:
        for c in confidence[0][active[0]].tolist():
          margins.compare(c, threshold, "threshold")
      if num_high >= num_to_transfer:
        transfer[0] = high
        if branches is not None:
          branches["threshold"] = branches.get("threshold", 0) + 1
      else:
        k = min(num_to_transfer, active.sum().item())
        _, idx = torch.topk(confidence[0], k=k)
        transfer[0, idx] = True
        if margins is not None:
          margins.cut(confidence[0], k, "top-k cut")
        if branches is not None:
          branches["top-k"] = branches.get("top-k", 0) + 1
      if margins is not None:
        margins.argmax(active_logits[0][transfer[0]], "argmax")
      if transfer.any():
        cur_x[:, -block_length:][transfer] = x0[transfer]
    x[:, :end] = cur_x
    if eos_id is not None and (x[0, prompt_length:end] == eos_id).any():
      break
  generated = x[:, :prompt_length + gen_length]
  eos_at = (generated[0][prompt_length:] == eos_id).nonzero(as_tuple=True)[0]
  first = eos_at[0].item() if len(eos_at) else gen_length
  return generated[:, prompt_length:prompt_length + first + 1]


# --- cases ----------------------------------------------------------------------------------

# name: (the generate arguments (mdjax's sampler knobs), one (prompt length, requirement) per
# row). The published loop runs one row at a time; mdjax runs a case's rows as one
# left-padded batch, which must give each row its own tokens.
CASES = {
    # threshold and top-k steps both taken; prompts ending inside a block (6 % 8, 5 % 8);
    # row 1 writes an EOS: its loop stops after that block, its output ends at the EOS
    "threshold": ({"gen_length": 16, "block_length": BLOCK, "steps": 8, "threshold": 0.5},
                  [(6, "both branches"), (5, "eos")]),
    # threshold 1.0: never above, the plain schedule (2 a step); steps capped by
    # gen_length // minimal_topk = 16 // 4; prompt 11 = one block + 3, prompt 8 = one block
    "schedule": ({"gen_length": 16, "block_length": BLOCK, "steps": 16, "minimal_topk": 4,
                  "threshold": 1.0}, [(11, "top-k only"), (8, "top-k only")]),
    # the published defaults: blocks of 32, 32 steps, threshold 0.95
    "defaults": ({"gen_length": 40, "block_length": 32, "steps": 32, "threshold": 0.95},
                 [(7, ""), (13, "")]),
}


def make_row(kwargs: dict, prompt_len: int, must: str, model, base_seed: int,
             tries: int = 300) -> dict:
  for seed in range(base_seed, base_seed + tries):
    rng = np.random.default_rng(seed)
    prompt = torch.from_numpy(rng.integers(0, len(common.CHARS), (1, prompt_len)))
    branches = {}
    with checking(common.Margins()) as margins:
      out = llada2_generate(model, prompt, margins=margins, branches=branches, **kwargs)
    if margins.min <= MARGIN:
      continue
    if must == "both branches" and len(branches) < 2:
      continue
    if must == "top-k only" and set(branches) != {"top-k"}:
      continue
    if (EOS_ID in out[0].tolist()) != (must == "eos"):
      continue  # an EOS where asked for, full-length outputs elsewhere
    return {"seed": seed, "min_margin": float(f"{margins.min:.3g}"), "branches": branches,
            "prompt": prompt[0].tolist(), "generated": out[0].tolist()}
  raise RuntimeError(f"no seed in [{base_seed}, {base_seed + tries}) gives a row of "
                     f"{kwargs} with {must!r}")


# --- the published loop on another checkpoint (mdjax/bench/families.py) ---------------------

BENCH_SOURCE = ("/work/.mirror/yks23+Information-Gain-Sampler/repo@"
                "f1cb636fcd5666afa1c16c4cb12944ecb614eaf2:dllm/dllm/pipelines/llada2/models")


def bench_loop(folder, source: str = BENCH_SOURCE):
  """`llada2_generate` (the fixtures' transcription of LLaDA2MoeModelLM.generate, greedy) on
  the LLaDA2MoeModelLM in `folder` (`mdjax.io.save`'s layout, loaded strictly), as
  (prompt_BxP numpy, new) -> (new tokens B x new numpy, forward calls). The knobs are mdjax's
  default plan: block_length config.json's block_size, steps 32, threshold 0.95,
  minimal_topk 1, config.json's EOS. The loop takes batch 1: the rows run one by one (their
  calls summed); a row that stopped is padded with EOS after it. `forward` sets the module's
  MASK_ID column to -inf: it is this checkpoint's mask id while a run lasts."""
  folder = pathlib.Path(folder)
  raw = json.loads((folder / "config.json").read_text())
  mask_id, eos_id, block = raw["mask_token_id"], raw["eos_token_id"], raw["block_size"]
  with published_modules(source) as (configuration, modeling):
    keys = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "model_type")}
    config = configuration.LLaDA2MoeConfig(**keys)
    config._attn_implementation = "sdpa"
    model = modeling.LLaDA2MoeModelLM(config).eval()
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
      state.update(safetensors.torch.load_file(str(file)))
    model.load_state_dict(state, strict=True)
  calls = [0]
  model.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))

  def run(prompt_BxP: np.ndarray, new: int):
    global MASK_ID
    calls[0] = 0
    rows = np.full((len(prompt_BxP), new), eos_id, np.int32)
    saved, MASK_ID = MASK_ID, mask_id
    try:
      with torch.no_grad():
        for i, prompt in enumerate(np.asarray(prompt_BxP)):
          out = llada2_generate(model, torch.from_numpy(prompt[None].astype(np.int64)),
                                temperature=0.0, block_length=block, steps=32, gen_length=new,
                                minimal_topk=1, threshold=0.95, eos_id=eos_id, mask_id=mask_id)
          rows[i, :out.shape[1]] = out[0, :new].numpy()
    finally:
      MASK_ID = saved
    return rows, calls[0]

  return run


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--source", required=True,
                      help="a folder with the published modeling files, or GITDIR@REV:SUBDIR")
  parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
  args = parser.parse_args(argv)
  out = common.fresh_output(args.out)

  tensors = weights(0)
  write_checkpoint(out, tensors)
  check_tokenizer(out)
  checks = {}
  with published_modules(args.source) as modules:
    model, modeling = published_model(modules, tensors)
    add_routing_hooks(model, modeling)
    with torch.no_grad():
      common.save_npz(out / "reference.npz", reference_logits(model, 21, checks))
      cases = []
      for index, (name, (kwargs, rows)) in enumerate(CASES.items()):
        case = {"name": name, "kwargs": dict(kwargs, temperature=0.0), "rows": [
            make_row(kwargs, prompt_len, must, model, base_seed=100 * (index + 1) + 1000 * r)
            for r, (prompt_len, must) in enumerate(rows)]}
        cases.append(case)
        for row in case["rows"]:
          print(f"{name}: seed {row['seed']}, min margin {row['min_margin']:.3g}, branches "
                f"{row['branches']}, output {row['generated']}")
  text = json.dumps(cases, indent=1)
  text = re.sub(r"\[\s*((?:-?\d+,\s*)*-?\d+)\s*\]",
                lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)
  (out / "generations.json").write_text(text + "\n")
  for what, value in checks.items():
    print(f"{what}: {value if isinstance(value, str) else f'{value:.2g}'}")


if __name__ == "__main__":
  main()
