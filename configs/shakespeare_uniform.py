"""Character-level Shakespeare under uniform noise: shakespeare_char.py's run, UDLM's NELBO.

A token is kept with probability alpha(t) = 1 - t, else redrawn uniformly over the characters
(no mask). The denoiser is told t (adaLN time conditioning): without a mask the canvas does
not say how noisy it is. The validation NELBO (bits/char) is this process's; samples are
drawn by the exact reverse kernel (uniform_ancestral) from random characters.
docs/training.md, "Noise".
"""

from configs import shakespeare_char


def get_config():
  c = shakespeare_char.get_config()
  c.noise = "uniform"
  c.model.time_conditioning = True
  c.sampler.update(family="uniform_ancestral", steps=64)  # the exact reverse kernel
  return c
