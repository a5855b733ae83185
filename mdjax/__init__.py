"""mdjax: masked (absorbing-state) discrete diffusion in JAX.

The face: `load(path) -> Model` (a train.py workdir, a published folder, a task's exact
denoiser) and `generate(model, prompts, ...)` (completions for any model, one key rule).

    model = mdjax.load("/tmp/mdjax_quickstart")  # the README quickstart's workdir
    out = mdjax.generate(model, ["OTHELLO."], max_new_tokens=40, key=jax.random.key(0))
    logits_BxLxV = model.denoiser(model.params, tokens_BxL, t_B)
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


def load(path: str, step: int | None = None, **kwargs):
  """The model at `path` as a `mdjax.Model`: a train.py workdir (its newest readable
  checkpoint, or step=), a published Hugging Face folder or torch .ckpt (dtype=, mesh=), or
  a task name (its exact denoiser). See `mdjax.loader.load`."""
  from mdjax import loader  # orbax, the models and the readers load on first use only
  return loader.load(path, step=step, **kwargs)


# The samplers load on first use (`import mdjax` alone, as the tasks do, stays light).
_LAZY = {"generate": "mdjax.generation", "generate_ids": "mdjax.generation",
         "Completion": "mdjax.generation", "Completions": "mdjax.generation",
         "Model": "mdjax.model"}


def __getattr__(name: str):
  if name in _LAZY:
    import importlib
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'mdjax' has no attribute {name!r}")
