"""lm-eval's command line with the "mdjax" model registered (lm-eval 0.4 has no plugin discovery).

  python -m mdjax.evaluate.lm_eval --model mdjax --model_args checkpoint=DIR,num_samples=128 \\
      --tasks hellaswag --batch_size 8 [any other lm_eval argument]

The same arguments as `lm_eval` (they all pass through to its CLI; `--model` defaults to mdjax).
Before lm-eval's setup, the mdjax model's arguments are checked by the model's own rules
(`harness.check_model_args`): an unknown --model_args key, a value the model refuses
(checkpoint=DIR that is not a folder, an unknown sampler= or estimator=, num_samples not a
multiple of mc_batch_size, ...) or a --batch_size that is not an integer is one line,
`lm_eval: error: ...`, and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from mdjax import cli


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m mdjax.evaluate.lm_eval", add_help=False)
  parser.add_argument("--model", default="mdjax")
  parser.add_argument("--model_args", default="")
  parser.add_argument("--batch_size", default="1")
  parser.add_argument("--tasks", default=None)
  parser.add_argument("--include_path", default=None)
  return parser


def check(argv: list[str]) -> str | None:
  """The first problem of the arguments for the mdjax model (None: none), found without
  loading anything."""
  known, _ = _parser().parse_known_args(argv)
  if known.model != "mdjax":
    return None  # another lm-eval model: its own checks
  from lm_eval.utils import simple_parse_args_string

  from mdjax.evaluate import harness
  if not known.tasks:
    return "--tasks is required: lm-eval task names, or YAML tasks under --include_path."
  try:
    harness.check_model_args(simple_parse_args_string(known.model_args), values=True)
  except ValueError as error:
    return f"--model_args: {error}"
  if not str(known.batch_size).isdigit() or int(known.batch_size) < 1:
    return (f"--batch_size={known.batch_size!r}: the mdjax model takes an integer >= 1 "
            "(requests per call; no 'auto').")
  if known.include_path is not None and not os.path.isdir(known.include_path):
    return f"--include_path={known.include_path!r} is not a folder of task YAML files."
  return None


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] not in ("run", "ls", "validate", "-h", "--help") \
      and not any(a == "--model" or a.startswith("--model=") for a in argv):
    argv = ["--model", "mdjax"] + argv
  problem = check(argv[1:] if argv and argv[0] == "run" else argv)
  if problem:
    cli.fail("lm_eval", problem, cli.USAGE)
  import mdjax.evaluate.harness  # noqa: F401  registers "mdjax"
  from lm_eval.__main__ import cli_evaluate
  sys.argv = [sys.argv[0]] + argv
  cli_evaluate()


if __name__ == "__main__":
  main()
