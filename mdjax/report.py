"""Writing experiment results: JSON, a markdown table and a PNG figure."""

from __future__ import annotations

import os
from typing import Any, Sequence

from mdjax import files, jsonl
from mdjax.errors import ArgumentError


def write_json(path: str, data: Any) -> None:
  """Writes `data` as indented strict JSON, atomically (a fresh temp file, then a rename)."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with files.atomic_write(path, "w") as f:
    jsonl.dump(data, f, indent=2)
    f.write("\n")


def _cell(value) -> str:
  if isinstance(value, float):
    return f"{value:.4g}"
  return str(value)


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
  """A GitHub markdown table of `rows` restricted to `columns`."""
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  for row in rows:
    lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |")
  return "\n".join(lines) + "\n"


def write_text(path: str, text: str) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    f.write(text)


def new_figure(**kwargs):
  """A matplotlib figure and axes with a non-interactive backend."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt.subplots(**kwargs)


def save_figure(fig, path: str) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def experiment_main(doc: str, run, write, markdown_name: str, default_n: int,
                    options: dict[str, tuple[str, str]] | None = None) -> None:
  """The command line every experiment shares: --n samples, --out directory.

  `options` adds string flags, name -> (default, help), passed to `run` by name.
  """
  import argparse
  parser = argparse.ArgumentParser(description=doc.splitlines()[0])
  parser.add_argument("--n", type=int, default=default_n, help="samples per point")
  parser.add_argument("--out", default="results", help="output directory")
  for name, (default, help_text) in (options or {}).items():
    parser.add_argument(f"--{name}", default=default, help=help_text)
  args = parser.parse_args()
  if args.n < 1:
    parser.error(f"--n={args.n} must be >= 1")
  try:
    results = run(args.n, **{name: getattr(args, name) for name in options or {}})
  except ArgumentError as error:  # a bad input file (--rows_from): one line, exit status 2
    parser.error(str(error))
  write(results, args.out)
  with open(os.path.join(args.out, markdown_name)) as f:
    print(f.read())
