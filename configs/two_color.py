"""Two-color corpus: trains in seconds; the NELBO should approach ln 2 nats (0.5 bits/token)."""

from configs.base import base_config


def get_config():
  c = base_config()
  c.task = "two_color"
  c.batch_size = 128
  c.model.update(d_model=32, num_layers=1, num_heads=2, d_ff=64)
  c.train.update(num_steps=300, warmup_steps=20, lr=3e-3)
  c.checkpoint.every = 100
  c.log_every = 50
  c.num_eval_samples = 2000
  c.sampler.update(family="random_order", steps=None)
  return c
