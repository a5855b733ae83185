"""ScanAndAdd sized for a 2-core CPU: a 0.15M-parameter denoiser, about 25 minutes.

The published setting's MLM objective and optimizer, with a smaller model and one
corruption knob: 70% of the (not fully masked) examples draw their masking ratio
from U[0, 0.3]. The answer is a function of about a dozen other tokens, so only
lightly masked examples teach it; with r ~ U[0, 1] alone this model had not
learned the sum after 6,000 steps (see the README).
"""

from configs.scan_and_add import get_config as published


def get_config():
  c = published()
  c.mlm = dict(low_ratio_prob=0.7, low_ratio_max=0.3)
  c.model.update(d_model=64, num_layers=3, num_heads=4, d_ff=256, positions="rope")
  c.batch_size = 128
  c.train.update(num_steps=20_000, lr=2e-3, warmup_steps=200, lr_floor=0.05)
  c.checkpoint.update(every=2000, keep=3)
  c.log_every = 1000
  c.eval_every = 2000
  c.num_eval_samples = 500
  return c
