"""The published samplers, as their reference code runs them, on mdjax's sampler families.

`generate` is LLaDA's `generate.py` (with Fast-dLLM's threshold, factor and KV caches);
`diffusion_generate` is Dream's `diffusion_generate` (`_sample`). Each call is one compiled
program (`sampling.sample`); the arguments are checked before anything compiles.

`model` is a loaded checkpoint (`mdjax.pretrained.load`) or anything with its fields:
`apply_fn` (a `Denoiser`), `params`, `mask_id`, `eos_id` and `config.eot_id`. Its logits
cover the checkpoint's vocabulary, the mask id inside it (its logit -inf).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from mdjax import sampling
from mdjax.denoiser import Denoiser
from mdjax.sampling.families import dream

Array = jax.Array

REMASKINGS = ("low_confidence", "random")
KV_CACHES = ("none", "dual", "prefix")


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
      (`model.config.eot_id`) is -inf in the softmax the confidence reads, so an EoT
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
  _check_int(gen_length, "gen_length", 1)
  _check_int(block_length, "block_length", 1)
  _check_int(steps, "steps", 1)
  if gen_length % block_length:
    raise ValueError(f"gen_length={gen_length} must be a multiple of block_length="
                     f"{block_length}.")
  num_blocks = gen_length // block_length
  if steps % num_blocks:
    raise ValueError(f"steps={steps} must be a multiple of the number of blocks "
                     f"gen_length / block_length = {num_blocks}: each block runs "
                     "steps / num_blocks steps.")
  _check_choice(remasking, "remasking", REMASKINGS)
  _check_choice(kv_cache, "kv_cache", KV_CACHES)
  _check_number(temperature, "temperature", "must be a finite number >= 0", lambda x: x >= 0)
  _check_number(cfg_scale, "cfg_scale", "must be a finite number >= 0", lambda x: x >= 0)
  if threshold is not None:
    _check_number(threshold, "threshold", "must be None or lie in (0, 1]",
                  lambda x: 0 < x <= 1)
  if factor is not None:
    _check_number(factor, "factor", "must be None or a finite number > 0", lambda x: x > 0)
  if threshold is not None and factor is not None:
    raise ValueError(f"threshold={threshold} and factor={factor}: set one (Fast-dLLM's factor "
                     "rule replaces the threshold).")
  for flag, name in ((logits_eos_inf, "logits_eos_inf"),
                     (confidence_eos_eot_inf, "confidence_eos_eot_inf")):
    if not isinstance(flag, bool):
      raise ValueError(f"{name}={flag!r} must be True or False.")
  eos_id, eot_id = model.eos_id, getattr(model.config, "eot_id", None)
  if logits_eos_inf and eos_id is None:
    raise ValueError("logits_eos_inf=True needs the model's EOS id; model.eos_id is None.")
  if confidence_eos_eot_inf and eot_id is None:
    raise ValueError("confidence_eos_eot_inf=True needs the model's EoT id; "
                     "model.config.eot_id is None.")
  valid_BxL = _valid(attention_mask, batch, prompt_length, gen_length)

  adaptive = threshold is not None or factor is not None
  per_block = block_length if adaptive else steps // num_blocks
  spec = sampling.ConfidenceSpec(
      steps=per_block * num_blocks, block_length=block_length, count_rule="even",
      score="prob" if remasking == "low_confidence" else "random", temperature=float(temperature),
      threshold=threshold, factor=factor,
      banned_ids=(eos_id,) if logits_eos_inf else (),
      score_excluded_ids=_excluded(confidence_eos_eot_inf, temperature, eos_id, eot_id),
      kv_cache="none" if kv_cache == "none" else "dual")
  denoiser = Denoiser.of(model.apply_fn)
  if cfg_scale > 0:
    denoiser = sampling.classifier_free(denoiser, float(cfg_scale), prompt_length=prompt_length,
                                        mask_id=model.mask_id)
  if kv_cache != "none" and not denoiser.offers_cache:
    raise ValueError(f"kv_cache={kv_cache!r}: the model offers no cached contract "
                     "(Denoiser.prefill and decode).")
  if kv_cache == "prefix":
    denoiser = prefix_cache(denoiser, prompt_length, block_length)
  return _run(model, denoiser, prompt_BxP, gen_length, spec, valid_BxL, key)


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
  _check_int(max_new_tokens, "max_new_tokens", 1)
  _check_int(steps, "steps", 1)
  _check_choice(alg, "alg", dream.ALGS)
  _check_number(eps, "eps", "must lie in [0, 1)", lambda x: 0 <= x < 1)
  _check_number(temperature, "temperature", "must be a finite number >= 0", lambda x: x >= 0)
  if alg_temp is not None:
    _check_number(alg_temp, "alg_temp", "must be None or a finite number >= 0",
                  lambda x: x >= 0)
  if top_p is not None:
    _check_number(top_p, "top_p", "must be None or lie in (0, 1]", lambda x: 0 < x <= 1)
  if top_k is not None:
    _check_int(top_k, "top_k", 1)
  if not isinstance(per_row_count, bool):
    raise ValueError(f"per_row_count={per_row_count!r} must be True or False.")
  valid_BxL = _valid(attention_mask, batch, prompt_length, max_new_tokens)
  spec = sampling.DreamSpec(steps=steps, eps=float(eps), alg=alg, alg_temp=alg_temp,
                            per_row_count=per_row_count, temperature=float(temperature),
                            top_p=1.0 if top_p is None else float(top_p), top_k=top_k)
  return _run(model, Denoiser.of(model.apply_fn), prompt_BxP, max_new_tokens, spec, valid_BxL,
              key)


def _excluded(confidence_eos_eot_inf: bool, temperature: float, eos_id, eot_id) -> tuple:
  """The ids LLaDA's `confidence_eos_eot_inf` line leaves out of the confidence softmax:
  EoT, and EOS where the noised logits it writes to are the logits (temperature 0)."""
  if not confidence_eos_eot_inf:
    return ()
  return (eot_id,) + ((eos_id,) if temperature == 0 and eos_id is not None else ())


# --- the prefix cache ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _PrefixPrefill:
  inner: Denoiser

  def __call__(self, params, tokens_BxL, t_B, valid_BxL=None):
    logits_BxLxV, cache = self.inner.prefill(params, tokens_BxL, t_B, **_given(valid_BxL))
    return logits_BxLxV, (cache, tokens_BxL)


@dataclasses.dataclass(frozen=True)
class _PrefixDecode:
  """A window pass of the dual cache run as Fast-dLLM's prefix cache: the pass covers the
  block and every position after it (fresh keys and values), attending to the cached
  ones before the block. Its width, the length minus the block's start, is static only
  per block, so the pass is a `lax.switch` over the blocks, one branch per width."""

  inner: Denoiser
  generation_start: int
  block_length: int

  def __call__(self, params, cache, tokens_BxW, start, t_B, valid_BxL=None):
    inner_cache, canvas_BxL = cache
    # The canvas as of the block's first step, with the block's current tokens: the
    # positions after the block do not change while the block is decoded.
    canvas_BxL = jax.lax.dynamic_update_slice_in_dim(canvas_BxL, tokens_BxW, start, axis=1)
    length, width = canvas_BxL.shape[1], tokens_BxW.shape[1]
    num_blocks = (length - self.generation_start) // self.block_length

    def branch(block):
      begin = self.generation_start + block * self.block_length

      def run():
        logits_BxRxV, _ = self.inner.decode(params, inner_cache, canvas_BxL[:, begin:], begin,
                                            t_B, **_given(valid_BxL))
        return logits_BxRxV[:, :width]

      return run

    block = (jnp.asarray(start, jnp.int32) - self.generation_start) // self.block_length
    logits_BxWxV = jax.lax.switch(jnp.clip(block, 0, num_blocks - 1),
                                  [branch(b) for b in range(num_blocks)])
    return logits_BxWxV, cache


def prefix_cache(denoiser, generation_start: int, block_length: int) -> Denoiser:
  """A cached denoiser whose window passes follow Fast-dLLM's prefix cache (`_PrefixDecode`)
  where `sampling.sample`'s dual cache makes window passes; the blocks are those of a
  generation that starts at `generation_start` and runs to the canvas's end."""
  inner = Denoiser.of(denoiser)
  return Denoiser(_PrefixApply(inner), prefill=_PrefixPrefill(inner),
                  decode=_PrefixDecode(inner, int(generation_start), int(block_length)))


@dataclasses.dataclass(frozen=True)
class _PrefixApply:
  inner: Denoiser

  def __call__(self, params, tokens_BxL, t_B, valid_BxL=None):
    return self.inner(params, tokens_BxL, t_B, valid_BxL)


# --- shared -------------------------------------------------------------------------------


def _given(valid_BxL) -> dict:
  return {} if valid_BxL is None else {"valid_BxL": valid_BxL}


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


def _check_int(value, name: str, low: int):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
    raise ValueError(f"{name}={value!r} must be an integer >= {low}.")


def _check_choice(value, name: str, allowed):
  if value not in allowed:
    raise ValueError(f"{name}={value!r} is not supported; one of {allowed}.")


def _check_number(value, name: str, rule: str, ok):
  if (isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating))
      or not math.isfinite(value) or not ok(value)):
    raise ValueError(f"{name}={value!r} {rule}.")
