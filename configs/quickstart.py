"""Quickstart: character-level Shakespeare in 2 to 5 minutes on 2 CPU cores (the README).

`shakespeare_char.py`'s task and objective (64-character windows, the MD4 NELBO) with a
0.46M-parameter denoiser trained for 1,000 steps of 32 windows: rough verse, not yet words
(3.30 held-out bits per character, against 2.72 for `shakespeare_char.py` after 42 minutes).
Its sampler is the workdir's default, which `mdjax.generate` and the server use unless told
otherwise: confidence decoding, one character a step, temperature 0.7.
ScanAndAdd, the science example, is `scan_and_add_cpu.py`.
"""

from configs.shakespeare_char import get_config as shakespeare_char


def get_config():
  c = shakespeare_char()
  c.batch_size = 32
  c.model.update(d_model=96, num_layers=3, num_heads=4, d_ff=384)
  c.train.update(num_steps=1000, lr=3e-3, warmup_steps=100, lr_floor=0.1)
  c.checkpoint.update(every=500, keep=2)
  c.log_every = 100
  c.eval_every = 0  # evaluated once, at the end
  c.eval_batches = 4
  c.num_eval_samples = 64
  c.sampler.update(family="confidence", steps=64, temperature=0.7)
  return c
