"""Prepared workdirs: a symbolic link (or a FIFO) planted in a workdir is refused, never written
through, and files outside the workdir stay byte for byte as they were."""

import json
import os
import shutil
import stat
import subprocess
import sys
import time
import types

import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import grpo as grpo_config
from configs import two_color as two_color_config
import mdjax
from mdjax import models, train
from mdjax.train import sft, state_io
from mdjax.train.workdir import (MetricsLog, TrainClock, UnsafeWorkdir, WorkdirLock,
                                 check_entries, keep_metrics_through)
from tests import attacks
from tests.paths import REPO

LLADA = os.path.join(REPO, "tests", "fixtures", "pretrained", "llada")


@pytest.fixture
def outside(tmp_path):
  """What a planted link points at: a file and a folder outside the workdir (the folder holds
  digit-named folders, as checkpoints do, and a shard index, as an export does)."""
  root = tmp_path / "outside"
  for step in ("7", "12"):
    (root / "folder" / step).mkdir(parents=True)
    (root / "folder" / step / "data").write_bytes(b"not a checkpoint " + step.encode())
  (root / "folder" / "model.safetensors.index.json").write_text('{"weight_map": {}}')
  (root / "victim.txt").write_bytes(b"precious bytes\n")
  return root


def _snapshot(root) -> dict:
  """Every entry under `root`: a file's bytes, a link's target, 'folder' or 'fifo'."""
  found = {}
  for folder, dirs, files in os.walk(root):
    for name in dirs + files:
      path = os.path.join(folder, name)
      key = os.path.relpath(path, root)
      if os.path.islink(path):
        found[key] = ("link", os.readlink(path))
      elif os.path.isdir(path):
        found[key] = "folder"
      elif not os.path.isfile(path):
        found[key] = "fifo"
      else:
        with open(path, "rb") as f:
          found[key] = f.read()
  return found


def _plant(workdir, entry, target):
  path = os.path.join(workdir, entry)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  os.symlink(target, path)
  return path


def _refused(info, entry, problem="is a symbolic link"):
  message = str(info.value)
  assert f"{entry}' {problem}" in message and "\n" not in message, message


# ----------------------------------------------------------------------------
# The workdir's files: the lock, the metrics log, the train clock.
# ----------------------------------------------------------------------------


def test_lock_refuses_a_linked_train_lock(tmp_path, outside):
  before = _snapshot(outside)
  _plant(tmp_path / "run", "train.lock", outside / "victim.txt")
  with pytest.raises(UnsafeWorkdir) as info:
    with WorkdirLock(str(tmp_path / "run")):
      pass
  _refused(info, "train.lock")
  assert _snapshot(outside) == before


def test_metrics_rewrite_ignores_a_planted_temporary_name(tmp_path, outside):
  before = _snapshot(outside)
  run = tmp_path / "run"
  planted = _plant(run, "metrics.jsonl.tmp", outside / "victim.txt")
  (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (5, 10, 15)))
  keep_metrics_through(str(run / "metrics.jsonl"), 10)
  assert [json.loads(line)["step"] for line in open(run / "metrics.jsonl")] == [5, 10]
  assert _snapshot(outside) == before
  assert os.readlink(planted) == str(outside / "victim.txt")
  assert sorted(os.listdir(run)) == ["metrics.jsonl", "metrics.jsonl.tmp"]  # nothing left


def test_train_clock_ignores_a_planted_temporary_name(tmp_path, outside):
  before = _snapshot(outside)
  run = tmp_path / "run"
  _plant(run, "train_seconds.json.tmp", outside / "victim.txt")
  TrainClock(str(run), 0).save(5)
  path = run / "train_seconds.json"
  assert json.loads(path.read_text())["step"] == 5 and not path.is_symlink()
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o644  # readable as before, not mkstemp's 0o600
  assert _snapshot(outside) == before
  assert sorted(os.listdir(run)) == ["train_seconds.json", "train_seconds.json.tmp"]


WRITERS = {
    "metrics_log": ("metrics.jsonl", lambda run: MetricsLog(run, tensorboard=False)),
    "metrics_rewrite": ("metrics.jsonl",
                        lambda run: keep_metrics_through(os.path.join(run, "metrics.jsonl"), 5)),
    "clock_read": ("train_seconds.json", lambda run: TrainClock(run, 5)),
    "clock_save": ("train_seconds.json", lambda run: TrainClock(run, 0).save(5)),
}


