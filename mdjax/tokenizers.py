"""Tokenizers: mdjax's own (characters, byte-level BPE) and the Hugging Face tokenizer.json
of a published checkpoint.

`CharTokenizer` maps the sorted characters of a text to ids 0..n-1; `BpeTokenizer` is a
byte-level BPE of the `tokenizers` package with the end-of-document token `EOS_TEXT` among
its ids. Both encode to int32 arrays, decode the mask id (`size`) as `mask_char` (a
character the vocabulary does not hold) and are saved with every checkpoint (`metadata`).
`characters_of` counts the characters ids code, the denominator of bits per character.
Text a tokenizer has no ids for is an `UnencodableText` (a ValueError) naming the character.

`load_hf_tokenizer(folder)` reads a checkpoint folder's tokenizer.json into a
`tokenizers.Tokenizer` (None without one); `tokenizer_failure` tells the library's refusals
of its input (an exception or a Rust panic) from other errors.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Sequence

import numpy as np

from mdjax import files as files_lib

MASK_CHAR = "\u00b7"  # how a still-masked position is shown in decoded text...
# ...unless the corpus holds it: then the first of these it does not hold.
MASK_CHAR_CHOICES = (MASK_CHAR, "\u2591", "\u25a1", "\ufffd", "_", "?", "#", "\x00")
EOS_TEXT = "<|endoftext|>"  # the BPE tokenizer's end-of-document token
# Documents are the pieces of a text between blank lines (one speech of a play); in a
# document stream the EOS id stands where the separator was, so the stream codes the text.
DOCUMENT_SEPARATOR = "\n\n"
TOKENIZER_FILE = "tokenizer.json"  # a Hugging Face folder's tokenizer


# ----------------------------------------------------------------------------
# mdjax's tokenizers.
# ----------------------------------------------------------------------------


class UnencodableText(ValueError):
  """Text holding a character the tokenizer has no id for (and no unknown token)."""


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
  """Characters <-> ids 0..len(vocab)-1 (sorted); with `eos`, the end-of-document id follows
  them (id len(vocab)); the mask id is `size`, shown as `mask_char`."""

  vocab: str
  eos: bool = False

  def __post_init__(self):
    if not self.vocab or len(set(self.vocab)) != len(self.vocab):
      raise ValueError(f"vocab={self.vocab!r} must be a non-empty string of distinct characters.")

  @classmethod
  def from_text(cls, text: str, eos: bool = False) -> "CharTokenizer":
    return cls("".join(sorted(set(text))), eos)

  @functools.cached_property
  def mask_char(self) -> str:
    """How a masked position shows in decoded text: a character outside the vocabulary."""
    return next(c for c in MASK_CHAR_CHOICES + tuple(map(chr, range(0xE000, 0xF900)))
                if c not in self.vocab)

  @property
  def size(self) -> int:
    return len(self.vocab) + int(self.eos)

  @property
  def eos_id(self) -> int | None:
    return len(self.vocab) if self.eos else None

  def metadata(self) -> dict:
    """What a checkpoint keeps of this tokenizer (EOS follows from `documents`)."""
    return {"vocab": self.vocab}

  @functools.cached_property
  def _codepoints(self) -> np.ndarray:
    return np.array([ord(c) for c in self.vocab], np.uint32)

  def encode(self, text: str) -> np.ndarray:
    """Ids of `text` (int32); a character outside the vocabulary is a ValueError."""
    points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)
    order = np.argsort(self._codepoints)
    where = np.searchsorted(self._codepoints[order], points)
    where = np.minimum(where, len(order) - 1)
    known = self._codepoints[order][where] == points
    if not known.all():
      unknown = sorted({text[i] for i in np.flatnonzero(~known)})
      first = int(np.flatnonzero(~known)[0])
      raise UnencodableText(
          f"text holds {len(unknown)} character(s) outside the tokenizer's vocabulary: "
          f"{unknown!r} (first at index {first}); the vocabulary is {self.vocab!r}.")
    return order[where].astype(np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    return [self.encode(t) for t in texts]

  def decode(self, ids) -> str:
    """Text of `ids`; EOS shows as nothing, the mask id (and anything out of range) as
    `mask_char`."""
    n = len(self.vocab)
    return "".join(self.vocab[i] if 0 <= i < n else "" if i == self.eos_id else self.mask_char
                   for i in np.asarray(ids).tolist())


def _bpe_pieces(text: str) -> list[str]:
  # Lines (ends kept): the byte-level pre-tokenizer splits at whitespace anyway, and pieces
  # let `encode_batch` use every core.
  return text.splitlines(keepends=True)


@dataclasses.dataclass(frozen=True, eq=False)
class BpeTokenizer:
  """Byte-level BPE (the `tokenizers` package): any text encodes; ids 0..size-1 with the
  end-of-document token `EOS_TEXT` among them; the mask id is `size`. `spec` is the
  tokenizer's JSON, saved with every checkpoint."""

  spec: str

  def __eq__(self, other):
    return isinstance(other, BpeTokenizer) and other.spec == self.spec

  def __hash__(self):
    return hash(self.spec)

  @classmethod
  def train(cls, text: str, vocab_size: int) -> "BpeTokenizer":
    """Trains on `text` (deterministic for a given text and size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_bpe_pieces(text), trainer=trainer)
    return cls(tok.to_str())

  @functools.cached_property
  def _tok(self):
    from tokenizers import Tokenizer
    return Tokenizer.from_str(self.spec)

  @property
  def size(self) -> int:
    return self._tok.get_vocab_size()

  @property
  def eos_id(self) -> int:
    return self._tok.token_to_id(EOS_TEXT)

  @functools.cached_property
  def mask_char(self) -> str:
    """How a masked position shows: a character no token decodes to."""
    held = set("".join(self._tok.decode([i]) for i in range(self.size)))
    return next(c for c in MASK_CHAR_CHOICES + tuple(map(chr, range(0xE000, 0xF900)))
                if c not in held)

  def metadata(self) -> dict:
    return {"bpe": self.spec}

  def _check(self, text: str) -> None:
    if EOS_TEXT in text:
      raise ValueError(f"text holds the end-of-document marker {EOS_TEXT!r} (first at index "
                       f"{text.index(EOS_TEXT)}); it is a token of its own, not text.")
    try:
      text.encode("utf-8")
    except UnicodeEncodeError as error:
      raise ValueError(f"text holds a character that has no UTF-8 bytes: {error}.") from None

  def encode(self, text: str) -> np.ndarray:
    """Ids of `text` (int32)."""
    self._check(text)
    ids = [i for e in _encode_pieces(self._tok, _bpe_pieces(text)) for i in e.ids]
    return np.asarray(ids, np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    for t in texts:
      self._check(t)
    return [np.asarray(e.ids, np.int32) for e in _encode_pieces(self._tok, list(texts))]

  def encode_many(self, texts: Sequence[str]) -> list[np.ndarray]:
    """`[self.encode(t) for t in texts]`, in one call to the tokenizer (all cores)."""
    for t in texts:
      self._check(t)
    pieces = [_bpe_pieces(t) for t in texts]
    flat = _encode_pieces(self._tok, [p for ps in pieces for p in ps])
    out, at = [], 0
    for ps in pieces:
      out.append(np.asarray([i for e in flat[at:at + len(ps)] for i in e.ids], np.int32))
      at += len(ps)
    return out

  def decode(self, ids) -> str:
    """Text of `ids`; EOS shows as nothing, the mask id (and anything out of range) as
    `mask_char`."""
    out, run = [], []
    for i in np.asarray(ids).tolist():
      if 0 <= i < self.size:
        if i != self.eos_id:
          run.append(i)
      else:
        out += [self._tok.decode(run), self.mask_char]
        run = []
    out.append(self._tok.decode(run))
    return "".join(out)


def _refuses(tok, text: str) -> bool:
  try:
    tok.encode(text, add_special_tokens=False)
  except BaseException as error:  # a Rust panic is a BaseException (PanicException)
    if not tokenizer_failure(error):
      raise
    return True
  return False


def _encode_pieces(tok, pieces: list[str]) -> list:
  """`tok.encode_batch(pieces)` (a `tokenizers.Tokenizer`); text it refuses (a WordLevel
  vocabulary without an unknown token) is an `UnencodableText` naming the first character
  it cannot encode, found by halving the first refused piece (the error path only)."""
  try:
    return tok.encode_batch(pieces, add_special_tokens=False)
  except BaseException as error:
    if not tokenizer_failure(error):
      raise
    why = (str(error).splitlines() or [type(error).__name__])[0][:200]
  for piece in pieces:
    if not _refuses(tok, piece):
      continue
    accepted, refused = 0, len(piece)  # prefix lengths: the shortest refused one ends at it
    while refused - accepted > 1:
      middle = (accepted + refused) // 2
      if _refuses(tok, piece[:middle]):
        refused = middle
      else:
        accepted = middle
    context = piece[max(0, refused - 20):refused + 20]
    raise UnencodableText(f"text holds {piece[refused - 1]!r} (in {context!r}), which the "
                          f"tokenizer has no id for ({why}).")
  raise UnencodableText(f"the tokenizer cannot encode the text ({why}).")


def characters_of(tokenizer, ids) -> int:
  """Characters of the text that `ids` (no mask ids) code, an EOS counting as the document
  separator it replaced: the denominator of bits per character."""
  ids = np.asarray(ids)
  eos = tokenizer.eos_id
  n_eos = int((ids == eos).sum()) if eos is not None else 0
  return len(tokenizer.decode(ids)) + n_eos * len(DOCUMENT_SEPARATOR)


# ----------------------------------------------------------------------------
# A Hugging Face folder's tokenizer.json.
# ----------------------------------------------------------------------------


def tokenizer_failure(e: BaseException) -> bool:
  """Whether `e` is the tokenizers library refusing its input: an Exception, or the Rust
  panic pyo3 raises as PanicException, which derives from BaseException only."""
  return isinstance(e, Exception) or type(e).__name__ == "PanicException"


def load_hf_tokenizer(folder: str):
  """The `tokenizers.Tokenizer` of `folder`'s tokenizer.json, None without one; an
  unreadable file is a ValueError naming it."""
  path = os.path.join(folder, TOKENIZER_FILE)
  if not files_lib.regular_file(path):
    return None
  import tokenizers  # a dependency of mdjax; imported only when a folder has a tokenizer
  # Read here: the library would open a FIFO swapped in for the file, and block.
  text = files_lib.read_text(path)
  try:
    return tokenizers.Tokenizer.from_str(text)
  except BaseException as e:  # its own exception type, or a panic on a malformed section
    if not tokenizer_failure(e):
      raise
    raise ValueError(f"{path}: unreadable tokenizer ({type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''})") from None
