"""Text files -> token shards and a manifest, for training on corpora that do not fit in memory.

  python -m mdjax.prepare_data --input=books/ --tokenizer=bpe:8192 --out=/data/books
  python -m mdjax.prepare_data --input=a.jsonl,b.jsonl --text_field=content \\
      --tokenizer=path/to/tokenizer.json --out=/data/web --validation_fraction=0.01

Inputs: .txt files (one document per file, or, with --documents=paragraph, the pieces
between blank lines), .jsonl files (one document per line, its `--text_field`), or folders
of them (searched recursively, in sorted order). Tokenizers: `char` (the corpus's characters,
found in a first pass), `bpe:N` (byte-level BPE of N ids trained on the first
`--bpe_training_chars` characters of the documents: a bounded prefix, so memory stays bounded),
or a `tokenizers` JSON file (any HF tokenizer.json; its end-of-document token is
`--eos_token` or the first of '<|endoftext|>', '</s>', ... it holds).

Streaming: documents are read in pieces of about `--chunk_chars` characters (a long document
is cut at line ends, which BPE encodes separately anyway), tokenized a batch at a time and
written as they come, so memory does not grow with the corpus. Every document is followed
by the EOS id. Document i goes to validation when floor((i+1) f) > floor(i f) for
f = `--validation_fraction`: evenly spread, exactly a fraction f, decided without knowing the
corpus size. The layout is described in `mdjax.data.shards`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Iterator


from mdjax import files as files_lib
from mdjax import jsonl
from mdjax.data import shards
from mdjax.tasks.text import BpeTokenizer, CharTokenizer

DOCUMENTS = ("file", "paragraph")
EXTENSIONS = (".txt", ".jsonl")
PARAGRAPH = "\n\n"


def input_files(inputs: list[str]) -> list[str]:
  """The files named, folders expanded (their .txt and .jsonl files, recursively, sorted)."""
  files = []
  for item in inputs:
    if os.path.isdir(item):
      found = sorted(os.path.join(root, n) for root, _, names in os.walk(item) for n in names
                     if n.endswith(EXTENSIONS))
      if not found:
        raise ValueError(f"--input={item!r} is a folder without .txt or .jsonl files.")
      files += found
    elif os.path.isfile(item):
      if not item.endswith(EXTENSIONS):
        raise ValueError(f"--input={item!r}: must be a .txt or .jsonl file, or a folder.")
      files.append(item)
    else:
      raise ValueError(f"--input={item!r}: no such file or folder.")
  return files


def _txt_pieces(path: str, documents: str, chunk_chars: int) -> Iterator[tuple[str, bool]]:
  """(text, ends_document) pieces of a .txt file, read `chunk_chars` at a time.

  A pending document longer than `chunk_chars` is cut after its last line end (and,
  with paragraphs, never between the two newlines of a separator), so pieces concatenate
  to the documents exactly and BPE encodes them as it would the whole.
  """
  separator = PARAGRAPH if documents == "paragraph" else None
  buffer = ""
  with open(path, encoding="utf-8") as f:
    while block := f.read(chunk_chars):
      buffer += block
      if separator:
        *whole, buffer = buffer.split(separator)
        for doc in whole:
          yield doc, True
      if len(buffer) > chunk_chars:
        # In a paragraph the buffer holds no separator: a newline before its last character
        # is followed by another character, so the cut splits no separator.
        cut = buffer.rfind("\n", 0, len(buffer) - 1 if separator else len(buffer)) + 1
        if cut > 0:
          yield buffer[:cut], False
          buffer = buffer[cut:]
  yield buffer, True


def _jsonl_pieces(path: str, text_field: str) -> Iterator[tuple[str, bool]]:
  for line_number, record in jsonl.read_rows(path, "input"):
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
      fields = sorted(record) if isinstance(record, dict) else type(record).__name__
      raise ValueError(f"{path}:{line_number}: no text field {text_field!r} (a string); the "
                       f"record holds {fields}. Name the field with --text_field.")
    yield text, True


def pieces(files: list[str], documents: str, text_field: str, chunk_chars: int
           ) -> Iterator[tuple[str, bool, int]]:
  """(text, ends_document, bytes read) over all files, in order."""
  for path in files:
    if path.endswith(".jsonl"):
      stream = _jsonl_pieces(path, text_field)
    else:
      stream = _txt_pieces(path, documents, chunk_chars)
    try:
      for text, ends in stream:
        yield text, ends, len(text.encode("utf-8", "surrogatepass"))
    except UnicodeDecodeError as error:
      raise ValueError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start} of a "
                       "block).") from None


def _progress(total_bytes: int, desc: str):
  from tqdm import tqdm
  return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, file=sys.stderr,
              mininterval=1.0, dynamic_ncols=True)


def make_tokenizer(spec: str, files, documents, text_field, chunk_chars, bpe_training_chars,
                   eos_token, total_bytes) -> tuple[object, dict]:
  """(tokenizer, its manifest entry without file and hash) for --tokenizer=`spec`."""
  if spec == "char":  # a first pass: the set of characters
    seen = set()
    with _progress(total_bytes, "characters") as bar:
      for text, _, size in pieces(files, documents, text_field, chunk_chars):
        seen.update(text)
        bar.update(size)
    if not seen:
      raise ValueError("the inputs hold no text.")
    return CharTokenizer("".join(sorted(seen)), eos=True), {"kind": "char"}
  if spec.startswith("bpe:"):
    try:
      size = int(spec[4:])
    except ValueError:
      size = -1
    if size < 258:
      raise ValueError(f"--tokenizer={spec!r}: bpe:N needs an integer N >= 258 (the 256 bytes, "
                       "EOS and at least one merge).")
    # Training reads a bounded prefix of the documents (joined by blank lines).
    prefix, held = [], 0
    for text, ends, _ in pieces(files, documents, text_field, chunk_chars):
      take = text[:bpe_training_chars - held]
      prefix.append(take + (PARAGRAPH if ends else ""))
      held += len(take)
      if held >= bpe_training_chars:
        break
    print(f"training BPE ({size} ids) on the first {held:,} characters", file=sys.stderr)
    tokenizer = BpeTokenizer.train("".join(prefix), size)
    return tokenizer, {"kind": "bpe", "bpe_training_chars": held}
  if not os.path.isfile(spec):
    raise ValueError(f"--tokenizer={spec!r}: must be 'char', 'bpe:N' or a tokenizer.json file.")
  with open(spec, encoding="utf-8") as f:
    tokenizer = shards.tokenizer_from_json(f.read(), eos_token, f"--tokenizer={spec!r}")
  return tokenizer, {"kind": "file", "source": os.path.abspath(spec)}


def in_validation(i: int, fraction: float) -> bool:
  """Document i is held out when floor((i+1) f) > floor(i f)."""
  return math.floor((i + 1) * fraction) > math.floor(i * fraction)


def prepare(inputs: list[str], tokenizer: str, out: str, validation_fraction: float = 0.01,
            shard_tokens: int = 1 << 27, documents: str = "file", text_field: str = "text",
            chunk_chars: int = 1 << 20, bpe_training_chars: int = 50_000_000,
            eos_token: str | None = None) -> dict:
  """Writes the shards and manifest of `inputs` to `out`; returns the manifest."""
  if documents not in DOCUMENTS:
    raise ValueError(f"--documents={documents!r} must be one of {DOCUMENTS}.")
  if not 0.0 <= validation_fraction < 1.0:
    raise ValueError(f"--validation_fraction={validation_fraction!r} must lie in [0, 1).")
  for name, value, low in (("shard_tokens", shard_tokens, 1), ("chunk_chars", chunk_chars, 1),
                           ("bpe_training_chars", bpe_training_chars, 1)):
    if not (isinstance(value, int) and value >= low):
      raise ValueError(f"--{name}={value!r} must be an integer >= {low}.")
  files = input_files(inputs)
  if os.path.exists(os.path.join(out, shards.MANIFEST)):
    raise ValueError(f"--out={out!r} already holds a prepared corpus; choose another folder.")
  total_bytes = sum(os.path.getsize(p) for p in files)
  tok, tokenizer_entry = make_tokenizer(tokenizer, files, documents, text_field, chunk_chars,
                                        bpe_training_chars, eos_token, total_bytes)
  os.makedirs(out, exist_ok=True)
  tokenizer_path = os.path.join(out, shards.TOKENIZER_FILE)
  with files_lib.create_file(tokenizer_path) as f:
    f.write(shards.tokenizer_json(tok).encode("utf-8"))
  dtype = shards.dtype_for(tok.size)
  writers = {s: shards.SplitWriter(out, s, dtype, tok.eos_id, shard_tokens)
             for s in shards.SPLITS}
  document, writer = 0, None  # the document being written and its split's writer
  batch, batch_chars = [], 0

  def flush():
    nonlocal document, writer
    for (text, ends), ids in zip(batch, shards.encode_many(tok, [t for t, _ in batch])):
      if writer is None and len(ids):  # a document opens with its first token
        writer = writers["validation" if in_validation(document, validation_fraction)
                         else "train"]
      if len(ids):
        writer.write(ids)
      if ends and writer is not None:
        writer.end_document()
        writer, document = None, document + 1
    batch.clear()

  with _progress(total_bytes, "tokenizing") as bar:
    for text, ends, size in pieces(files, documents, text_field, chunk_chars):
      batch.append((text, ends))
      batch_chars += len(text)
      bar.update(size)
      if batch_chars >= chunk_chars:
        flush()
        batch_chars = 0
    flush()
    bar.update(bar.total - bar.n)  # bytes counted on decoded text: \r\n reads as \n
  splits = {s: w.close() for s, w in writers.items()}
  if not splits["train"]["tokens"]:
    raise ValueError(f"--input={','.join(inputs)!r}: no training document (the inputs are empty"
                     " or every document went to validation).")
  if validation_fraction > 0 and not splits["validation"]["documents"]:
    raise ValueError(f"--validation_fraction={validation_fraction}: the corpus's {document} "
                     "documents hold none out (fewer than 1/fraction); use more documents "
                     "(e.g. --documents=paragraph) or --validation_fraction=0.")
  manifest = {
      "format": shards.FORMAT, "version": shards.VERSION,
      "vocab_size": tok.size, "eos_id": int(tok.eos_id), "dtype": dtype.name,
      "tokenizer": {"file": shards.TOKENIZER_FILE, "sha256": shards.sha256_of(tokenizer_path),
                    "eos_token": getattr(tok, "eos_token", None), **tokenizer_entry},
      "documents": documents, "text_field": text_field,
      "validation_fraction": validation_fraction, "shard_tokens": shard_tokens,
      "inputs": [{"path": os.path.abspath(p), "bytes": os.path.getsize(p)} for p in files],
      "splits": splits}
  shards.write_manifest(out, manifest)
  return manifest


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m mdjax.prepare_data",
                                   description=__doc__.split("\n")[0])
  parser.add_argument("--input", required=True,
                      help="comma-separated .txt / .jsonl files or folders of them")
  parser.add_argument("--tokenizer", required=True, help="char, bpe:N or a tokenizer.json")
  parser.add_argument("--out", required=True, help="the folder to write (new or empty)")
  parser.add_argument("--validation_fraction", type=float, default=0.01,
                      help="fraction of documents held out (default 0.01)")
  parser.add_argument("--shard_tokens", type=int, default=1 << 27,
                      help="tokens per shard before a new one starts (default 2**27)")
  parser.add_argument("--documents", choices=DOCUMENTS, default="file",
                      help=".txt files: one document per file, or per blank-line paragraph")
  parser.add_argument("--text_field", default="text", help=".jsonl: the field with the text")
  parser.add_argument("--chunk_chars", type=int, default=1 << 20,
                      help="characters read and tokenized at a time (default 2**20)")
  parser.add_argument("--bpe_training_chars", type=int, default=50_000_000,
                      help="bpe:N trains on this many leading characters (default 5e7)")
  parser.add_argument("--eos_token", default=None,
                      help="a tokenizer.json's end-of-document token (default: found)")
  args = parser.parse_args(argv)
  try:
    manifest = prepare([p for p in args.input.split(",") if p], args.tokenizer, args.out,
                       args.validation_fraction, args.shard_tokens, args.documents,
                       args.text_field, args.chunk_chars, args.bpe_training_chars,
                       args.eos_token)
  except (ValueError, OSError, UnicodeDecodeError) as error:
    print(f"prepare_data: error: {error}", file=sys.stderr)
    return 1
  train, validation = manifest["splits"]["train"], manifest["splits"]["validation"]
  print(f"{args.out}: {manifest['vocab_size']} ids ({manifest['dtype']}), train "
        f"{train['tokens']:,} tokens / {train['documents']:,} documents in "
        f"{len(train['shards'])} shard(s), validation {validation['tokens']:,} tokens / "
        f"{validation['documents']:,} documents")
  return 0


if __name__ == "__main__":
  sys.exit(main())
