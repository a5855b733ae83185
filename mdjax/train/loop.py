"""The training loop: progress, evaluation, resuming, `train` and `ensure_trained`."""

from __future__ import annotations

import functools
import math
import os
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from mdjax import data, lora, models, plot, sampling, tasks
from mdjax.data.pipeline import batch_for_step
from mdjax.train import distributed, objectives
from mdjax.train.state_io import (CORRUPT_DIR, checkpoint_manager, load_for_sampling,
                                  newest_readable, restore_data, restore_latest, save, step_dirs)
from mdjax.train.config_checks import ConfigError, check_config
from mdjax.train.flops import model_flops_per_token, mfu, peak_flops_per_device
from mdjax.train.state import (TrainState, init_state, learning_rate_schedule,
                               make_loss_fn, make_mesh, make_optimizer, train_step)
from mdjax.train.workdir import (LOCK, METRICS, TENSORBOARD, TRAIN_SECONDS, Interrupts,
                                 MetricsLog, TrainClock, WorkdirLock, check_entries,
                                 keep_metrics_through, run_summary, writable)


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




def evaluate(config, task: tasks.Task, params, loss_fn_eval) -> dict:
  """Held-out loss in bits per token (the NELBO, or the causal NLL) over `eval_batches` batches
  (`data.validation_batches`: a corpus's validation split, else `eval_batch`'s draws):
  `val_bits_per_token`. With
  `train.grad_accum_steps` = k > 1 each batch is scored in k micro-batches (rows i, i + k,
  ..., noise from fold_in(key, i)), which hold no more in memory than a training pass."""
  values = []
  accum = config.train.get("grad_accum_steps", 1)
  for i, x in enumerate(data.validation_batches(config, task)):
    key = jax.random.fold_in(jax.random.key(config.seed + 1), i)
    if accum == 1:
      values.append(float(loss_fn_eval(params, key, x)))
    else:
      values.append(np.mean([float(loss_fn_eval(params, jax.random.fold_in(key, j), x[j::accum]))
                             for j in range(accum)]))
  value = float(np.mean(values))
  return {"val_bits_per_token": value}


def sample_and_score(config, task: tasks.Task, apply_fn, params) -> dict:
  """Sample metrics of `num_eval_samples` draws of `config.sampler`; under uniform or hybrid
  noise the sampler is told the run's process (`sampling.with_noise`)."""
  spec = sampling.make_spec(config.sampler.family, length=task.length,
                            **{k: v for k, v in config.sampler.to_dict().items() if k != "family"})
  if objectives.noise_name(config) != "absorbing":
    spec = sampling.with_noise(spec, objectives.noise_process(config, task.vocab_size))
  out = sampling.sample(apply_fn, params, jax.random.key(config.seed + 2),
                        task.empty_canvas(config.num_eval_samples), spec, mask_id=task.mask_id)
  return {f"sample_{k}": v for k, v in task.sample_metrics(np.asarray(out.tokens_BxL)).items()}



class _NoMetrics:
  """The metrics log of processes other than 0: process 0 writes every row."""

  def write(self, row: dict) -> None:
    del row

  def close(self) -> None:
    pass


def _finished_read_only(config, workdir: str, log) -> TrainState:
  """A read-only workdir: its finished state, or a PermissionError before anything is built."""
  num_steps = config.train.num_steps
  steps = []
  if os.path.isdir(os.path.join(workdir, "checkpoints")):
    steps = step_dirs(checkpoint_manager(workdir, read_only=True))
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
  found = newest_readable(manager, lambda *_: abstract, log, move_aside=False,
                           steps=[num_steps])
  if found is None:
    raise PermissionError(f"workdir={workdir!r} is not writable and its step {num_steps} is "
                          "unreadable.")
  return found[-1]


def train(config, workdir: str, log=print) -> TrainState:
  """Trains (or resumes) the configured job in `workdir`; returns the final state.

  Checks the config first (`check_config`), then the workdir's entries (`check_entries`: no
  symbolic link, nothing but files and folders), then locks it (`WorkdirLock`). A
  workdir this call created is removed again when the run fails before writing anything.
  SIGTERM or Ctrl-C saves a checkpoint at the current step and returns (see `Interrupts`).
  A read-only workdir holding the finished run is only read.
  """
  config = objectives.resolve_config(config)  # fine-tuning: model fields left to the start point
  check_config(config)
  if os.path.isdir(workdir) and not writable(workdir):
    return _finished_read_only(config, workdir, log)
  if os.path.isdir(workdir):  # before anything is written: no entry may lead out of it
    check_entries(workdir, files=(LOCK, METRICS, TRAIN_SECONDS, plot.CURVES),
                  folders=(CORRUPT_DIR, *objectives.workdir_folders()),
                  walked=("checkpoints", TENSORBOARD))
  created = not os.path.exists(workdir)
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as error:
    raise PermissionError(f"workdir={workdir!r} cannot be created: {error}") from error
  run = objectives.get(config.objective).run or _train  # an objective's own loop (RL)
  if jax.process_index() != 0:  # process 0 locks, logs and writes; the others compute
    with Interrupts() as interrupts:
      return run(config, workdir, lambda *args, **kwargs: None, interrupts)
  with WorkdirLock(workdir, log), Interrupts() as interrupts:
    try:
      return run(config, workdir, log, interrupts)
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


