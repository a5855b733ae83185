"""The sampling benchmark's files: prefix.json, prefix.md (tables) and prefix.png."""

from __future__ import annotations

import statistics

from mdjax.report import markdown_table, new_figure, save_figure, write_json, write_text


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
  return (f"\n## Overhead\n\nMedians of {rounds} interleaved rounds.\n\n(i) Every family at its "
          "defaults (`Family.bench_spec`) against the "
          "bare forward passes it makes: its time over (one forward pass at this batch) x "
          "(sequences the program passes to the denoiser per row, `evaluated`); per context: "
          "over the sequences the family counts (`contexts_B`), which leaves out padded "
          "contexts and finished rows.\n\n"
          + markdown_table(families, list(families[0]))
          + "\n(ii) Per call at batch 1 (confidence decoding): `sampling.sample(...)` against the "
          "compiled program from `sampling.lower(...)` called directly; the difference is the "
          "host's work per call.\n\n" + markdown_table(calls, list(calls[0]))
          + "\n(iii) The sampler's own work per step: each family's compiled program with an "
          "embedding-lookup denoiser (V = 15), K = L, time over K.\n\n"
          + markdown_table(steps, list(steps[0])))


def summary_text(result: dict, rows: list[dict]) -> str:
  """The machine, the model, the throughput table and its medians, the training line."""
  m, t, model = result["machine"], result["train"], result["model"]
  return (f"# Sampling benchmark\n\nMachine: {m['device_kind']} ({m['platform']}, "
          f"{m['num_devices']} device(s); host CPU {m['cpu']}, {m['cpu_count']} cores), "
          f"jax {m['jax']}, Python {m['python']}.\n\n"
          f"Model: {model['params']:,} parameters (d_model {model['d_model']}, "
          f"{model['num_layers']} layers, {model['num_heads']} heads, d_ff {model['d_ff']}, "
          f"V {model['vocab_size']}, {model['dtype']}); batch {result['rows'][0]['batch']}, "
          f"L {result['rows'][0]['seq_len']}. Times are medians of "
          f"{result['settings']['repeats']} interleaved rounds after a warm-up (each round "
          "calls every implementation of a K once).\n\n"
          + markdown_table(rows, list(rows[0]))
          + "\nMedians over K:\n\n" + markdown_table(ratio_medians(rows), [
              "sampler", "scan / forwards (per nfe)", "loop / scan"])
          + "\n`scan / forwards (per nfe)`: the scan sampler's time over the time of as many bare "
          "forward passes as it made denoiser calls (1.0 = no overhead). `loop / scan`: the Python "
          "loop of jitted steps over the single program.\n\n"
          f"Training: {t['tokens_per_s']:,.0f} tokens/s. Forward pass: "
          f"{t['forward_flops'] / 1e9:.3g} GFLOP, {t['flops_per_s'] / 1e9:.3g} GFLOP/s achieved "
          f"against {t['peak_matmul_flops_per_s'] / 1e9:.3g} GFLOP/s for a "
          f"{result['settings']['matmul_size']}² matmul: utilisation "
          f"{100 * t['utilisation']:.1f}%.\n")


def plot(result: dict, rows: list[dict], path: str) -> None:
  """Throughput, the two ratios and compile time against K; nothing without matplotlib."""
  try:
    fig, (ax_tp, ax_r, ax_c) = new_figure(ncols=3, figsize=(16, 4.5))
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
  ax_tp.set_title(f"{result['machine']['device_kind']}: throughput against K")
  ax_r.set_title("sampler overhead and what one program buys")
  ax_c.set_title("compile time against K")
  save_figure(fig, path)


def write(result: dict, prefix: str) -> None:
  """prefix.json, prefix.md (tables) and prefix.png (throughput against K)."""
  write_json(prefix + ".json", result)
  rows = summary_rows(result)
  write_text(prefix + ".md", summary_text(result, rows) + overhead_text(result))
  plot(result, rows, prefix + ".png")
