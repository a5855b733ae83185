"""Tests of training: learning, checkpoints, fault tolerance, sharding, bad input."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import two_color as two_color_config
from mdjax import tasks, train
from tests.paths import REPO



def _config(**train_overrides):
  config = two_color_config.get_config()
  config.train.update(**train_overrides)
  config.num_eval_samples = 500
  return config


def _quiet(*args, **kwargs):
  pass


@pytest.fixture(scope="module")
def two_color_run(tmp_path_factory):
  """The two-color job of configs/two_color.py (300 steps, checkpoints every 100), trained once."""
  workdir = tmp_path_factory.mktemp("two_color")
  train.train(_config(num_steps=300), str(workdir), log=_quiet)
  return workdir


def _copy(workdir, tmp_path):
  """A private copy of a trained workdir, for tests that damage or extend it."""
  return shutil.copytree(workdir, tmp_path / "run")


@pytest.mark.xdist_group("two_color_run")
@pytest.mark.slow
def test_two_color_learns_toward_the_entropy(two_color_run, tmp_path, sample_cli):
  records = [json.loads(line) for line in open(two_color_run / "metrics.jsonl")]
  final = [r for r in records if "val_bits_per_token" in r][-1]
  # Optimum: ln 2 nats per sequence = 0.5 bits per token; uniform: 1 bit.
  assert final["val_bits_per_token"] < 0.65, final
  assert final["sample_invalid_fraction"] < 0.05, final
  losses = [r["loss"] for r in records if "loss" in r]
  assert losses[-1] < losses[0]
  # sample.py reads the workdir, writes samples and metrics.
  out = tmp_path / "samples"
  run = lambda *flags: sample_cli(f"--workdir={two_color_run}", *flags)
  proc = run("--sampler=random_order", "--num_samples=300", "--batch_size=128", f"--out={out}")
  assert proc.returncode == 0, proc.stderr[-2000:]
  metrics = json.loads((out / "metrics.json").read_text())
  assert metrics["invalid_fraction"] < 0.05
  assert len((out / "samples.jsonl").read_text().splitlines()) == 300
  bad = run("--sampler=ancestral", "--steps=0")
  assert bad.returncode != 0 and "steps=0" in bad.stderr
  bad = run("--step=7")
  assert bad.returncode != 0 and "step=7 is not saved" in bad.stderr


@pytest.mark.xdist_group("two_color_run")
@pytest.mark.slow
def test_restore_into_another_shape_is_a_clear_error(two_color_run, tmp_path):
  other = _config(num_steps=400)
  other.model.d_model = 64
  with pytest.raises(ValueError, match=r"another shape.*d_model.*\(32, 64\)"):
    train.train(other, str(_copy(two_color_run, tmp_path)), log=_quiet)


@pytest.mark.slow
def test_restore_with_other_task_parameters_is_a_clear_error(tmp_path):
  from configs import scan_and_add_cpu
  config = scan_and_add_cpu.get_config()
  config.model.update(d_model=16, num_layers=1, num_heads=2, d_ff=32)
  # No samples at the final evaluation: only the checkpoint matters here.
  config.batch_size, config.eval_batches, config.num_eval_samples = 8, 1, 0
  config.train.update(num_steps=4, warmup_steps=1)
  train.train(config, str(tmp_path), log=_quiet)
  config.task_kwargs.max_command_id = 9
  config.train.num_steps = 8
  saved_and_requested = r"\(\{'max_command_id': 1\}, \{'max_command_id': 9\}\)"
  with pytest.raises(ValueError, match="task_kwargs.*" + saved_and_requested):
    train.train(config, str(tmp_path), log=_quiet)


@pytest.mark.xdist_group("two_color_run")
@pytest.mark.slow
def test_corrupt_newest_checkpoint_falls_back(two_color_run, tmp_path):
  config = _config(num_steps=300)
  workdir = _copy(two_color_run, tmp_path)
  newest = workdir / "checkpoints" / "300" / "state"
  for root, _, files in os.walk(newest):  # truncate every data file
    for name in files:
      open(os.path.join(root, name), "w").close()
  messages = []
  mesh = train.make_mesh(1)
  task = tasks.from_config(config)
  state, *_ = train.init_state(config, mesh, task)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  restored = train.restore_latest(train.checkpoint_manager(str(workdir), config), abstract,
                                  config, task, log=messages.append)
  assert int(restored.step) == 200
  assert any("step 300 is unreadable" in m for m in messages), messages


@pytest.mark.slow
def test_nan_loss_stops_with_a_clear_message_and_keeps_good_checkpoints(tmp_path):
  config = _config(num_steps=200, lr=1e38, warmup_steps=1, grad_clip=1e38)
  config.checkpoint.every = 1
  with pytest.raises(FloatingPointError, match="non-finite loss at step"):
    train.train(config, str(tmp_path), log=_quiet)
  steps = sorted(int(s) for s in os.listdir(tmp_path / "checkpoints") if s.isdigit())
  manager = train.checkpoint_manager(str(tmp_path), config)
  mesh = train.make_mesh(1)
  state, *_ = train.init_state(config, mesh, tasks.from_config(config))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  for step in steps:  # every kept checkpoint holds finite parameters
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract)))["state"]
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(restored.params))


def _final_params(workdir):
  _, _, params, step = train.load_for_sampling(str(workdir))
  return step, params


@pytest.mark.xdist_group("two_color_run")
@pytest.mark.slow
def test_sigkill_mid_run_then_restart_matches_uninterrupted(two_color_run, tmp_path):
  # The uninterrupted run is the module's job; the killed one is the same job in a real
  # train.py process, checkpointing every 50 steps (saving does not change the state).
  killed = tmp_path / "killed"
  command = [sys.executable, os.path.join(REPO, "train.py"), "--config",
             os.path.join(REPO, "configs", "two_color.py"), f"--workdir={killed}",
             "--config.train.num_steps=300", "--config.checkpoint.every=50",
             "--config.num_eval_samples=500"]
  proc = subprocess.Popen(command, env=dict(os.environ, PYTHONPATH=REPO),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 120
  while not (killed / "checkpoints" / "50").exists() and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  saved = [int(s) for s in os.listdir(killed / "checkpoints") if s.isdigit()]
  assert max(saved) < 300, "the run was killed before it finished"
  # The restart: what train.py runs, in this process.
  config = _config(num_steps=300)
  config.checkpoint.every = 50
  train.train(config, str(killed), log=_quiet)
  (step_a, params_a), (step_b, params_b) = _final_params(two_color_run), _final_params(killed)
  assert step_a == step_b == 300
  for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


_FOUR_DEVICES = """
import jax, json
from configs import two_color
from mdjax import tasks, train
out = {}
for name, n, fsdp in (("1", 1, False), ("4", 4, False), ("4fsdp", 4, True)):
  c = two_color.get_config()
  c.num_devices = n
  c.train.fsdp = fsdp
  c.train.num_steps = 5
  c.checkpoint.every = 1000
  c.eval_every = 0
  task = tasks.from_config(c)
  state, _, apply_fn, sh = train.init_state(c, train.make_mesh(n), task)
  loss_fn = train.make_loss_fn(c, apply_fn, task)
  opt = train.make_optimizer(c.train)
  step = jax.jit(lambda s, x: train.train_step(s, x, loss_fn=loss_fn, optimizer=opt,
                                               ema_decay=0.0, seed=c.seed))
  mesh = train.make_mesh(n)
  losses = []
  for i in range(5):
    x = jax.device_put(train.batch_for_step(c, i, task), jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("data")))
    state, m = step(state, x)
    losses.append(float(m["loss"]))
  out[name] = losses
