"""Workdirs that move: a saved config names files by absolute paths, a corpus is matched by its
data's hash (not its path spelling), and a fine-tuned workdir whose start point is gone says
so in one line instead of reporting its checkpoints unreadable."""

import importlib
import os
import shutil

import pytest

from configs import corpus as corpus_config
from mdjax import plot, tasks, train
from mdjax.prepare_data import prepare
from mdjax.train import sft, state_io
from tests.paths import REPO
from experiments.tiny_text import write_paragraphs

FIXTURES = os.path.join(REPO, "tests", "fixtures")


def _quiet(*args, **kwargs):
  pass


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
  """A tiny char corpus, and another one of the same text and tokenizer cut in other shards."""
  tmp = tmp_path_factory.mktemp("portable")
  write_paragraphs(tmp / "words.txt")
  for name, shard_tokens in (("corpus", 200), ("other", 300)):
    prepare([str(tmp / "words.txt")], "char", str(tmp / name), validation_fraction=0.1,
            documents="paragraph", shard_tokens=shard_tokens)
  return tmp


def _config(data_dir, num_steps):
  c = corpus_config.get_config()
  c.task_kwargs.update(data_dir=str(data_dir), length=16)
  c.model.update(d_model=16, num_layers=1, num_heads=2, d_ff=32)
  c.batch_size = 4
  c.train.update(num_steps=num_steps, warmup_steps=1)
  c.checkpoint.update(every=1)
  c.eval_every, c.eval_batches, c.num_eval_samples, c.log_every = 0, 1, 0, 1
  c.data.update(threads=1, prefetch=1)
  return c


def _saved_config(workdir):
  manager = state_io.checkpoint_manager(workdir, read_only=True)
  with state_io.quiet_orbax():
    return state_io._read_json(manager, max(manager.all_steps()), "config")


@pytest.mark.slow
def test_a_corpus_run_resumes_under_any_spelling_of_its_corpus(corpora, tmp_path, monkeypatch):
  workdir = str(tmp_path / "run")
  monkeypatch.chdir(corpora)
  # Four runs, each drawing curves.png at its end (about 1 s a draw): the curves are
  # test_train's; here only what resumes counts.
  monkeypatch.setattr(plot.Curves, "draw", lambda self, last=False: None)
  assert int(train.train(_config("corpus", 2), workdir, log=_quiet).step) == 2
  # The saved config names the corpus by its absolute path, whatever the spelling given.
  saved = _saved_config(workdir)
  assert saved["task_kwargs"]["data_dir"] == str(corpora / "corpus")
  scratch = shutil.copytree(corpora / "corpus", tmp_path / "scratch" / "corpus")
  spellings = (str(corpora / "corpus") + "/",  # a trailing slash
               os.path.join("..", corpora.name, "corpus"),  # relative, another spelling
               str(scratch))  # a copy on local scratch: the same data, another folder
  for steps, data_dir in enumerate(spellings, start=3):
    lines = []
    state = train.train(_config(data_dir, steps), workdir, log=lines.append)
    assert int(state.step) == steps, (data_dir, lines)
    assert f"resumed from step {steps - 1}" in lines, (data_dir, lines)
  assert _saved_config(workdir)["task_kwargs"]["data_dir"] == str(scratch)
  # Another corpus (same tokenizer, other shards) is still refused, naming the field.
  with pytest.raises(train.CheckpointMismatch,
                     match=r"another shape or task.*task_kwargs\.data_dir.*inputs sha256"):
    train.train(_config(corpora / "other", 6), workdir, log=_quiet)
  assert not os.path.exists(os.path.join(workdir, train.CORRUPT_DIR))


def test_saved_paths_are_absolute_and_normalised(corpora, monkeypatch):
  monkeypatch.chdir(corpora)
  config = _config("./corpus/", 1)
  config.train.init_from = "pretrained:llada/../llada"
  saved = state_io.portable_config(config)
  assert saved["task_kwargs"]["data_dir"] == str(corpora / "corpus")
  assert saved["train"]["init_from"] == "pretrained:" + str(corpora / "llada")
  assert config.task_kwargs.data_dir == "./corpus/"  # the config itself is left as given
  assert tasks.resolve_paths("two_color", {"length": 4}) == {"length": 4}


