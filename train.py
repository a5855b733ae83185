"""Trains a masked-diffusion denoiser.

  python train.py --config=configs/two_color.py --workdir=/tmp/two_color [--config.seed=1]

Resumes from the newest readable checkpoint in --workdir (an unreadable one is moved to
workdir/checkpoints_corrupt). SIGTERM or Ctrl-C saves a checkpoint at the current step and
exits 0; the same command resumes. One run per workdir (workdir/train.lock).

Several processes (hosts, or GPUs) run the same command, each with its id:

  python train.py --config=... --workdir=SHARED_DIR --coordinator=HOST0:1234 \
      --num_processes=2 --process_id=0   # and --process_id=1 elsewhere

or with JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID set; under `srun` with
several tasks SLURM's variables are read, and --distributed lets JAX find a TPU pod slice.
See docs/training.md, "Many processes and hosts".

Errors are one line, `train.py: error: ...`: exit status 2 for a command line or config
value that cannot work (a usage error), 1 for what the run met (a busy, unsafe or
unwritable workdir, a checkpoint of another model, the cluster).
"""

import ast
import difflib
import glob
import os
import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_HERE = os.path.dirname(os.path.abspath(__file__))


def _config_files() -> list[str]:
  """The training configs, as configs/NAME.py (bench_*: sampling benchmarks, not trained)."""
  names = [os.path.basename(p) for p in glob.glob(os.path.join(_HERE, "configs", "*.py"))]
  return sorted(f"configs/{n}" for n in names
                if n not in ("__init__.py", "base.py") and not n.startswith("bench"))


def _first_sentence(doc: str) -> str:
  """The docstring's first sentence, whatever its line breaks."""
  paragraph = " ".join(doc.split("\n\n")[0].split())
  return re.split(r"(?<=\.)\s+(?=[A-Z])", paragraph)[0]


def _config_help() -> str:
  """The config files and the fields a user can override, for --help."""
  lines = ["Config file with get_config(). Available:"]
  for name in _config_files():
    with open(os.path.join(_HERE, name), encoding="utf-8") as f:
      doc = ast.get_docstring(ast.parse(f.read())) or ""
    lines.append(f"  {name}: {_first_sentence(doc)}")
  try:
    sys.path.insert(0, _HERE)
    from configs.base import base_config
    fields = []

    def walk(node, prefix):
      for key, value in sorted(node.items()):
        if hasattr(value, "items"):
          walk(value, f"{prefix}{key}.")
        else:
          fields.append(f"{prefix}{key}={value!r}")

    walk(base_config(), "")
    lines.append("Override any field with --config.FIELD=VALUE; fields (base defaults):")
    lines.append("  " + ", ".join(fields))
    lines.append("  text configs also take task_kwargs.text_path=FILE (your own UTF-8 text).")
  except Exception:  # --help must never fail
    pass
  return "\n".join(lines)


_CONFIG = config_flags.DEFINE_config_file("config", None, _config_help(), lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")
flags.mark_flags_as_required(["config", "workdir"])
_COORDINATOR = flags.DEFINE_string(
    "coordinator", None, "HOST:PORT of process 0 when several processes train together "
    "(else JAX_COORDINATOR_ADDRESS).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "How many processes train "
                                      "together (else JAX_NUM_PROCESSES).", lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's id, 0 to "
                                   "num_processes - 1 (else JAX_PROCESS_ID).", lower_bound=0)
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Let JAX find the processes (TPU pod slices, SLURM, Open MPI, "
    "Kubernetes): jax.distributed.initialize() without arguments.")
_INIT_TIMEOUT = flags.DEFINE_integer(
    "init_timeout", 300, "Seconds to wait for the coordinator and the other processes.",
    lower_bound=1)
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    "heartbeat_timeout", 100, "Seconds after which the processes stop when one of them no "
    "longer answers.", lower_bound=1)


_HELP_FLAGS = ("help", "helpshort", "helpfull", "helpxml", "?", "h")


