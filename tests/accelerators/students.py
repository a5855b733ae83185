"""The tiny distillation student the accelerator tests train (CDLM, dParallel, d3LLM)."""

import os
import shutil

import jax
import numpy as np

from configs import sudoku4_teacher
from mdjax import train


def tiny_student(module, num_prompts: int = 256, **changes):
  """A 1-layer student of the sudoku4 oracle from configs/distill_*.py `module`, fresh, 16
  rows a step, `num_prompts` teacher decodings; `changes` as flattened config fields."""
  config = module.get_config()
  config.distill.teacher = "sudoku4"
  config.model.update(d_model=32, num_layers=1, num_heads=2, d_ff=64)
  config.batch_size = 16
  config.distill.num_prompts = num_prompts
  config.eval_at_end = False
  with config.unlocked():
    config.update_from_flattened_dict(changes)
  return config


def tiny_start(path) -> str:
  """One NELBO step of the tiny student's model on sudoku4 in `path` (a start to fine-tune
  from); returns the path."""
  start = sudoku4_teacher.get_config()
  start.model.update(d_model=32, num_layers=1, num_heads=2, d_ff=64)
  start.update_from_flattened_dict({"train.num_steps": 1, "eval_at_end": False})
  train.train(start, str(path), log=lambda *a: None)
  return str(path)


def trained_and_resumed(config, workdir):
  """The final state of `config` trained in `workdir`, checked equal to the bit to the run
  resumed from its checkpoint before the last (params and optimizer state)."""
  whole = jax.device_get(train.train(config, str(workdir), log=lambda *a: None))
  shutil.rmtree(os.path.join(str(workdir), "checkpoints", str(config.train.num_steps)))
  resumed = jax.device_get(train.train(config, str(workdir), log=lambda *a: None))
  jax.tree.map(np.testing.assert_array_equal, resumed, whole)
  return whole
