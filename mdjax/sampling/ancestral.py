"""The ancestral reverse kernel (MD4 / MDLM) and its remasking form (ReMDM).

Both families share one kernel, so remasking with sigma = 0 is the ancestral
sampler token for token: the reveal draws, the value draws and the reveal
probabilities are the same arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.sampling import specs as specs_lib
from mdjax.sampling import transforms
from mdjax.sampling.state import Context, State, candidates, commit, value_probs

Array = jax.Array


def _interval_arrays(schedule, t_K: np.ndarray, s_K: np.ndarray) -> dict[str, np.ndarray]:
  """Reveal probability 1 - (1 - alpha_s) / (1 - alpha_t) per interval."""
  oma_t = np.asarray(schedule.one_minus_alpha(t_K), np.float64)
  oma_s = np.asarray(schedule.one_minus_alpha(s_K), np.float64)
  oma_s = np.where(s_K == 0.0, 0.0, oma_s)
  return {"oma_t": oma_t, "oma_s": oma_s, "reveal_p": 1.0 - oma_s / oma_t}


def plan_ancestral(spec: specs_lib.AncestralSpec, num_blocks: int) -> dict[str, np.ndarray]:
  """Per-step arrays: each block runs its own grid of steps / num_blocks steps."""
  per_block = spec.steps // num_blocks
  times = specs_lib.time_grid(spec.grid, per_block)
  t_K = np.tile(times[:-1], num_blocks)
  s_K = np.tile(times[1:], num_blocks)
  xs = _interval_arrays(spec.schedule, t_K, s_K)
  xs.update(t=t_K, block=np.repeat(np.arange(num_blocks), per_block),
            sigma=np.zeros_like(t_K))
  return xs


def _loop_time(t: np.ndarray, t_on: float, t_off: float) -> np.ndarray:
  """ReMDM-loop clock: held at t_on on [t_off, t_on], compressed below t_off."""
  return np.where(t >= t_on, t, np.where(t >= t_off, t_on, t * t_on / t_off))


def plan_remask(spec: specs_lib.RemaskSpec) -> dict[str, np.ndarray]:
  """Per-step arrays, with the scalar sigma (cap, rescale) or sigma_max (conf)."""
  times = specs_lib.time_grid(spec.grid, spec.steps)
  t_K, s_K = times[:-1], times[1:]
  sigma_on = np.ones_like(t_K, bool)
  if spec.loop_t_on is not None:
    sigma_on = (s_K >= spec.loop_t_off) & (t_K <= spec.loop_t_on)
    t_K = _loop_time(t_K, spec.loop_t_on, spec.loop_t_off)
    s_K = _loop_time(s_K, spec.loop_t_on, spec.loop_t_off)
  xs = _interval_arrays(spec.schedule, t_K, s_K)
  alpha_t = 1.0 - xs["oma_t"]
  with np.errstate(divide="ignore"):
    sigma_max = np.where(alpha_t > 0, np.minimum(1.0, xs["oma_s"] / alpha_t), 1.0)
  if spec.sigma == "cap":
    sigma = np.minimum(spec.eta, sigma_max)
  elif spec.sigma == "rescale":
    sigma = spec.eta * sigma_max
  else:  # conf: sigma_max, spread over committed tokens at run time
    sigma = sigma_max
  xs.update(t=t_K, block=np.zeros(len(t_K), np.int32), sigma=np.where(sigma_on, sigma, 0.0))
  return xs


def update(spec, state: State, ctx: Context, xs, logits_BxLxV: Array,
           keys_B: Array) -> State:
  """One reverse step t -> s: remask committed tokens, reveal masked ones."""
  length = state.tokens_BxL.shape[1]
  masked_BxL = candidates(state, ctx, xs["block"])
  committed_BxL = (state.tokens_BxL != ctx.mask_id) & ctx.editable_BxL
  values_BxL = transforms.draw_values(keys_B, logits_BxLxV, **spec.transform)
  _, conf_BxL = value_probs(logits_BxLxV, values_BxL)
  reveal_p_B = jnp.broadcast_to(xs["reveal_p"], state.tokens_BxL.shape[:1])
  remask_BxL = jnp.zeros_like(committed_BxL)
  if isinstance(spec, specs_lib.RemaskSpec):
    if spec.sigma == "conf":
      # Spread sigma_max by softmax(-confidence when written) over committed.
      logit_BxL = jnp.where(committed_BxL, -state.write_conf_BxL, -jnp.inf)
      share_BxL = jnp.where(committed_BxL, jax.nn.softmax(logit_BxL, axis=-1), 0.0)
      sigma_BxL = xs["sigma"] * share_BxL
    else:
      sigma_BxL = jnp.where(committed_BxL, xs["sigma"], 0.0)
    num_committed_B = jnp.maximum(committed_BxL.sum(-1), 1)
    mean_sigma_B = sigma_BxL.sum(-1) / num_committed_B
    # (alpha_s - (1 - sigma) alpha_t) / (1 - alpha_t), which keeps the marginal.
    alpha_t = 1.0 - xs["oma_t"]
    reveal_p_B = jnp.minimum(1.0, reveal_p_B + mean_sigma_B * alpha_t / xs["oma_t"])
    remask_u_BxL = transforms.row_uniform(keys_B, transforms.REMASK, (length,))
    remask_BxL = committed_BxL & (remask_u_BxL < sigma_BxL)
  reveal_u_BxL = transforms.row_uniform(keys_B, transforms.REVEAL, (length,))
  reveal_BxL = masked_BxL & (reveal_u_BxL < reveal_p_B[:, None])
  state = commit(state, reveal_BxL, values_BxL, conf_BxL, xs["step"])
  return state.replace(
      tokens_BxL=jnp.where(remask_BxL, ctx.mask_id, state.tokens_BxL),
      reopened_B=state.reopened_B + remask_BxL.sum(-1),
  )
