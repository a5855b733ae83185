"""`Denoiser`: a denoiser and the passes it offers beyond the plain call, as one value.

The plain contract is `denoiser(params, tokens_BxL, t_B) -> logits_BxLxV` (with
`valid_BxL=`, False on padding, where the caller has padding). A denoiser may offer more:

  prefill(params, tokens_BxL, t_B, valid_BxL=None) -> (logits_BxLxV, cache)
  decode(params, cache, tokens_BxW, start, t_B, valid_BxL=None) -> (logits_BxWxV, cache)
      the cached contract (`sampling.kv_cache`): a full pass that returns the keys and
      values, and a pass over W positions against them;
  block_size: its attention is block-causal with blocks of this many positions;
  block_pair(params, noisy_BxL, clean_BxL, t_B) -> logits_BxLxV
      the block-diffusion training pass (`diffusion.block_nelbo_loss`);
  encode_condition(params, shaped_logits_BxLxV) -> condition
      self-conditioning (DiffusionGemma): the input the next step's `apply(...,
      condition=condition)` takes, made from this step's shaped logits. `apply` then admits
      `condition=` (absent: the first step's, no previous prediction); a denoiser without
      `encode_condition` never receives it, so every other denoiser is unchanged.

A new pretrained denoiser provides `apply` and whichever of these it has, and `max_len`,
the positions it holds, where it knows them (a `mdjax.Model` gives its denoiser its own).
The value is frozen and hashable (by its functions), so it is a static argument of compiled
programs as a plain function is; every public entry point takes either and wraps a function
once (`Denoiser.of`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

# The passes a denoiser may offer beside `apply`.
PASSES = ("prefill", "decode", "block_size", "block_pair", "encode_condition")


@dataclasses.dataclass(frozen=True)
class Denoiser:
  """A denoiser value: `apply` and the passes it offers (None: not offered).

  max_len: the positions it holds (None: not known here); checked on the host, never read
  inside a compiled program, so it is no part of the value's identity (equal denoisers of
  other lengths share programs). Fields left None are taken from `apply` when it is a
  Denoiser, so wrapping never loses a capability.
  """

  apply: Callable  # (params, tokens_BxL, t_B, valid_BxL=None) -> logits_BxLxV
  prefill: Callable | None = None  # (params, tokens_BxL, t_B, valid_BxL=None) -> (logits, cache)
  decode: Callable | None = None  # (params, cache, tokens_BxW, start, t_B, valid_BxL=None)
  block_size: int | None = None  # block-causal attention's block (None: no blocks)
  block_pair: Callable | None = None  # (params, noisy_BxL, clean_BxL, t_B) -> logits_BxLxV
  encode_condition: Callable | None = None  # (params, shaped_logits_BxLxV) -> condition
  max_len: int | None = dataclasses.field(default=None, compare=False)

  def __post_init__(self):
    if isinstance(self.apply, Denoiser):  # a wrapped value keeps what it offers
      for name in PASSES + ("max_len",):
        if getattr(self, name) is None:
          object.__setattr__(self, name, getattr(self.apply, name))

  def map_passes(self, wrap: Callable[[Callable], Callable]) -> "Denoiser":
    """This denoiser with `wrap(fn)` in place of `apply` and of every pass it offers (its
    block size and length kept): how a wrapper of the parameters (a mesh's gather, LoRA's
    merge) keeps every pass, self-conditioning included, and any pass added later."""
    passes = ("apply",) + tuple(name for name in PASSES if name != "block_size")
    return dataclasses.replace(self, **{name: wrap(getattr(self, name)) for name in passes
                                        if getattr(self, name) is not None})

  @classmethod
  def of(cls, apply_fn: Any) -> "Denoiser":
    """`apply_fn` as a Denoiser: itself when it is one, else wrapped (once per call site:
    equal wrappers of one function share compiled programs)."""
    return apply_fn if isinstance(apply_fn, Denoiser) else cls(apply_fn)

  def __call__(self, params, tokens_BxL, t_B, valid_BxL=None, condition=None):
    """The plain contract; `valid_BxL` and `condition` reach `apply` only when given (a
    condition only to a denoiser that makes one: `encode_condition`)."""
    extra = {} if valid_BxL is None else {"valid_BxL": valid_BxL}
    if condition is not None:
      if self.encode_condition is None:
        raise ValueError("condition= given to a denoiser without self-conditioning "
                         "(encode_condition is None).")
      extra["condition"] = condition
    return self.apply(params, tokens_BxL, t_B, **extra)

  @property
  def self_conditions(self) -> bool:
    """Whether `apply` takes the previous step's prediction (`encode_condition`)."""
    return self.encode_condition is not None

  @property
  def offers_cache(self) -> bool:
    """Whether it meets the cached contract (`prefill` and `decode`)."""
    return self.prefill is not None and self.decode is not None
