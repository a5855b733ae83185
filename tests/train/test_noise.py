"""Training under uniform and hybrid noise (`config.noise`): a run resumes bit for bit, loads
with its process as `Model.noise`, reports the held-out NELBO of its process and learns
two_color; a resume under another process and bad noise fields are refused by field;
absorbing stays the default, MD4's NELBO."""

import json
import shutil

import jax
import numpy as np
import pytest

import mdjax
from configs import shakespeare_char, shakespeare_hybrid, shakespeare_uniform, two_color
from mdjax import data, diffusion, noise, tasks, train
from mdjax.train import loop, objectives


def _quiet(*args, **kwargs):
  pass


def _tiny(noise_name, **changes):
  """configs/two_color.py under `noise_name`, told t, drawing no samples."""
  config = two_color.get_config()
  config.noise = noise_name
  config.model.time_conditioning = True
  config.num_eval_samples = 0
  config.update_from_flattened_dict(changes)  # dotted paths: "hybrid.p_uniform"
  return config


def _rows(workdir):
  return [json.loads(line) for line in open(workdir / "metrics.jsonl")]


@pytest.mark.parametrize("noise_name, changes, process", [
    ("uniform", {"sampler.family": "uniform_ancestral", "sampler.steps": 4,
                 "num_eval_samples": 64}, noise.Uniform(vocab_size=2)),
    ("hybrid", {"hybrid.p_uniform": 0.3, "gidd.weighting": "dynamic"},
     noise.Hybrid(vocab_size=2, p_uniform=0.3)),
])
@pytest.mark.slow
def test_a_run_resumes_bit_for_bit_and_loads_with_its_process(tmp_path, noise_name, changes,
                                                              process):
  config = _tiny(noise_name, **{"train.num_steps": 4, "train.warmup_steps": 1,
                                "train.ema_decay": 0.9, "checkpoint.every": 2, "eval_every": 2,
                                "eval_batches": 2, "log_every": 1, **changes})
  workdir = tmp_path / "run"
  whole = jax.device_get(train.train(config, str(workdir), log=_quiet))
  # Resume from step 2: steps 3 and 4 again, the same state (params, Adam, EMA) to the bit.
  shutil.rmtree(workdir / "checkpoints" / "4")
  lines = []
  resumed = jax.device_get(train.train(config, str(workdir), log=lines.append))
  assert "resumed from step 2" in lines
  assert int(resumed.step) == 4 and resumed.ema_params is not None
  jax.tree.map(np.testing.assert_array_equal, resumed, whole)
  assert [r["step"] for r in _rows(workdir) if "loss" in r] == [1, 2, 3, 4]
  # The workdir's model is the EMA under the run's process.
  model = mdjax.load(str(workdir))
  assert model.noise == process and model.step == 4
  jax.tree.map(np.testing.assert_array_equal, model.params, whole.ema_params)
  # The held-out figure is the process's NELBO (weighting "elbo", whatever training weighs),
  # in bits per token, on `evaluate`'s batches and keys.
  evals = [r for r in _rows(workdir) if "val_bits_per_token" in r]
  assert [r["step"] for r in evals] == [2, 4]
  values = []
  for i, x in enumerate(data.validation_batches(config, model.task)):
    key = jax.random.fold_in(jax.random.key(config.seed + 1), i)
    _, aux = noise.gidd_loss(model.denoiser, model.params, key, x, process=process)
    values.append(float(aux["bits_per_token"]))
  assert evals[-1]["val_bits_per_token"] == pytest.approx(np.mean(values), rel=1e-5)
  if config.num_eval_samples:  # drawn by a sampler of the process, as mdjax.generate draws
    assert 0 <= evals[-1]["sample_invalid_fraction"] <= 1
    out = mdjax.generate(model, [[]] * 3, max_new_tokens=2, key=0)
    assert model.sampler.family == "uniform_ancestral"
    assert [len(ids) for ids in out.token_ids] == [2, 2, 2]
  # The process decides what the model means: another one is refused on resume.
  for other in ({"noise": "absorbing", "num_eval_samples": 10, "gidd.weighting": "elbo"},
                {"noise": "hybrid" if noise_name == "uniform" else "uniform",
                 "gidd.weighting": "elbo"},
                {"schedule": "cosine"}):
    config_b = config.copy_and_resolve_references()
    config_b.update_from_flattened_dict(other)
    config_b.train.num_steps = 6
    with pytest.raises(train.CheckpointMismatch, match=r"'noise'"):
      train.train(config_b, str(workdir), log=_quiet)


def _held_out(config, task, params, apply_fn):
  eval_loss = loop.make_eval_loss(config, apply_fn, task, train.make_loss_fn(config, apply_fn,
                                                                             task))
  return train.evaluate(config, task, params, eval_loss)["val_bits_per_token"]


