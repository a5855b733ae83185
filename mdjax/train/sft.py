"""Supervised fine-tuning, the training side: start points, the response-only NELBO and the
export back. Its rows (the examples, their encoding and packing) are the task's,
`mdjax.tasks.sft`. The start points serve other objectives too: 'nelbo' and 'a2d'
(`objectives`) start from "pretrained:DIR" on a text or corpus task whose tokenizer is the
start's (a corpus prepared with `--tokenizer=DIR/tokenizer.json`), and export alike.

A run of `configs/sft.py` (task 'sft', objective 'sft') starts from `train.init_from`: an mdjax
workdir (its newest checkpoint) or "pretrained:DIR", a published diffusion LM folder read by
`mdjax.io.load` (LLaDA, Dream, or a block-causal SDAR, Fast-dLLM v2, LLaDA2). This
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
                          `mdjax.io.load` and `sample.py --pretrained` read.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from mdjax import diffusion, formats, io, lora, models
from mdjax.denoiser import Denoiser
from mdjax.io import record, tensors
from mdjax.models import published as published_model
from mdjax.tasks import sft as sft_data
from mdjax.train import gemma_start, objectives, state_io
from mdjax.train.config_checks import ConfigError
from mdjax.train.state import model_config

EXPORT_DIR = "pretrained"  # WORKDIR/pretrained: a published start's fine-tuned folder
# How the model runs, not what its weights are: free to differ from the start point's.
COMPUTE_FIELDS = ("dtype", "remat")


# The objectives that start from `train.init_from` (the start points of this module).
START_OBJECTIVES = ("sft", "nelbo", "a2d")


def _published_fields(config, objective: str) -> dict:
  """A published architecture as the fields of `config.model`: a block-causal start's block
  size is model.block_size for 'nelbo' (whose block NELBO reads it there); 'sft' and 'a2d'
  read it from the start's denoiser."""
  return dict(d_model=config.d_model, num_layers=config.num_layers, num_heads=config.num_heads,
              d_ff=config.mlp_hidden, positions="rope", norm="rms", mlp="swiglu",
              time_conditioning=False, causal=False,
              block_size=config.block_size if objective == "nelbo" else None)


def _start_fields(start: str, objective: str = "sft"
                  ) -> tuple[dict, str, int | None, int | None, str]:
  """(model fields, where they were read, the longest sequence or None, the block size of a
  block-causal published start or None, the noise it was trained under) of a start point."""
  kind, where = sft_data.split_start(start)
  if kind == "pretrained" and gemma_start.is_start(where):  # DiffusionGemma's orbax params
    return gemma_start.start_fields(where, objective)
  if kind == "pretrained":
    config, _ = sft_data.published_config(where)
    return (_published_fields(config, objective), os.path.join(where, "config.json"),
            config.max_len, config.block_size, "absorbing")
  saved, _ = state_io.start_config(where)  # its sizes checked against its arrays first
  return (dict(saved.get("model") or {}), f"{where}'s checkpoint", None, None,
          objectives.noise_name(saved))