@pytest.mark.parametrize("writer", WRITERS)
def test_linked_workdir_files_are_refused(tmp_path, outside, writer):
  entry, call = WRITERS[writer]
  before = _snapshot(outside)
  _plant(tmp_path / "run", entry, outside / "victim.txt")
  with pytest.raises(UnsafeWorkdir) as info:
    call(str(tmp_path / "run"))
  _refused(info, entry)
  assert _snapshot(outside) == before


FIFO_READERS = {
    "lock": ("train.lock", lambda run: WorkdirLock(run).__enter__()),
    "metrics_log": WRITERS["metrics_log"],
    "metrics_rewrite": WRITERS["metrics_rewrite"],
    "clock_read": WRITERS["clock_read"],
}


@pytest.mark.parametrize("reader", FIFO_READERS)
def test_a_fifo_in_the_workdir_is_refused_without_waiting(tmp_path, reader):
  entry, call = FIFO_READERS[reader]
  (tmp_path / "run").mkdir()
  os.mkfifo(tmp_path / "run" / entry)
  with attacks.deadline(), pytest.raises(UnsafeWorkdir) as info:
    call(str(tmp_path / "run"))
  _refused(info, entry, "is not a regular file")


# ----------------------------------------------------------------------------
# Checkpoints set aside; the SFT export.
# ----------------------------------------------------------------------------


def _unreadable(step, saved_config, saved_task):
  raise AssertionError("the planted folders hold no checkpoint")


@pytest.mark.parametrize("entry", ["checkpoints", "checkpoints/7", "checkpoints_corrupt"])
def test_unreadable_steps_are_not_moved_through_a_link(tmp_path, outside, entry):
  run = tmp_path / "run"
  if entry != "checkpoints":  # a real checkpoints/ holding an unreadable step 7
    (run / "checkpoints").mkdir(parents=True)
    if entry != "checkpoints/7":
      (run / "checkpoints" / "7").mkdir()
  _plant(run, entry, outside / "folder" / ("7" if entry == "checkpoints/7" else ""))
  before = _snapshot(outside)
  manager = state_io.checkpoint_manager(str(run), read_only=True)
  with pytest.raises(UnsafeWorkdir) as info:
    state_io.newest_readable(manager, _unreadable, log=lambda message: None,
                             move_aside=True)
  _refused(info, entry)
  assert _snapshot(outside) == before


def _published_state():
  from mdjax import io
  return types.SimpleNamespace(params=io.load(LLADA).params, ema_params=None, step=8)


@pytest.mark.parametrize("entry", ["pretrained.partial", "pretrained"])
def test_export_unlinks_a_linked_target_instead_of_writing_through_it(tmp_path, outside, entry):
  run = tmp_path / "run"
  planted = _plant(run, entry, outside / "folder")
  before = _snapshot(outside)
  config = ml_collections.ConfigDict({"train": {"init_from": "pretrained:" + LLADA}})
  out = sft.export(config, _published_state(), str(run), log=lambda message: None)
  assert out == os.path.join(run, sft.EXPORT_DIR)
  assert os.path.isdir(out) and not os.path.islink(out)
  assert os.path.isfile(os.path.join(out, "config.json"))
  assert not os.path.lexists(planted) or planted == out
  assert os.listdir(run) == [sft.EXPORT_DIR]
  assert _snapshot(outside) == before


# ----------------------------------------------------------------------------
# The start of a run: train() refuses before anything is built or written.
# ----------------------------------------------------------------------------


def _config():
  config = two_color_config.get_config()
  config.train.update(num_steps=5, warmup_steps=1)
  return config


# entry planted -> what it points at (under `outside`); None: a FIFO.
PLANTED = {
    "train.lock": "victim.txt", "metrics.jsonl": "victim.txt",
    "train_seconds.json": "victim.txt", "curves.png": "victim.txt",
    "checkpoints": "folder", "checkpoints_corrupt": "folder", "tensorboard": "folder",
    "pretrained": "folder", "pretrained.partial": "folder",
    "checkpoints/20": "folder/7", "checkpoints/20/state": "folder/7",
    "tensorboard/events.out.tfevents.1": "victim.txt",
    "fifo:train.lock": None, "fifo:checkpoints/20": None,
}


