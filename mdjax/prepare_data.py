"""Text files -> token shards and a manifest, for training on corpora that do not fit in memory.

  python -m mdjax.prepare_data --input=books/ --tokenizer=bpe:8192 --out=/data/books
  python -m mdjax.prepare_data --input=a.jsonl,b.jsonl --text_field=content \\
      --tokenizer=path/to/tokenizer.json --out=/data/web --validation_fraction=0.01

Inputs: .txt and .md files (text: one document per file, or, with --documents=paragraph,
the pieces between blank lines), .jsonl files (one document per line, its `--text_field`), or
folders of them (searched recursively, in sorted order; other files are skipped, and named). Tokenizers: `char` (the corpus's characters,
found in a first pass), `bpe:N` (byte-level BPE of N ids trained on the first
`--bpe_training_chars` characters of the documents: a bounded prefix, so memory stays bounded),
or a `tokenizers` JSON file (any HF tokenizer.json; its end-of-document token is
`--eos_token` or the first of '<|endoftext|>', '</s>', ... it holds).

Streaming: documents are read in pieces of about `--chunk_chars` characters (a long document
is cut at line ends, which BPE encodes separately anyway), tokenized a batch at a time and
written as they come, so memory does not grow with the corpus. Every document is followed
by the EOS id. Document i goes to validation when floor((i+1) f) > floor(i f) for
f = `--validation_fraction`: evenly spread, exactly a fraction f, decided without knowing the
corpus size. Inputs of fewer than 1/f documents (one text file, a small folder; counted
before any work) hold out the tail instead: the text from the start of the line holding
character C - ceil(f C) of the C characters (that character itself when the line is the
first) is the validation split, the document it cuts ending there. The folder is built beside
`--out` and moved into place at the end: a failed run leaves no partial `--out`. The layout
is described in `mdjax.data.shards`.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
import sys
from typing import Iterator


from mdjax import cli, jsonl
from mdjax import files as files_lib
from mdjax.data import shards
from mdjax.errors import ArgumentError
from mdjax.tokenizers import BpeTokenizer, CharTokenizer, UnencodableText

DOCUMENTS = ("file", "paragraph")
# The validation split is called small below this many windows of configs/corpus.py's length.
FEW_WINDOWS, WINDOW = 4, 128
MIN_FRACTION = 1e-12
TEXT_EXTENSIONS = (".txt", ".md")  # read as plain text
EXTENSIONS = TEXT_EXTENSIONS + (".jsonl",)
SKIPPED_SHOWN = 5  # skipped files named in the notice
PARAGRAPH = "\n\n"


class UsageError(ValueError):
  """A flag's value refused before any input is read (exit status 2 on the command line)."""


def input_files(inputs: list[str]) -> tuple[list[str], list[str]]:
  """(the files read, the files skipped): the files named, folders expanded (their .txt, .md
  and .jsonl files, recursively, sorted; their other files skipped)."""
  files, skipped = [], []
  for item in inputs:
    if os.path.isdir(item):
      found = sorted(os.path.join(root, n) for root, _, names in os.walk(item) for n in names)
      read = [path for path in found if path.endswith(EXTENSIONS)]
      if not read:
        raise ValueError(f"--input={item!r} is a folder without .txt, .md or .jsonl files.")
      files += read
      skipped += [path for path in found if not path.endswith(EXTENSIONS)]
    elif os.path.isfile(item):
      if not item.endswith(EXTENSIONS):
        raise ValueError(f"--input={item!r}: must be a .txt, .md or .jsonl file, or a folder.")
      files.append(item)
    else:
      raise ValueError(f"--input={item!r}: no such file or folder.")
  return files, skipped


def skipped_notice(skipped: list[str]) -> str:
  """The line naming the files a folder held that are not read."""
  shown = ", ".join(skipped[:SKIPPED_SHOWN])
  more = f" and {len(skipped) - SKIPPED_SHOWN} more" if len(skipped) > SKIPPED_SHOWN else ""
  return (f"skipped {len(skipped)} file(s) that are not .txt, .md or .jsonl: {shown}{more}.")


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


