"""LoRA fine-tuning of DiffusionGemma through the trainer (configs/diffusion_gemma_lora.py): gemma's
params checkpoint as `train.init_from`, the uniform-noise NELBO, adapters on q, k and o only.
A short run lowers the held-out NELBO, resumes, and exports the merged weights in gemma's
layout; a start it cannot train by is refused by name."""

import os

import jax
import numpy as np
import pytest

import mdjax
from mdjax import lora, tasks, train
from mdjax import noise as noise_lib
from mdjax.io import gemma_params
from mdjax.models import diffusion_gemma as network
from mdjax.train.config_checks import ConfigError
from configs import diffusion_gemma_lora

PARAMS = diffusion_gemma_lora.FIXTURE
BATCHES, ROWS = 8, 64


def held_out_bits(params, config) -> tuple[float, float]:
  """The uniform-noise NELBO in bits per token on 8 fixed held-out batches of 64 (fixed noise
  keys): mean and standard error."""
  task = tasks.get("scan_and_add", {})
  denoiser = network.training_denoiser(config, task.vocab_size)
  process = noise_lib.get("uniform", task.vocab_size)
  bits = jax.jit(lambda p, k, x: noise_lib.gidd_loss(denoiser, p, k, x, process=process)[1][
      "bits_per_token"])
  values = [float(bits(params, jax.random.key(i), task.validation_data(jax.random.key(100 + i),
                                                                       ROWS)))
            for i in range(BATCHES)]
  return float(np.mean(values)), float(np.std(values, ddof=1) / np.sqrt(BATCHES))


@pytest.mark.slow
def test_a_lora_run_lowers_the_nelbo_resumes_and_exports_gemmas_layout(tmp_path):
  config = diffusion_gemma_lora.get_config()
  config.train.num_steps = 10
  config.update(eval_at_end=False, log_every=5)
  config.checkpoint.every = 5
  workdir = str(tmp_path / "run")
  state = train.train(config, workdir, log=lambda *_: None)
  # Only the adapters trained (q, k, o of every layer); the base is the checkpoint's.
  base = gemma_params.load(PARAMS)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               state.params["base"], base.params)
  assert {k for layer in state.params["lora"].values() for k in layer} == {"q", "k", "o"}
  # The held-out NELBO falls: 7.8 -> 4.0 bits a token after 20 steps in the recorded run;
  # each figure is a mean over 8 batches of 64 rows, so the drop is compared with 4 standard
  # errors of the difference.
  config.train.num_steps = 20
  resumed = train.train(config, workdir, log=lambda *_: None)
  assert int(resumed.step) == 20
  exported = mdjax.load(os.path.join(workdir, "pretrained"))
  assert gemma_params.leaf_shapes(os.path.join(workdir, "pretrained")) == \
      gemma_params.leaf_shapes(PARAMS)
  merged = lora.merged(config, resumed.params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                                                       atol=1e-6),
               exported.params, merged)
  before, before_se = held_out_bits(base.params, base.config)
  after, after_se = held_out_bits(exported.params, exported.config)
  assert after < before - 4 * np.hypot(before_se, after_se), (before, after)


def test_a_gemma_start_trains_by_the_uniform_nelbo_only(tmp_path):
  config = diffusion_gemma_lora.get_config()
  config.objective = "a2d"
  with pytest.raises(ConfigError, match="uniform-noise model, which objective='a2d'"):
    train.train(config, str(tmp_path / "a2d"), log=lambda *_: None)
  config = diffusion_gemma_lora.get_config()
  config.noise = "absorbing"
  with pytest.raises(ConfigError, match="noise='absorbing'"):
    train.train(config, str(tmp_path / "absorbing"), log=lambda *_: None)
  assert not os.listdir(tmp_path)  # refused before a workdir is made
