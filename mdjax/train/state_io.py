"""The training state on disk (orbax checkpoints): atomic saves, the newest readable step, `load`
for sampling.

An unreadable checkpoint is moved aside (never deleted) and the next newest is read; what
orbax's abandoned reads report after a failed restore is kept off stderr. A saved config names
files by absolute paths, and the files a task was built from (a corpus; an SFT run's examples
and published start point) are matched by their hash, not their paths: a workdir and its
inputs may move."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
import warnings
from typing import Any, Callable

import grain
import jax
import ml_collections
import orbax.checkpoint as ocp
from absl import logging

from mdjax import lora
from mdjax import model as model_lib
from mdjax import saved_run, tasks
from mdjax.tasks import sft as sft_data
from mdjax.train import objectives
from mdjax.train.state import TrainState, init_state, make_mesh
from mdjax.train.workdir import refuse_link


# ----------------------------------------------------------------------------
# Checkpoints.
# ----------------------------------------------------------------------------


CORRUPT_DIR = "checkpoints_corrupt"  # unreadable checkpoints are moved here, never deleted


class CheckpointMismatch(ValueError):
  """A readable checkpoint of another model, task or tokenizer than the config asks for."""


class InputNotFound(ValueError):
  """A readable checkpoint whose config names a file or folder that is not there: a
  fine-tuning run's start point (`train.init_from`: the model's architecture and tokenizer)
  or its data file."""


# Not the checkpoint's fault: raised as they are, never reported unreadable or moved aside.
_READABLE_ERRORS = (CheckpointMismatch, InputNotFound)


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
  # "data": the grain iterator's state of a corpus run, one file per process (grain's handler).
  # "inputs": the hash of what the task was built from (`Task.inputs_sha256`), matched on resume.
  return {"state": ocp.StandardCheckpointHandler(), "config": ocp.JsonCheckpointHandler(),
          "task": ocp.JsonCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler(),
          "inputs": ocp.JsonCheckpointHandler()}


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


def portable_config(config) -> dict:
  """`config` as a dict with the paths it names (the task's files and folders,
  `train.init_from`) absolute and normalised: read from any folder, it names the same files."""
  saved = config.to_dict()
  if saved.get("task_kwargs"):
    saved["task_kwargs"] = tasks.resolve_paths(saved.get("task"), saved["task_kwargs"])
  if (saved.get("train") or {}).get("init_from"):
    saved["train"]["init_from"] = sft_data.resolve_start(saved["train"]["init_from"])
  return saved


def save(manager: ocp.CheckpointManager, state: TrainState, config, task: tasks.Task,
         source=None) -> None:
  """Saves state, config (`portable_config`), task metadata and a corpus's data hash, and the
  input pipeline's iterator state when `source` (a `mdjax.data` batch source) has one; orbax
  writes to a temporary dir, then renames."""
  step = int(state.step)
  items = dict(state=ocp.args.StandardSave(state),
               config=ocp.args.JsonSave(portable_config(config)),
               task=ocp.args.JsonSave(task.checkpoint_metadata()))
  if task.inputs_sha256 is not None:
    items["inputs"] = ocp.args.JsonSave({"sha256": task.inputs_sha256})
  if getattr(source, "iterator", None) is not None:
    items["data"] = grain.checkpoint.CheckpointSave(source.iterator)
  with quiet_orbax():
    manager.save(step, args=ocp.args.Composite(**items), force=True)
    manager.wait_until_finished()


def _as_dict(value) -> dict | None:
  return value.to_dict() if hasattr(value, "to_dict") else value


def _check_model_matches(saved: dict, config, step: int, saved_inputs: str | None = None,
                         inputs: str | None = None) -> None:
  """CheckpointMismatch unless the saved model and task are the config's. Paths are compared
  normalised; the files they name by the inputs' hashes (`saved_inputs`, `inputs`:
  `Task.inputs_sha256`) where both are known."""
  saved_model, model = saved.get("model", {}), config.model.to_dict()
  # remat changes how gradients are computed, not the parameters: a run may resume with
  # it switched (checkpoints written before the field existed do not hold it).
  diffs = {k: (saved_model.get(k), v) for k, v in model.items()
           if saved_model.get(k) != v and k != "remat"}
  saved_kwargs = tasks.resolve_paths(config.task, {
      k: v for k, v in (saved.get("task_kwargs") or {}).items() if v is not None})
  kwargs = tasks.resolve_paths(config.task, tasks.kwargs_of(config))
  if saved_inputs is not None and inputs is not None:  # the same inputs under any path
    names = tasks.PATH_KWARGS.get(config.task, ())
    saved_at = {k: saved_kwargs.pop(k) for k in names if k in saved_kwargs}
    at = {k: kwargs.pop(k) for k in names if k in kwargs}
    if saved_inputs != inputs:
      diffs["task_kwargs." + "/".join(sorted(at or saved_at))] = (
          f"{saved_at} (inputs sha256 {saved_inputs[:12]}...)",
          f"{at} (inputs sha256 {inputs[:12]}...)")
  # LoRA decides the parameters (adapters on the base, their scale): rank, alpha, targets;
  # the leaves lr_scales freezes, the optimizer state's structure (other scales may change).
  saved_train, train = saved.get("train") or {}, config.get("train") or {}
  saved_lora, wanted_lora = (lora.config_of(ml_collections.ConfigDict(saved)),
                             lora.config_of(config))
  saved_frozen = lora.lr_state_key(saved_train.get("lr_scales"))
  frozen = lora.lr_state_key(_as_dict(train.get("lr_scales")))
  if saved_frozen != frozen:
    diffs["train.lr_scales"] = (
        f"{saved_train.get('lr_scales') or {}} (frozen: {saved_frozen})",
        f"{_as_dict(train.get('lr_scales')) or {}} (frozen: {frozen})")
  for name, saved_value, value in (("task", saved.get("task"), config.task),
                                   ("task_kwargs", saved_kwargs, kwargs),
                                   ("train.lora", saved_lora, wanted_lora),
                                   ("noise", objectives.process_fields(saved),
                                    objectives.process_fields(config))):
    if saved_value != value:
      diffs[name] = (saved_value, value)
  if diffs:
    raise CheckpointMismatch(
        f"checkpoint step {step} holds a model of another shape or task: (saved, requested) = "
        f"{diffs}. Use another workdir or the saved config.")


def _saved_sizes(state_metadata) -> dict:
  """{config field: value} of the model's sizes as its saved arrays hold them, from orbax's
  metadata (shapes only, no array read): model.num_layers (blocks), model.d_model (the
  embedding's width), model.d_ff (the first block's mlp_out). {} for a layout not mdjax's
  Transformer."""
  params = state_metadata.get("params") if hasattr(state_metadata, "get") else None
  if isinstance(params, dict) and set(params) == {"base", "lora"}:  # a LoRA run's
    params = params["base"]
  if not (isinstance(params, dict) and isinstance(params.get("blocks"), dict)
          and isinstance(params.get("embed"), dict) and "embedding" in params["embed"]):
    return {}
  blocks = params["blocks"]
  sizes = {"num_layers": len(blocks),
           "d_model": tuple(params["embed"]["embedding"].shape)[-1]}
  first = blocks.get("0")
  mlp_out = first.get("mlp_out") if isinstance(first, dict) else None
  if isinstance(mlp_out, dict) and "kernel" in mlp_out:
    sizes["d_ff"] = tuple(mlp_out["kernel"].shape)[0]
  return sizes


def _check_config_fits_arrays(saved_config: dict, state_metadata, step: int,
                              start: str | None = None) -> None:
  """CheckpointMismatch where the step's saved config asks for a model of other sizes than
  the arrays it saved (a config edited by hand, or tampered with): checked on the arrays'
  metadata before any model is built, which for `num_layers=10000` took 83 s and 2.7 GB.
  A run with a start point (`train.init_from`) takes its model's sizes from there, unless
  the workdir is itself the start point `start`: a run takes its sizes from this config."""
  if start is None and (saved_config.get("train") or {}).get("init_from"):
    return
  sizes = _saved_sizes(state_metadata)
  where = "" if start is None else f"start={start!r}: "
  if start is not None and not sizes:  # the run builds an mdjax Transformer from this config
    raise CheckpointMismatch(
        f"{where}checkpoint step {step} holds no mdjax Transformer's arrays (a run from a "
        "published folder keeps its layout): start from a published folder instead, "
        "train.init_from='pretrained:DIR' (an SFT run's export is WORKDIR/pretrained).")
  model = saved_config.get("model") or {}
  for field, found in sizes.items():
    if field in model and model[field] != found:
      raise CheckpointMismatch(
          f"{where}checkpoint step {step}: its config's model.{field}={model[field]!r} does "
          f"not fit its arrays (model.{field}={found}, from their shapes); the model was not "
          "built. The config was edited after the save: restore it, or use another workdir.")


def start_config(workdir: str) -> tuple[dict, dict]:
  """(config, task metadata) of a start point's (`train.init_from`: a workdir) newest readable
  step, its config checked against that step's arrays first (orbax's metadata, no array
  read): a run builds its model from this config, so one edited after the save is a
  CheckpointMismatch naming the workdir, never a model of `num_layers=10000` built."""
  step, config, metadata = saved_run.newest_saved(workdir)
  try:
    with quiet_orbax():
      state = (checkpoint_manager(workdir, read_only=True).item_metadata(step) or {}).get("state")
  except Exception:  # a missing or unreadable state folder: no sizes to check against
    state = None
  if state is None:
    raise CheckpointMismatch(
        f"start={workdir!r}: checkpoint step {step} holds no readable array metadata; the "
        "model's sizes in its config cannot be checked: use another start point.")
  _check_config_fits_arrays(config, state, step, start=workdir)
  return config, metadata


def _summary(error: BaseException) -> str:
  """One line of an error: its type and the start of its first line (no TensorStore dump)."""
  lines = str(error).strip().splitlines()
  text = lines[0] if lines else ""
  return f"{type(error).__name__}: {text[:160]}{'...' if len(text) > 160 else ''}"


def _read_json(manager, step: int, name: str) -> dict:
  return manager.restore(step, args=ocp.args.Composite(**{name: ocp.args.JsonRestore()}))[name]


def _saved_inputs_sha256(manager, step: int) -> str | None:
  """The inputs' hash a step saved (None: a task without one, or written before it was)."""
  if "inputs" not in (manager.item_metadata(step) or {}):
    return None
  return _read_json(manager, step, "inputs").get("sha256")


