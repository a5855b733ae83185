"""Continued training of a causal LM converted to a masked diffusion LM (Dream-style: the
shift kept, bidirectional attention), the MDLM / MD4 NELBO (`a2d.a2d_loss_fn`).

  python -m mdjax.convert --input=AR_DIR --to=masked --out=/ckpt/a2d_masked
  python -m mdjax.prepare_data --input=DOCS --tokenizer=/ckpt/a2d_masked/tokenizer.json \\
      --out=/data/docs
  python train.py --config=configs/a2d_masked.py --workdir=/tmp/a2d_masked \\
      --config.train.init_from=pretrained:/ckpt/a2d_masked \\
      --config.task_kwargs.data_dir=/data/docs

The corpus must be tokenized by the converted folder's tokenizer (its ids are the start's).
a2d.anneal_steps: DiffuLLaMA's attention-mask annealing, from the causal model's attention to
bidirectional over that many steps (each later key visible with probability
min(1, (step + 1) / anneal_steps), drawn per step); 0 switches at once (RND1's direct
switch). train.lr_scales: layer-wise learning rates (e.g. --config.train.lr_scales.mlp=0.1,
as RND1 keeps the MLPs' knowledge). The final step exports WORKDIR/pretrained in the start's
layout (Dream), which `configs/sft.py` fine-tunes (train.init_from=pretrained:WORKDIR/pretrained).
Without flags it trains the tiny converted Qwen2 fixture on its corpus (a CPU smoke run).
"""

import os

import ml_collections
from ml_collections import config_dict

from configs.base import base_config

_FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                         "fixtures", "a2d")


def a2d_config(start: str) -> ml_collections.ConfigDict:
  """The recipe shared by configs/a2d_masked.py and configs/a2d_block.py, from `start`."""
  c = base_config()
  c.task = "corpus"
  c.task_kwargs.update(length=32, documents="packed")
  c.task_kwargs.data_dir = os.path.join(_FIXTURES, "corpus")  # tokenized by the start's tokenizer
  c.objective = "a2d"
  c.schedule = "linear"  # MDLM's; weight 1/t
  # Every model field is the start point's unless set (then it must match; dtype is a compute
  # knob, free to differ).
  c.model = ml_collections.ConfigDict({
      name: config_dict.placeholder(type(value) if value is not None else int)
      for name, value in c.model.items()})
  c.train.init_from = "pretrained:" + start
  c.a2d = ml_collections.ConfigDict(dict(
      anneal_steps=0,  # 0: the direct switch; N: anneal from causal attention over N steps
      complementary=False,  # each row trained under a mask and its complement
      # "STEP:SIZE,...": a block-causal start's block size from each step on (ends at its own)
      block_size_schedule=config_dict.placeholder(str)))
  c.train.update(num_steps=1000, lr=1e-4, lr_floor=0.1, warmup_steps=50, weight_decay=0.1,
                 ema_decay=0.0)
  # Layer-wise learning rates (multipliers of lr; 0 freezes): e.g. mlp=0.1 keeps more of the
  # causal model's MLPs (RND1's recipe). All 1: one rate.
  c.train.lr_scales = ml_collections.ConfigDict(dict(attention=1.0, mlp=1.0, embed=1.0,
                                                     head=1.0, norm=1.0))
  c.batch_size = 8
  c.checkpoint.update(every=500, keep=2)
  c.log_every = 10
  c.eval_every = 0
  c.eval_batches = 2
  c.num_eval_samples = 0
  # The corpus pipeline (`mdjax.data.pipeline`), as configs/corpus.py.
  c.data = ml_collections.ConfigDict(dict(threads=2, prefetch=4, on_corrupt="stop",
                                          verify="checksum"))
  return c


def get_config():
  c = a2d_config(os.path.join(_FIXTURES, "masked"))
  c.a2d.anneal_steps = 100  # DiffuLLaMA anneals; set 0 for the direct switch
  return c
