"""A corpus run stopped mid-epoch and resumed sees the batches, and ends with the parameters,
of an uninterrupted run, bit for bit; the grain iterator state in its checkpoints."""

import json
import os
import signal

import jax
import numpy as np
import pytest

from configs import corpus as corpus_config
from mdjax import data, plot, tasks, train
from mdjax.prepare_data import prepare
from experiments.tiny_text import write_paragraphs

STOP_AT = 6  # the SIGTERM arrives while step 6's batch is read: the run saves at step 7


def _quiet(*args, **kwargs):
  pass


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """60 short paragraphs: 37 windows of 16 characters, an epoch of 9 steps of 4 rows."""
  tmp = tmp_path_factory.mktemp("resume")
  write_paragraphs(tmp / "words.txt")
  prepare([str(tmp / "words.txt")], "char", str(tmp / "corpus"), validation_fraction=0.1,
          documents="paragraph", shard_tokens=200)
  return tmp / "corpus"


def _config(data_dir):
  """configs/corpus.py cut to 12 steps of a 1-layer model (an epoch is 9 steps)."""
  c = corpus_config.get_config()
  c.task_kwargs.update(data_dir=str(data_dir), length=16)
  c.model.update(d_model=16, num_layers=1, num_heads=2, d_ff=32)
  c.batch_size = 4
  c.train.update(num_steps=12, warmup_steps=2)
  c.checkpoint.update(every=12)  # the stop's and the last
  c.eval_every, c.eval_batches, c.num_eval_samples, c.log_every = 0, 1, 0, 4
  c.data.update(threads=2, prefetch=3)
  return c


@pytest.mark.slow
def test_stopped_mid_epoch_and_resumed_matches_the_uninterrupted_run(data_dir, tmp_path,
                                                                     monkeypatch):
  config = _config(data_dir)
  task = tasks.from_config(config)
  windows = data.batch_source(config, task).windows
  assert len(windows) // config.batch_size == 9  # the run crosses an epoch after its stop
  seen = []  # (step, rows) in the order the loop read them
  read = data.CorpusBatches.batch_for
  stop = {"at": None}

  def recorded(self, step):
    rows = read(self, step)
    seen.append((step, rows.copy()))
    if step == stop["at"]:
      # The loop's handler is in place (else the signal would end the test process).
      assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
      os.kill(os.getpid(), signal.SIGTERM)  # what `kill` does; the loop ends the step, saves
    return rows
  monkeypatch.setattr(data.CorpusBatches, "batch_for", recorded)
  # Drawing curves.png (seconds of matplotlib) has nothing to do with the batches.
  monkeypatch.setattr(plot.Curves, "draw", lambda self, last=False: None)

  whole = train.train(config, str(tmp_path / "whole"), log=_quiet)
  uninterrupted, seen[:] = list(seen), []
  stop["at"] = STOP_AT
  stopped = tmp_path / "stopped"
  assert int(train.train(config, str(stopped), log=_quiet).step) == STOP_AT + 1
  saved = sorted(int(s) for s in os.listdir(stopped / "checkpoints") if s.isdigit())
  assert saved == [STOP_AT + 1]
  # The checkpoint holds this process's grain iterator state: the next step.
  state_file = stopped / "checkpoints" / str(STOP_AT + 1) / "data" / "process_0-of-1.json"
  assert json.loads(state_file.read_text()) == {"next_index": STOP_AT + 1}
  stop["at"] = None
  resumed = train.train(config, str(stopped), log=_quiet)
  assert [s for s, _ in uninterrupted] == list(range(12))
  assert [s for s, _ in seen] == list(range(12))
  for (_, a), (_, b) in zip(uninterrupted, seen):
    np.testing.assert_array_equal(a, b)
  assert int(resumed.step) == int(whole.step) == 12
  for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_input_state_restored_or_rebuilt_from_the_step(data_dir, tmp_path):
  config = _config(data_dir)
  task = tasks.from_config(config)
  manager = train.checkpoint_manager(str(tmp_path), config)
  state = train.init_state(config, train.make_mesh(1), task)[0].replace(step=np.int32(5))
  source = data.batch_source(config, task)
  for s in range(5):
    source.batch_for(s)
  train.save(manager, state, config, task, source)
  fresh, messages = data.batch_source(config, task), []
  train.state_io.restore_data(manager, 5, fresh, messages.append)
  assert fresh.state() == {"next_index": 5} and messages == []
  np.testing.assert_array_equal(fresh.batch_for(5), source.batch_for(5))
  # Written by two processes: this process count has no file; the step decides.
  folder = tmp_path / "checkpoints" / "5" / "data"
  os.rename(folder / "process_0-of-1.json", folder / "process_0-of-2.json")
  other = data.batch_source(config, task)
  train.state_io.restore_data(manager, 5, other, messages.append)
  assert other.state() == {"next_index": 5}
  assert "no input state for this process" in messages[0]
