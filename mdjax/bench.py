"""Sampling throughput per step count, three implementations side by side.

  python -m mdjax.bench --config=configs/bench_cpu.py [--config.batch=8 ...]
  python -m mdjax.bench --config=configs/bench_cpu.py --workdir=DIR   # a trained checkpoint
  python -m mdjax.bench --config=configs/bench_kv_cache.py   # KV cache (mdjax.bench_kv_cache)

For each sampler family and step count K it times, in one run:
  scan         mdjax's sampler: the whole trajectory in one lax.scan program;
  python_loop  the same jitted step called K times from Python (how the PyTorch
               reference samplers of LLaDA, MDLM and ReMDM run);
  forward_only K bare denoiser forward passes of the same model in one program:
               the floor any sampler pays.
Times are medians of `repeats` calls after a warm-up, with block_until_ready.
It also measures training throughput and the forward pass's achieved FLOP/s
against a large matmul's. Writes results/bench_*.{json,md,png}.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mdjax import diffusion, models, report, sampling, tasks
from mdjax import train as train_lib

IMPLS = ("scan", "python_loop", "forward_only")
FAMILIES = ("ancestral", "confidence", "remask", "blocks", "ancestral_no_skip",
            "confidence_no_skip")
_NO_SKIP = "_no_skip"  # the family with skip_idle_steps=False: a scan over every step


def interleaved_medians(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
  """Median wall time of each fn (results blocked on) over `repeats` rounds, after a warm-up.

  Each round calls every fn once, so a change in the machine's load falls on all
  of them alike and their ratios stay meaningful on a shared machine.
  """
  for fn in fns.values():
    jax.block_until_ready(fn())
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(values) for name, values in times.items()}


def median_time(fn: Callable[[], Any], repeats: int) -> float:
  return interleaved_medians({"fn": fn}, repeats)["fn"]


def family_spec(family: str, steps: int, length: int, num_blocks: int) -> sampling.SamplerSpec:
  """The benchmarked spec of a family at K steps."""
  if family.endswith(_NO_SKIP) and family in FAMILIES:
    spec = family_spec(family.removesuffix(_NO_SKIP), steps, length, num_blocks)
    return dataclasses.replace(spec, skip_idle_steps=False)
  if family == "ancestral":
    return sampling.AncestralSpec(steps=steps)
  if family == "confidence":
    return sampling.ConfidenceSpec(steps=steps)
  if family == "remask":
    return sampling.RemaskSpec(steps=steps, eta=0.05)
  if family == "blocks":
    return sampling.ConfidenceSpec(steps=steps, block_length=length // num_blocks)
  raise ValueError(f"sampler={family!r} must be one of {FAMILIES}.")


def forward_only_program(apply_fn, steps: int):
  """K denoiser passes in one scan; each input depends on the last output, so none is elided."""

  def run(params, tokens_BxL):
    vocab = jax.eval_shape(apply_fn, params, tokens_BxL, jnp.zeros(tokens_BxL.shape[:1])).shape[-1]

    def body(tokens, t):
      logits_BxLxV = apply_fn(params, tokens, jnp.full(tokens.shape[:1], t))
      return (tokens + (logits_BxLxV[..., 0] > 0)) % (vocab + 1), None

    return jax.lax.scan(body, tokens_BxL, jnp.linspace(1.0, 0.0, steps))[0]

  return jax.jit(run)


def _compiled_peak_bytes(compiled) -> int | None:
  """Peak memory XLA reserves for a compiled program (arguments + outputs + temporaries)."""
  try:
    mem = compiled.memory_analysis()
  except Exception:  # not every backend reports it
    return None
  if mem is None:
    return None
  return int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
             - mem.alias_size_in_bytes)


def _timed_compile(lower_fn):
  """(compiled program, seconds to trace, lower and compile it); lower_fn -> (lowered, args)."""
  start = time.perf_counter()
  lowered, args = lower_fn()
  compiled = lowered.compile()
  return compiled, args, time.perf_counter() - start


def bench_step_count(apply_fn, params, canvas_BxL, families, steps: int, num_blocks: int,
                     repeats: int, key) -> list[dict]:
  """Every implementation at K steps, compiled first, then timed in interleaved rounds."""
  length = canvas_BxL.shape[1]
  forward = forward_only_program(apply_fn, steps)
  compiled_fwd, fwd_args, fwd_compile_s = _timed_compile(
      lambda: (forward.lower(params, canvas_BxL), (params, canvas_BxL)))
  calls = {("forward", "forward_only"): functools.partial(compiled_fwd, *fwd_args)}
  rows = {("forward", "forward_only"): dict(compile_s=fwd_compile_s, nfe=steps,
                                            peak_bytes=_compiled_peak_bytes(compiled_fwd))}
  for family in families:
    spec = family_spec(family, steps, length, num_blocks)
    compiled, args, compile_s = _timed_compile(
        lambda: sampling.lower(apply_fn, params, key, canvas_BxL, spec))
    nfe = int(compiled(*args).nfe)
    calls[family, "scan"] = functools.partial(compiled, *args)
    rows[family, "scan"] = dict(compile_s=compile_s, nfe=nfe,
                                peak_bytes=_compiled_peak_bytes(compiled))
    loop = functools.partial(sampling.sample_python_loop, apply_fn, params, key, canvas_BxL, spec)
    start = time.perf_counter()
    jax.block_until_ready(loop())  # the first call compiles the step (once, whatever K is)
    calls[family, "python_loop"] = loop
    rows[family, "python_loop"] = dict(compile_s=time.perf_counter() - start, nfe=nfe,
                                       peak_bytes=None)
  medians = interleaved_medians(calls, repeats)
  out = []
  for (sampler, impl), row in rows.items():
    time_s = medians[sampler, impl]
    if impl == "python_loop":  # its first call ran the loop once too
      row["compile_s"] = max(row["compile_s"] - time_s, 0.0)
    out.append(dict(sampler=sampler, impl=impl, K=steps, time_s=time_s, **row))
  return out


# ----------------------------------------------------------------------------
# Overhead: every family against its forward passes, the call path, the step's own work.
# ----------------------------------------------------------------------------


def default_spec(family: str, steps: int, length: int) -> sampling.SamplerSpec:
  """A family at its default settings with K steps on a length-L canvas (all generated).

  The knobs a family has no default for: ordered and field orders write K equal groups
  left to right (field order: two fields, the halves, each spread evenly over K steps);
  speculative drafts L / K positions a round; localized remasking refines a confidence
  run of K / 2 steps with one round of K / 4 ancestral refill steps.
  """
  if family == "ordered":
    return sampling.OrderedSpec(groups=tuple(tuple(int(p) for p in group) for group in
                                             np.array_split(np.arange(length), steps)))
  if family == "field_order":
    half = length // 2
    halves = (tuple(range(half)), tuple(range(half, length)))
    # L writes spread evenly over K steps, the first half's positions first.
    written_K1 = (np.arange(steps + 1) * length) // steps
    first_K = np.diff(np.minimum(written_K1, half))
    counts = np.stack([first_K, np.diff(written_K1) - first_K], -1)
    return sampling.FieldOrderSpec(fields=halves,
                                   counts=tuple(tuple(int(c) for c in row) for row in counts))
  if family == "speculative":
    return sampling.SpeculativeSpec(k=max(length // steps, 1))
  if family == "local_remask":
    return sampling.LocalRemaskSpec(base=sampling.ConfidenceSpec(steps=steps // 2),
                                    refill=sampling.AncestralSpec(steps=max(steps // 4, 1)),
                                    rounds=1)
  if family == "random_order":
    return sampling.RandomOrderSpec()
  return sampling.make_spec(family, steps=steps)


def evaluated_per_row(apply_fn, params, key, canvas_BxL, spec) -> float:
  """The sequences a sampler passes to the denoiser, over the canvas rows: an untimed run
  whose denoiser reports each call's batch to the host. It counts what `contexts_B` leaves
  out: rows evaluated after they finished, and the padded contexts of a round that had
  fewer positions left than contexts (speculative verification)."""
  sizes = []

  def counted(params, tokens_NxL, *args, **kwargs):
    jax.debug.callback(lambda: sizes.append(tokens_NxL.shape[0]))
    return apply_fn(params, tokens_NxL, *args, **kwargs)

  jax.block_until_ready(sampling.sample(counted, params, key, canvas_BxL, spec).tokens_BxL)
  jax.effects_barrier()
  return sum(sizes) / canvas_BxL.shape[0]


def family_overheads(apply_fn, params, canvas_BxL, steps: int, repeats: int, key) -> list[dict]:
  """(i) Every registered family at its defaults against the bare forward passes it makes.

  The floor is the time of one forward pass at this batch (K passes in one program, over
  K) times the sequences the program passes to the denoiser per row (`evaluated`), so 1.0
  means the sampler adds nothing to its denoiser calls. `overhead_vs_forward` divides by
  the sequences the family counts as evaluated instead (`contexts_B`: one per call, J for a
  call of J contexts, only the useful ones), so it also charges the calls' padding.
  """
  length = canvas_BxL.shape[1]
  forward = forward_only_program(apply_fn, steps)
  calls = {"forward": functools.partial(forward, params, canvas_BxL)}
  made = {}
  for family in sorted(sampling.families()):
    spec = default_spec(family, steps, length)
    compiled, args, _ = _timed_compile(
        lambda: sampling.lower(apply_fn, params, key, canvas_BxL, spec))
    result = compiled(*args)
    made[family] = (int(result.nfe), float(jnp.mean(result.contexts_B)),
                    evaluated_per_row(apply_fn, params, key, canvas_BxL, spec))
    calls[family] = functools.partial(compiled, *args)
  medians = interleaved_medians(calls, repeats)
  per_pass = medians["forward"] / steps
  return [dict(sampler=family, K=steps, nfe=nfe, contexts=contexts, evaluated=evaluated,
               time_s=medians[family],
               overhead_vs_forward=medians[family] / (per_pass * contexts),
               overhead_vs_evaluated=medians[family] / (per_pass * evaluated))
          for family, (nfe, contexts, evaluated) in made.items()]


def call_overheads(config, key, repeats: int) -> list[dict]:
  """(ii) Per call, `sample()` against the compiled program from `sampling.lower`, batch 1.

  The difference is the host's work per call (checks, the plan, dispatch) on the bench
  model and on a tiny model (d 64, 2 layers), where it weighs most.
  """
  tiny = config.model.to_dict() | dict(d_model=64, num_layers=2, num_heads=2, d_ff=256)
  out = []
  for name, model in (("bench", config.model.to_dict()), ("tiny", tiny)):
    model_cfg = models.TransformerConfig(vocab_size=config.vocab_size, max_len=config.seq_len,
                                         **model)
    _, params, apply_fn = models.init(model_cfg, seed=0)
    params = nnx.to_pure_dict(params)
    canvas_BxL = jnp.full((1, config.seq_len), config.vocab_size, jnp.int32)
    spec = sampling.ConfidenceSpec(steps=config.call_steps)
    compiled, args, _ = _timed_compile(
        lambda: sampling.lower(apply_fn, params, key, canvas_BxL, spec))
    medians = interleaved_medians({
        "sample": lambda: sampling.sample(apply_fn, params, key, canvas_BxL, spec).tokens_BxL,
        "program": lambda: compiled(*args).tokens_BxL}, repeats)
    out.append(dict(model=name, params=models.count_params(params), batch=1,
                    K=config.call_steps, sample_s=medians["sample"],
                    program_s=medians["program"],
                    ratio=medians["sample"] / medians["program"]))
  return out


# The vocabulary of the step-cost measure's trivial denoiser (ScanAndAdd's size).
STEP_VOCAB = 15


def step_costs(batches, length: int, repeats: int, key) -> list[dict]:
  """(iii) The sampler's own time per step: each family's compiled program with a denoiser
  that is an embedding lookup (logits = table[token], V = 15), K = L steps, over K."""
  table = jax.random.normal(jax.random.key(0), (STEP_VOCAB + 1, STEP_VOCAB))
  apply_fn = _embedding_denoiser
  out = []
  for batch in batches:
    canvas_BxL = jnp.full((batch, length), STEP_VOCAB, jnp.int32)
    calls, steps = {}, {}
    for family in sorted(sampling.families()):
      spec = default_spec(family, length, length)
      compiled, args, _ = _timed_compile(
          lambda: sampling.lower(apply_fn, table, key, canvas_BxL, spec))
      calls[family] = functools.partial(compiled, *args)
      steps[family] = sampling.num_steps(spec, length)
    medians = interleaved_medians(calls, repeats)
    out += [dict(sampler=family, batch=batch, K=steps[family],
                 us_per_step=1e6 * medians[family] / steps[family]) for family in calls]
  return out


def _embedding_denoiser(table, tokens_BxL, t_B):
  del t_B
  return table[tokens_BxL]


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


def machine_info() -> dict:
  device = jax.devices()[0]
  cpu = platform.processor()
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    cpu = names[0] if names else cpu
  return dict(platform=device.platform, device_kind=device.device_kind,
              num_devices=jax.device_count(), cpu=cpu, cpu_count=os.cpu_count(),
              jax=jax.__version__, python=platform.python_version())


def _check_config(config) -> None:
  """Bad settings fail here, before anything compiles."""
  for name in ("batch", "seq_len", "repeats", "train_batch", "matmul_size"):
    value = config[name]
    if not (isinstance(value, int) and value >= 1):
      raise ValueError(f"{name}={value!r} must be an integer >= 1.")
  for name in ("repeats", "overhead_repeats"):
    if not (isinstance(config[name], int) and config[name] >= 5):
      raise ValueError(f"{name}={config[name]!r} must be an integer >= 5 (medians of >= 5 "
                       "calls).")
  steps = tuple(config.steps)
  if not steps or any(not isinstance(k, int) or k < 1 for k in steps):
    raise ValueError(f"steps={steps!r} must be a non-empty list of integers >= 1.")
  unknown = sorted(set(config.samplers) - set(FAMILIES))
  if unknown:
    raise ValueError(f"samplers={list(config.samplers)!r}: unknown {unknown}; allowed {FAMILIES}.")
  if "blocks" in config.samplers:
    if config.seq_len % config.num_blocks:
      raise ValueError(f"num_blocks={config.num_blocks} must divide seq_len={config.seq_len}.")
    bad = [k for k in steps if k % config.num_blocks]
    if bad:
      raise ValueError(f"steps={bad} are not divisible by num_blocks={config.num_blocks} "
                       "(the blocks sampler splits steps evenly across blocks).")
  if not (isinstance(config.step_length, int) and config.step_length >= 4):
    raise ValueError(f"step_length={config.step_length!r} must be an integer >= 4.")
  for name in ("family_steps", "call_steps"):
    value = config[name]
    if not (isinstance(value, int) and 2 <= value <= config.seq_len):
      raise ValueError(f"{name}={value!r} must be an integer in [2, seq_len={config.seq_len}].")
  batches = tuple(config.step_batches)
  if not batches or any(not isinstance(b, int) or b < 1 for b in batches):
    raise ValueError(f"step_batches={batches!r} must be a non-empty list of integers >= 1.")
  if config.model.dtype not in ("float32", "bfloat16"):
    raise ValueError(f"model.dtype={config.model.dtype!r} must be 'float32' or 'bfloat16'.")


def _model(config, workdir: str | None):
  """(model config, apply_fn, params): random init, or a trained checkpoint."""
  if workdir:
    train_config, apply_fn, params, _ = train_lib.load_for_sampling(workdir)
    model_cfg = train_lib.model_config(train_config, tasks.from_config(train_config))
    if model_cfg.max_len < config.seq_len:
      raise ValueError(f"seq_len={config.seq_len} exceeds the checkpoint's max_len="
                       f"{model_cfg.max_len}.")
    return model_cfg, apply_fn, params
  model_cfg = models.TransformerConfig(vocab_size=config.vocab_size, max_len=config.seq_len,
                                       **config.model.to_dict())
  _, params, apply_fn = models.init(model_cfg, seed=0)
  return model_cfg, apply_fn, nnx.to_pure_dict(params)


def run(config, workdir: str | None = None, log=print) -> dict:
  """Runs the whole benchmark; returns the results dict (the JSON schema)."""
  _check_config(config)
  model_cfg, apply_fn, params = _model(config, workdir)
  num_params = models.count_params(params)
  canvas_BxL = jnp.full((config.batch, config.seq_len), model_cfg.vocab_size, jnp.int32)
  key = jax.random.key(config.seed)
  log(f"model: {num_params:,} parameters, dtype {model_cfg.dtype}; batch {config.batch}, "
      f"L {config.seq_len}; {machine_info()}")
  shape = dict(batch=config.batch, seq_len=config.seq_len, params=num_params)
  rows = []
  for steps in config.steps:
    found = bench_step_count(apply_fn, params, canvas_BxL, config.samplers, steps,
                             config.num_blocks, config.repeats, key)
    forward = found[0]
    for row in found:
      row.update(shape, tokens_per_s=config.batch * config.seq_len / row["time_s"],
                 seqs_per_s=config.batch / row["time_s"])
      if row["impl"] != "forward_only":
        loop = next(r for r in found if r["sampler"] == row["sampler"] and r["impl"] == "python_loop")
        scan = next(r for r in found if r["sampler"] == row["sampler"] and r["impl"] == "scan")
        row["overhead_vs_forward"] = scan["time_s"] / (forward["time_s"] * scan["nfe"] / steps)
        row["loop_over_scan"] = loop["time_s"] / scan["time_s"]
      log(f"K={steps:4d} {row['sampler']:10s} {row['impl']:12s} {row['time_s'] * 1e3:9.2f} ms "
          f"compile {row['compile_s']:.2f} s")
    rows += found
  flops = forward_flops(apply_fn, params, canvas_BxL, model_cfg)
  # Seconds per forward pass: the median over K of the forward_only rows.
  forward_1 = statistics.median(r["time_s"] / r["K"] for r in rows if r["impl"] == "forward_only")
  peak = peak_matmul_flops_per_s(config.matmul_size, model_cfg.dtype, config.repeats)
  train = dict(tokens_per_s=train_tokens_per_s(config, model_cfg, config.repeats),
               flops_per_s=flops / forward_1, peak_matmul_flops_per_s=peak,
               forward_flops=flops)
  train["utilisation"] = train["flops_per_s"] / peak
  families = family_overheads(apply_fn, params, canvas_BxL, config.family_steps,
                              config.overhead_repeats, key)
  calls = call_overheads(config, key, config.overhead_repeats)
  steps = step_costs(tuple(config.step_batches), config.step_length, config.overhead_repeats,
                     key)
  return dict(machine=machine_info(), model=model_cfg.__dict__ | {"params": num_params},
              settings=dict(repeats=config.repeats, overhead_repeats=config.overhead_repeats,
                            num_blocks=config.num_blocks,
                            matmul_size=config.matmul_size, train_batch=config.train_batch),
              rows=rows, train=train, families=families, calls=calls, steps=steps)


def summary_rows(result: dict) -> list[dict]:
  """One row per (sampler, K): the three times and the two ratios."""
  rows = result["rows"]
  forward = {r["K"]: r for r in rows if r["impl"] == "forward_only"}
  out = []
  for r in rows:
    if r["impl"] != "scan":
      continue
    loop = next(x for x in rows if x["impl"] == "python_loop" and x["sampler"] == r["sampler"]
                and x["K"] == r["K"])
    out.append({"sampler": r["sampler"], "K": r["K"], "nfe": r["nfe"],
                "scan ms": r["time_s"] * 1e3, "loop ms": loop["time_s"] * 1e3,
                "K forwards ms": forward[r["K"]]["time_s"] * 1e3,
                "scan / forwards (per nfe)": r["overhead_vs_forward"],
                "loop / scan": r["loop_over_scan"], "tokens/s": r["tokens_per_s"],
                "compile s": r["compile_s"],
                "peak MiB": (r["peak_bytes"] or 0) / 2 ** 20})
  return out


def ratio_medians(rows: list[dict]) -> list[dict]:
  """Per sampler, the median over K of the two ratios of `summary_rows`."""
  out = []
  for sampler in dict.fromkeys(r["sampler"] for r in rows):
    mine = [r for r in rows if r["sampler"] == sampler]
    out.append({"sampler": sampler, **{name: statistics.median(r[name] for r in mine)
                                       for name in ("scan / forwards (per nfe)", "loop / scan")}})
  return out


def overhead_text(result: dict) -> str:
  """The three overhead tables: families against their forward passes, the call path, the
  step's own work."""
  families = [{"sampler": r["sampler"], "K": r["K"], "nfe": r["nfe"],
               "contexts / row": r["contexts"], "evaluated / row": r["evaluated"],
               "ms": r["time_s"] * 1e3,
               "scan / forwards (per evaluated)": r["overhead_vs_evaluated"],
               "scan / forwards (per context)": r["overhead_vs_forward"]}
              for r in result["families"]]
  calls = [{"model": r["model"], "params": r["params"], "K": r["K"],
            "sample() ms": r["sample_s"] * 1e3, "program ms": r["program_s"] * 1e3,
            "host µs": (r["sample_s"] - r["program_s"]) * 1e6,
            "sample() / program": r["ratio"]} for r in result["calls"]]
  batches = sorted({r["batch"] for r in result["steps"]})
  steps = [{"sampler": name, "K": next(r["K"] for r in result["steps"] if r["sampler"] == name),
            **{f"µs / step, B={b}": next(r["us_per_step"] for r in result["steps"]
                                         if r["sampler"] == name and r["batch"] == b)
               for b in batches}}
           for name in dict.fromkeys(r["sampler"] for r in result["steps"])]
  rounds = result["settings"]["overhead_repeats"]
  return (f"\n## Overhead\n\nMedians of {rounds} interleaved rounds.\n\n(i) Every family at its defaults (`bench.default_spec`) against the "
          "bare forward passes it makes: its time over (one forward pass at this batch) x "
          "(sequences the program passes to the denoiser per row, `evaluated`); per context: "
          "over the sequences the family counts (`contexts_B`), which leaves out padded "
          "contexts and finished rows.\n\n"
          + report.markdown_table(families, list(families[0]))
          + "\n(ii) Per call at batch 1 (confidence decoding): `sampling.sample(...)` against the "
          "compiled program from `sampling.lower(...)` called directly; the difference is the "
          "host's work per call.\n\n" + report.markdown_table(calls, list(calls[0]))
          + "\n(iii) The sampler's own work per step: each family's compiled program with an "
          "embedding-lookup denoiser (V = 15), K = L, time over K.\n\n"
          + report.markdown_table(steps, list(steps[0])))


