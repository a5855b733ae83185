"""The input pipeline: each process's rows of the global batch of a step, on grain.

The training loop asks a *batch source* for the rows of step s:

  source = data.batch_source(config, task, process_index=p, process_count=P)
  rows = source.batch_for(step)      # [batch_size / P, L]: this process's rows

The global batch of step s is a function of (seed, s) only, whatever P: process p's rows
are rows [p b, (p+1) b) of it (b = batch_size / P), so the processes' rows concatenated in
process order are the batch one process would read.

A corpus task (`mdjax.tasks.corpus`) reads its prepared shards through grain:

  windows (a RandomAccessDataSource over the memmapped shards: packed windows of the token
  stream, or one document per window padded with EOS)
  -> MapDataset.shuffle(seed)      a permutation per epoch (grain folds in the epoch)
  -> .repeat()                     epochs without end: window k of the stream is row k
  -> .batch(b)[p::P]               process p's b rows of each step
  -> .to_iter_dataset(ReadOptions) `data.threads` threads read `data.prefetch` steps ahead

so row r of step s is window k = s * batch_size + r of the shuffled stream, and process p
reads only its rows. The grain iterator's state (`source.state()`, {'next_index': step})
is saved in every checkpoint (`mdjax.train.state_io`), one file per process; a resumed
run restores it, or, when the process count changed, starts the iterator at the step.
Other tasks draw their batch from (seed, step) (`batch_for_step`); their
source slices the process's rows of it and has no state.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import grain
import numpy as np

from mdjax import streams
from mdjax.data.shards import ON_CORRUPT, VERIFY, Split

# A `mdjax.tasks.Task`: the data rooms stand below the tasks (a corpus task reads its batches
# here), so the type is named, not imported.
Task = Any

LAYOUTS = ("packed", "padded")
# The grain shuffle's seed is drawn from (config.seed, this tag): not a key any jax stream uses.
SHUFFLE_TAG = 0x6772_6169  # 'grai'
DEFAULTS = dict(threads=4, prefetch=8, on_corrupt="stop", verify="checksum")


def data_options(config) -> dict:
  """`config.data` (threads, prefetch, on_corrupt, verify) over the defaults, checked."""
  data = config.get("data")
  options = dict(DEFAULTS, **(data.to_dict() if hasattr(data, "to_dict") else data or {}))
  unknown = sorted(set(options) - set(DEFAULTS))
  if unknown:
    raise ValueError(f"config field data.{unknown[0]}: unknown; data takes {sorted(DEFAULTS)}.")
  for name in ("threads", "prefetch"):
    value = options[name]
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
      raise ValueError(f"config field data.{name}={value!r}: must be an integer >= 0.")
  if options["on_corrupt"] not in ON_CORRUPT:
    raise ValueError(f"config field data.on_corrupt={options['on_corrupt']!r}: must be one of "
                     f"{ON_CORRUPT}.")
  if options["verify"] not in VERIFY:
    raise ValueError(f"config field data.verify={options['verify']!r}: must be one of {VERIFY}.")
  return options


def shuffle_seed(seed: int) -> int:
  """The grain shuffle seed of a config seed (32 bits, as grain takes)."""
  return int(np.random.SeedSequence([int(seed), SHUFFLE_TAG]).generate_state(1)[0])


class Windows(grain.sources.RandomAccessDataSource):
  """The training windows of a split: `packed` (window i is tokens [iL, (i+1)L) of the
  stream, documents joined by EOS; the last partial window is dropped) or `padded` (window
  i is document i, cut at L, EOS after it). Each is an int32 array [L]."""

  def __init__(self, split: Split, length: int, layout: str, eos_id: int):
    if layout not in LAYOUTS:
      raise ValueError(f"documents={layout!r} must be one of {LAYOUTS}.")
    self.split, self.length, self.layout, self.eos_id = split, length, layout, eos_id
    self._len = (split.num_tokens // length if layout == "packed" else split.num_documents)

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, i: int) -> np.ndarray:
    i = int(i) % self._len  # grain's repeat hands out indices past one epoch
    if self.layout == "packed":
      return self.split.tokens(i * self.length, (i + 1) * self.length)
    window = np.full((self.length,), self.eos_id, np.int32)
    document = self.split.document(i, self.length)
    window[:len(document)] = document
    return window

  def __repr__(self) -> str:
    return (f"Windows({self.split.name}, {self._len} x {self.length}, {self.layout})")


def check_processes(batch_size: int, process_index: int, process_count: int) -> int:
  """Rows per process; a ValueError when the batch does not split evenly."""
  if not (isinstance(process_count, int) and process_count >= 1
          and 0 <= process_index < process_count):
    raise ValueError(f"process_index={process_index!r}, process_count={process_count!r}: need "
                     "0 <= process_index < process_count.")
  if batch_size % process_count:
    raise ValueError(f"config field batch_size={batch_size}: must be divisible by the "
                     f"{process_count} processes (each reads an equal share of the batch).")
  return batch_size // process_count


class CorpusBatches:
  """A corpus task's batch source: grain over the train split's windows (module docstring)."""

  def __init__(self, windows: Windows, batch_size: int, seed: int, process_index: int = 0,
               process_count: int = 1, threads: int = 4, prefetch: int = 8):
    if len(windows) < 1:
      raise ValueError(f"the training split holds no window of {windows.length} tokens "
                       f"({windows.split.num_tokens} tokens, {windows.split.num_documents} "
                       "documents).")
    rows = check_processes(batch_size, process_index, process_count)
    self.windows, self.batch_size, self.rows = windows, batch_size, rows
    self.process_index, self.process_count = process_index, process_count
    self.seed = shuffle_seed(seed)
    self.dataset = (grain.MapDataset.source(windows).shuffle(seed=self.seed).repeat()
                    .batch(rows, drop_remainder=True)[process_index::process_count])
    read = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=prefetch)
    self.iterator = iter(self.dataset.to_iter_dataset(read))
    self._next = 0  # the step the iterator yields next

  def batch_for(self, step: int) -> np.ndarray:
    """This process's rows of step `step` ([rows, L] int32): the next prefetched batch when
    the loop asks in order, else the iterator moved to the step first."""
    if step != self._next:
      self.restore(step)
    rows = next(self.iterator)
    self._next = step + 1
    return rows

  def state(self) -> dict:
    """The grain iterator's state (its next step)."""
    return self.iterator.get_state()

  def restore(self, step: int, state: dict | None = None) -> None:
    """Puts the iterator at `step`: grain's saved `state` when it names that step, else
    rebuilt from the step (a changed process count, a checkpoint without data state)."""
    if state is None or state.get("next_index") != step:
      state = {"next_index": int(step)}
    self.iterator.set_state(state)
    self._next = int(state["next_index"])


