"""mdjax.train.start_point: the workdir-start check and the model-field merge the
distillation, CDLM and RL objectives share (their runs: tests/accelerators, tests/rl)."""

import ml_collections
import pytest

from mdjax.train import start_point, state_io
from mdjax.train.config_checks import ConfigError


def test_merged_model_takes_the_config_then_the_start_then_the_default():
  config_model = ml_collections.ConfigDict(dict(d_model=None, num_layers=2, dtype="bfloat16",
                                                block_size=8))
  start = dict(d_model=64, num_layers=2, dtype="float32", block_size=None, causal=False)
  merged = start_point.merged_model(config_model, start, {"mlp": "gelu"}, ("dtype", "block_size"),
                                    "W")
  assert merged == dict(d_model=64, num_layers=2, dtype="bfloat16", block_size=8, causal=False)
  # block_size set to other than the start's: refused unless it is free
  with pytest.raises(ConfigError, match=r"model.block_size=8 differs from the start point's "
                     r"None \(W\); leave it unset"):
    start_point.merged_model(config_model, start, {}, ("dtype",), "W")
  fresh = start_point.merged_model(ml_collections.ConfigDict(dict(mlp=None, d_model=32)), {},
                                   {"mlp": "gelu"}, (), None)
  assert fresh == dict(mlp="gelu", d_model=32)


def test_workdir_start_names_the_field_of_an_unreadable_or_other_task_start(monkeypatch):
  config = ml_collections.ConfigDict(dict(task="sudoku4"))
  monkeypatch.setattr(state_io, "start_config", lambda where: ({"task": "two_color"}, {}))
  with pytest.raises(ConfigError, match=r"task='sudoku4': the start point '/w' was trained on "
                     r"task 'two_color'"):
    start_point.workdir_start(config, "/w")

  def unreadable(where):
    raise ValueError(f"{where}: no checkpoint")
  monkeypatch.setattr(state_io, "start_config", unreadable)
  with pytest.raises(ConfigError, match=r"train.init_from: /w: no checkpoint"):
    start_point.workdir_start(config, "/w")
  monkeypatch.setattr(state_io, "start_config", lambda where: ({"task": "sudoku4"}, {}))
  assert start_point.workdir_start(config, "/w") == {"task": "sudoku4"}
