"""Supervised fine-tuning on a chat / instruction JSONL from a published folder or a workdir.

  python train.py --config=configs/sft.py --config.task_kwargs.path=chat.jsonl \
      --config.train.init_from=pretrained:DIR --workdir=/tmp/sft

train.init_from is "pretrained:DIR" (a LLaDA or Dream Hugging Face folder) or an mdjax workdir.
Only the response (and its EOS padding) is masked; the loss is the NELBO per response token
(LLaDA's SFT recipe; see mdjax/train/sft.py). The model fields left unset (None) are the
start point's; a field set to another value is refused. A published start is exported, at
the last step, to WORKDIR/pretrained (mdjax.load, sample.py --pretrained). Without the two
flags it fine-tunes the tiny LLaDA test fixture on tests/fixtures/sft/chat.jsonl (a smoke run).
"""

import os

import ml_collections
from ml_collections import config_dict

from configs.base import base_config

_FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                         "fixtures")


def get_config():
  c = base_config()
  # train.init_from and the task's tokenizer source are one value.
  start = config_dict.FieldReference(
      "pretrained:" + os.path.join(_FIXTURES, "pretrained", "llada"), field_type=str)
  c.task = "sft"
  c.task_kwargs = ml_collections.ConfigDict(dict(
      path=os.path.join(_FIXTURES, "sft", "chat.jsonl"),  # the JSONL of prompts and responses
      start=start,  # the tokenizer's and ids' owner: train.init_from
      length=256,  # tokens per row: prompt, response, EOS padding
      truncate=False,  # True: cut responses that do not fit (else a row that does not fit errs)
      chat=True,  # render prompts with the start point's chat template when it has one
      validation_path=config_dict.placeholder(str)))  # held-out JSONL (default: the training rows)
  c.objective = "sft"
  c.schedule = "linear"  # t is the masked fraction of the response, weight 1/t (LLaDA)
  # Every model field is the start point's unless set (then it must match; dtype and remat are
  # compute knobs, free to differ).
  base_model = c.model
  c.model = ml_collections.ConfigDict({
      name: config_dict.placeholder(type(value) if value is not None else int)
      for name, value in base_model.items()})
  c.train.init_from = start
  # LLaDA's SFT optimizer: AdamW 2.5e-5, weight decay 0.1, a short warmup.
  c.train.update(num_steps=1000, lr=2.5e-5, lr_floor=0.1, warmup_steps=50, weight_decay=0.1,
                 ema_decay=0.0)
  c.batch_size = 8
  c.checkpoint.update(every=500, keep=2)
  c.log_every = 10
  c.eval_every = 0
  c.eval_batches = 2
  c.num_eval_samples = 0  # an unconditional sample says little of a chat model
  return c
