"""The published diffusion LMs' Hugging Face checkpoints (LLaDA, Dream): load and save.

`load(folder)` reads config.json, the safetensors weights (one file or sharded with an
index), tokenizer.json and the chat template into a `PretrainedModel` whose `apply_fn` is
`mdjax.models.published.denoiser(config)`; `save` writes such a folder back, bit for bit.
"""

from mdjax.pretrained.layouts import LAYOUTS, detect
from mdjax.pretrained.load import PretrainedModel, load, partition_spec, save
from mdjax.pretrained.tensors import read_checkpoint, read_header, read_tensor, write_checkpoint

__all__ = ["LAYOUTS", "PretrainedModel", "detect", "load", "partition_spec", "read_checkpoint",
           "read_header", "read_tensor", "save", "write_checkpoint"]
