"""Character-level Shakespeare on a 2-core CPU: 64-character windows, a 1.07M-parameter denoiser.

The MD4 NELBO with the linear schedule; whole plays are held out for validation (see
mdjax/tasks/text.py). Another UTF-8 file: --config.task_kwargs.text_path=FILE.
"""

from ml_collections import config_dict

from configs.base import base_config


def get_config():
  c = base_config()
  c.task = "text"
  c.task_kwargs.update(corpus="shakespeare", length=64)
  c.task_kwargs.text_path = config_dict.placeholder(str)  # a UTF-8 file instead of the corpus
  c.objective = "nelbo"
  c.batch_size = 64
  c.model.update(d_model=128, num_layers=4, num_heads=4, d_ff=512, positions="rope")
  c.train.update(num_steps=7000, lr=2e-3, warmup_steps=200, lr_floor=0.05, b2=0.99,
                 weight_decay=0.0, ema_decay=0.0)
  c.checkpoint.update(every=1000, keep=3)
  c.log_every = 200
  c.eval_every = 2000
  c.eval_batches = 8
  c.num_eval_samples = 100
  c.sampler.update(family="ancestral", steps=64)
  return c
