"""d3LLM's pseudo-trajectory distillation of a sudoku4 teacher (objective 'd3llm',
mdjax.accelerators.distill; docs/accelerators.md).

  python train.py --config=configs/sudoku4_teacher.py --workdir=/tmp/sudoku4_teacher
  python train.py --config=configs/distill_d3llm.py --workdir=/tmp/sudoku4_d3llm \\
      --config.train.init_from=/tmp/sudoku4_teacher \\
      --config.distill.teacher=/tmp/sudoku4_teacher

The teacher decodes 3,200 puzzles once, one cell a step, greedily; the student learns its
answers at the teacher's own intermediate canvases (the trajectory step a mask ratio selects
inside a block), with d3LLM's curricula over training: the mask ratio drawn in
[p * 0.8, 0.8] at progress p, the block growing 8, 8, 12, 12, 16, 16 (the reference's
16 ... 32 scaled to the 16-cell solution), the complementary copy and dParallel's certainty
term; loss (ce + ce_rev + 2 entropy) / 4. The reference's optimizer values (AdamW 2e-5,
6 epochs, LoRA r=256 on LLaDA-8B) are for an 8B model; here the whole student trains at
3e-4 for 300 steps of 64 rows: 6 epochs of the 3,200 puzzles, one curriculum stage each.
Model fields are the start point's.
"""

from ml_collections import config_dict

from configs.base import distill_config


def get_config():
  return distill_config(
      "d3llm", num_steps=300,
      teacher_block_length=config_dict.placeholder(int),
      block_lengths=config_dict.placeholder(str),  # None: 8,8,12,12,16,16
      min_mask_ratio=0.0, max_mask_ratio=0.8, complementary=True,
      entropy_temperature=0.5, entropy_weight=2.0)
