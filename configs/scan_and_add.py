"""ScanAndAdd, the published setting: 6 layers, d 256, 8 heads, ff 1024, MLM, 60k steps."""

from configs.base import base_config


def get_config():
  c = base_config()
  c.task = "scan_and_add"
  c.task_kwargs.max_command_id = 1  # M: 9 gives five synonyms per command kind
  c.objective = "mlm"
  c.batch_size = 128
  c.model.update(d_model=256, num_layers=6, num_heads=8, d_ff=1024, positions="sinusoidal",
                 norm="layer", mlp="gelu")
  c.train.update(num_steps=60_000, lr=1.5e-4, lr_floor=0.1, warmup_steps=250, b1=0.9, b2=0.95,
                 weight_decay=0.001, grad_clip=1.0)
  c.checkpoint.update(every=5000, keep=3)
  c.log_every = 500
  c.eval_every = 5000
  c.sampler.update(family="confidence", steps=24, temperature=0.4)
  return c