def batch_for_step(config, step: int, task: Task) -> np.ndarray:
  """The training batch of a generated task's step: a pure function of (seed, step)."""
  import jax

  key = jax.random.fold_in(jax.random.key(config.seed), step)
  return task.sample_data(key, config.batch_size)


def eval_batch(config, i: int, task: Task, batch_size: int | None = None) -> np.ndarray:
  """Held-out batch i of a generated task: its validation text, or fresh draws of a
  synthetic law (a stream apart from training's)."""
  import jax

  key = jax.random.fold_in(jax.random.key(config.seed), streams.RowStream.EVAL_DATA + i)
  return task.validation_data(key, config.batch_size if batch_size is None else batch_size)


class GeneratedBatches:
  """The batch source of a generated task: `batch_fn(config, step, task)` (the whole batch,
  from (seed, step)), this process's rows of it. No state: the step is all there is."""

  iterator = None

  def __init__(self, config, task: Task, process_index: int = 0, process_count: int = 1,
               batch_fn: Callable | None = None):
    batch_fn = batch_for_step if batch_fn is None else batch_fn
    self.rows = check_processes(config.batch_size, process_index, process_count)
    self.config, self.task, self.batch_fn = config, task, batch_fn
    self.process_index, self.process_count = process_index, process_count

  def batch_for(self, step: int):
    batch = self.batch_fn(self.config, step, self.task)
    if self.process_count == 1:
      return batch
    return batch[self.process_index * self.rows:(self.process_index + 1) * self.rows]

  def state(self) -> None:
    return None

  def restore(self, step: int, state: Any = None) -> None:
    del step, state


def batch_source(config, task: Task, process_index: int = 0, process_count: int = 1,
                 batch_fn: Callable | None = None):
  """The batch source of a training run: `CorpusBatches` for a corpus task (options from
  `config.data`), else `GeneratedBatches` over `batch_fn` (default `batch_for_step`)."""
  if task.name == "corpus":
    options = data_options(config)
    split = task.corpus.open("train", verify=options["verify"],
                             on_corrupt=options["on_corrupt"])
    windows = Windows(split, task.length, task.params["documents"], task.eos_id)
    return CorpusBatches(windows, config.batch_size, config.seed, process_index, process_count,
                         options["threads"], options["prefetch"])
  return GeneratedBatches(config, task, process_index, process_count, batch_fn)


def validation_batches(config, task: Task, num_batches: int | None = None,
                       batch_size: int | None = None, process_index: int = 0,
                       process_count: int = 1) -> list[np.ndarray]:
  """Held-out batches ([batch_size / process_count, L] each, this process's rows), the same
  every call: a corpus's validation split (windows evenly spaced over it), or the task's
  held-out draws of `eval_batch` for other tasks. Defaults:
  `config.eval_batches` batches of `config.batch_size`."""
  num_batches = config.eval_batches if num_batches is None else num_batches
  batch_size = config.batch_size if batch_size is None else batch_size
  rows = check_processes(batch_size, process_index, process_count)
  total = num_batches * batch_size
  if task.name == "corpus":
    windows = task.validation_windows(total)
    batches = [windows[i * batch_size:(i + 1) * batch_size] for i in range(num_batches)]
  else:
    batches = [np.asarray(eval_batch(config, i, task, batch_size)) for i in range(num_batches)]
  return [b[process_index * rows:(process_index + 1) * rows] for b in batches]


class InputWait:
  """The time the loop blocks on the input pipeline: `with wait:` around each
  `batch_for`; `fraction()` is that time over the wall time since the previous call."""

  def __init__(self):
    self.waited, self.since, self._t = 0.0, time.perf_counter(), None

  def __enter__(self):
    self._t = time.perf_counter()
    return self

  def __exit__(self, *exc):
    self.waited += time.perf_counter() - self._t

  def fraction(self) -> float | None:
    """Waiting over wall time since the previous call (None before any step)."""
    now = time.perf_counter()
    wall, waited = now - self.since, self.waited
    self.since, self.waited = now, 0.0
    return waited / wall if wall > 0 else None

  def restart(self) -> None:
    """After work that is not training (checkpoints, evaluations): timed from now."""
    self.since, self.waited = time.perf_counter(), 0.0
