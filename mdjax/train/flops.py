"""Model FLOPs per token, accelerator peaks and MFU (model FLOPs utilization).

The accounting is PaLM's (Chowdhery et al. 2022, appendix B): a training token costs
6 N + 12 n_layer d_model T matmul FLOPs, N the parameters multiplied with every token's
activations (forward 2 N, backward 4 N) and 12 n_layer d_model T the attention scores and
weighted sums over a context of T positions (forward and backward; the full T x T matrix,
as this Transformer computes it whatever the mask). N here counts the blocks' projections
and the output head; the input embedding (a lookup), the norms and the time-conditioning
layers (applied once per sequence, not per token) are left out. A BD3-LM trained on the
block NELBO runs each pass over 2 L positions (the noisy and the clean copy), so its
blocks and attention count twice per training token (its head once). These are model
FLOPs: rematerialization's recomputed forward is not counted, so MFU does not reward it.

MFU = tokens/s x FLOPs per token / (devices x peak FLOP/s per device).
`peak_flops_per_device` reads `train.peak_flops`, else the device's dense bf16 figure in
`PEAK_BF16_FLOPS`, else (`train.measure_peak_flops=True`) a matmul benchmark; without any
of these `mfu` is None.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mdjax import models, tasks
from mdjax.train.state import model_config

# Dense (no sparsity) bf16 FLOP/s of one JAX device, matched as a lowercase substring of
# `device.device_kind`, first match wins. Sources: NVIDIA's H100, H200 and A100 datasheets
# (their "with sparsity" figures halved: H100 SXM 1,979 -> 989 TFLOPS, H100 PCIe 1,513 ->
# 756, H200 1,979 -> 989, A100 312 dense); Google Cloud's TPU system architecture pages
# (per chip, which JAX shows as one device: v4 275, v5e 197, v5p 459, v6e 918 TFLOPS).
PEAK_BF16_FLOPS = (
    ("h200", 989e12),
    ("h100 pcie", 756e12),
    ("h100", 989e12),
    ("a100", 312e12),
    ("tpu v4", 275e12),
    ("tpu v5 lite", 197e12),  # v5e's device_kind
    ("tpu v5e", 197e12),
    ("tpu v5p", 459e12),
    ("tpu v5", 459e12),  # v5p's device_kind
    ("tpu v6 lite", 918e12),  # v6e (Trillium)
)


def matmul_params(cfg: models.TransformerConfig) -> int:
  """N of the accounting: the weights every token's activations are multiplied with (the
  blocks' qkv, output, MLP projections and the output head)."""
  d = cfg.d_model
  hidden = 2 * cfg.d_ff if cfg.mlp == "swiglu" else cfg.d_ff
  per_block = d * 3 * d + d * d + d * hidden + cfg.d_ff * d
  return cfg.num_layers * per_block + d * cfg.vocab_size


def flops_per_token(cfg: models.TransformerConfig, seq_len: int,
                    block_pair: bool = False) -> float:
  """Training FLOPs per token (forward and backward) of sequences of `seq_len` tokens:
  6 N + 12 n_layer d_model T, T = seq_len; with `block_pair` (BD3-LM's training pass over
  the noisy and clean copies) the blocks and the attention over T = 2 seq_len count twice."""
  d, layers = cfg.d_model, cfg.num_layers
  head = d * cfg.vocab_size
  blocks = matmul_params(cfg) - head
  copies = 2 if block_pair else 1
  context = copies * seq_len
  return float(6 * (copies * blocks + head) + copies * 12 * layers * d * context)


def model_flops_per_token(config, task: tasks.Task) -> float:
  """`flops_per_token` of a training config's model, task length and objective."""
  cfg = model_config(config, task)
  block_pair = config.objective == "nelbo" and cfg.block_size is not None
  return flops_per_token(cfg, task.length, block_pair)


def known_peak_flops(device_kind: str) -> float | None:
  """The dense bf16 peak of a device kind from `PEAK_BF16_FLOPS`, or None."""
  kind = device_kind.lower()
  for name, peak in PEAK_BF16_FLOPS:
    if name in kind:
      return peak
  return None


@functools.lru_cache(maxsize=8)
def measure_peak_flops(size: int = 1024, dtype: str = "float32", repeats: int = 5) -> float:
  """FLOP/s per device of a size x size matmul, run on every local device at once (so
  devices that share a host's cores, as simulated CPU devices do, share them here too):
  the best of `repeats` timed calls, after a compiling one."""
  devices = np.array(jax.local_devices())
  mesh = Mesh(devices, ("d",))
  sharding = NamedSharding(mesh, PartitionSpec("d"))
  shape = (len(devices), size, size)
  a = jax.device_put(jnp.ones(shape, dtype), sharding)
  b = jax.device_put(jnp.full(shape, 0.5, dtype), sharding)
  matmul = jax.jit(lambda x, y: jnp.einsum("nij,njk->nik", x, y), out_shardings=sharding)
  jax.block_until_ready(matmul(a, b))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(matmul(a, b))
    best = min(best, time.perf_counter() - start)
  return 2.0 * size ** 3 / best


def peak_flops_per_device(config=None) -> float | None:
  """Peak FLOP/s of one device: `train.peak_flops` when set, else the table's figure for
  this device kind, else a measured matmul when `train.measure_peak_flops`, else None."""
  train = {} if config is None else config.get("train", {})
  configured = train.get("peak_flops")
  if configured is not None:
    return float(configured)
  known = known_peak_flops(jax.devices()[0].device_kind)
  if known is not None:
    return known
  if train.get("measure_peak_flops", False):
    return measure_peak_flops()
  return None


def mfu(config, task: tasks.Task, tokens_per_s: float, num_devices: int,
        peak_flops: float | None = None) -> float | None:
  """Model FLOPs utilization of a training run: tokens_per_s x `model_flops_per_token` /
  (num_devices x peak). `peak_flops` (per device) defaults to `peak_flops_per_device`;
  None when no peak is known."""
  if not (isinstance(num_devices, (int, np.integer)) and num_devices >= 1):
    raise ValueError(f"num_devices={num_devices!r} must be an integer >= 1.")
  if not (np.isfinite(tokens_per_s) and tokens_per_s >= 0):
    raise ValueError(f"tokens_per_s={tokens_per_s!r} must be a finite number >= 0.")
  peak = peak_flops_per_device(config) if peak_flops is None else peak_flops
  if peak is None:
    return None
  return tokens_per_s * model_flops_per_token(config, task) / (num_devices * peak)
