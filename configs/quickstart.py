"""Quickstart: a small ScanAndAdd denoiser in about two minutes on 2 CPU cores."""

from configs.scan_and_add_cpu import get_config as cpu


def get_config():
  c = cpu()
  c.model.update(d_model=64, num_layers=2, num_heads=4, d_ff=256)
  c.batch_size = 64
  c.train.update(num_steps=600, lr=3e-3, warmup_steps=50)
  c.checkpoint.update(every=300, keep=2)
  c.log_every = 100
  c.eval_every = 0
  c.num_eval_samples = 500
  return c