@pytest.mark.parametrize("planted", PLANTED)
def test_train_refuses_a_workdir_with_a_planted_entry(tmp_path, outside, monkeypatch, planted):
  run = tmp_path / "run"
  entry = planted.removeprefix("fifo:")
  os.makedirs(os.path.dirname(run / entry), exist_ok=True)
  if PLANTED[planted] is None:
    os.mkfifo(run / entry)
  else:
    _plant(run, entry, outside / PLANTED[planted])
  before, workdir_before = _snapshot(outside), _snapshot(run)

  def never(*args, **kwargs):
    raise AssertionError("built before the workdir was checked")

  monkeypatch.setattr(train.tasks, "from_config", never)
  monkeypatch.setattr(train.loop, "init_state", never)
  with attacks.deadline(), pytest.raises(UnsafeWorkdir) as info:
    train.train(_config(), str(run), log=lambda message: None)
  problem = "is a symbolic link" if PLANTED[planted] else "is "
  _refused(info, entry, problem)
  assert _snapshot(outside) == before
  assert _snapshot(run) == workdir_before, "refused before anything was written"


@pytest.mark.slow
def test_train_cli_reports_a_planted_link_in_one_line(tmp_path, outside):
  run = tmp_path / "run"
  _plant(run, "train.lock", outside / "victim.txt")
  before = _snapshot(outside)
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, "train.py"), "--config=configs/two_color.py",
       f"--workdir={run}"], capture_output=True, text=True, cwd=REPO, timeout=120,
      env=dict(os.environ, PYTHONPATH=REPO))
  assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
  assert proc.stderr.startswith(f"train.py: error: workdir entry '{run}/train.lock' is a "
                                "symbolic link"), proc.stderr
  assert _snapshot(outside) == before


def test_a_linked_workdir_with_its_own_entries_is_accepted(tmp_path):
  # Users link a workdir to scratch space: the link is the workdir, its entries are its own.
  real = tmp_path / "scratch" / "run"
  (real / "checkpoints" / "20" / "state").mkdir(parents=True)
  (real / "checkpoints" / "20" / "state" / "manifest.ocdbt").write_bytes(b"x")
  (real / "metrics.jsonl").write_text(json.dumps({"step": 5}) + "\n")
  os.symlink(real, tmp_path / "run")
  run = str(tmp_path / "run")
  check_entries(run, files=("train.lock", "metrics.jsonl"), folders=("pretrained",),
                walked=("checkpoints",))
  with WorkdirLock(run, log=lambda message: None):
    keep_metrics_through(os.path.join(run, "metrics.jsonl"), 5)
    TrainClock(run, 0).save(5)
  assert sorted(os.listdir(real)) == ["checkpoints", "metrics.jsonl", "train.lock",
                                      "train_seconds.json"]


# --- a tampered saved config -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_workdir(tmp_path_factory):
  """A two-color workdir trained for 5 steps (one block, d_model 32, d_ff 64)."""
  workdir = str(tmp_path_factory.mktemp("tiny") / "run")
  train.train(_config(), workdir, log=lambda *_: None)
  return workdir


def _tampered(tiny_workdir, tmp_path, init_from=None, **model):
  """A copy of the tiny workdir whose saved config (every step's) asks for `model` (and names
  the start point `init_from`)."""
  workdir = str(shutil.copytree(tiny_workdir, tmp_path / "tampered"))
  checkpoints = os.path.join(workdir, "checkpoints")
  for step in os.listdir(checkpoints):
    path = os.path.join(checkpoints, step, "config", "metadata")
    with open(path) as f:
      saved = json.load(f)
    saved["model"].update(model)
    if init_from is not None:
      saved["train"]["init_from"] = init_from
    with open(path, "w") as f:
      json.dump(saved, f)
  return workdir


# Before (issue 55): the model was built first and the arrays compared after; num_layers=10000
# took 83 s and 2.7 GB in the review, num_layers=2000 29 s and +650 MB here.
@pytest.mark.parametrize("field, value", [("num_layers", 10000), ("d_model", 4096),
                                          ("d_ff", 10**6)])
def test_tampered_config_is_refused_before_the_model_is_built(tiny_workdir, tmp_path,
                                                              monkeypatch, field, value):
  workdir = _tampered(tiny_workdir, tmp_path, **{field: value})

  def never(*args, **kwargs):
    raise AssertionError("the model was built")
  monkeypatch.setattr(state_io, "init_state", never)
  start = time.monotonic()
  with attacks.deadline(20):
    with pytest.raises(state_io.CheckpointMismatch) as error:
      mdjax.load(workdir)
  took = time.monotonic() - start
  saved = {"num_layers": 1, "d_model": 32, "d_ff": 64}[field]
  message = str(error.value)
  assert "\n" not in message
  assert (f"its config's model.{field}={value} does not fit its arrays "
          f"(model.{field}={saved}, from their shapes)") in message, message
  assert took < 10, took


