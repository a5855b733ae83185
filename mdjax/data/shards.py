"""Token shards on disk: the folder `python -m mdjax.prepare_data` writes and the pipeline reads.

A prepared corpus is a folder:

  manifest.json          what the folder holds; written last, so a folder without it is unfinished
  tokenizer.json         the tokenizer: a `tokenizers` JSON (BPE, or any HF tokenizer.json), or
                         {"char_vocab": "..."} for characters (the EOS id follows them)
  train-00000.bin ...    token ids, little-endian uint16 (vocabularies up to 65,536 ids) or
                         uint32, every document followed by the EOS id
  train-00000.idx ...    little-endian uint64: where each of the shard's documents starts
  validation-00000.bin, validation-00000.idx ...

`.bin` files are raw arrays read through `np.memmap`: a training window is a slice of the
token stream, found in O(1) and read without decoding records, which is what random access
over windows needs (a window spans documents, so record files such as ArrayRecord would
have to be reassembled). A shard ends at a document boundary; its `.idx` lists its
documents, so a padded window (one document) is one slice too. The manifest records each
file's token and document counts and SHA-256, and the tokenizer's SHA-256.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys
from typing import Sequence

import numpy as np

from mdjax.tasks.text import EOS_TEXT, BpeTokenizer, CharTokenizer

MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT = "mdjax.corpus"
VERSION = 1
SPLITS = ("train", "validation")
ON_CORRUPT = ("stop", "skip")
VERIFY = ("checksum", "size")
# The end-of-document token of a tokenizer.json when none is named: the first it holds.
EOS_CANDIDATES = (EOS_TEXT, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")


class CorruptShard(ValueError):
  """A shard file that does not hold what the manifest says (truncated, altered, missing)."""


def dtype_for(vocab_size: int) -> np.dtype:
  """uint16 when every id fits, else uint32 (little-endian either way)."""
  return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def sha256_of(path: str, block: int = 1 << 22) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(block):
      digest.update(chunk)
  return digest.hexdigest()


# ----------------------------------------------------------------------------
# Tokenizers from their files.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class HfTokenizer(BpeTokenizer):
  """Any `tokenizers` JSON (e.g. a model's tokenizer.json) with its end-of-document token
  named: encodes, decodes and counts ids as `BpeTokenizer` does (lines encoded separately)."""

  eos_token: str = EOS_TEXT

  @property
  def eos_id(self) -> int:
    return self._tok.token_to_id(self.eos_token)

  def _check(self, text: str) -> None:
    if self.eos_token in text:
      raise ValueError(f"text holds the end-of-document marker {self.eos_token!r} (first at "
                       f"index {text.index(self.eos_token)}); it is a token of its own.")

  def metadata(self) -> dict:
    return {"bpe": self.spec, "eos_token": self.eos_token}


def eos_token_of(spec: str, eos_token: str | None, where: str) -> str:
  """The end-of-document token of a tokenizer JSON: `eos_token`, or the first known one."""
  from tokenizers import Tokenizer
  tok = Tokenizer.from_str(spec)
  if eos_token is not None:
    if tok.token_to_id(eos_token) is None:
      raise ValueError(f"eos_token={eos_token!r} is not a token of {where}.")
    return eos_token
  for name in EOS_CANDIDATES:
    if tok.token_to_id(name) is not None:
      return name
  raise ValueError(f"{where} holds none of the end-of-document tokens {EOS_CANDIDATES}; name "
                   "its token with --eos_token.")


def tokenizer_from_json(text: str, eos_token: str | None = None, where: str = "tokenizer"):
  """The tokenizer a tokenizer.json holds: CharTokenizer (with EOS), BpeTokenizer (mdjax's,
  EOS '<|endoftext|>') or HfTokenizer (another end-of-document token)."""
  try:
    spec = json.loads(text)
  except json.JSONDecodeError as error:
    raise ValueError(f"{where} is not JSON: {error}.") from None
  if isinstance(spec, dict) and "char_vocab" in spec:
    return CharTokenizer(spec["char_vocab"], eos=True)
  if not (isinstance(spec, dict) and "model" in spec):
    raise ValueError(f"{where} is neither a `tokenizers` JSON (no 'model') nor a character "
                     "vocabulary ({'char_vocab': ...}).")
  eos_token = eos_token_of(text, eos_token, where)
  return BpeTokenizer(text) if eos_token == EOS_TEXT else HfTokenizer(text, eos_token)


def tokenizer_json(tokenizer) -> str:
  """The tokenizer.json text of a tokenizer (`tokenizer_from_json` reads it back)."""
  if isinstance(tokenizer, CharTokenizer):
    return json.dumps({"char_vocab": tokenizer.vocab}, ensure_ascii=False)
  return tokenizer.spec


def encode_many(tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
  """`[tokenizer.encode(t) for t in texts]`, in one call to the tokenizer (all cores)."""
  if isinstance(tokenizer, CharTokenizer):  # one id per character: encode once, cut
    ids = tokenizer.encode("".join(texts))
    return np.split(ids, np.cumsum([len(t) for t in texts])[:-1])
  for t in texts:
    tokenizer._check(t)
  pieces = [t.splitlines(keepends=True) for t in texts]  # what `BpeTokenizer.encode` encodes
  flat = tokenizer._tok.encode_batch([p for ps in pieces for p in ps], add_special_tokens=False)
  out, at = [], 0
  for ps in pieces:
    out.append(np.asarray([i for e in flat[at:at + len(ps)] for i in e.ids], np.int32))
    at += len(ps)
  return out


# ----------------------------------------------------------------------------
# Writing.
# ----------------------------------------------------------------------------


class _HashedFile:
  """A binary file written in order, its SHA-256 kept as it goes."""

  def __init__(self, path: str):
    self.path, self.file, self.digest, self.bytes = path, open(path, "wb"), hashlib.sha256(), 0

  def write(self, array: np.ndarray) -> None:
    data = array.tobytes()
    self.file.write(data)
    self.digest.update(data)
    self.bytes += len(data)

  def close(self) -> str:
    self.file.close()
    return self.digest.hexdigest()


class SplitWriter:
  """Writes one split's shards as documents arrive; memory holds one piece at a time.

  `write(ids)` appends ids to the current document (opening one if none is open);
  `end_document()` writes its EOS, and starts a new shard once the current one holds
  `shard_tokens` or more.
  """

  def __init__(self, out_dir: str, split: str, dtype: np.dtype, eos_id: int, shard_tokens: int):
    self.out_dir, self.split, self.dtype = out_dir, split, dtype
    self.eos = np.array([eos_id], dtype)
    self.shard_tokens = shard_tokens
    self.shards: list[dict] = []
    self._bin = self._idx = None
    self._open_document = False
    self._tokens = self._documents = 0

  def _start_shard(self) -> None:
    name = f"{self.split}-{len(self.shards):05d}"
    self._bin = _HashedFile(os.path.join(self.out_dir, name + ".bin"))
    self._idx = _HashedFile(os.path.join(self.out_dir, name + ".idx"))
    self._tokens = self._documents = 0

  def _finish_shard(self) -> None:
    self.shards.append({
        "file": os.path.basename(self._bin.path), "index": os.path.basename(self._idx.path),
        "tokens": self._tokens, "documents": self._documents,
        "sha256": self._bin.close(), "index_sha256": self._idx.close()})
    self._bin = self._idx = None

  def write(self, ids: np.ndarray) -> None:
    if not self._open_document:
      if self._bin is None:
        self._start_shard()
      self._idx.write(np.array([self._tokens], "<u8"))
      self._documents += 1
      self._open_document = True
    self._bin.write(np.asarray(ids).astype(self.dtype))
    self._tokens += len(ids)

  def end_document(self) -> None:
    self.write(self.eos)
    self._open_document = False
    if self._tokens >= self.shard_tokens:
      self._finish_shard()

  def close(self) -> dict:
    """The split's manifest entry."""
    if self._open_document:
      self.end_document()
    if self._bin is not None:
      self._finish_shard()
    return {"tokens": sum(s["tokens"] for s in self.shards),
            "documents": sum(s["documents"] for s in self.shards), "shards": self.shards}


def write_manifest(out_dir: str, manifest: dict) -> None:
  """Writes manifest.json atomically (a temporary file, then a rename)."""
  path = os.path.join(out_dir, MANIFEST)
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(manifest, f, indent=1, ensure_ascii=False)
    f.write("\n")
  os.replace(path + ".tmp", path)


# ----------------------------------------------------------------------------
# Reading.
# ----------------------------------------------------------------------------


def read_manifest(data_dir: str) -> dict:
  """The manifest of a prepared corpus; a ValueError naming what is missing or wrong."""
  path = os.path.join(data_dir, MANIFEST)
  if not os.path.isdir(data_dir):
    raise ValueError(f"data_dir={data_dir!r} is not a folder; prepare one with "
                     "`python -m mdjax.prepare_data --input=... --out=DIR`.")
  if not os.path.isfile(path):
    raise ValueError(f"data_dir={data_dir!r} holds no {MANIFEST} (not a prepared corpus, or "
                     "its preparation did not finish).")
  try:
    with open(path, encoding="utf-8") as f:
      manifest = json.load(f)
  except json.JSONDecodeError as error:
    raise ValueError(f"{path} is not JSON: {error}.") from None
  if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
    raise ValueError(f"{path}: format {manifest.get('format')!r} version "
                     f"{manifest.get('version')!r}; this mdjax reads {FORMAT!r} version {VERSION}.")
  return manifest


@functools.lru_cache(maxsize=8)
def _tokenizer_cached(path: str, signature, eos_token):
  del signature  # part of the cache key only
  with open(path, encoding="utf-8") as f:
    return tokenizer_from_json(f.read(), eos_token, path)


def load_tokenizer(data_dir: str, manifest: dict | None = None):
  """The corpus's tokenizer, checked against the manifest (hash, vocabulary size, EOS id)."""
  manifest = manifest or read_manifest(data_dir)
  entry = manifest["tokenizer"]
  path = os.path.join(data_dir, entry["file"])
  if not os.path.isfile(path):
    raise ValueError(f"{path}: the corpus's tokenizer file is missing.")
  digest = sha256_of(path)
  if digest != entry["sha256"]:
    raise ValueError(f"{path} does not match {os.path.join(data_dir, MANIFEST)}: its SHA-256 is "
                     f"{digest[:12]}..., the manifest's {entry['sha256'][:12]}... (the shards were "
                     "written with another tokenizer).")
  stat = os.stat(path)
  tokenizer = _tokenizer_cached(path, (stat.st_mtime_ns, stat.st_size), entry.get("eos_token"))
  if tokenizer.size != manifest["vocab_size"] or tokenizer.eos_id != manifest["eos_id"]:
    raise ValueError(f"{path} has {tokenizer.size} ids and EOS id {tokenizer.eos_id}; the "
                     f"manifest says vocab_size={manifest['vocab_size']}, eos_id="
                     f"{manifest['eos_id']}.")
  return tokenizer


@dataclasses.dataclass(frozen=True)
class Shard:
  path: str
  tokens: np.ndarray  # memmap, [tokens]
  starts: np.ndarray  # memmap, [documents]: where each document starts


class Split:
  """One split's shards as one token stream (memmaps, nothing read until asked).

  Documents and tokens are numbered across shards in manifest order; `tokens(a, b)` reads
  a slice that may cross shard boundaries, `document(i)` one document without its EOS.
  Each token read is checked to lie below the vocabulary size: a shard altered in place is
  named at the read that meets it.
  """

  def __init__(self, data_dir: str, name: str, manifest: dict, verify: str = "checksum",
               on_corrupt: str = "stop", log=None):
    if verify not in VERIFY:
      raise ValueError(f"data.verify={verify!r} must be one of {VERIFY}.")
    if on_corrupt not in ON_CORRUPT:
      raise ValueError(f"data.on_corrupt={on_corrupt!r} must be one of {ON_CORRUPT}.")
    self.name, self.vocab_size = name, manifest["vocab_size"]
    self.dtype = np.dtype(manifest["dtype"])
    self.shards: list[Shard] = []
    self.skipped: list[str] = []
    for entry in manifest["splits"][name]["shards"]:
      try:
        self.shards.append(self._open(data_dir, entry, verify))
      except CorruptShard as error:
        if on_corrupt == "stop":
          raise
        self.skipped.append(entry["file"])
        (log or _warn)(f"{error} Skipped (data.on_corrupt='skip'): its "
                       f"{entry['documents']} documents are left out of this run.")
    tokens = [s.tokens.shape[0] for s in self.shards]
    docs = [s.starts.shape[0] for s in self.shards]
    self.token_offsets = np.concatenate([[0], np.cumsum(tokens, dtype=np.int64)])
    self.document_offsets = np.concatenate([[0], np.cumsum(docs, dtype=np.int64)])

  def _open(self, data_dir: str, entry: dict, verify: str) -> Shard:
    paths = {k: os.path.join(data_dir, entry[k]) for k in ("file", "index")}
    sizes = {"file": entry["tokens"] * self.dtype.itemsize, "index": entry["documents"] * 8}
    for key, path in paths.items():
      if not os.path.isfile(path):
        raise CorruptShard(f"shard file {path} is missing.")
      size = os.path.getsize(path)
      if size != sizes[key]:
        raise CorruptShard(f"shard file {path} holds {size} bytes; the manifest says "
                           f"{sizes[key]} (truncated or rewritten).")
      if verify == "checksum":
        digest = sha256_of(path)
        expected = entry["sha256" if key == "file" else "index_sha256"]
        if digest != expected:
          raise CorruptShard(f"shard file {path} is corrupt: its SHA-256 is {digest[:12]}..., "
                             f"the manifest's {expected[:12]}....")
    tokens = (np.memmap(paths["file"], self.dtype, "r") if entry["tokens"]
              else np.zeros(0, self.dtype))
    starts = (np.memmap(paths["index"], "<u8", "r") if entry["documents"]
              else np.zeros(0, "<u8"))
    return Shard(paths["file"], tokens, starts)

  @property
  def num_tokens(self) -> int:
    return int(self.token_offsets[-1])

  @property
  def num_documents(self) -> int:
    return int(self.document_offsets[-1])

  def _checked(self, ids: np.ndarray, shard: Shard) -> np.ndarray:
    if ids.size and int(ids.max()) >= self.vocab_size:
      raise CorruptShard(f"shard file {shard.path} holds id {int(ids.max())}, outside the "
                         f"vocabulary of {self.vocab_size} ids (the file is corrupt).")
    return ids

  def tokens(self, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) of the split's stream (int32)."""
    out = []
    k = int(np.searchsorted(self.token_offsets, start, side="right")) - 1
    while start < stop:
      shard, base = self.shards[k], int(self.token_offsets[k])
      end = min(stop, int(self.token_offsets[k + 1]))
      out.append(self._checked(np.asarray(shard.tokens[start - base:end - base]), shard))
      start, k = end, k + 1
    return np.concatenate(out).astype(np.int32) if out else np.zeros(0, np.int32)

  def document(self, i: int, max_tokens: int | None = None) -> np.ndarray:
    """Document i's tokens (its EOS left out), at most `max_tokens` of them (int32)."""
    k = int(np.searchsorted(self.document_offsets, i, side="right")) - 1
    shard, j = self.shards[k], i - int(self.document_offsets[k])
    start = int(shard.starts[j])
    stop = (int(shard.starts[j + 1]) if j + 1 < shard.starts.shape[0]
            else shard.tokens.shape[0]) - 1  # the EOS
    if max_tokens is not None:
      stop = min(stop, start + max_tokens)
    return self._checked(np.asarray(shard.tokens[start:stop]), shard).astype(np.int32)


def _warn(message: str) -> None:
  print(message, file=sys.stderr, flush=True)
