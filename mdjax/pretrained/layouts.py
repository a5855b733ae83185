"""The published checkpoint layouts, now `mdjax.checkpoints` (one file per family, one
registry): the names this module had, kept for one release."""

from mdjax.checkpoints import FAMILIES, detect, supported
from mdjax.checkpoints.base import (TORCH_DTYPES, Family, Layout, Leaf, _bool, _first_id, _get,
                                    _head_dim, _published, _refuse, _with_ids, depth, hf_shape,
                                    leaf_shape)
from mdjax.checkpoints.bd3lm import BD3LM as BD3LMLayout
from mdjax.checkpoints.dit import ATTN_BACKENDS, DIT_FIXED, INV_FREQ, inv_freq
from mdjax.checkpoints.dit import DiTFamily as DiTLayout
from mdjax.checkpoints.dream import DREAM_MASK_ID
from mdjax.checkpoints.dream import Dream as DreamLayout
from mdjax.checkpoints.llada import LLADA_EOT_ID, LLADA_MASK_ID, LLADA_VOCAB
from mdjax.checkpoints.llada import LLaDA as LLaDALayout
from mdjax.checkpoints.llama import LLAMA3_KEYS, _rope
from mdjax.checkpoints.llama import Llama as LlamaLayout
from mdjax.checkpoints.mdlm import MDLM as MDLMLayout
from mdjax.checkpoints.qwen2 import Qwen2 as Qwen2Layout

LAYOUTS = FAMILIES


def optional_buffers(layout: Family) -> tuple[str, ...]:
  """Buffer names a checkpoint of the family may hold (`Family.optional_buffers`)."""
  return layout.optional_buffers


__all__ = ["ATTN_BACKENDS", "BD3LMLayout", "DIT_FIXED", "DREAM_MASK_ID", "DiTLayout",
           "DreamLayout", "Family", "INV_FREQ", "LAYOUTS", "LLADA_EOT_ID", "LLADA_MASK_ID",
           "LLADA_VOCAB", "LLAMA3_KEYS", "LLaDALayout", "Layout", "Leaf", "LlamaLayout",
           "MDLMLayout", "Qwen2Layout", "TORCH_DTYPES", "_bool", "_first_id", "_get",
           "_head_dim", "_published", "_refuse", "_rope", "_with_ids", "depth", "detect",
           "hf_shape", "inv_freq", "leaf_shape", "optional_buffers", "supported"]
