"""KV-cached block decoding against the uncached sampler, side by side in one run.

  python -m mdjax.bench --config=configs/bench_kv_cache.py        # results/bench_kv_cache.*

For each cell (canvas length L, batch B) and step count K, confidence decoding in blocks
of `block` positions runs uncached (`impl="none"`: K full passes) and with the dual cache
(`impl="dual"`: one full pass per block, then passes over the block only). Both programs
are compiled first (compile_s), then timed in interleaved rounds (medians). Each row also
gives the program's peak memory (the cache included) and the time ratio's ceiling from
FLOPs: K full passes against (refresh passes + the other K - refreshes window passes),
the passes' FLOPs as XLA counts them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from mdjax import models, report, sampling
from mdjax.bench.timing import (compiled_peak_bytes, interleaved_medians, machine_info,
                                timed_compile)

IMPLS = ("none", "dual")


def cell_specs(steps: int, block: int) -> dict[str, sampling.ConfidenceSpec]:
  """The benchmarked sampler (LLaDA-style confidence decoding in blocks), per impl."""
  spec = sampling.ConfidenceSpec(steps=steps, block_length=block)
  return {impl: dataclasses.replace(spec, kv_cache=impl) for impl in IMPLS}


def _flops(compiled) -> float:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["flops"])


def pass_flops(apply_fn, params, batch: int, length: int, block: int) -> tuple[float, float]:
  """(FLOPs of a full pass with its cache, of a window pass over `block` positions)."""
  tokens_BxL = jnp.zeros((batch, length), jnp.int32)
  t_B = jnp.ones((batch,), jnp.float32)
  prefill = jax.jit(apply_fn.prefill).lower(params, tokens_BxL, t_B).compile()
  _, cache = jax.eval_shape(apply_fn.prefill, params, tokens_BxL, t_B)
  # Only the window's logits: the sampler keeps no window keys (see sampling.kv_cache).
  decode = jax.jit(lambda p, c, x, s, t: apply_fn.decode(p, c, x, s, t)[0])
  window = decode.lower(params, cache, tokens_BxL[:, :block], 0, t_B).compile()
  return _flops(prefill), _flops(window)


def flop_ceiling(steps: int, refreshes: int, full_flops: float, window_flops: float) -> float:
  """The uncached / cached time ratio if time were FLOPs."""
  return steps * full_flops / (refreshes * full_flops + (steps - refreshes) * window_flops)


def bench_cell(apply_fn, params, length: int, batch: int, block: int, steps_list, repeats: int,
               key, log=print) -> list[dict]:
  """Every K of one (L, B) cell: both impls compiled, then timed in interleaved rounds."""
  canvas_BxL = jnp.full((batch, length), apply_fn_vocab(apply_fn, params), jnp.int32)
  full_flops, window_flops = pass_flops(apply_fn, params, batch, length, block)
  calls, rows = {}, {}
  for steps in steps_list:
    for impl, spec in cell_specs(steps, block).items():
      compiled, args, compile_s = timed_compile(
          lambda: sampling.lower(apply_fn, params, key, canvas_BxL, spec))
      calls[steps, impl] = functools.partial(compiled, *args)
      refreshes = steps if impl == "none" else length // block
      rows[steps, impl] = dict(
          L=length, batch=batch, block=block, K=steps, impl=impl, compile_s=compile_s,
          peak_bytes=compiled_peak_bytes(compiled),
          flop_ceiling=flop_ceiling(steps, refreshes, full_flops, window_flops))
  medians = interleaved_medians(calls, repeats)
  out = []
  for (steps, impl), row in rows.items():
    row["time_s"] = medians[steps, impl]
    row["speedup"] = medians[steps, "none"] / medians[steps, impl]
    log(f"L={length:5d} B={batch} K={steps:5d} {impl:5s} {row['time_s']:9.3f} s  speedup "
        f"{row['speedup']:6.2f} (ceiling {row['flop_ceiling']:6.2f})  compile "
        f"{row['compile_s']:.1f} s  peak {row['peak_bytes'] / 2**20:.0f} MiB")
    out.append(row)
  return out


def apply_fn_vocab(apply_fn, params) -> int:
  """V (the mask id) from the denoiser's output shape."""
  tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  return jax.eval_shape(apply_fn, params, tokens, jax.ShapeDtypeStruct((1,), jnp.float32)
                        ).shape[-1]


