"""Supervised fine-tuning, the training side: start points, the response-only NELBO and the
export back. Its rows (the examples, their encoding and packing) are the task's,
`mdjax.tasks.sft`.

A run of `configs/sft.py` (task 'sft', objective 'sft') starts from `train.init_from`: an mdjax
workdir (its newest checkpoint) or "pretrained:DIR", a published diffusion LM folder read by
`mdjax.pretrained.load` (LLaDA, Dream, or a block-causal SDAR, Fast-dLLM v2, LLaDA2). This
module registers the objective 'sft' (`objectives.Objective`),
whose hooks the train state and loop call:

  resolve_config(config)  before the config checks: the model fields the config leaves unset
                          (None) become the start point's; a field set to another value than
                          the start point's is a ConfigError naming it.
  start_model(config, task)  `init_state`'s model: (graphdef, float32 params, apply_fn) of the
                          start point (a published model behind mdjax's denoiser contract).
  loss_fn(config, apply_fn, task)  `diffusion.nelbo_loss` on the task's packed rows: only the
                          response (its EOS padding included) is maskable, the prompt always
                          visible, each row's NELBO divided by its response length (LLaDA);
                          a block-causal start's block NELBO the same way.
                          The held-out evaluation reports it too.
  export(config, state, workdir)  at the final step, a published start's fine-tuned weights
                          as a folder of its layout, WORKDIR/pretrained, which
                          `pretrained.load` and `sample.py --pretrained` read.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from mdjax import diffusion, models, pretrained
from mdjax.denoiser import Denoiser
from mdjax.models import published as published_model
from mdjax import checkpoints as families
from mdjax.pretrained import tensors
from mdjax.saved_run import saved_config
from mdjax.tasks import sft as sft_data
from mdjax.train import checkpoints, objectives
from mdjax.train.config_checks import ConfigError
from mdjax.train.state import model_config

EXPORT_DIR = "pretrained"  # WORKDIR/pretrained: a published start's fine-tuned folder
# How the model runs, not what its weights are: free to differ from the start point's.
COMPUTE_FIELDS = ("dtype", "remat")


def _published_fields(config) -> dict:
  """A published architecture as the fields of `config.model`."""
  return dict(d_model=config.d_model, num_layers=config.num_layers, num_heads=config.num_heads,
              d_ff=config.mlp_hidden, positions="rope", norm="rms", mlp="swiglu",
              time_conditioning=False, causal=False, block_size=None)


def _start_fields(start: str) -> tuple[dict, str, int | None, int | None]:
  """(model fields, where they were read, the longest sequence or None, the block size of a
  block-causal published start or None) of a start point."""
  kind, where = sft_data.split_start(start)
  if kind == "pretrained":
    config, _ = sft_data.published_config(where)
    return (_published_fields(config), os.path.join(where, "config.json"), config.max_len,
            config.block_size)
  saved, _ = saved_config(where)
  return dict(saved.get("model") or {}), f"{where}'s checkpoint", None, None


def resolve_config(config):
  """`config` with its model fields filled from the start point (a copy), or `config` itself
  when it names no start point and no SFT task; ConfigError on a field that differs."""
  init_from = config.get("train", {}).get("init_from")
  if not init_from and config.get("task") != "sft":
    return config
  if config.get("task") != "sft" or config.get("objective") != "sft":
    raise ConfigError(f"config fields task={config.get('task')!r}, objective="
                      f"{config.get('objective')!r}: fine-tuning from train.init_from runs "
                      "task='sft' with objective='sft' (configs/sft.py).")
  try:
    fields, where, max_len, block = _start_fields(init_from)
  except ValueError as error:
    raise ConfigError(f"config field train.init_from: {error}") from None
  resolved = ml_collections.ConfigDict(config.to_dict())
  defaults = {f.name: f.default for f in dataclasses.fields(models.TransformerConfig)
              if f.default is not dataclasses.MISSING}
  model = resolved.model
  published = init_from.startswith(sft_data.PRETRAINED_PREFIX)
  for name in sorted(set(model.keys()) | set(fields)):
    value = model.get(name)
    if name in COMPUTE_FIELDS:
      if value is None:  # a workdir's own compute knobs, else the defaults
        start_value = None if published else fields.get(name)
        model[name] = defaults.get(name) if start_value is None else start_value
    elif value is None:
      model[name] = fields.get(name, defaults.get(name))
    elif name in fields and value != fields[name]:
      raise ConfigError(f"config field model.{name}={value!r} differs from the start point's "
                        f"{fields[name]!r} ({where}); leave it unset to take the start "
                        "point's architecture.")
  if model.get("causal"):
    raise ConfigError(f"config field model.causal=True ({where}): a left-to-right model; "
                      "fine-tuning with the response-only NELBO needs a diffusion model.")
  if published and model.get("remat"):
    raise ConfigError("config field model.remat=True: the published models run without "
                      "rematerialization; leave it False.")
  length = resolved.task_kwargs.get("length")
  if block is not None and isinstance(length, int) and length % block:
    raise ConfigError(f"config field task_kwargs.length={length}: the start point is "
                      f"block-causal with blocks of {block} ({where}); the rows' length must "
                      "be a multiple of it.")
  if max_len is not None and isinstance(length, int) and length > max_len:
    raise ConfigError(f"config field task_kwargs.length={length}: the start point's model "
                      f"reads at most {max_len} positions ({where}).")
  return resolved


# ----------------------------------------------------------------------------
# The start point's model.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PublishedView:
  """A published model under mdjax's denoiser contract: the mask id is V (the checkpoint's
  own mask id, inside its vocabulary, is what the network reads), and float32 parameters run
  in `config.dtype` (float32 master weights). Equal configs give equal values (one compiled
  program)."""

  config: object  # a PublishedConfig, its dtype the compute dtype

  def _inner(self, params, tokens_BxL):
    """The network's own ids (V is its mask id) and the params in the compute dtype."""
    inner_BxL = jnp.where(tokens_BxL == self.config.vocab_size, self.config.mask_id, tokens_BxL)
    return jax.tree.map(lambda p: p.astype(self.config.jnp_dtype), params), inner_BxL

  def __call__(self, params, tokens_BxL, t_B, valid_BxL=None):
    del t_B  # time-free
    params, inner_BxL = self._inner(params, tokens_BxL)
    return published_model.forward(self.config, params, inner_BxL, valid_BxL)

  def block_pair(self, params, noisy_BxL, clean_BxL, t_B):
    """A block-causal network's training pass (`published.block_pair`)."""
    del t_B
    params, inner_BxL = self._inner(params, noisy_BxL)
    return published_model.block_pair(self.config, params, inner_BxL, clean_BxL)

  def denoiser(self) -> Denoiser:
    """The view as a `Denoiser`: with a block-causal network's block size and block pair."""
    blocks = self.config.block_size is not None
    return Denoiser(self, block_size=self.config.block_size,
                    block_pair=self.block_pair if blocks else None)


