"""python -m mdjax.bench --config=configs/bench_cpu.py (or bench_gpu.py, bench_kv_cache.py)."""

from __future__ import annotations

import sys

from mdjax.bench import kv_cache, report, suite


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
      if workdir_flag.value:
        raise app.UsageError("--workdir: the KV-cache benchmark runs its config's model.")
      kv_cache.write(kv_cache.run(config), prefix)
    else:
      try:
        result = suite.run(config, workdir_flag.value)
      except ValueError as error:
        raise app.UsageError(str(error)) from error
      report.write(result, prefix)
    with open(prefix + ".md") as f:
      print(f.read())

  app.run(_main, argv=argv or sys.argv)


if __name__ == "__main__":
  main()
