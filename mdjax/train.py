"""Training: a pure train step, optax, orbax checkpoints, data-parallel sharding.

`train(config, workdir)` runs a whole job and resumes from the newest good
checkpoint in `workdir`. It builds the task once (`tasks.from_config`) and passes the
`Task` value down. The batch a step sees is a function of (seed, step), so a resumed run
sees exactly what an uninterrupted one would; the random streams are named in
`mdjax.streams`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mdjax import diffusion, models, plot, sampling, streams, tasks

Array = jax.Array


@struct.dataclass
class TrainState:
  step: Array
  params: Any
  opt_state: Any
  ema_params: Any


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


def block_nelbo_options(config) -> dict:
  """t_min, t_max and antithetic of the block NELBO (config.block_nelbo, defaults if absent)."""
  options = dict(t_min=1e-5, t_max=1.0, antithetic=True)
  options.update(config.get("block_nelbo", ml_collections.ConfigDict()).to_dict())
  return options


def learning_rate_schedule(cfg) -> optax.Schedule:
  """Linear warmup then cosine decay to `lr_floor * lr`: the rate of update i (from 0)."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
      decay_steps=max(cfg.num_steps, cfg.warmup_steps + 1), end_value=cfg.lr * cfg.lr_floor)


def make_optimizer(cfg) -> optax.GradientTransformation:
  """AdamW on `learning_rate_schedule`, clipping."""
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2,
                  weight_decay=cfg.weight_decay))


def masking_schedule(config) -> diffusion.Schedule:
  """The configured masking schedule, e.g. schedule='polynomial', schedule_kwargs.power=3."""
  kwargs = config.get("schedule_kwargs", ml_collections.ConfigDict()).to_dict()
  return diffusion.get_schedule(config.schedule, **kwargs)


def make_loss_fn(config, apply_fn, task: tasks.Task) -> Callable:
  """loss_fn(params, key, x_BxL) -> (loss, aux) for the configured objective."""
  if config.objective == "nelbo" and config.model.get("block_size") is not None:
    return functools.partial(diffusion.block_nelbo_loss, apply_fn, schedule=masking_schedule(config),
                             mask_id=task.mask_id, block_size=config.model.block_size,
                             **block_nelbo_options(config))
  if config.objective == "nelbo":
    return functools.partial(diffusion.nelbo_loss, apply_fn, schedule=masking_schedule(config),
                             mask_id=task.mask_id)
  if config.objective == "causal":
    if not config.model.causal:
      raise ValueError("objective='causal' needs model.causal=True (a left-to-right model).")
    return functools.partial(diffusion.causal_lm_loss, apply_fn, start_id=task.mask_id)
  if config.objective == "mlm":
    corruption = diffusion.MlmCorruption(**config.get("mlm", ml_collections.ConfigDict()).to_dict())
    return functools.partial(diffusion.mlm_loss, apply_fn, vocab_size=task.vocab_size,
                             mask_id=task.mask_id, corruption=corruption)
  raise ValueError(f"objective={config.objective!r} must be 'nelbo', 'mlm' or 'causal'.")


def batch_for_step(config, step: int, task: tasks.Task) -> np.ndarray:
  """The training batch of a step: a pure function of (seed, step)."""
  key = jax.random.fold_in(jax.random.key(config.seed), step)
  return task.sample_data(key, config.batch_size)


def make_mesh(num_devices: int | None = None) -> Mesh:
  """A 1-D mesh over the local devices with the batch axis 'data'."""
  devices = np.array(jax.devices()[:num_devices] if num_devices else jax.devices())
  return Mesh(devices, ("data",))


def param_sharding(mesh: Mesh, params, fsdp: bool):
  """Replicated parameters, or (FSDP) each split on its first divisible axis."""
  size = mesh.shape["data"]

  def spec(x):
    if fsdp:
      for axis, dim in enumerate(x.shape):
        if dim % size == 0 and dim >= size:
          return NamedSharding(mesh, PartitionSpec(*([None] * axis + ["data"])))
    return NamedSharding(mesh, PartitionSpec())

  return jax.tree.map(spec, params)


# ----------------------------------------------------------------------------
# The train step.
# ----------------------------------------------------------------------------