def write(result: dict, prefix: str) -> None:
  """prefix.json, prefix.md (tables) and prefix.png (throughput against K)."""
  report.write_json(prefix + ".json", result)
  m, t = result["machine"], result["train"]
  model = result["model"]
  rows = summary_rows(result)
  text = (f"# Sampling benchmark\n\nMachine: {m['device_kind']} ({m['platform']}, "
          f"{m['num_devices']} device(s); host CPU {m['cpu']}, {m['cpu_count']} cores), "
          f"jax {m['jax']}, Python {m['python']}.\n\n"
          f"Model: {model['params']:,} parameters (d_model {model['d_model']}, "
          f"{model['num_layers']} layers, {model['num_heads']} heads, d_ff {model['d_ff']}, "
          f"V {model['vocab_size']}, {model['dtype']}); batch {result['rows'][0]['batch']}, "
          f"L {result['rows'][0]['seq_len']}. Times are medians of "
          f"{result['settings']['repeats']} interleaved rounds after a warm-up (each round "
          "calls every implementation of a K once).\n\n"
          + report.markdown_table(rows, list(rows[0]))
          + "\nMedians over K:\n\n" + report.markdown_table(ratio_medians(rows), [
              "sampler", "scan / forwards (per nfe)", "loop / scan"])
          + "\n`scan / forwards (per nfe)`: the scan sampler's time over the time of as many bare "
          "forward passes as it made denoiser calls (1.0 = no overhead). `loop / scan`: the Python "
          "loop of jitted steps over the single program.\n\n"
          f"Training: {t['tokens_per_s']:,.0f} tokens/s. Forward pass: "
          f"{t['forward_flops'] / 1e9:.3g} GFLOP, {t['flops_per_s'] / 1e9:.3g} GFLOP/s achieved "
          f"against {t['peak_matmul_flops_per_s'] / 1e9:.3g} GFLOP/s for a "
          f"{result['settings']['matmul_size']}² matmul: utilisation "
          f"{100 * t['utilisation']:.1f}%.\n")
  report.write_text(prefix + ".md", text + overhead_text(result))
  try:
    fig, (ax_tp, ax_r, ax_c) = report.new_figure(ncols=3, figsize=(16, 4.5))
  except ImportError:
    return
  styles = {"scan": "-o", "python_loop": "--s", "forward_only": ":^"}
  for sampler in sorted({r["sampler"] for r in result["rows"]}):
    for impl, style in styles.items():
      pts = sorted((r["K"], r["tokens_per_s"], r["compile_s"]) for r in result["rows"]
                   if r["sampler"] == sampler and r["impl"] == impl)
      if pts:
        ks, tps, comp = zip(*pts)
        label = f"{sampler} ({impl})" if impl != "forward_only" else "K forward passes"
        ax_tp.plot(ks, tps, style, label=label)
        ax_c.plot(ks, comp, style, label=label)
    if sampler != "forward":
      pts = sorted((r["K"], r["scan / forwards (per nfe)"], r["loop / scan"]) for r in rows
                   if r["sampler"] == sampler)
      ks, overhead, loop = zip(*pts)
      line, = ax_r.plot(ks, overhead, "-o", label=f"{sampler}: scan / forwards")
      ax_r.plot(ks, loop, "--s", color=line.get_color(), label=f"{sampler}: loop / scan")
  ax_r.axhline(1.0, color="gray", lw=0.8)
  for ax, ylabel in ((ax_tp, "generated tokens / s"), (ax_r, "time ratio"),
                     (ax_c, "compile s")):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("steps K")
    ax.set_ylabel(ylabel)
  ax_tp.set_yscale("log")
  ax_tp.legend(fontsize=7)
  ax_r.legend(fontsize=7)
  ax_tp.set_title(f"{m['device_kind']}: throughput against K")
  ax_r.set_title("sampler overhead and what one program buys")
  ax_c.set_title("compile time against K")
  report.save_figure(fig, prefix + ".png")


def main(argv=None) -> None:
  from absl import app, flags
  from ml_collections import config_flags

  config_flag = config_flags.DEFINE_config_file("config", None, "Bench config (get_config()).")
  workdir_flag = flags.DEFINE_string("workdir", None, "Benchmark a trained checkpoint instead.")
  out_flag = flags.DEFINE_string("out", None, "Output prefix (default: the config's out).")

  def _main(argv):
    del argv
    config = config_flag.value
    if config is None:
      raise app.UsageError("--config=configs/bench_cpu.py (or bench_gpu.py) is required.")
    prefix = out_flag.value or config.out
    if "kv_cache" in config:  # configs/bench_kv_cache*.py: cached against uncached
      from mdjax import bench_kv_cache
      if workdir_flag.value:
        raise app.UsageError("--workdir: the KV-cache benchmark runs its config's model.")
      bench_kv_cache.write(bench_kv_cache.run(config), prefix)
    else:
      try:
        result = run(config, workdir_flag.value)
      except ValueError as error:
        raise app.UsageError(str(error)) from error
      write(result, prefix)
    with open(prefix + ".md") as f:
      print(f.read())

  app.run(_main, argv=argv or sys.argv)


if __name__ == "__main__":
  main()
