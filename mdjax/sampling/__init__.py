"""Samplers for masked diffusion: one jitted `sample` for every family.

Families (each a frozen spec): AncestralSpec (exact MD4/MDLM reverse kernel),
ConfidenceSpec (MaskGIT/LLaDA), RemaskSpec (ReMDM), OrderedSpec (fixed write
orders), FieldOrderSpec (write orders over fields, confidence within a field;
`parse_write_order` reads them from notation) and RandomOrderSpec (exact chain
rule in a random order), SpeculativeSpec (exact parallel sampling by
speculative verification), DeferSpec (PUNT-style test-and-defer), RevisionSpec
(D3IM-style direct revision) and LocalRemaskSpec (PURE-style localized remasking). Blocks
(semi-autoregressive decoding) are the `block_length` knob of the first two.
"""

from mdjax.sampling.driver import (SampleResult, lower, num_steps, row_keys, sample,
                                   sample_python_loop)
from mdjax.sampling.orders import parse_write_order
from mdjax.sampling.specs import (
    AncestralSpec,
    ConfidenceSpec,
    DeferSpec,
    FieldOrderSpec,
    LocalRemaskSpec,
    OrderedSpec,
    RandomOrderSpec,
    RemaskSpec,
    RevisionSpec,
    SamplerSpec,
    SpeculativeSpec,
    make_spec,
    time_grid,
)
from mdjax.sampling.transforms import SCORES

__all__ = [
    "AncestralSpec", "ConfidenceSpec", "DeferSpec", "FieldOrderSpec", "LocalRemaskSpec",
    "OrderedSpec", "RandomOrderSpec", "RemaskSpec", "RevisionSpec", "SCORES", "SampleResult", "SamplerSpec", "SpeculativeSpec", "lower",
    "make_spec", "num_steps", "parse_write_order", "row_keys", "sample", "sample_python_loop",
    "time_grid",
]
