"""JSON Lines input: the rows of a file, a line that is not JSON named."""

from __future__ import annotations

import json
from typing import Any, Iterator


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
