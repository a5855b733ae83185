"""An MDLM-like denoiser on a corpus prepared with `python -m mdjax.prepare_data`.

  python -m mdjax.prepare_data --input=DOCS --tokenizer=bpe:8192 --out=/data/docs
  python train.py --config=configs/corpus.py --workdir=/tmp/corpus \\
      --config.task_kwargs.data_dir=/data/docs

The vocabulary, EOS and tokenizer come from the corpus's manifest. 128-token windows of the
token stream (documents joined by EOS; `task_kwargs.documents="padded"` gives one document
per window instead), shuffled per epoch by grain; the MD4/MDLM NELBO with the linear
schedule and no time conditioning, as MDLM trains. `data` sets the pipeline: reader threads,
batches read ahead, what a corrupt shard does, how shards are checked when opened.
"""

import ml_collections
from ml_collections import config_dict

from configs.base import base_config


def get_config():
  c = base_config()
  c.task = "corpus"
  c.task_kwargs.update(length=128, documents="packed")
  c.task_kwargs.data_dir = config_dict.placeholder(str)  # the prepared corpus folder
  c.objective = "nelbo"
  c.schedule = "linear"
  c.batch_size = 32
  c.model.update(d_model=256, num_layers=6, num_heads=4, d_ff=1024, positions="rope",
                 time_conditioning=False)
  c.train.update(num_steps=20000, lr=1e-3, warmup_steps=1000, lr_floor=0.1, b2=0.99,
                 weight_decay=0.0, ema_decay=0.999)
  c.checkpoint.update(every=1000, keep=3)
  c.log_every = 100
  c.eval_every = 2000
  c.eval_batches = 8
  c.num_eval_samples = 16
  c.sampler.update(family="ancestral", steps=128)
  # The input pipeline (mdjax.data.pipeline): grain reader threads, steps read ahead,
  # on_corrupt "stop" (name the shard) or "skip" (leave it out, say so), verify "checksum"
  # (SHA-256 of every shard when opened) or "size" (file sizes only).
  c.data = ml_collections.ConfigDict(dict(threads=4, prefetch=8, on_corrupt="stop",
                                          verify="checksum"))
  return c