def compile_train_step(config, mesh, shardings, loss_fn):
  """The jitted train step: state sharded as `shardings`, the batch split on `data`."""
  return jax.jit(
      functools.partial(train_step, loss_fn=loss_fn, optimizer=make_optimizer(config.train),
                        ema_decay=config.train.ema_decay, seed=config.seed,
                        learning_rate=learning_rate_schedule(config.train),
                        grad_accum_steps=config.train.get("grad_accum_steps", 1)),
      in_shardings=(shardings, NamedSharding(mesh, PartitionSpec("data"))),
      out_shardings=(shardings, None), donate_argnums=0)


def make_eval_loss(config, apply_fn, task: tasks.Task, loss_fn):
  """(params, key, x) -> held-out bits per token of the objective's held-out loss (the NELBO,
  for block-causal models the block NELBO, over the full time range), or of `loss_fn`, the
  training loss (the causal NLL; SFT's response-only NELBO per response token)."""
  make_held_out = objectives.get(config.objective).held_out_loss_fn
  held_out = loss_fn if make_held_out is None else make_held_out(config, apply_fn, task)
  return jax.jit(lambda p, k, x: held_out(p, k, x)[1]["bits_per_token"])


def _finite_on_host(step_metrics, step: int, workdir: str) -> dict:
  """A step's metrics as floats; a non-finite one stops the run (its checkpoint unsaved)."""
  host = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
  if not all(math.isfinite(v) for v in host.values()):
    raise FloatingPointError(
        f"non-finite loss at step {step}: {host}; stopping. The last good checkpoint is "
        f"kept in {workdir}/checkpoints.")
  return host


def _evaluation(config, task: tasks.Task, apply_fn, state: TrainState, eval_loss) -> dict:
  """The held-out loss of the parameters sampling reads (the EMA, if kept) as
  `val_bits_per_token`, with an EMA that of the raw parameters too
  (`val_bits_per_token_raw`), and sample metrics when asked."""
  params = state.ema_params if state.ema_params is not None else state.params
  params = distributed.host_copy(params)  # several processes: each evaluates a whole copy
  record = evaluate(config, task, params, eval_loss)
  if state.ema_params is not None:
    raw = evaluate(config, task, distributed.host_copy(state.params), eval_loss)
    record["val_bits_per_token_raw"] = raw["val_bits_per_token"]
  if objectives.get(config.objective).samples and config.num_eval_samples:
    record.update(sample_and_score(config, task, apply_fn, params))
  return record


def _evaluation_work(config, state: TrainState) -> str:
  """What `_evaluation` computes, in words."""
  work = f"{config.eval_batches} held-out batch(es)"
  if state.ema_params is not None:
    work += " for the EMA and the raw weights each"
  if objectives.get(config.objective).samples and config.num_eval_samples:
    work += f", {config.num_eval_samples} samples by sampler {config.sampler.family!r}"
  return work


