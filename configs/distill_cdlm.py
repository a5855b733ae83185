"""CDLM's consistency distillation of a sudoku4 teacher into a block-causal student that
decodes with the exact block cache (objective 'cdlm', mdjax.accelerators.cdlm;
docs/accelerators.md).

  python train.py --config=configs/sudoku4_teacher.py --workdir=/tmp/sudoku4_teacher
  python train.py --config=configs/distill_cdlm.py --workdir=/tmp/sudoku4_cdlm \\
      --config.train.init_from=/tmp/sudoku4_teacher \\
      --config.distill.teacher=/tmp/sudoku4_teacher
  python sample.py --workdir=/tmp/sudoku4_cdlm --sampler=confidence --steps=16 \\
      --block_length=8 --threshold=0.9 --kv_cache=exact --temperature=0 \\
      --prompt=1,4,3,0,4,4,2,1,2,4,4,4,4,0,4,4  # a puzzle: digits 0-3, 4 a blank

The teacher decodes 3,200 puzzles once, in blocks of 8 cells (two grid rows), one cell a
step, greedily, and its distribution at each write is kept. The reference's 32-token blocks
make a 256-token answer 8 blocks; on sudoku4 blocks of 4 (one grid row, 4 blocks) cost the
teacher itself its accuracy (decoded row by row it solves 0.949 of the bench's puzzles, in
blocks of 8 0.970, as one block 1.000: a row's cells are often fixed only by later rows),
so the bench's student has two blocks: the second decodes against the exact cache of the
puzzle and the first. The student has the teacher's weights under block-causal attention
(model.block_size=8; the puzzle's 16 cells are 2 whole blocks) and learns the reference's
three terms with its LLaDA weights: distillation 1.0 (the teacher's distributions at the
cells a block completion reveals), consistency 0.5 (its own stop-gradient prediction at the
block's completion for the cells still masked), masked denoising 0.1 (the puzzles' true
solutions). The reference trains LoRA on LLaDA-8B / Dream-7B for 16 epochs; here the whole
student trains at 3e-4 (AdamW, constant) for 800 steps of 64 rows: 16 epochs of the 3,200
puzzles. Model fields other than block_size are the start point's;
--config.train.lora.rank=8 trains LoRA adapters only.
"""

from configs.base import distill_config

BLOCK_SIZE = 8


def get_config():
  c = distill_config("cdlm", num_steps=800, distill_weight=1.0, consistency_weight=0.5,
                     dlm_weight=0.1)
  # The reference's decoding: its blocks, threshold 0.9, the exact cache of finished blocks.
  c.sampler.update(block_length=BLOCK_SIZE, kv_cache="exact")
  c.model.block_size = BLOCK_SIZE  # the student's own attention: block-causal
  return c
