"""Regenerates the causal-judge fixtures in tests/fixtures/judge/.

  pip install -e '.[reference]'
  python -m tests.reference.judge [--out tests/fixtures/judge]

Every file is rebuilt from fixed seeds; nothing is downloaded. What it writes:

  llama/   a tiny random LlamaForCausalLM folder (config.json as transformers writes it,
           model.safetensors, untied head, 4 heads over 2 key/value heads, Llama 3.1's
           "llama3" RoPE scaling: with 8 frequencies against an original length of 32, one
           is kept, one interpolated and six slowed down) with the char-level
           tokenizer of tests/fixtures/pretrained/ (ids 0..95 printable ASCII and newline)
           whose post-processor puts <|startoftext|> (the config's bos_token_id) first, as
           Llama's tokenizers put <s>.
  qwen2/   a tiny random Qwen2ForCausalLM folder: q/k/v biases, tie_word_embeddings true (no
           lm_head tensor, as the small Qwen2 checkpoints), and a byte-level BPE tokenizer
           (256 bytes, merges learnt from TRAIN_TEXT, <|endoftext|>) that adds no BOS, as
           Qwen2's; bos_token_id = eos_token_id = <|endoftext|>, as Qwen2.5's base config.
  reference.npz   per family a 2 x 16 batch of ids and transformers' float32 logits
           (LlamaForCausalLM / Qwen2ForCausalLM as published: causal, eager attention), and
           for each text of TEXTS the per-sample NLL in nats per token under the rule of
           `mdjax.evaluate.generative_perplexity` (written out again here in torch):
           the judge's tokenizer without special tokens, the config's bos_token_id first and
           never scored, windows of MAX_LENGTH inputs that score the next token at each
           position, a later window starting STRIDE targets on so that each token is scored
           once with at least MAX_LENGTH - STRIDE tokens before it.
  texts.json      TEXTS, MAX_LENGTH, STRIDE and the token counts per family.

The weights are spread as the diffusion fixtures' (embedding std 1, sharp attention) so that
logits are far from uniform and a wrong mask or position shows.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

if __package__ in (None, ""):  # run as a script: tests/reference/ lies two below the root
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from tests.reference import pretrained as ref  # exits without the [reference] extra

torch, transformers, safetensors = ref.torch, ref.transformers, ref.safetensors

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "judge"

MAX_LENGTH, STRIDE = 16, 8
TEXTS = [
    "To be, or not to be: that is the question.",
    "Hello, world!",
    "Now is the winter of our discontent\nMade glorious summer by this sun of York;",
    "a",
]
# The Qwen2 fixture's BPE merges are learnt from this text (their order is its counts').
TRAIN_TEXT = (
    "All the world's a stage, and all the men and women merely players; they have their "
    "exits and their entrances, and one man in his time plays many parts. To be, or not to "
    "be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
    "arrows of outrageous fortune. Now is the winter of our discontent made glorious summer.")
BPE_VOCAB = 300
BPE_EOS = "<|endoftext|>"

LLAMA_CONFIG = dict(
    vocab_size=ref.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 32},
    max_position_embeddings=64, tie_word_embeddings=False, attention_bias=False,
    mlp_bias=False, bos_token_id=ref.BOS_ID, eos_token_id=ref.EOS_ID, pad_token_id=ref.EOS_ID)
QWEN2_CONFIG = dict(
    vocab_size=BPE_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    max_position_embeddings=64, tie_word_embeddings=True, use_sliding_window=False)


def llama_tokenizer():
  """The diffusion fixtures' char-level tokenizer, with BOS put first by its post-processor."""
  from tokenizers import processors
  tok = ref.build_tokenizer()
  bos = ref.SPECIALS[ref.BOS_ID]
  tok.post_processor = processors.TemplateProcessing(
      single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ref.BOS_ID)])
  return tok


