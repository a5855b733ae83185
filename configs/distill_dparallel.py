"""dParallel's certainty-forcing distillation of a sudoku4 teacher into a student that commits
more cells a step (objective 'dparallel', mdjax.accelerators.distill; docs/accelerators.md).

  python train.py --config=configs/sudoku4_teacher.py --workdir=/tmp/sudoku4_teacher
  python train.py --config=configs/distill_dparallel.py --workdir=/tmp/sudoku4_dparallel \\
      --config.train.init_from=/tmp/sudoku4_teacher \\
      --config.distill.teacher=/tmp/sudoku4_teacher

The teacher decodes 3,200 puzzles (the first 16 positions of the task's rows) once, one
cell a step, greedily (LLaDA's low-confidence remasking); the student, started from the
teacher (self-distillation, as dParallel distills LLaDA into itself), learns its answers
under dParallel's semi-autoregressive and complementary masks with the certainty term
(entropy at temperature 0.5, weight 2, on the cells it already gets right). The
reference's optimizer values (AdamW 2e-5, constant rate, 6 epochs, LoRA r=128 on LLaDA-8B)
are for an 8B model; here the whole 0.26M-parameter student trains at 3e-4 (constant) for
300 steps of 64 rows: 6 epochs of the 3,200 puzzles. The teacher may be a task's exact
oracle (--config.distill.teacher=sudoku4) and the student LoRA adapters
(--config.train.lora.rank=8). Model fields are the start point's.
"""

from ml_collections import config_dict

from configs.base import distill_config


def get_config():
  return distill_config(
      "dparallel", num_steps=300,
      teacher_block_length=config_dict.placeholder(int),
      block_length=config_dict.placeholder(int),  # None: the whole 16-cell solution
      mask_ratio=0.5, eps=1e-3, entropy_temperature=0.5, entropy_weight=2.0)
