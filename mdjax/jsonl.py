"""JSON in and out: the rows of a JSON Lines file (a line that is not JSON named), and strict
JSON for every file mdjax writes (a value that is not finite as null, never a bare NaN).

Every JSON text mdjax parses from a file or a request has its nesting counted on its raw text
first (`json_depth`, linear in its length, no recursion): Python's parser recurses a level a
frame, and a text nested some 1,000 deep ends in a RecursionError instead of a message."""

from __future__ import annotations

import json
import math
import re
from typing import Any, Iterable, Iterator

import numpy as np

from mdjax.errors import ArgumentError

# The deepest nesting of arrays and objects a JSON file mdjax reads may hold (a JSONL row,
# a config.json). Real ones need a handful of levels (a chat row: the row, its messages, a
# message, its content parts, a part = 5; a Hugging Face config.json 3); 256 leaves room for
# any metadata a row carries, while the parser, which spends a Python frame a level, stays
# far from the interpreter's recursion limit (1,000) from wherever it is called.
MAX_DEPTH = 256

# A backslash and the character it escapes: removed before quotes are paired (in JSON a
# backslash stands in strings only, so what is left of a string's quotes are its ends).
_ESCAPE = re.compile(rb"\\.", re.S)
_QUOTE, _OPEN, _CLOSE = ord('"'), np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def json_depth(raw: bytes | str) -> int:
  """The deepest nesting of arrays and objects in a JSON text, counted on its bytes without
  parsing it, in time linear in its length (brackets inside strings do not count; after an
  unclosed string nothing does: the text is not JSON, and a parser stops there)."""
  if isinstance(raw, str):
    raw = raw.encode("utf-8", "surrogatepass")
  if not raw:
    return 0
  chars = np.frombuffer(_ESCAPE.sub(b"", raw), np.uint8)
  outside = np.cumsum(chars == _QUOTE) % 2 == 0  # after an even count of quotes
  change = (np.isin(chars, _OPEN).astype(np.int32) - np.isin(chars, _CLOSE)) * outside
  return int(np.cumsum(change).max(initial=0))


def check_depth(text: bytes | str, where: str, param: str | None = None,
                bound: int = MAX_DEPTH) -> None:
  """An ArgumentError (a ValueError) naming `where` (a file, a file and line) and `param` when
  `text` nests arrays and objects deeper than `bound`. Cheap for the usual text: its brackets
  are counted (two C scans) before any depth is."""
  if text.count("[" if isinstance(text, str) else b"[") + text.count(
      "{" if isinstance(text, str) else b"{") <= bound:
    return
  depth = json_depth(text)
  if depth > bound:
    raise ArgumentError(param, f"{where}: nests {depth:,} levels of JSON arrays and objects; "
                        f"at most {bound} are read.")


def loads(text: bytes | str, where: str, param: str | None = None, **kwargs) -> Any:
  """json.loads of `text` after `check_depth`: a text nested too deep is an ArgumentError
  naming `where`, never a RecursionError (one left by a deep caller's stack is reported the
  same way). json.JSONDecodeError and the parser's other ValueErrors pass through."""
  check_depth(text, where, param)
  try:
    return json.loads(text, **kwargs)
  except RecursionError:
    raise ArgumentError(param, f"{where}: nested too deeply to read (at most {MAX_DEPTH} levels "
                        "of JSON arrays and objects).") from None


def finite(value: Any) -> Any:
  """`value` with every float that is not finite (a NaN loss, an inf bound) as None, inside
  dicts, lists and tuples too: what strict JSON parsers read, where Python's NaN is refused."""
  if isinstance(value, float):
    return value if math.isfinite(value) else None
  if isinstance(value, dict):
    return {k: finite(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [finite(v) for v in value]
  return value


def dumps(value: Any, **kwargs) -> str:
  """json.dumps of `finite(value)`: strict JSON (allow_nan=False)."""
  return json.dumps(finite(value), allow_nan=False, **kwargs)


def dump(value: Any, f, **kwargs) -> None:
  """json.dump of `finite(value)` into the text file `f`: strict JSON."""
  json.dump(finite(value), f, allow_nan=False, **kwargs)


def read_rows(path: str, argument: str) -> Iterator[tuple[int, Any]]:
  """(line number, parsed row) for each non-blank line of `path`; a line that is not JSON, or
  nests deeper than MAX_DEPTH, is an ArgumentError naming `argument`, the file and the line."""
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = loads(line, f"{argument}={path!r} line {number}", argument)
      except json.JSONDecodeError as error:
        raise ArgumentError(argument, f"{argument}={path!r} line {number}: not JSON "
                            f"({error.msg}).") from None
      yield number, row


def log_rows(lines: Iterable[str], where: str) -> Iterator[dict]:
  """The JSON objects among `lines` (of the log `where`, such as metrics.jsonl), parsed; every
  other line is skipped: one cut short by a kill, not JSON, nested deeper than MAX_DEPTH, or
  not an object. For logs a run appends to, where a bad line is one lost row, not a stop."""
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      row = loads(line, f"{where} line {number}")
    except ValueError:  # JSONDecodeError, or nested too deep (ArgumentError)
      continue
    if isinstance(row, dict):
      yield row
