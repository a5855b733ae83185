"""config.rl: its fields, their defaults (d1's diffu-GRPO config where it has one) and the
checks every RL run passes before anything compiles (`rl_options`: a ConfigError naming the
field, its value and what it takes)."""

from __future__ import annotations

import math

import ml_collections
import numpy as np

from mdjax.rl import igpo as igpo_lib
from mdjax.rl import logps as logps_lib
from mdjax.rl import losses
from mdjax.rl import mdpo as mdpo_lib
from mdjax.rl import rewards as rewards_lib
from mdjax.rl import spg as spg_lib
from mdjax.train import sft
from mdjax.train.config_checks import ConfigError

OBJECTIVE_NAMES = sft.RL_OBJECTIVES  # declared there (a workdir loads without this module)
ESTIMATORS = ("one_step", "elbo", "trajectory", "coupled")

# config.rl's fields and their defaults (d1's diffu-GRPO config where it has one).
DEFAULTS = dict(
    num_generations=6,  # G completions per prompt (d1: 6)
    num_iterations=12,  # inner updates per rollout batch, each with its own mask key (d1: 12)
    epsilon=0.5,  # the ratio's clip range (d1's train.yaml: 0.5)
    beta=0.04,  # the KL penalty's weight (d1: 0.04; 0: no reference pass)
    kl_estimator="k3",  # the penalty: "k3" (d1's; its gradient is KL(ref || policy)'s) or "k2"
    p_mask_prompt=0.15,  # one_step: each prompt token masked with this probability (d1: 0.15)
    cfg_scale=0.0,  # one_step: classifier-free guidance of the log-probabilities (d1: 0)
    estimator="one_step",  # or "elbo" (the MC-ELBO), "trajectory", "coupled" (DiffuCoder's)
    elbo_samples=4,  # elbo: Monte Carlo samples per row
    coupled_t_min=logps_lib.COUPLED_T_RANGE[0],  # coupled: the mask ratio t ~ U[min, max]
    coupled_t_max=logps_lib.COUPLED_T_RANGE[1],  # (DiffuCoder: 0.2, 0.8)
    scale_by_std=False,  # advantages divided by the group's std (d1: False)
    # objective 'spg' (SPG's sudoku/gsm8k scripts and config defaults):
    spg_negative="mix",  # the bound of a negative-advantage row: "mix", "eubo" or "elbo"
    spg_mix_weight=0.5,  # mix: w EUBO + (1 - w) ELBO
    spg_eubo_beta=1.5,  # the EUBO's power beta >= 1 (SPG: 1.0 sudoku, 1.5 gsm8k/math)
    spg_num_draws=2,  # block-wise masked copies per row and inner iteration (SPG's num_t)
    spg_block_length=None,  # None: the sampler's block_length, else the whole completion
    rewards=None,  # `mdjax.rl.rewards` names, summed with `reward_weights`; None: an id
    #                task's exact check (`rewards.TASK_CHECKS`)
    reward_weights=None,  # None: 1 each
    prompts=None,  # text prompts: a JSONL (`sources.JsonlSource`); None: task 'sft''s own file
    max_prompt_length=200,  # text prompts: left padded (or cut from the left) to this
    max_completion_length=256,  # text prompts: the completion's length
    chat=True,  # text prompts: through the model's chat template
    # d1's reference-model sync (TRL's SyncRefModelCallback; TRL's defaults, d1's train.yaml
    # sets True and 64): every `ref_model_sync_steps` updates ref <- a policy + (1 - a) ref.
    sync_ref_model=False,
    ref_model_sync_steps=512,
    ref_model_mixup_alpha=0.6,
    # IGPO (`mdjax.rl.igpo`; run_igpo.sh's values): hints for groups whose rollouts all fail.
    igpo=False,
    **igpo_lib.DEFAULTS,
    # objective 'mdpo' (`mdjax.rl.mdpo`): the sampler steps trained per rollout batch (None:
    # MDPO's 16, at most sampler.steps).
    mdpo_train_steps=None,
    # objective 'rft' (rejection-sampling fine-tuning): the rows whose reward is at least
    # this are the successes it fine-tunes on (1.0: an exact check's pass).
    rft_min_reward=1.0,
)


