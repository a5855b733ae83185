"""A tiny text corpus and the Shakespeare configs cut to seconds: the smoke runs' stand-in
for Shakespeare (experiments/smoke.py), and the tests'."""

import numpy as np

from configs import shakespeare_causal, shakespeare_char

CONFIGS = {False: shakespeare_char.get_config, True: shakespeare_causal.get_config}
WORDS = ("thou", "art", "the", "king", "and", "queen", "of", "night", "fair", "love", "sweet")


def write_corpus(path, seed=0, first_line=""):
  rng = np.random.default_rng(seed)
  lines = [" ".join(rng.choice(WORDS, 6)).capitalize() + "." for _ in range(400)]
  path.write_text(first_line + "\n".join(lines), encoding="utf-8")
  return str(path)


def write_paragraphs(path, count=60, words=2, seed=0):
  """`count` short paragraphs of `words` words each, blank lines between: a corpus of many
  small documents for prepare_data."""
  rng = np.random.default_rng(seed)
  paragraphs = [" ".join(rng.choice(WORDS, words)).capitalize() + "." for _ in range(count)]
  path.write_text("\n\n".join(paragraphs), encoding="utf-8")
  return str(path)


def tiny_config(text_path: str, causal: bool = False):
  """configs/shakespeare_char.py (or the causal reference) cut to seconds on a tiny corpus."""
  c = CONFIGS[causal]()
  c.task_kwargs.update(text_path=text_path, length=16)
  c.model.update(d_model=32, num_layers=1, num_heads=2, d_ff=64)
  c.batch_size = 16
  c.train.update(num_steps=30, warmup_steps=5)
  c.checkpoint.update(every=15)
  c.eval_every = 0
  c.eval_batches = 1
  c.log_every = 15
  c.num_eval_samples = 0 if causal else 8
  c.sampler.update(steps=4)
  return c
