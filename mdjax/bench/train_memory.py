"""The compiled memory of one train step with and without remat and gradient accumulation.

  python -m mdjax.bench.train_memory [--d_model=256 --num_layers=4 --batch_size=8 --length=1024]

Compiles (never runs) the train step of a bfloat16 Transformer on Shakespeare characters
and prints XLA's memory analysis of each program: the temporary buffers (activations kept
for the backward pass and everything else the step allocates beside its arguments and
outputs). On CPU the figures for remat depend on one XLA pass: XLA:CPU expands
jax.checkpoint's optimization barriers before common-subexpression elimination, which then
merges the recomputed forward back into the first one, so remat saves nothing unless the
pass is off:

  XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander python -m mdjax.bench.train_memory
"""

from __future__ import annotations

import argparse
import functools
import os

import jax

from mdjax import data, tasks
from mdjax.train import state as train_state


def temp_mib(remat: bool, grad_accum_steps: int, d_model: int, num_layers: int,
             batch_size: int, length: int) -> float:
  """MiB of temporary buffers of the compiled train step."""
  from configs import shakespeare_char  # the repository's configs/ (run from its root)
  config = shakespeare_char.get_config()
  config.task_kwargs.length, config.batch_size = length, batch_size
  config.model.update(d_model=d_model, num_layers=num_layers, num_heads=d_model // 64,
                      d_ff=4 * d_model, dtype="bfloat16", remat=remat)
  task = tasks.from_config(config)
  state, _, apply_fn, _ = train_state.init_state(config, train_state.make_mesh(1), task)
  step = jax.jit(functools.partial(
      train_state.train_step, loss_fn=train_state.make_loss_fn(config, apply_fn, task),
      optimizer=train_state.make_optimizer(config.train), ema_decay=0.0, seed=0,
      grad_accum_steps=grad_accum_steps))
  compiled = step.lower(state, data.batch_for_step(config, 0, task)).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 2**20


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  for name, default in (("d_model", 256), ("num_layers", 4), ("batch_size", 8),
                        ("length", 1024)):
    parser.add_argument(f"--{name}", type=int, default=default)
  args = parser.parse_args(argv)
  print(f"{jax.devices()[0].device_kind}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print(f"bfloat16, d_model {args.d_model}, {args.num_layers} layers, batch {args.batch_size} "
        f"x {args.length} tokens")
  for remat, accum in ((False, 1), (True, 1), (False, 4), (True, 4)):
    mib = temp_mib(remat, accum, args.d_model, args.num_layers, args.batch_size, args.length)
    print(f"remat={remat!s:5} grad_accum_steps={accum}: {mib:8.1f} MiB temporary", flush=True)


if __name__ == "__main__":
  main()
