"""An RL run's config and start point: the objective's `resolve_config` and `start_model`
hooks (`mdjax.train.objectives`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections

from mdjax import models
from mdjax.rl.options import OBJECTIVE_NAMES, rl_options
from mdjax.tasks import sft as sft_data
from mdjax.train import sft, start_point, state_io
from mdjax.train.config_checks import ConfigError


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
    saved = start_point.workdir_start(config, where)  # its sizes checked against its arrays
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
  model = start_point.merged_model(config.model, fields, {}, sft.COMPUTE_FIELDS, init_from)
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


def no_supervised_loss(config, apply_fn, task):
  """RL has no supervised loss: its loop (`run`) computes the objective's."""
  del apply_fn, task
  raise ConfigError(f"objective={config.objective!r} runs its own loop (mdjax.rl.trainer.run); "
                    "it has no supervised loss.")
