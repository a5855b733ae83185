"""RL with verifiable rewards: the objectives 'grpo' (d1's diffu-GRPO), 'wd1' and 'spg'.

`train.py --config=configs/grpo.py --workdir=W` runs, per step (`train.num_steps` of them):

  1. prompts: `batch_size / rl.num_generations` of them, a function of (seed, step) (a
     resumed run sees what an uninterrupted one would): an id task's prompt cells
     (`sources.IdTaskSource`: none for two_color, the puzzle for Sudoku 4x4, ...), or, for
     a published chat model (task 'sft'), lines of a JSONL
     (`sources.JsonlSource`: its tokenizer and chat template, left padded to
     `rl.max_prompt_length`);
  2. rollouts: G = `rl.num_generations` completions of each prompt by `config.sampler` (any
     mdjax sampler spec; d1's: LLaDA's semi-autoregressive low-confidence decoding), one
     compiled call per batch, the parameters its traced arguments;
  3. rewards on the host (`rl.rewards`: names in `mdjax.rl.rewards`, by default an id task's
     exact check (`rewards.TASK_CHECKS`), or e.g. 'sudoku' (d1's rule)), their weighted
     sum, group advantages;
  4. the log-probabilities of the policy before the updates ("old") and of the reference
     (the start point, frozen; with LoRA the base with the adapters off) for
     `rl.num_iterations` mask keys, one per inner iteration;
  5. `rl.num_iterations` updates (d1's inner loop; update i reads mask key i) of the loss of
     `config.objective`: 'grpo' (`losses.grpo_loss`: clipped ratio, `rl.kl_estimator`), 'wd1'
     (`losses.wd1_loss`) or 'spg' (`spg.spg_loss` on its own block-wise ELBO / EUBO, `rl.spg_*`;
     it reads no `rl.estimator`), the log-probabilities by `rl.estimator`: "one_step" (d1's
     `forward_process`: the completion masked, prompt tokens with `p_mask_prompt`) or
     "elbo" (the completion's MC-ELBO, one log-probability per row), "trajectory" or
     "coupled" (coupled-GRPO's complementary mask pair, `logps.coupled_logps_fn`).

The start is `train.init_from`: an mdjax workdir or "pretrained:DIR", its float32 parameters;
with `train.lora.rank` > 0 only adapters train. Checkpoints are the supervised loop's
(`TrainState`, saved every `checkpoint.every` steps, at the end and on SIGTERM; the same
command resumes). A reward function that raises or returns NaN stops the run naming it and
the row; the last checkpoint stays. The result loads with `mdjax.load(W)` (the objective's
`start_model` builds the model, the checkpoint fills its parameters).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp

from mdjax import lora, models, sampling, tasks
from mdjax.rl import logps as logps_lib
from mdjax.rl import losses
from mdjax.rl import rewards as rewards_lib
from mdjax.rl import sources
from mdjax.rl import spg as spg_lib
from mdjax.tasks import sft as sft_data
from mdjax.train import objectives, sft, state_io
from mdjax.train.config_checks import ConfigError
from mdjax.train.state import TrainState, init_state, make_mesh, make_optimizer
from mdjax.train.workdir import MetricsLog, TrainClock, keep_metrics_through, run_summary

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
)


class Stream(enum.IntEnum):
  """Draws within one RL step (folded into the step's key)."""

  PROMPTS = 0  # which prompts the step reads
  ROLLOUT = 1  # the sampler's key
  MASKS = 2  # the inner iterations' mask keys (fold_in(this key, i))


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
  for name in ("scale_by_std", "chat"):
    if not isinstance(opts[name], bool):
      refuse(name, "must be True or False")
  return opts


# ----------------------------------------------------------------------------
# Config and start point (the objective's hooks).
# ----------------------------------------------------------------------------


def _is_rl(config) -> bool:
  return config.get("objective") in OBJECTIVE_NAMES


def resolve_config(config):
  """An RL config checked (`rl_options`) with its model fields the start point's (a copy);
  any other config unchanged."""
  if not _is_rl(config):
    return config
  rl_options(config)
  init_from = config.get("train", {}).get("init_from")
  if not init_from:
    raise ConfigError(f"config field train.init_from={init_from!r}: objective "
                      f"{config.objective!r} fine-tunes a trained model: an mdjax workdir or "
                      "'pretrained:DIR'.")
  if config.train.get("ema_decay", 0.0):
    raise ConfigError(f"config field train.ema_decay={config.train.ema_decay!r}: must be 0 for "
                      "RL (the rollouts and the reference read the parameters themselves).")
  try:
    kind, where = sft_data.split_start(init_from)
  except ValueError as error:
    raise ConfigError(f"config field train.init_from: {error}") from None
  resolved = ml_collections.ConfigDict(config.to_dict())
  if kind == "workdir":
    try:
      saved, _ = state_io.start_config(where)  # its sizes checked against its arrays first
    except ValueError as error:
      raise ConfigError(f"config field train.init_from: {error}") from None
    if saved.get("task") != config.task:
      raise ConfigError(f"config field task={config.task!r}: the start point {where!r} was "
                        f"trained on task {saved.get('task')!r}.")
    fields = dict(saved.get("model") or {})
    resolved.task_kwargs = ml_collections.ConfigDict(
        {**(saved.get("task_kwargs") or {}), **config.task_kwargs.to_dict()})
  else:
    if config.task != "sft":
      raise ConfigError(f"config field task={config.task!r}: a published start "
                        f"({init_from}) reads text prompts: task 'sft' (its JSONL and the "
                        "start's tokenizer).")
    opts = rl_options(config)
    length = opts["max_prompt_length"] + opts["max_completion_length"]
    given = config.task_kwargs.get("length")
    if given not in (None, length):
      raise ConfigError(f"config field task_kwargs.length={given!r}: an RL row is "
                        f"rl.max_prompt_length + rl.max_completion_length = {length}; leave it "
                        "unset.")
    resolved.task_kwargs.update(length=length, start=init_from)
    if "truncate" not in config.task_kwargs:  # the task's rows only name the data
      resolved.task_kwargs.truncate = True
    published, _ = sft_data.published_config(where)
    fields = dict(d_model=published.d_model, num_layers=published.num_layers,
                  num_heads=published.num_heads, d_ff=published.mlp_hidden, positions="rope",
                  norm="rms", mlp="swiglu", time_conditioning=False, causal=False,
                  block_size=None)
  model = {}
  for name in sorted(set(config.model.keys()) | set(fields)):
    value = config.model.get(name)
    if value is None or name in ("dtype", "remat"):
      model[name] = fields.get(name) if value is None else value
    elif name in fields and value != fields[name]:
      raise ConfigError(f"config field model.{name}={value!r} differs from the start point's "
                        f"{fields[name]!r} ({init_from}); leave it unset.")
    else:
      model[name] = value
  if model.get("dtype") is None:
    model["dtype"] = "float32"
  if model.get("remat") is None:
    model["remat"] = False
  resolved.model = ml_collections.ConfigDict(model)
  return resolved


def start_model(config, task):
  """(graphdef, float32 params, apply_fn) of `train.init_from`: a workdir's newest checkpoint
  (its EMA parameters when kept) or a published folder behind mdjax's denoiser contract."""
  kind, where = sft_data.split_start(config.train.init_from)
  if kind == "pretrained":  # as SFT starts from one
    return sft.start_model(config, task)
  start = state_io.load(where, log=lambda message: None)
  if start.task.vocab_size != task.vocab_size or start.task.length != task.length:
    raise ValueError(f"start={where!r}: its task has {start.task.vocab_size} ids and length "
                     f"{start.task.length}; this run's {task.vocab_size} and {task.length}.")
  params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), start.params)
  graphdef, apply_fn = _model_of(models.TransformerConfig(
      vocab_size=task.vocab_size, max_len=task.length, **config.model.to_dict()))
  return graphdef, params, apply_fn


