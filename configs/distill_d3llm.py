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

import ml_collections
from ml_collections import config_dict

from configs.base import base_config


def get_config():
  c = base_config()
  c.task = "sudoku4"
  c.task_kwargs.given_probability = 0.5
  c.objective = "d3llm"
  c.batch_size = 64
  c.train.update(init_from="", num_steps=300, lr=3e-4, lr_floor=1.0, warmup_steps=0,
                 weight_decay=0.01)
  c.checkpoint.update(every=100, keep=1)
  c.log_every = 50
  c.eval_batches = 1
  c.num_eval_samples = 0
  c.sampler.update(family="confidence", steps=16, threshold=0.9, temperature=0.0)
  c.distill = ml_collections.ConfigDict(dict(
      teacher=config_dict.placeholder(str), prompt_length=16, num_prompts=3200,
      temperature=0.0,
      teacher_block_length=config_dict.placeholder(int),
      block_lengths=config_dict.placeholder(str),  # None: 8,8,12,12,16,16
      min_mask_ratio=0.0, max_mask_ratio=0.8, complementary=True,
      entropy_temperature=0.5, entropy_weight=2.0))
  c.model = ml_collections.ConfigDict({
      name: config_dict.placeholder(type(value) if value is not None else int)
      for name, value in c.model.items()})
  return c
