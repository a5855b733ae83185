"""The training state and step: factories from the config, the pure train step, sharding."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mdjax import diffusion, lora, models, streams, tasks
from mdjax.mesh import auto_axes, make_mesh, param_sharding  # noqa: F401  (train's names too)
from mdjax.train import objectives
from mdjax.train.config_checks import ConfigError
# The losses' knobs, now the objectives'; their names here stay (train's names too).
from mdjax.train.objectives import block_nelbo_options, masking_schedule  # noqa: F401

Array = jax.Array


@struct.dataclass
class TrainState:
  step: Array
  params: Any
  opt_state: Any
  ema_params: Any
  # An objective's teacher kept in the state (`objectives.Objective.teacher_copy`, DUO): a
  # copy of the student's trained parameters (a LoRA run's adapters), refreshed every
  # `loss_fn.teacher_every` steps. None for every other objective.
  teacher_params: Any = None


# ----------------------------------------------------------------------------
# Building blocks from the config.
# ----------------------------------------------------------------------------


def model_config(config, task: tasks.Task) -> models.TransformerConfig:
  block_size = config.model.get("block_size")
  if block_size is not None:
    try:
      diffusion.check_block_size(block_size, task.length, "model.block_size")
    except ValueError as error:
      raise ConfigError(f"config field {error}") from None
  return models.TransformerConfig(vocab_size=task.vocab_size, max_len=task.length,
                                  **config.model.to_dict())


def learning_rate_schedule(cfg) -> optax.Schedule:
  """Linear warmup then cosine decay to `lr_floor * lr`: the rate of update i (from 0)."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
      decay_steps=max(cfg.num_steps, cfg.warmup_steps + 1), end_value=cfg.lr * cfg.lr_floor)


def make_optimizer(cfg) -> optax.GradientTransformation:
  """AdamW on `learning_rate_schedule`, clipping (the config's `train` section). With
  `lora` on, on the adapters only (`lora.optimizer`: no state for the base); with
  `lr_scales` ({name: multiplier}, `lora.LR_NAMES`), each leaf's rate times its name's
  multiplier, 0 freezing it (`lora.lr_scaled`)."""
  optimizer = optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2,
                  weight_decay=cfg.weight_decay))
  if lora.config_of(cfg) is not None:
    optimizer = lora.optimizer(optimizer)
  scales = cfg.get("lr_scales")
  if scales:
    optimizer = lora.lr_scaled(optimizer, scales.to_dict() if hasattr(scales, "to_dict")
                               else dict(scales))
  return optimizer


def make_loss_fn(config, apply_fn, task: tasks.Task) -> Callable:
  """loss_fn(params, key, x_BxL) -> (loss, aux) of the configured objective (`objectives`)."""
  return objectives.get(config.objective).loss_fn(config, apply_fn, task)


# ----------------------------------------------------------------------------
# The train step.
# ----------------------------------------------------------------------------


def accumulated_value_and_grad(loss_fn, params, key: Array, x_BxL: Array, steps: int):
  """((loss, aux), grads) of the mean of `loss_fn` over `steps` micro-batches, one at a time
  (lax.scan): micro-batch i holds rows i, i + steps, i + 2 steps, ... (so each device's
  shard of a batch split on its rows splits evenly) and draws its noise from
  fold_in(key, i). With a mean loss and equal micro-batches, the mean of their gradients
  is the gradient of the whole batch's loss; the noise differs from a single pass's (other
  keys, times stratified per micro-batch), not its law. aux keeps its scalars, averaged."""
  batch, length = x_BxL.shape
  if batch % steps:
    raise ValueError(f"grad_accum_steps={steps} must divide the batch of {batch} rows.")
  x_KxMxL = x_BxL.reshape(batch // steps, steps, length).swapaxes(0, 1)
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def micro(total, i_and_x):
    i, x_MxL = i_and_x
    (loss, aux), grads = grad_fn(params, jax.random.fold_in(key, i), x_MxL)
    scalars = {k: v for k, v in aux.items() if jnp.ndim(v) == 0}
    return jax.tree.map(jnp.add, total, (loss, scalars, grads)), None

  (loss, aux), _ = jax.eval_shape(grad_fn, params, key, x_KxMxL[0])
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                       (loss, {k: v for k, v in aux.items() if not v.shape}, params))
  total, _ = jax.lax.scan(micro, zeros, (jnp.arange(steps), x_KxMxL))
  loss, aux, grads = jax.tree.map(lambda v: v / steps, total)
  return (loss, aux), grads


def ema_decay_at(step, ema_decay: float):
  """The EMA decay of update `step` (from 0): min(ema_decay, (1 + step) / (10 + step)),
  TensorFlow's `num_updates` warm-up. Without it a short run's EMA stays near the
  initialisation (0.999 keeps 94% of it after 60 steps); with it update 0 keeps 10%."""
  return jnp.minimum(ema_decay, (1.0 + step) / (10.0 + step))


