"""MDLM (kuleshov-group/mdlm-owt): model_type "mdlm", the bidirectional DiT
(`mdjax.formats.dit`), no block_size key.

Its reference sampler is MDLM's `_sample` with the `ddpm_cache` predictor
(`sampling.MDLMSpec`): steps on linspace(1, eps, steps + 1), then noise removal;
`mdlm_sample` runs it unconditionally (one compiled program).
"""

from __future__ import annotations

import jax
import numpy as np

from mdjax import sampling
from mdjax.formats.dit import DiTFormat, sampled_config, sampled_parts
from mdjax.model import SamplerPlan
from mdjax.models.checks import check_count
from mdjax.models.dit import DiTConfig
from mdjax.sampling.knobs import Knob

Array = jax.Array


def plan(model, *, length: int, steps: int, eps: float = 1e-5, noise_removal: bool = True,
         cache: bool | None = None, length_name: str = "length") -> SamplerPlan:
  """MDLM's `_sample` over a canvas of `length` positions: its MDLMSpec, on the folded
  denoiser and params (`dit.sampled_parts`). cache None: unless the model is
  time-conditioned, as MDLM."""
  apply_fn, params, config = sampled_parts(model)
  check_count("steps", steps)
  check_count(length_name, length)
  if length > config.model_length:
    raise ValueError(f"{length_name}={length} is longer than the model's {config.model_length} "
                     "positions: MDLM samples one window; for longer sequences use a BD3-LM "
                     "checkpoint's blocks (bd3lm_sample), which slide past the training length.")
  if config.block_size is not None:
    raise ValueError(f"model.config.block_size={config.block_size}: a block-causal (BD3-LM) "
                     "model samples block by block; use bd3lm_sample.")
  if cache is None:
    cache = not config.time_conditioning
  if cache and config.time_conditioning:
    raise ValueError("cache=True with a time-conditioned model: its logits depend on t, so a "
                     "reused call would be wrong (MDLM turns the cache off there).")
  spec = sampling.MDLMSpec(steps=steps, eps=eps, noise_removal=noise_removal, cache=cache)
  return SamplerPlan(denoiser=apply_fn, spec=spec, params=params)


def mdlm_sample(model, *, num_samples: int, steps: int, key: Array, length: int | None = None,
                eps: float = 1e-5, noise_removal: bool = True, cache: bool | None = None
                ) -> sampling.SampleResult:
  """MDLM's `_sample` (predictor `ddpm_cache`): `num_samples` rows of `length` tokens
  (default the model's length) from all masks, `steps` steps on linspace(1, eps, steps + 1),
  then noise removal (the argmax of whatever is still masked). `cache` (default: unless the
  model is time-conditioned, as MDLM) reuses the last call while the canvas is unchanged;
  `result.nfe` counts the calls made, `result.saved_calls` those reused or skipped.
  One compiled program."""
  config = sampled_config(model)
  check_count("num_samples", num_samples)
  length = config.model_length if length is None else length
  chosen = plan(model, length=length, steps=steps, eps=eps, noise_removal=noise_removal,
                cache=cache)
  tokens_BxL = np.full((num_samples, length), config.mask_id, np.int32)
  return sampling.sample(chosen.denoiser, chosen.params, key, tokens_BxL, chosen.spec)


class Sampler:
  """MDLM's `_sample` as a model's default sampler on [prompt, max_new_tokens masks]
  (within the model's length): steps default to max_new_tokens."""

  knobs = ("steps", "eps", "noise_removal", "cache")
  # Its own knobs (the others are the spec knobs of their names, `sampling.knobs`).
  own_knobs = (Knob("cache", bool, None, optional=True, help="MDLM: reuse the last logits "
                    "while the canvas did not change (None: unless the model is "
                    "time-conditioned, as MDLM)."),)
  spec_defaults: dict = {}

  def plan(self, model, *, prompt_length: int, max_new_tokens: int, **knobs) -> SamplerPlan:
    check_count("max_new_tokens", max_new_tokens)
    knobs.setdefault("steps", max_new_tokens)
    return plan(model, length=prompt_length + max_new_tokens,
                length_name="prompt length + max_new_tokens", **knobs)


class MDLMFormat(DiTFormat):
  """MDLM's layout: bidirectional."""

  family = "mdlm"
  network = "mdlm"
  model_types = ("mdlm",)
  architectures = ("MDLM",)
  sampler = Sampler()

  def config_to_hf(self, config: DiTConfig) -> dict:
    self._check_writable(config)
    if config.block_size is not None:
      raise ValueError(f"config.block_size={config.block_size} cannot be written as "
                       f"{self.family} (its attention is bidirectional): save it as bd3lm")
    return {"architectures": list(self.architectures), "model_type": self.model_types[0],
            **self._common_hf(config)}