def test_untampered_tiny_workdir_loads(tiny_workdir):
  model = mdjax.load(tiny_workdir)
  assert model.config.model.num_layers == 1 and model.step == 5


# --- a tampered start point (train.init_from=WORKDIR) --------------------------------------


def _run_from(start):
  """A two-color run from the workdir `start` (objective 'nelbo'), its sizes the start's."""
  config = _config()
  config.objective = "nelbo"
  config.model.update(d_model=None, num_layers=None, num_heads=None, d_ff=None)
  config.train.init_from = start
  return config


def _never_built(monkeypatch):
  def never(*args, **kwargs):
    raise AssertionError("a model was built")
  monkeypatch.setattr(models, "init", never)
  monkeypatch.setattr(state_io, "init_state", never)


# Before (issue 55): the run took the start's sizes from its config and built the model
# (num_layers=10000) before the start's arrays were read. A start point with a start point of
# its own ("chained") is checked too: the run takes its sizes from this config all the same.
@pytest.mark.parametrize("chained", [False, True])
def test_a_tampered_start_point_is_refused_before_the_model_is_built(
    tiny_workdir, tmp_path, monkeypatch, chained):
  start = _tampered(tiny_workdir, tmp_path, init_from=tiny_workdir if chained else None,
                    num_layers=10000)
  _never_built(monkeypatch)
  began = time.monotonic()
  with attacks.deadline(20):
    with pytest.raises(train.ConfigError) as error:
      train.train(_run_from(start), str(tmp_path / "run"), log=lambda *_: None)
  message = str(error.value)
  assert message == (
      f"config field train.init_from: start={start!r}: checkpoint step 5: its config's "
      "model.num_layers=10000 does not fit its arrays (model.num_layers=1, from their "
      "shapes); the model was not built. The config was edited after the save: restore it, "
      "or use another workdir."), message
  assert time.monotonic() - began < 10
  assert not os.path.exists(tmp_path / "run")


def test_a_tampered_start_point_of_an_rl_run_is_refused_as_its_config_resolves(
    tiny_workdir, tmp_path):
  from mdjax.rl import trainer  # registers the RL objectives
  start = _tampered(tiny_workdir, tmp_path, d_model=4096)
  config = grpo_config.get_config()
  config.task = "two_color"  # the start's
  config.rl.rewards = None  # the task's own exact check (grpo.py's is Sudoku's)
  config.train.init_from = start
  with pytest.raises(train.ConfigError, match=(
      rf"^config field train.init_from: start={start!r}: checkpoint step 5: its config's "
      r"model.d_model=4096 does not fit its arrays \(model.d_model=32, from their shapes\)")):
    trainer.resolve_config(config)


def _replace_state(workdir, tree=None):
  """Step 5's arrays removed, or replaced by `tree` (saved as orbax saves a state)."""
  folder = os.path.join(workdir, "checkpoints", "5", "state")
  shutil.rmtree(folder, ignore_errors=True)
  if tree is not None:
    ocp.Checkpointer(ocp.StandardCheckpointHandler()).save(folder,
                                                          args=ocp.args.StandardSave(tree))


def test_a_start_point_whose_sizes_cannot_be_checked_is_refused(tiny_workdir, tmp_path,
                                                                 monkeypatch):
  """A tampered config with no array metadata beside it, or with arrays not of mdjax's
  Transformer (a published layout): before, the run built num_layers=10000 from it."""
  _never_built(monkeypatch)
  start = _tampered(tiny_workdir, tmp_path, num_layers=10000)
  _replace_state(start)
  with pytest.raises(train.ConfigError, match=(
      rf"^config field train.init_from: start={start!r}: checkpoint step 5 holds no readable "
      r"array metadata; the model's sizes in its config cannot be checked")):
    train.train(_run_from(start), str(tmp_path / "run"), log=lambda *_: None)
  _replace_state(start, {"params": {"embed": np.zeros((4, 2), np.float32)}})
  with pytest.raises(train.ConfigError, match=(
      rf"^config field train.init_from: start={start!r}: checkpoint step 5 holds no mdjax "
      r"Transformer's arrays \(a run from a published folder keeps its layout\)")):
    train.train(_run_from(start), str(tmp_path / "run"), log=lambda *_: None)


def test_an_untampered_start_point_resolves_to_its_sizes(tiny_workdir):
  config = sft.resolve_config(_run_from(tiny_workdir))
  assert (config.model.num_layers, config.model.d_model, config.model.d_ff) == (1, 32, 64)
