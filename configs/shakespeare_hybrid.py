"""Character-level Shakespeare under GIDD's hybrid noise: masks and uniform redraws, GIDD's NELBO.

shakespeare_char.py's run with noise="hybrid": uniform noise peaks mid-way at a share
hybrid.p_uniform of the tokens (gamma=1) and t = 1 is all masks (von Rütte et al. 2025).
GIDD's loss weighting: --config.gidd.weighting=elbo (the NELBO, default), clip or dynamic. The
denoiser is told t; the validation NELBO (bits/char) is this process's; samples are drawn by
the exact reverse kernel (uniform_ancestral). docs/training.md, "Noise".
"""

from configs import shakespeare_char


def get_config():
  c = shakespeare_char.get_config()
  c.noise = "hybrid"
  c.hybrid.update(p_uniform=0.1, gamma=1.0)
  c.model.time_conditioning = True
  c.sampler.update(family="uniform_ancestral", steps=64)  # the exact reverse kernel
  return c