def start_model(config, task):
  """(graphdef, params, apply_fn) of `config.train.init_from`: graphdef None and a
  `PublishedView` for a published folder; the workdir's model, its newest checkpoint's
  parameters (the EMA ones when kept), for a workdir. Parameters are float32. None without
  a start point (a fresh model)."""
  if not config.train.get("init_from"):
    return None
  config = resolve_config(config)  # the model fields the config leaves to the start point
  kind, where = sft_data.split_start(config.train.init_from)
  if kind == "pretrained":
    model = pretrained.load(where)
    if model.vocab_size != task.vocab_size:
      raise ValueError(f"start {where}: {model.vocab_size} ids, the task {task.vocab_size}.")
    params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), model.params)
    view = PublishedView(dataclasses.replace(model.config, dtype=config.model.dtype))
    return None, params, view.denoiser()
  graphdef, fresh, apply_fn = models.init(model_config(config, task), seed=config.seed)
  fresh = nnx.to_pure_dict(fresh)
  start = checkpoints.load(where, log=lambda message: None)
  want = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(fresh)}
  got = {jax.tree_util.keystr(p): x.shape
         for p, x in jax.tree_util.tree_leaves_with_path(start.params)}
  for name in sorted(set(want) | set(got)):
    if want.get(name) != got.get(name):
      raise ValueError(f"start={where!r}: parameter {name} is {got.get(name)} there, the "
                       f"config's model needs {want.get(name)}.")
  params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), start.params)
  return graphdef, params, apply_fn


