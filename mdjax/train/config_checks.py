"""The config checked before anything is built: one ConfigError naming the field."""

from __future__ import annotations

import math

import numpy as np

from mdjax import errors, lora, noise, sampling, tasks
from mdjax.train import objectives


# ----------------------------------------------------------------------------
# Config checks, the workdir lock, interruption, the metrics file.
# ----------------------------------------------------------------------------


def _integer(low):
  return (lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= low,
          f"must be an integer >= {low}")


def _number(test, allowed):
  return (lambda v: isinstance(v, (int, float, np.number)) and not isinstance(v, bool)
          and math.isfinite(v) and test(v), f"must be a finite number {allowed}")


# Every numeric field a config may set: (field, (test, what is allowed)). Absent optional
# fields are skipped.
CONFIG_RANGES = (
    ("seed", _integer(0)), ("batch_size", _integer(1)), ("num_devices", _integer(0)),
    ("log_every", _integer(1)), ("eval_every", _integer(0)), ("eval_batches", _integer(1)),
    ("num_eval_samples", _integer(0)),
    ("model.d_model", _integer(1)), ("model.num_layers", _integer(1)),
    ("model.num_heads", _integer(1)), ("model.d_ff", _integer(1)),
    ("train.num_steps", _integer(1)), ("train.lr", _number(lambda v: v > 0, "> 0")),
    ("train.lr_floor", _number(lambda v: 0 <= v <= 1, "in [0, 1]")),
    ("train.warmup_steps", _integer(0)),
    ("train.b1", _number(lambda v: 0 <= v < 1, "in [0, 1)")),
    ("train.b2", _number(lambda v: 0 <= v < 1, "in [0, 1)")),
    ("train.weight_decay", _number(lambda v: v >= 0, ">= 0")),
    ("train.grad_clip", _number(lambda v: v > 0, "> 0")),
    ("train.ema_decay", _number(lambda v: 0 <= v < 1, "in [0, 1)")),
    ("train.grad_accum_steps", _integer(1)),
    ("train.lora.rank", _integer(0)), ("train.lora.alpha", _number(lambda v: v > 0, "> 0")),
    ("train.lora.dropout", _number(lambda v: v == 0, "equal to 0 (the adapters are merged "
                                   "into the weights, W + scale * A @ B, which cannot drop an "
                                   "adapter's input per token)")),
    ("checkpoint.every", _integer(1)), ("checkpoint.keep", _integer(1)),
    ("block_nelbo.t_min", _number(lambda v: 0 <= v < 1, "in [0, 1)")),
    ("block_nelbo.t_max", _number(lambda v: 0 < v <= 1, "in (0, 1]")),
    ("hybrid.p_uniform", _number(lambda v: 0 <= v < 1, "in [0, 1)")),
    # gamma in (0, 2] keeps GIDD's forward jump rates >= 0 (mdjax.noise.Hybrid).
    ("hybrid.gamma", _number(lambda v: 0 < v <= 2, "in (0, 2]")),
    ("gidd.min_loss_weight", _number(lambda v: v >= 0, ">= 0")),
    ("gidd.max_loss_weight", _number(lambda v: v > 0, "> 0")),
)

# The objectives' names, live: those registered on import (`objectives.register`) join it.
OBJECTIVES = objectives.OBJECTIVES.keys()
# The objectives that train a block-causal model (model.block_size): the block NELBO, and
# CDLM's student (mdjax.accelerators.cdlm).
BLOCK_OBJECTIVES = ("nelbo", "cdlm")
# The objectives that train under uniform noise (`noise`): UDLM's NELBO, and DUO's
# consistency distillation of a uniform-noise model (mdjax.accelerators.duo).
UNIFORM_OBJECTIVES = ("nelbo", "duo")


_ABSENT = object()


def _field(config, path: str):
  """The value at a dotted path, or _ABSENT."""
  node = config
  for name in path.split("."):
    if node is None or name not in node:
      return _ABSENT
    node = node[name]
  return node


class ConfigError(ValueError):
  """A config value out of its range (the message names the field)."""