def resolve_config(config):
  """`config` with its model fields filled from the start point (a copy), or `config` itself
  when it names no start point and no SFT task; ConfigError on a field that differs, or on an
  objective that does not start from `train.init_from` (START_OBJECTIVES)."""
  init_from = config.get("train", {}).get("init_from")
  task, objective = config.get("task"), config.get("objective")
  if not init_from and task != "sft":
    return config
  own = objectives.OBJECTIVES.get(objective)
  if own is not None and objective not in START_OBJECTIVES and own.start_model is not None:
    return config  # an objective with start points of its own (RL: 'grpo', 'wd1')
  if (task == "sft") != (objective == "sft") or objective not in START_OBJECTIVES:
    raise ConfigError(f"config fields task={task!r}, objective={objective!r}: fine-tuning "
                      "from train.init_from runs task='sft' with objective='sft' "
                      "(configs/sft.py), or objective 'nelbo' or 'a2d' on a text or corpus "
                      "task (configs/a2d_masked.py).")
  try:
    fields, where, max_len, block, start_noise = _start_fields(init_from, objective)
  except ValueError as error:
    raise ConfigError(f"config field train.init_from: {error}") from None
  if start_noise != objectives.noise_name(config):
    raise ConfigError(f"config field noise={objectives.noise_name(config)!r}: the start point "
                      f"was trained under {start_noise!r} noise ({where}), and a fine-tuned "
                      "model keeps its process (sft and a2d fine-tune absorbing models; "
                      f"objective 'nelbo' continues under --config.noise={start_noise}).")
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
  """A published model under mdjax's denoiser contract: the mask id is `vocab` (the
  checkpoint's own mask id, inside its vocabulary, is what the network reads), the logits are
  those of ids [0, vocab), and float32 parameters run in `config.dtype` (float32 master
  weights). vocab None: the checkpoint's vocabulary (a task of a tokenizer with fewer ids
  than the embedding has rows reads and predicts its own ids only). Equal configs give equal
  values (one compiled program)."""

  config: object  # a PublishedConfig, its dtype the compute dtype
  vocab: int | None = None

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size if self.vocab is None else self.vocab

  def _inner(self, params, tokens_BxL):
    """The network's own ids (the view's mask id is its mask id) and the params in the
    compute dtype."""
    inner_BxL = jnp.where(tokens_BxL == self.vocab_size, self.config.mask_id, tokens_BxL)
    return jax.tree.map(lambda p: p.astype(self.config.jnp_dtype), params), inner_BxL

  def _ours(self, logits_BxLxV):
    return logits_BxLxV if self.vocab is None else logits_BxLxV[..., :self.vocab]

  def __call__(self, params, tokens_BxL, t_B, valid_BxL=None, anneal=None):
    del t_B  # time-free
    params, inner_BxL = self._inner(params, tokens_BxL)
    return self._ours(published_model.forward(self.config, params, inner_BxL, valid_BxL,
                                              anneal=anneal))

  def block_pair(self, params, noisy_BxL, clean_BxL, t_B, anneal=None):
    """A block-causal network's training pass (`published.block_pair`)."""
    del t_B
    params, inner_BxL = self._inner(params, noisy_BxL)
    return self._ours(published_model.block_pair(self.config, params, inner_BxL, clean_BxL,
                                                 anneal=anneal))

  def denoiser(self) -> Denoiser:
    """The view as a `Denoiser`: with a block-causal network's block size and block pair."""
    blocks = self.config.block_size is not None
    return Denoiser(self, block_size=self.config.block_size,
                    block_pair=self.block_pair if blocks else None)

  def annealed(self, fraction, key) -> Denoiser:
    """The denoiser with attention annealed towards causal (`layers.anneal_visible`:
    fraction 0 causal, 1 the network's own pattern; one draw of `key`)."""
    anneal = (fraction, key)
    blocks = self.config.block_size is not None
    return Denoiser(functools.partial(self.__call__, anneal=anneal),
                    block_size=self.config.block_size,
                    block_pair=functools.partial(self.block_pair, anneal=anneal)
                    if blocks else None)

  def with_block_size(self, block_size: int) -> "PublishedView":
    """The view of the same network block-causal in blocks of `block_size` (a block-size
    schedule's other sizes)."""
    return dataclasses.replace(self, config=dataclasses.replace(self.config,
                                                                block_size=block_size))


def _data_field(config) -> str:
  """The config field naming a text / corpus task's data, as `field=value`."""
  for name in ("data_dir", "text_path"):
    value = config.task_kwargs.get(name)
    if value is not None:
      return f"task_kwargs.{name}={value!r}"
  return f"task={config.task!r}"


def _same_tokenizer(config, model, task, where: str) -> None:
  """A text / corpus task must read the start's ids: its tokenizer is the start's (a
  ConfigError naming the task's data field otherwise)."""
  ours = getattr(getattr(task, "tokenizer", None), "_tok", None)
  theirs = model.tokenizer
  if theirs is None:
    raise ConfigError(f"config field train.init_from: start {where}: no tokenizer.json; a text "
                      "or corpus task needs the start's tokenizer.")
  if ours is None or ours.get_vocab(with_added_tokens=True) != theirs.get_vocab(
      with_added_tokens=True):
    raise ConfigError(f"config field {_data_field(config)}: the task's tokenizer "
                      f"({task.description}) is not the start's ({where}); prepare the corpus "
                      f"with --tokenizer={os.path.join(where, 'tokenizer.json')}.")


