"""Optimizer-state bytes of full fine-tuning against LoRA, at LLaDA-8B's shape and measured.

  python experiments/lora_memory.py [--out=results]

Writes results/lora_memory.json. The optimizer is the train loop's (`mdjax.train.state.
make_optimizer`: clipping and AdamW, `lora.optimizer` around it with `train.lora` on) on
float32 master weights, as mdjax fine-tunes (SFT converts a published start to float32).
Rows: full fine-tuning, and LoRA of rank 8 and 64 on q, k, v, o and on every matrix
(attention and mlp: q, k, v, o, gate, up, down).

`llada_8b`: LLaDA-8B's shape (d_model 4096, 32 layers, 32 heads, MLP 12288, 126,464 ids),
computed with jax.eval_shape from `published.init_params` (nothing is allocated), and XLA's
memory analysis of its train step compiled for bfloat16 compute on a batch of 1 x 512
tokens (compiled for this machine's backend, never run: a GPU's figures differ somewhat).
`measured`: a small LLaDA-shaped model (d_model 256, 4 layers, MLP 688, 2,048 ids), its
params drawn (seed 0) and the optimizer state built for real; bytes summed over the state's
arrays (`nbytes`), beside the same count from shapes (they must agree); and XLA's memory
analysis of the compiled train step (`train_step`, the state donated as the loop does, the
NELBO on a batch of 4 x 128 tokens, float32 compute): the state it reads and writes, and
its temporary buffers (gradients, activations, merged weights, updates).
"""

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402

from configs.base import base_config  # noqa: E402
from mdjax import diffusion, lora  # noqa: E402
from mdjax.models import published  # noqa: E402
from mdjax.train.sft import PublishedView  # noqa: E402
from mdjax.train.state import TrainState, make_optimizer, train_step  # noqa: E402

SEED = 0
ATTENTION = ("attention",)
ALL = ("attention", "mlp")
SETTINGS = (("full", 0, ()), ("lora r8 qkvo", 8, ATTENTION), ("lora r64 qkvo", 64, ATTENTION),
            ("lora r8 all", 8, ALL), ("lora r64 all", 64, ALL))

LLADA_8B = published.PublishedConfig(
    family="llada", vocab_size=126464, d_model=4096, num_layers=32, num_heads=32,
    num_kv_heads=32, head_dim=128, mlp_hidden=12288, rope_theta=500000.0, norm_eps=1e-5,
    qkv_bias=False, logit_shift=False, mask_id=126336, eos_id=126081, dtype="float32")
SMALL_BATCH = (4, 128)  # the measured train step's batch: rows, tokens
LLADA_BATCH = (1, 512)  # the 8B step's (d1's rows: a 256-token prompt and completion)
SMALL = dataclasses.replace(LLADA_8B, vocab_size=2048, d_model=256, num_layers=4, num_heads=4,
                            num_kv_heads=4, head_dim=64, mlp_hidden=688, mask_id=2047,
                            eos_id=2046)


def train_config(rank: int, targets: tuple[str, ...]):
  """The `train` section of a run: LoRA of `rank` on `targets` (rank 0: full)."""
  train = base_config().train
  train.lora.rank = rank
  if rank:
    train.lora.targets = targets
  return train


def state_of(params, rank: int, targets: tuple[str, ...]):
  """(trained params, optimizer state) of a setting: the adapters (or every parameter) and
  the train loop's optimizer state over {"base", "lora"} (or the params)."""
  train = train_config(rank, targets)
  if rank:
    config = lora.config_of(train)
    adapters = lora.init(params, config, jax.random.fold_in(jax.random.key(SEED), lora.LORA_INIT))
    params, trained = {"base": params, "lora": adapters}, adapters
  else:
    trained = params
  return trained, make_optimizer(train).init(params)


def row(name, rank, targets, trained, opt_state, full_bytes, measured_bytes=None) -> dict:
  out = {"setting": name, "rank": rank, "targets": list(targets),
         "trained_params": int(sum(x.size for x in jax.tree.leaves(trained))),
         "optimizer_state_bytes": lora.count_bytes(opt_state),
         "optimizer_state_arrays": sum(1 for x in jax.tree.leaves(opt_state) if x.ndim > 0)}
  out["fraction_of_full"] = out["optimizer_state_bytes"] / full_bytes
  if measured_bytes is not None:
    out["measured_optimizer_state_bytes"] = measured_bytes
  return out


