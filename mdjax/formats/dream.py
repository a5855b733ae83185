"""Dream (Dream-org/Dream-v0-Base-7B, -Instruct-7B): model_type "Dream", DreamModel, Qwen2
tensor names on the published network (logits shifted by one, positions counted from each
row's first real token).

Its reference sampler is Dream's `diffusion_generate` (`_sample`): `steps` steps on the time
grid linspace(1, eps, steps + 1), by `sampling.DreamSpec`. `diffusion_generate` runs it on
ids as one compiled program.
"""

from __future__ import annotations

import jax

from mdjax import sampling
from mdjax.denoiser import Denoiser
from mdjax.formats.base import (TransformersFormat, build_published_config, check_choice,
                                check_flag, check_int, check_number, check_prompt_ids,
                                config_token_id, config_value, prompt_valid,
                                qwen_config_fields, qwen_config_json, refuse_value,
                                sample_on_ids, with_special_ids)
from mdjax.formats.llama import LLAMA3_KEYS, rope_config
from mdjax.model import SamplerPlan
from mdjax.models.published import PublishedConfig
from mdjax.sampling.families import dream as dream_family

Array = jax.Array

DREAM_MASK_ID = 151666


def plan(model, *, max_new_tokens: int, steps: int, eps: float = 1e-3, alg: str = "origin",
         alg_temp: float | None = None, temperature: float = 0.0, top_p: float | None = None,
         top_k: int | None = None, per_row_count: bool = False) -> SamplerPlan:
  """Dream's `diffusion_generate` for `max_new_tokens` new tokens (arguments as
  `diffusion_generate`'s, checked in its order): its DreamSpec."""
  check_int(max_new_tokens, "max_new_tokens", 1)
  check_int(steps, "steps", 1)
  check_choice(alg, "alg", dream_family.ALGS)
  check_number(eps, "eps", "must lie in [0, 1)", lambda x: 0 <= x < 1)
  check_number(temperature, "temperature", "must be a finite number >= 0", lambda x: x >= 0)
  if alg_temp is not None:
    check_number(alg_temp, "alg_temp", "must be None or a finite number >= 0", lambda x: x >= 0)
  if top_p is not None:
    check_number(top_p, "top_p", "must be None or lie in (0, 1]", lambda x: 0 < x <= 1)
  if top_k is not None:
    check_int(top_k, "top_k", 1)
  check_flag(per_row_count, "per_row_count")
  spec = sampling.DreamSpec(steps=steps, eps=float(eps), alg=alg, alg_temp=alg_temp,
                            per_row_count=per_row_count, temperature=float(temperature),
                            top_p=1.0 if top_p is None else float(top_p), top_k=top_k)
  return SamplerPlan(denoiser=Denoiser.of(model.denoiser), spec=spec)


def diffusion_generate(model, prompt_BxP, *, max_new_tokens: int, steps: int,
                       eps: float = 1e-3, alg: str = "origin", alg_temp: float | None = None,
                       temperature: float = 0.0, top_p: float | None = None,
                       top_k: int | None = None, attention_mask=None, key=None,
                       per_row_count: bool = False) -> Array:
  """Dream's `diffusion_generate`: ids [B, P + max_new_tokens].

  `steps` steps on the time grid linspace(1, eps, steps + 1) (float32, as torch's CPU
  linspace); `alg` "origin" reveals each masked position with probability 1 - s/t (1 at the
  last step), "maskgit_plus" / "topk_margin" / "entropy" commit the int(n (1 - s/t)) most
  confident proposals, confidence read from the transformed (temperature, top-p, top-k)
  probabilities, n the batch mean of the rows' masked counts (`sampling.DreamSpec`).
  Values: argmax at temperature 0, else drawn (mdjax's random streams, not torch's).
  alg_temp > 0 draws the committed positions without replacement from
  softmax(confidence / alg_temp) (Gumbel-top-k: the law of torch.multinomial).

  per_row_count=True uses each row's own masked count instead of the batch mean. Here
  every row starts with max_new_tokens masks and every step commits the same count in
  every row, so the two agree token for token; they differ only for rows that start with
  different counts, which this function never builds.

  model: as `llada.generate`'s. attention_mask: [B, P], 1 real and 0 padding (left
  padding); it reaches the model as `valid_BxL` (Dream's positions counted from each row's
  first real token are the model's). key: a PRNG key (default key(0)); origin's reveals,
  T > 0 and alg_temp > 0 read it.
  """
  prompt_BxP = check_prompt_ids(model, prompt_BxP)
  batch, prompt_length = prompt_BxP.shape
  chosen = plan(model, max_new_tokens=max_new_tokens, steps=steps, eps=eps, alg=alg,
                alg_temp=alg_temp, temperature=temperature, top_p=top_p, top_k=top_k,
                per_row_count=per_row_count)
  valid_BxL = prompt_valid(attention_mask, batch, prompt_length, max_new_tokens)
  return sample_on_ids(model, chosen.denoiser, prompt_BxP, max_new_tokens, chosen.spec, valid_BxL,
                       key)