print(json.dumps({"devices": jax.device_count(), "losses": out}))
"""


@pytest.mark.slow
def test_four_simulated_devices_match_one():
  # jax_num_cpu_devices rather than an XLA flag: the XLA flags are part of the compilation
  # cache's keys, and without one this process reuses what the tests compiled before it.
  env = dict(os.environ, PYTHONPATH=REPO, JAX_NUM_CPU_DEVICES="4")
  proc = subprocess.run([sys.executable, "-c", _FOUR_DEVICES], env=env, capture_output=True,
                        text=True, check=True, cwd=REPO)
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result["devices"] == 4
  np.testing.assert_allclose(result["losses"]["4"], result["losses"]["1"], rtol=1e-4)
  np.testing.assert_allclose(result["losses"]["4fsdp"], result["losses"]["1"], rtol=1e-4)


@pytest.mark.parametrize("name", sorted(
    f[:-3] for f in os.listdir(os.path.join(REPO, "configs"))
    if f.endswith(".py") and f not in ("__init__.py", "base.py", "corpus.py")
    and not f.startswith(("bench", "grpo", "distill"))))
@pytest.mark.slow
def test_every_config_builds_and_traces_a_train_step(name):  # (bench_*: sampling benchmarks)
  # corpus.py needs a prepared corpus: tests/data/test_prepare.py traces it on one. grpo*.py
  # run RL's own loop from a trained start: tests/rl/test_trainer.py runs and checks them;
  # distill_*.py take their model from a teacher: tests/accelerators/test_distill.py runs them.
  # Shapes only (jax.eval_shape): the model, optimizer, loss and a batch fit together.
  import importlib
  config = importlib.import_module(f"configs.{name}").get_config()
  mesh = train.make_mesh(1)
  task = tasks.from_config(config)
  built = {}

  def init():  # the apply_fn holds no arrays: it outlives the abstract evaluation
    state, _, built["apply_fn"], _ = train.init_state(config, mesh, task)
    return state

  # Abstract parameters: the published models are never initialised for real.
  state = jax.eval_shape(init)
  loss_fn = train.make_loss_fn(config, built["apply_fn"], task)
  x = train.batch_for_step(config, 0, task)
  assert x.shape == (config.batch_size, task.length)
  loss, _ = jax.eval_shape(loss_fn, state.params, jax.random.key(0), x)
  assert loss.shape == ()


# ----------------------------------------------------------------------------
# Recovery from an unreadable newest checkpoint (train.py and sample.py alike).
# ----------------------------------------------------------------------------


def _truncate_data(step_dir):
  for root, _, files in os.walk(step_dir / "state"):
    for name in files:
      if name not in ("_METADATA", "commit_success.txt", "_CHECKPOINT_METADATA"):
        open(os.path.join(root, name), "w").close()


def _delete_data(step_dir):
  for root, _, files in os.walk(step_dir / "state"):
    if os.path.basename(root) == "d":
      for name in files:
        os.remove(os.path.join(root, name))


def _empty(step_dir):
  shutil.rmtree(step_dir)
  step_dir.mkdir()


CORRUPTIONS = {
    "truncated_data": _truncate_data,
    "deleted_data": _delete_data,
    "deleted_state_metadata": lambda d: os.remove(d / "state" / "_METADATA"),
    "deleted_config_metadata": lambda d: os.remove(d / "config" / "metadata"),
    "empty_folder": _empty,
}


@pytest.mark.xdist_group("two_color_run")
@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
@pytest.mark.slow
def test_unreadable_newest_checkpoint_is_moved_aside(two_color_run, tmp_path, corruption,
                                                     sample_cli):
  import mdjax
  workdir = _copy(two_color_run, tmp_path)
  CORRUPTIONS[corruption](workdir / "checkpoints" / "300")
  # Sampling falls back to step 200 and leaves the workdir as it is.
  model = mdjax.load(str(workdir))
  assert model.step == 200
  proc = sample_cli(f"--workdir={workdir}", "--sampler=random_order", "--num_samples=4",
                    "--batch_size=4")
  assert proc.returncode == 0 and "step=200" in proc.stdout, proc.stderr[-2000:]
  warning = [line for line in proc.stderr.splitlines() if "step 300" in line]
  assert len(warning) == 1 and "unreadable" in warning[0], proc.stderr
  # Training moves it aside (kept, not deleted), resumes from 200 and finishes.
  messages = []
  train.train(_config(num_steps=300), str(workdir), log=messages.append)
  unreadable = [m for m in messages if "step 300 is unreadable" in m]
  assert len(unreadable) == 1 and "\n" not in unreadable[0] and len(unreadable[0]) < 400
  aside = os.listdir(workdir / "checkpoints_corrupt")
  assert len(aside) == 1 and aside[0].startswith("300-"), aside
  assert any("resumed from step 200" in m for m in messages), messages
  assert mdjax.load(str(workdir)).step == 300
  proc = sample_cli(f"--workdir={workdir}", "--sampler=random_order", "--num_samples=4",
                    "--batch_size=4")
  assert proc.returncode == 0 and "step=300" in proc.stdout, proc.stderr[-2000:]


# Entry points in one fresh process (what each runs after its flags): arguments are
# (entry point, workdir) pairs, each run after a marker line on stderr, then an unrelated
# unraisable error (which must still be printed) before exit.
_ENTRY_POINTS = """
import sys
from absl import flags, logging
from configs import two_color
import mdjax, sample
from mdjax import train

