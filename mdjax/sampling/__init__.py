"""Samplers for masked diffusion: one jitted `sample` for every registered family.

Families (each one module: its frozen spec, its per-step plan and its update):
AncestralSpec (exact MD4/MDLM reverse kernel), ConfidenceSpec (MaskGIT/LLaDA),
EntropyBoundedSpec (EB-sampler), RemaskSpec (ReMDM), OrderedSpec (fixed write
orders), FieldOrderSpec (write orders over fields, confidence within a field;
`parse_write_order` reads them from notation), RandomOrderSpec (exact chain rule in
a random order), SpeculativeSpec (exact parallel sampling by speculative
verification), DeferSpec (PUNT-style test-and-defer), RevisionSpec (D3IM-style
direct revision) and LocalRemaskSpec (PURE-style localized remasking). Blocks
(semi-autoregressive decoding) are the `block_length` knob of ancestral, confidence
and entropy-bounded decoding; with `kv_cache="dual"` they decode each block against a
KV cache (`sampling.kv_cache`). `sample_blocks` runs any family one block at a time after a
sliding window (block diffusion: exact cache, any length). `sampling.base` defines the
family protocol.
"""

from mdjax.sampling.base import (IDLE_FRACTION_TO_SKIP, KV_CACHES, Canvas, Family, SamplerSpec,
                                 families, family_of, make_spec, register)
from mdjax.sampling.driver import (SampleResult, lower, num_steps, row_keys, sample,
                                   sample_python_loop)
from mdjax.sampling.kv_cache import offers_cache, recompute_cache
from mdjax.sampling.blockwise import BlocksResult, sample_blocks
from mdjax.sampling.reveal import time_grid
from mdjax.sampling.scores import SCORES
# Each family module registers its family on import.
from mdjax.sampling.ancestral import AncestralSpec
from mdjax.sampling.confidence import ConfidenceSpec
from mdjax.sampling.defer import DeferSpec
from mdjax.sampling.entropy_bounded import EntropyBoundedSpec
from mdjax.sampling.field_order import FieldOrderSpec
from mdjax.sampling.local_remask import LocalRemaskSpec
from mdjax.sampling.ordered import OrderedSpec
from mdjax.sampling.random_order import RandomOrderSpec
from mdjax.sampling.remask import RemaskSpec
from mdjax.sampling.revision import RevisionSpec
from mdjax.sampling.speculative import SpeculativeSpec
from mdjax.sampling.orders import parse_write_order

__all__ = [
    "AncestralSpec", "BlocksResult", "Canvas", "ConfidenceSpec", "DeferSpec", "EntropyBoundedSpec", "Family",
    "FieldOrderSpec", "IDLE_FRACTION_TO_SKIP", "KV_CACHES", "LocalRemaskSpec", "OrderedSpec",
    "RandomOrderSpec", "RemaskSpec",
    "RevisionSpec", "SCORES", "SampleResult", "SamplerSpec", "SpeculativeSpec", "families",
    "family_of", "lower", "make_spec", "num_steps", "offers_cache", "parse_write_order",
    "recompute_cache", "register", "row_keys", "sample", "sample_blocks", "sample_python_loop",
    "time_grid",
]