def run(config, log=print) -> dict:
  """The whole benchmark: results dict (the JSON schema: `rows` as the issue fixes them)."""
  kv = config.kv_cache
  max_len = max(cell[0] for cell in kv.cells)
  model_cfg = models.TransformerConfig(vocab_size=config.vocab_size, max_len=max_len,
                                       **config.model.to_dict())
  _, params, apply_fn = models.init(model_cfg, seed=0)
  key = jax.random.key(config.seed)
  log(f"model: {models.count_params(params):,} parameters, dtype {model_cfg.dtype}; "
      f"{machine_info()}")
  rows = []
  for length, batch, fractions in kv.cells:
    steps_list = [int(length * f) for f in fractions]
    rows += bench_cell(apply_fn, params, length, batch, kv.block, steps_list, kv.repeats, key,
                       log)
  return dict(machine=machine_info(), model=model_cfg.__dict__,
              settings=dict(repeats=kv.repeats, block=kv.block, sampler="confidence"),
              rows=rows)


def summary_rows(result: dict) -> list[dict]:
  """One row per (L, B, K): both times, the ratio, its FLOP ceiling, compile and memory."""
  by_key = {(r["L"], r["batch"], r["K"], r["impl"]): r for r in result["rows"]}
  out = []
  for (length, batch, steps, impl), none in sorted(by_key.items()):
    if impl != "none":
      continue
    dual = by_key[length, batch, steps, "dual"]
    ratio = none["time_s"] / dual["time_s"]
    out.append({"L": length, "batch": batch, "K": steps, "uncached s": round(none["time_s"], 3),
                "dual s": round(dual["time_s"], 4), "speedup": round(ratio, 2),
                "FLOP ceiling": round(dual["flop_ceiling"], 2),
                "ceiling / speedup": round(dual["flop_ceiling"] / ratio, 2),
                "compile s (none, dual)": f"{none['compile_s']:.1f}, {dual['compile_s']:.1f}",
                "peak MiB (none, dual)": f"{none['peak_bytes'] / 2**20:.0f}, "
                                         f"{dual['peak_bytes'] / 2**20:.0f}"})
  return out


def write(result: dict, prefix: str) -> None:
  """prefix.json, prefix.md (the table) and prefix.png (speedup against K with ceilings)."""
  report.write_json(prefix + ".json", result)
  m, model = result["machine"], result["model"]
  rows = summary_rows(result)
  text = (f"# KV-cached block decoding\n\nMachine: {m['device_kind']} ({m['platform']}; host "
          f"CPU {m['cpu']}, {m['cpu_count']} cores), jax {m['jax']}.\n\n"
          f"Model: d_model {model['d_model']}, {model['num_layers']} layers, "
          f"{model['num_heads']} heads, d_ff {model['d_ff']}, V {model['vocab_size']}, "
          f"{model['dtype']}. Sampler: confidence decoding in blocks of "
          f"{result['settings']['block']}, uncached against the dual cache (one full pass "
          "per block). Times are medians of "
          f"{result['settings']['repeats']} interleaved rounds of compiled programs.\n\n"
          + report.markdown_table(rows, list(rows[0]))
          + "\n`FLOP ceiling`: K full passes over (one full pass per block + the other steps' "
          "window passes), FLOPs as XLA counts them; `ceiling / speedup`: how far the measured "
          "ratio is from it (1.0 = at the ceiling).\n")
  report.write_text(prefix + ".md", text)
  try:
    fig, (ax_s, ax_c) = report.new_figure(ncols=2, figsize=(11, 4.2))
  except ImportError:
    return
  for length, batch in sorted({(r["L"], r["batch"]) for r in rows}):
    pts = [r for r in rows if (r["L"], r["batch"]) == (length, batch)]
    ks = [r["K"] for r in pts]
    line, = ax_s.plot(ks, [r["speedup"] for r in pts], "-o", label=f"L={length}, B={batch}")
    ax_s.plot(ks, [r["FLOP ceiling"] for r in pts], ":", color=line.get_color())
    ax_c.plot(ks, [r["uncached s"] for r in pts], "--s", color=line.get_color(),
              label=f"L={length}, B={batch}: uncached")
    ax_c.plot(ks, [r["dual s"] for r in pts], "-o", color=line.get_color(),
              label=f"L={length}, B={batch}: dual cache")
  for ax, ylabel in ((ax_s, "uncached / cached time"), (ax_c, "seconds per call")):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("steps K")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
  ax_s.set_title("speedup (dotted: FLOP ceiling)")
  ax_c.set_title(f"{m['device_kind']}: time per sampler call")
  report.save_figure(fig, prefix + ".png")

