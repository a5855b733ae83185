"""Tasks: synthetic ones with known joint laws (and exact denoisers), and character text.

Each task offers LENGTH, VOCAB_SIZE, MASK_ID, `sample_data`, `empty_canvas`, `decode`
and `sample_metrics`; the synthetic ones also `exact_denoiser` (the denoiser contract),
the text task `encode`, `validation_data` and `checkpoint_metadata` (its vocabulary).
"""

from mdjax.tasks import scan_and_add, text, two_color

TASKS = {"two_color": two_color, "scan_and_add": scan_and_add, "text": text}


def get(name: str, task_kwargs: dict | None = None):
  """A task by name, with its parameters bound (e.g. max_command_id=9 for ScanAndAdd).

  Without `task_kwargs` it is the task module itself; with them, an object offering the
  same names for those parameters.
  """
  if name not in TASKS:
    raise ValueError(f"task={name!r} is unknown: must be one of {sorted(TASKS)}.")
  task_kwargs = dict(task_kwargs or {})
  if not task_kwargs and hasattr(TASKS[name], "LENGTH"):
    return TASKS[name]
  if not hasattr(TASKS[name], "bind"):
    raise ValueError(f"task_kwargs={task_kwargs!r}: task {name!r} takes no parameters.")
  return TASKS[name].bind(**task_kwargs)


def kwargs_of(config) -> dict:
  """A training config's task parameters as a plain dict ({} when it has none)."""
  kwargs = config.get("task_kwargs")
  return dict(kwargs.to_dict() if hasattr(kwargs, "to_dict") else kwargs or {})


def from_config(config, metadata: dict | None = None):
  """The task a training config names (`config.task`, `config.task_kwargs`).

  `metadata` is what a checkpoint saved of the task (e.g. a text task's vocabulary).
  """
  return get(config.task, {**kwargs_of(config), **(metadata or {})})


__all__ = ["TASKS", "from_config", "get", "kwargs_of", "scan_and_add", "text", "two_color"]