@functools.lru_cache(maxsize=8)
def _model_of(model_config: models.TransformerConfig):
  """(graphdef, apply_fn) of a model config, one per config in a process: the programs that
  take the denoiser as a static argument (the sampler, the updates) compile once for runs
  of the same model (a resumed run, a test's several runs)."""
  graphdef, _, apply_fn = models.init(model_config, seed=0)
  return graphdef, apply_fn


def _unused_loss_fn(config, apply_fn, task):
  """RL has no supervised loss: its loop (`run`) computes the objective's."""
  del apply_fn, task
  raise ConfigError(f"objective={config.objective!r} runs its own loop (mdjax.rl.trainer.run); "
                    "it has no supervised loss.")


# ----------------------------------------------------------------------------
# The compiled pieces.
# ----------------------------------------------------------------------------


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


def rollout(apply_fn, params, key, prompts: sources.Prompts, group: int,
            completion_length: int, spec, mask_id: int):
  """G completions of each prompt (rows p0 x G, p1 x G, ...): (ids_BxL, the step that wrote
  each position (-1: the prompt), seconds); numpy."""
  ids = np.repeat(prompts.ids_PxLp, group, axis=0)
  canvas = np.concatenate([ids, np.full((len(ids), completion_length), mask_id, np.int32)], 1)
  valid = None
  if prompts.valid_PxLp is not None:
    valid = np.concatenate([np.repeat(prompts.valid_PxLp, group, axis=0),
                            np.ones((len(ids), completion_length), bool)], 1)
  fixed = np.zeros(canvas.shape, bool)
  fixed[:, :ids.shape[1]] = True
  start = time.perf_counter()
  out = sampling.sample(apply_fn, params, key, canvas, spec, fixed, mask_id=mask_id,
                        **({} if valid is None else {"valid_BxL": valid}))
  tokens = np.asarray(out.tokens_BxL)  # waits for the program
  return tokens, np.asarray(out.write_step_BxL), time.perf_counter() - start


