"""Generative perplexity: samples decoded to text, retokenized by a causal judge, scored by it.

The measure of MDLM, BD3-LM and ReMDM: a sampler's texts are encoded with the judge's own
tokenizer (whatever tokenizer produced them), scored by the judge's next-token NLL, and
reported as the corpus perplexity exp(total NLL / total tokens). Beside it, the unigram
entropy of each sample's tokens: a degenerate sampler (one word repeated) scores a low
perplexity and a low entropy, so the two are read together.

A judge is a loaded causal checkpoint (`mdjax.io.load` of a LlamaForCausalLM or
Qwen2ForCausalLM folder: families "llama", "qwen2"), a mdjax workdir trained with
objective "causal" (its task's tokenizer), or a `Judge` built by hand.

  python -m mdjax.evaluate.gen_ppl --judge=DIR --samples=FILE [--max_length=N] [--stride=S]

How a text is scored (`generative_perplexity`):
  * ids = the judge's tokenizer on the text, no special tokens added; an id the tokenizer
    gives for what it cannot encode (its unknown token), or a character outside a mdjax
    task's vocabulary, is a ValueError naming the sample's index.
  * The judge's start token goes first and is context only: config.json's bos_token_id
    (Llama's <s>; GPT-2's and Qwen2's <|endoftext|>), a mdjax causal model's start id (the
    mask id). A judge without one scores from the text's second token on. With `eos=True`
    the judge's EOS follows the text and is scored too.
  * Texts longer than `max_length` are scored in windows: a window is `max_length` inputs
    whose outputs predict the next token at each position; the first window scores targets
    1..max_length, each later one the next `stride` targets, starting where they leave
    max_length inputs before its last. Every token is scored exactly once, with at least
    max_length - stride + 1 tokens before it (all of them in the first window); stride =
    max_length gives disjoint chunks.
  * Entropy: -sum_v p_v log p_v (nats) of the histogram of the sample's judge ids (start
    and EOS excluded), and of the sampler's own ids when they are given.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mdjax import cli, files, jsonl, loader
from mdjax.model import WORKDIR_FAMILY, Model
from mdjax.models.published import CAUSAL_FAMILIES

Array = jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class Judge:
  """A causal LM ready to score texts.

  logits_fn(params, tokens_BxL) -> float32 logits_BxLxV, those at position i predicting the
  token at i + 1. encode(text) -> ids (a ValueError for text it cannot encode). start_id: put
  before every text, never scored (None: none). max_length: the longest window it takes.
  """

  name: str
  logits_fn: Callable
  params: Any
  encode: Callable[[str], Sequence[int]]
  vocab_size: int
  max_length: int
  start_id: int | None = None
  eos_id: int | None = None

  @property
  def window_nll(self):
    """(params, inputs_BxL, targets_BxL, scored_BxL) -> the scored targets' NLL per row."""
    return _window_nll(self.logits_fn)


@functools.lru_cache(maxsize=32)
def _window_nll(logits_fn):
  # One compiled program per logits function (equal functions share it) and shape.

  def fn(params, inputs_BxL, targets_BxL, scored_BxL):
    logp_BxLxV = jax.nn.log_softmax(logits_fn(params, inputs_BxL).astype(jnp.float32))
    logp_BxL = jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    return -jnp.sum(jnp.where(scored_BxL, logp_BxL, 0.0), axis=-1)

  return jax.jit(fn)


@dataclasses.dataclass(frozen=True)
class _DenoiserLogits:
  """A causal model's denoiser(params, tokens_BxL, t_B), t ignored (a published judge's
  and a mdjax causal model's alike)."""

  apply_fn: Any

  def __call__(self, params, tokens_BxL):
    return self.apply_fn(params, tokens_BxL, jnp.zeros(tokens_BxL.shape[:1]))


@dataclasses.dataclass(frozen=True)
class GenPPL:
  """What `generative_perplexity` returns.

  nll_per_token_N: each sample's NLL in nats per scored token. num_tokens_N: tokens scored.
  gen_ppl: exp(sum of NLLs / sum of tokens), the corpus perplexity. entropy_N: each
  sample's unigram entropy (nats) over its judge tokens; sampler_entropy_N over the
  sampler's tokens (None when not given). The means are over samples.
  """

  nll_per_token_N: np.ndarray
  num_tokens_N: np.ndarray
  gen_ppl: float
  entropy_N: np.ndarray
  sampler_entropy_N: np.ndarray | None
  judge: str
  max_length: int
  stride: int

  @property
  def nll_per_token(self) -> float:
    """The corpus NLL per token, log(gen_ppl)."""
    return math.log(self.gen_ppl)

  @property
  def mean_entropy(self) -> float:
    return float(self.entropy_N.mean())

  @property
  def mean_sampler_entropy(self) -> float | None:
    return None if self.sampler_entropy_N is None else float(self.sampler_entropy_N.mean())

  def summary(self) -> dict:
    return {"judge": self.judge, "num_samples": int(len(self.nll_per_token_N)),
            "num_tokens": int(self.num_tokens_N.sum()), "gen_ppl": self.gen_ppl,
            "nll_per_token": self.nll_per_token, "entropy": self.mean_entropy,
            "sampler_entropy": self.mean_sampler_entropy, "max_length": self.max_length,
            "stride": self.stride}


