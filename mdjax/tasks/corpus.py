"""A prepared corpus on disk (`python -m mdjax.prepare_data`): token shards too large for memory.

The vocabulary, the EOS id and the tokenizer come from the corpus's manifest; the mask id
is the vocabulary size. Training batches come from the grain pipeline
(`mdjax.data.batch_source`), which reads `length`-token windows of the train split:
`documents='packed'` (the token stream, documents joined by EOS, cut into windows) or
'padded' (one document per window, EOS after it). `sample_data` / `validation_data` draw
windows at random indices from a key, for callers that want a batch of a key;
`validation_windows(n)` are n windows evenly spaced over the validation split.

Checkpoints keep the tokenizer (its JSON and SHA-256): a run resumed on a corpus prepared
with another tokenizer is refused, and a workdir samples and decodes without its corpus.
They also keep the corpus's `data_sha256` (its manifest's tokens, not its path): a run resumes
on the same corpus wherever it lies now (a copy on local scratch, a relative path).
`vocab_size`, when the config sets it, must equal the manifest's.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

import jax
import numpy as np

from mdjax.tasks.base import Task
from mdjax.tasks.text import text_metrics

LAYOUTS = ("packed", "padded")
# The manifest fields that decide the token ids a run reads; not `inputs` (the source paths).
DATA_FIELDS = ("format", "version", "vocab_size", "eos_id", "dtype", "tokenizer", "documents",
               "splits")


class CorpusFiles:
  """A prepared corpus folder: its manifest, its tokenizer, its splits opened on demand."""

  def __init__(self, data_dir: str):
    from mdjax.data import shards
    self.data_dir = data_dir
    self.manifest = shards.read_manifest(data_dir)
    self.tokenizer = shards.load_tokenizer(data_dir, self.manifest)
    self.tokenizer_sha256 = self.manifest["tokenizer"]["sha256"]
    self._splits = {}

  @property
  def data_sha256(self) -> str:
    """SHA-256 of the manifest's data fields (its shards' and tokenizer's hashes among them):
    equal for a copy of the folder, whatever its path."""
    fields = {k: self.manifest.get(k) for k in DATA_FIELDS}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode("utf-8")).hexdigest()

  def open(self, split: str, verify: str = "checksum", on_corrupt: str = "stop", log=None):
    """The split's shards (checked as `verify` says, once per option set)."""
    from mdjax.data.shards import Split
    key = (split, verify, on_corrupt)
    if key not in self._splits:
      self._splits[key] = Split(self.data_dir, split, self.manifest, verify, on_corrupt, log)
    return self._splits[key]

  def __repr__(self) -> str:
    m = self.manifest
    return (f"corpus {self.data_dir} ({m['splits']['train']['tokens']:,} training tokens, "
            f"{m['vocab_size']} ids)")


def _signature(data_dir: str):
  """(mtime, size) of the manifest and the tokenizer: a rewritten one is read again."""
  stats = []
  for name in ("manifest.json", "tokenizer.json"):
    path = os.path.join(data_dir, name)
    stats.append((os.stat(path).st_mtime_ns, os.stat(path).st_size)
                 if os.path.isfile(path) else None)
  return tuple(stats)


@functools.lru_cache(maxsize=4)
def _files(data_dir: str, signature) -> CorpusFiles:
  del signature  # part of the cache key only
  return CorpusFiles(data_dir)


def open_corpus(data_dir: str) -> CorpusFiles:
  """The corpus folder (cached while its manifest and tokenizer are unchanged)."""
  return _files(os.path.abspath(data_dir), _signature(os.path.abspath(data_dir)))


def _check_shape(data_dir, length, documents, vocab_size) -> None:
  if not (isinstance(data_dir, str) and data_dir):
    raise ValueError(f"data_dir={data_dir!r} must name a folder written by "
                     "`python -m mdjax.prepare_data`.")
  if not (isinstance(length, int) and length >= 2):
    raise ValueError(f"length={length!r} must be an integer >= 2.")
  if documents not in LAYOUTS:
    raise ValueError(f"documents={documents!r} must be one of {LAYOUTS}.")
  if vocab_size is not None and not (isinstance(vocab_size, int) and vocab_size >= 1):
    raise ValueError(f"vocab_size={vocab_size!r} must be None or a positive integer.")


def _windows_in(split: dict, length: int, documents: str) -> int:
  return split["tokens"] // length if documents == "packed" else split["documents"]


def _check_files(files: CorpusFiles, vocab_size, tokenizer_sha256, length: int,
                 documents: str) -> None:
  manifest = files.manifest
  for name in ("train", "validation"):  # training and its evaluations need a window of each
    split = manifest["splits"][name]
    if _windows_in(split, length, documents) < 1:
      raise ValueError(f"length={length}: the {name} split of {files.data_dir} holds "
                       f"{split['tokens']} tokens in {split['documents']} documents, not one "
                       f"{documents} window; use a shorter length or prepare the corpus with "
                       "more text (or a larger --validation_fraction).")
  if vocab_size is not None and vocab_size != manifest["vocab_size"]:
    raise ValueError(f"vocab_size={vocab_size}: the corpus {files.data_dir} has "
                     f"{manifest['vocab_size']} ids (its manifest); set vocab_size="
                     f"{manifest['vocab_size']} or leave it unset.")
  if tokenizer_sha256 is not None and tokenizer_sha256 != files.tokenizer_sha256:
    raise ValueError(f"tokenizer_sha256={tokenizer_sha256[:12]}...: the corpus {files.data_dir} "
                     f"was tokenized with another tokenizer ({files.tokenizer_sha256[:12]}...).")


