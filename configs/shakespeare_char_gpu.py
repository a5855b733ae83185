"""Character-level Shakespeare for one accelerator: 256-character windows, a 6-layer
denoiser (14.2M parameters), bfloat16 compute, EMA, 50,000 steps of 128 windows."""

from configs.shakespeare_char import get_config as cpu_config


def get_config():
  c = cpu_config()
  c.task_kwargs.length = 256
  c.batch_size = 128
  c.model.update(d_model=384, num_layers=6, num_heads=6, d_ff=1536, dtype="bfloat16")
  c.train.update(num_steps=50_000, lr=1e-3, warmup_steps=1000, lr_floor=0.1, ema_decay=0.9999)
  c.checkpoint.update(every=5000, keep=3)
  c.log_every = 500
  c.eval_every = 5000
  c.eval_batches = 16
  c.sampler.update(family="ancestral", steps=256)
  return c