def check_tokenizer_spec(spec: str) -> int | None:
  """N of `bpe:N` (None for the other kinds); a UsageError for a spec no kind accepts."""
  if spec.startswith("bpe:"):
    size = int(spec[4:]) if spec[4:].isdigit() else -1
    if size < 258:
      raise UsageError(f"--tokenizer={spec!r}: bpe:N needs an integer N >= 258 (the 256 bytes, "
                       "EOS and at least one merge).")
    return size
  if spec != "char" and not os.path.isfile(spec):
    raise UsageError(f"--tokenizer={spec!r}: must be 'char', 'bpe:N' or a tokenizer.json file.")
  return None


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
    size = check_tokenizer_spec(spec)
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
  with open(spec, encoding="utf-8") as f:
    tokenizer = shards.tokenizer_from_json(f.read(), eos_token, f"--tokenizer={spec!r}")
  return tokenizer, {"kind": "file", "source": os.path.abspath(spec)}


def in_validation(i: int, fraction: float) -> bool:
  """Document i is held out when floor((i+1) f) > floor(i f)."""
  return math.floor((i + 1) * fraction) > math.floor(i * fraction)


def documents_to_hold_one_out(fraction: float) -> int:
  """The fewest documents of which `in_validation` holds one out (fraction > 0)."""
  n = max(1, math.ceil(1 / fraction))
  while math.floor(n * fraction) < 1:  # float rounding either way
    n += 1
  while n > 1 and math.floor((n - 1) * fraction) >= 1:
    n -= 1
  return n


def count_documents(files: list[str], documents: str, text_field: str, chunk_chars: int,
                    enough: int) -> int:
  """The inputs' documents that hold text, counted streaming and no further than `enough`;
  a .txt file that is one document is counted by its size, unread."""
  count = 0
  for path in files:
    if count >= enough:
      break
    if documents == "file" and path.endswith(TEXT_EXTENSIONS):
      count += os.path.getsize(path) > 0
      continue
    has_text = False
    for text, ends, _ in pieces([path], documents, text_field, chunk_chars):
      has_text = has_text or bool(text)
      if ends:
        count, has_text = count + has_text, False
        if count >= enough:
          break
  return count


def _check_flags(documents, validation_fraction, shard_tokens, chunk_chars, bpe_training_chars,
                 tokenizer) -> None:
  if documents not in DOCUMENTS:
    raise UsageError(f"--documents={documents!r} must be one of {DOCUMENTS}.")
  if not (isinstance(validation_fraction, (int, float)) and 0.0 <= validation_fraction < 1.0):
    raise UsageError(f"--validation_fraction={validation_fraction!r} must lie in [0, 1).")
  if 0 < validation_fraction < MIN_FRACTION:  # 1/f documents could never be counted
    raise UsageError(f"--validation_fraction={validation_fraction!r} must be 0 or at least "
                     f"{MIN_FRACTION}.")
  for name, value, low in (("shard_tokens", shard_tokens, 1), ("chunk_chars", chunk_chars, 1),
                           ("bpe_training_chars", bpe_training_chars, 1)):
    if not (isinstance(value, int) and value >= low):
      raise UsageError(f"--{name}={value!r} must be an integer >= {low}.")
  check_tokenizer_spec(tokenizer)


def _check_destinations(out: str, names) -> None:
  """Each name in `out` is absent or a regular file: a file is never written through a link
  or a FIFO planted there (UnsafeFile naming it)."""
  for name in names:
    path = os.path.join(out, name)
    if os.path.islink(path):
      raise files_lib.UnsafeFile(path, files_lib.link_problem(path))
    if os.path.lexists(path) and not os.path.isfile(path):
      raise files_lib.UnsafeFile(path, files_lib.NOT_REGULAR)


def _check_out(out: str) -> None:
  """`--out`: new, or a folder without a prepared corpus (its other files are kept)."""
  if os.path.lexists(out) and not os.path.isdir(out):
    raise UsageError(f"--out={out!r} is a file; name a new or empty folder.")
  if os.path.lexists(os.path.join(out, shards.MANIFEST)):
    raise UsageError(f"--out={out!r} already holds a prepared corpus; choose another folder.")
  if os.path.isdir(out):
    _check_destinations(out, [shards.TOKENIZER_FILE, shards.MANIFEST] + [
        f"{split}-00000.{ext}" for split in shards.SPLITS for ext in ("bin", "idx")])


