"""DUO's discrete consistency distillation of a uniform-noise Shakespeare model into a
student that samples in fewer steps (objective 'duo', mdjax.accelerators.duo;
docs/accelerators.md, "DUO").

  python train.py --config=configs/shakespeare_uniform.py --workdir=/tmp/shakespeare_uniform
  python train.py --config=configs/distill_duo.py --workdir=/tmp/shakespeare_duo \\
      --config.distill.teacher=/tmp/shakespeare_uniform
  python sample.py --workdir=/tmp/shakespeare_duo --sampler=uniform_ancestral --steps=8

The student starts as the teacher (train.init_from is set to distill.teacher) and the
teacher is the student's copy, replaced every update_teacher_every steps; round n distills
over a time step 2^n / teacher_steps. The reference (s-sahoo/duo, scripts/distil_owt.sh)
runs 5 rounds of 10,000 steps at T = 512 (algo.T; its config's default 64), AdamW at 6e-5
after 500 warm-up steps, batch 128, on a 170M model. Here 5 rounds of 100 steps at T = 64
(the last round's step 1/4 of the time), batch 64, AdamW at 3e-4, constant after 20
warm-up steps. Model fields and the noise process are the teacher's;
--config.train.lora.rank=8 trains LoRA adapters only.
"""

import ml_collections
from ml_collections import config_dict

from configs import shakespeare_uniform


def get_config():
  c = shakespeare_uniform.get_config()
  c.objective = "duo"
  c.batch_size = 64
  c.train.update(init_from="", num_steps=500, lr=3e-4, lr_floor=1.0, warmup_steps=20,
                 weight_decay=0.0, ema_decay=0.0)
  c.checkpoint.update(every=100, keep=1)
  c.log_every = 50
  c.eval_every = 0
  c.eval_batches = 4
  c.num_eval_samples = 0
  c.sampler.update(family="uniform_ancestral", steps=8)
  c.distill = ml_collections.ConfigDict(dict(
      teacher=config_dict.placeholder(str), teacher_steps=64, update_teacher_every=100,
      loss="kl-bwd", match="posterior", gamma_min=config_dict.placeholder(float),
      gamma_max=config_dict.placeholder(float)))
  c.model = ml_collections.ConfigDict({
      name: config_dict.placeholder(type(value) if value is not None else int)
      for name, value in c.model.items()})
  return c
