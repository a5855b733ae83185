"""Block diffusion (BD3-LM) on character-level Shakespeare: configs/shakespeare_char.py with
block-causal attention in blocks of 16 and the block NELBO; samples decode block by block on
the exact KV cache. Blocks of 1 would be a left-to-right model; blocks of 64 (the window) MD4.
"""

from configs.shakespeare_char import get_config as diffusion_config


def get_config():
  c = diffusion_config()
  c.model.block_size = 16
  # BD3-LM's clipped noise range is a knob here (e.g. t_min=0.3, t_max=0.8); the default is
  # the full range, where the training loss is the NELBO itself.
  c.block_nelbo.update(t_min=1e-5, t_max=1.0, antithetic=True)
  c.sampler = c.sampler.__class__(dict(family="confidence", steps=64, block_length=16,
                                       kv_cache="exact"))
  return c