def check_config(config) -> None:
  """Range checks of every numeric field: a ValueError naming the field, its value and what
  is allowed. Runs before anything is built, compiled or written."""

  def refuse(path, value, allowed):
    raise ConfigError(f"config field {path}={value!r}: {allowed}.")

  for path, (test, allowed) in CONFIG_RANGES:
    value = _field(config, path)
    if value is not _ABSENT and not test(value):
      refuse(path, value, allowed)
  heads, width = config.model.num_heads, config.model.d_model
  if width % heads:
    refuse("model.num_heads", heads, f"must divide model.d_model={width}")
  steps = _field(config, "sampler.steps")
  if steps is not _ABSENT and steps is not None and not _integer(1)[0](steps):
    refuse("sampler.steps", steps, "must be an integer >= 1 (or None for families without)")
  if config.objective not in OBJECTIVES:
    refuse("objective", config.objective, f"must be one of {tuple(OBJECTIVES)}")
  task = _field(config, "task")
  if task is not _ABSENT:
    if task not in tasks.TASKS:
      refuse("task", task, f"must be one of {sorted(tasks.TASKS)}")
    try:  # the task's parameters, the corpus file or package; nothing is read or trained
      tasks.check(task, tasks.kwargs_of(config))
    except ValueError as error:
      message = str(error)
      raise ConfigError("config field " + (message if message.startswith("task_kwargs")
                                           else f"task_kwargs.{message}")) from None
  family = _field(config, "sampler.family")
  if family is not _ABSENT:  # the sampler of the evaluations, found before the model is built
    names = sorted(sampling.families()) + ["left_to_right"]
    if family not in names:
      refuse("sampler.family", family, f"must be one of {names}")
    knobs = {k: v for k, v in config.sampler.items() if k != "family"}
    try:  # the length only sets left_to_right's order, which is not what is checked here
      sampling.make_spec(family, length=1, **knobs)
    except (ValueError, TypeError) as error:
      raise ConfigError(f"config field sampler ({family}): {error}") from None
  _check_noise(config, refuse)
  block_size = _field(config, "model.block_size")
  if block_size is not _ABSENT and block_size is not None:
    if not _integer(1)[0](block_size):
      refuse("model.block_size", block_size, "must be None or an integer >= 1 (dividing the "
             "sequence length)")
    if config.objective not in BLOCK_OBJECTIVES:
      refuse("model.block_size", block_size, f"needs objective='nelbo' (the block NELBO) or "
             f"'cdlm' (a block-causal student), not {config.objective!r}")
    if config.model.get("time_conditioning") or config.model.get("causal"):
      refuse("model.block_size", block_size, "needs model.time_conditioning=False and "
             "model.causal=False")
  t_min, t_max = _field(config, "block_nelbo.t_min"), _field(config, "block_nelbo.t_max")
  if t_min is not _ABSENT and t_max is not _ABSENT and not t_min < t_max:
    refuse("block_nelbo.t_min", t_min, f"must be below block_nelbo.t_max={t_max}")
  antithetic = _field(config, "block_nelbo.antithetic")
  if antithetic is not _ABSENT and not isinstance(antithetic, bool):
    refuse("block_nelbo.antithetic", antithetic, "must be True or False")
  accum = _field(config, "train.grad_accum_steps")
  if accum is not _ABSENT and config.batch_size % accum:
    refuse("train.grad_accum_steps", accum, f"must divide batch_size={config.batch_size} (the "
           "batch is split into that many equal micro-batches)")
  targets = _field(config, "train.lora.targets")
  if targets is not _ABSENT:
    allowed = lora.TARGETS + tuple(lora.GROUPS)
    if not (isinstance(targets, (tuple, list)) and targets
            and all(isinstance(t, str) and t in allowed for t in targets)
            and len(set(targets)) == len(targets)):
      refuse("train.lora.targets", targets, f"must be a non-empty tuple of distinct names from "
             f"{allowed}")
  scales = _field(config, "train.lr_scales")
  if scales is not _ABSENT and scales is not None:
    for name, value in scales.items():
      if name not in lora.LR_NAMES:
        refuse(f"train.lr_scales.{name}", value, f"unknown name; allowed: {lora.LR_NAMES}")
      if not _number(lambda v: v >= 0, ">= 0")[0](value):
        refuse(f"train.lr_scales.{name}", value, "must be a finite number >= 0 (a multiplier "
               "of train.lr; 0 freezes)")
  for path in ("model.remat", "train.measure_peak_flops", "eval_at_end"):
    value = _field(config, path)
    if value is not _ABSENT and not isinstance(value, bool):
      refuse(path, value, "must be True or False")
  peak = _field(config, "train.peak_flops")
  if peak is not _ABSENT and peak is not None and not _number(lambda v: v > 0, "> 0")[0](peak):
    refuse("train.peak_flops", peak, "must be None (the device's known peak) or a finite "
           "number > 0 (FLOP/s per device)")
  tensorboard = _field(config, "log_tensorboard")
  if tensorboard is not _ABSENT and not isinstance(tensorboard, bool):
    refuse("log_tensorboard", tensorboard, "must be True or False")
  if tensorboard is True:
    try:
      import tensorboardX  # noqa: F401
    except ImportError:
      refuse("log_tensorboard", tensorboard,
             "needs the tensorboardX package (pip install 'mdjax[tensorboard]')")


