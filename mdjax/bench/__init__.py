"""Sampling benchmarks: throughput per step count, sampler overheads, and the KV cache.

  python -m mdjax.bench --config=configs/bench_cpu.py [--config.batch=8 ...]
  python -m mdjax.bench --config=configs/bench_cpu.py --workdir=DIR   # a trained checkpoint
  python -m mdjax.bench --config=configs/bench_kv_cache.py   # KV cache (bench.kv_cache)

For each sampler and step count K the sampling benchmark (`run`) times the scan
sampler, a Python loop of its jitted step and K bare forward passes (`throughput`);
then every registered family at its `Family.bench_spec` against its forward passes,
`sample()`'s call path, and the sampler's own work per step (`overhead`); then
training throughput and the forward pass's achieved FLOP/s against a large matmul's
(`compute`). Times are medians of interleaved rounds after a warm-up, with
block_until_ready (`timing`). `write` gives results/bench_*.{json,md,png}.

Modules import one way: throughput, compute and kv_cache use timing; overhead uses
throughput; suite uses all four; report uses none of them; __main__ uses suite, report
and kv_cache.

Single benchmarks, each `python -m mdjax.bench.NAME` from the repository root: `dit` and
`pretrained` (mdjax against the reference PyTorch loops of tests/reference/, the
`[reference]` extra), `pretrained_gpu`, `step_profile` (uses overhead and timing),
`train_memory`, `eos` (EOS early stop; experiments/eos_long.py) and `noise_text` (absorbing,
uniform and hybrid noise on Shakespeare at equal training tokens). They use timing at most.
"""

from mdjax.bench.report import write
from mdjax.bench.suite import run
from mdjax.bench.throughput import IMPLS, SAMPLERS

__all__ = ["IMPLS", "SAMPLERS", "run", "write"]
