"""The causal reference model for Shakespeare text quality: same corpus, windows and Transformer
code as configs/shakespeare_char.py, with the `causal` flag and the next-character loss.

It scores generated text (generative bits per character, experiments/text_quality.py); it is
not a denoiser and is not sampled by the diffusion samplers.
"""

from configs.shakespeare_char import get_config as diffusion_config


def get_config():
  c = diffusion_config()
  c.objective = "causal"
  c.model.causal = True
  c.train.update(num_steps=3000, warmup_steps=100)
  c.eval_every = 1000
  c.num_eval_samples = 0
  return c
