"""Sampling throughput per step count K: three implementations of each sampler side by side.

  scan         mdjax's sampler: the whole trajectory in one lax.scan program;
  python_loop  the same jitted step called K times from Python (how the PyTorch
               reference samplers of LLaDA, MDLM and ReMDM run);
  forward_only K bare denoiser forward passes of the same model in one program:
               the floor any sampler pays.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp

from mdjax import sampling
from mdjax.bench.timing import compiled_peak_bytes, interleaved_medians, timed_compile

IMPLS = ("scan", "python_loop", "forward_only")
SAMPLERS = ("ancestral", "confidence", "remask", "blocks", "ancestral_no_skip",
            "confidence_no_skip")
NO_SKIP = "_no_skip"  # the sampler with skip_idle_steps=False: a scan over every step
BLOCKS = "blocks"  # confidence decoding in semi-AR blocks


def sweep_spec(sampler: str, steps: int, length: int, num_blocks: int) -> sampling.SamplerSpec:
  """The spec a sampler of the sweep times at K steps: its family's `bench_spec`.

  `blocks` is confidence decoding in `num_blocks` semi-AR blocks; `<name>_no_skip` is
  `<name>` with skip_idle_steps=False.
  """
  if sampler not in SAMPLERS:
    raise ValueError(f"sampler={sampler!r} must be one of {SAMPLERS}.")
  name = sampler.removesuffix(NO_SKIP)
  family = sampling.families()["confidence" if name == BLOCKS else name]
  spec = family.bench_spec(steps, length)
  if name == BLOCKS:
    spec = dataclasses.replace(spec, block_length=length // num_blocks)
  if sampler.endswith(NO_SKIP):
    spec = dataclasses.replace(spec, skip_idle_steps=False)
  return spec


def forward_only_program(apply_fn, steps: int):
  """K denoiser passes in one scan; each input depends on the last output, so none is elided."""

  def run(params, tokens_BxL):
    vocab = jax.eval_shape(apply_fn, params, tokens_BxL, jnp.zeros(tokens_BxL.shape[:1])).shape[-1]

    def body(tokens, t):
      logits_BxLxV = apply_fn(params, tokens, jnp.full(tokens.shape[:1], t))
      return (tokens + (logits_BxLxV[..., 0] > 0)) % (vocab + 1), None

    return jax.lax.scan(body, tokens_BxL, jnp.linspace(1.0, 0.0, steps))[0]

  return jax.jit(run)


def bench_step_count(apply_fn, params, canvas_BxL, samplers, steps: int, num_blocks: int,
                     repeats: int, key) -> list[dict]:
  """Every implementation at K steps, compiled first, then timed in interleaved rounds."""
  length = canvas_BxL.shape[1]
  forward = forward_only_program(apply_fn, steps)
  compiled_fwd, fwd_args, fwd_compile_s = timed_compile(
      lambda: (forward.lower(params, canvas_BxL), (params, canvas_BxL)))
  calls = {("forward", "forward_only"): functools.partial(compiled_fwd, *fwd_args)}
  rows = {("forward", "forward_only"): dict(compile_s=fwd_compile_s, nfe=steps,
                                            peak_bytes=compiled_peak_bytes(compiled_fwd))}
  for sampler in samplers:
    spec = sweep_spec(sampler, steps, length, num_blocks)
    compiled, args, compile_s = timed_compile(
        lambda: sampling.lower(apply_fn, params, key, canvas_BxL, spec))
    nfe = int(compiled(*args).nfe)
    calls[sampler, "scan"] = functools.partial(compiled, *args)
    rows[sampler, "scan"] = dict(compile_s=compile_s, nfe=nfe,
                                 peak_bytes=compiled_peak_bytes(compiled))
    loop = functools.partial(sampling.sample_python_loop, apply_fn, params, key, canvas_BxL, spec)
    start = time.perf_counter()
    jax.block_until_ready(loop())  # the first call compiles the step (once, whatever K is)
    calls[sampler, "python_loop"] = loop
    rows[sampler, "python_loop"] = dict(compile_s=time.perf_counter() - start, nfe=nfe,
                                        peak_bytes=None)
  medians = interleaved_medians(calls, repeats)
  out = []
  for (sampler, impl), row in rows.items():
    time_s = medians[sampler, impl]
    if impl == "python_loop":  # its first call ran the loop once too
      row["compile_s"] = max(row["compile_s"] - time_s, 0.0)
    out.append(dict(sampler=sampler, impl=impl, K=steps, time_s=time_s, **row))
  return out


def add_rates(found: list[dict], shape: dict) -> None:
  """Adds the shape, the rates and the two ratios to the rows of one K (forward row first)."""
  forward = found[0]
  batch, length = shape["batch"], shape["seq_len"]
  for row in found:
    row.update(shape, tokens_per_s=batch * length / row["time_s"],
               seqs_per_s=batch / row["time_s"])
    if row["impl"] == "forward_only":
      continue
    mine = {r["impl"]: r for r in found if r["sampler"] == row["sampler"]}
    scan, loop = mine["scan"], mine["python_loop"]
    row["overhead_vs_forward"] = scan["time_s"] / (forward["time_s"] * scan["nfe"] / row["K"])
    row["loop_over_scan"] = loop["time_s"] / scan["time_s"]


def sweep(apply_fn, params, canvas_BxL, config, shape: dict, key, log=print) -> list[dict]:
  """Every sampler of `config.samplers` at every K of `config.steps`: the `rows` of the JSON."""
  rows = []
  for steps in config.steps:
    found = bench_step_count(apply_fn, params, canvas_BxL, config.samplers, steps,
                             config.num_blocks, config.repeats, key)
    add_rates(found, shape)
    for row in found:
      log(f"K={steps:4d} {row['sampler']:10s} {row['impl']:12s} {row['time_s'] * 1e3:9.2f} ms "
          f"compile {row['compile_s']:.2f} s")
    rows += found
  return rows
