"""A run's start and end: the EMA warm-up, strict metrics, raw and EMA validation, the
end-of-run summary, a finished workdir's rerun, a signal before the first step."""

import json
import math
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import two_color as two_color_config
from mdjax import plot, train
from mdjax.train import state as train_state
from mdjax.train import workdir as workdir_lib


def _config(num_steps=10, **overrides):
  config = two_color_config.get_config()
  config.train.update(num_steps=num_steps, warmup_steps=2, ema_decay=0.999)
  config.checkpoint.every = num_steps
  config.update(log_every=5, eval_every=5, eval_batches=1, num_eval_samples=0)
  config.update(overrides)
  return config


def _strict_rows(path):
  def refuse(constant):
    raise ValueError(f"not strict JSON: {constant}")
  return [json.loads(line, parse_constant=refuse) for line in open(path)]


def test_ema_warms_up_by_the_num_updates_rule():
  # loss = sum(p): each SGD update subtracts lr from every parameter.
  params = {"w": jnp.array([1.0, -2.0], jnp.float32)}
  optimizer = optax.sgd(0.5)
  state = train_state.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                                 opt_state=optimizer.init(params),
                                 ema_params=jax.tree.map(jnp.copy, params))
  loss_fn = lambda p, key, x: (jnp.sum(p["w"]), {})
  ema = np.array([1.0, -2.0], np.float32)
  for t in range(3):
    state, _ = train_state.train_step(state, None, loss_fn=loss_fn, optimizer=optimizer,
                                      ema_decay=0.999, seed=0)
    decay = min(0.999, (1 + t) / (10 + t))  # 0.1, 2/11, 3/12
    raw = np.array([1.0, -2.0], np.float32) - 0.5 * (t + 1)
    ema = decay * ema + (1 - decay) * raw
    np.testing.assert_array_equal(state.params["w"], raw)  # the raw parameters: plain SGD
    # float32 against float64 arithmetic: a few roundings of values below 4.
    np.testing.assert_allclose(state.ema_params["w"], ema, rtol=0, atol=4 * 4 * 2.0**-24)
  # Once (1 + t) / (10 + t) passes the decay, the configured decay holds.
  assert float(train_state.ema_decay_at(jnp.int32(10_000), 0.999)) == pytest.approx(0.999)


def test_metrics_are_strict_json_with_null_for_nan(tmp_path):
  log = workdir_lib.MetricsLog(str(tmp_path), tensorboard=False)
  log.write({"step": 1, "loss": float("nan"), "tokens_per_s": float("inf"), "lr": 0.5})
  log.close()
  assert _strict_rows(tmp_path / "metrics.jsonl") == [
      {"step": 1, "loss": None, "tokens_per_s": None, "lr": 0.5}]
  # An older file's bare NaN is rewritten as null when a resumed run trims the file.
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 2, "val_bits_per_token": NaN}\n{"step": 3, "loss": 1.0}\n')
  workdir_lib.keep_metrics_through(str(tmp_path / "metrics.jsonl"), 2)
  rows = _strict_rows(tmp_path / "metrics.jsonl")
  assert rows[1:] == [{"step": 2, "val_bits_per_token": None}]
  # Readers take null: the plot skips it, the summary names no validation.
  assert plot._series(rows, "loss") == ([], [])
  assert "validation" not in workdir_lib.run_summary(str(tmp_path), 2, 2)


DEEP_LINE = "[" * 100_000  # a RecursionError near 1,000 levels in Python's parser


def test_a_metrics_line_that_is_no_row_is_skipped_as_a_cut_one(tmp_path):
  """A metrics.jsonl line nested 100,000 deep (or not an object, or with a step that is no
  number): a RecursionError traceback (or an AttributeError, a TypeError) from the resume's
  trim, the end-of-run summary and the plot before (issue 55); now skipped by all three, as
  a row cut short by a kill is."""
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 1.0, "val_bits_per_token": 2.0}\n' + DEEP_LINE + "\n"
                  '[1, 2]\n{"step": "2", "loss": 3.0}\n{"loss": 4.0}\n{"step": 2, "loss": 0.5}\n'
                  '{"step": 9, "loss": 0.1}\n{"step": 10, "lo')
  assert [r.get("step") for r in plot.read_metrics(str(tmp_path))] == [1, "2", None, 2, 9]
  assert plot._series(plot.read_metrics(str(tmp_path)), "loss") == ([1, 2, 9], [1.0, 0.5, 0.1])
  assert "validation bits/token: final 2 at step 1" in workdir_lib.run_summary(str(tmp_path), 2, 2)
  workdir_lib.keep_metrics_through(str(path), 2)
  assert _strict_rows(path) == [{"step": 1, "loss": 1.0, "val_bits_per_token": 2.0},
                                {"loss": 4.0}, {"step": 2, "loss": 0.5}]