def qwen2_tokenizer():
  """Byte-level BPE of BPE_VOCAB ids (the 256 bytes, merges from TRAIN_TEXT, then EOS)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB - 1, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator([TRAIN_TEXT], trainer)
  tok.add_special_tokens([BPE_EOS])
  assert tok.get_vocab_size() == BPE_VOCAB, tok.get_vocab_size()
  return tok


def weights(config: dict, seed: int, bias: bool) -> dict[str, np.ndarray]:
  """Random tensors by transformers' Llama / Qwen2 names (torch Linear [out, in])."""
  d, f, n = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
  v = config["vocab_size"]
  kv = config["num_key_value_heads"] * (d // config["num_attention_heads"])
  rng = np.random.default_rng(seed)
  out = {"model.embed_tokens.weight": ref._normal(rng, (v, d), ref.EMBED_STD)}
  for i in range(n):
    b = f"model.layers.{i}"
    out[f"{b}.input_layernorm.weight"] = ref._norm_weight(rng, d)
    for p, width, scale in (("q", d, ref.QK_SCALE), ("k", kv, ref.QK_SCALE),
                            ("v", kv, ref.VO_SCALE)):
      out[f"{b}.self_attn.{p}_proj.weight"] = ref._linear(rng, width, d, scale)
      if bias:
        out[f"{b}.self_attn.{p}_proj.bias"] = ref._normal(rng, (width,), ref.BIAS_STD)
    out[f"{b}.self_attn.o_proj.weight"] = ref._linear(rng, d, d, ref.VO_SCALE)
    out[f"{b}.post_attention_layernorm.weight"] = ref._norm_weight(rng, d)
    out[f"{b}.mlp.gate_proj.weight"] = ref._linear(rng, f, d)
    out[f"{b}.mlp.up_proj.weight"] = ref._linear(rng, f, d)
    out[f"{b}.mlp.down_proj.weight"] = ref._linear(rng, d, f)
  out["model.norm.weight"] = ref._norm_weight(rng, d)
  if not config["tie_word_embeddings"]:
    out["lm_head.weight"] = ref._normal(rng, (v, d), ref.HEAD_STD)
  else:  # a tied head reads the embedding: scaled down so logits stay as spread as untied
    out["model.embed_tokens.weight"] *= np.float32(ref.HEAD_STD)
  return out


def build(folder: pathlib.Path, cls, config_cls, config: dict, tensors: dict, tokenizer,
          special_tokens: dict):
  """Writes the folder with transformers' own save_pretrained and returns the model."""
  hf_config = config_cls(**config)
  hf_config._attn_implementation = "eager"
  model = cls(hf_config).eval()
  state = {k: torch.from_numpy(v) for k, v in tensors.items()}
  if config["tie_word_embeddings"]:
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
  model.load_state_dict(state, strict=True)
  model.save_pretrained(str(folder), safe_serialization=True)
  tokenizer.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps(
      {"clean_up_tokenization_spaces": False, "model_max_length": config[
          "max_position_embeddings"], "tokenizer_class": "PreTrainedTokenizerFast",
       **special_tokens}, indent=2, sort_keys=True) + "\n")
  stored = safetensors.torch.load_file(str(folder / "model.safetensors"))
  assert ("lm_head.weight" in stored) != config["tie_word_embeddings"], sorted(stored)
  return model


def text_ids(folder: pathlib.Path, text: str, bos_id: int | None) -> list[int]:
  """The text through transformers' fast tokenizer of the folder: Llama's adds its BOS
  itself; for Qwen2 (no BOS added) the config's bos_token_id is put first."""
  tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
  ids = tok(text)["input_ids"]
  if ids[:1] != [bos_id]:
    ids = [bos_id] + ids
  assert tok.decode(ids[1:]) == text, (tok.decode(ids[1:]), text)
  return ids


@torch.no_grad()
def windowed_nll(model, ids: list[int]) -> tuple[float, int]:
  """(total NLL in nats, tokens scored) of ids[1:] under windows of MAX_LENGTH inputs."""
  x = torch.tensor(ids)
  n = len(ids) - 1  # targets 1..n
  total, scored, end = 0.0, 0, 0
  while end < n:
    new_end = min(n, MAX_LENGTH if end == 0 else end + STRIDE)
    start = max(0, new_end - MAX_LENGTH)
    logits = model(input_ids=x[None, start:new_end]).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    for t in range(end + 1, new_end + 1):  # target t is predicted at input position t - 1
      total -= float(logp[t - 1 - start, x[t]])
      scored += 1
    end = new_end
  assert scored == n
  return total, scored


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
  args = parser.parse_args(argv)
  out = ref.fresh_output(args.out)
  qwen_tok = qwen2_tokenizer()
  eos = qwen_tok.token_to_id(BPE_EOS)
  qwen_config = dict(QWEN2_CONFIG, bos_token_id=eos, eos_token_id=eos)
  families = {
      "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, LLAMA_CONFIG,
                weights(LLAMA_CONFIG, 21, bias=False), llama_tokenizer(),
                {"bos_token": ref.SPECIALS[ref.BOS_ID], "eos_token": ref.SPECIALS[ref.EOS_ID],
                 "unk_token": ref.UNK}, ref.BOS_ID),
      "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, qwen_config,
                weights(qwen_config, 22, bias=True), qwen_tok,
                {"eos_token": BPE_EOS, "pad_token": BPE_EOS}, eos),
  }
  arrays, meta = {}, {"texts": TEXTS, "max_length": MAX_LENGTH, "stride": STRIDE}
  for family, (cls, config_cls, config, tensors, tok, specials, bos) in families.items():
    folder = out / family
    model = build(folder, cls, config_cls, config, tensors, tok, specials)
    rng = np.random.default_rng(31 if family == "llama" else 32)
    high = len(ref.CHARS) if family == "llama" else BPE_VOCAB
    tokens = rng.integers(0, high, (2, 16))
    with torch.no_grad():
      logits = model(input_ids=torch.from_numpy(tokens)).logits.float().numpy()
    arrays[f"{family}_tokens"] = tokens.astype(np.int32)
    arrays[f"{family}_logits"] = logits
    nll, counts = [], []
    for text in TEXTS:
      ids = text_ids(folder, text, bos)
      total, scored = windowed_nll(model, ids)
      nll.append(total / scored)
      counts.append(scored)
    arrays[f"{family}_nll_per_token"] = np.array(nll)
    meta[f"{family}_tokens_per_text"] = counts
    print(f"{family}: {sum(v.size for v in tensors.values()):,} parameters; logits std "
          f"{logits.std():.2f}; NLL/token {np.round(nll, 4).tolist()} over {counts} tokens")
  ref.save_npz(out / "reference.npz", arrays)
  (out / "texts.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
  main()