def score(source, names, weights, prompts: sources.Prompts, group: int, ids_BxL, mask_BxC):
  """(rewards_B, {reward_NAME: mean}) of the rows (`rewards.compute`: the weighted sum of
  each function's); a function that raises or returns NaN raises `rewards.RewardError`
  naming it and the row."""
  texts = [t for t in prompts.texts for _ in range(group)]
  targets = [t for t in prompts.targets for _ in range(group)]
  completions = source.completion_texts(ids_BxL, mask_BxC)
  rewards_B, per_fn_BxR = rewards_lib.compute(names, texts, completions, targets, weights)
  return rewards_B, {f"reward_{n}": float(per_fn_BxR[:, i].mean()) for i, n in enumerate(names)}


# ----------------------------------------------------------------------------
# The loop.
# ----------------------------------------------------------------------------


def step_key(config, step: int) -> jax.Array:
  """The key of RL step `step`: every draw of the step folds it (`Stream`)."""
  from mdjax import streams
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(config.seed),
                                               streams.RowStream.TRAIN_NOISE), step)


def _lora_parts(config, apply_fn):
  """With LoRA on (`train.lora.rank` > 0): (reference apply_fn, params -> reference params),
  the base with the adapters off; None without LoRA."""
  if lora.config_of(config) is None:
    return None
  return lora.unadapted(apply_fn), lambda params: params["base"]


