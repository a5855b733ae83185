"""Flax denoisers meeting the denoiser contract."""

from mdjax.models.transformer import (
    KVCache,
    Transformer,
    TransformerConfig,
    count_params,
    init,
    make_apply_fn,
)

__all__ = ["KVCache", "Transformer", "TransformerConfig", "count_params", "init", "make_apply_fn"]
