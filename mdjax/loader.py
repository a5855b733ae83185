"""`load(path) -> Model`: one entry for every model mdjax samples or scores.

  a train.py workdir (a folder with checkpoints/)      -> `mdjax.train.load`
  a published Hugging Face folder (config.json), or a torch / Lightning .ckpt
                                                         -> `mdjax.io.load`
  gemma's params checkpoint (an orbax folder: DiffusionGemma)
                                                         -> `mdjax.io.gemma_params.load`
  a task's name ("two_color", "oracle:scan_and_add")    -> the task's exact denoiser
      (noise="uniform" / "hybrid" / a `mdjax.noise` process: exact under that process)

Whatever it was, the result is one `mdjax.Model`, which `mdjax.generate`, sample.py, the
lm-eval model and generative perplexity take as it is.
"""

from __future__ import annotations

import os
from typing import Any

from mdjax import errors
from mdjax import mesh as mesh_lib
from mdjax import noise as noise_lib
from mdjax import io, tasks, train
from mdjax import quantize as quantize_lib
from mdjax.io import gemma_params
from mdjax.model import ORACLE_FAMILY, ConfiguredSampler, Model, task_model

ORACLE_PREFIX = "oracle:"
CKPT_SUFFIXES = (".ckpt", ".pt", ".pth")  # a torch checkpoint `mdjax.io.load` reads


def kind_of(path: str) -> str:
  """"workdir", "published" or "oracle": what `load` reads at `path` (a ValueError when it
  is none of them)."""
  src = os.fspath(path)
  if src.startswith(ORACLE_PREFIX) or (not os.path.exists(src) and src in tasks.TASKS):
    return "oracle"
  if os.path.isdir(os.path.join(src, "checkpoints")):
    return "workdir"
  if (os.path.isfile(os.path.join(src, "config.json")) or gemma_params.is_checkpoint(src) or
      (os.path.isfile(src) and src.endswith(CKPT_SUFFIXES)) or
      (os.path.isdir(src) and any(n.endswith(".ckpt") for n in os.listdir(src)))):
    return "published"
  if not os.path.exists(src):
    raise ValueError(f"path={src!r} does not exist (a train.py workdir, a published folder, a "
                     f"torch .ckpt, or a task name: {', '.join(sorted(tasks.TASKS))}).")
  raise ValueError(f"path={src!r} is neither a train.py workdir (no checkpoints/), a published "
                   "folder (no config.json) nor a torch checkpoint (.ckpt, .pt, .pth).")


def load(path: str, *, dtype: str | None = None, mesh=None, step: int | None = None,
         task_kwargs: dict | None = None, noise=None, quantize: str | None = None,
         **kwargs: Any) -> Model:
  """The model at `path` (module docstring) as a `Model`.

  dtype: a published checkpoint's ("float32", "bfloat16"; None keeps the checkpoint's).
  mesh: the params stored sharded over it: by the FSDP rule of `mdjax.mesh`, or, on a mesh
  with 'tensor' / 'expert' axes, a published Transformer's heads, hidden columns and
  LLaDA2's experts split over them (docs/devices.md; an ArgumentError before any weight is
  read when they do not divide). step: a
  workdir's checkpoint step (default the newest readable). task_kwargs: an oracle task's
  parameters. noise: an oracle's noise process, by name ("absorbing", "uniform", "hybrid",
  each with the linear schedule) or as a `mdjax.noise` process value; the model is the exact
  posterior p(x0_i | x_t) under it, by enumerating the task's law (`Task.support`; a task
  whose law is too large says so), with params the enumerated law and `Model.noise` the
  process. None (the default) is the task's own absorbing oracle. quantize: "int8" or
  "int4" stores a workdir's or a published checkpoint's weight matrices as integers with
  float scales, dequantized where each is used (`mdjax.quantize`; None: float weights).
  Other keywords go to the
  loader of that kind (`mdjax.io.load`'s config= and ema=, `train.load`'s log=). Every argument that does not apply to the kind found is a
  ValueError naming it.
  """
  quantize_lib.check_mode(quantize)
  kind = kind_of(path)
  given = {"dtype": dtype, "step": step, "task_kwargs": task_kwargs, "noise": noise,
           "quantize": quantize}
  applies = {"workdir": ("step", "quantize"), "published": ("dtype", "quantize"),
             "oracle": ("task_kwargs", "noise")}[kind]
  wrong = [name for name, value in given.items() if value is not None and name not in applies]
  if wrong:
    raise ValueError(f"{wrong[0]}={given[wrong[0]]!r} does not apply to {path!r}, a {kind} "
                     f"(its arguments: {', '.join(applies) or 'none'}).")
  if kind != "published" or gemma_params.is_checkpoint(os.fspath(path)):
    what = {"workdir": "a train.py workdir", "oracle": "a task's exact denoiser",
            "published": "a DiffusionGemma checkpoint"}[kind]
    mesh_lib.refuse_model_axes(mesh, f"{path!r}, {what},")
  if kind == "published" and gemma_params.is_checkpoint(os.fspath(path)):
    return quantize_lib.quantize_model(gemma_params.load(path, dtype=dtype, mesh=mesh,
                                                         **kwargs), quantize)
  if kind == "published":
    return quantize_lib.quantize_model(io.load(path, dtype=dtype, mesh=mesh, **kwargs),
                                       quantize)
  if kind == "workdir":
    model = quantize_lib.quantize_model(train.load(path, step, **kwargs), quantize)
  else:
    if kwargs:
      raise ValueError(f"{sorted(kwargs)[0]}= does not apply to a task's exact denoiser.")
    name = path[len(ORACLE_PREFIX):] if path.startswith(ORACLE_PREFIX) else path
    if name not in tasks.TASKS:
      raise ValueError(f"task={name!r} is unknown; known: {sorted(tasks.TASKS)}.")
    task = tasks.get(name, task_kwargs)
    if task.exact_denoiser is None:
      raise ValueError(f"task={name!r} has no exact denoiser to load.")
    model = oracle_model(task, name, noise)
  if mesh is not None and model.params is not None:
    model = model.replace(params=mesh_lib.shard_params(mesh, model.params))
  return model


def oracle_model(task, name: str, noise=None) -> Model:
  """The task's exact denoiser as a Model: its own (absorbing) one, or under `noise`."""
  if noise is None:
    return task_model(task, task.exact_denoiser, None, family=ORACLE_FAMILY, source=name)
  process = noise_lib.as_process(noise, task.vocab_size)
  if isinstance(process, noise_lib.Absorbing):  # t-free: the task's own oracle is exact
    return task_model(task, task.exact_denoiser, None, family=ORACLE_FAMILY, source=name,
                      noise=process)
  if task.support is None:
    raise errors.ArgumentError("noise", f"noise={noise!r} is invalid for task {name!r}: it "
                               "has no enumerable law (Task.support), so no exact denoiser "
                               "under other noise; only noise=None or 'absorbing'.")
  support = task.support()
  # Its default sampler is the exact reverse kernel of its process (the absorbing
  # families do not sample uniform or hybrid noise).
  sampler = ConfiguredSampler(family="uniform_ancestral", eos_id=task.eos_id)
  return task_model(task, noise_lib.exact_denoiser(process), support.arrays,
                    family=ORACLE_FAMILY, source=name, noise=process, sampler=sampler)