def run(config, workdir: str, log, interrupts):
  """The RL loop (module docstring); returns the final `TrainState`. One process."""
  opts = rl_options(config)
  if jax.process_count() > 1:
    raise ConfigError(f"objective={config.objective!r} runs in one process (this run has "
                      f"{jax.process_count()}); the rollouts and rewards are not split.")
  mesh = make_mesh(config.get("num_devices") or None)
  task = tasks.from_config(config)
  state, _, apply_fn, shardings = init_state(config, mesh, task)
  log(f"model: {models.count_params(state.params):,} parameters ({config.objective}, "
      f"G={opts['num_generations']}, {opts['num_iterations']} inner updates)")
  lora_parts = _lora_parts(config, apply_fn)
  if lora_parts is None:  # the start point, frozen (a copy: the updates donate the state)
    ref_apply, ref_params = apply_fn, jax.tree.map(jnp.copy, state.params)
    ref_of = lambda params: ref_params  # noqa: E731
    sample_apply, sampled = apply_fn, lambda params: params  # noqa: E731
  else:
    ref_apply, ref_of = lora_parts
    # Rollouts read the adapters merged once per step, not at every sampler step.
    sample_apply = ref_apply
    sampled = jax.jit(functools.partial(lora.merge, lora_config=lora.config_of(config)))
  manager = state_io.checkpoint_manager(workdir, config)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  restored = state_io.restore_latest(manager, abstract, config, task, log)
  if restored is not None:
    state = jax.device_put(restored, shardings)
    log(f"resumed from step {int(state.step)}")
  num_steps = config.train.num_steps
  source = sources.make_source(config, task, opts)
  group = opts["num_generations"]
  num_prompts = config.batch_size // group
  spec = sampler_spec(config, source.prompt_length + source.completion_length)
  # The learning-rate schedule counts updates: num_iterations of them per step.
  train_cfg = ml_collections.ConfigDict(config.train.to_dict())
  train_cfg.num_steps = num_steps * opts["num_iterations"]
  programs = build_programs(config, opts, apply_fn, ref_apply, train_cfg, source.prompt_length,
                            source.mask_id)
  clock = TrainClock(workdir, int(state.step))
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  keep_metrics_through(metrics_path, int(state.step))
  metrics = MetricsLog(workdir, bool(config.get("log_tensorboard", False)))
  step = start_step = int(state.step)
  saved_step = step if restored is not None else None
  params, opt_state = state.params, state.opt_state
  try:
    while step < num_steps and interrupts.signal_name is None:
      key = step_key(config, step)
      prompts = source.draw(jax.random.fold_in(key, Stream.PROMPTS), num_prompts)
      ids_BxL, write_BxL, rollout_seconds = rollout(
          sample_apply, sampled(params), jax.random.fold_in(key, Stream.ROLLOUT), prompts, group,
          source.completion_length, spec, source.mask_id)
      mask_BxC = np.asarray(losses.completion_mask(
          ids_BxL[:, source.prompt_length:], () if source.eos_id is None else source.eos_id),
          np.float32)
      if opts["estimator"] == "trajectory" and write_BxL.max() >= opts["sampler_steps"]:
        raise ValueError(f"rl.estimator='trajectory': the sampler wrote at step "
                         f"{int(write_BxL.max())}, past sampler.steps={opts['sampler_steps']} "
                         "(its steps count per block?); set sampler.steps to the total.")
      try:
        rewards_B, reward_means = score(source, opts["rewards"], opts["reward_weights"],
                                        prompts, group, ids_BxL, mask_BxC)
      except rewards_lib.RewardError as error:
        log(f"step {step + 1}: {error}; stopping. The last checkpoint (step "
            f"{saved_step}) is kept in {workdir}/checkpoints.")
        raise
      start = time.perf_counter()
      advantages_B = losses.group_advantages(jnp.asarray(rewards_B), group,
                                             scale_by_std=opts["scale_by_std"])
      mask_keys = jax.vmap(lambda i: jax.random.fold_in(
          jax.random.fold_in(key, Stream.MASKS), i))(jnp.arange(opts["num_iterations"]))
      ids = jnp.asarray(ids_BxL)
      valid = None if prompts.valid_PxLp is None else jnp.asarray(np.concatenate(
          [np.repeat(prompts.valid_PxLp, group, axis=0),
           np.ones((len(ids_BxL), source.completion_length), bool)], 1))
      mask = jnp.asarray(mask_BxC if opts["estimator"] != "elbo" or config.objective == "spg"
                         else np.ones((len(ids_BxL), 1), np.float32))
      write = jnp.asarray(write_BxL)
      old_all = (programs.all_logps["policy"](params, ids, valid, mask_keys, write, mask)
                 if needs_old(config, opts) else None)
      ref_all = (programs.all_logps["reference"](ref_of(params), ids, valid, mask_keys, write,
                                                 mask) if needs_reference(config, opts) else None)
      inner = []
      for i in range(opts["num_iterations"]):
        params, opt_state, m = programs.update(
            params, opt_state, ids, valid, mask_keys[i], None if old_all is None else old_all[i],
            None if ref_all is None else ref_all[i], advantages_B, mask, write)
        inner.append(m)
      host = [{k: float(v) for k, v in jax.device_get(m).items()} for m in inner]
      update_seconds = time.perf_counter() - start
      step += 1
      row = {k: float(np.mean([h[k] for h in host])) for k in host[0]}
      if not all(math.isfinite(v) for v in row.values()):
        raise FloatingPointError(f"non-finite loss at step {step}: {row}; stopping. The last "
                                 f"checkpoint (step {saved_step}) is kept in "
                                 f"{workdir}/checkpoints.")
      groups = rewards_B.reshape(-1, group)
      row.update(step=step, reward_mean=float(rewards_B.mean()),
                 reward_std=float(groups.std(axis=1, ddof=1).mean()),
                 zero_std_ratio=float((groups.std(axis=1) < 1e-6).mean()),
                 completion_length=float(mask_BxC.sum(1).mean()),
                 rollout_seconds=rollout_seconds, update_seconds=update_seconds,
                 rollout_fraction=rollout_seconds / max(rollout_seconds + update_seconds, 1e-9),
                 **reward_means)
      row.setdefault("kl", 0.0)
      row.setdefault("clip_ratio", 0.0)
      metrics.write({"step": step, **{k: v for k, v in row.items() if k != "step"}})
      log(f"step {step}/{num_steps} reward {row['reward_mean']:.3f} kl {row['kl']:.4g} "
          f"clip {row['clip_ratio']:.3f} rollout {rollout_seconds:.2f}s update "
          f"{update_seconds:.2f}s")
      state = TrainState(step=jnp.asarray(step, jnp.int32), params=params, opt_state=opt_state,
                         ema_params=None)
      if step % config.checkpoint.every == 0 or step == num_steps:
        state_io.save(manager, state, config, task)
        clock.save(step)
        saved_step = step
    if step < num_steps and step != start_step and saved_step != step:
      state_io.save(manager, state, config, task)
      clock.save(step)
      log(f"{interrupts.signal_name}: checkpoint saved at step {step} of {num_steps} in "
          f"{workdir}/checkpoints; the same command resumes.")
    elif step < num_steps and step == start_step:
      log(f"{interrupts.signal_name} before the first step: stopped, nothing trained.")
  finally:
    metrics.close()
  if step == num_steps:
    log(run_summary(workdir, step, num_steps))
  return TrainState(step=jnp.asarray(step, jnp.int32), params=params, opt_state=opt_state,
                    ema_params=None)


for _name in OBJECTIVE_NAMES:
  objectives.register(objectives.Objective(
      _name, _unused_loss_fn, resolve_config=resolve_config, start_model=start_model,
      samples=False, run=run))
