"""LoRA fine-tuning of DiffusionGemma (gemma's params checkpoint) by the uniform-noise NELBO.

  python train.py --config=configs/diffusion_gemma_lora.py --workdir=/tmp/gemma_lora \\
      --config.train.init_from=pretrained:/ckpt/diffusiongemma-26B-A4B-it \\
      --config.task=corpus --config.task_kwargs.data_dir=/data/docs   # its tokenizer's ids

DiffusionGemma is a uniform-noise model, so it trains under noise='uniform' with objective
'nelbo' (UDLM's NELBO, `mdjax.noise.gidd_loss`): each row noised whole (every token kept with
probability 1 - t, else redrawn uniformly) and denoised by the decoder pass
(`mdjax.train.gemma_start`). LoRA adapters of rank 4 on the attention's q, k and o (gemma's
value projection is the key's on its global layers); the base weights stay frozen. The final
step writes the merged weights back in gemma's layout (WORKDIR/pretrained). How this differs
from the objective gemma's hackable_diffusion_adapter trains: docs/pretrained.md.

Without flags it trains the tiny random DiffusionGemma of the tests on ScanAndAdd's ids (14 of
its 128: the logits of those ids are trained) for a few steps on the CPU: a smoke run.
"""

import os

import ml_collections
from ml_collections import config_dict

from configs.base import base_config

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                        "fixtures", "diffusion_gemma", "params")


def get_config() -> ml_collections.ConfigDict:
  c = base_config()
  c.task = "scan_and_add"
  c.objective = "nelbo"
  c.noise = "uniform"  # the start's process (a ConfigError names noise otherwise)
  c.schedule = "linear"  # gemma's LinearSchedule: noise probability t
  # Every model field is the start point's unless set (dtype is a compute knob).
  c.model = ml_collections.ConfigDict({
      name: config_dict.placeholder(type(value) if value is not None else int)
      for name, value in c.model.items()})
  c.train.init_from = "pretrained:" + FIXTURE
  c.train.lora.update(rank=4, alpha=8.0, targets=("q", "k", "o"))
  c.train.update(num_steps=20, lr=1e-2, lr_floor=1.0, warmup_steps=0, weight_decay=0.0,
                 ema_decay=0.0)
  c.batch_size = 16
  c.checkpoint.update(every=10, keep=2)
  c.log_every = 5
  c.eval_every = 0
  c.eval_batches = 2
  c.num_eval_samples = 0  # the held-out NELBO only
  return c