def _check_noise(config, refuse) -> None:
  """`noise`, the hybrid's fields and GIDD's weighting (`gidd`), each refused by field."""
  name = _field(config, "noise")
  if name is _ABSENT:
    return
  if name not in noise.PROCESSES:
    refuse("noise", name, f"must be one of {tuple(noise.PROCESSES)}")
  weighting = _field(config, "gidd.weighting")
  low, high = _field(config, "gidd.min_loss_weight"), _field(config, "gidd.max_loss_weight")
  if weighting is not _ABSENT and weighting not in noise.WEIGHTINGS:
    refuse("gidd.weighting", weighting, f"must be one of {noise.WEIGHTINGS}")
  if low is not _ABSENT and high is not _ABSENT and low > high:
    refuse("gidd.min_loss_weight", low, f"must be at most gidd.max_loss_weight={high}")
  if name == "absorbing":
    if weighting not in (_ABSENT, "elbo"):
      refuse("gidd.weighting", weighting, "must be 'elbo' with noise='absorbing' (MD4's NELBO; "
             "GIDD's weightings train noise='uniform' or 'hybrid')")
    return
  if weighting == "dynamic" and name != "hybrid":
    refuse("gidd.weighting", weighting, f"must be 'elbo' or 'clip' with noise={name!r} "
           "('dynamic' weighs GIDD's hybrid process)")
  if config.objective not in (UNIFORM_OBJECTIVES if name == "uniform" else ("nelbo",)):
    refuse("noise", name, f"needs objective='nelbo' (UDLM's / GIDD's NELBO) or, for uniform "
           f"noise, 'duo' (its distillation), not {config.objective!r}")
  block_size = _field(config, "model.block_size")
  if block_size not in (_ABSENT, None):
    refuse("model.block_size", block_size, f"must be None with noise={name!r} (the block NELBO "
           "masks: absorbing noise only)")
  samples, family = _field(config, "num_eval_samples"), _field(config, "sampler.family")
  kinds = sampling.families()[family].noise_kinds if family in sampling.families() else None
  if samples not in (_ABSENT, 0) and name not in (kinds or ("absorbing",)):
    refuse("sampler.family", family, f"must sample {name} noise to draw the evaluation's "
           f"num_eval_samples={samples} (e.g. 'uniform_ancestral'), or set num_eval_samples=0")
  if name == "hybrid":  # a field the hybrid process does not take
    try:
      objectives.noise_process(config, 1)
    except errors.ArgumentError as error:
      if error.param in ("schedule", "vocab_size"):
        raise
      raise ConfigError(f"config field hybrid.{error.param}: {error}") from None