def _new_build_folder(out: str) -> str:
  """A fresh folder beside `out` (same file system, so the final move is a rename)."""
  parent, name = os.path.split(os.path.abspath(out))
  os.makedirs(parent, exist_ok=True)
  path = os.path.join(parent, f".{name}.partial-{secrets.token_hex(4)}")
  os.mkdir(path)
  return path


def _move_into_place(built: str, out: str) -> None:
  """`built` becomes `out`: one rename when `out` is new, else its files moved in one by one,
  the manifest last (a folder without it is unfinished)."""
  if not os.path.lexists(out):
    os.rename(built, out)
    return
  names = sorted(os.listdir(built), key=lambda name: name == shards.MANIFEST)
  _check_destinations(out, names)
  for name in names:
    os.replace(os.path.join(built, name), os.path.join(out, name))
  os.rmdir(built)


def _say(message: str) -> None:
  print(f"prepare_data: {message}", file=sys.stderr, flush=True)


def prepare(inputs: list[str], tokenizer: str, out: str, validation_fraction: float = 0.01,
            shard_tokens: int = 1 << 27, documents: str = "file", text_field: str = "text",
            chunk_chars: int = 1 << 20, bpe_training_chars: int = 50_000_000,
            eos_token: str | None = None) -> dict:
  """Writes the shards and manifest of `inputs` to `out`; returns the manifest. Flags are
  checked first (UsageError), then the inputs are counted, then tokenized."""
  _check_flags(documents, validation_fraction, shard_tokens, chunk_chars, bpe_training_chars,
               tokenizer)
  files, skipped = input_files(inputs)
  _check_out(out)
  if skipped:
    _say(skipped_notice(skipped))
  cut = None  # with too few documents: the first character of the held-out tail
  if validation_fraction > 0:
    enough = documents_to_hold_one_out(validation_fraction)
    found = count_documents(files, documents, text_field, chunk_chars, enough)
    if 0 < found < enough:
      chars = sum(len(t) for t, _, _ in pieces(files, documents, text_field, chunk_chars))
      cut = chars - math.ceil(validation_fraction * chars)
      _say(f"{found} document(s), fewer than the {enough} that --validation_fraction="
           f"{validation_fraction} needs to hold one out: validation is the text's tail instead, "
           f"from the line holding character {cut:,} of {chars:,}.")
  else:
    _say("warning: --validation_fraction=0 holds nothing out, and train.py refuses a corpus "
         "without a validation window.")
  total_bytes = sum(os.path.getsize(p) for p in files)
  tok, tokenizer_entry = make_tokenizer(tokenizer, files, documents, text_field, chunk_chars,
                                        bpe_training_chars, eos_token, total_bytes)
  built = _new_build_folder(out)
  try:
    try:
      manifest = _write(built, files, tok, tokenizer_entry, validation_fraction, cut,
                        shard_tokens, documents, text_field, chunk_chars, total_bytes)
    except UnencodableText as error:  # a tokenizer.json without the corpus's characters
      raise ArgumentError("tokenizer", f"--tokenizer={tokenizer!r} cannot encode the input: "
                          f"{error} Prepare with a tokenizer that covers the text (e.g. "
                          "--tokenizer=char or bpe:N).") from None
    if not manifest["splits"]["train"]["tokens"]:
      raise ValueError(f"--input={','.join(inputs)!r}: no training document (the inputs are "
                       "empty or every document went to validation).")
    _move_into_place(built, out)
  except BaseException:
    shutil.rmtree(built, ignore_errors=True)
    raise
  held_out = manifest["splits"]["validation"]["tokens"]
  if validation_fraction > 0 and held_out < FEW_WINDOWS * WINDOW:
    windows = held_out // WINDOW
    _say(f"warning: the validation split holds {held_out:,} tokens, " + (
        f"{windows} window(s) of {WINDOW} (configs/corpus.py's length): an evaluation repeats "
        "them" if windows else f"less than one window of {WINDOW} (configs/corpus.py's "
        "length): train.py refuses it at that length") + "; a larger --validation_fraction or "
        "more text holds out more.")
  return manifest