@pytest.mark.parametrize("noise_name", ["uniform", "hybrid"])
@pytest.mark.slow
def test_the_held_out_nelbo_falls_below_the_independent_colours(tmp_path, noise_name):
  # two_color's law: two equal colours, ln 2 nats per pair = 0.5 bits per token (the exact
  # denoiser's NELBO under any process); a model of the colours as independent scores 1 bit.
  # Measured on these 16 held-out batches after 150 steps: 0.53 (uniform) and 0.48 (hybrid),
  # from 21.3 and 11.7 bits untrained (on the same draws; the estimates are heavy-tailed).
  config = _tiny(noise_name, **{"train.num_steps": 150, "checkpoint.every": 150,
                                "eval_at_end": False, "eval_batches": 16, "log_every": 50})
  final = train.train(config, str(tmp_path / "run"), log=_quiet)
  task = tasks.from_config(config)
  start, _, apply_fn, _ = train.init_state(config, train.make_mesh(1), task)
  before = _held_out(config, task, start.params, apply_fn)
  after = _held_out(config, task, final.params, apply_fn)
  assert after < 0.8 and after < before / 4, (before, after)


@pytest.mark.parametrize("changes, field", [
    ({"noise": "gaussian"}, "noise"),
    ({"noise": "uniform", "num_eval_samples": 5}, "sampler.family"),
    ({"noise": "hybrid", "num_eval_samples": 5, "sampler.family": "diffusion_gemma",
      "sampler.steps": 4},
     "sampler.family"),
    ({"noise": "uniform", "objective": "mlm"}, "noise"),
    ({"noise": "uniform", "model.block_size": 1, "model.time_conditioning": False},
     "model.block_size"),
    ({"noise": "hybrid", "hybrid.p_uniform": 1.0}, "hybrid.p_uniform"),
    ({"noise": "hybrid", "hybrid.gamma": 3.0}, "hybrid.gamma"),
    ({"noise": "uniform", "gidd.weighting": "dynamic"}, "gidd.weighting"),
    ({"noise": "absorbing", "gidd.weighting": "clip"}, "gidd.weighting"),
    ({"noise": "hybrid", "gidd.weighting": "none"}, "gidd.weighting"),
    ({"noise": "hybrid", "gidd.min_loss_weight": 3.0}, "gidd.min_loss_weight"),
    ({"noise": "hybrid", "gidd.max_loss_weight": 0.0}, "gidd.max_loss_weight"),
])
def test_bad_noise_fields_are_refused_by_field(changes, field):
  config = _tiny("absorbing")
  config.num_eval_samples = 0
  config.update_from_flattened_dict(changes)
  with pytest.raises(train.ConfigError, match=rf"^config field {field}="):
    train.check_config(config)


def test_a_field_the_hybrid_does_not_take_is_refused_by_name():
  config = _tiny("hybrid")
  config.hybrid.beta = 1.0
  with pytest.raises(train.ConfigError, match=r"^config field hybrid\.beta: "):
    train.check_config(config)


def test_absorbing_stays_the_default_and_the_configs_name_their_process():
  config = two_color.get_config()
  assert config.noise == "absorbing" and config.gidd.weighting == "elbo"
  task = tasks.from_config(config)
  loss_fn = objectives.nelbo_loss_fn(config, lambda *a: None, task)
  assert loss_fn.func is diffusion.nelbo_loss  # MD4's, as before
  uniform, hybrid = shakespeare_uniform.get_config(), shakespeare_hybrid.get_config()
  assert (uniform.noise, hybrid.noise, shakespeare_char.get_config().noise) == (
      "uniform", "hybrid", "absorbing")
  for config in (uniform, hybrid):
    train.check_config(config)
    task = tasks.from_config(config)
    loss_fn = objectives.nelbo_loss_fn(config, lambda *a: None, task)
    assert loss_fn.func is noise.gidd_loss
    assert loss_fn.keywords["process"] == objectives.noise_process(config, task.vocab_size)
  assert objectives.noise_process(hybrid, 65) == noise.Hybrid(vocab_size=65, p_uniform=0.1)


def test_the_text_benchmark_runs_one_model_at_equal_tokens():
  # python -m mdjax.bench.noise_text: the three runs differ in their process alone.
  from mdjax.bench import noise_text
  runs = noise_text.configs(steps=400)
  assert sorted(runs) == sorted(noise_text.PROCESSES)
  for name, config in runs.items():
    assert config.noise == name and config.train.num_steps == 400
    train.check_config(config)
  plain = []
  for config in runs.values():
    fields = config.to_dict()
    for field in ("noise", "hybrid", "gidd", "sampler"):
      fields.pop(field)
    plain.append(fields)
  assert plain[0] == plain[1] == plain[2] and plain[0]["model"]["time_conditioning"]


@pytest.mark.slow
def test_a_start_point_of_another_process_is_refused_by_the_noise_field(tmp_path):
  """Fine-tuning from a uniform run (`train.init_from`) under absorbing noise is a
  ConfigError naming `noise` before a model is built (was: the run silently trained the
  uniform model as an absorbing one); under its own process it resolves."""
  from mdjax.train import sft
  start = tmp_path / "start"
  train.train(_tiny("uniform", **{"train.num_steps": 2, "train.warmup_steps": 1,
                                  "checkpoint.every": 2, "eval_every": 0,
                                  "eval_at_end": False}), str(start), log=_quiet)
  config = two_color.get_config()
  config.train.init_from = str(start)
  with pytest.raises(train.ConfigError, match=r"noise='absorbing'.*'uniform' noise"):
    sft.resolve_config(config)
  config.noise, config.model.time_conditioning = "uniform", True  # as the start was trained
  assert sft.resolve_config(config).noise == "uniform"