def unigram_entropy(ids) -> float:
  """-sum_v p_v log p_v (nats) of the histogram of `ids` (0 for a single repeated id)."""
  ids = np.asarray(ids).reshape(-1)
  if ids.size == 0:
    raise ValueError("ids is empty: the entropy of no tokens is undefined.")
  _, counts = np.unique(ids, return_counts=True)
  p = counts / counts.sum()
  return float(-(p * np.log(p)).sum())


# --- judges ------------------------------------------------------------------------------


def _hf_encoder(tokenizer, vocab_size: int):
  """encode(text) of a `tokenizers.Tokenizer`: no special tokens; its unknown token (which
  stands for text it cannot encode) is a ValueError."""
  unk = getattr(tokenizer.model, "unk_token", None)
  unk_id = tokenizer.token_to_id(unk) if unk else None

  def encode(text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if unk_id is not None and unk_id in ids:
      at = ids.index(unk_id)
      raise ValueError(f"the judge's tokenizer cannot encode part of the text (token {at} "
                       f"is its unknown token {unk!r})")
    if ids and max(ids) >= vocab_size:
      raise ValueError(f"the judge's tokenizer gives id {max(ids)}, outside its "
                       f"{vocab_size} logits")
    return ids

  return encode


def _first_id(raw: dict, key: str):
  """A config.json id some configs give as a list (the first is the canonical one)."""
  value = raw.get(key)
  value = value[0] if isinstance(value, list) and value else value
  return value if isinstance(value, int) and not isinstance(value, bool) else None


def _published_judge(model: Model) -> Judge:
  """A published causal checkpoint (families "llama", "qwen2")."""
  if not model.causal:
    raise ValueError(f"judge is a {model.family!r} checkpoint, not a causal LM (families "
                     f"{CAUSAL_FAMILIES}).")
  if model.tokenizer is None:
    raise ValueError(f"judge {model.source!r} has no tokenizer.json: texts cannot be "
                     "retokenized.")
  return Judge(name=f"{model.family}:{os.path.basename(model.source or '')}",
               logits_fn=_DenoiserLogits(model.denoiser), params=model.params,
               encode=_hf_encoder(model.tokenizer, model.vocab_size),
               vocab_size=model.vocab_size, max_length=model.max_len,
               start_id=_first_id(model.hf_config or {}, "bos_token_id"), eos_id=model.eos_id)


def _workdir_judge(model: Model) -> Judge:
  """A mdjax model trained with objective "causal" (`mdjax.load` of its workdir)."""
  objective = model.config.get("objective")
  if objective != "causal":
    raise ValueError(f"judge {model.workdir!r} was trained with objective={objective!r}, not "
                     "'causal': it is not a left-to-right LM.")
  task = model.task
  if task.tokenizer is None:
    raise ValueError(f"judge {model.workdir!r}: task {task.name!r} has no tokenizer.")

  # causal_lm_loss's convention: the mask id (outside the data's ids) starts every window.
  return Judge(name=f"mdjax:{os.path.basename(os.path.normpath(model.workdir))}",
               logits_fn=_DenoiserLogits(model.denoiser), params=model.params,
               encode=lambda text: task.encode(text).tolist(), vocab_size=task.mask_id + 1,
               max_length=task.length, start_id=task.mask_id, eos_id=task.eos_id)


def load_judge(judge) -> Judge:
  """A `Judge` from a Judge, a `mdjax.Model` (a causal published checkpoint, or a workdir
  trained with objective "causal"), or a path `mdjax.load` reads."""
  if isinstance(judge, Judge):
    return judge
  if isinstance(judge, (str, os.PathLike)):
    path = os.fspath(judge)
    if loader.kind_of(path) == "oracle":
      raise ValueError(f"judge={path!r} is a task's exact denoiser, not a causal LM.")
    judge = loader.load(path)
  if isinstance(judge, Model):
    return _workdir_judge(judge) if judge.family == WORKDIR_FAMILY else _published_judge(judge)
  raise ValueError(f"judge is a {type(judge).__name__}: pass a causal mdjax.Model, a mdjax "
                   "workdir trained with objective 'causal', a folder, or a Judge.")


# --- scoring ------------------------------------------------------------------------------


def _windows(n: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
  """(input start a, first target, last target) of the windows over targets 1..n of a
  sequence of n + 1 tokens (module docstring): inputs [a, a + max_length)."""
  out, end = [], 0
  while end < n:
    new_end = min(n, max_length if end == 0 else end + stride)
    out.append((max(0, new_end - max_length), end + 1, new_end))
    end = new_end
  return out


def _check_int(name: str, value, low: int, high: int | None = None):
  from mdjax.models.checks import is_int
  if not (is_int(value) and value >= low and (high is None or value <= high)):
    raise ValueError(f"{name}={value!r} must be an integer in [{low}, "
                     f"{'inf' if high is None else high}].")


def generative_perplexity(texts: Sequence[str], judge, *, batch_size: int = 16,
                          max_length: int | None = None, stride: int | None = None,
                          sampler_tokens: Sequence[Sequence[int]] | None = None,
                          eos: bool = False) -> GenPPL:
  """Scores `texts` under a causal `judge` (see the module docstring for the rules).

  judge: anything `load_judge` takes. batch_size: windows per forward pass. max_length:
  inputs per window (default and maximum: the judge's). stride: targets a later window adds
  (default max_length // 2, at most max_length). sampler_tokens: each text's ids in the
  sampler's vocabulary, for its entropy. eos: append the judge's EOS and score it.
  """
  if isinstance(texts, str) or not isinstance(texts, Sequence) or not len(texts):
    raise ValueError(f"texts={texts!r:.80} must be a non-empty sequence of strings.")
  for i, text in enumerate(texts):
    if not isinstance(text, str):
      raise ValueError(f"texts[{i}] is a {type(text).__name__}, not a string.")
  _check_int("batch_size", batch_size, 1)
  judge = load_judge(judge)
  max_length = judge.max_length if max_length is None else max_length
  _check_int("max_length", max_length, 1, judge.max_length)
  stride = max(1, max_length // 2) if stride is None else stride
  _check_int("stride", stride, 1, max_length)
  if eos and judge.eos_id is None:
    raise ValueError(f"eos=True but judge {judge.name!r} has no EOS id.")
  if sampler_tokens is not None and len(sampler_tokens) != len(texts):
    raise ValueError(f"sampler_tokens has {len(sampler_tokens)} rows for {len(texts)} texts.")

  sequences, entropy = [], []
  for i, text in enumerate(texts):
    try:
      ids = [int(t) for t in judge.encode(text)]
    except ValueError as error:
      raise ValueError(f"texts[{i}]: {error}") from None
    if not ids:
      raise ValueError(f"texts[{i}] is empty under the judge's tokenizer: nothing to score.")
    entropy.append(unigram_entropy(ids))
    seq = ([judge.start_id] if judge.start_id is not None else []) + ids
    seq += [judge.eos_id] if eos else []
    if len(seq) < 2:
      raise ValueError(f"texts[{i}] is one token and judge {judge.name!r} has no start "
                       "token: nothing to score.")
    sequences.append(np.asarray(seq, np.int32))
  sampler_entropy = None
  if sampler_tokens is not None:
    sampler_entropy = []
    for i, row in enumerate(sampler_tokens):
      if len(row) == 0:
        raise ValueError(f"sampler_tokens[{i}] is empty.")
      sampler_entropy.append(unigram_entropy(row))

  rows = []  # (sample, inputs, targets, scored)
  for i, seq in enumerate(sequences):
    for start, first, last in _windows(len(seq) - 1, max_length, stride):
      inputs = seq[start:start + max_length]
      targets = seq[start + 1:start + 1 + max_length]
      scored = np.arange(start + 1, start + 1 + len(targets)) >= first
      rows.append((i, inputs, targets, scored))
  width = max(len(r[1]) for r in rows)  # shorter rows are padded on the right: causal
  total = -(-len(rows) // batch_size) * batch_size
  inputs_RxL = np.zeros((total, width), np.int32)
  targets_RxL = np.zeros((total, width), np.int32)
  scored_RxL = np.zeros((total, width), bool)
  for r, (_, inputs, targets, scored) in enumerate(rows):
    inputs_RxL[r, :len(inputs)] = inputs
    targets_RxL[r, :len(targets)] = targets
    scored_RxL[r, :len(targets)] = scored
  nll_R = np.concatenate([
      np.asarray(judge.window_nll(judge.params, inputs_RxL[b:b + batch_size],
                                  targets_RxL[b:b + batch_size], scored_RxL[b:b + batch_size]),
                 np.float64) for b in range(0, total, batch_size)])
  sample_R = np.array([r[0] for r in rows])
  nll_N = np.bincount(sample_R, weights=nll_R[:len(rows)], minlength=len(texts))
  tokens_N = np.array([len(s) - 1 for s in sequences])
  return GenPPL(nll_per_token_N=nll_N / tokens_N, num_tokens_N=tokens_N,
                gen_ppl=float(math.exp(nll_N.sum() / tokens_N.sum())),
                entropy_N=np.array(entropy),
                sampler_entropy_N=None if sampler_entropy is None else np.array(sampler_entropy),
                judge=judge.name, max_length=max_length, stride=stride)


# --- the command line ----------------------------------------------------------------------

TEXT_KEYS = ("text", "completion")  # sample.py's samples.jsonl and completions.jsonl
TOKEN_KEYS = ("tokens", "token_ids")
SAMPLE_FILES = ("samples.jsonl", "completions.jsonl")


def read_samples(path: str) -> tuple[list[str], list[list[int]] | None]:
  """(texts, sampler tokens or None) of a .jsonl file of {"text": ...} (or sample.py's
  {"completion": ...}) lines, optionally with "tokens" / "token_ids", or of sample.py's
  --out folder (its samples.jsonl or completions.jsonl)."""
  path = os.fspath(path)
  if os.path.isdir(path):
    found = [n for n in SAMPLE_FILES if os.path.isfile(os.path.join(path, n))]
    if not found:
      raise ValueError(f"samples={path!r}: a folder without {' or '.join(SAMPLE_FILES)}.")
    path = os.path.join(path, found[0])
  if not path.endswith(".jsonl") or not os.path.isfile(path):
    raise ValueError(f"samples={path!r} must be a .jsonl file or sample.py's --out folder.")
  texts, tokens = [], []
  for n, row in jsonl.read_rows(path, "samples"):
    key = next((k for k in TEXT_KEYS if isinstance(row, dict) and k in row), None)
    if key is None or not isinstance(row[key], str):
      raise ValueError(f"samples={path!r} line {n}: no string field among {TEXT_KEYS}.")
    texts.append(row[key])
    tokens.append(next((row[k] for k in TOKEN_KEYS if k in row), None))
  if not texts:
    raise ValueError(f"samples={path!r} holds no sample.")
  return texts, (tokens if all(t is not None for t in tokens) else None)


def main(argv=None) -> dict:
  parser = cli.Parser(
      "gen_ppl", prog="python -m mdjax.evaluate.gen_ppl",
      description="Generative perplexity of text samples under a causal judge, with the "
                  "samples' unigram entropy.")
  parser.add_argument("--judge", required=True, help="a LlamaForCausalLM / Qwen2ForCausalLM "
                      "folder, or a mdjax workdir trained with objective 'causal'")
  parser.add_argument("--samples", required=True, help="a .jsonl of {'text': ...} lines (and "
                      "optionally 'tokens'), or sample.py's --out folder")
  parser.add_argument("--batch_size", type=int, default=16)
  parser.add_argument("--max_length", type=int, default=None, help="default: the judge's")
  parser.add_argument("--stride", type=int, default=None, help="default: max_length // 2")
  parser.add_argument("--eos", action="store_true", help="append and score the judge's EOS")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
  parser.add_argument("--out", default=None, help="also write per-sample rows (JSON lines; "
                      "'index': the sample's position in --samples)")
  args = parser.parse_args(argv)
  texts, tokens = read_samples(args.samples)
  judge = loader.load(args.judge, dtype=args.dtype)  # dtype= for a published folder only
  result = generative_perplexity(texts, judge, batch_size=args.batch_size,
                                 max_length=args.max_length, stride=args.stride,
                                 sampler_tokens=tokens, eos=args.eos)
  summary = {**result.summary(), "samples": args.samples}
  if args.out:
    with files.atomic_write(args.out, "w") as f:
      for i in range(len(texts)):
        f.write(jsonl.dumps({
            "index": i, "nll_per_token": float(result.nll_per_token_N[i]),
            "num_tokens": int(result.num_tokens_N[i]), "entropy": float(result.entropy_N[i]),
            **({} if result.sampler_entropy_N is None else
               {"sampler_entropy": float(result.sampler_entropy_N[i])})}) + "\n")
  print(jsonl.dumps(summary))
  return summary


if __name__ == "__main__":
  cli.run("gen_ppl", main)  # ValueError: a bad judge, samples file or setting
