#!/usr/bin/env bash
# The sampling benchmarks on one GPU in bfloat16 (configs/bench_gpu.py, then the KV cache's
# configs/bench_kv_cache_gpu.py), at most 5 minutes each.
# Needs a python3 with jax (CUDA), flax, optax, orbax-checkpoint and matplotlib; ml-collections
# is installed from wheels in .whl/ when missing (machines without network).
# Writes results/bench_gpu.{json,md,png} and results/bench_kv_cache_gpu.*, or $OUT/... when
# OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import ml_collections" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-index --find-links .whl ml-collections
fi
"$PY" -c "import jax; assert jax.default_backend() == 'gpu', jax.devices(); print(jax.devices())"
PYTHONPATH=. timeout 300 "$PY" -m mdjax.bench --config=configs/bench_gpu.py \
  --out="${OUT:-results}/bench_gpu"
PYTHONPATH=. timeout 300 "$PY" -m mdjax.bench --config=configs/bench_kv_cache_gpu.py \
  --out="${OUT:-results}/bench_kv_cache_gpu"
