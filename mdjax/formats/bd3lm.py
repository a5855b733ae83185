"""BD3-LM (kuleshov-group/bd3lm-owt-block_size{4,8,16}): model_type "bd3lm", the DiT
(`mdjax.formats.dit`) with block-causal attention of block_size when cross_attn is true
(its default); with cross_attn false the reference attends bidirectionally and block_size is
unused (DiTConfig.block_size None).

Its reference sampler is BD3-LM's `_semi_ar_sampler`: block by block after a sliding window
of the model's length minus one block, each block by `sampling.BD3LMSpec` (first hitting,
nucleus). `bd3lm_sample` runs it unconditionally, with the exact KV cache of the finished
blocks, to any length (past the model's, through the window).
"""

from __future__ import annotations

import jax
import numpy as np

from mdjax import sampling
from mdjax.formats.base import config_bool, config_value
from mdjax.formats.dit import DiTFormat, sampled_config, sampled_parts
from mdjax.model import SamplerPlan
from mdjax.models.checks import check_count
from mdjax.models.dit import DiTConfig
from mdjax.sampling.knobs import Knob

Array = jax.Array


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


def bd3lm_sample(model, *, num_samples: int, length: int, key: Array,
                 steps_per_block: int | None = None, nucleus_p: float = 0.9,
                 first_hitting: bool = True, bos_id: int | None = None,
                 cached: bool = True) -> sampling.BlocksResult:
  """BD3-LM's `_semi_ar_sampler`: `num_samples` rows of `length` tokens (any multiple of the
  block size, past the model's length too), block by block after a sliding window of the
  model's length minus one block (the reference's context), each block by BD3-LM's update
  (`sampling.BD3LMSpec`). steps_per_block: None with first hitting is one step per masked
  position (the reference's T >> block_size ends each block after as many); without first
  hitting, the DDPM grid's steps (default: the block size). `bos_id`: the first token is held
  at it, as the reference's `x[:, 0] = BOS` (GPT-2's 50256 for the released checkpoints;
  None: every position generated). cached: the exact KV cache of finished blocks.
  Returns `sampling.BlocksResult` (tokens_BxT of `length` tokens, counters summed)."""
  config = sampled_config(model)
  check_count("num_samples", num_samples)
  check_count("length", length)
  chosen = plan(model, length=length, steps_per_block=steps_per_block, nucleus_p=nucleus_p,
                first_hitting=first_hitting)
  apply_fn, params, spec = chosen.denoiser, chosen.params, chosen.spec
  block, window = chosen.blocks_of, chosen.window
  keys = sampling.row_keys(key, num_samples)
  if bos_id is None:
    return sampling.sample_blocks(apply_fn, params, keys, np.zeros((num_samples, 0), np.int32),
                                  spec, length=length, blocks_of=block, window=window,
                                  mask_id=config.mask_id, cached=cached)
  if not (isinstance(bos_id, (int, np.integer)) and 0 <= bos_id < config.vocab_size):
    raise ValueError(f"bos_id={bos_id!r} must be a token id in [0, {config.vocab_size}).")
  # The first block on its own canvas, BOS fixed at position 0 (as the reference's first
  # block); then the rest after it as a prompt of one whole block, so no block is spent on
  # BOS's offset.
  first_BxK = np.full((num_samples, block), config.mask_id, np.int32)
  first_BxK[:, 0] = bos_id
  first_keys, rest_keys = jax.vmap(jax.random.split, out_axes=1)(keys)
  first = sampling.sample(apply_fn, params, first_keys, first_BxK, spec)
  counters, tokens_BxT = first.counters, first.tokens_BxL
  if length > block:
    rest = sampling.sample_blocks(apply_fn, params, rest_keys, np.asarray(tokens_BxT), spec,
                                  length=length - block, blocks_of=block, window=window,
                                  mask_id=config.mask_id, cached=cached)
    counters, tokens_BxT = counters + rest.counters, rest.tokens_BxT
  return sampling.BlocksResult(tokens_BxT=tokens_BxT,
                               generated_length_B=np.full(num_samples, length - 1),
                               counters=counters,
                               blocks_run=np.int32(length // block))


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


class BD3LMFormat(DiTFormat):
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
