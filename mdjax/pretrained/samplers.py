"""The published samplers, as their reference code runs them, on mdjax's sampler families.

`generate` is LLaDA's `generate.py` (with Fast-dLLM's threshold, factor and KV caches);
`diffusion_generate` is Dream's `diffusion_generate` (`_sample`). Each call is one compiled
program (`sampling.sample`); the arguments are checked before anything compiles.

Both are the families' reference samplers (`mdjax.checkpoints.llada.plan`,
`mdjax.checkpoints.dream.plan`: the spec and the denoiser a call samples) run on ids.

`model` is a loaded checkpoint (`mdjax.pretrained.load`: a `mdjax.model.Model`) or anything
with its fields: `denoiser` (a `Denoiser`), `params`, `mask_id`, `eos_id` and `eot_id` (or
`config.eot_id`). Its logits cover the checkpoint's vocabulary, the mask id inside it (its
logit -inf).
"""

from __future__ import annotations

import jax
import numpy as np

from mdjax import sampling
from mdjax.checkpoints import dream as dream_family
from mdjax.checkpoints import llada as llada_family
from mdjax.denoiser import Denoiser

Array = jax.Array


def generate(model, prompt_BxP, *, steps: int, gen_length: int, block_length: int,
             temperature: float = 0.0, cfg_scale: float = 0.0,
             remasking: str = "low_confidence", logits_eos_inf: bool = False,
             confidence_eos_eot_inf: bool = False, attention_mask=None, key=None,
             threshold: float | None = None, factor: float | None = None,
             kv_cache: str = "none") -> Array:
  """LLaDA's `generate`: ids [B, P + gen_length], the prompt then the generation.

  The generation is cut into gen_length / block_length blocks decoded left to right, each
  in steps / num_blocks steps (steps must be a multiple of the number of blocks). Each step
  proposes x0 at every masked position of the block (argmax at temperature 0; at T > 0 a
  draw from softmax(logits / T), the law of LLaDA's float64 Gumbel noise, from mdjax's
  random streams, so not torch's numbers) and commits the most confident: confidence is the
  proposal's probability under softmax(logits) (`remasking="low_confidence"`) or uniform
  noise (`"random"`). A block of N masked positions commits N // S per step for its S
  steps, the remainder one more each on the first steps (`get_num_transfer_tokens`).
  Nothing ends a row early: EOS is a token like any other.

  Args:
    model: a loaded checkpoint (module docstring).
    prompt_BxP: int ids, no mask id among them; left-padded rows with `attention_mask`.
    steps, gen_length, block_length: as LLaDA's.
    temperature: >= 0.
    cfg_scale: classifier-free guidance, un + (cfg_scale + 1)(cond - un), the whole prompt
      [0, P) masked in the unconditional rows (`sampling.classifier_free`); 0: none.
    remasking: "low_confidence" or "random".
    logits_eos_inf: the EOS logit is -inf (never proposed; confidence renormalised
      without it), as LLaDA sets it before the noise and the softmax.
    confidence_eos_eot_inf: as LLaDA's code does it: after x0 is drawn, the EoT logit
      (`model.eot_id`) is -inf in the softmax the confidence reads, so an EoT
      proposal scores 0 (below every other proposal) and the other proposals'
      probabilities are renormalised without it. The same line sets EOS to -inf in the
      noised logits, which at temperature 0 are the logits themselves (the noise function
      returns its input): so at T = 0 EOS is excluded from that softmax too, and at T > 0
      it is not (nothing reads the noised logits after x0). No effect with
      remasking="random".
    attention_mask: [B, P], 1 real and 0 padding (left padding); the generation is real.
    key: a PRNG key (default key(0)); only T > 0 and random remasking read it.
    threshold: Fast-dLLM's `get_transfer_index`: each step commits the most confident
      proposal and every other one of the block with confidence >= threshold, in (0, 1].
    factor: Fast-dLLM's `get_transfer_index_dynamic` (`ConfidenceSpec.factor`), > 0.
      With threshold or factor a block runs until it has no mask, which takes at most
      block_length steps: that is the bound, and steps only has to meet the rule above.
    kv_cache: "none"; "dual" (Fast-dLLM's DualCache: a full pass at each block's first step
      gives that step's logits and caches every position's keys and values, then passes
      over the block attend to the cached prefix and suffix); "prefix" (Fast-dLLM's
      `generate_with_prefix_cache`: the later passes run over the block and everything
      after it, attending to the cached keys and values of the positions before the block).
  """
  prompt_BxP = _prompt(model, prompt_BxP)
  batch, prompt_length = prompt_BxP.shape
  plan = llada_family.plan(
      model, prompt_length=prompt_length, gen_length=gen_length, steps=steps,
      block_length=block_length, temperature=temperature, cfg_scale=cfg_scale,
      remasking=remasking, logits_eos_inf=logits_eos_inf,
      confidence_eos_eot_inf=confidence_eos_eot_inf, threshold=threshold, factor=factor,
      kv_cache=kv_cache)
  valid_BxL = _valid(attention_mask, batch, prompt_length, gen_length)
  return _run(model, plan.denoiser, prompt_BxP, gen_length, plan.spec, valid_BxL, key)


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

  attention_mask: [B, P], 1 real and 0 padding (left padding); it reaches the model as
  `valid_BxL` (Dream's positions counted from each row's first real token are the
  model's). key: a PRNG key (default key(0)); origin's reveals, T > 0 and alg_temp > 0
  read it.
  """
  prompt_BxP = _prompt(model, prompt_BxP)
  batch, prompt_length = prompt_BxP.shape
  plan = dream_family.plan(model, max_new_tokens=max_new_tokens, steps=steps, eps=eps, alg=alg,
                           alg_temp=alg_temp, temperature=temperature, top_p=top_p, top_k=top_k,
                           per_row_count=per_row_count)
  valid_BxL = _valid(attention_mask, batch, prompt_length, max_new_tokens)
  return _run(model, plan.denoiser, prompt_BxP, max_new_tokens, plan.spec, valid_BxL, key)


# --- shared -------------------------------------------------------------------------------


def _run(model, denoiser: Denoiser, prompt_BxP: np.ndarray, gen_length: int, spec,
         valid_BxL, key) -> Array:
  """The canvas [prompt, gen_length masks] sampled with `spec`: its final ids."""
  batch, _ = prompt_BxP.shape
  canvas_BxL = np.concatenate(
      [prompt_BxP, np.full((batch, gen_length), model.mask_id, np.int32)], axis=1)
  key = jax.random.key(0) if key is None else key
  result = sampling.sample(denoiser, model.params, key, canvas_BxL, spec,
                           mask_id=model.mask_id, valid_BxL=valid_BxL)
  return result.tokens_BxL


def _prompt(model, prompt_BxP) -> np.ndarray:
  prompt = np.asarray(prompt_BxP)
  if prompt.ndim != 2 or not np.issubdtype(prompt.dtype, np.integer) or 0 in prompt.shape:
    raise ValueError(f"prompt_BxP has shape {prompt.shape} and dtype {prompt.dtype}; it must "
                     "be a 2-D integer array with at least one row and one position.")
  if (prompt == model.mask_id).any():
    row, pos = np.argwhere(prompt == model.mask_id)[0]
    raise ValueError(f"prompt_BxP holds the mask id {model.mask_id} (row {row}, position "
                     f"{pos}); a prompt is given tokens (pad with another id).")
  return prompt.astype(np.int32)


def _valid(attention_mask, batch: int, prompt_length: int, gen_length: int):
  """valid_BxL: the attention mask extended with ones over the generation (None: none)."""
  if attention_mask is None:
    return None
  mask = np.asarray(attention_mask)
  if mask.shape != (batch, prompt_length):
    raise ValueError(f"attention_mask has shape {mask.shape}; prompt_BxP has "
                     f"{(batch, prompt_length)}.")
  if not np.isin(mask, (0, 1)).all():
    raise ValueError("attention_mask must hold 1 (a real token) and 0 (padding) only.")
  return np.concatenate([mask.astype(bool), np.ones((batch, gen_length), bool)], axis=1)
