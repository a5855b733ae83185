"""Samplers for masked diffusion: one jitted `sample` for every family.

Families (each a frozen spec): AncestralSpec (exact MD4/MDLM reverse kernel),
ConfidenceSpec (MaskGIT/LLaDA), RemaskSpec (ReMDM), OrderedSpec (fixed write
orders) and RandomOrderSpec (exact chain rule in a random order). Blocks
(semi-autoregressive decoding) are the `block_length` knob of the first two.
"""

from mdjax.sampling.driver import (SampleResult, lower, num_steps, row_keys, sample,
                                   sample_python_loop)
from mdjax.sampling.specs import (
    AncestralSpec,
    ConfidenceSpec,
    OrderedSpec,
    RandomOrderSpec,
    RemaskSpec,
    SamplerSpec,
    make_spec,
    time_grid,
)
from mdjax.sampling.transforms import SCORES

__all__ = [
    "AncestralSpec", "ConfidenceSpec", "OrderedSpec", "RandomOrderSpec", "RemaskSpec",
    "SCORES", "SampleResult", "SamplerSpec", "lower", "make_spec", "num_steps", "row_keys",
    "sample", "sample_python_loop", "time_grid",
]
