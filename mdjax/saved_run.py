"""What a train.py workdir saved beside its arrays, read without the trainer.

Every checkpoint step holds the run's config and its task's metadata (e.g. a text task's
vocabulary) as JSON items. A fine-tuning task reads a workdir start point's tokenizer through
`saved_config` (the task must not import the trainer), and training reads the start point's
architecture through `newest_saved` (`mdjax.train.state_io.start_config`, which checks it
against that step's arrays first).
"""

from __future__ import annotations

import os

import orbax.checkpoint as ocp
from etils import epath

# The JSON items of a step (`mdjax.train.state_io.save`), one folder each.
CONFIG_ITEM, TASK_ITEM = "config", "task"


def _read_item(step_dir: str, name: str) -> dict:
  return ocp.JsonCheckpointHandler().restore(epath.Path(step_dir) / name)


def saved_config(workdir: str) -> tuple[dict, dict]:
  """(config, task metadata) of a workdir's newest readable checkpoint (`newest_saved`)."""
  _, config, metadata = newest_saved(workdir)
  return config, metadata


def newest_saved(workdir: str) -> tuple[int, dict, dict]:
  """(step, config, task metadata) of a workdir's newest readable checkpoint; no array is read.

  A step whose config does not read (truncated, emptied) is passed over for the one before;
  a ValueError names the workdir when none reads. A step saved without task metadata gives {}.
  """
  checkpoints = os.path.join(os.path.abspath(workdir), "checkpoints")
  steps = sorted((int(name) for name in os.listdir(checkpoints) if name.isdigit()),
                 reverse=True) if os.path.isdir(checkpoints) else []
  for step in steps:
    step_dir = os.path.join(checkpoints, str(step))
    try:
      config = _read_item(step_dir, CONFIG_ITEM)
      has_task = os.path.isdir(os.path.join(step_dir, TASK_ITEM))
      return step, config, (_read_item(step_dir, TASK_ITEM) if has_task else {})
    except Exception:  # an unreadable step: the previous one
      continue
  raise ValueError(f"start={workdir!r}: no readable checkpoint.")