def load(workdir):
  mdjax.load(workdir)

def sample_py(workdir):
  flags.FLAGS(["sample.py", "--workdir=" + workdir, "--sampler=random_order",
               "--num_samples=4", "--batch_size=4"])
  sample.main([])

def train_py(workdir):
  logging.set_verbosity(logging.WARNING)  # as train.py's main
  config = two_color.get_config()
  config.train.num_steps = 200  # resumes at its end: the restore is what is tested here
  train.train(config, workdir)

class Unrelated:
  def __del__(self):
    raise ValueError("unrelated")

for entry, workdir in zip(sys.argv[1::2], sys.argv[2::2]):
  print("== " + workdir, file=sys.stderr, flush=True)
  globals()[entry](workdir)
print("== unrelated", file=sys.stderr, flush=True)
Unrelated()
"""

# The corruptions that fail a restore with reads of other arrays in flight, each in a
# process of its own (the first failure of a process races its leftovers); the others
# fail before any array is read and share one.
_READS_IN_FLIGHT = ("truncated_data", "deleted_data")
_PROCESSES = [[name] for name in _READS_IN_FLIGHT] + [
    sorted(set(CORRUPTIONS) - set(_READS_IN_FLIGHT))]


@pytest.mark.xdist_group("two_color_run")
@pytest.mark.parametrize("corruptions", _PROCESSES, ids="+".join)
@pytest.mark.slow
def test_unreadable_checkpoint_is_one_line_on_stderr(two_color_run, tmp_path, corruptions):
  # Orbax's reads abandoned by the failed restore report late (on other threads, when
  # collected, at exit): none of it may reach stderr, in any entry point. Each entry point
  # is first in some process: the first meets the process's first failure.
  entries = ["load", "sample_py", "train_py"]
  first = _PROCESSES.index(corruptions) % len(entries)
  entries = entries[first:] + entries[:first]
  args = []
  for corruption in corruptions:
    for entry in entries:
      workdir = shutil.copytree(two_color_run, tmp_path / f"{corruption}-{entry}")
      CORRUPTIONS[corruption](workdir / "checkpoints" / "300")
      args += [entry, str(workdir)]
  proc = subprocess.run([sys.executable, "-c", _ENTRY_POINTS, *args], cwd=REPO,
                        env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-3000:]
  sections = {}
  for line in proc.stderr.splitlines():
    if line.startswith("== "):
      sections[line[3:]] = lines = []
    else:
      lines.append(line)
  notice = "checkpoint step 300 is unreadable"
  for entry, workdir in zip(args[::2], args[1::2]):
    lines = sections[workdir]  # after the last, whatever exit printed too
    assert len(lines) <= 3, (workdir, proc.stderr[-3000:])
    if entry != "train_py":  # train.py reports on stdout, with its progress
      assert sum(notice in line for line in lines) == 1, (workdir, proc.stderr[-3000:])
  in_stdout = sum(notice in line for line in proc.stdout.splitlines())
  assert in_stdout == len(corruptions), proc.stdout[-3000:]
  assert any("ValueError: unrelated" in line for line in sections["unrelated"]), proc.stderr


@pytest.mark.xdist_group("two_color_run")
@pytest.mark.slow
def test_load_is_quiet_and_self_contained(two_color_run, capfd):
  import mdjax
  capfd.readouterr()
  model = mdjax.load(str(two_color_run))
  out, err = capfd.readouterr()
  assert out == "" and err == "", (out, err)
  assert model.step == 300 and model.tokenizer is None and model.task.name == "two_color"
  assert model.config.train.num_steps == 300
  tokens = model.task.empty_canvas(3)
  logits = model.denoiser(model.params, tokens, jax.numpy.ones(3))
  assert logits.shape == (3, model.task.length, model.task.vocab_size)
  assert mdjax.load(str(two_color_run), step=200).step == 200
  with pytest.raises(ValueError, match="step=7 is not saved"):
    mdjax.load(str(two_color_run), step=7)


def _warmup_cosine(step, lr=3e-3, warmup=20, num_steps=300, floor=0.1):
  """The learning rate of update `step` (from 0), written out: linear warmup, cosine decay."""
  if step < warmup:
    return lr * step / warmup
  done = min(step - warmup, num_steps - warmup) / (num_steps - warmup)
  return lr * floor + (lr - lr * floor) * 0.5 * (1 + math.cos(math.pi * done))


@pytest.mark.xdist_group("two_color_run")
@pytest.mark.slow
def test_curves_png_beside_metrics_and_redrawn(two_color_run, tmp_path, capsys):
  from matplotlib.image import imread

  from mdjax import plot
  # The run wrote curves.png at its last checkpoint, and no temporary file.
  png = two_color_run / "curves.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert [n for n in os.listdir(two_color_run) if n.endswith(".tmp")] == []
  rows = [r for r in map(json.loads, open(two_color_run / "metrics.jsonl")) if "loss" in r]
  assert [r["step"] for r in rows] == [50, 100, 150, 200, 250, 300]
  for r in rows:  # the rate of the row's update: optax counts updates from 0
    assert r["lr"] == pytest.approx(_warmup_cosine(r["step"] - 1), rel=1e-5), r
    assert r["tokens_per_s"] > 0, r
  # Redrawn from metrics.jsonl alone, into the workdir or --out.
  copy = tmp_path / "copy"
  copy.mkdir()
  shutil.copy(two_color_run / "metrics.jsonl", copy)
  plot.main([str(copy)])
  plot.main([str(copy), f"--out={tmp_path / 'other.png'}"])
  assert capsys.readouterr().out.splitlines() == [
      f"wrote {copy / 'curves.png'}", f"wrote {tmp_path / 'other.png'}"]
  image = imread(copy / "curves.png")
  assert image.shape[0] > 400 and image.shape[1] > 600 and image.std() > 0.05


def test_curves_errors_are_one_line_and_matplotlib_is_optional(tmp_path, monkeypatch, capsys):
  from mdjax import plot
  empty = tmp_path / "empty"
  empty.mkdir()
  blank = tmp_path / "blank"
  blank.mkdir()
  (blank / "metrics.jsonl").write_text("")
  for workdir, why in ((tmp_path / "missing", "is not a directory"),
                       (empty, "holds no metrics.jsonl"), (blank, "holds no rows yet")):
    with pytest.raises(SystemExit) as info:
      plot.main([str(workdir)])
    assert info.value.code == 2  # a workdir named wrong: usage
    message = capsys.readouterr().err.rstrip("\n")
    assert message.startswith("plot: error: ") and "\n" not in message, message
    assert f"workdir={str(workdir)!r}" in message and why in message, message
  # Training's drawer: skipped between close checkpoints, always at the last one.
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "lr": 1e-3}) + "\n")
  messages = []
  curves = plot.Curves(str(workdir), messages.append, every_s=3600)
  curves.draw()
  assert not (workdir / "curves.png").exists()
  curves.draw(last=True)
  assert (workdir / "curves.png").exists() and messages == []
  # Without matplotlib: no png, one line saying how to install it, once.
  os.remove(workdir / "curves.png")
  for name in [n for n in sys.modules if n.split(".")[0] == "matplotlib"] + ["matplotlib"]:
    monkeypatch.setitem(sys.modules, name, None)
  curves = plot.Curves(str(workdir), messages.append, every_s=0)
  curves.draw()
  curves.draw(last=True)
  assert messages == ["curves.png not drawn: matplotlib is not installed "
                      "(pip install 'mdjax[plot]')."], messages
  assert os.listdir(workdir) == ["metrics.jsonl"]
  with pytest.raises(SystemExit) as info:
    plot.main([str(workdir)])
  assert info.value.code == 1
  assert "plot: error: matplotlib is not installed (pip install" in capsys.readouterr().err
