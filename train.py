"""Trains a masked-diffusion denoiser.

  python train.py --config=configs/two_color.py --workdir=/tmp/two_color [--config.seed=1]

Resumes from the newest readable checkpoint in --workdir (an unreadable one is moved to
workdir/checkpoints_corrupt). SIGTERM or Ctrl-C saves a checkpoint at the current step and
exits 0; the same command resumes. One run per workdir (workdir/train.lock). On several
hosts, set the usual JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
variables: jax.distributed.initialize() is then called before anything else.
"""

import ast
import glob
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_HERE = os.path.dirname(os.path.abspath(__file__))


def _config_help() -> str:
  """The config files and the fields a user can override, for --help."""
  lines = ["Config file with get_config(). Available:"]
  for path in sorted(glob.glob(os.path.join(_HERE, "configs", "*.py"))):
    name = os.path.basename(path)
    if name in ("__init__.py", "base.py") or name.startswith("bench"):
      continue
    with open(path, encoding="utf-8") as f:
      doc = ast.get_docstring(ast.parse(f.read())) or ""
    lines.append(f"  configs/{name}: {doc.splitlines()[0] if doc else ''}")
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


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  import jax
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    jax.distributed.initialize()
  from mdjax import train
  try:
    train.train(_CONFIG.value, _WORKDIR.value)
  except (train.ConfigError, train.CheckpointMismatch, train.WorkdirBusy,
          PermissionError) as error:
    print(f"train.py: error: {error}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