def _train(config, workdir: str, log, interrupts: Interrupts) -> TrainState:
  num_devices = config.get("num_devices") or None
  if num_devices and distributed.is_multiprocess() and num_devices != jax.device_count():
    raise ConfigError(f"config field num_devices={num_devices}: with {jax.process_count()} "
                      f"processes must be 0 (all {jax.device_count()} devices).")
  mesh = make_mesh(num_devices)
  split_error = distributed.check_batch_split(config.batch_size, mesh)
  if split_error:
    raise ConfigError(split_error)
  distributed.check_process_slice(config.batch_size, mesh)
  primary = jax.process_index() == 0
  task = tasks.from_config(config)
  # This process's rows of each step's batch (a corpus: grain over its shards).
  source = data.batch_source(config, task, process_index=jax.process_index(),
                             process_count=jax.process_count(), batch_fn=batch_for_step)
  state, graphdef, apply_fn, shardings = init_state(config, mesh, task)
  trained = ("" if not lora.is_adapted(state.params) else
             f" ({models.count_params(state.params['lora']):,} trained: LoRA adapters)")
  log(f"model: {models.count_params(state.params):,} parameters{trained}; devices: "
      f"{mesh.shape['data']}")
  manager = checkpoint_manager(workdir, config)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  distributed.barrier("mdjax:restore")  # every process lists the same steps
  restored = restore_latest(manager, abstract, config, task, log, move_aside=primary)
  if restored is not None:
    state = jax.device_put(restored, shardings)
    if int(state.step) >= config.train.num_steps:
      log(f"already finished: {workdir} holds step {int(state.step)} of "
          f"{config.train.num_steps} (a longer run: raise train.num_steps)")
    else:
      log(f"resumed from step {int(state.step)}")
    restore_data(manager, int(state.step), source, log)
  saved_step = int(state.step) if restored is not None else None
  clock = TrainClock(workdir, int(state.step))
  loss_fn = make_loss_fn(config, apply_fn, task)
  step_fn = compile_train_step(config, mesh, shardings, loss_fn)
  eval_loss = make_eval_loss(config, apply_fn, task, loss_fn)
  num_steps = config.train.num_steps
  progress = _Progress(num_steps, int(state.step))
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  # Rows past the restored step were written after its checkpoint: the resumed run
  # writes them again, so every step is logged exactly once.
  if primary:
    keep_metrics_through(metrics_path, int(state.step))
  pending = None  # metrics of the previous step: fetched one step late (async dispatch)
  tty = sys.stdout.isatty()
  throughput = _Throughput(config.batch_size * task.length)
  input_wait = data.InputWait()  # the time the loop blocks on source.batch_for
  peak_flops = peak_flops_per_device(config)  # None: no known peak, MFU logged as null
  log(f"model FLOPs per token: {model_flops_per_token(config, task):.4g}; peak FLOP/s per "
      f"device: {'unknown' if peak_flops is None else f'{peak_flops:.4g}'}")
  curves = plot.Curves(workdir, log, draws=jax.process_index() == 0)  # one host draws

  def report(step_metrics, step):
    host = _finite_on_host(step_metrics, step, workdir)
    if throughput.last is None:  # the first (compiling) step: both windows start here
      input_wait.restart()
    throughput.step_done()
    if step % config.log_every == 0 or step == num_steps:
      row = {"step": step, **host}
      tokens_per_s = throughput.take()
      if tokens_per_s is not None:
        row["tokens_per_s"] = tokens_per_s
        row["input_wait_fraction"] = input_wait.fraction()
        row["mfu"] = mfu(config, task, tokens_per_s, mesh.size, peak_flops)
      metrics.write(row)
      if primary:
        line = progress.line(step, host["loss"])
        print("\r" + line if tty else line, end="" if tty else "\n", flush=True)

  metrics = (MetricsLog(workdir, bool(config.get("log_tensorboard", False))) if primary
             else _NoMetrics())

  # All processes stop at the same step, whichever got the signal (one step later with
  # several processes: the flags are gathered while the next step runs).
  signalled = distributed.AnyProcess(mesh)

  def stopping() -> bool:
    return signalled(interrupts.signal_name is not None)

  try:
    step = start_step = int(state.step)
    while step < num_steps and not stopping():
      with input_wait:
        rows = source.batch_for(step)
      x = distributed.global_batch(rows, config.batch_size, mesh)
      state, step_metrics = step_fn(state, x)
      if pending is not None:
        report(*pending)
      step += 1
      pending = (step_metrics, step)
      save_now = step % config.checkpoint.every == 0 or step == num_steps
      periodic = bool(config.eval_every and step % config.eval_every == 0)
      at_end = step == num_steps and config.get("eval_at_end", True)  # older configs lack it
      eval_now = periodic or at_end
      if save_now or eval_now:
        # Never save a state whose loss was not finite; its row goes with the checkpoint.
        report(*pending)
        pending = None
      if save_now:
        # Every process: orbax writes each array once, grain each process's input state.
        save(manager, state, config, task, source)
        if primary:
          clock.save(step)
        saved_step = step
      if eval_now:
        if at_end:  # it may take minutes: say what runs and how to skip it
          log(("\n" if tty else "") + f"end-of-run evaluation: {_evaluation_work(config, state)}"
              " (--config.eval_at_end=False skips it)")
        record = {"step": step, **_evaluation(config, task, apply_fn, state, eval_loss)}
        metrics.write(record)
        log(("\n" if tty and not at_end else "") + "eval " + " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()))
      if save_now:
        curves.draw(last=step == num_steps)
      if save_now or eval_now:
        throughput.restart()
        input_wait.restart()
    if pending is not None:
      report(*pending)
    name = interrupts.signal_name or "a signal to another process"
    if step == start_step < num_steps:  # stopped before a step ran: nothing new to save
      log(f"{name} before the first step: stopped, nothing trained or saved; the same "
          "command " + ("resumes" if saved_step is not None else "starts again") + ".")
    elif step < num_steps:  # stopped by a signal (on any process)
      if saved_step != step:
        save(manager, state, config, task, source)
        if primary:
          clock.save(step)
      curves.draw(last=True)
      log(("\n" if tty else "") + f"{name}: checkpoint saved at step {step} "
          f"of {num_steps} in {workdir}/checkpoints; the same command resumes.")
    export = objectives.get(config.objective).export
    if step == num_steps and export is not None and jax.process_index() == 0:
      export(config, state, workdir, log)  # SFT from a published start: its layout, fine-tuned
  finally:
    metrics.close()
  if step == num_steps and primary:
    log(("\n" if tty else "") + run_summary(workdir, step, num_steps))
  return state


def ensure_trained(config, workdir: str):
  """Trains, resumes or reuses `config` in `workdir`: (apply_fn, params) of its final step."""
  train(config, workdir)
  _, apply_fn, params, step = load_for_sampling(workdir)
  if step != config.train.num_steps:
    raise RuntimeError(f"{workdir} holds step {step}, not the final {config.train.num_steps}.")
  return apply_fn, params