def _read_step(manager, step: int, abstract_for: Callable[[int, dict, dict], Any]):
  """(config dict, task metadata, state) of a step; any unreadable part raises."""
  with quiet_orbax(), _read_leftovers.read(os.path.join(manager.directory, str(step))):
    saved_config = _read_json(manager, step, "config")
    items = manager.item_metadata(step) or {}
    saved_task = _read_json(manager, step, "task") if "task" in items else {}
    if items.get("state") is not None:  # before the model is built
      _check_config_fits_arrays(saved_config, items["state"], step)
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
    """A read of a step folder; if the block raises, the read failed. A mismatch is not a
    failed read: the folder was read whole, and no read was abandoned."""
    folder = os.path.join(folder, "")  # '/.../checkpoints/30/' does not name step 300
    self.install()
    with self.lock:
      self.reading.append(folder)
    failed = True
    try:
      yield
      failed = False
    except _READABLE_ERRORS:
      failed = False
      raise
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
  """Moves an unreadable step to workdir/checkpoints_corrupt/<step>-<time>; returns the path.
  Refuses (UnsafeWorkdir) where a folder involved is a symbolic link: the move would take a
  folder from outside the workdir, or put one there."""
  checkpoints = os.fspath(manager.directory)
  aside = os.path.join(os.path.dirname(checkpoints), CORRUPT_DIR)
  folder = os.path.join(checkpoints, str(step))
  for path in (checkpoints, folder, aside):
    refuse_link(path)
  os.makedirs(aside, exist_ok=True)
  target = os.path.join(aside, f"{step}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
  os.rename(folder, target)
  with quiet_orbax():
    manager.reload()
  return target


def step_dirs(manager: ocp.CheckpointManager) -> list[int]:
  """Every finished step folder, listed by orbax or not (an emptied folder is not listed)."""
  checkpoints = os.fspath(manager.directory)
  on_disk = {int(n) for n in os.listdir(checkpoints) if n.isdigit()} if os.path.isdir(
      checkpoints) else set()
  return sorted(on_disk | set(manager.all_steps()), reverse=True)


def newest_readable(manager, abstract_for, log, move_aside: bool, steps=None):
  """(step, config, task metadata, state) of the newest readable step, or None.

  Unreadable steps are reported in one line each and, with `move_aside`, moved to
  workdir/checkpoints_corrupt (kept for inspection, out of the manager's way).
  """
  for step in (step_dirs(manager) if steps is None else steps):
    try:
      return (step, *_read_step(manager, step, abstract_for))
    except _READABLE_ERRORS:
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
    _check_model_matches(saved_config, config, step, _saved_inputs_sha256(manager, step),
                         task.inputs_sha256)
    if saved_task and saved_task != task.checkpoint_metadata():
      raise CheckpointMismatch(
          f"checkpoint step {step} was trained with another tokenizer: saved {saved_task}, "
          f"now {task.checkpoint_metadata()}. Use another workdir or the saved corpus.")
    return abstract_state

  found = newest_readable(manager, abstract_for, log, move_aside)
  return None if found is None else found[-1]


def restore_data(manager: ocp.CheckpointManager, step: int, source, log=print) -> None:
  """Puts `source`'s iterator where checkpoint `step` left this process's: grain's saved
  state, or, where the checkpoint holds none for this process (another process count, a
  checkpoint written without it), the iterator started at `step` (a function of the step)."""
  if getattr(source, "iterator", None) is None:
    return
  folder = os.path.join(os.fspath(manager.directory), str(step), "data")
  state = None
  if os.path.isdir(folder):
    try:
      with quiet_orbax():
        manager.restore(step, args=ocp.args.Composite(
            data=grain.checkpoint.CheckpointRestore(source.iterator)))
      state = source.state()
    except ValueError as error:  # no file for this process index and count
      log(f"checkpoint step {step}: no input state for this process ({_summary(error)}); "
          "the input pipeline starts at the step.")
  source.restore(step, state)


def _warn(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def _check_inputs(workdir: str, step: int, config) -> None:
  """InputNotFound where a fine-tuned step's start point or data file is not where its config
  says: the model and task are rebuilt from them; the checkpoint itself is fine."""
  start = config.get("train", {}).get("init_from")
  if start:
    try:
      sft_data.split_start(start)
    except ValueError:
      wanted = "config.json" if start.startswith(sft_data.PRETRAINED_PREFIX) else "checkpoints/"
      raise InputNotFound(
          f"workdir={workdir!r}: start point train.init_from={start!r} not found (no {wanted} "
          f"there); checkpoint step {step} is readable, but its model is built on the start "
          "point (its architecture and tokenizer): put it back at that path.") from None
  if config.get("task") == "sft":
    for key in ("path", "validation_path"):
      path = config.task_kwargs.get(key)
      if path is not None and not os.path.isfile(path):
        raise InputNotFound(
            f"workdir={workdir!r}: data file task_kwargs.{key}={path!r} not found; checkpoint "
            f"step {step} is readable, but its task is rebuilt from that file: put it back at "
            "that path.")


def load(workdir: str, step: int | None = None, log: Callable[[str], None] = _warn) -> Model:
  """The trained model of a workdir (a `mdjax.Model`, family "mdjax", its `task` and
  `config` the saved ones, its default sampler `config.sampler`): its newest readable
  checkpoint, or `step`. A LoRA run's (`train.lora`) is its adapters merged into the base
  (`lora.merged`): plain params of the base layout, the base denoiser. A causal run's
  (objective 'causal') has no mask id (`Model.mask_id` refuses the diffusion samplers). A
  run under uniform or hybrid noise (`config.noise`) has its process as `Model.noise`
  (None: absorbing).

  Reads only (a read-only workdir is fine); an unreadable newest checkpoint is reported in
  one line through `log` and the previous one is used. Orbax's own warnings are silenced.
  """
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise ValueError(f"workdir={workdir!r} holds no checkpoint.")
  manager = checkpoint_manager(workdir, read_only=True)
  saved_steps = step_dirs(manager)
  if not saved_steps:
    raise ValueError(f"workdir={workdir!r} holds no checkpoint.")
  if step is not None and step not in saved_steps:
    raise ValueError(f"step={step} is not saved in {workdir!r}; saved steps: "
                     f"{sorted(saved_steps)}.")
  built = {}

  def abstract_for(step, saved_config, saved_task):
    config = ml_collections.ConfigDict(saved_config)
    _check_inputs(workdir, step, config)
    # The saved tokenizer decides the ids, whatever the corpus files hold today.
    config.task_kwargs.update(saved_task)
    task = tasks.from_config(config)
    state, _, apply_fn, _ = init_state(config, make_mesh(1), task)
    built.update(config=config, task=task, apply_fn=apply_fn)
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, state)

  found = newest_readable(manager, abstract_for, log, move_aside=False,
                           steps=None if step is None else [step])
  if found is None:
    raise ValueError(f"workdir={workdir!r}: no readable checkpoint"
                     + (f" at step {step}." if step is not None else "."))
  step, _, _, state = found
  params = state.ema_params if state.ema_params is not None else state.params
  config = built["config"]
  # A LoRA run's model is its adapters merged into the base: plain params of the base
  # layout and the base denoiser (what an export or another run's start point reads).
  params = lora.merged(config, params)
  apply_fn = lora.unadapted(built["apply_fn"])
  settings = {k: v for k, v in config.sampler.to_dict().items() if k != "family"}
  sampler = model_lib.ConfiguredSampler(config.sampler.family, tuple(sorted(settings.items())),
                                        eos_id=built["task"].eos_id)
  process = (None if objectives.noise_name(config) == "absorbing" else
             objectives.noise_process(config, built["task"].vocab_size))
  return model_lib.task_model(built["task"], apply_fn, params, sampler=sampler,
                              causal=config.get("objective") == "causal", config=config,
                              step=step, source=workdir, noise=process)


def load_for_sampling(workdir: str, step: int | None = None):
  """(config, apply_fn, params, step) of a trained workdir: `mdjax.load` as a tuple."""
  model = load(workdir, step)
  return model.config, model.denoiser, model.params, model.step


# ----------------------------------------------------------------------------
# The loop.
