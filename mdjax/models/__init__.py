"""Flax denoisers meeting the denoiser contract."""

from mdjax.models.transformer import (
    Transformer,
    TransformerConfig,
    count_params,
    init,
    make_apply_fn,
)

__all__ = ["Transformer", "TransformerConfig", "count_params", "init", "make_apply_fn"]