def check(data_dir: str | None = None, length: int = 128, documents: str = "packed",
          vocab_size: int | None = None, tokenizer_json: str | None = None,
          tokenizer_sha256: str | None = None, eos_token: str | None = None) -> None:
  """`bind`'s errors, found by reading the manifest and tokenizer only (no shard)."""
  _check_shape(data_dir, length, documents, vocab_size)
  if tokenizer_json is None:
    _check_files(open_corpus(data_dir), vocab_size, tokenizer_sha256, length, documents)


def _draw(split, length, layout, eos_id, indices) -> np.ndarray:
  from mdjax.data.pipeline import Windows
  windows = Windows(split, length, layout, eos_id)
  return np.stack([windows[int(i)] for i in indices])


def bind(data_dir: str | None = None, length: int = 128, documents: str = "packed",
         vocab_size: int | None = None, tokenizer_json: str | None = None,
         tokenizer_sha256: str | None = None, eos_token: str | None = None) -> Task:
  """The corpus task of `data_dir`. `tokenizer_json` / `tokenizer_sha256` / `eos_token` come
  from a checkpoint: the corpus must hold that tokenizer, and without the corpus the task
  still encodes and decodes (it has no data)."""
  _check_shape(data_dir, length, documents, vocab_size)
  try:
    files = open_corpus(data_dir)
  except ValueError as error:
    if tokenizer_json is None:
      raise
    return _without_corpus(data_dir, length, documents, tokenizer_json, eos_token,
                           str(error).split("\n")[0])
  _check_files(files, vocab_size, tokenizer_sha256, length, documents)
  tok, manifest = files.tokenizer, files.manifest
  eos_id = int(manifest["eos_id"])

  def windows_of(split_name, key, batch):
    split = files.open(split_name, verify="size")
    count = (split.num_tokens // length if documents == "packed" else split.num_documents)
    if count < 1:
      raise ValueError(f"the {split_name} split of {data_dir} holds no window of {length} "
                       "tokens.")
    indices = np.asarray(jax.random.randint(key, (batch,), 0, count))
    return _draw(split, length, documents, eos_id, indices)

  def validation_windows(num: int) -> np.ndarray:
    split = files.open("validation", verify="size")
    count = (split.num_tokens // length if documents == "packed" else split.num_documents)
    if count < 1:
      raise ValueError(f"the validation split of {data_dir} holds no window of {length} tokens "
                       f"({split.num_tokens} tokens); prepare it with a larger "
                       "--validation_fraction or use a shorter length.")
    return _draw(split, length, documents, eos_id, np.linspace(0, count - 1, num).astype(np.int64))

  def sample_metrics(tokens_BxL):
    texts = [tok.decode(row) for row in np.asarray(tokens_BxL)]
    return text_metrics(texts, None, tok.mask_char)

  from mdjax.data.shards import tokenizer_json as json_of
  return Task(
      name="corpus", length=length, vocab_size=tok.size, mask_id=tok.size, eos_id=eos_id,
      sample_data=lambda key, batch: windows_of("train", key, batch),
      validation_data=lambda key, batch: windows_of("validation", key, batch),
      decode=tok.decode, encode=tok.encode, sample_metrics=sample_metrics, tokenizer=tok,
      params={"data_dir": data_dir, "documents": documents}, corpus=files,
      inputs_sha256=files.data_sha256,
      validation_windows=validation_windows,
      metadata={"tokenizer_json": json_of(tok), "tokenizer_sha256": files.tokenizer_sha256,
                "eos_token": getattr(tok, "eos_token", None)},
      description=f"CorpusTask(length={length}, documents={documents}, {files!r})")


def _without_corpus(data_dir, length, documents, tokenizer_json, eos_token, why) -> Task:
  from mdjax.data.shards import tokenizer_from_json
  tok = tokenizer_from_json(tokenizer_json, eos_token, "the checkpoint's tokenizer")

  def no_data(key, batch):
    raise ValueError(f"the corpus of this task is not available ({why}): rebuilt from a "
                     "checkpoint's tokenizer, it samples and decodes but has no data.")

  def sample_metrics(tokens_BxL):
    texts = [tok.decode(row) for row in np.asarray(tokens_BxL)]
    return text_metrics(texts, None, tok.mask_char)

  sha256 = hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest()
  return Task(
      name="corpus", length=length, vocab_size=tok.size, mask_id=tok.size, eos_id=tok.eos_id,
      sample_data=no_data, decode=tok.decode, encode=tok.encode, sample_metrics=sample_metrics,
      tokenizer=tok, params={"data_dir": data_dir, "documents": documents},
      metadata={"tokenizer_json": tokenizer_json, "tokenizer_sha256": sha256,
                "eos_token": eos_token},
      description=f"CorpusTask(length={length}, vocab={tok.size}, no corpus: {why})")
