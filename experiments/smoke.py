"""Smoke runs of the research scripts: their command line with `--smoke`, and tiny text models.

  python experiments/<script>.py --smoke --out=DIR [--workdir=DIR ...]

runs a script end to end at sizes that take seconds (each script's `smoke` says which) and
writes its results files to DIR, as the full run writes them to results/. The exact denoiser
stands in for the trained ScanAndAdd models, and the Shakespeare configs are cut to a tiny
network trained in seconds on a tiny corpus (experiments/tiny_text.py), written to
WORKDIR/corpus.txt where missing; models already trained there at those sizes are reused.
A smoke run checks that a script runs and what its files hold, not its numbers.
tests/test_experiments.py runs each script this way, in a subprocess; no test imports a
script.
"""

from __future__ import annotations

import argparse
import os
import pathlib


def experiment_main(doc: str, run, write, markdown_name: str, default_n: int,
                    options: dict[str, tuple[str, str]] | None = None, smoke=None,
                    smoke_n: int | None = None) -> None:
  """`mdjax.report.experiment_main`'s command line (--n, --out, string options passed to
  `run` by name) with --smoke: `smoke(**options)` sets the script's smoke sizes and returns
  the keyword arguments `run` gets (the options, and stand-ins for trained models); --n
  defaults to `smoke_n` there."""
  parser = argparse.ArgumentParser(description=doc.splitlines()[0])
  parser.add_argument("--n", type=int, default=None,
                      help=f"samples per point (default {default_n}; --smoke: {smoke_n})")
  parser.add_argument("--out", default="results", help="output directory")
  for name, (default, help_text) in (options or {}).items():
    parser.add_argument(f"--{name}", default=default, help=help_text)
  if smoke is not None:
    parser.add_argument("--smoke", action="store_true",
                        help="sizes that take seconds: " + " ".join(smoke.__doc__.split()))
  args = parser.parse_args()
  smoking = getattr(args, "smoke", False)
  n = args.n if args.n is not None else (smoke_n if smoking else default_n)
  if n < 1:
    parser.error(f"--n={n} must be >= 1")
  kwargs = {name: getattr(args, name) for name in options or {}}
  if smoking:
    kwargs = smoke(**kwargs)
  write(run(n, **kwargs), args.out)
  with open(os.path.join(args.out, markdown_name)) as f:
    print(f.read())


def text_config(workdir: str, causal: bool = False):
  """configs/shakespeare_char.py (or the causal reference) cut to seconds on the tiny corpus
  WORKDIR/corpus.txt, written first if missing: `tiny_text.tiny_config`, so
  that a workdir the tests trained is reused."""
  from experiments.tiny_text import tiny_config, write_corpus
  path = os.path.join(workdir, "corpus.txt")
  if not os.path.exists(path):
    os.makedirs(workdir, exist_ok=True)
    write_corpus(pathlib.Path(path))
  return tiny_config(path, causal)