def rl_options(config) -> dict:
  """config.rl over `DEFAULTS`, checked: a ConfigError naming the field otherwise."""
  given = config.get("rl", ml_collections.ConfigDict()).to_dict()
  unknown = sorted(set(given) - set(DEFAULTS))
  if unknown:
    raise ConfigError(f"config field rl: unknown {unknown}; it takes {sorted(DEFAULTS)}.")
  opts = {**DEFAULTS, **given}

  def refuse(name, allowed):
    raise ConfigError(f"config field rl.{name}={opts[name]!r}: {allowed}.")

  def integer(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)

  def number(value):
    return (isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
            and math.isfinite(value))

  if not integer(opts["num_generations"]) or opts["num_generations"] < 2:
    refuse("num_generations", "must be an integer >= 2 (group advantages compare a prompt's "
           "completions)")
  if config.batch_size % opts["num_generations"]:
    raise ConfigError(f"config field batch_size={config.batch_size}: must be a multiple of "
                      f"rl.num_generations={opts['num_generations']} (completions per step).")
  for name in ("num_iterations", "elbo_samples", "max_prompt_length", "max_completion_length"):
    if not integer(opts[name]) or opts[name] < 1:
      refuse(name, "must be an integer >= 1")
  if not number(opts["epsilon"]) or opts["epsilon"] <= 0:
    refuse("epsilon", "must be a finite number > 0")
  if not number(opts["beta"]) or opts["beta"] < 0:
    refuse("beta", "must be a finite number >= 0")
  if opts["kl_estimator"] not in losses.KL_ESTIMATORS:
    refuse("kl_estimator", f"must be one of {losses.KL_ESTIMATORS}")
  if not number(opts["p_mask_prompt"]) or not 0 <= opts["p_mask_prompt"] <= 1:
    refuse("p_mask_prompt", "must be a number in [0, 1]")
  if not number(opts["cfg_scale"]) or opts["cfg_scale"] < 0:
    refuse("cfg_scale", "must be a finite number >= 0")
  if opts["estimator"] not in ESTIMATORS:
    refuse("estimator", f"must be one of {ESTIMATORS}")
  if not (number(opts["coupled_t_min"]) and 0 < opts["coupled_t_min"] < 1):
    refuse("coupled_t_min", "must be a number in (0, 1) (the pair divides by t and 1 - t)")
  if not (number(opts["coupled_t_max"]) and opts["coupled_t_min"] <= opts["coupled_t_max"] < 1):
    refuse("coupled_t_max", f"must be a number in [rl.coupled_t_min={opts['coupled_t_min']}, 1)")
  steps = config.get("sampler", {}).get("steps")
  if opts["estimator"] == "trajectory" and not (integer(steps) and steps >= 1):
    refuse("estimator", f"'trajectory' scores each sampler step: sampler.steps={steps!r} must "
           "be an integer >= 1")
  opts["sampler_steps"] = steps  # the trajectory's passes
  names = opts["rewards"]
  task_check = rewards_lib.TASK_CHECKS.get(config.get("task"))
  if names is None:
    if task_check is None:
      refuse("rewards", f"task {config.get('task')!r} has no exact check: name the reward "
             f"functions ({rewards_lib.names()})")
    names = (task_check,)
  if isinstance(names, str):  # "sudoku,sudoku4_solved"
    names = (names,)
  if not names or not all(isinstance(n, str) for n in names):
    refuse("rewards", "must be a non-empty list of reward names")
  # A command line's --config.rl.rewards=a,b arrives as ("a,b",).
  names = opts["rewards"] = tuple(n.strip() for joined in names for n in joined.split(","))
  for name in names:
    if name not in rewards_lib.names():
      refuse("rewards", f"{name!r} is not a registered reward; registered: "
             f"{rewards_lib.names()}")
    if name in rewards_lib.TASK_CHECKS.values() and name != task_check:
      refuse("rewards", f"{name!r} is the exact check of another task; task "
             f"{config.get('task')!r}'s is {task_check!r}")
  weights = opts["reward_weights"]
  if weights is not None:
    if len(weights) != len(names) or not all(number(w) for w in weights):
      refuse("reward_weights", f"must be None or {len(names)} finite numbers (one per reward)")
    opts["reward_weights"] = tuple(float(w) for w in weights)
  problem = spg_lib.option_problem(opts)
  if problem:
    refuse(*problem)
  block = config.get("sampler", {}).get("block_length")
  opts["sampler_block_length"] = block if integer(block) else None  # spg's default blocks
  for name in ("scale_by_std", "chat", "sync_ref_model"):
    if not isinstance(opts[name], bool):
      refuse(name, "must be True or False")
  _check_after_d1(config, opts, refuse, integer, number, task_check)
  return opts


