"""KV-cached block decoding on the CPU: the bench_cpu model (4.2M parameters at L = 64).

Confidence decoding in blocks of 32, uncached against the dual cache. The uncached sampler
costs K full passes, so the CPU runs the cells it can afford (about 30 min on 2 cores):
L = 256 at batch 1 and 8, and L = 1024 and 2048 at batch 1, K from L/8 to L (2048: L/8).
configs/bench_kv_cache_gpu.py runs the whole grid.
"""

import ml_collections

from configs.bench_cpu import get_config as bench_cpu


def get_config():
  c = bench_cpu()
  c.kv_cache = ml_collections.ConfigDict()
  c.kv_cache.block = 32
  # (L, batch, K as fractions of L)
  c.kv_cache.cells = ((256, 1, (1 / 8, 1 / 4, 1 / 2, 1)), (256, 8, (1 / 8, 1 / 4, 1 / 2, 1)),
                      (1024, 1, (1 / 8, 1 / 4, 1 / 2, 1)), (2048, 1, (1 / 8,)))
  c.kv_cache.repeats = 3
  c.out = "results/bench_kv_cache"
  return c
