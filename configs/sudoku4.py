"""Sudoku 4x4 on a 2-core CPU in about a minute: the start point configs/grpo.py fine-tunes.

  python train.py --config=configs/sudoku4.py --workdir=/tmp/sudoku4   # 53 s of training
  python train.py --config=configs/grpo.py --workdir=/tmp/sudoku_grpo \\
      --config.train.init_from=/tmp/sudoku4

The start of experiments/rl.py (docs/rl.md), field for field: an 83k-parameter
Transformer trained by the NELBO for 600 steps on puzzles whose cells are each given with
probability 0.7, sampled as d1 samples (low-confidence decoding, the drawn token's
probability, 4 cells a step, temperature 1), as configs/grpo.py's rollouts are. Given the
puzzle it solves 0.420 of experiments/rl.py's 2000 evaluation puzzles. No end-of-run samples:
drawn without a puzzle, almost none is a solved grid, which says little about the start.
"""

from configs.base import base_config


def get_config():
  c = base_config()
  c.task = "sudoku4"
  c.task_kwargs.given_probability = 0.7
  c.batch_size = 64
  c.model.update(d_model=64, num_layers=2, num_heads=4, d_ff=128)
  c.train.update(num_steps=600, lr=3e-3, warmup_steps=100)
  c.checkpoint.update(every=600, keep=1)
  c.log_every = 100
  c.eval_batches = 1
  c.num_eval_samples = 0
  c.sampler.update(family="confidence", steps=4, score="prob", count_rule="even",
                   temperature=1.0)
  return c
