"""KV-cached block decoding on one GPU in bfloat16: the bench_gpu model (d_model 512, 8 layers).

The whole grid: L in {256, 1024, 2048}, batch 1 and 8, K in {L/8, L/4, L/2, L}, blocks of 32
(experiments/bench_gpu.sh, a few minutes on one H100/H200-class GPU).
"""

from configs.bench_gpu import get_config as bench_gpu
from configs.bench_kv_cache import get_config as bench_kv_cache


def get_config():
  c = bench_gpu()
  c.kv_cache = bench_kv_cache().kv_cache
  fractions = (1 / 8, 1 / 4, 1 / 2, 1)
  c.kv_cache.cells = tuple((length, batch, fractions) for length in (256, 1024, 2048)
                           for batch in (1, 8))
  c.out = "results/bench_kv_cache_gpu"
  return c