def _write(folder, files, tok, tokenizer_entry, validation_fraction, cut, shard_tokens,
           documents, text_field, chunk_chars, total_bytes) -> dict:
  """Tokenizes the inputs into `folder`: tokenizer, shards, then the manifest."""
  tokenizer_path = os.path.join(folder, shards.TOKENIZER_FILE)
  with files_lib.create_file(tokenizer_path, exclusive=True) as f:
    f.write(shards.tokenizer_json(tok).encode("utf-8"))
  dtype = shards.dtype_for(tok.size)
  writers = {s: shards.SplitWriter(folder, s, dtype, tok.eos_id, shard_tokens)
             for s in shards.SPLITS}
  document, writer = 0, None  # the document being written and its split's writer
  batch, batch_chars, seen = [], 0, 0  # seen: characters read

  def flush():
    nonlocal document, writer
    texts = [t for t, _, _ in batch]
    for (_, ends, held_out), ids in zip(batch, shards.encode_many(tok, texts)):
      if writer is None and len(ids):  # a document opens with its first token
        if held_out is None:
          held_out = in_validation(document, validation_fraction)
        writer = writers["validation" if held_out else "train"]
      if len(ids):
        writer.write(ids)
      if ends and writer is not None:
        writer.end_document()
        writer, document = None, document + 1
    batch.clear()

  with _progress(total_bytes, "tokenizing") as bar:
    for text, ends, size in pieces(files, documents, text_field, chunk_chars):
      if cut is None:
        batch.append((text, ends, None))
      elif seen <= cut < seen + len(text):  # the tail starts in this piece
        at = text.rfind("\n", 0, cut - seen) + 1  # its line's start (a piece starts a line)
        if at == 0 and seen == 0:  # the first line: cut at the character, training keeps text
          at = cut
        batch += [(text[:at], True, False), (text[at:], ends, True)]
      else:
        batch.append((text, ends, seen >= cut))
      seen += len(text)
      batch_chars += len(text)
      bar.update(size)
      if batch_chars >= chunk_chars:
        flush()
        batch_chars = 0
    flush()
    bar.update(bar.total - bar.n)  # bytes counted on decoded text: \r\n reads as \n
  splits = {s: w.close() for s, w in writers.items()}
  manifest = {
      "format": shards.FORMAT, "version": shards.VERSION,
      "vocab_size": tok.size, "eos_id": int(tok.eos_id), "dtype": dtype.name,
      "tokenizer": {"file": shards.TOKENIZER_FILE, "sha256": shards.sha256_of(tokenizer_path),
                    "eos_token": getattr(tok, "eos_token", None), **tokenizer_entry},
      "documents": documents, "text_field": text_field,
      "validation_fraction": validation_fraction,
      "validation_rule": "documents" if cut is None else "tail",
      "shard_tokens": shard_tokens,
      "inputs": [{"path": os.path.abspath(p), "bytes": os.path.getsize(p)} for p in files],
      "splits": splits}
  if cut is not None:
    manifest["validation_from_character"] = cut
  shards.write_manifest(folder, manifest)
  return manifest


def main(argv=None) -> int:
  parser = cli.Parser("prepare_data", prog="python -m mdjax.prepare_data",
                      description=__doc__.split("\n")[0])
  parser.add_argument("--input", required=True,
                      help="comma-separated .txt / .md / .jsonl files or folders of them")
  parser.add_argument("--tokenizer", required=True, help="char, bpe:N or a tokenizer.json")
  parser.add_argument("--out", required=True,
                      help="the folder to write (new, or one without a manifest.json)")
  parser.add_argument("--validation_fraction", type=float, default=0.01,
                      help="fraction of documents held out (default 0.01; of the text's tail "
                           "when the documents are fewer than 1/fraction)")
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
  except UsageError as error:
    return cli.report("prepare_data", error, cli.USAGE)
  except (ValueError, OSError, UnicodeDecodeError) as error:
    return cli.report("prepare_data", error, cli.RUNTIME)
  train, validation = manifest["splits"]["train"], manifest["splits"]["validation"]
  print(f"{args.out}: {manifest['vocab_size']} ids ({manifest['dtype']}), train "
        f"{train['tokens']:,} tokens / {train['documents']:,} documents in "
        f"{len(train['shards'])} shard(s), validation {validation['tokens']:,} tokens / "
        f"{validation['documents']:,} documents")
  return 0


if __name__ == "__main__":
  sys.exit(main())
