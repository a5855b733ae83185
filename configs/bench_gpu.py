"""Sampling benchmark on one GPU in bfloat16: a 25M-parameter denoiser, batch 32, L = 256.

Sized to finish in under 5 minutes on one H100/H200-class GPU (experiments/bench_gpu.sh).
"""

from configs.bench_cpu import get_config as cpu


def get_config():
  c = cpu()
  c.model.update(d_model=512, num_layers=8, num_heads=8, d_ff=2048, dtype="bfloat16")
  c.vocab_size = 256
  c.seq_len = 256
  c.batch = 32
  c.steps = (8, 32, 128, 256)
  c.samplers = ("ancestral", "confidence", "remask")
  c.train_batch = 32
  c.matmul_size = 8192
  c.out = "results/bench_gpu"
  return c
