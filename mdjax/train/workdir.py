"""The workdir: one run at a time (train.lock), signals, the metrics log, the train clock.

A run writes only to entries of its own workdir: a symbolic link planted there (train.lock
pointing at a file elsewhere, a linked checkpoints/) is refused, never written through.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import tempfile
import threading
import time

from mdjax import files as files_lib
from mdjax import jsonl

LOCK = "train.lock"
METRICS = "metrics.jsonl"
TRAIN_SECONDS = "train_seconds.json"
TENSORBOARD = "tensorboard"


class WorkdirBusy(RuntimeError):
  """Another process trains in this workdir."""


class UnsafeWorkdir(ValueError):
  """A workdir entry a run writes to is a symbolic link, or not a regular file or folder."""


def _refusal(path: str, problem: str) -> UnsafeWorkdir:
  return UnsafeWorkdir(
      f"workdir entry {path!r} {problem}; a run writes only to the workdir's own files and "
      "folders: remove it (or move what it points to into the workdir) and run again.")


def _link_refusal(path: str) -> UnsafeWorkdir:
  return _refusal(path, f"is {files_lib.link_problem(path)}")


def refuse_link(path: str) -> None:
  """Raises UnsafeWorkdir when `path` is a symbolic link (the workdir itself may be one)."""
  if os.path.islink(path):
    raise _link_refusal(path)


def check_entries(workdir: str, files=(), folders=(), walked=()) -> None:
  """Refuses a workdir whose named entries are symbolic links or of the wrong kind (`files`
  regular files, `folders` and `walked` folders), or where anything inside a `walked` folder
  is a link or neither file nor folder (orbax deletes old steps through a linked one)."""
  for names, is_kind, kind in ((files, stat.S_ISREG, "a regular file"),
                               ((*folders, *walked), stat.S_ISDIR, "a folder")):
    for name in names:
      path = os.path.join(workdir, name)
      try:
        mode = os.lstat(path).st_mode
      except FileNotFoundError:
        continue
      if stat.S_ISLNK(mode):
        raise _link_refusal(path)
      if not is_kind(mode):
        raise _refusal(path, f"is not {kind}")
  pending = [os.path.join(workdir, name) for name in walked]
  while pending:
    folder = pending.pop()
    if not os.path.isdir(folder):
      continue
    with os.scandir(folder) as entries:
      for entry in entries:
        if entry.is_symlink():
          raise _link_refusal(entry.path)
        if entry.is_dir(follow_symlinks=False):
          pending.append(entry.path)
        elif not entry.is_file(follow_symlinks=False):
          raise _refusal(entry.path, "is neither a regular file nor a folder")


def open_own_file(path: str, flags: int, mode: int = files_lib.NEW_FILE_MODE) -> int:
  """A descriptor of the regular file `path`, opened without following a symbolic link and
  without waiting on a FIFO; a link or another kind of file raises UnsafeWorkdir."""
  try:
    return files_lib.open_fd(path, flags, follow_links=False, mode=mode)
  except files_lib.UnsafeFile as error:
    raise _refusal(path, f"is {error.problem}") from None


def write_atomically(path: str, text: str) -> None:
  """Writes `text` to `path` through a fresh temporary file beside it, then a rename: never a
  half-written file, never a fixed temporary name (one could be a planted link)."""
  refuse_link(path)
  with files_lib.atomic_write(path, "w") as f:
    f.write(text)


class WorkdirLock:
  """An exclusive lock on a workdir (fcntl.flock on workdir/train.lock, holding the pid).

  The kernel drops the lock when its process dies, so a lock left by a dead process is
  simply taken over; a live holder makes a second run stop at once. A train.lock that is a
  symbolic link or a FIFO is refused (UnsafeWorkdir), never opened through.
  """

  def __init__(self, workdir: str, log=print):
    self.path, self.log, self.fd = os.path.join(workdir, LOCK), log, None

  def __enter__(self):
    import fcntl
    fd = open_own_file(self.path, os.O_RDWR | os.O_CREAT)
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


def keep_metrics_through(path: str, step: int) -> None:
  """Drops metrics rows past `step` (written after the checkpoint a run resumes from)."""
  try:
    fd = open_own_file(path, os.O_RDONLY)
  except FileNotFoundError:
    return
  kept = []
  with os.fdopen(fd) as f:
    # A line that is no row (cut short by a kill, nested too deep) or whose step is no number
    # is dropped with the rows past `step`.
    for row in jsonl.log_rows(f, path):
      row_step = row.get("step", 0)
      if isinstance(row_step, (int, float)) and row_step <= step:
        kept.append(jsonl.dumps(row) + "\n")  # strict (an older file's bare NaN: null)
  write_atomically(path, "".join(kept))


class MetricsLog:
  """metrics.jsonl, one row per line, flushed as written; TensorBoard too when asked."""

  def __init__(self, workdir: str, tensorboard: bool):
    fd = open_own_file(os.path.join(workdir, METRICS), os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                       0o666)
    self.file = os.fdopen(fd, "a")
    self.writer = None
    if tensorboard:
      from tensorboardX import SummaryWriter
      folder = os.path.join(workdir, TENSORBOARD)
      refuse_link(folder)
      self.writer = SummaryWriter(folder)

  def write(self, row: dict) -> None:
    self.file.write(jsonl.dumps(row) + "\n")
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


def writable(path: str) -> bool:
  """Whether files can be created in `path` (tried: permission bits are not the whole story)."""
  try:
    fd, name = tempfile.mkstemp(dir=path, prefix=".write-test-")
  except OSError:
    return False
  os.close(fd)
  os.remove(name)
  return True



class TrainClock:
  """Wall seconds spent training a workdir, summed over resumed runs (train_seconds.json).

  Written next to each checkpoint, so the figure covers the steps the checkpoints hold;
  time after the last checkpoint of a crashed run is not counted.
  """

  def __init__(self, workdir: str, step: int):
    self.path = os.path.join(workdir, TRAIN_SECONDS)
    self.previous = 0.0
    if step and os.path.lexists(self.path):
      with os.fdopen(open_own_file(self.path, os.O_RDONLY)) as f:
        self.previous = _seconds_of(f.read(), self.path)
    self.start = time.perf_counter()

  def save(self, step: int) -> None:
    seconds = self.previous + time.perf_counter() - self.start
    write_atomically(self.path, jsonl.dumps({"seconds": round(seconds, 1), "step": step}))


def run_summary(workdir: str, step: int, num_steps: int) -> str:
  """The end of a run in a few lines: validation (final and best, with their steps; the
  EMA's and the raw weights' when both are logged), wall time, the checkpoint and how to
  plot and sample."""
  rows = []
  path = os.path.join(workdir, METRICS)
  try:
    with os.fdopen(open_own_file(path, os.O_RDONLY)) as f:
      rows = list(jsonl.log_rows(f, path))  # a row cut short by a kill is skipped
  except FileNotFoundError:
    pass
  lines = [f"finished: step {step} of {num_steps}"]
  seconds = read_train_seconds(workdir)
  if seconds is not None:
    lines[0] += f" in {seconds:.1f} s of training"
  raw = any("val_bits_per_token_raw" in row for row in rows)
  for name, label in (("val_bits_per_token", "validation bits/token" + (" (EMA)" if raw else "")),
                      ("val_bits_per_token_raw", "validation bits/token (raw weights)")):
    scored = [(row[name], row["step"]) for row in rows
              if isinstance(row.get(name), (int, float)) and "step" in row]
    if scored:
      best = min(scored)
      lines.append(f"{label}: final {scored[-1][0]:.4g} at step {scored[-1][1]}, "
                   f"best {best[0]:.4g} at step {best[1]}")
  lines.append(f"checkpoint: {os.path.join(workdir, 'checkpoints', str(step))}")
  lines.append(f"curves: python -m mdjax.plot {workdir}; samples: python sample.py "
               f"--workdir={workdir}")
  return "\n".join(lines)


def read_train_seconds(workdir: str) -> float | None:
  """The training wall time recorded in a workdir (None when it has no record)."""
  path = os.path.join(workdir, TRAIN_SECONDS)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return _seconds_of(f.read(), path)


def _seconds_of(text: str, path: str) -> float:
  """The "seconds" of train_seconds.json's text; a ValueError naming `path` when it holds no
  such number (not JSON, nested too deep, another value)."""
  try:
    record = jsonl.loads(text, path)
  except json.JSONDecodeError as error:
    raise ValueError(f"{path}: not JSON ({error.msg}); it holds {{\"seconds\": number, "
                     "\"step\": number}.") from None
  seconds = record.get("seconds") if isinstance(record, dict) else None
  if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
    raise ValueError(f"{path}: no number \"seconds\" in it; it holds {{\"seconds\": number, "
                     "\"step\": number}.")
  return float(seconds)