def _command_line_error(argv: list[str], check_fields: bool = True) -> str | None:
  """A missing config file, or (`check_fields`, loading the config) an override of a field
  the config lacks, as one line naming the flag and what is allowed (ml_collections would
  raise a long traceback); else None."""
  args = argv[1:argv.index("--")] if "--" in argv else argv[1:]
  path, overrides = None, []
  for i, arg in enumerate(args):
    if not arg.startswith("-"):
      continue
    name, has_value, value = arg.lstrip("-").partition("=")
    if name in _HELP_FLAGS:
      return None
    if name == "config":
      path = value if has_value else (args[i + 1] if i + 1 < len(args) else None)
    elif name.startswith(("config.", "noconfig.")):  # noconfig.X: a boolean set to False
      overrides.append((name.removeprefix("no").split(".")[1:], arg))
  if path is None:
    return None  # absl names the missing flag
  file = path.split(":", 1)[0]
  if not os.path.isfile(file):
    configs = _config_files()
    close = difflib.get_close_matches(file, configs, n=1)
    hint = f"did you mean --config={close[0]}? " if close else ""
    return f"--config={path!r} is not a file; {hint}the configs: {', '.join(configs)}."
  if not check_fields:
    return None
  try:
    config = flags.FLAGS["config"].parser.parse(path)  # the loader --config itself uses
  except ValueError as e:  # the file refused its argument (--config=configs/NAME.py:ARG)
    while e.__context__ is not None:  # ml_collections re-raises it with its traceback as text
      e = e.__context__
    return f"--config={path!r}: {e}"
  except Exception:  # an error inside the file: its own traceback tells more
    return None
  for parts, arg in overrides:
    node = config
    for depth, part in enumerate(parts):
      if isinstance(node, (bool, int, float, str)):
        return f"{arg}: {file}'s field {'.'.join(parts[:depth])!r}={node!r} holds no fields."
      if "[" in part or not hasattr(node, "keys"):
        break  # an index, or a field inside another value: ml_collections checks these
      if part not in node:
        parent = ".".join(parts[:depth])
        fields = sorted(node.keys())
        close = difflib.get_close_matches(part, fields, n=1)
        hint = f" (did you mean {'.'.join(parts[:depth] + close)!r}?)" if close else ""
        where = f"{parent} holds" if parent else "its fields:"
        return (f"{arg}: {file} has no field {'.'.join(parts[:depth + 1])!r}{hint}; "
                f"{where} {', '.join(fields)}.")
      node = node[part]
  return None


USAGE, RUNTIME = 2, 1  # exit statuses


def _fail(error, status: int):
  print(f"train.py: error: {error}", file=sys.stderr)
  sys.exit(status)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, its errors on one line (the config file is loaded once when the
  command line is right; only a failed parse looks at it again to say why)."""
  # A missing file first: ml_collections reports it only when the config is first read.
  error = _command_line_error(argv, check_fields=False)
  if error is None:
    try:
      return flags.FLAGS(argv)
    except Exception as parse_error:  # ml_collections raises more than flags.Error
      error = _command_line_error(argv)
      if error is None:
        if not isinstance(parse_error, flags.Error):
          raise
        error = str(parse_error)
  _fail(error, USAGE)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  from mdjax.train import distributed  # imports jax, makes no array: initialize comes first
  try:
    cluster = distributed.cluster_from(_COORDINATOR.value, _NUM_PROCESSES.value,
                                       _PROCESS_ID.value, auto=_DISTRIBUTED.value)
    distributed.initialize(cluster, _INIT_TIMEOUT.value, _HEARTBEAT_TIMEOUT.value)
  except (ValueError, RuntimeError) as error:
    _fail(error, RUNTIME)
  from mdjax import rl, train  # rl: registers the objectives 'grpo' and 'wd1'
  # register 'cdlm', 'dparallel', 'd3llm' and 'duo'
  from mdjax.accelerators import cdlm, distill, duo
  del rl, cdlm, distill, duo
  try:
    train.train(_CONFIG.value, _WORKDIR.value)
  except train.ConfigError as error:
    _fail(error, USAGE)
  except (train.CheckpointMismatch, train.WorkdirBusy, train.UnsafeWorkdir,
          PermissionError) as error:
    _fail(error, RUNTIME)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
