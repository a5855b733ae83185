"""Readers and writers of files from outside, within the caps and refusals of
docs/security.md: a published Hugging Face folder (`folder`: `load` -> `mdjax.model.Model`,
`save` back, bit for bit; `record` builds the Model; DiffusionGemma's folder is
`diffusion_gemma_hf`'s), its safetensors weights (`tensors`), a torch / Lightning `.ckpt` (the
restricted reader of `lightning`; `convert_ckpt` writes it as a folder) and its chat template
(`chat_template`, rendered in a bounded sandbox).

What a folder's tensors and config.json mean is its format's file of `mdjax.formats`; the
safe-open helpers every writer shares are `mdjax.files`.
"""

from mdjax.io import diffusion_gemma_hf, folder
from mdjax.io.chat_template import render_chat
from mdjax.io.lightning import read_ckpt
from mdjax.io.tensors import read_checkpoint, read_header, read_tensor, write_checkpoint
from mdjax.model import Model


def load(path, **kwargs) -> Model:
  """A published Hugging Face folder or torch .ckpt as a `Model` (`folder.load`; a
  DiffusionGemma folder: `diffusion_gemma_hf.load`)."""
  if diffusion_gemma_hf.is_folder(path):
    return diffusion_gemma_hf.load(path, **kwargs)
  return folder.load(path, **kwargs)


def save(model_or_params, path, **kwargs) -> list[str]:
  """Writes a published Hugging Face folder (`folder.save`; a DiffusionGemma model:
  `diffusion_gemma_hf.save`, the layout transformers and vLLM read)."""
  if isinstance(model_or_params, Model) and model_or_params.family == diffusion_gemma_hf.FAMILY:
    return diffusion_gemma_hf.save(model_or_params, path, **kwargs)
  return folder.save(model_or_params, path, **kwargs)


__all__ = ["load", "read_checkpoint", "read_ckpt", "read_header", "read_tensor", "render_chat",
           "save", "write_checkpoint"]
