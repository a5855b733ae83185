"""BD3-LM (kuleshov-group/bd3lm-owt-block_size{4,8,16}): model_type "bd3lm", the DiT
(`mdjax.checkpoints.dit`) with block-causal attention of block_size when cross_attn is true
(its default); with cross_attn false the reference attends bidirectionally and block_size is
unused (DiTConfig.block_size None).

Its reference sampler is BD3-LM's `_semi_ar_sampler`: block by block after a sliding window
of the model's length minus one block, each block by `sampling.BD3LMSpec` (first hitting,
nucleus); `mdjax.pretrained.bd3lm_sample` runs it unconditionally.
"""

from __future__ import annotations

import numpy as np

from mdjax import sampling
from mdjax.checkpoints.base import config_bool, config_value
from mdjax.checkpoints.dit import DiTFamily, sampled_parts
from mdjax.model import SamplerPlan
from mdjax.models.checks import check_count
from mdjax.models.dit import DiTConfig
from mdjax.sampling.knobs import Knob


def plan(model, *, length: int, steps_per_block: int | None = None, nucleus_p: float = 0.9,
         first_hitting: bool = True, length_name: str = "length") -> SamplerPlan:
  """BD3-LM's sampler for `length` generated positions (whole blocks): its BD3LMSpec, the
  block size and the window of context, on the folded denoiser and params.
  steps_per_block: None with first hitting is one step per masked position; without first
  hitting, the DDPM grid's steps (default: the block size)."""
  apply_fn, params, config = sampled_parts(model)
  block = config.block_size
  if block is None:
    raise ValueError("model.config.block_size is None: a bidirectional (MDLM) model; sample it "
                     "with mdlm_sample, or load a BD3-LM checkpoint.")
  if length % block:
    raise ValueError(f"{length_name}={length} must be a multiple of the model's "
                     f"block_size={block} (BD3-LM generates whole blocks).")
  if first_hitting and config.time_conditioning:
    raise ValueError("first_hitting=True with a time-conditioned model: the reference tells "
                     "such a model the random hitting time, which the family's plan cannot; "
                     "use first_hitting=False.")
  if not first_hitting and steps_per_block is None:
    steps_per_block = block
  spec = sampling.BD3LMSpec(steps=steps_per_block, first_hitting=first_hitting,
                            nucleus_p=nucleus_p)
  return SamplerPlan(denoiser=apply_fn, spec=spec, params=params, blocks_of=block,
                     window=config.model_length - block)


class Sampler:
  """BD3-LM's `_semi_ar_sampler` as a model's default sampler: max_new_tokens (whole
  blocks) after the prompt."""

  knobs = ("steps_per_block", "nucleus_p", "first_hitting")
  # Its own knobs (the others are the spec knobs of their names, `sampling.knobs`).
  own_knobs = (Knob("steps_per_block", int, None, optional=True, minimum=1, help="BD3-LM: "
                    "steps a block (None: with first hitting one per masked position, "
                    "without it the block size)."),)
  spec_defaults: dict = {}

  def plan(self, model, *, prompt_length: int, max_new_tokens: int, **knobs) -> SamplerPlan:
    check_count("max_new_tokens", max_new_tokens)
    return plan(model, length=max_new_tokens, length_name="max_new_tokens", **knobs)


class BD3LM(DiTFamily):
  """BD3-LM's layout (module docstring)."""

  family = "bd3lm"
  network = "bd3lm"
  model_types = ("bd3lm",)
  architectures = ("BD3LM",)
  sampler = Sampler()

  def _block_size(self, raw: dict, model_length: int) -> int | None:
    f = self.family
    if not config_bool(raw, "cross_attn", f, True):
      return None
    size = config_value(raw, "block_size", int, f, 1)
    if size < 1 or model_length % size:
      raise ValueError(f"{f} config.json: block_size={size} does not divide "
                       f"model_length={model_length}")
    return size

  def config_to_hf(self, config: DiTConfig) -> dict:
    self._check_writable(config)
    blocks = config.block_size is not None
    return {"architectures": list(self.architectures), "model_type": self.model_types[0],
            "block_size": config.block_size if blocks else config.model_length,
            "cross_attn": blocks, "adaln": True, "attn_backend": "sdpa", "causal": False,
            "var_min": True, "sampling_eps_min": 1e-3, "sampling_eps_max": 0.999,
            **self._common_hf(config)}

  def buffers(self, config: DiTConfig, raw: dict) -> dict[str, np.ndarray]:
    out = super().buffers(config, raw)
    if config_bool(raw, "var_min", self.family, True):  # BD3LM registers them with var_min
      for key, default in (("sampling_eps_min", 1e-3), ("sampling_eps_max", 0.999)):
        out[key] = np.asarray(config_value(raw, key, float, self.family, default), np.float32)
    return out
