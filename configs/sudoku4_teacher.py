"""A sudoku4 teacher for the distillation objectives: a 4-layer Transformer trained by the
NELBO on the bench's puzzles (each cell given with probability 0.5), a few minutes of CPU.

  python train.py --config=configs/sudoku4_teacher.py --workdir=/tmp/sudoku4_teacher

`python -m mdjax.bench.accelerators` trains it (seed 0), distills it into students
(configs/distill_dparallel.py, configs/distill_d3llm.py) and measures them all beside its
exact oracle (docs/accelerators.md). configs/sudoku4.py is the smaller start of the RL
experiments (2 layers, puzzles with 0.7 of the cells given).
"""

from configs.base import base_config


def get_config():
  c = base_config()
  c.task = "sudoku4"
  c.task_kwargs.given_probability = 0.5  # sudoku4.DEFAULT: the bench's puzzles
  c.batch_size = 128
  c.model.update(d_model=64, num_layers=4, num_heads=4, d_ff=256)
  c.train.update(num_steps=1500, lr=3e-3, warmup_steps=100)
  c.checkpoint.update(every=500, keep=1)
  c.log_every = 100
  c.eval_batches = 1
  c.num_eval_samples = 0
  # Greedy decoding one cell a step: the teacher's rollouts for the students.
  c.sampler.update(family="confidence", steps=16, score="prob", count_rule="even",
                   temperature=0.0)
  return c