class Sampler:
  """Dream's `diffusion_generate` as a model's default sampler: steps default to
  max_new_tokens; greedy unless a temperature is given."""

  knobs = ("steps", "eps", "alg", "alg_temp", "temperature", "top_p", "top_k", "per_row_count")
  own_knobs = ()  # each is the spec knob of its name (`sampling.knobs`)
  spec_defaults = {"temperature": 0.0}  # the reference's default: greedy

  def plan(self, model, *, prompt_length: int, max_new_tokens: int, **knobs) -> SamplerPlan:
    knobs.setdefault("steps", max_new_tokens)
    return plan(model, max_new_tokens=max_new_tokens, **knobs)


class DreamFormat(TransformersFormat):
  """Dream-7B's layout: Qwen2 names."""

  family = "dream"
  network = "dream"
  model_types = ("Dream",)
  architectures = ("DreamModel",)
  sampler = Sampler()
  padding_invariant = True  # positions count from the first real token (`models.published`)

  def config_from_hf(self, raw: dict, dtype: str) -> PublishedConfig:
    f = self.family
    refuse_value(raw, f, "hidden_act", ("silu",), "the MLP is silu(gate) * up")
    # Dream's rotary module reads transformers' rope_scaling (ROPE_INIT_FUNCTIONS): Llama
    # 3.1's "llama3" is expressed (a converted Llama 3), others refused.
    theta, scaling = rope_config(raw, f)
    refuse_value(raw, f, "use_sliding_window", (False,), "attention is over the whole sequence")
    return build_published_config(
        self.network, **{**qwen_config_fields(raw, f), "rope_theta": theta}, rope_scaling=scaling,
        qkv_bias=True, logit_shift=True,
        mask_id=config_value(raw, "mask_token_id", int, f, DREAM_MASK_ID),
        eos_id=config_token_id(raw, "eos_token_id", f),
        eot_id=config_token_id(raw, "eot_token_id", f),
        max_len=config_value(raw, "max_position_embeddings", int, f, 32768), dtype=dtype)

  def config_to_hf(self, config: PublishedConfig) -> dict:
    self._check_writable(config)
    if not (config.qkv_bias and config.logit_shift):
      raise ValueError(f"config.qkv_bias={config.qkv_bias}, logit_shift={config.logit_shift} "
                       f"cannot be written as {self.family} (its code has q/k/v biases and "
                       "shifts logits)")
    raw = {"architectures": list(self.architectures), "model_type": self.model_types[0],
           **qwen_config_json(config), "mask_token_id": config.mask_id, "use_cache": False}
    if config.rope_scaling is not None:
      raw["rope_scaling"] = {"rope_type": "llama3", **dict(zip(LLAMA3_KEYS, config.rope_scaling))}
    return with_special_ids(raw, config)