def train_step(state: TrainState, x_BxL: Array, *, loss_fn, optimizer, ema_decay: float,
               seed: int, learning_rate: optax.Schedule | None = None
               ) -> tuple[TrainState, dict]:
  """value_and_grad of the loss -> optax -> metrics (with `learning_rate`, its value as
  `lr`). Pure."""
  noise_key = jax.random.fold_in(jax.random.key(seed), streams.RowStream.TRAIN_NOISE)
  key = jax.random.fold_in(noise_key, state.step)
  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, key, x_BxL)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  ema = state.ema_params
  if ema_decay > 0:
    ema = jax.tree.map(lambda e, p: ema_decay * e + (1 - ema_decay) * p, ema, params)
  metrics = {k: v for k, v in aux.items() if jnp.ndim(v) == 0}
  metrics.update(loss=loss, grad_norm=optax.tree.norm(grads))
  if learning_rate is not None:  # the rate of this update: optax counts updates from 0
    metrics["lr"] = learning_rate(state.step)
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                    ema_params=ema), metrics


def init_state(config, mesh: Mesh, task: tasks.Task):
  """Fresh state, sharded on the mesh; returns (state, graphdef, apply_fn, shardings)."""
  graphdef, params, apply_fn = models.init(model_config(config, task), seed=config.seed)
  params = nnx.to_pure_dict(params)
  optimizer = make_optimizer(config.train)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                     opt_state=optimizer.init(params),
                     ema_params=params if config.train.ema_decay > 0 else None)
  shardings = state_sharding(mesh, state, config.train.fsdp)
  return jax.device_put(state, shardings), graphdef, apply_fn, shardings


def state_sharding(mesh: Mesh, state: TrainState, fsdp: bool):
  replicated = NamedSharding(mesh, PartitionSpec())
  by_shape = {}
  for leaf, sh in zip(jax.tree.leaves(state.params),
                      jax.tree.leaves(param_sharding(mesh, state.params, fsdp))):
    by_shape.setdefault(leaf.shape, sh)
  # Optimizer moments follow the parameter of their shape; scalars replicate.
  return jax.tree.map(lambda x: by_shape.get(jnp.shape(x), replicated) if fsdp else replicated,
                      state)


# ----------------------------------------------------------------------------
# Checkpoints.
# ----------------------------------------------------------------------------


CORRUPT_DIR = "checkpoints_corrupt"  # unreadable checkpoints are moved here, never deleted


class CheckpointMismatch(ValueError):
  """A readable checkpoint of another model, task or tokenizer than the config asks for."""


@contextlib.contextmanager
def quiet_orbax():
  """Silences orbax's informational warnings (read-only managers, unrestored items) in scope."""
  level = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      yield
  finally:
    logging.set_verbosity(level)


def _item_handlers():
  return {"state": ocp.StandardCheckpointHandler(), "config": ocp.JsonCheckpointHandler(),
          "task": ocp.JsonCheckpointHandler()}


def checkpoint_manager(workdir: str, config=None, read_only: bool = False
                       ) -> ocp.CheckpointManager:
  """The workdir's orbax manager (writes go to a temporary dir, then a rename: atomic)."""
  with quiet_orbax():
    if read_only:
      options = ocp.CheckpointManagerOptions(read_only=True)
    else:
      options = ocp.CheckpointManagerOptions(
          max_to_keep=config.checkpoint.keep, create=True, enable_async_checkpointing=False)
    return ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), "checkpoints"),
                                 options=options, item_handlers=_item_handlers())


def save(manager: ocp.CheckpointManager, state: TrainState, config, task: tasks.Task) -> None:
  """Saves state, config and task metadata; orbax writes to a temporary dir, then renames."""
  step = int(state.step)
  with quiet_orbax():
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(config.to_dict()),
        task=ocp.args.JsonSave(task.checkpoint_metadata())), force=True)
    manager.wait_until_finished()


def _check_model_matches(saved: dict, config, step: int) -> None:
  saved_model, model = saved.get("model", {}), config.model.to_dict()
  diffs = {k: (saved_model.get(k), v) for k, v in model.items() if saved_model.get(k) != v}
  saved_kwargs = {k: v for k, v in (saved.get("task_kwargs") or {}).items() if v is not None}
  for name, saved_value, value in (("task", saved.get("task"), config.task),
                                   ("task_kwargs", saved_kwargs, tasks.kwargs_of(config))):
    if saved_value != value:
      diffs[name] = (saved_value, value)
  if diffs:
    raise CheckpointMismatch(
        f"checkpoint step {step} holds a model of another shape or task: (saved, requested) = "
        f"{diffs}. Use another workdir or the saved config.")


def _summary(error: BaseException) -> str:
  """One line of an error: its type and the start of its first line (no TensorStore dump)."""
  lines = str(error).strip().splitlines()
  text = lines[0] if lines else ""
  return f"{type(error).__name__}: {text[:160]}{'...' if len(text) > 160 else ''}"


def _read_json(manager, step: int, name: str) -> dict:
  return manager.restore(step, args=ocp.args.Composite(**{name: ocp.args.JsonRestore()}))[name]


