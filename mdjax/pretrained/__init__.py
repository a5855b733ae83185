"""The published diffusion LMs' Hugging Face checkpoints (LLaDA, Dream, MDLM, BD3-LM): load,
sample, save.

`load(folder)` reads config.json, the safetensors weights (one file or sharded with an
index), tokenizer.json and the chat template into a `mdjax.model.Model` built by its family's
file of `mdjax.checkpoints` (denoiser, ids, reference sampler; a torch / Lightning `.ckpt` is
read too, by the restricted reader of `lightning`); `generate` (LLaDA's, with Fast-dLLM's
rules and caches) and `diffusion_generate` (Dream's) sample it as the reference code does
(texts to texts: `mdjax.generate`); `save` writes such a folder back, bit for bit.
"""

from mdjax.pretrained.chat_template import render_chat
from mdjax.pretrained.lightning import read_ckpt
from mdjax.pretrained.load import load, partition_spec, save
from mdjax.pretrained.samplers import diffusion_generate, generate
from mdjax.pretrained.tensors import read_checkpoint, read_header, read_tensor, write_checkpoint

__all__ = ["diffusion_generate", "generate", "load", "partition_spec", "read_checkpoint",
           "read_ckpt", "read_header", "read_tensor", "render_chat", "save", "write_checkpoint"]
