"""Classifier-free guidance as a denoiser wrapper: every family samples guided logits.

`classifier_free(denoiser, scale, prompt_length=P, mask_id=m)` is a `Denoiser` whose every
pass runs the inner denoiser once on 2B rows, [conditional; unconditional], and returns

    un + (scale + 1) * (cond - un)

LLaDA's rule (`generate.py`: `un_logits + (cfg_scale + 1) * (logits - un_logits)`). The
unconditional rows are the canvas with its prompt positions replaced by the mask id: the
prompt is positions [0, P) of the canvas `sample` runs on (LLaDA masks the positions that
were not masked when generation started, the first P). With left-padded prompts of
different lengths every row's prompt lies in [0, P), P the padded width; padding (invalid
positions) is masked too, which a model that honours `valid_BxL` never reads.

Where a value is ruled out (-inf) by the conditional pass, it stays ruled out; where only
the unconditional pass rules it out, the conditional logit is kept (the rule would give
-inf + inf = NaN there). `scale = 0` is the inner denoiser itself, one pass of B rows (as
LLaDA skips the unconditional pass when cfg_scale is 0).

When the inner denoiser offers the cached contract (`prefill`, `decode`), so does the
guided one: its cache holds the 2B rows, so `kv_cache="dual"` (and, on a block-causal
model, `"exact"`) decode with guidance. `sample_blocks` moves the canvas along the
sequence, so positions [0, P) of its window are not the prompt: guide `sample`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.denoiser import Denoiser
from mdjax.sampling.base import check

Array = jax.Array


def guided_logits(cond_BxLxV: Array, un_BxLxV: Array, scale: float) -> Array:
  """un + (scale + 1) * (cond - un), with -inf where `cond` is -inf and `cond` where only
  `un` is -inf (where the rule is NaN: -inf - -inf, or -inf + inf)."""
  guided_BxLxV = un_BxLxV + (scale + 1.0) * (cond_BxLxV - un_BxLxV)
  guided_BxLxV = jnp.where(jnp.isneginf(un_BxLxV), cond_BxLxV, guided_BxLxV)
  return jnp.where(jnp.isneginf(cond_BxLxV), -jnp.inf, guided_BxLxV)


@dataclasses.dataclass(frozen=True)
class Guidance:
  """What the guided passes share: the inner denoiser and the rule's constants (frozen and
  hashable, so equal arguments give equal denoisers and share compiled programs)."""

  inner: Denoiser
  scale: float
  prompt_length: int
  mask_id: int

  def rows(self, tokens_BxW: Array, t_B: Array, valid_BxL: Array | None, start=0):
    """(tokens_2BxW, t_2B, valid_2BxL): the conditional rows, then the unconditional ones
    (positions start.. of the canvas, those before `prompt_length` masked)."""
    position_W = start + jnp.arange(tokens_BxW.shape[1])
    un_BxW = jnp.where(position_W[None] < self.prompt_length, self.mask_id, tokens_BxW)
    twice = lambda x: None if x is None else jnp.concatenate([x, x], 0)
    return jnp.concatenate([tokens_BxW, un_BxW], 0), twice(t_B), twice(valid_BxL)

  def combine(self, logits_2BxWxV: Array) -> Array:
    cond_BxWxV, un_BxWxV = jnp.split(logits_2BxWxV, 2, axis=0)
    return guided_logits(cond_BxWxV, un_BxWxV, self.scale)


def _valid(valid_BxL):
  return {} if valid_BxL is None else {"valid_BxL": valid_BxL}


@dataclasses.dataclass(frozen=True)
class _Apply:
  """The guided plain pass: (params, tokens_BxL, t_B, valid_BxL=None) -> logits_BxLxV."""

  guidance: Guidance

  def __call__(self, params, tokens_BxL, t_B, valid_BxL=None):
    g = self.guidance
    if g.scale == 0.0:
      return g.inner(params, tokens_BxL, t_B, valid_BxL)
    tokens_2BxL, t_2B, valid_2BxL = g.rows(tokens_BxL, t_B, valid_BxL)
    return g.combine(g.inner(params, tokens_2BxL, t_2B, valid_2BxL))


@dataclasses.dataclass(frozen=True)
class _Prefill:
  """The guided full pass that returns the cache of the 2B rows."""

  guidance: Guidance

  def __call__(self, params, tokens_BxL, t_B, valid_BxL=None):
    g = self.guidance
    if g.scale == 0.0:
      return g.inner.prefill(params, tokens_BxL, t_B, **_valid(valid_BxL))
    tokens_2BxL, t_2B, valid_2BxL = g.rows(tokens_BxL, t_B, valid_BxL)
    logits_2BxLxV, cache = g.inner.prefill(params, tokens_2BxL, t_2B, **_valid(valid_2BxL))
    return g.combine(logits_2BxLxV), cache


@dataclasses.dataclass(frozen=True)
class _Decode:
  """The guided pass over W positions from `start` against the 2B rows' cache."""

  guidance: Guidance

  def __call__(self, params, cache, tokens_BxW, start, t_B, valid_BxL=None):
    g = self.guidance
    if g.scale == 0.0:
      return g.inner.decode(params, cache, tokens_BxW, start, t_B, **_valid(valid_BxL))
    tokens_2BxW, t_2B, valid_2BxL = g.rows(tokens_BxW, t_B, valid_BxL, start)
    logits_2BxWxV, cache = g.inner.decode(params, cache, tokens_2BxW, start, t_2B,
                                          **_valid(valid_2BxL))
    return g.combine(logits_2BxWxV), cache


def classifier_free(denoiser, scale: float, *, prompt_length: int, mask_id: int) -> Denoiser:
  """`denoiser` with classifier-free guidance (module docstring): a `Denoiser` any family
  samples.

  Args:
    denoiser: the inner denoiser (a function or a `Denoiser`); it must take 2B rows.
    scale: the guidance scale (>= 0; LLaDA's cfg_scale). 0 is the inner denoiser.
    prompt_length: P; positions [0, P) of the canvas are the prompt, masked in the
      unconditional rows (left-padded prompts: the padded width).
    mask_id: the mask id the unconditional rows hold at the prompt positions.
  """
  check(isinstance(scale, (int, float, np.floating)) and not isinstance(scale, bool)
        and math.isfinite(scale) and scale >= 0, "scale", scale, "must be a finite number >= 0")
  check(isinstance(prompt_length, (int, np.integer)) and not isinstance(prompt_length, bool)
        and prompt_length >= 0, "prompt_length", prompt_length,
        "must be an integer >= 0 (positions [0, P) of the canvas are the prompt)")
  check(isinstance(mask_id, (int, np.integer)) and not isinstance(mask_id, bool)
        and mask_id >= 0, "mask_id", mask_id, "must be an integer id >= 0")
  inner = Denoiser.of(denoiser)
  guidance = Guidance(inner=inner, scale=float(scale), prompt_length=int(prompt_length),
                      mask_id=int(mask_id))
  cached = inner.offers_cache
  return Denoiser(_Apply(guidance), prefill=_Prefill(guidance) if cached else None,
                  decode=_Decode(guidance) if cached else None, block_size=inner.block_size)