def test_a_train_seconds_file_that_holds_no_seconds_is_one_line_naming_it(tmp_path):
  """train_seconds.json nested 100,000 deep: a RecursionError traceback before (issue 55), on
  resuming and in `read_train_seconds`; now one ValueError naming the file and the bound."""
  path = tmp_path / "train_seconds.json"
  readers = (lambda: train.read_train_seconds(str(tmp_path)),
             lambda: workdir_lib.TrainClock(str(tmp_path), 5))
  for text, message in (
      (DEEP_LINE, "nests 100,000 levels of JSON arrays and objects; at most 256 are read."),
      ("[1]", 'no number "seconds" in it; it holds {"seconds": number, "step": number}.'),
      ('{"seconds": ', 'not JSON (Expecting value); it holds {"seconds": number, "step": '
                      'number}.')):
    path.write_text(text)
    for read in readers:
      with pytest.raises(ValueError) as error:
        read()
      assert str(error.value) == f"{path}: {message}"
  path.write_text('{"seconds": 12.5, "step": 5}')
  assert train.read_train_seconds(str(tmp_path)) == workdir_lib.TrainClock(
      str(tmp_path), 5).previous == 12.5


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("finished") / "run"
  lines = []
  train.train(_config(), str(workdir), log=lines.append)
  return workdir, lines


@pytest.mark.slow
def test_eval_rows_hold_ema_and_raw_validation_once(finished_run):
  workdir, _ = finished_run
  evals = [r for r in _strict_rows(workdir / "metrics.jsonl") if "val_bits_per_token" in r]
  assert [r["step"] for r in evals] == [5, 10]
  for row in evals:
    assert set(row) == {"step", "val_bits_per_token", "val_bits_per_token_raw"}, row
    assert 0 < row["val_bits_per_token"] != row["val_bits_per_token_raw"] > 0
  assert os.path.getsize(workdir / plot.CURVES) > 0


@pytest.mark.slow
def test_a_finished_run_prints_its_summary_and_a_rerun_says_already_finished(finished_run):
  workdir, lines = finished_run
  evals = [r for r in _strict_rows(workdir / "metrics.jsonl") if "val_bits_per_token" in r]
  best = min(evals, key=lambda r: r["val_bits_per_token"])
  summary = lines[-1]
  assert summary.startswith("finished: step 10 of 10 in "), lines
  assert (f"validation bits/token (EMA): final {evals[-1]['val_bits_per_token']:.4g} at step "
          f"10, best {best['val_bits_per_token']:.4g} at step {best['step']}") in summary
  assert "validation bits/token (raw weights): final " in summary
  assert f"checkpoint: {workdir}/checkpoints/10" in summary
  assert f"python -m mdjax.plot {workdir}" in summary
  rerun = []
  train.train(_config(), str(workdir), log=rerun.append)
  assert not any("resumed" in line for line in rerun), rerun
  assert any(line.startswith(f"already finished: {workdir} holds step 10 of 10")
             for line in rerun), rerun
  assert rerun[-1] == summary


def _signal_at(monkeypatch, where):
  """SIGTERM to this process as the train step is built ("build"), or as the first step is
  dispatched ("first_step"), i.e. while it compiles."""
  real = train.loop.compile_train_step

  def compile_and_signal(*args, **kwargs):
    step_fn = real(*args, **kwargs)
    if where == "build":
      os.kill(os.getpid(), signal.SIGTERM)
      return step_fn
    calls = []

    def first_signalled(*step_args):
      if not calls:
        calls.append(1)
        os.kill(os.getpid(), signal.SIGTERM)
      return step_fn(*step_args)
    return first_signalled
  monkeypatch.setattr(train.loop, "compile_train_step", compile_and_signal)


def test_sigterm_before_the_first_step_saves_nothing_and_claims_nothing(tmp_path, monkeypatch):
  _signal_at(monkeypatch, "build")
  lines = []
  state = train.train(_config(), str(tmp_path), log=lines.append)
  assert int(state.step) == 0
  assert lines[-1] == ("SIGTERM before the first step: stopped, nothing trained or saved; the "
                       "same command starts again."), lines
  assert not any("goes on" in line or "finished" in line for line in lines), lines
  assert not os.path.exists(tmp_path / "checkpoints" / "0")


@pytest.mark.slow
def test_sigterm_during_the_first_step_does_not_say_training_goes_on(tmp_path, monkeypatch):
  _signal_at(monkeypatch, "first_step")
  lines = []
  state = train.train(_config(), str(tmp_path), log=lines.append)
  assert int(state.step) == 1
  assert lines[-1] == (f"SIGTERM: checkpoint saved at step 1 of 10 in {tmp_path}/checkpoints; "
                       "the same command resumes."), lines
  assert not any("goes on" in line for line in lines), lines
  assert math.isfinite(json.load(open(tmp_path / "train_seconds.json"))["seconds"])
