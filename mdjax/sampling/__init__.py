"""Samplers for masked diffusion: one jitted `sample` for every registered family.

Families (each one module of `sampling/families/`: its frozen spec, its per-step plan and
its update):
AncestralSpec (exact MD4/MDLM reverse kernel), ConfidenceSpec (MaskGIT/LLaDA),
EntropyBoundedSpec (EB-sampler), RemaskSpec (ReMDM), OrderedSpec (fixed write
orders), FieldOrderSpec (write orders over fields, confidence within a field;
`parse_write_order` reads them from notation), RandomOrderSpec (exact chain rule in
a random order), SpeculativeSpec (exact parallel sampling by speculative
verification), DeferSpec (PUNT-style test-and-defer), RevisionSpec (D3IM-style
direct revision), LocalRemaskSpec (PURE-style localized remasking), MDLMSpec (MDLM's
ddpm_cache sampler), BD3LMSpec (BD3-LM's first-hitting and nucleus update inside a block) and
LLaDA21Spec (LLaDA2.1's threshold decoding with token-to-token edits).
Semi-autoregressive blocks inside one canvas (`sampling.semi_autoregressive`) are the `block_length` knob of
ancestral, confidence and entropy-bounded decoding; with `kv_cache="dual"` they decode each
block against a KV cache (`sampling.kv_cache`). Block-by-block generation
(`sampling.block_generation.sample_blocks`, block diffusion) runs any family one block at a
time after a sliding window: exact cache on a block-causal model, any length.
`sampling.classifier_free` wraps any denoiser with classifier-free guidance
(`sampling.guidance`). `sampling.base` defines the family protocol; `sampling.prepare` and
`Stepper` (`sampling.stepping`) are the public door for stepping a sampler by hand.
"""

from mdjax.denoiser import Denoiser
from mdjax.sampling.base import (KV_CACHES, BoundDenoiser, Canvas, Counters, Family,
                                 SamplerSpec, families, family_of, make_spec, register)
from mdjax.sampling.stepping import (IDLE_FRACTION_TO_SKIP, Carry, SampleResult, Stepper,
                                     row_keys)
from mdjax.sampling.driver import (Prepared, lower, num_steps, prepare, sample,
                                   sample_python_loop)
from mdjax.sampling.end_of_row import EndOfRow
from mdjax.sampling.kv_cache import offers_cache, recompute_cache
from mdjax.sampling.block_generation import BlocksResult, sample_blocks
from mdjax.sampling.guidance import classifier_free
from mdjax.sampling.reveal import time_grid
from mdjax.sampling.revising import with_noise
from mdjax.sampling.scores import SCORES
# Each family module registers its family on import.
from mdjax.sampling.families.ancestral import AncestralSpec
from mdjax.sampling.families.bd3lm import BD3LMSpec
from mdjax.sampling.families.confidence import ConfidenceSpec
from mdjax.sampling.families.defer import DeferSpec
from mdjax.sampling.families.diffusion_gemma import DiffusionGemmaSpec
from mdjax.sampling.families.diffusion_gemma_canvases import DiffusionGemmaCanvasesSpec
from mdjax.sampling.families.dream import DreamSpec
from mdjax.sampling.families.entropy_bounded import EntropyBoundedSpec
from mdjax.sampling.families.fast_dllm_v2 import FastDllmV2Spec
from mdjax.sampling.families.field_order import FieldOrderSpec, parse_write_order
from mdjax.sampling.families.learned_commit import LearnedCommitSpec
from mdjax.sampling.families.llada21 import LLaDA21Spec
from mdjax.sampling.families.local_remask import LocalRemaskSpec
from mdjax.sampling.families.mdlm import MDLMSpec
from mdjax.sampling.families.order_policy import OrderPolicySpec
from mdjax.sampling.families.ordered import OrderedSpec, parse_groups
from mdjax.sampling.families.random_order import RandomOrderSpec
from mdjax.sampling.families.remask import RemaskSpec
from mdjax.sampling.families.revision import RevisionSpec
from mdjax.sampling.families.speculative import SpeculativeSpec
from mdjax.sampling.families.uniform_ancestral import UniformAncestralSpec
# Importing the subpackage bound its module to the name `families`; the registry function
# keeps the public name (the modules stay importable as `mdjax.sampling.families.<name>`).
from mdjax.sampling.base import families  # noqa: E402,F811

__all__ = [
    "AncestralSpec", "BD3LMSpec", "BlocksResult", "BoundDenoiser", "Canvas", "Carry",
    "ConfidenceSpec", "Counters", "Prepared", "Stepper", "prepare",
    "DeferSpec", "Denoiser", "DiffusionGemmaCanvasesSpec", "DiffusionGemmaSpec", "DreamSpec", "EndOfRow", "classifier_free",
    "EntropyBoundedSpec", "Family", "FastDllmV2Spec", "FieldOrderSpec", "IDLE_FRACTION_TO_SKIP", "KV_CACHES", "LLaDA21Spec", "LocalRemaskSpec", "MDLMSpec", "OrderedSpec",
    "RandomOrderSpec", "RemaskSpec",
    "RevisionSpec", "SCORES", "UniformAncestralSpec", "with_noise", "SampleResult", "SamplerSpec", "SpeculativeSpec", "families",
    "family_of", "lower", "make_spec", "num_steps", "offers_cache", "parse_groups", "parse_write_order",
    "recompute_cache", "register", "row_keys", "sample", "sample_blocks", "sample_python_loop",
    "time_grid",
    "LearnedCommitSpec",
    "OrderPolicySpec",
]
