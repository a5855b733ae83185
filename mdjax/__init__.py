"""mdjax: masked (absorbing-state) discrete diffusion in JAX.

`mdjax.load(workdir, step=None)` restores a trained model (see `mdjax.train.Model`).
"""

from mdjax import diffusion
from mdjax.denoiser import Denoiser
from mdjax.diffusion import (
    CosineSchedule,
    LinearSchedule,
    LogLinearSchedule,
    PolynomialSchedule,
    Schedule,
    get_schedule,
)

__version__ = "0.1.0"


def load(workdir: str, step: int | None = None, **kwargs):
  """The trained model of a train.py workdir: a `mdjax.train.Model` with `apply_fn`,
  `params`, `task`, `tokenizer`, `config` and `step`.

  The newest readable checkpoint, or `step`; needs no corpus file (the tokenizer is saved
  with the checkpoint) and only reads the workdir. Quiet: orbax's warnings are silenced,
  and an unreadable newest checkpoint is one line on stderr (or through `log=`).

    model = mdjax.load("/tmp/quickstart")
    logits_BxLxV = model.apply_fn(model.params, tokens_BxL, t_B)
  """
  from mdjax import train  # orbax and the models load on first use only
  return train.load(workdir, step, **kwargs)
