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

A corpus may come from elsewhere, so the reader trusts none of it: the manifest's fields are
checked before use, the files it names are plain names of regular files whose real paths lie
in the folder (no `../x`, no absolute path, no link leading out, no FIFO), ids are unsigned
(uint16 or uint32, as written) and below the vocabulary size, and each `.idx` starts at 0
and increases within its shard, whatever `verify` says. Bad input is a one-line ValueError
naming the file and the field.
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

from mdjax import files as files_lib
from mdjax.tokenizers import EOS_TEXT, BpeTokenizer, CharTokenizer

MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT = "mdjax.corpus"
VERSION = 1
SPLITS = ("train", "validation")
# What `dtype_for` writes: unsigned, so no id is negative (the top is checked at every read).
DTYPES = ("uint16", "uint32")
ON_CORRUPT = ("stop", "skip")
VERIFY = ("checksum", "size")
# The end-of-document token of a tokenizer.json when none is named: the first it holds.
EOS_CANDIDATES = (EOS_TEXT, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")


class CorruptShard(ValueError):
  """A shard file that does not hold what the manifest says (truncated, altered, missing)."""


def dtype_for(vocab_size: int) -> np.dtype:
  """uint16 when every id fits, else uint32 (little-endian either way)."""
  return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def sha256_of(path: str) -> str:
  with open(path, "rb") as f:
    return _sha256_of_file(f)


def _sha256_of_file(f, block: int = 1 << 22) -> str:
  digest = hashlib.sha256()
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


def _parsed(spec: str, where: str):
  """`tokenizers.Tokenizer.from_str(spec)`; what it cannot read is a ValueError naming `where`."""
  from tokenizers import Tokenizer
  try:
    return Tokenizer.from_str(spec)
  except BaseException as error:  # a Rust panic is a BaseException (PanicException)
    if not isinstance(error, Exception) and type(error).__name__ != "PanicException":
      raise
    why = (str(error).splitlines() or [type(error).__name__])[0][:200]
    raise ValueError(f"{where} is not a `tokenizers` JSON it can read: {why}.") from None


def eos_token_of(spec: str, eos_token: str | None, where: str) -> str:
  """The end-of-document token of a tokenizer JSON: `eos_token`, or the first known one."""
  tok = _parsed(spec, where)
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
  except (ValueError, RecursionError) as error:  # JSONDecodeError, an over-long number, nesting
    raise ValueError(f"{where} is not JSON: {str(error)[:200] or 'nested too deeply'}.") from None
  if isinstance(spec, dict) and "char_vocab" in spec:
    vocab = spec["char_vocab"]
    if not (isinstance(vocab, str) and vocab and len(set(vocab)) == len(vocab)):
      raise ValueError(f"{where}: char_vocab must be a non-empty string of distinct characters.")
    return CharTokenizer(vocab, eos=True)
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
  return tokenizer.encode_many(texts)


# ----------------------------------------------------------------------------
# Writing.
# ----------------------------------------------------------------------------


class _HashedFile:
  """A binary file written in order, its SHA-256 kept as it goes."""

  def __init__(self, path: str):
    self.path, self.file, self.digest, self.bytes = path, files_lib.create_file(path), hashlib.sha256(), 0

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
  """Writes manifest.json atomically (a fresh temporary file, then a rename)."""
  with files_lib.atomic_write(os.path.join(out_dir, MANIFEST)) as f:
    f.write((json.dumps(manifest, indent=1, ensure_ascii=False) + "\n").encode("utf-8"))


# ----------------------------------------------------------------------------
# Reading.
# ----------------------------------------------------------------------------


def _shown(value) -> str:
  """`repr(value)`, cut short: a message stays one readable line (a whole path fits)."""
  text = repr(value)
  return text if len(text) <= 300 else text[:297] + "..."


def _is_count(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _field_error(where: str, field: str, value, allowed: str) -> ValueError:
  return ValueError(f"{where}: field {field}={_shown(value)} {allowed}.")


def _object(where: str, field: str, value) -> dict:
  if not isinstance(value, dict):
    raise _field_error(where, field, value, "must be a JSON object")
  return value


def _check_name(where: str, field: str, name) -> str:
  """A file the manifest names: a plain name of a file in the corpus folder, nothing else."""
  if not (isinstance(name, str) and name not in ("", ".", "..")
          and os.path.basename(name) == name and not any(c in name for c in "\\\0")):
    raise _field_error(where, field, name, "must be the name of a file in the corpus folder "
                       "(no '/', '\\', '.' or '..')")
  return name


def _open_member(data_dir: str, name: str, where: str, field: str | None):
  """The corpus folder's file `name` (the manifest's `field`, or the manifest itself when
  None), open to read: a regular file whose real path lies in the folder; a link leading out
  of it, a FIFO or a device is a ValueError naming `where`. FileNotFoundError when absent."""
  what = f"field {field}={_shown(name)}" if field else _shown(name)
  if field:
    _check_name(where, field, name)
  root = os.path.realpath(data_dir)
  real = os.path.realpath(os.path.join(data_dir, name))
  if os.path.commonpath([root, real]) != root:
    raise ValueError(f"{where}: {what} leads to {real}, outside the corpus folder {root} (a "
                     "symbolic link); a corpus's files lie in its folder.")
  try:
    return os.fdopen(files_lib.open_fd(real, follow_links=False), "rb")
  except FileNotFoundError:
    raise
  except ValueError as error:
    raise ValueError(f"{where}: {what}: {error}; a corpus's files are regular files.") from None


def _check_vocabulary(manifest: dict, where: str) -> None:
  """vocab_size and dtype, which every reader of the shards uses."""
  if not (_is_count(manifest.get("vocab_size")) and manifest["vocab_size"] >= 1):
    raise _field_error(where, "vocab_size", manifest.get("vocab_size"),
                       "must be a positive integer")
  if manifest.get("dtype") not in DTYPES:
    raise _field_error(where, "dtype", manifest.get("dtype"), f"must be one of {DTYPES}")


def _tokenizer_entry(manifest: dict, where: str) -> dict:
  entry = _object(where, "tokenizer", manifest.get("tokenizer"))
  _check_name(where, "tokenizer.file", entry.get("file"))
  if not isinstance(entry.get("sha256"), str):
    raise _field_error(where, "tokenizer.sha256", entry.get("sha256"), "must be a string")
  if not isinstance(entry.get("eos_token"), (str, type(None))):
    raise _field_error(where, "tokenizer.eos_token", entry.get("eos_token"),
                       "must be a string or null")
  eos_id, vocab_size = manifest.get("eos_id"), manifest["vocab_size"]
  if not (_is_count(eos_id) and eos_id < vocab_size):
    raise _field_error(where, "eos_id", eos_id, f"must be an id below vocab_size={vocab_size}")
  return entry


def _split_entry(manifest: dict, name: str, where: str) -> dict:
  """The manifest's entry of split `name`: its counts, each shard's names, counts and hashes."""
  splits = _object(where, "splits", manifest.get("splits"))
  split = _object(where, f"splits.{name}", splits.get(name))
  shards = split.get("shards")
  if not isinstance(shards, list):
    raise _field_error(where, f"splits.{name}.shards", shards, "must be a list")
  for i, shard in enumerate(shards):
    field = f"splits.{name}.shards[{i}]"
    _object(where, field, shard)
    for key in ("file", "index"):
      _check_name(where, f"{field}.{key}", shard.get(key))
    for key in ("sha256", "index_sha256"):
      if not isinstance(shard.get(key), str):
        raise _field_error(where, f"{field}.{key}", shard.get(key), "must be a string")
    for key in ("tokens", "documents"):
      if not _is_count(shard.get(key)):
        raise _field_error(where, f"{field}.{key}", shard.get(key),
                           "must be an integer >= 0")
    if not 0 < shard["documents"] <= shard["tokens"]:  # every document ends with its EOS
      raise _field_error(where, f"{field}.documents", shard["documents"],
                         f"must lie in [1, tokens={shard['tokens']}]")
  for key in ("tokens", "documents"):
    total = sum(shard[key] for shard in shards)
    if split.get(key) != total:
      raise _field_error(where, f"splits.{name}.{key}", split.get(key),
                         f"must equal its shards' sum, {total}")
  return split


def check_manifest(manifest, where: str) -> dict:
  """`manifest` (manifest.json's content) with every field the readers use checked: a
  ValueError naming `where` and the field otherwise."""
  _object(where, "the manifest", manifest)
  if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
    raise ValueError(f"{where}: format {_shown(manifest.get('format'))} version "
                     f"{_shown(manifest.get('version'))}; this mdjax reads {FORMAT!r} version "
                     f"{VERSION}.")
  _check_vocabulary(manifest, where)
  _tokenizer_entry(manifest, where)
  for name in SPLITS:
    _split_entry(manifest, name, where)
  return manifest


def read_manifest(data_dir: str) -> dict:
  """The manifest of a prepared corpus; a ValueError naming what is missing or wrong."""
  path = os.path.join(data_dir, MANIFEST)
  if not os.path.isdir(data_dir):
    raise ValueError(f"data_dir={data_dir!r} is not a folder; prepare one with "
                     "`python -m mdjax.prepare_data --input=... --out=DIR`.")
  try:
    file = _open_member(data_dir, MANIFEST, path, None)
  except FileNotFoundError:
    raise ValueError(f"data_dir={data_dir!r} holds no {MANIFEST} (not a prepared corpus, or "
                     "its preparation did not finish).") from None
  with file:
    raw = file.read()
  try:
    manifest = json.loads(raw.decode("utf-8"))
  except (ValueError, RecursionError) as error:  # bad JSON or UTF-8, a huge number, nesting
    raise ValueError(f"{path} is not JSON: {str(error)[:200]}.") from None
  return check_manifest(manifest, path)


@functools.lru_cache(maxsize=8)
def _tokenizer_cached(text: str, eos_token, where: str):
  return tokenizer_from_json(text, eos_token, where)


def load_tokenizer(data_dir: str, manifest: dict | None = None):
  """The corpus's tokenizer, checked against the manifest (hash, vocabulary size, EOS id)."""
  manifest = manifest or read_manifest(data_dir)
  where = os.path.join(data_dir, MANIFEST)
  _check_vocabulary(_object(where, "the manifest", manifest), where)
  entry = _tokenizer_entry(manifest, where)
  path = os.path.join(data_dir, entry["file"])
  try:
    with _open_member(data_dir, entry["file"], where, "tokenizer.file") as f:
      raw = f.read()
  except FileNotFoundError:
    raise ValueError(f"{path}: the corpus's tokenizer file is missing.") from None
  digest = hashlib.sha256(raw).hexdigest()
  if digest != entry["sha256"]:
    raise ValueError(f"{path} does not match {where}: its SHA-256 is {digest[:12]}..., the "
                     f"manifest's {entry['sha256'][:12]}... (the shards were written with "
                     "another tokenizer).")
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as error:
    raise ValueError(f"{path} is not UTF-8 ({error.reason} at byte {error.start}).") from None
  tokenizer = _tokenizer_cached(text, entry.get("eos_token"), path)
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
    where = os.path.join(data_dir, MANIFEST)
    _check_vocabulary(_object(where, "the manifest", manifest), where)
    entries = _split_entry(manifest, name, where)["shards"]
    self.name, self.vocab_size = name, manifest["vocab_size"]
    self.dtype = np.dtype(manifest["dtype"])
    self.shards: list[Shard] = []
    self.skipped: list[str] = []
    for i, entry in enumerate(entries):
      try:
        field = f"splits.{name}.shards[{i}]"
        self.shards.append(self._open(data_dir, entry, verify, where, field))
      except CorruptShard as error:
        if on_corrupt == "stop":
          raise
        self.skipped.append(entry["file"])
        (log or _warn)(f"{error} Skipped (data.on_corrupt='skip'): its "
                       f"{entry['documents']} documents are left out of this run.")
    if entries and not self.shards:
      raise ValueError(f"the {name} split of {data_dir}: all {len(entries)} of its shards were "
                       "skipped as corrupt (data.on_corrupt='skip'); nothing is left to read.")
    tokens = [s.tokens.shape[0] for s in self.shards]
    docs = [s.starts.shape[0] for s in self.shards]
    self.token_offsets = np.concatenate([[0], np.cumsum(tokens, dtype=np.int64)])
    self.document_offsets = np.concatenate([[0], np.cumsum(docs, dtype=np.int64)])

  def _open(self, data_dir: str, entry: dict, verify: str, where: str, field: str) -> Shard:
    """The shard's memmaps, once its files hold what `entry` says (CorruptShard otherwise)."""
    arrays = {}
    for key, dtype, count in (("file", self.dtype, entry["tokens"]),
                              ("index", np.dtype("<u8"), entry["documents"])):
      path = os.path.join(data_dir, entry[key])
      try:
        file = _open_member(data_dir, entry[key], where, f"{field}.{key}")
      except FileNotFoundError:
        raise CorruptShard(f"shard file {path} is missing.") from None
      with file:
        size = os.fstat(file.fileno()).st_size
        if size != count * dtype.itemsize:
          raise CorruptShard(f"shard file {path} holds {size} bytes; the manifest says "
                             f"{count * dtype.itemsize} (truncated or rewritten).")
        if verify == "checksum":
          digest = _sha256_of_file(file)
          expected = entry["sha256" if key == "file" else "index_sha256"]
          if digest != expected:
            raise CorruptShard(f"shard file {path} is corrupt: its SHA-256 is {digest[:12]}..., "
                               f"the manifest's {expected[:12]}....")
        arrays[key] = np.memmap(file, dtype, "r")  # the file checked, not one put in its place
    _check_starts(arrays["index"], entry["tokens"], os.path.join(data_dir, entry["index"]))
    return Shard(os.path.join(data_dir, entry["file"]), arrays["file"], arrays["index"])

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


def _check_starts(starts: np.ndarray, tokens: int, path: str) -> None:
  """A shard's document starts: the first at 0, each after the one before (a document holds
  at least its EOS), all before the shard's end; else CorruptShard naming the .idx file."""
  if starts[0] != 0:
    raise CorruptShard(f"shard index {path}: document 0 starts at {int(starts[0])}; the first "
                       "document starts at 0 (the file is corrupt).")
  back = starts[1:] <= starts[:-1]
  if back.any():
    j = int(np.argmax(back)) + 1
    raise CorruptShard(f"shard index {path}: document {j} starts at {int(starts[j])}, not after "
                       f"document {j - 1} (at {int(starts[j - 1])}); starts must increase (the "
                       "file is corrupt).")
  if starts[-1] >= tokens:
    raise CorruptShard(f"shard index {path}: document {len(starts) - 1} starts at "
                       f"{int(starts[-1])}, past the shard's {tokens} tokens (the file is "
                       "corrupt).")


def _warn(message: str) -> None:
  print(message, file=sys.stderr, flush=True)
