"""Trains a masked-diffusion denoiser.

  python train.py --config=configs/two_color.py --workdir=/tmp/two_color [--config.seed=1]

Resumes from the newest checkpoint in --workdir. On several hosts, set the
usual JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID variables:
jax.distributed.initialize() is then called before anything else.
"""

import os

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file with get_config().",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  import jax
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    jax.distributed.initialize()
  from mdjax import train
  train.train(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