def start_model(config, task):
  """(graphdef, params, apply_fn) of `config.train.init_from`: graphdef None and a
  `PublishedView` for a published folder; the workdir's model, its newest checkpoint's
  parameters (the EMA ones when kept), for a workdir. Parameters are float32. None without
  a start point (a fresh model)."""
  if not config.train.get("init_from"):
    return None
  config = resolve_config(config)  # the model fields the config leaves to the start point
  kind, where = sft_data.split_start(config.train.init_from)
  if kind == "pretrained" and gemma_start.is_start(where):
    return gemma_start.start_model(config, task, where, _same_tokenizer)
  if kind == "pretrained":
    model = io.load(where)
    vocab = None
    if config.task != "sft":  # a text / corpus task: the start's tokenizer, maybe fewer ids
      _same_tokenizer(config, model, task, where)
      if task.vocab_size > model.vocab_size:
        raise ConfigError(f"config field {_data_field(config)}: the task has "
                          f"{task.vocab_size} ids, the start {where} {model.vocab_size}.")
      vocab = None if task.vocab_size == model.vocab_size else task.vocab_size
    elif model.vocab_size != task.vocab_size:
      raise ValueError(f"start {where}: {model.vocab_size} ids, the task {task.vocab_size}.")
    params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), model.params)
    view = PublishedView(dataclasses.replace(model.config, dtype=config.model.dtype), vocab)
    return None, params, view.denoiser()
  graphdef, fresh, apply_fn = models.init(model_config(config, task), seed=config.seed)
  fresh = nnx.to_pure_dict(fresh)
  start = state_io.load(where, log=lambda message: None)
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
  """A published start's trained parameters (the EMA ones when kept) written in its layout
  to WORKDIR/pretrained, in the start checkpoint's dtype, its tokenizer files copied; the
  folder path, or None for a workdir start (the workdir is the result)."""
  init_from = config.train.get("init_from")
  if not init_from:
    return None
  kind, folder = sft_data.split_start(init_from)
  if kind != "pretrained":
    return None
  params = state.ema_params if state.ema_params is not None else state.params
  params = lora.merged(config, params)  # LoRA's adapters folded into the weights (or as is)
  params = jax.tree.map(_on_host, params)
  if gemma_start.is_start(folder):  # gemma's params layout, the start's dtype
    model, write = gemma_start.trained_model(params, folder), gemma_start.save
  else:
    _, raw = sft_data.published_config(folder)
    dtype = _native_dtype(folder)
    published = formats.detect(raw, folder).config_from_hf(raw, dtype)
    model = record.published_model(params=params, config=published, family=published.family,
                                   source=os.path.abspath(folder), hf_config=raw)
    write = functools.partial(io.save, dtype=dtype)
  out = os.path.join(workdir, EXPORT_DIR)
  partial = out + ".partial"
  _remove(partial)
  write(model, partial)
  _remove(out)
  os.rename(partial, out)  # a complete folder or none
  log(f"trained {model.family} folder: {out} (step {int(state.step)}; "
      f"mdjax.load or sample.py --pretrained={out})")
  return out


EXPORT_FOLDERS = (EXPORT_DIR, EXPORT_DIR + ".partial")

objectives.register(objectives.Objective(
    "sft", loss_fn, resolve_config=resolve_config, start_model=start_model, export=export,
    workdir_folders=EXPORT_FOLDERS))
# 'nelbo' starts from train.init_from too (a converted or published folder) and exports alike.
objectives.register(dataclasses.replace(objectives.get("nelbo"), start_model=start_model,
                                        export=export, workdir_folders=EXPORT_FOLDERS))


# The RL objectives (`mdjax.rl`, which registers them whole on import): their models are start
# points, so a workdir of theirs loads (`mdjax.load`) without the RL code; their loop is
# mdjax.rl's.
RL_OBJECTIVES = ("grpo", "wd1", "spg", "rft", "mdpo")


def _needs_rl(config, *args, **kwargs):
  raise ConfigError(f"objective={config.objective!r} runs the RL loop of mdjax.rl: import "
                    "mdjax.rl first (train.py does).")


def _rl_unresolved(config):
  if config.get("objective") in RL_OBJECTIVES:
    _needs_rl(config)
  return config


for _name in RL_OBJECTIVES:
  objectives.register(objectives.Objective(_name, _needs_rl, resolve_config=_rl_unresolved,
                                           start_model=start_model, run=_needs_rl,
                                           samples=False))