def _read_step(manager, step: int, abstract_for: Callable[[int, dict, dict], Any]):
  """(config dict, task metadata, state) of a step; any unreadable part raises."""
  with quiet_orbax(), _read_leftovers.read(os.path.join(manager.directory, str(step))):
    saved_config = _read_json(manager, step, "config")
    items = manager.item_metadata(step) or {}
    saved_task = _read_json(manager, step, "task") if "task" in items else {}
    abstract = abstract_for(step, saved_config, saved_task)
    if items.get("state") is None:
      raise FileNotFoundError("the state's metadata is missing")
    saved = sorted(tuple(m.shape) for m in jax.tree.leaves(items["state"]))
    wanted = sorted(tuple(x.shape) for x in jax.tree.leaves(abstract))
    if saved != wanted:  # readable, but another state (e.g. EMA parameters on or off)
      raise CheckpointMismatch(
          f"checkpoint step {step} does not fit the model: it holds {len(saved)} arrays, the "
          f"config's state {len(wanted)} (or other shapes). Use another workdir or the saved "
          "config.")
    state = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract)))["state"]
  return saved_config, saved_task, state


def _closed_loop_callback(report) -> bool:
  """Whether an unraisable report is a finished read handed to an event loop already closed."""
  frames, tb = set(), report.exc_traceback
  while tb is not None:
    frames.add(tb.tb_frame.f_code.co_name)
    tb = tb.tb_next
  return (report.object is None and isinstance(report.exc_value, RuntimeError)
          and str(report.exc_value) == "Event loop is closed"
          and "call_soon_threadsafe" in frames)


class _ReadLeftovers:
  """Keeps what the abandoned reads of a failed restore report off stderr; nothing else.

  A restore that fails closes orbax's event loop with the reads of the other arrays still
  pending. Each ends later, at times mdjax does not choose (on TensorStore's threads before
  the failure has even reached mdjax, when collected, at interpreter exit), and reports:
  a finished read finds the loop closed ('Event loop is closed'); a pending read coroutine,
  closed when collected, turns the GeneratorExit into an Exception that prints the array's
  whole TensorStore spec; a failed read nobody awaited any more logs 'Future exception was
  never retrieved'. Hundreds to thousands of lines about a step mdjax reports in one.

  The first two reach `sys.unraisablehook` and the last asyncio's logger; both are
  filtered here. A report naming a step folder is dropped when a read of that folder failed
  or is in flight (it then fails); 'Event loop is closed' names none: it is held while a
  read is in flight (its outcome decides) and dropped once any read has failed. Every
  other report goes on as before.
  """

  def __init__(self):
    self.lock = threading.RLock()  # a collection inside can report to the hook
    self.reading = []  # step folders being read
    self.failed = set()  # step folders whose read failed: leftovers may come at any time
    self.held = []  # (next hook, report) of closed-loop reports while reads were in flight
    self.orbax_dir = os.path.dirname(ocp.__file__) + os.sep

  def _names_read_folder(self, text: str) -> bool:
    return any(folder in text for folder in (*self.reading, *self.failed))

  def _abandoned_coroutine(self, report) -> bool:
    """An orbax read coroutine closed while pending, naming a folder read or failed."""
    code = getattr(report.object, "cr_code", None)
    return (code is not None and code.co_filename.startswith(self.orbax_dir)
            and isinstance(getattr(report.exc_value, "__context__", None), GeneratorExit)
            and self._names_read_folder(str(report.exc_value)))

  def filter(self, record) -> bool:
    """asyncio's logger: False for a never-retrieved failure of a read of a failing step."""
    error = record.exc_info[1] if record.exc_info else None
    if error is None or not record.getMessage().split("\n", 1)[0].endswith(
        "exception was never retrieved"):
      return True
    with self.lock:
      return not self._names_read_folder(str(error))

  def install(self) -> None:
    """Puts the filters in place (once; the unraisable one again if it was replaced)."""
    asyncio_logger = asyncio.log.logger
    if self not in asyncio_logger.filters:
      asyncio_logger.addFilter(self)
    previous = sys.unraisablehook
    if getattr(previous, "_mdjax_read_leftovers", None) is self:
      return
    closed_loop_callback = _closed_loop_callback  # module globals may be gone at exit

    def hook(report):
      with self.lock:
        if self._abandoned_coroutine(report):
          return
        if closed_loop_callback(report):
          if self.failed:
            return
          if self.reading:
            self.held.append((previous, report))
            return
      previous(report)

    hook._mdjax_read_leftovers = self
    sys.unraisablehook = hook

  @contextlib.contextmanager
  def read(self, folder: str):
    """A read of a step folder; if the block raises, the read failed."""
    folder = os.path.join(folder, "")  # '/.../checkpoints/30/' does not name step 300
    self.install()
    with self.lock:
      self.reading.append(folder)
    failed = True
    try:
      yield
      failed = False
    finally:
      with self.lock:
        self.reading.remove(folder)
        if failed:
          self.failed.add(folder)
        release = [] if self.failed or self.reading else self.held
        if self.failed or not self.reading:
          self.held = []
      for previous, report in release:  # not from a failed read of mdjax: shown as usual
        previous(report)


