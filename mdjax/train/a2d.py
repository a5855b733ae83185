"""The objective 'a2d': continued training of a model converted from a causal LM
(`mdjax.convert`) into a diffusion LM. Its loss is the NELBO of the converted start (its
shift is the network's own) with three knobs, `config.a2d`:

  anneal_steps         DiffuLLaMA's attention annealing from causal over N steps (0: the
                       direct switch, the converted network's own attention from step 0);
  complementary        each row trained under a mask and its complement (SDAR, Fast-dLLM v2):
                       every token predicted once masked and seen once;
  block_size_schedule  "STEP:SIZE,...": the block size from each step on (a block-causal
                       start), ending at the start's.

It starts from `train.init_from="pretrained:DIR"` and exports like SFT (`mdjax.train.sft`);
importing `mdjax.train` registers it.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from mdjax import diffusion, lora
from mdjax.denoiser import Denoiser
from mdjax.tasks import sft as sft_data
from mdjax.train import objectives, sft
from mdjax.train.config_checks import ConfigError

A2D_DEFAULTS = dict(anneal_steps=0, complementary=False, block_size_schedule=None)


def a2d_options(config) -> dict:
  """config.a2d's knobs with their defaults: anneal_steps (0: the converted model's own
  attention from the first step, the direct switch; N: DiffuLLaMA's annealing over N steps),
  complementary (each row trained twice, under a mask and its complement: SDAR / Fast-dLLM
  v2), block_size_schedule ("STEP:SIZE,STEP:SIZE,...": the block size from each step on, a
  block-causal start only; None: the start's)."""
  options = dict(A2D_DEFAULTS)
  options.update(config.get("a2d", ml_collections.ConfigDict()).to_dict())
  return options


def parse_block_size_schedule(value) -> tuple[tuple[int, int], ...] | None:
  """((first step, block size), ...) of "0:4,100:8,200:32"; None stays None."""
  if value is None:
    return None
  pairs = []
  try:
    for part in str(value).split(","):
      step, size = part.split(":")
      pairs.append((int(step), int(size)))
  except ValueError:
    raise ValueError(f"a2d.block_size_schedule={value!r} must be 'STEP:SIZE,STEP:SIZE,...' "
                     "(integers).") from None
  steps = [p[0] for p in pairs]
  if steps[0] != 0 or any(b <= a for a, b in zip(steps, steps[1:])):
    raise ValueError(f"a2d.block_size_schedule={value!r}: its steps must start at 0 and "
                     "increase.")
  if any(size < 1 for _, size in pairs):
    raise ValueError(f"a2d.block_size_schedule={value!r}: block sizes must be >= 1.")
  return tuple(pairs)


def resolve_a2d(config):
  """The a2d config's checks (before training): its knobs, a published start point, the block
  sizes against the rows' length and the start's blocks. Any other objective's config is
  returned unchanged."""
  if config.get("objective") != "a2d":
    return config
  options = a2d_options(config)
  unknown = sorted(set(options) - set(A2D_DEFAULTS))
  if unknown:
    raise ConfigError(f"config field a2d.{unknown[0]}: unknown (a2d's knobs: "
                      f"{', '.join(A2D_DEFAULTS)}).")
  steps = options["anneal_steps"]
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
    raise ConfigError(f"config field a2d.anneal_steps={steps!r} must be an integer >= 0 (0: "
                      "the direct switch).")
  if not isinstance(options["complementary"], bool):
    raise ConfigError(f"config field a2d.complementary={options['complementary']!r} must be "
                      "True or False.")
  if options["complementary"] and config.get("schedule") != "linear":
    raise ConfigError(f"config field a2d.complementary=True needs schedule='linear' (the "
                      f"complement of a mask at time t is one at time 1 - t), not "
                      f"{config.get('schedule')!r}.")
  init_from = config.get("train", {}).get("init_from")
  if not (isinstance(init_from, str) and init_from.startswith("pretrained:")):
    raise ConfigError(f"config field train.init_from={init_from!r}: objective 'a2d' starts "
                      "from a converted folder, 'pretrained:DIR' (python -m mdjax.convert).")
  try:
    schedule = parse_block_size_schedule(options["block_size_schedule"])
  except ValueError as error:
    raise ConfigError(f"config field {error}") from None
  if schedule is not None:
    try:
      start, _ = sft_data.published_config(init_from[len("pretrained:"):])
    except (ValueError, OSError) as error:
      raise ConfigError(f"config field train.init_from: {error}") from None
    if start.block_size is None:
      raise ConfigError(f"config field a2d.block_size_schedule={options['block_size_schedule']!r}"
                        ": the start is not block-causal (convert it with --to=block).")
    if schedule[-1][1] != start.block_size:
      raise ConfigError(f"config field a2d.block_size_schedule="
                        f"{options['block_size_schedule']!r} must end at the start's block size "
                        f"{start.block_size} (the exported layout's).")
    length = config.get("task_kwargs", {}).get("length")
    for _, size in schedule:
      if isinstance(length, int) and length % size:
        raise ConfigError(f"config field a2d.block_size_schedule: block size {size} does not "
                          f"divide task_kwargs.length={length}.")
  return config


def _complement_nelbo(net: Denoiser, params, key, x_BxL, *, block_size, schedule, mask_id,
                      t_min: float, t_max: float, antithetic: bool):
  """The NELBO under complementary masks (SDAR, Fast-dLLM v2): each row twice, masked where
  a uniform draw is >= alpha(t) and masked where it is below, so every token is predicted
  once masked and seen once; the second copy's time is 1 - t (its masked fraction under the
  linear schedule). Each copy is an unbiased estimate of the NELBO; their mean is the loss.
  block_size None: the whole row one block (MD4's NELBO); else the block NELBO."""
  batch, length = x_BxL.shape
  block = length if block_size is None else block_size
  num_blocks = length // block
  time_key, mask_key = jax.random.split(key)
  t_BxN = diffusion.block_times(time_key, batch, num_blocks, t_min=t_min, t_max=t_max,
                                antithetic=antithetic)
  # t and 1 - t both kept in [t_min, 1 - t_min]: neither copy is all visible at weight 1/0.
  t_BxN = jnp.clip(t_BxN, t_min, 1.0 - t_min)
  u_BxL = jax.random.uniform(mask_key, x_BxL.shape)
  keep_BxL = u_BxL < jnp.repeat(schedule.alpha(t_BxN), block, axis=1)
  times = jnp.concatenate([t_BxN, 1.0 - t_BxN])  # 2B x N
  z_2BxL = jnp.concatenate([jnp.where(keep_BxL, x_BxL, mask_id),
                            jnp.where(keep_BxL, mask_id, x_BxL)])
  x_2BxL = jnp.concatenate([x_BxL, x_BxL])
  if block_size is None:
    logits = net(params, z_2BxL, times[:, 0])
  else:
    logits = net.block_pair(params, z_2BxL, x_2BxL, times.mean(-1))
  if logits.shape[-1] != mask_id:
    raise ValueError(f"mask_id={mask_id} but the denoiser returns {logits.shape[-1]} logits "
                     "per position.")
  masked_2BxL = z_2BxL == mask_id
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll_2BxL = jnp.where(masked_2BxL,
                       -jnp.take_along_axis(logp, x_2BxL[..., None], axis=-1)[..., 0], 0.0)
  nll_2BxN = nll_2BxL.reshape(2 * batch, num_blocks, block).sum(-1)
  nelbo_2B = (schedule.weight(times) * nll_2BxN).sum(-1)
  nelbo_B = 0.5 * (nelbo_2B[:batch] + nelbo_2B[batch:])
  loss = nelbo_B.mean()
  aux = {"nelbo_nats": loss, "nelbo_nats_B": nelbo_B,
         "bits_per_token": nelbo_B.sum() / (batch * length) / np.log(2.0),
         "masked_fraction": masked_2BxL[:batch].mean()}
  return loss, aux


def _a2d_fn(config, apply_fn, task, training: bool) -> Callable:
  options = a2d_options(config)
  schedule = objectives.masking_schedule(config)
  lora_config = lora.config_of(config)
  denoiser = lora.unadapted(apply_fn)
  view = denoiser.apply
  anneal_steps = options["anneal_steps"] if training else 0
  if anneal_steps and not hasattr(view, "annealed"):
    raise ValueError("a2d.anneal_steps > 0 needs a published start's network (its attention "
                     "pattern is annealed): train.init_from='pretrained:DIR'.")
  blocks = parse_block_size_schedule(options["block_size_schedule"]) if training else None
  block_size = denoiser.block_size
  if blocks is not None and block_size is None:
    raise ValueError("a2d.block_size_schedule needs a block-causal start.")
  complementary = options["complementary"] and training
  block_options = objectives.block_nelbo_options(config) if training else {}

  def one(net: Denoiser, size, params, key, x_BxL):
    """The loss of `net` in blocks of `size` (None: MD4's NELBO)."""
    if complementary:
      full = dict(t_min=1e-5, t_max=1.0, antithetic=True)
      return _complement_nelbo(net, params, key, x_BxL, block_size=size, schedule=schedule,
                               mask_id=task.mask_id, **{**full, **block_options})
    if size is None:
      return diffusion.nelbo_loss(net, params, key, x_BxL, schedule=schedule,
                                  mask_id=task.mask_id)
    return diffusion.block_nelbo_loss(net, params, key, x_BxL, block_size=size,
                                      schedule=schedule, mask_id=task.mask_id, **block_options)

  def net_of(size, fraction, key):
    """The denoiser in blocks of `size`, annealed to `fraction` (None: not annealed)."""
    source = view if size in (None, block_size) else view.with_block_size(size)
    if fraction is None:
      net = denoiser if source is view else source.denoiser()
    else:
      net = source.annealed(fraction, key)
    return net if lora_config is None else lora.adapt(net, lora_config)

  def loss(params, key, x_BxL, step=None):
    anneal_key, key = jax.random.split(key)
    fraction = None
    if anneal_steps and step is not None:  # DiffuLLaMA: min(1, (step + 1) / anneal_steps)
      fraction = jnp.minimum(1.0, (jnp.asarray(step, jnp.float32) + 1.0) / anneal_steps)
    if blocks is None or step is None:
      return one(net_of(block_size, fraction, anneal_key), block_size, params, key, x_BxL)
    starts = jnp.asarray([first for first, _ in blocks])
    index = jnp.sum(jnp.asarray(step) >= starts) - 1
    branches = [functools.partial(one, net_of(size, fraction, anneal_key), size)
                for _, size in blocks]
    return jax.lax.switch(index, branches, params, key, x_BxL)

  loss.takes_step = training  # the train step passes step=state.step
  return loss


def a2d_loss_fn(config, apply_fn, task) -> Callable:
  """loss(params, key, x_BxL, step=None) -> (loss, aux): the NELBO of a converted start
  (its shift is the network's own) under `a2d_options`: attention annealed from causal over
  anneal_steps (DiffuLLaMA), MD4's NELBO for a bidirectional start and the block NELBO for
  a block-causal one, optionally with complementary masks and a block-size schedule. Without
  `step` (evaluation) the network's own attention and block size."""
  return _a2d_fn(config, apply_fn, task, training=True)


def held_out_a2d_fn(config, apply_fn, task) -> Callable:
  """The held-out loss of 'a2d': the plain NELBO (or block NELBO over the full time range) of
  the converted network's own attention: a bound, whatever the training knobs."""
  return _a2d_fn(config, apply_fn, task, training=False)


objectives.register(objectives.Objective(
    "a2d", a2d_loss_fn, held_out_loss_fn=held_out_a2d_fn, resolve_config=resolve_a2d,
    start_model=sft.start_model, export=sft.export, workdir_folders=sft.EXPORT_FOLDERS))
