"""RL's sanity task: prompt-less two_color under a one-step ancestral sampler.

  python train.py --config=configs/two_color.py --workdir=/tmp/two_color        # the start
  python train.py --config=configs/grpo_two_color.py --workdir=/tmp/two_color_grpo \\
      --config.train.init_from=/tmp/two_color
  python sample.py --workdir=/tmp/two_color_grpo --sampler=ancestral --steps=1  # valid ~1.0

One ancestral step draws both positions independently from the denoiser's marginals, so
the start (the data's marginals, 1/2 each) is valid half the time; the best policy puts
both positions on one color (valid 1.0). diffu-GRPO's one-step log-probabilities are the
exact log-probabilities of this sampler. The KL penalty is k2 at d1's beta: with d1's k3,
whose gradient is KL(ref || policy)'s, the policy stops at valid = 1 - beta G / (G - 1)
(0.954 here; docs/rl.md).
"""

import ml_collections

from configs import grpo


def get_config():
  c = grpo.get_config()
  c.task = "two_color"
  c.batch_size = 64  # G = 8 completions of the empty prompt, 8 times
  c.train.update(num_steps=30, lr=3e-3)
  c.checkpoint.update(every=30, keep=1)
  c.rl.update(num_generations=8, num_iterations=4, beta=0.04, kl_estimator="k2",
              rewards=("two_color_valid",))
  c.sampler = ml_collections.ConfigDict(dict(family="ancestral", steps=1))
  return c