def loss_fn(config, apply_fn, task):
  """loss(params, key, rows_BxL) -> (loss, aux): the response-only NELBO in nats per response
  token (`diffusion.nelbo_loss` with maskable = response, per_token=True); aux's
  bits_per_token is per response token over the batch. A block-causal start (SDAR,
  Fast-dLLM v2, LLaDA2) trains by the block NELBO (`diffusion.block_nelbo_loss`: each block
  denoised after the clean blocks before it, as its decoder reads them), per response token
  the same way."""
  schedule = objectives.masking_schedule(config)
  block_size = Denoiser.of(apply_fn).block_size

  def loss(params, key, rows_BxL):
    tokens_BxL, maskable_BxL = sft_data.unpack_rows(rows_BxL)
    if block_size is None:
      return diffusion.nelbo_loss(apply_fn, params, key, tokens_BxL, schedule=schedule,
                                  mask_id=task.mask_id, maskable_BxL=maskable_BxL,
                                  per_token=True)
    _, aux = diffusion.block_nelbo_loss(apply_fn, params, key, tokens_BxL,
                                        block_size=block_size, schedule=schedule,
                                        mask_id=task.mask_id, maskable_BxL=maskable_BxL)
    per_token_B = aux["nelbo_nats_B"] / jnp.maximum(maskable_BxL.sum(axis=-1), 1)
    return per_token_B.mean(), aux

  return loss


# ----------------------------------------------------------------------------
# The export.
# ----------------------------------------------------------------------------


def _native_dtype(folder: str) -> str:
  """The start checkpoint's dtype ('bfloat16' or 'float32'), read from its headers."""
  codes = {info.dtype for info in tensors.read_checkpoint(folder).values()}
  return "bfloat16" if codes == {"BF16"} else "float32"


def _on_host(x) -> np.ndarray:
  """A parameter on this host: whole, or one replica of a replicated multi-host array."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  if x.sharding.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  raise ValueError("export: a parameter is split across hosts (FSDP over several processes); "
                   "the export needs every parameter whole on process 0.")


def _remove(path: str) -> None:
  """Removes a previous export: a folder with what it holds; a symbolic link (or a file) is
  unlinked itself, never followed (rmtree skips a link, and `save` would write through it)."""
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path, ignore_errors=True)
  elif os.path.lexists(path):
    os.unlink(path)


def export(config, state, workdir: str, log=print) -> str | None:
  """A published start's fine-tuned parameters (the EMA ones when kept) written in its layout
  to WORKDIR/pretrained, in the start checkpoint's dtype, its tokenizer files copied; the
  folder path, or None for a workdir start (the workdir is the result)."""
  init_from = config.train.get("init_from")
  if not init_from:
    return None
  kind, folder = sft_data.split_start(init_from)
  if kind != "pretrained":
    return None
  _, raw = sft_data.published_config(folder)
  dtype = _native_dtype(folder)
  published = families.detect(raw, folder).config_from_hf(raw, dtype)
  params = state.ema_params if state.ema_params is not None else state.params
  model = pretrained.PretrainedModel(
      apply_fn=None, params=jax.tree.map(_on_host, params), config=published,
      family=published.family, source=os.path.abspath(folder), hf_config=raw)
  out = os.path.join(workdir, EXPORT_DIR)
  partial = out + ".partial"
  _remove(partial)
  pretrained.save(model, partial, dtype=dtype)
  _remove(out)
  os.rename(partial, out)  # a complete folder or none
  log(f"fine-tuned {published.family} folder: {out} (step {int(state.step)}; "
      f"pretrained.load or sample.py --pretrained={out})")
  return out


objectives.register(objectives.Objective(
    "sft", loss_fn, resolve_config=resolve_config, start_model=start_model, export=export,
    workdir_folders=(EXPORT_DIR, EXPORT_DIR + ".partial")))
