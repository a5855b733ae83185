"""ScanAndAdd sized for a 2-core CPU (see the README for what it reaches)."""

from configs.scan_and_add import get_config as published


def get_config():
  c = published()
  c.model.update(d_model=128, num_layers=4, num_heads=4, d_ff=512)
  c.batch_size = 128
  c.train.update(num_steps=6000, lr=1e-3, warmup_steps=200, lr_floor=0.05)
  c.checkpoint.update(every=1000, keep=3)
  c.log_every = 200
  c.eval_every = 1000
  return c
