"""The workdir: one run at a time (train.lock), signals, the metrics log, the train clock."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time




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


def keep_metrics_through(path: str, step: int) -> None:
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
