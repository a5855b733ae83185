"""The compiled pieces of an RL step: the log-probabilities of `rl.estimator` (or of the
objective's own bounds), the objective's loss, and the jitted update; one set per process for
runs of the same settings and model (parameters are arguments)."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import ml_collections
import optax

from mdjax import sampling
from mdjax.rl import logps as logps_lib
from mdjax.rl import losses
from mdjax.rl import spg as spg_lib
from mdjax.train.state import make_optimizer


def _logps_fn(objective: str, opts: dict, denoiser, prompt_length: int, mask_id: int):
  """(params, ids_BxL, valid_BxL or None, key, write_step_BxL, completion mask_BxC) ->
  log-probabilities: B x C per token ("one_step"; "trajectory": each token under the canvas
  of the rollout step that wrote it; "coupled"), or B x 1, the completion's MC-ELBO as one
  log-probability ("elbo"); objective 'spg': B x 2, each row's ELBO and EUBO."""
  if objective == "spg":
    return functools.partial(spg_lib.trainer_bounds, denoiser, opts, prompt_length, mask_id)
  fn = _estimator_fn(opts, denoiser, prompt_length, mask_id)
  return lambda params, ids_BxL, valid_BxL, key, write_BxL, mask_BxC: fn(
      params, ids_BxL, valid_BxL, key, write_BxL)


def _estimator_fn(opts: dict, denoiser, prompt_length: int, mask_id: int):
  if opts["estimator"] == "one_step":
    return lambda params, ids_BxL, valid_BxL, key, write_BxL: logps_lib.per_token_logps_fn(
        denoiser, params, ids_BxL, prompt_length, key, mask_id=mask_id,
        p_mask_prompt=opts["p_mask_prompt"], cfg_scale=opts["cfg_scale"], valid_BxL=valid_BxL)
  if opts["estimator"] == "coupled":
    return lambda params, ids_BxL, valid_BxL, key, write_BxL: logps_lib.coupled_logps_fn(
        denoiser, params, ids_BxL, prompt_length, key, mask_id=mask_id,
        t_min=opts["coupled_t_min"], t_max=opts["coupled_t_max"], valid_BxL=valid_BxL)
  if opts["estimator"] == "trajectory":
    return lambda params, ids_BxL, valid_BxL, key, write_BxL: logps_lib.trajectory_logps_fn(
        denoiser, params, ids_BxL, write_BxL, prompt_length, mask_id=mask_id,
        num_steps=opts["sampler_steps"], valid_BxL=valid_BxL)
  return lambda params, ids_BxL, valid_BxL, key, write_BxL: logps_lib.elbo_logps_fn(
      denoiser, params, ids_BxL, prompt_length, key, mask_id=mask_id,
      num_samples=opts["elbo_samples"])[:, None]


def _loss(objective: str, opts: dict, logps, old, ref, advantages_B, mask):
  if objective == "grpo":
    return losses.grpo_loss(logps, old, ref, advantages_B, mask, epsilon=opts["epsilon"],
                            beta=opts["beta"], kl_estimator=opts["kl_estimator"])
  if objective == "spg":
    return spg_lib.spg_loss(logps[:, 0], logps[:, 1], advantages_B, mask,
                            negative=opts["spg_negative"], mix_weight=opts["spg_mix_weight"])
  return losses.wd1_loss(logps, advantages_B, mask, group_size=opts["num_generations"])


def needs_old(config, opts: dict) -> bool:
  """d1 reads the rollout policy's log-probabilities with num_iterations > 1; wd1 never."""
  return config.objective == "grpo" and opts["num_iterations"] > 1


def needs_reference(config, opts: dict) -> bool:
  return config.objective == "grpo" and opts["beta"] != 0


@dataclasses.dataclass(frozen=True)
class Programs:
  """The jitted functions of a run (compiled once: parameters are arguments)."""

  all_logps: object  # (params, ids, valid, mask keys N, write steps, mask) -> N x B x C
  update: object  # (params, opt_state, ids, valid, key, old, ref, adv, mask, write steps)
  #                 -> (params, opt_state, metrics)


def build_programs(config, opts: dict, apply_fn, ref_apply_fn, train_cfg, prompt_length: int,
                   mask_id: int) -> Programs:
  """The run's jitted functions; runs of the same settings and model share them (one
  compilation per process)."""
  return _programs(config.objective, tuple(sorted((k, v if not isinstance(v, list) else tuple(v))
                                                  for k, v in opts.items())),
                   apply_fn, ref_apply_fn, json.dumps(train_cfg.to_dict(), sort_keys=True),
                   prompt_length, mask_id)


@functools.lru_cache(maxsize=8)
def _programs(objective: str, opts_items: tuple, apply_fn, ref_apply_fn, train_json: str,
              prompt_length: int, mask_id: int) -> Programs:
  opts = dict(opts_items)
  optimizer = make_optimizer(ml_collections.ConfigDict(json.loads(train_json)))
  policy = _logps_fn(objective, opts, apply_fn, prompt_length, mask_id)
  reference = _logps_fn(objective, opts, ref_apply_fn, prompt_length, mask_id)

  def all_logps(fn, params, ids_BxL, valid_BxL, keys_N, write_BxL, mask):
    return jax.lax.map(lambda key: fn(params, ids_BxL, valid_BxL, key, write_BxL, mask), keys_N)

  def loss(params, ids_BxL, valid_BxL, key, old, ref, advantages_B, mask, write_BxL):
    logps = policy(params, ids_BxL, valid_BxL, key, write_BxL, mask)
    return _loss(objective, opts, logps, old, ref, advantages_B, mask)

  def update(params, opt_state, ids_BxL, valid_BxL, key, old, ref, advantages_B, mask,
             write_BxL):
    (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(
        params, ids_BxL, valid_BxL, key, old, ref, advantages_B, mask, write_BxL)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {k: v for k, v in metrics.items() if jnp.ndim(v) == 0}
    metrics.update(loss=value, grad_norm=optax.tree.norm(grads))
    return params, opt_state, metrics

  policy_logps = jax.jit(functools.partial(all_logps, policy))
  # Without LoRA the reference is the policy's denoiser on the start's parameters: one program.
  reference_logps = (policy_logps if ref_apply_fn == apply_fn
                     else jax.jit(functools.partial(all_logps, reference)))
  return Programs(
      all_logps={"policy": policy_logps, "reference": reference_logps},
      update=jax.jit(update, donate_argnums=(0, 1)))


def sampler_spec(config, length: int):
  knobs = {k: v for k, v in config.sampler.to_dict().items() if k != "family"}
  return sampling.make_spec(config.sampler.family, length=length, **knobs)
