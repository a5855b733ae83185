"""RL objectives over per-token log-probabilities: d1's diffu-GRPO and wd1.

`group_advantages`: rewards minus their group's mean (d1; `scale_by_std` also divides by the
group's standard deviation plus 1e-4, as TRL's GRPO does and d1 does not).
`grpo_loss`: d1's `DiffuGRPOTrainer.compute_loss` (dllm-reasoning/d1,
diffu-grpo/diffu_grpo_trainer.py): the clipped ratio and the k3 KL to a frozen reference,
summed over the completion tokens of the whole batch and divided by their count.
`wd1_loss`: wd1's ratio-free weighted log-likelihood (xiaohangt/wd1,
wd1/trainers/rev_grpo_trainer.py `RevDiffuGRPOTrainer.compute_loss`; `negative=False` is
rev_grpo_trainer_psr.py's positive-only variant).

Rows are B = prompts x G completions, the G completions of a prompt adjacent (d1's order).
Every function is jit-safe: shapes and the keyword settings are static, values traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mdjax.models.checks import check_count, is_number

Array = jax.Array


def _check_group(num_rows: int, group_size) -> None:
  check_count("group_size", group_size, 2, " (a group needs two completions for a baseline)")
  if num_rows % group_size:
    raise ValueError(f"group_size={group_size} does not divide the {num_rows} rows (rows are "
                     "prompts x group_size completions, a prompt's completions adjacent).")


def group_advantages(rewards_B, group_size: int, *, scale_by_std: bool = False) -> Array:
  """Each reward minus its group's mean (d1's advantage; d1 does not divide by the std).

  scale_by_std: also divide by the group's sample standard deviation (ddof 1, torch's
  default) plus 1e-4, TRL's GRPO normalisation.
  """
  rewards_B = jnp.asarray(rewards_B, jnp.float32)
  if rewards_B.ndim != 1:
    raise ValueError(f"rewards_B has shape {rewards_B.shape}; expected [B].")
  _check_group(rewards_B.shape[0], group_size)
  rewards_NxG = rewards_B.reshape(-1, group_size)
  advantages_NxG = rewards_NxG - rewards_NxG.mean(1, keepdims=True)
  if scale_by_std:
    advantages_NxG = advantages_NxG / (rewards_NxG.std(1, ddof=1, keepdims=True) + 1e-4)
  return advantages_NxG.reshape(-1)


def completion_mask(completion_ids_BxC, stop_ids) -> Array:
  """d1's completion mask, int32 [B, C]: 1 up to and including a row's first stop id (d1:
  the tokenizer's EOS; a `mdjax.Model`'s `stop_ids` are EOS and end of turn), 1 everywhere
  in a row without one."""
  ids_BxC = jnp.asarray(completion_ids_BxC)
  if ids_BxC.ndim != 2:
    raise ValueError(f"completion_ids_BxC has shape {ids_BxC.shape}; expected [B, C].")
  stop_ids = tuple(int(i) for i in np.atleast_1d(stop_ids))
  is_stop_BxC = jnp.isin(ids_BxC, jnp.asarray(stop_ids, ids_BxC.dtype)) if stop_ids else (
      jnp.zeros(ids_BxC.shape, bool))
  length = ids_BxC.shape[1]
  stop_B = jnp.where(is_stop_BxC.any(1), jnp.argmax(is_stop_BxC, 1), length)
  return (jnp.arange(length)[None] <= stop_B[:, None]).astype(jnp.int32)


def _check_shapes(logps, completion_mask, **others) -> None:
  if logps.ndim != 2:
    raise ValueError(f"logps has shape {logps.shape}; expected [B, C] (per completion token).")
  if completion_mask.shape != logps.shape:
    raise ValueError(f"completion_mask has shape {completion_mask.shape}; expected logps' "
                     f"{logps.shape}.")
  for name, value in others.items():
    if value is None:
      continue
    expected = logps.shape[:1] if name in ("advantages", "rewards") else logps.shape
    if value.shape != expected:
      raise ValueError(f"{name} has shape {value.shape}; expected {expected}.")


KL_ESTIMATORS = ("k3", "k2")


def grpo_loss(logps, old_logps, ref_logps, advantages, completion_mask, *, epsilon: float,
              beta: float, kl_estimator: str = "k3") -> tuple[Array, dict[str, Array]]:
  """d1's diffu-GRPO loss of one inner iteration, and its metrics.

  logps [B, C]: the policy's per-token log-probabilities (`per_token_logps_fn`, with this
  iteration's mask key). old_logps: those of the policy that drew the rollouts, with the
  same mask key (d1's num_iterations > 1), or None: the detached `logps` (num_iterations ==
  1: the ratio is 1 and only its gradient is used). ref_logps: the frozen reference's, same
  mask key; None exactly when beta == 0. advantages [B]; completion_mask [B, C] (1 up to and
  including the first EOS).

    ratio = exp(logps - old_logps);  A-term = -min(ratio A, clip(ratio, 1 - eps, 1 + eps) A)
    kl = exp(ref - logps) - (ref - logps) - 1   (k3, per token; d1's)
    loss = sum(mask * (A-term + beta kl)) / sum(mask)

  kl_estimator="k2" puts (logps - ref)^2 / 2 in the loss instead. Differentiated through
  logps at tokens drawn from the policy, k3's expected gradient is that of KL(ref || policy),
  the mass-covering direction, whose pull on a logit does not vanish as the policy leaves the
  reference; k2's is that of KL(policy || ref), the KL the objective names (on-policy: the
  first inner iteration). tests/rl/test_losses.py checks both by enumeration. With k3 a
  mode-seeking optimum is out of reach: on prompt-less two_color at one step the policy
  stops where validity = 1 - beta G / (G - 1) (0.954 at d1's beta 0.04, G 8); with k2 it
  goes to 1 (docs/rl.md).

  metrics: clip_ratio, d1's (TRL's of its time) definition, the masked fraction of tokens
  where ratio A < clip(ratio) A (the unclipped term is the smaller one, so the minimum is
  NOT the clipped one); kl, the masked mean of the k3 KL (only when beta != 0, as d1 logs;
  k3 whatever `kl_estimator`: its value is an unbiased estimate of KL(policy || ref)).
  """
  if not (is_number(epsilon) and epsilon >= 0):
    raise ValueError(f"epsilon={epsilon!r} must be a number >= 0.")
  if not (is_number(beta) and beta >= 0):
    raise ValueError(f"beta={beta!r} must be a number >= 0.")
  if kl_estimator not in KL_ESTIMATORS:
    raise ValueError(f"kl_estimator={kl_estimator!r} must be one of {KL_ESTIMATORS}.")
  if (ref_logps is None) != (beta == 0):
    raise ValueError(f"ref_logps is {'None' if ref_logps is None else 'given'} with "
                     f"beta={beta!r}: the reference's log-probabilities are needed exactly "
                     "when beta != 0.")
  logps = jnp.asarray(logps, jnp.float32)
  advantages = jnp.asarray(advantages, jnp.float32)
  completion_mask = jnp.asarray(completion_mask, jnp.float32)
  old_logps = None if old_logps is None else jnp.asarray(old_logps, jnp.float32)
  ref_logps = None if ref_logps is None else jnp.asarray(ref_logps, jnp.float32)
  _check_shapes(logps, completion_mask, old_logps=old_logps, ref_logps=ref_logps,
                advantages=advantages)
  if old_logps is None:
    old_logps = jax.lax.stop_gradient(logps)
  coef_1 = jnp.exp(logps - old_logps)
  coef_2 = jnp.clip(coef_1, 1 - epsilon, 1 + epsilon)
  per_token_loss1 = coef_1 * advantages[:, None]
  per_token_loss2 = coef_2 * advantages[:, None]
  per_token_loss = -jnp.minimum(per_token_loss1, per_token_loss2)
  # d1 divides by the mask's sum as is; the floor only matters for an all-empty batch.
  tokens = jnp.maximum(completion_mask.sum(), 1.0)
  metrics = {}
  if beta != 0:
    per_token_kl = jnp.exp(ref_logps - logps) - (ref_logps - logps) - 1
    per_token_penalty = (per_token_kl if kl_estimator == "k3"
                         else 0.5 * jnp.square(logps - ref_logps))
    per_token_loss = per_token_loss + beta * per_token_penalty
    metrics["kl"] = (per_token_kl * completion_mask).sum() / tokens
  loss = (per_token_loss * completion_mask).sum() / tokens
  is_clipped = (per_token_loss1 < per_token_loss2).astype(jnp.float32)
  metrics["clip_ratio"] = (is_clipped * completion_mask).sum() / tokens
  return loss, metrics


def wd1_loss(logps, advantages, completion_mask, *, group_size: int, negative: bool = True
             ) -> tuple[Array, dict[str, Array]]:
  """wd1's ratio-free weighted log-likelihood loss, and its metrics.

  With a completion's log-likelihood logp_i = sum_t mask_it logps_it (summed, not averaged,
  over its tokens) and advantages A_i (rewards minus the group mean, `group_advantages`):

    w+_i = softmax(A)_i,  w-_i = softmax(-A)_i   (over the completions of a group)
    loss = sum_i (-w+_i logp_i + w-_i logp_i)    (negative=False: the first term only)

  summed over groups. wd1's code takes the softmax over dim 0 of its per-device batch, which
  its configs fill with one group (per_device_train_batch_size = num_generations = 6);
  `group_size` = B reproduces that softmax over a whole batch. The weights carry no gradient
  (advantages are constants), no old or reference policy enters and nothing is clipped.

  metrics: logp (the mean completion log-likelihood, masked sum per row), weight_max (the
  largest positive weight, 1 / group_size for a group of equal rewards).
  """
  logps = jnp.asarray(logps, jnp.float32)
  advantages = jnp.asarray(advantages, jnp.float32)
  completion_mask = jnp.asarray(completion_mask, jnp.float32)
  _check_shapes(logps, completion_mask, advantages=advantages)
  _check_group(logps.shape[0], group_size)
  seq_logp_NxG = (logps * completion_mask).sum(-1).reshape(-1, group_size)
  advantages_NxG = advantages.reshape(-1, group_size)
  is_weights_NxG = jax.nn.softmax(advantages_NxG, axis=1)
  loss = -(seq_logp_NxG * is_weights_NxG).sum()
  if negative:
    n_is_weights_NxG = jax.nn.softmax(-advantages_NxG, axis=1)
    loss = loss + (seq_logp_NxG * n_is_weights_NxG).sum()
  return loss, {"logp": seq_logp_NxG.mean(), "weight_max": is_weights_NxG.max()}


def rft_loss(logps, completion_mask, success_B, *, length_B=None
             ) -> tuple[Array, dict[str, Array]]:
  """Rejection-sampling fine-tuning: the negative log-likelihood of the successful rollouts
  only (SFT on the correct completions), per completion token, and its metrics.

  logps [B, C] (or [B, 1], a whole completion's, with completion_mask [B, 1] of ones);
  success_B: 1 for a row kept, 0 otherwise; length_B: each row's completion tokens (default
  the mask's sum), the normaliser: loss = -sum_b s_b sum_c mask logps / sum_b s_b length_b
  (0 when no row succeeded). metrics: kept_fraction."""
  logps = jnp.asarray(logps, jnp.float32)
  completion_mask = jnp.asarray(completion_mask, jnp.float32)
  success_B = jnp.asarray(success_B, jnp.float32)
  _check_shapes(logps, completion_mask, rewards=success_B)
  length_B = completion_mask.sum(-1) if length_B is None else jnp.asarray(length_B, jnp.float32)
  seq_logp_B = (logps * completion_mask).sum(-1)
  tokens = jnp.maximum((success_B * length_B).sum(), 1.0)
  return -(success_B * seq_logp_B).sum() / tokens, {"kept_fraction": success_B.mean()}
