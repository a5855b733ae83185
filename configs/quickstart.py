"""Quickstart: the CPU ScanAndAdd setting, shortened to about two minutes on 2 CPU cores."""

from configs.scan_and_add_cpu import get_config as cpu


def get_config():
  c = cpu()
  c.batch_size = 64
  c.train.update(num_steps=2500, warmup_steps=100)
  c.checkpoint.update(every=1250, keep=2)
  c.log_every = 250
  c.eval_every = 0
  return c
