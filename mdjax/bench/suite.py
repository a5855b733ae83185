"""The whole sampling benchmark: its settings checked, its model, every measure in one dict."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mdjax import loader, models, sampling
from mdjax.model import WORKDIR_FAMILY
from mdjax import train as train_lib
from mdjax.bench.compute import train_and_flops
from mdjax.bench.overhead import call_overheads, family_overheads, step_costs
from mdjax.bench.throughput import BLOCKS, SAMPLERS, sweep
from mdjax.bench.timing import machine_info


def check_config(config) -> None:
  """Bad settings fail here, before anything compiles."""
  for name in ("batch", "seq_len", "repeats", "train_batch", "matmul_size"):
    value = config[name]
    if not (isinstance(value, int) and value >= 1):
      raise ValueError(f"{name}={value!r} must be an integer >= 1.")
  for name in ("repeats", "overhead_repeats"):
    if not (isinstance(config[name], int) and config[name] >= 5):
      raise ValueError(f"{name}={config[name]!r} must be an integer >= 5 (medians of >= 5 "
                       "calls).")
  steps = tuple(config.steps)
  if not steps or any(not isinstance(k, int) or k < 1 for k in steps):
    raise ValueError(f"steps={steps!r} must be a non-empty list of integers >= 1.")
  unknown = sorted(set(config.samplers) - set(SAMPLERS))
  if unknown:
    raise ValueError(f"samplers={list(config.samplers)!r}: unknown {unknown}; allowed {SAMPLERS}.")
  if BLOCKS in config.samplers:
    if config.seq_len % config.num_blocks:
      raise ValueError(f"num_blocks={config.num_blocks} must divide seq_len={config.seq_len}.")
    bad = [k for k in steps if k % config.num_blocks]
    if bad:
      raise ValueError(f"steps={bad} are not divisible by num_blocks={config.num_blocks} "
                       "(the blocks sampler splits steps evenly across blocks).")
  if not (isinstance(config.step_length, int) and config.step_length >= 4):
    raise ValueError(f"step_length={config.step_length!r} must be an integer >= 4.")
  for name in ("family_steps", "call_steps"):
    value = config[name]
    if not (isinstance(value, int) and 2 <= value <= config.seq_len):
      raise ValueError(f"{name}={value!r} must be an integer in [2, seq_len={config.seq_len}].")
  families = config.get("families")
  if families is not None:
    unknown = sorted(set(families) - set(sampling.families()))
    if not families or unknown:
      raise ValueError(f"families={list(families)!r} is invalid: give None (every family) or "
                       f"registered names ({', '.join(sorted(sampling.families()))}).")
  batches = tuple(config.step_batches)
  if not batches or any(not isinstance(b, int) or b < 1 for b in batches):
    raise ValueError(f"step_batches={batches!r} must be a non-empty list of integers >= 1.")
  if config.model.dtype not in ("float32", "bfloat16"):
    raise ValueError(f"model.dtype={config.model.dtype!r} must be 'float32' or 'bfloat16'.")


def load_model(config, workdir: str | None):
  """(model config, apply_fn, params): the config's model at random init, or a trained
  checkpoint."""
  if workdir:
    model = loader.load(workdir)
    if model.family != WORKDIR_FAMILY:
      raise ValueError(f"workdir={workdir!r} is a {model.family!r} model; the suite times "
                       "mdjax's Transformer (a train.py workdir).")
    apply_fn, params = model.denoiser, model.params
    model_cfg = train_lib.model_config(model.config, model.task)
    if model_cfg.max_len < config.seq_len:
      raise ValueError(f"seq_len={config.seq_len} exceeds the checkpoint's max_len="
                       f"{model_cfg.max_len}.")
    return model_cfg, apply_fn, params
  model_cfg = models.TransformerConfig(vocab_size=config.vocab_size, max_len=config.seq_len,
                                       **config.model.to_dict())
  _, params, apply_fn = models.init(model_cfg, seed=0)
  return model_cfg, apply_fn, nnx.to_pure_dict(params)


def run(config, workdir: str | None = None, log=print) -> dict:
  """Runs the whole benchmark; returns the results dict (the JSON schema)."""
  check_config(config)
  model_cfg, apply_fn, params = load_model(config, workdir)
  num_params = models.count_params(params)
  canvas_BxL = jnp.full((config.batch, config.seq_len), model_cfg.vocab_size, jnp.int32)
  key = jax.random.key(config.seed)
  log(f"model: {num_params:,} parameters, dtype {model_cfg.dtype}; batch {config.batch}, "
      f"L {config.seq_len}; {machine_info()}")
  shape = dict(batch=config.batch, seq_len=config.seq_len, params=num_params)
  rows = sweep(apply_fn, params, canvas_BxL, config, shape, key, log)
  train = train_and_flops(config, model_cfg, apply_fn, params, canvas_BxL, rows)
  families = family_overheads(apply_fn, params, canvas_BxL, config.family_steps,
                              config.overhead_repeats, key, config.get("families"))
  calls = call_overheads(config, key, config.overhead_repeats)
  steps = step_costs(tuple(config.step_batches), config.step_length, config.overhead_repeats,
                     key, config.get("families"))
  return dict(machine=machine_info(), model=model_cfg.__dict__ | {"params": num_params},
              settings=dict(repeats=config.repeats, overhead_repeats=config.overhead_repeats,
                            num_blocks=config.num_blocks,
                            matmul_size=config.matmul_size, train_batch=config.train_batch),
              rows=rows, train=train, families=families, calls=calls, steps=steps)
