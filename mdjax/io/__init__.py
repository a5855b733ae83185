"""Readers and writers of files from outside, within the caps and refusals of
docs/security.md: a published Hugging Face folder (`folder`: `load` -> `mdjax.model.Model`,
`save` back, bit for bit; `record` builds the Model), its safetensors weights (`tensors`), a torch / Lightning `.ckpt` (the
restricted reader of `lightning`; `convert_ckpt` writes it as a folder) and its chat template
(`chat_template`, rendered in a bounded sandbox).

What a folder's tensors and config.json mean is its format's file of `mdjax.formats`; the
safe-open helpers every writer shares are `mdjax.files`.
"""

from mdjax.io.chat_template import render_chat
from mdjax.io.folder import load, save
from mdjax.io.lightning import read_ckpt
from mdjax.io.tensors import read_checkpoint, read_header, read_tensor, write_checkpoint

__all__ = ["load", "read_checkpoint", "read_ckpt", "read_header", "read_tensor", "render_chat",
           "save", "write_checkpoint"]
