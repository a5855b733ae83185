"""A teacher for the small oracle tasks of the accelerators bench: permutation (6 items in
uniform random order) and the list tasks (a prompt of 4 distinct items of 8; copy, replace
one by a marker, or shuffle them), each at its exact oracle's sizes.

  python train.py --config=configs/oracle_task_teacher.py:list_shuffle --workdir=/tmp/t

The argument after the colon names the task (default permutation). A 2-layer, 0.13M-parameter
Transformer, NELBO, 2,000 steps of 128 rows: a couple of minutes of CPU.
`python -m mdjax.bench.accelerators --task=list_shuffle` trains it (seed 0), distills it
into students and measures them beside the task's exact oracle (docs/accelerators.md).
"""

from configs.base import base_config

TASKS = ("permutation", "list_copy", "list_replace", "list_shuffle")


def get_config(task: str = "permutation"):
  if task not in TASKS:
    raise ValueError(f"task={task!r} must be one of {TASKS}.")
  c = base_config()
  c.task = task
  c.task_kwargs = {}  # the task's defaults: the exact oracles' sizes (n 6; n 4 of m 8)
  c.batch_size = 128
  c.model.update(d_model=64, num_layers=2, num_heads=4, d_ff=256)
  c.train.update(num_steps=2000, lr=2e-3, warmup_steps=100)
  c.checkpoint.update(every=1000, keep=1)
  c.log_every = 500
  c.eval_batches = 1
  c.num_eval_samples = 0
  # One position a step at the law's temperature: the teacher's rollouts for the students.
  c.sampler.update(family="confidence", steps=6 if task == "permutation" else 4,
                   score="prob", count_rule="even", temperature=1.0)
  return c
