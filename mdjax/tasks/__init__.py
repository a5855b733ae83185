"""Tasks: synthetic ones with known joint laws (and exact denoisers), and character text.

Every task is a `Task` value (`mdjax.tasks.base`): its shape (`length`, `vocab_size`,
`mask_id`), `sample_data`, `validation_data`, `empty_canvas`, `decode`, `sample_metrics`,
and, where the task has them, `checks`, `exact_denoiser` (the synthetic tasks), `encode`,
`tokenizer` and `checkpoint_metadata()` (text: its vocabulary). Build one with `get` or
`from_config` and pass it down.
"""

import inspect
import os

from mdjax.tasks import (
  corpus,
  lists,
  permutation,
  scan_and_add,
  sft,
  sudoku4,
  text,
  two_color,
)
from mdjax.tasks.base import Task

TASKS = {"two_color": two_color, "scan_and_add": scan_and_add, "text": text, "corpus": corpus,
         "sft": sft, "permutation": permutation, "sudoku4": sudoku4,
         "list_copy": lists.copy_task, "list_replace": lists.replace_task,
         "list_shuffle": lists.shuffle_task}
# The parameters that name files or folders: saved absolute, compared once normalised.
PATH_KWARGS = {"text": ("text_path",), "corpus": ("data_dir",),
               "sft": ("path", "validation_path", "start")}


def get(name: str, task_kwargs: dict | None = None) -> Task:
  """The task `name` with its parameters bound (e.g. max_command_id=9 for ScanAndAdd)."""
  if name not in TASKS:
    raise ValueError(f"task={name!r} is unknown: must be one of {sorted(TASKS)}.")
  return TASKS[name].bind(**dict(task_kwargs or {}))


def check(name: str, task_kwargs: dict | None = None) -> None:
  """What `get` would refuse, found without building the task (no corpus is read): a
  ValueError naming the task or the parameter, its value and what is allowed."""
  if name not in TASKS:
    raise ValueError(f"task={name!r} is unknown: must be one of {sorted(TASKS)}.")
  module, kwargs = TASKS[name], dict(task_kwargs or {})
  if not hasattr(module, "check"):  # the synthetic tasks: binding them reads nothing
    module.bind(**kwargs)
    return
  params = inspect.signature(module.check).parameters
  for key in kwargs:
    if key not in params:
      raise ValueError(f"task_kwargs.{key}={kwargs[key]!r}: task {name!r} takes no such "
                       f"parameter; it takes {', '.join(params)}.")
  module.check(**kwargs)


def kwargs_of(config) -> dict:
  """A training config's task parameters as a plain dict, unset (None) ones left out."""
  kwargs = config.get("task_kwargs")
  kwargs = dict(kwargs.to_dict() if hasattr(kwargs, "to_dict") else kwargs or {})
  return {k: v for k, v in kwargs.items() if v is not None}  # None: the task's default


def resolve_paths(name: str, kwargs: dict) -> dict:
  """`kwargs` of task `name` with its file and folder parameters absolute and normalised (a
  start point's 'pretrained:' kept): the same files from any working directory."""
  resolved = dict(kwargs)
  for key in PATH_KWARGS.get(name, ()):
    value = resolved.get(key)
    if key == "start":
      resolved[key] = sft.resolve_start(value)
    elif isinstance(value, str) and value:
      resolved[key] = os.path.abspath(value)
  return resolved


def from_config(config, metadata: dict | None = None) -> Task:
  """The task a training config names (`config.task`, `config.task_kwargs`).

  `metadata` is what a checkpoint saved of the task (e.g. a text task's vocabulary).
  """
  return get(config.task, {**kwargs_of(config), **(metadata or {})})


__all__ = ["PATH_KWARGS", "TASKS", "Task", "check", "corpus", "from_config", "get", "kwargs_of",
           "lists", "permutation", "resolve_paths", "scan_and_add", "sft", "sudoku4", "text",
           "two_color"]
