"""Log-probabilities of completions given their prompts, for RL objectives.

`per_token_logps_fn`: d1's one-step estimate (dllm-reasoning/d1, diffu_grpo_trainer.py
`forward_process` + `get_logits` + `_get_per_token_logps`, one mask seed): the completion
fully masked, each prompt token masked with probability `p_mask_prompt`, one denoiser pass,
the log-softmax at each completion position gathered at its token. `cfg_scale` > 0 is
d1's (LLaDA's) unsupervised guidance: a second pass with the whole prompt masked,
logits = un + (cfg_scale + 1) (cond - un). The mask id's logit is ruled out (-inf) when it
lies inside the vocabulary, as every mdjax sampler and scorer does, so a completion token's
probability is over the real tokens only.

`elbo_logps_fn`: the completion's Monte Carlo ELBO given the prompt, by mdjax's stratified
estimator (`mdjax.evaluate.loglikelihood`, LLaDA's): num_samples draws whose masked counts
evenly cover 1..C, each weighted C / count; a lower bound on log p(completion | prompt),
tight in expectation for an exact denoiser, differentiable in the params.

`trajectory_logps_fn`: the rollout's own trajectory, each completion token scored under the
canvas of the sampler step that wrote it (`SampleResult.write_step_BxL`): one pass a step, the
log-probability of the parallel decode the sampler actually ran.

`coupled_logps_fn`: coupled-GRPO's estimate (DiffuCoder, apple/ml-diffucoder,
`src/open_r1/coupled_grpo.py` `forward_process` + `selective_log_softmax`): a mask ratio t
uniform in [t_min, t_max], one uniform draw per completion position splitting the completion
into a mask M and its complement, so each position is masked in exactly one of the pair; three
passes (the completion fully masked; M masked; the complement masked), and per position
(log p_full + log p_pair / w) / 2 with log p_pair from the pass that masked it and w = t for M,
1 - t for the complement.

All four are functional (params an argument, `prompt_length` and the settings static) for a
trainer to jit and differentiate; `per_token_logps` is the first for a `mdjax.Model`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.denoiser import Denoiser
from mdjax.evaluate.loglikelihood import denoiser_logits, draw_values
from mdjax.models.checks import check_count, is_int, is_number

Array = jax.Array


def _check(ids_BxL, prompt_length, mask_id, p_mask_prompt=0.0, cfg_scale=0.0) -> None:
  """The arguments, checked before tracing: a ValueError names the bad one."""
  shape = np.shape(ids_BxL)
  if len(shape) != 2 or shape[0] == 0:
    raise ValueError(f"ids_BxL has shape {shape}; expected [B >= 1, L].")
  if not (is_int(prompt_length) and 0 <= prompt_length < shape[1]):
    raise ValueError(f"prompt_length={prompt_length!r} must be an integer in [0, {shape[1]}) "
                     f"(ids_BxL holds {shape[1]} positions; the completion needs one).")
  check_count("mask_id", mask_id, 0)
  if not (is_number(p_mask_prompt) and 0.0 <= p_mask_prompt <= 1.0):
    raise ValueError(f"p_mask_prompt={p_mask_prompt!r} must be a probability in [0, 1].")
  if not (is_number(cfg_scale) and cfg_scale >= 0.0):
    raise ValueError(f"cfg_scale={cfg_scale!r} must be a number >= 0.")


def _no_mask(logits_NxLxV: Array, mask_id: int) -> Array:
  """The mask id's logit at -inf where it lies inside the vocabulary (a published LLaDA);
  after the guidance combination, whose (-inf) - (-inf) there is NaN."""
  if mask_id >= logits_NxLxV.shape[-1]:  # mdjax's models: logits over the V real ids
    return logits_NxLxV
  return logits_NxLxV.at[..., mask_id].set(-jnp.inf)


def per_token_logps_fn(denoiser, params, ids_BxL, prompt_length: int, key: Array, *,
                       mask_id: int, p_mask_prompt: float = 0.0, cfg_scale: float = 0.0,
                       valid_BxL=None) -> Array:
  """log p(completion token | masked completion, prompt) per completion position, float32
  [B, C] with C = L - prompt_length (d1's one-step estimate, one mask draw from `key`).

  valid_BxL: False on left padding of the prompt, passed to the denoiser (d1 passes none:
  its padding is EOS tokens the model attends to). The completion is given the time t = 1
  (all of it masked).
  """
  _check(ids_BxL, prompt_length, mask_id, p_mask_prompt, cfg_scale)
  denoiser = Denoiser.of(denoiser)
  ids_BxL = jnp.asarray(ids_BxL, jnp.int32)
  batch, length = ids_BxL.shape
  # forward_process: prompt token masked where its uniform draw is below p_mask_prompt,
  # every completion token masked.
  is_prompt_L = jnp.arange(length) < prompt_length
  draw_BxL = jax.random.uniform(key, (batch, length))
  is_mask_BxL = (is_prompt_L & (draw_BxL < p_mask_prompt)) | ~is_prompt_L
  noisy_BxL = jnp.where(is_mask_BxL, mask_id, ids_BxL)
  t_B = jnp.ones((batch,), jnp.float32)
  valid = None if valid_BxL is None else jnp.asarray(valid_BxL, bool)
  # get_logits: LLaDA's guidance masks the prompt positions of the second pass.
  logits_BxLxV = denoiser_logits(denoiser, params, noisy_BxL, t_B, valid, prompt_length,
                                 mask_id, float(cfg_scale))
  logits_BxCxV = _no_mask(logits_BxLxV[:, prompt_length:], mask_id)
  logp_BxCxV = jax.nn.log_softmax(logits_BxCxV, -1)
  target_BxC = ids_BxL[:, prompt_length:]
  return jnp.take_along_axis(logp_BxCxV, target_BxC[..., None], -1)[..., 0]


def elbo_logps_fn(denoiser, params, ids_BxL, prompt_length: int, key: Array, *, mask_id: int,
                  num_samples: int, draws_per_call: int | None = None) -> Array:
  """The stratified Monte Carlo ELBO of log p(completion | prompt) per row, float32 [B]
  (`mdjax.evaluate.loglikelihood`'s estimator; its mean over keys is the bound).

  num_samples draws (masked counts j C / num_samples + u mod C, a uniform subset of that
  many completion positions each, weight C / count); draws_per_call of them per denoiser
  call (default all: num_samples x B rows in one pass).
  """
  _check(ids_BxL, prompt_length, mask_id)
  check_count("num_samples", num_samples)
  per_call = num_samples if draws_per_call is None else draws_per_call
  check_count("draws_per_call", per_call)
  if num_samples % per_call:
    raise ValueError(f"num_samples={num_samples} must be a multiple of "
                     f"draws_per_call={per_call}.")
  ids_BxL = jnp.asarray(ids_BxL, jnp.int32)
  values_SxB = draw_values(
      Denoiser.of(denoiser), params, key, ids_BxL[:, :prompt_length],
      ids_BxL[:, prompt_length:], None, estimator="stratified", num_samples=int(num_samples),
      batch_size=int(per_call), mask_id=int(mask_id), cfg_scale=0.0, eps=1e-3)
  return values_SxB.mean(0)


@functools.partial(jax.jit, static_argnames=("denoiser", "prompt_length", "mask_id",
                                             "p_mask_prompt", "cfg_scale"))
def _per_token_logps(denoiser, params, ids_BxL, key, valid_BxL, *, prompt_length, mask_id,
                     p_mask_prompt, cfg_scale):
  return per_token_logps_fn(denoiser, params, ids_BxL, prompt_length, key, mask_id=mask_id,
                            p_mask_prompt=p_mask_prompt, cfg_scale=cfg_scale,
                            valid_BxL=valid_BxL)


def trajectory_logps_fn(denoiser, params, ids_BxL, write_step_BxL, prompt_length: int, *,
                        mask_id: int, num_steps: int, valid_BxL=None) -> Array:
  """log p(token | the canvas its sampler step read) per completion position, float32 [B, C]:
  the log-probability of the rollout's own trajectory. Step s's canvas shows the positions
  written before it (`write_step_BxL` < s: the prompt, -1, and earlier steps) and masks the
  rest; each position is scored at the step that wrote it (`SampleResult.write_step_BxL`),
  one denoiser pass per step (`num_steps`, static: the sampler's). For a sampler that writes
  each position once the sum over a row is the log-probability of its tokens given the order
  the sampler chose (with an exact denoiser and one position a step, log p(completion |
  prompt) by the chain rule); the choice of positions itself is not scored. A remasked
  position is scored at its last write. The time a step reads is its masked fraction of
  the completion.
  """
  _check(ids_BxL, prompt_length, mask_id)
  check_count("num_steps", num_steps, 1)
  denoiser = Denoiser.of(denoiser)
  ids_BxL = jnp.asarray(ids_BxL, jnp.int32)
  write_BxL = jnp.asarray(write_step_BxL, jnp.int32)
  valid = None if valid_BxL is None else jnp.asarray(valid_BxL, bool)
  target_BxC = ids_BxL[:, prompt_length:]

  def step_logps(step):
    hidden_BxL = write_BxL >= step
    noisy_BxL = jnp.where(hidden_BxL, mask_id, ids_BxL)
    t_B = hidden_BxL[:, prompt_length:].mean(-1).astype(jnp.float32)
    logits_BxLxV = denoiser_logits(denoiser, params, noisy_BxL, t_B, valid, prompt_length,
                                   mask_id, 0.0)
    logp_BxCxV = jax.nn.log_softmax(_no_mask(logits_BxLxV[:, prompt_length:], mask_id), -1)
    logp_BxC = jnp.take_along_axis(logp_BxCxV, target_BxC[..., None], -1)[..., 0]
    return jnp.where(write_BxL[:, prompt_length:] == step, logp_BxC, 0.0)

  return jax.lax.map(step_logps, jnp.arange(num_steps)).sum(0)


COUPLED_T_RANGE = (0.2, 0.8)  # DiffuCoder's `random.uniform(0.2, 0.8)`


def complementary_masks(key: Array, num_rows: int, completion_length: int, *,
                        t_min: float = COUPLED_T_RANGE[0], t_max: float = COUPLED_T_RANGE[1]
                        ) -> tuple[Array, Array]:
  """coupled-GRPO's pair of masks: (is_first_BxC bool, t float32 scalar). The first mask of a
  position is `u < t` for its own uniform u, the second is its complement, so every position
  is masked in exactly one mask of the pair (DiffuCoder's `u > t` differs only at u == t).
  One t for the whole batch, as DiffuCoder draws it per call."""
  t_key, u_key = jax.random.split(key)
  t = jax.random.uniform(t_key, (), jnp.float32, t_min, t_max)
  u_BxC = jax.random.uniform(u_key, (num_rows, completion_length))
  return u_BxC < t, t


def coupled_logps_fn(denoiser, params, ids_BxL, prompt_length: int, key: Array, *,
                     mask_id: int, t_min: float = COUPLED_T_RANGE[0],
                     t_max: float = COUPLED_T_RANGE[1], valid_BxL=None) -> Array:
  """coupled-GRPO's per-position estimate, float32 [B, C] (module docstring): one mask pair
  from `key` (`complementary_masks`), three passes in one denoiser call of 3 B rows, the
  prompt never masked (DiffuCoder's forward_process leaves it). Its value is DiffuCoder's
  weighted average, not a log-probability: the pair's term divides by t or 1 - t (its
  expectation over the pair's draw is about twice the position's log-probability under a
  partly masked completion)."""
  _check(ids_BxL, prompt_length, mask_id)
  if not (is_number(t_min) and is_number(t_max) and 0.0 < t_min <= t_max < 1.0):
    raise ValueError(f"(t_min, t_max)=({t_min!r}, {t_max!r}) must satisfy 0 < t_min <= t_max "
                     "< 1 (the pair divides by t and 1 - t).")
  denoiser = Denoiser.of(denoiser)
  ids_BxL = jnp.asarray(ids_BxL, jnp.int32)
  batch, length = ids_BxL.shape
  completion = length - prompt_length
  first_BxC, t = complementary_masks(key, batch, completion, t_min=t_min, t_max=t_max)
  hidden_3xBxC = jnp.stack([jnp.ones_like(first_BxC), first_BxC, ~first_BxC])
  prompt_3xBxP = jnp.zeros((3, batch, prompt_length), bool)
  hidden_3xBxL = jnp.concatenate([prompt_3xBxP, hidden_3xBxC], -1)
  noisy_NxL = jnp.where(hidden_3xBxL, mask_id, ids_BxL[None]).reshape(3 * batch, length)
  t_N = hidden_3xBxC.mean(-1).reshape(-1).astype(jnp.float32)
  valid = None if valid_BxL is None else jnp.tile(jnp.asarray(valid_BxL, bool), (3, 1))
  logits_NxLxV = denoiser_logits(denoiser, params, noisy_NxL, t_N, valid, prompt_length,
                                 mask_id, 0.0)
  logp_NxCxV = jax.nn.log_softmax(_no_mask(logits_NxLxV[:, prompt_length:], mask_id), -1)
  target_NxC = jnp.tile(ids_BxL[:, prompt_length:], (3, 1))
  logp_3xBxC = jnp.take_along_axis(logp_NxCxV, target_NxC[..., None], -1)[..., 0].reshape(
      3, batch, completion)
  pair_BxC = jnp.where(first_BxC, logp_3xBxC[1] / t, logp_3xBxC[2] / (1.0 - t))
  return (logp_3xBxC[0] + pair_BxC) / 2


def per_token_logps(model, ids_BxL, prompt_length: int, *, key: Array,
                    p_mask_prompt: float = 0.0, cfg_scale: float = 0.0,
                    valid_BxL=None) -> Array:
  """`per_token_logps_fn` of a `mdjax.Model` (its denoiser, params and mask id), compiled
  once per shape and settings: float32 [B, L - prompt_length]."""
  _check(ids_BxL, prompt_length, model.mask_id, p_mask_prompt, cfg_scale)
  ids = np.asarray(ids_BxL)
  if ids.shape[1] > model.max_len:
    raise ValueError(f"ids_BxL holds {ids.shape[1]} positions; the model holds "
                     f"max_len={model.max_len}.")
  if ((ids < 0) | (ids >= max(model.vocab_size, model.mask_id + 1))).any():
    raise ValueError(f"ids_BxL holds ids outside [0, {model.vocab_size}) (the model's "
                     "vocabulary).")
  if (ids[:, prompt_length:] == model.mask_id).any():
    raise ValueError(f"the completion ids_BxL[:, {prompt_length}:] hold the mask id "
                     f"{model.mask_id}: a completion to score must be fully written.")
  if valid_BxL is not None and not model.takes_padding:
    raise ValueError(f"valid_BxL given for a {model.family!r} model, whose positions are "
                     "fixed (no padding).")
  return _per_token_logps(model.denoiser, model.params, jnp.asarray(ids, jnp.int32), key,
                          None if valid_BxL is None else jnp.asarray(valid_BxL, bool),
                          prompt_length=int(prompt_length), mask_id=int(model.mask_id),
                          p_mask_prompt=float(p_mask_prompt), cfg_scale=float(cfg_scale))
