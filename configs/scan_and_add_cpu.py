"""ScanAndAdd sized for a 2-core CPU: a 0.15M-parameter denoiser, 14,000 steps.

The published setting's MLM objective and optimizer, with a smaller model and one
corruption knob: 70% of the (not fully masked) examples draw their masking ratio
from U[0, 0.3]. The answer is a function of about a dozen other tokens, so only
lightly masked examples teach it; with r ~ U[0, 1] alone models of this size had not
learned the sum after 6,000 steps (see the README). Sinusoidal (absolute)
positions, as published: with RoPE alone a bidirectional model sees no absolute
position at the all-masked state and, at some checkpoints, misplaced the first marker.
"""

from configs.scan_and_add import get_config as published


def get_config():
  c = published()
  c.mlm = dict(low_ratio_prob=0.7, low_ratio_max=0.3)
  c.model.update(d_model=64, num_layers=3, num_heads=4, d_ff=256)
  c.batch_size = 128
  c.train.update(num_steps=14_000, lr=2e-3, warmup_steps=200, lr_floor=0.05)
  c.checkpoint.update(every=2000, keep=3)
  c.log_every = 1000
  c.eval_every = 2000
  c.num_eval_samples = 500
  return c
