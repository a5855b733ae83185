"""The machine's side of the benchmark: training throughput, the forward pass's FLOPs and
achieved FLOP/s, against a large matmul's."""

from __future__ import annotations

import functools
import math
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from mdjax import diffusion, models
from mdjax import train as train_lib
from mdjax.bench.timing import median_time


def forward_flops(apply_fn, params, tokens_BxL, model_cfg: models.TransformerConfig) -> float:
  """FLOPs of one forward pass: XLA's cost analysis, else an analytic count."""
  compiled = jax.jit(apply_fn).lower(params, tokens_BxL, jnp.zeros(tokens_BxL.shape[:1])).compile()
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    if cost and cost.get("flops", 0) > 0:
      return float(cost["flops"])
  except Exception:
    pass
  return analytic_forward_flops(model_cfg, *tokens_BxL.shape)


def analytic_forward_flops(cfg: models.TransformerConfig, batch: int, length: int) -> float:
  """2 x multiply-adds of the matmuls: projections, attention scores and values, MLP, head."""
  d, tokens = cfg.d_model, batch * length
  mlp_in = 2 * cfg.d_ff if cfg.mlp == "swiglu" else cfg.d_ff
  per_layer = 2 * tokens * (4 * d * d + d * mlp_in + cfg.d_ff * d) + 4 * batch * length ** 2 * d
  return float(cfg.num_layers * per_layer + 2 * tokens * d * cfg.vocab_size)


def peak_matmul_flops_per_s(size: int, dtype: str, repeats: int) -> float:
  """FLOP/s of a large square matmul, its fastest of `repeats` calls: the practical peak."""
  a = jax.random.normal(jax.random.key(0), (size, size), jnp.dtype(dtype))
  b = jax.random.normal(jax.random.key(1), (size, size), jnp.dtype(dtype))
  matmul = jax.jit(jnp.matmul)
  jax.block_until_ready(matmul(a, b))
  best = math.inf
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(matmul(a, b))
    best = min(best, time.perf_counter() - start)
  return 2.0 * size ** 3 / best


def train_tokens_per_s(config, model_cfg, repeats: int) -> float:
  """Tokens per second of the pure train step (MD4 NELBO, AdamW) on random tokens."""
  graphdef, params, apply_fn = models.init(model_cfg, seed=0)
  params = nnx.to_pure_dict(params)
  optimizer = train_lib.make_optimizer(config.train)
  state = train_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                               opt_state=optimizer.init(params), ema_params=None)
  loss_fn = functools.partial(diffusion.nelbo_loss, apply_fn,
                              schedule=diffusion.LinearSchedule(), mask_id=model_cfg.vocab_size)
  step = jax.jit(functools.partial(train_lib.train_step, loss_fn=loss_fn, optimizer=optimizer,
                                   ema_decay=0.0, seed=0))
  x_BxL = jax.random.randint(jax.random.key(2), (config.train_batch, config.seq_len), 0,
                             model_cfg.vocab_size)
  time_s = median_time(lambda: step(state, x_BxL)[1]["loss"], repeats)
  return config.train_batch * config.seq_len / time_s


def train_and_flops(config, model_cfg, apply_fn, params, canvas_BxL, rows) -> dict:
  """The `train` entry of the JSON: training throughput, and the forward pass's FLOP/s (its
  time the median over K of the sweep's forward_only rows) against the matmul's."""
  flops = forward_flops(apply_fn, params, canvas_BxL, model_cfg)
  forward_1 = statistics.median(r["time_s"] / r["K"] for r in rows if r["impl"] == "forward_only")
  peak = peak_matmul_flops_per_s(config.matmul_size, model_cfg.dtype, config.repeats)
  train = dict(tokens_per_s=train_tokens_per_s(config, model_cfg, config.repeats),
               flops_per_s=flops / forward_1, peak_matmul_flops_per_s=peak,
               forward_flops=flops)
  train["utilisation"] = train["flops_per_s"] / peak
  return train