def train_step(state: TrainState, x_BxL: Array, *, loss_fn, optimizer, ema_decay: float,
               seed: int, learning_rate: optax.Schedule | None = None,
               grad_accum_steps: int = 1) -> tuple[TrainState, dict]:
  """value_and_grad of the loss (over `grad_accum_steps` micro-batches: see
  `accumulated_value_and_grad`; of a LoRA model's adapters only) -> optax -> metrics (with `learning_rate`, its value as
  `lr`). A loss with `takes_step` set (an attribute of the function) is called with
  step=state.step (a traced scalar: a schedule over training); one with `teacher_every` with
  teacher_params= the state's teacher, first set to the student's trained parameters at every
  multiple of that many steps (`objectives.Objective.teacher_copy`). Pure."""
  noise_key = jax.random.fold_in(jax.random.key(seed), streams.RowStream.TRAIN_NOISE)
  key = jax.random.fold_in(noise_key, state.step)
  teacher_every = getattr(loss_fn, "teacher_every", None)
  if getattr(loss_fn, "takes_step", False):  # a loss that changes over training (annealing)
    loss_fn = functools.partial(loss_fn, step=state.step)
  adapted = lora.is_adapted(state.params)
  trained = state.params["lora"] if adapted else state.params
  teacher = state.teacher_params
  if teacher_every:  # DUO: the student's copy, every so many steps
    teacher = jax.lax.cond(state.step % teacher_every == 0, lambda: trained,
                           lambda: state.teacher_params)
    whole = {"base": state.params["base"], "lora": teacher} if adapted else teacher
    loss_fn = functools.partial(loss_fn, teacher_params=jax.lax.stop_gradient(whole))
  grad_loss_fn = loss_fn
  if adapted:
    # LoRA: differentiate the adapters only; the frozen base's gradient (zeros) is never
    # formed, nor carried through gradient accumulation's loop.
    base = state.params["base"]
    grad_loss_fn = lambda adapters, *args: loss_fn({"base": base, "lora": adapters}, *args)
  if grad_accum_steps == 1:
    (loss, aux), grads = jax.value_and_grad(grad_loss_fn, has_aux=True)(trained, key, x_BxL)
  else:
    (loss, aux), grads = accumulated_value_and_grad(grad_loss_fn, trained, key, x_BxL,
                                                    grad_accum_steps)
  if trained is not state.params:
    grads = {"base": jax.tree.map(jnp.zeros_like, state.params["base"]), "lora": grads}
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  ema = state.ema_params
  if ema_decay > 0:
    decay = ema_decay_at(state.step, ema_decay)
    ema = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, ema, params)
  metrics = {k: v for k, v in aux.items() if jnp.ndim(v) == 0}
  metrics.update(loss=loss, grad_norm=optax.tree.norm(grads))
  if learning_rate is not None:  # the rate of this update: optax counts updates from 0
    metrics["lr"] = learning_rate(state.step)
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                    ema_params=ema, teacher_params=teacher), metrics


def init_state(config, mesh: Mesh, task: tasks.Task):
  """Fresh state, sharded on the mesh; returns (state, graphdef, apply_fn, shardings). The
  model and parameters are the objective's start model where it has one (SFT with
  `train.init_from`: the start point's), else a fresh model. With `train.lora` on, the
  params are {"base": the model's, "lora": adapters} and apply_fn the adapted denoiser
  (`mdjax.lora`); graphdef stays the base model's."""
  start = objectives.start_model(config, task)
  if start is not None:
    graphdef, params, apply_fn = start
  else:
    graphdef, params, apply_fn = models.init(model_config(config, task), seed=config.seed)
    params = nnx.to_pure_dict(params)
  lora_config = lora.config_of(config)
  if lora_config is not None:
    key = jax.random.fold_in(jax.random.key(config.seed), lora.LORA_INIT)
    try:
      adapters = lora.init(params, lora_config, key)
    except ValueError as error:  # a target the model has no matrix for
      raise ConfigError(f"config field train.lora.{error}") from None
    params = {"base": params, "lora": adapters}
    apply_fn = lora.adapt(apply_fn, lora_config)
  optimizer = make_optimizer(config.train)
  objectives.ensure(config.get("objective"))  # a saved run's, loaded by mdjax.load
  objective = objectives.OBJECTIVES.get(config.get("objective"))
  teacher = None
  if objective is not None and objective.teacher_copy:  # replaced at step 0 by the student's
    teacher = jax.tree.map(jnp.copy, params["lora"] if lora_config is not None else params)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                     opt_state=optimizer.init(params),
                     # A copy: the train step donates the state, each buffer once.
                     ema_params=(jax.tree.map(jnp.copy, params) if config.train.ema_decay > 0
                                 else None), teacher_params=teacher)
  shardings = state_sharding(mesh, state, config.train.fsdp)
  return jax.device_put(state, shardings), graphdef, apply_fn, shardings


def state_sharding(mesh: Mesh, state: TrainState, fsdp: bool):
  """The sharding of every leaf of the state: the parameters by `param_sharding` (the FSDP
  rule of `mdjax.mesh`), their optimizer moments alike, the rest replicated."""
  replicated = NamedSharding(auto_axes(mesh), PartitionSpec())
  by_shape = {}
  for leaf, sh in zip(jax.tree.leaves(state.params),
                      jax.tree.leaves(param_sharding(mesh, state.params, fsdp))):
    by_shape.setdefault(leaf.shape, sh)
  # Optimizer moments follow the parameter of their shape; scalars replicate.
  return jax.tree.map(lambda x: by_shape.get(jnp.shape(x), replicated) if fsdp else replicated,
                      state)