def computed(config) -> dict:
  """Every setting at `config`'s shape, from shapes only; the train step compiled for
  bfloat16 compute (float32 master weights, as SFT runs a published start)."""
  params = jax.eval_shape(lambda key: published.init_params(config, key), jax.random.key(SEED))
  compute = dataclasses.replace(config, dtype="bfloat16")
  rows, full = [], None
  for name, rank, targets in SETTINGS:
    trained, opt_state = jax.eval_shape(lambda p: state_of(p, rank, targets), params)
    full = full or lora.count_bytes(opt_state)
    rows.append(row(name, rank, targets, trained, opt_state, full))
    rows[-1].update(step_memory(compute, params, rank, targets, opt_state, LLADA_BATCH))
  return {"params": published.num_params(config), "param_bytes": lora.count_bytes(params),
          "step_batch": list(LLADA_BATCH), "step_compute_dtype": "bfloat16", "rows": rows}


def step_memory(config, params, rank: int, targets: tuple[str, ...], opt_state,
                batch: tuple[int, int]) -> dict:
  """XLA's memory analysis of the compiled train step of a setting on a batch of `batch`
  (rows, tokens): compiled, never run, nothing allocated."""
  train = train_config(rank, targets)
  apply_fn = PublishedView(config).denoiser()
  if rank:
    lora_config = lora.config_of(train)
    adapters = jax.eval_shape(lambda p: lora.init(p, lora_config, jax.random.key(SEED)), params)
    params, apply_fn = {"base": params, "lora": adapters}, lora.adapt(apply_fn, lora_config)
  loss_fn = functools.partial(diffusion.nelbo_loss, apply_fn, schedule=diffusion.LinearSchedule(),
                              mask_id=config.vocab_size)
  state = TrainState(step=jax.ShapeDtypeStruct((), jax.numpy.int32), params=params,
                     opt_state=opt_state, ema_params=None)
  step = jax.jit(functools.partial(train_step, loss_fn=loss_fn, optimizer=make_optimizer(train),
                                   ema_decay=0.0, seed=SEED), donate_argnums=0)
  x_BxL = jax.ShapeDtypeStruct(batch, jax.numpy.int32)
  analysis = step.lower(state, x_BxL).compile().memory_analysis()
  return {"step_argument_bytes": int(analysis.argument_size_in_bytes),
          "step_temporary_bytes": int(analysis.temp_size_in_bytes)}


def measured(config) -> dict:
  """Every setting on `config`'s model with the state allocated: its arrays' bytes; and the
  compiled train step's memory."""
  params = published.init_params(config, jax.random.key(SEED))
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  rows, full = [], None
  for name, rank, targets in SETTINGS:
    trained, opt_state = jax.jit(lambda p: state_of(p, rank, targets))(params)
    arrays = [x for x in jax.tree.leaves(opt_state) if isinstance(x, jax.Array)]
    nbytes = int(sum(x.nbytes for x in arrays))
    full = full or nbytes
    rows.append(row(name, rank, targets, trained, opt_state, full, measured_bytes=nbytes))
    if nbytes != rows[-1]["optimizer_state_bytes"]:
      raise AssertionError(f"{name}: {nbytes} bytes allocated, {rows[-1]} from shapes")
    opt_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), opt_state)
    rows[-1].update(step_memory(config, shapes, rank, targets, opt_shapes, SMALL_BATCH))
    del opt_state
  return {"params": published.num_params(config), "param_bytes": lora.count_bytes(params),
          "step_batch": list(SMALL_BATCH), "rows": rows}


def shape_of(config) -> dict:
  return {k: getattr(config, k) for k in ("d_model", "num_layers", "num_heads", "head_dim",
                                           "mlp_hidden", "vocab_size")}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="results")
  args = parser.parse_args()
  results = {
      "command": "python experiments/lora_memory.py",
      "optimizer": "train loop's: clip_by_global_norm + adamw (float32 moments mu, nu); "
                   "LoRA: lora.optimizer (state for the adapters only)",
      "machine": {"platform": platform.platform(), "jax": jax.__version__,
                  "device": jax.devices()[0].device_kind},
      "llada_8b": {"shape": shape_of(LLADA_8B), **computed(LLADA_8B)},
      "measured": {"shape": shape_of(SMALL), **measured(SMALL)},
  }
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "lora_memory.json")
  with open(path, "w") as f:
    json.dump(results, f, indent=1)
  for part in ("llada_8b", "measured"):
    print(f"{part}: {results[part]['params']:,} parameters")
    for r in results[part]["rows"]:
      print(f"  {r['setting']:>14}: {r['trained_params']:>13,} trained, optimizer state "
            f"{r['optimizer_state_bytes'] / 2**20:>10,.1f} MiB ({r['fraction_of_full']:.4%})"
            + (f"; step: state {r['step_argument_bytes'] / 2**20:.1f} MiB, temporary "
               f"{r['step_temporary_bytes'] / 2**20:.1f} MiB" if "step_argument_bytes" in r
               else ""))
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
