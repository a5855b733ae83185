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
from mdjax.rl import igpo as igpo_lib
from mdjax.rl import logps as logps_lib
from mdjax.rl import losses
from mdjax.rl import mdpo as mdpo_lib
from mdjax.rl import ref_sync
from mdjax.rl import spg as spg_lib
from mdjax.train.state import make_optimizer


# A step's batch: a dict of arrays (a pytree; absent fields None):
#   ids_BxL, valid_BxL (None: no padding), write_BxL (the step that wrote each position),
#   mask (the completion mask, [B, C]; [B, 1] of ones for the "elbo" estimator),
#   completion_BxC (the completion mask, always [B, C]), advantages_B;
#   rft: success_B; mdpo: steps_K, x0_KxBxC, conf_KxBxC, masked_KxBxC, advantages_KxB.


def _logps_fn(objective: str, opts: dict, denoiser, prompt_length: int, mask_id: int):
  """(params, batch, key) -> log-probabilities: B x C per token ("one_step"; "trajectory":
  each token under the canvas of the rollout step that wrote it; "coupled"), or B x 1, the
  completion's MC-ELBO as one log-probability ("elbo"); objective 'spg': B x 2, each row's
  ELBO and EUBO; 'mdpo': K x B x C, each selected step's draws under its canvas."""
  if objective == "spg":
    return lambda params, batch, key: spg_lib.trainer_bounds(
        denoiser, opts, prompt_length, mask_id, params, batch["ids_BxL"], batch["valid_BxL"],
        key, batch["write_BxL"], batch["mask"])
  if objective == "mdpo":
    return lambda params, batch, key: mdpo_lib.step_logps(
        denoiser, params, batch["ids_BxL"], batch["write_BxL"], batch["steps_K"],
        batch["x0_KxBxC"], prompt_length, mask_id=mask_id,
        temperature=opts["sampler_temperature"], valid_BxL=batch["valid_BxL"])
  estimator = opts["estimator"]
  if estimator == "one_step":
    return lambda params, batch, key: logps_lib.per_token_logps_fn(
        denoiser, params, batch["ids_BxL"], prompt_length, key, mask_id=mask_id,
        p_mask_prompt=opts["p_mask_prompt"], cfg_scale=opts["cfg_scale"],
        valid_BxL=batch["valid_BxL"])
  if estimator == "coupled":
    return lambda params, batch, key: logps_lib.coupled_logps_fn(
        denoiser, params, batch["ids_BxL"], prompt_length, key, mask_id=mask_id,
        t_min=opts["coupled_t_min"], t_max=opts["coupled_t_max"], valid_BxL=batch["valid_BxL"])
  if estimator == "trajectory":
    return lambda params, batch, key: logps_lib.trajectory_logps_fn(
        denoiser, params, batch["ids_BxL"], batch["write_BxL"], prompt_length, mask_id=mask_id,
        num_steps=opts["sampler_steps"], valid_BxL=batch["valid_BxL"])
  return lambda params, batch, key: logps_lib.elbo_logps_fn(
      denoiser, params, batch["ids_BxL"], prompt_length, key, mask_id=mask_id,
      num_samples=opts["elbo_samples"])[:, None]


def _loss(objective: str, opts: dict, logps, old, ref, batch):
  if objective == "grpo":
    return losses.grpo_loss(logps, old, ref, batch["advantages_B"], batch["mask"],
                            epsilon=opts["epsilon"], beta=opts["beta"],
                            kl_estimator=opts["kl_estimator"])
  if objective == "spg":
    return spg_lib.spg_loss(logps[:, 0], logps[:, 1], batch["advantages_B"], batch["mask"],
                            negative=opts["spg_negative"], mix_weight=opts["spg_mix_weight"])
  if objective == "rft":
    return losses.rft_loss(logps, batch["mask"], batch["success_B"],
                           length_B=batch["completion_BxC"].sum(-1))
  if objective == "mdpo":
    return mdpo_lib.mdpo_loss(logps, old, batch["advantages_KxB"], batch["masked_KxBxC"],
                              batch["conf_KxBxC"], epsilon=opts["epsilon"])
  return losses.wd1_loss(logps, batch["advantages_B"], batch["mask"],
                         group_size=opts["num_generations"])


def needs_old(config, opts: dict) -> bool:
  """d1 reads the rollout policy's log-probabilities with num_iterations > 1 (MDPO as well);
  wd1, spg and rft never."""
  return config.objective in ("grpo", "mdpo") and opts["num_iterations"] > 1


def needs_reference(config, opts: dict) -> bool:
  return config.objective == "grpo" and opts["beta"] != 0


@dataclasses.dataclass(frozen=True)
class Programs:
  """The jitted functions of a run (compiled once: parameters are arguments)."""

  all_logps: dict  # {"policy", "reference"}: (params, batch, mask keys N) -> N x (logps)
  update: object  # (params, opt_state, batch, key, old, ref) -> (params, opt_state, metrics)
  optimizer: object  # the optax optimizer `update` steps (with rl.sync_ref_model: its sync)
  entropy: object  # igpo: (params, ids_BxL, valid_BxL) -> B x C, completion masked
  step_predictions: object  # mdpo: (params, ids, write, valid, key) -> x0, conf, masked (S x)


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
  if opts["sync_ref_model"]:
    optimizer = ref_sync.with_ref_sync(optimizer, opts["ref_model_mixup_alpha"],
                                       opts["ref_model_sync_steps"])
  policy = _logps_fn(objective, opts, apply_fn, prompt_length, mask_id)
  reference = _logps_fn(objective, opts, ref_apply_fn, prompt_length, mask_id)

  def all_logps(fn, params, batch, keys_N):
    return jax.lax.map(lambda key: fn(params, batch, key), keys_N)

  def loss(params, batch, key, old, ref):
    return _loss(objective, opts, policy(params, batch, key), old, ref, batch)

  def update(params, opt_state, batch, key, old, ref):
    (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, batch, key, old,
                                                                     ref)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {k: v for k, v in metrics.items() if jnp.ndim(v) == 0}
    metrics.update(loss=value, grad_norm=optax.tree.norm(grads))
    return params, opt_state, metrics

  policy_logps = jax.jit(functools.partial(all_logps, policy))
  # Without LoRA the reference is the policy's denoiser on the start's parameters: one program.
  reference_logps = (policy_logps if ref_apply_fn == apply_fn
                     else jax.jit(functools.partial(all_logps, reference)))
  entropy = jax.jit(lambda params, ids_BxL, valid_BxL: igpo_lib.masked_entropy(
      apply_fn, params, ids_BxL, prompt_length, mask_id=mask_id, valid_BxL=valid_BxL))
  predictions = jax.jit(lambda params, ids_BxL, write_BxL, valid_BxL, key:
                        mdpo_lib.step_predictions(
                            apply_fn, params, ids_BxL, write_BxL, key, prompt_length,
                            mask_id=mask_id, num_steps=opts["sampler_steps"],
                            temperature=opts["sampler_temperature"], valid_BxL=valid_BxL))
  return Programs(
      all_logps={"policy": policy_logps, "reference": reference_logps},
      update=jax.jit(update, donate_argnums=(0, 1)), optimizer=optimizer, entropy=entropy,
      step_predictions=predictions)


def sampler_spec(config, length: int):
  knobs = {k: v for k, v in config.sampler.to_dict().items() if k != "family"}
  return sampling.make_spec(config.sampler.family, length=length, **knobs)
