"""MDPO, masked diffusion policy optimization (He et al. 2025, arXiv 2508.13148; code
github.com/autonomousvision/mdpo at e6ae439, `src/open_r1/mdpo/mdpo_trainer.py`,
`src/mdlm_generation_utils.py` `diffusion_generate`): train under the inference-time schedule.

A rollout of S sampler steps is S decisions. At step s the sampler read a canvas c_s (the
positions it had written before s shown, the rest masked) and drew a prediction x0_s of every
masked position (it committed some of them, the rest it threw away). MDPO scores x0_s (the
canvas with its masks filled by the step's draws) with the reward: r_s, the intermediate
reward, and gives step s the advantage (its "adv-v4")

    a_s = (r_s - r_{s-1}) + 1 + mean_{k > s} r_k     (r_{-1} = 0; the last step: + r_{S-1})

normalised per step over the group, (a_s - mean) / (std + 1e-4) (std with ddof 1). It trains
on the `train_steps` steps of largest sum over the batch of |A_s|: at each, every masked
position of c_s, its target the step's draw x0_s, its weight the draw's probability (the
confidence, detached) times lambda_s = C / (masked count of the row):

    loss_s = sum_{b, i masked} -min(rho A_bs, clip(rho, 1 - eps, 1 + eps) A_bs) lambda_bs
             conf_bsi / (masked count of the batch + 1e-4)

with rho the ratio to the rollout policy (1 with one inner iteration), the log-probabilities
those of the logits divided by the sampling temperature (MDPO's); the loss of an update is
the mean over the selected steps (MDPO accumulates them as micro-batches). No KL (MDPO's
recipe runs beta 0; `rl.beta` is not read).

Where this deviates: mdjax's sampler returns the step that wrote each position, not the
draws it threw away, so x0_s is rebuilt after the rollout: the committed positions keep the
rollout's tokens; the other masked positions get a fresh draw from the same step
distribution, softmax(logits(c_s) / T) (MDPO's own draws are conditioned on having lost the
confidence ranking to the committed ones; a fresh draw is not). MDPO's extra rollout modes
(running confidence remasking, mixed block lengths, the answer-backslide data selection)
are not part of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.denoiser import Denoiser
from mdjax.evaluate.loglikelihood import denoiser_logits

Array = jax.Array

TRAIN_STEPS = 16  # MDPO's sample_train_steps (of its 128 diffusion steps)


def _step_logp(denoiser, params, ids_BxL, write_BxL, step, prompt_length: int, *, mask_id: int,
               temperature: float, valid_BxL=None) -> tuple[Array, Array]:
  """(log-softmax [B, C, V] of step `step`'s canvas at the temperature, masked_BxC)."""
  masked_BxL = write_BxL >= step
  noisy_BxL = jnp.where(masked_BxL, mask_id, ids_BxL)
  masked_BxC = masked_BxL[:, prompt_length:]
  t_B = masked_BxC.mean(-1).astype(jnp.float32)
  logits = denoiser_logits(denoiser, params, noisy_BxL, t_B, valid_BxL, prompt_length, mask_id,
                           0.0)[:, prompt_length:].astype(jnp.float32)
  if mask_id < logits.shape[-1]:
    logits = logits.at[..., mask_id].set(-jnp.inf)
  return jax.nn.log_softmax(logits / temperature, -1), masked_BxC


def step_predictions(denoiser, params, ids_BxL, write_step_BxL, key: Array, prompt_length: int,
                     *, mask_id: int, num_steps: int, temperature: float, valid_BxL=None
                     ) -> tuple[Array, Array, Array]:
  """(x0_SxBxC, conf_SxBxC, masked_SxBxC) of a rollout (module docstring): each step's canvas
  rebuilt from the write steps, its prediction of every masked position (the rollout's token
  where the step committed it, else a fresh draw from fold_in(key, s)), that token's
  probability at the temperature, and the step's masked positions."""
  denoiser = Denoiser.of(denoiser)
  ids_BxL = jnp.asarray(ids_BxL, jnp.int32)
  write_BxL = jnp.asarray(write_step_BxL, jnp.int32)
  target_BxC = ids_BxL[:, prompt_length:]
  written_BxC = write_BxL[:, prompt_length:]
  valid = None if valid_BxL is None else jnp.asarray(valid_BxL, bool)

  def one(step):
    logp_BxCxV, masked_BxC = _step_logp(denoiser, params, ids_BxL, write_BxL, step,
                                        prompt_length, mask_id=mask_id,
                                        temperature=temperature, valid_BxL=valid)
    draw_BxC = jax.random.categorical(jax.random.fold_in(key, step), logp_BxCxV, axis=-1)
    x0_BxC = jnp.where(masked_BxC & (written_BxC != step), draw_BxC, target_BxC)
    conf_BxC = jnp.exp(jnp.take_along_axis(logp_BxCxV, x0_BxC[..., None], -1)[..., 0])
    return x0_BxC.astype(jnp.int32), jnp.where(masked_BxC, conf_BxC, 0.0), masked_BxC

  return jax.lax.map(one, jnp.arange(num_steps))


def step_logps(denoiser, params, ids_BxL, write_step_BxL, steps_K, x0_KxBxC, prompt_length: int,
               *, mask_id: int, temperature: float, valid_BxL=None) -> Array:
  """log p(x0_k | the canvas of step steps_K[k]) at the temperature, float32 [K, B, C]."""
  denoiser = Denoiser.of(denoiser)
  ids_BxL = jnp.asarray(ids_BxL, jnp.int32)
  write_BxL = jnp.asarray(write_step_BxL, jnp.int32)
  valid = None if valid_BxL is None else jnp.asarray(valid_BxL, bool)

  def one(args):
    step, x0_BxC = args
    logp_BxCxV, _ = _step_logp(denoiser, params, ids_BxL, write_BxL, step, prompt_length,
                               mask_id=mask_id, temperature=temperature, valid_BxL=valid)
    return jnp.take_along_axis(logp_BxCxV, x0_BxC[..., None], -1)[..., 0]

  return jax.lax.map(one, (jnp.asarray(steps_K, jnp.int32), jnp.asarray(x0_KxBxC, jnp.int32)))


def step_advantages(rewards_BxS, group: int) -> np.ndarray:
  """MDPO's adv-v4 per step, normalised over each group per step: float32 [B, S]."""
  r = np.asarray(rewards_BxS, np.float64)
  num_steps = r.shape[1]
  diff = np.concatenate([r[:, :1], r[:, 1:] - r[:, :-1]], 1) + 1.0
  later = np.cumsum(r[:, 1:][:, ::-1], 1)[:, ::-1] / np.arange(num_steps - 1, 0, -1)
  adv = diff + np.concatenate([later, r[:, -1:]], 1)
  adv_GxNxS = adv.reshape(-1, group, num_steps)
  mean = adv_GxNxS.mean(1, keepdims=True)
  std = adv_GxNxS.std(1, ddof=1, keepdims=True)
  return ((adv_GxNxS - mean) / (std + 1e-4)).reshape(r.shape).astype(np.float32)


def select_steps(advantages_BxS, count: int) -> np.ndarray:
  """The `count` steps of largest sum over rows of |A| (MDPO's topk), largest first."""
  total_S = np.abs(np.asarray(advantages_BxS)).sum(0)
  return np.argsort(-total_S, kind="stable")[:count].astype(np.int32)


def mdpo_loss(logps_KxBxC, old_KxBxC, advantages_KxB, masked_KxBxC, conf_KxBxC, *,
              epsilon: float) -> tuple[Array, dict[str, Array]]:
  """MDPO's loss (module docstring), the mean over the K selected steps; metrics:
  clip_ratio (as d1 counts it), over the masked tokens."""
  logps = jnp.asarray(logps_KxBxC, jnp.float32)
  old = jax.lax.stop_gradient(logps) if old_KxBxC is None else jnp.asarray(old_KxBxC)
  masked = jnp.asarray(masked_KxBxC, jnp.float32)
  advantages = jnp.asarray(advantages_KxB, jnp.float32)[..., None]
  lambda_KxB = masked.shape[-1] / (masked.sum(-1) + 1e-4)
  ratio = jnp.exp(logps - old)
  unclipped = ratio * advantages
  clipped = jnp.clip(ratio, 1 - epsilon, 1 + epsilon) * advantages
  per_token = -jnp.minimum(unclipped, clipped) * lambda_KxB[..., None]
  weight = masked * jnp.asarray(conf_KxBxC, jnp.float32)
  per_step_K = (per_token * weight).sum((1, 2)) / (masked.sum((1, 2)) + 1e-4)
  is_clipped = (unclipped < clipped).astype(jnp.float32)
  clip_ratio = (is_clipped * masked).sum() / jnp.maximum(masked.sum(), 1.0)
  return per_step_K.mean(), {"clip_ratio": clip_ratio}


def option_problem(opts: dict) -> tuple[str, str] | None:
  """The trainer's `rl.mdpo_train_steps` checked for objective 'mdpo': (field, what it
  takes) of the first bad one."""
  count, steps = opts["mdpo_train_steps"], opts["sampler_steps"]
  if not (isinstance(steps, (int, np.integer)) and steps >= 1):
    return "mdpo_train_steps", ("objective 'mdpo' trains on each sampler step: "
                                f"sampler.steps={steps!r} must be an integer >= 1")
  if not (count is None or (isinstance(count, (int, np.integer)) and not isinstance(count, bool)
                            and 1 <= count <= steps)):
    return "mdpo_train_steps", (f"must be None (min({TRAIN_STEPS}, sampler.steps)) or an "
                                f"integer in [1, sampler.steps={steps}]")
  return None
