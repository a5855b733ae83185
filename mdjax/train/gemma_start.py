"""A DiffusionGemma params checkpoint (gemma's orbax layout, `mdjax.io.gemma_params`) as a
fine-tuning start point, `train.init_from="pretrained:DIR"`, for `mdjax.train.sft`'s start
points.

DiffusionGemma is a uniform-noise model: it fine-tunes by objective 'nelbo' under
`noise='uniform'` (UDLM's NELBO, `mdjax.noise.gidd_loss`), every position of a row noised and
run as the decoder (`models.diffusion_gemma.training_denoiser`), optionally with LoRA
(`train.lora`: the attention's q, k and o projections are targets; gemma's einsum layouts
make each head's projection an adapted matrix). The architecture is read from the tree's
shapes as `mdjax.load` reads it (what the shapes cannot say is the published model's). A
task of fewer ids than the vocabulary trains the logits of its ids only; a text task must
read the start's tokenizer. The export writes the merged weights back in gemma's layout and
the start's dtype (WORKDIR/pretrained), which `mdjax.load` and gemma's `load_params` read.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.formats import diffusion_gemma as layout
from mdjax.io import gemma_params
from mdjax.io.record import published_model
from mdjax.models import diffusion_gemma as network
from mdjax.train.config_checks import ConfigError

OBJECTIVES = ("nelbo",)  # DiffusionGemma's uniform noise: the NELBO; 'sft' / 'a2d' are absorbing


def is_start(where: str) -> bool:
  """Whether a "pretrained:DIR" start is a DiffusionGemma params checkpoint."""
  return gemma_params.is_checkpoint(where)


def start_config(where: str) -> network.DiffusionGemmaConfig:
  """The architecture of the checkpoint, read from its shapes (no weight read)."""
  return layout.config_from_shapes(gemma_params.leaf_shapes(where), where)


def start_fields(where: str, objective: str) -> tuple[dict, str, int, None, str]:
  """`sft._start_fields` of the checkpoint: (the model fields its sizes give, where, its
  length, no block size, its noise), or a ValueError for an objective it does not train by
  (sft names train.init_from)."""
  if objective not in OBJECTIVES:
    raise ValueError(f"a DiffusionGemma start ({where}) is a uniform-noise model, which "
                     f"objective={objective!r} does not train; fine-tune it with objective "
                     "'nelbo' and noise='uniform' (configs/diffusion_gemma_lora.py).")
  config = start_config(where)
  fields = dict(d_model=config.d_model, num_layers=config.num_layers,
                num_heads=config.num_heads, d_ff=config.mlp_hidden, positions="rope",
                norm="rms", mlp="swiglu", time_conditioning=False, causal=False, block_size=None)
  return fields, where, config.max_len, None, layout.noise_of(config).name


def start_model(config, task, where: str, same_tokenizer) -> tuple[None, dict, object]:
  """(None, float32 params, the training denoiser in `config.model.dtype`) of the checkpoint;
  `same_tokenizer(config, model, task, where)` checks a text task's ids against the start's."""
  model = gemma_params.load(where)
  if task.encode is not None:  # a text task reads the start's ids
    same_tokenizer(config, model, task, where)
  if task.vocab_size > model.vocab_size:
    raise ConfigError(f"config field task={config.task!r}: the task has {task.vocab_size} ids, "
                      f"the start {where} {model.vocab_size}.")
  vocab = None if task.vocab_size == model.vocab_size else task.vocab_size
  params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), model.params)
  compute = dataclasses.replace(model.config, dtype=config.model.dtype)
  return None, params, network.training_denoiser(compute, vocab)


def trained_model(params, where: str):
  """The fine-tuned model to write back: `params` (merged, on the host) in the start
  checkpoint's dtype, with its architecture."""
  config = start_config(where)
  dtype = np.dtype(config.jnp_dtype)
  params = jax.tree.map(lambda p: np.asarray(p).astype(dtype), params)
  return published_model(params=params, config=config, family=layout.FAMILY,
                         source=os.path.abspath(where))


def save(model, path: str) -> None:
  """gemma's params layout at `path` (`gemma_params.save`)."""
  gemma_params.save(model, path)