def _sft_workdir(tmp_path, monkeypatch):
  """An SFT workdir (its initial state saved, no step compiled) started from a copy of the
  LLaDA fixture and a copy of its data, both named by relative paths; returns (workdir, the
  start's copy, the data's copy)."""
  monkeypatch.chdir(tmp_path)
  shutil.copytree(os.path.join(FIXTURES, "pretrained", "llada"), tmp_path / "llada")
  shutil.copy(os.path.join(FIXTURES, "sft", "chat.jsonl"), tmp_path / "chat.jsonl")
  config = importlib.import_module("configs.sft").get_config()
  config.train.init_from = "pretrained:llada"
  config.task_kwargs.update(path="chat.jsonl", length=80)
  config = sft.resolve_config(config)
  task = tasks.from_config(config)
  state, *_ = train.init_state(config, train.make_mesh(1), task)
  workdir = str(tmp_path / "sft")
  train.save(train.checkpoint_manager(workdir, config), state, config, task)
  return workdir, tmp_path / "llada", tmp_path / "chat.jsonl"


def test_an_sft_workdir_loads_from_another_folder_and_names_a_missing_start_point(
    tmp_path, monkeypatch):
  workdir, start, data = _sft_workdir(tmp_path, monkeypatch)
  saved = _saved_config(workdir)
  assert saved["train"]["init_from"] == saved["task_kwargs"]["start"] == f"pretrained:{start}"
  assert saved["task_kwargs"]["path"] == str(data)
  monkeypatch.chdir(REPO)  # another folder: the relative paths would name nothing here
  assert train.load(workdir).step == 0

  def refusal():
    lines = []
    with pytest.raises(ValueError) as raised:
      train.load(workdir, log=lines.append)
    message = str(raised.value)
    assert "\n" not in message and "unreadable" not in message and lines == [], message
    return message

  moved = shutil.move(data, tmp_path / "elsewhere.jsonl")  # the data is gone
  assert refusal().startswith(f"workdir={workdir!r}: data file task_kwargs.path='{data}' "
                              "not found; checkpoint step 0 is readable")
  shutil.move(moved, data)
  shutil.rmtree(start)  # the start point is gone: the checkpoint itself is fine
  assert refusal().startswith(f"workdir={workdir!r}: start point train.init_from="
                              f"'pretrained:{start}' not found (no config.json there); "
                              "checkpoint step 0 is readable")
  assert os.listdir(os.path.join(workdir, "checkpoints")) == ["0"]
  assert not os.path.exists(os.path.join(workdir, train.CORRUPT_DIR))


def test_an_sft_run_resumes_from_copies_of_its_start_point_and_data(tmp_path, monkeypatch):
  """The start point and examples are matched by content (`Task.inputs_sha256`), not by the
  paths that name them: copies elsewhere resume, other examples are refused."""
  workdir, start, data = _sft_workdir(tmp_path, monkeypatch)
  elsewhere = tmp_path / "scratch"
  shutil.copytree(start, elsewhere / "llada")
  shutil.copy(data, elsewhere / "chat.jsonl")

  def restore(start_dir, data_file):
    config = importlib.import_module("configs.sft").get_config()
    config.train.init_from = f"pretrained:{start_dir}"
    config.task_kwargs.update(path=str(data_file), length=80)
    config = sft.resolve_config(config)
    task = tasks.from_config(config)
    state, *_ = train.init_state(config, train.make_mesh(1), task)
    return state_io.restore_latest(train.checkpoint_manager(workdir, config), state, config,
                                   task, log=_quiet)

  assert int(restore(elsewhere / "llada", elsewhere / "chat.jsonl").step) == 0
  rows = (elsewhere / "chat.jsonl").read_text().splitlines()
  (elsewhere / "chat.jsonl").write_text("\n".join(rows[1:]) + "\n")  # other examples
  with pytest.raises(state_io.CheckpointMismatch,
                     match=r"task_kwargs\.path/start.*inputs sha256"):
    restore(elsewhere / "llada", elsewhere / "chat.jsonl")
  assert os.listdir(os.path.join(workdir, "checkpoints")) == ["0"]