def _check_after_d1(config, opts, refuse, integer, number, task_check) -> None:
  """The reference sync's, IGPO's, MDPO's and RFT's fields (`rl_options`)."""
  objective = config.get("objective")
  if not integer(opts["ref_model_sync_steps"]) or opts["ref_model_sync_steps"] < 1:
    refuse("ref_model_sync_steps", "must be an integer >= 1 (optimizer updates between syncs)")
  if not number(opts["ref_model_mixup_alpha"]) or not 0 <= opts["ref_model_mixup_alpha"] <= 1:
    refuse("ref_model_mixup_alpha", "must be a number in [0, 1]")
  if opts["sync_ref_model"]:
    if objective != "grpo" or opts["beta"] == 0:
      refuse("sync_ref_model", f"there is no reference to sync: objective {objective!r} with "
             f"rl.beta={opts['beta']!r} reads none (grpo with beta > 0 does; TRL skips the "
             "sync then)")
    if config.get("train", {}).get("lora", {}).get("rank", 0):
      refuse("sync_ref_model", "with LoRA (train.lora.rank > 0) the reference is the base with "
             "the adapters off, which stays the start (TRL skips the sync under PEFT too)")
  problem = igpo_lib.option_problem(opts)
  if problem:
    refuse(*problem)
  if opts["igpo"]:
    if objective != "grpo":
      refuse("igpo", f"IGPO's hints feed diffu-GRPO's loss: objective {objective!r} must be "
             "'grpo'")
    if opts["estimator"] == "elbo":
      refuse("igpo", "IGPO filters the hinted tokens of the loss: rl.estimator='elbo' has one "
             "log-probability per row; use one_step, coupled or trajectory")
    if config.get("task") == "sft" or opts["prompts"] is not None or task_check is None:
      refuse("igpo", f"the hints are an id task's own completions, its exact check the judge: "
             f"task {config.get('task')!r} has none")
  temperature = config.get("sampler", {}).get("temperature")
  # Every sampler spec has the knob (`SamplerSpec.temperature`), 1.0 unless set.
  opts["sampler_temperature"] = 1.0 if temperature is None else temperature
  if objective == "mdpo":
    problem = mdpo_lib.option_problem(opts)
    if problem:
      refuse(*problem)
    temperature = opts["sampler_temperature"]
    if not (number(temperature) and temperature > 0):
      raise ConfigError(f"config field sampler.temperature={temperature!r}: objective 'mdpo' "
                        "divides the logits by the sampling temperature; it must be > 0.")
    if opts["mdpo_train_steps"] is None:
      opts["mdpo_train_steps"] = min(mdpo_lib.TRAIN_STEPS, opts["sampler_steps"])
  if not number(opts["rft_min_reward"]):
    refuse("rft_min_reward", "must be a finite number")
