"""Continued training of a causal LM converted to a block diffusion LM (Fast-dLLM v2 with the
shift, SDAR without): the block NELBO (each block denoised after the clean blocks before it),
complementary masks (each row trained under a mask and its complement, so every token is
predicted once masked and seen once: SDAR, Fast-dLLM v2), an optional block-size schedule.

  python -m mdjax.convert --input=AR_DIR --to=block --block_size=32 --out=/ckpt/a2d_block
  python -m mdjax.prepare_data --input=DOCS --tokenizer=/ckpt/a2d_block/tokenizer.json \\
      --out=/data/docs
  python train.py --config=configs/a2d_block.py --workdir=/tmp/a2d_block \\
      --config.train.init_from=pretrained:/ckpt/a2d_block \\
      --config.task_kwargs.data_dir=/data/docs

task_kwargs.length must be a multiple of the block size (and of every size of
a2d.block_size_schedule, "STEP:SIZE,..." ending at the start's, as LLaDA2.0 grows the block
over training). a2d.anneal_steps anneals inside the blocks from causal attention (0: the direct
switch, as SDAR and Fast-dLLM v2 do). The final step exports WORKDIR/pretrained in the start's
layout. Without flags it trains the tiny converted Qwen2 fixture (blocks of 4) on its corpus.
"""

import os

from configs.a2d_masked import _FIXTURES, a2d_config


def get_config():
  c = a2d_config(os.path.join(_FIXTURES, "block"))
  c.a2d.complementary = True
  return c
