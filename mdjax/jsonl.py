"""JSON in and out: the rows of a JSON Lines file (a line that is not JSON named), and strict
JSON for every file mdjax writes (a value that is not finite as null, never a bare NaN)."""

from __future__ import annotations

import json
import math
from typing import Any, Iterator


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
  """(line number, parsed row) for each non-blank line of `path`; a line that is not JSON is
  a ValueError naming `argument`, the file and the line."""
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as error:
        raise ValueError(f"{argument}={path!r} line {number}: not JSON ({error.msg}).") from None
      yield number, row