_read_leftovers = _ReadLeftovers()


def _set_aside(manager: ocp.CheckpointManager, step: int) -> str:
  """Moves an unreadable step to workdir/checkpoints_corrupt/<step>-<time>; returns the path."""
  checkpoints = os.fspath(manager.directory)
  aside = os.path.join(os.path.dirname(checkpoints), CORRUPT_DIR)
  os.makedirs(aside, exist_ok=True)
  target = os.path.join(aside, f"{step}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
  os.rename(os.path.join(checkpoints, str(step)), target)
  with quiet_orbax():
    manager.reload()
  return target


def _step_dirs(manager: ocp.CheckpointManager) -> list[int]:
  """Every finished step folder, listed by orbax or not (an emptied folder is not listed)."""
  checkpoints = os.fspath(manager.directory)
  on_disk = {int(n) for n in os.listdir(checkpoints) if n.isdigit()} if os.path.isdir(
      checkpoints) else set()
  return sorted(on_disk | set(manager.all_steps()), reverse=True)


def _newest_readable(manager, abstract_for, log, move_aside: bool, steps=None):
  """(step, config, task metadata, state) of the newest readable step, or None.

  Unreadable steps are reported in one line each and, with `move_aside`, moved to
  workdir/checkpoints_corrupt (kept for inspection, out of the manager's way).
  """
  for step in (_step_dirs(manager) if steps is None else steps):
    try:
      return (step, *_read_step(manager, step, abstract_for))
    except CheckpointMismatch:
      raise
    except Exception as error:  # truncated, deleted or empty: the step cannot be read
      if move_aside:
        where = f"moved to {_set_aside(manager, step)}"
      else:
        where = "left in place"
      log(f"checkpoint step {step} is unreadable ({_summary(error)}); {where}; "
          "using the previous one.")
  return None


def restore_latest(manager: ocp.CheckpointManager, abstract_state: TrainState, config,
                   task: tasks.Task, log=print, move_aside: bool = True) -> TrainState | None:
  """The newest readable checkpoint (unreadable newer ones moved aside), or None."""

  def abstract_for(step, saved_config, saved_task):
    _check_model_matches(saved_config, config, step)
    if saved_task and saved_task != task.checkpoint_metadata():
      raise CheckpointMismatch(
          f"checkpoint step {step} was trained with another tokenizer: saved {saved_task}, "
          f"now {task.checkpoint_metadata()}. Use another workdir or the saved corpus.")
    return abstract_state

  found = _newest_readable(manager, abstract_for, log, move_aside)
  return None if found is None else found[-1]


@dataclasses.dataclass(frozen=True)
class Model:
  """A trained denoiser loaded from a workdir (`mdjax.load`).

  `apply_fn(params, tokens_BxL, t_B) -> logits_BxLxV` is the denoiser contract; `params`
  are the EMA parameters when the run kept them. `task` is rebuilt from the saved config and
  tokenizer (no corpus file needed: a text task without its corpus samples and decodes, but
  has no training data). `tokenizer` is the task's (None for synthetic tasks).
  """

  config: ml_collections.ConfigDict
  apply_fn: Callable
  params: Any
  task: tasks.Task
  step: int
  workdir: str

  @property
  def tokenizer(self):
    return self.task.tokenizer


def _warn(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def load(workdir: str, step: int | None = None, log: Callable[[str], None] = _warn) -> Model:
  """The trained model of a workdir: its newest readable checkpoint, or `step`.

  Reads only (a read-only workdir is fine); an unreadable newest checkpoint is reported in
  one line through `log` and the previous one is used. Orbax's own warnings are silenced.
  """
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise ValueError(f"workdir={workdir!r} holds no checkpoint.")
  manager = checkpoint_manager(workdir, read_only=True)
  saved_steps = _step_dirs(manager)
  if not saved_steps:
    raise ValueError(f"workdir={workdir!r} holds no checkpoint.")
  if step is not None and step not in saved_steps:
    raise ValueError(f"step={step} is not saved in {workdir!r}; saved steps: "
                     f"{sorted(saved_steps)}.")
  built = {}

  def abstract_for(step, saved_config, saved_task):
    config = ml_collections.ConfigDict(saved_config)
    # The saved tokenizer decides the ids, whatever the corpus files hold today.
    config.task_kwargs.update(saved_task)
    task = tasks.from_config(config)
    state, _, apply_fn, _ = init_state(config, make_mesh(1), task)
    built.update(config=config, task=task, apply_fn=apply_fn)
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, state)

  found = _newest_readable(manager, abstract_for, log, move_aside=False,
                           steps=None if step is None else [step])
  if found is None:
    raise ValueError(f"workdir={workdir!r}: no readable checkpoint"
                     + (f" at step {step}." if step is not None else "."))
  step, _, _, state = found
  params = state.ema_params if state.ema_params is not None else state.params
  return Model(config=built["config"], apply_fn=built["apply_fn"], params=params,
               task=built["task"], step=step, workdir=workdir)


def load_for_sampling(workdir: str, step: int | None = None):
  """(config, apply_fn, params, step) of a trained workdir: `mdjax.load` as a tuple."""
  model = load(workdir, step)
  return model.config, model.apply_fn, model.params, model.step


# ----------------------------------------------------------------------------
# The loop.
# ----------------------------------------------------------------------------


class _Progress:
  """A one-line progress report with rate and ETA."""

  def __init__(self, total: int, start_step: int):
    self.total, self.start_step, self.t0 = total, start_step, time.perf_counter()

  def line(self, step: int, loss: float) -> str:
    done = step - self.start_step
    rate = done / max(time.perf_counter() - self.t0, 1e-9)
    eta = (self.total - step) / max(rate, 1e-9)
    width = 24
    filled = int(width * step / self.total)
    return (f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{self.total} "
            f"loss {loss:.4f} | {rate:.1f} steps/s | ETA {eta:.0f}s")


class _Throughput:
  """Training tokens per second between logged rows: the wall time from one step's metrics
  to the next, checkpoints, evaluations and the first (compiling) step left out."""

  def __init__(self, tokens_per_step: int):
    self.tokens_per_step = tokens_per_step
    self.last, self.steps, self.seconds = None, 0, 0.0

  def step_done(self) -> None:
    now = time.perf_counter()
    if self.last is not None:
      self.steps += 1
      self.seconds += now - self.last
    self.last = now

  def restart(self) -> None:
    """After work that is not training: the next step is timed from now."""
    self.last = time.perf_counter()

  def take(self) -> float | None:
    """Tokens/s since the previous call (None when no step was timed)."""
    if not self.steps:
      return None
    rate = self.steps * self.tokens_per_step / max(self.seconds, 1e-9)
    self.steps, self.seconds = 0, 0.0
    return rate


def eval_batch(config, i: int, task: tasks.Task) -> np.ndarray:
  """Held-out batch i: the task's validation text, or fresh draws of a synthetic law."""
  key = jax.random.fold_in(jax.random.key(config.seed), streams.RowStream.EVAL_DATA + i)
  return task.validation_data(key, config.batch_size)


class TrainClock:
  """Wall seconds spent training a workdir, summed over resumed runs (train_seconds.json).

  Written next to each checkpoint, so the figure covers the steps the checkpoints hold;
  time after the last checkpoint of a crashed run is not counted.
  """

  def __init__(self, workdir: str, step: int):
    self.path = os.path.join(workdir, "train_seconds.json")
    self.previous = 0.0
    if step and os.path.exists(self.path):
      with open(self.path) as f:
        self.previous = float(json.load(f)["seconds"])
    self.start = time.perf_counter()

  def save(self, step: int) -> None:
    seconds = self.previous + time.perf_counter() - self.start
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      json.dump({"seconds": round(seconds, 1), "step": step}, f)
    os.replace(tmp, self.path)  # atomic: never a half-written file


def read_train_seconds(workdir: str) -> float | None:
  """The training wall time recorded in a workdir (None when it has no record)."""
  path = os.path.join(workdir, "train_seconds.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return float(json.load(f)["seconds"])


def evaluate(config, task: tasks.Task, params, loss_fn_eval) -> dict:
  """Held-out loss in bits per token (the NELBO, or the causal NLL) over `eval_batches` batches."""
  values = []
  for i in range(config.eval_batches):
    x = eval_batch(config, i, task)
    key = jax.random.fold_in(jax.random.key(config.seed + 1), i)
    values.append(float(loss_fn_eval(params, key, x)))
  return {"eval_bits_per_token": float(np.mean(values))}


def sample_and_score(config, task: tasks.Task, apply_fn, params) -> dict:
  spec = sampling.make_spec(config.sampler.family, length=task.length,
                            **{k: v for k, v in config.sampler.to_dict().items() if k != "family"})
  out = sampling.sample(apply_fn, params, jax.random.key(config.seed + 2),
                        task.empty_canvas(config.num_eval_samples), spec, mask_id=task.mask_id)
  return {f"sample_{k}": v for k, v in task.sample_metrics(np.asarray(out.tokens_BxL)).items()}


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
    ("checkpoint.every", _integer(1)), ("checkpoint.keep", _integer(1)),
    ("block_nelbo.t_min", _number(lambda v: 0 <= v < 1, "in [0, 1)")),
    ("block_nelbo.t_max", _number(lambda v: 0 < v <= 1, "in (0, 1]")),
)
OBJECTIVES = ("nelbo", "mlm", "causal")


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
    refuse("objective", config.objective, f"must be one of {OBJECTIVES}")
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
  block_size = _field(config, "model.block_size")
  if block_size is not _ABSENT and block_size is not None:
    if not _integer(1)[0](block_size):
      refuse("model.block_size", block_size, "must be None or an integer >= 1 (dividing the "
             "sequence length)")
    if config.objective != "nelbo":
      refuse("model.block_size", block_size, f"needs objective='nelbo' (the block NELBO), not "
             f"{config.objective!r}")
    if config.model.get("time_conditioning") or config.model.get("causal"):
      refuse("model.block_size", block_size, "needs model.time_conditioning=False and "
             "model.causal=False")
  t_min, t_max = _field(config, "block_nelbo.t_min"), _field(config, "block_nelbo.t_max")
  if t_min is not _ABSENT and t_max is not _ABSENT and not t_min < t_max:
    refuse("block_nelbo.t_min", t_min, f"must be below block_nelbo.t_max={t_max}")
  antithetic = _field(config, "block_nelbo.antithetic")
  if antithetic is not _ABSENT and not isinstance(antithetic, bool):
    refuse("block_nelbo.antithetic", antithetic, "must be True or False")
  tensorboard = _field(config, "log_tensorboard")
  if tensorboard is not _ABSENT and not isinstance(tensorboard, bool):
    refuse("log_tensorboard", tensorboard, "must be True or False")
  if tensorboard is True:
    try:
      import tensorboardX  # noqa: F401
    except ImportError:
      refuse("log_tensorboard", tensorboard,
             "needs the tensorboardX package (pip install 'mdjax[tensorboard]')")


class WorkdirBusy(RuntimeError):
  """Another process trains in this workdir."""


class WorkdirLock:
  """An exclusive lock on a workdir (fcntl.flock on workdir/train.lock, holding the pid).

  The kernel drops the lock when its process dies, so a lock left by a dead process is
  simply taken over; a live holder makes a second run stop at once.
  """

  def __init__(self, workdir: str, log=print):
    self.path, self.log, self.fd = os.path.join(workdir, "train.lock"), log, None

  def __enter__(self):
    import fcntl
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    previous = os.read(fd, 200).decode(errors="replace").split()
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      os.close(fd)
      holder = f"pid {previous[0]}" if previous else "another process"
      raise WorkdirBusy(
          f"workdir={os.path.dirname(self.path)!r} is in use by {holder} (lock "
          f"{self.path}); wait for it to finish, or stop it (SIGTERM saves a checkpoint)."
      ) from None
    if previous:
      self.log(f"taking over the workdir lock of pid {previous[0]} (no longer running)")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {os.uname().nodename}\n".encode(), 0)
    self.fd = fd
    return self

  def __exit__(self, *exc):
    os.ftruncate(self.fd, 0)  # the file stays: removing it would race with a new holder
    os.close(self.fd)


class Interrupts:
  """SIGTERM and SIGINT (Ctrl-C) set `signal_name`; the loop saves and stops at a step's end.

  A second signal restores the previous handlers and is handled by them (a second Ctrl-C
  stops at once). Handlers are only installed from the main thread.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.signal_name, self.previous = None, {}

  def _handle(self, signum, frame):
    del frame
    self.signal_name = signal.Signals(signum).name
    self._restore()

  def _restore(self):
    for signum, handler in self.previous.items():
      signal.signal(signum, handler)
    self.previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    return self

  def __exit__(self, *exc):
    self._restore()


def _keep_metrics_through(path: str, step: int) -> None:
  """Drops metrics rows past `step` (written after the checkpoint a run resumes from)."""
  if not os.path.exists(path):
    return
  kept = []
  with open(path) as f:
    for line in f:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:  # a row cut short by a kill
        continue
      if row.get("step", 0) <= step:
        kept.append(line if line.endswith("\n") else line + "\n")
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.writelines(kept)
  os.replace(tmp, path)


class MetricsLog:
  """metrics.jsonl, one row per line, flushed as written; TensorBoard too when asked."""

  def __init__(self, workdir: str, tensorboard: bool):
    self.file = open(os.path.join(workdir, "metrics.jsonl"), "a")
    self.writer = None
    if tensorboard:
      from tensorboardX import SummaryWriter
      self.writer = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, row: dict) -> None:
    self.file.write(json.dumps(row) + "\n")
    self.file.flush()
    if self.writer is not None:
      for name, value in row.items():
        if name != "step" and isinstance(value, (int, float)):
          self.writer.add_scalar(name, value, row["step"])
      self.writer.flush()

  def close(self) -> None:
    self.file.close()
    if self.writer is not None:
      self.writer.close()


def _writable(path: str) -> bool:
  """Whether files can be created in `path` (tried: permission bits are not the whole story)."""
  try:
    fd, name = tempfile.mkstemp(dir=path, prefix=".write-test-")
  except OSError:
    return False
  os.close(fd)
  os.remove(name)
  return True


def _finished_read_only(config, workdir: str, log) -> TrainState:
  """A read-only workdir: its finished state, or a PermissionError before anything is built."""
  num_steps = config.train.num_steps
  steps = []
  if os.path.isdir(os.path.join(workdir, "checkpoints")):
    steps = _step_dirs(checkpoint_manager(workdir, read_only=True))
  if num_steps not in steps:
    raise PermissionError(
        f"workdir={workdir!r} is not writable; training to step {num_steps} needs to write "
        f"checkpoints there (saved steps: {sorted(steps)}). Sampling and evaluation only read "
        "it; train in a writable copy.")
  mesh = make_mesh(config.get("num_devices") or None)
  task = tasks.from_config(config)
  state, *_ = init_state(config, mesh, task)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  manager = checkpoint_manager(workdir, read_only=True)
  found = _newest_readable(manager, lambda *_: abstract, log, move_aside=False,
                           steps=[num_steps])
  if found is None:
    raise PermissionError(f"workdir={workdir!r} is not writable and its step {num_steps} is "
                          "unreadable.")
  return found[-1]


def train(config, workdir: str, log=print) -> TrainState:
  """Trains (or resumes) the configured job in `workdir`; returns the final state.

  Checks the config first (`check_config`), then locks the workdir (`WorkdirLock`). A
  workdir this call created is removed again when the run fails before writing anything.
  SIGTERM or Ctrl-C saves a checkpoint at the current step and returns (see `Interrupts`).
  A read-only workdir holding the finished run is only read.
  """
  check_config(config)
  if os.path.isdir(workdir) and not _writable(workdir):
    return _finished_read_only(config, workdir, log)
  created = not os.path.exists(workdir)
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as error:
    raise PermissionError(f"workdir={workdir!r} cannot be created: {error}") from error
  if jax.process_index() != 0:
    return _train(config, workdir, log, Interrupts())
  with WorkdirLock(workdir, log), Interrupts() as interrupts:
    try:
      return _train(config, workdir, log, interrupts)
    except BaseException:
      if created:  # removed under the lock: no other run can be using it
        _remove_if_untrained(workdir)
      raise


def _remove_if_untrained(workdir: str) -> None:
  """Removes a workdir that holds nothing but empty files and the lock (a run that failed
  before its first logged step), so the same command starts clean; any content keeps it."""
  lock = os.path.join(workdir, "train.lock")
  for root, _, files in os.walk(workdir):
    for name in files:
      path = os.path.join(root, name)
      if path != lock and os.path.getsize(path):
        return
  try:
    for root, dirs, files in os.walk(workdir, topdown=False):
      for name in files:
        os.remove(os.path.join(root, name))
      for name in dirs:
        os.rmdir(os.path.join(root, name))
    os.rmdir(workdir)
  except OSError:  # something else appeared in it: what is left stays
    pass


def _train(config, workdir: str, log, interrupts: Interrupts) -> TrainState:
  mesh = make_mesh(config.get("num_devices") or None)
  if config.batch_size % mesh.shape["data"]:
    raise ConfigError(f"config field batch_size={config.batch_size}: must be divisible by the "
                     f"{mesh.shape['data']} devices of the mesh.")
  task = tasks.from_config(config)
  state, graphdef, apply_fn, shardings = init_state(config, mesh, task)
  log(f"model: {models.count_params(state.params):,} parameters; devices: {mesh.shape['data']}")
  manager = checkpoint_manager(workdir, config)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  restored = restore_latest(manager, abstract, config, task, log)
  if restored is not None:
    state = jax.device_put(restored, shardings)
    log(f"resumed from step {int(state.step)}")
  saved_step = int(state.step) if restored is not None else None
  clock = TrainClock(workdir, int(state.step))
  loss_fn = make_loss_fn(config, apply_fn, task)
  optimizer = make_optimizer(config.train)
  step_fn = jax.jit(
      functools.partial(train_step, loss_fn=loss_fn, optimizer=optimizer,
                        ema_decay=config.train.ema_decay, seed=config.seed,
                        learning_rate=learning_rate_schedule(config.train)),
      in_shardings=(shardings, NamedSharding(mesh, PartitionSpec("data"))),
      out_shardings=(shardings, None), donate_argnums=0)
  eval_schedule = masking_schedule(config)
  if config.objective == "causal":
    eval_loss = jax.jit(lambda p, k, x: loss_fn(p, k, x)[1]["bits_per_token"])
  elif config.model.get("block_size") is not None:
    # The block NELBO over the full time range: a bound, whatever range training clips to.
    eval_loss = jax.jit(lambda p, k, x: diffusion.block_nelbo_loss(
        apply_fn, p, k, x, schedule=eval_schedule, mask_id=task.mask_id,
        block_size=config.model.block_size)[1]["bits_per_token"])
  else:
    eval_loss = jax.jit(lambda p, k, x: diffusion.nelbo_loss(
        apply_fn, p, k, x, schedule=eval_schedule, mask_id=task.mask_id)[1]["bits_per_token"])
  num_steps = config.train.num_steps
  progress = _Progress(num_steps, int(state.step))
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  # Rows past the restored step were written after its checkpoint: the resumed run
  # writes them again, so every step is logged exactly once.
  _keep_metrics_through(metrics_path, int(state.step))
  pending = None  # metrics of the previous step: fetched one step late (async dispatch)
  tty = sys.stdout.isatty()
  throughput = _Throughput(config.batch_size * task.length)
  curves = plot.Curves(workdir, log)

  def flush(step_metrics, step):
    host = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
    if not all(math.isfinite(v) for v in host.values()):
      raise FloatingPointError(
          f"non-finite loss at step {step}: {host}; stopping. The last good checkpoint is "
          f"kept in {workdir}/checkpoints.")
    return host

  def report(step_metrics, step):
    host = flush(step_metrics, step)
    throughput.step_done()
    if step % config.log_every == 0 or step == num_steps:
      row = {"step": step, **host}
      tokens_per_s = throughput.take()
      if tokens_per_s is not None:
        row["tokens_per_s"] = tokens_per_s
      metrics.write(row)
      line = progress.line(step, host["loss"])
      print("\r" + line if tty else line, end="" if tty else "\n", flush=True)

  metrics = MetricsLog(workdir, bool(config.get("log_tensorboard", False)))
  try:
    step = int(state.step)
    while step < num_steps and interrupts.signal_name is None:
      x = jax.device_put(batch_for_step(config, step, task),
                         NamedSharding(mesh, PartitionSpec("data")))
      state, step_metrics = step_fn(state, x)
      if pending is not None:
        report(*pending)
      step += 1
      pending = (step_metrics, step)
      save_now = step % config.checkpoint.every == 0 or step == num_steps
      eval_now = step == num_steps or bool(config.eval_every and step % config.eval_every == 0)
      if save_now or eval_now:
        # Never save a state whose loss was not finite; its row goes with the checkpoint.
        report(*pending)
        pending = None
      if save_now:
        save(manager, state, config, task)
        clock.save(step)
        saved_step = step
      if eval_now:
        params = state.ema_params if state.ema_params is not None else state.params
        record = {"step": step, **evaluate(config, task, params, eval_loss)}
        if config.objective != "causal" and config.num_eval_samples:
          record.update(sample_and_score(config, task, apply_fn, params))
        metrics.write(record)
        log(("\n" if tty else "") + "eval " + " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()))
      if save_now:
        curves.draw(last=step == num_steps)
      if save_now or eval_now:
        throughput.restart()
    if pending is not None:
      report(*pending)
    if interrupts.signal_name is not None:
      if saved_step != step:
        save(manager, state, config, task)
        clock.save(step)
      curves.draw(last=True)
      log(("\n" if tty else "") + f"{interrupts.signal_name}: checkpoint saved at step {step} "
          f"of {num_steps} in {workdir}/checkpoints; the same command resumes.")
  finally:
    metrics.close()
  return state


def ensure_trained(config, workdir: str):
  """Trains, resumes or reuses `config` in `workdir`: (apply_fn, params) of its final step."""
  train(config, workdir)
  _, apply_fn, params, step = load_for_sampling(workdir)
  if step != config.train.num_steps:
    raise RuntimeError(f"{workdir} holds step {step}, not the final {config.train.num_steps}.")
  return apply_fn, params
