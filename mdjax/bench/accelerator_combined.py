"""The combined figure of `mdjax.bench.accelerators`: the best trained method with a
confidence threshold and the KV or block cache against the teacher one position a step,
uncached, at equal exact accuracy, as one ratio of wall time and of denoiser calls, timed side
by side (`combined_ratio` in results/accelerators.json)."""

from __future__ import annotations

import math
import time
from typing import Sequence

import jax
import numpy as np

from mdjax import sampling
from mdjax.accelerators import cdlm, distill, frontier
from mdjax.bench import parallelism as bench
from mdjax.bench.accelerator_points import TRAINED, Method, measure, with_model



def median_seconds(run, repeats: int) -> float:
  """The median wall time of `run()` (it blocks until its result is ready)."""
  times = []
  for _ in range(repeats):
    started = time.perf_counter()
    run()
    times.append(time.perf_counter() - started)
  return float(np.median(times))


def within(rec: dict, base: dict) -> bool:
  """Equal accuracy: not below the baseline's by more than 2 standard errors of the
  difference."""
  return rec["accuracy"] >= base["accuracy"] - 2 * math.hypot(base["accuracy_se"],
                                                              rec["accuracy_se"])


COMBINED_THRESHOLDS = (0.9, 0.99, 0.999, 0.9999)  # searched upwards: fewest calls first


def combined(teacher_ot: bench.OracleTask, students: dict, points: list[dict],
             canvas: np.ndarray, seed: int, *, repeats: int = 5, latency_rows: int = 32,
             thresholds: Sequence[float] = COMBINED_THRESHOLDS, labels: Sequence[str] | None = None,
             previous: dict | None = None, temperature: float = 0.0, log=print) -> dict:
  """The best bidirectional student (most AUP at `temperature`, the trained models' own) with
  a confidence threshold, with the dual KV cache (when there is a prompt to cache) and without it, and the block-causal student (CDLM's, when given)
  block by block with the exact cache, against the teacher one position a step, uncached:
  for each, the lowest threshold of `thresholds` whose accuracy is within 2 standard errors
  of the teacher's; then each timed side by side with the baseline (interleaved, median of
  `repeats`) on all rows in one batch and on `latency_rows` rows one at a time (batch size
  1, where TPF is counted). The teacher's own threshold (no training) found the same way is
  the training-free reference; `exact_cache`: the block-causal student at its reference's
  threshold with the exact cache against itself without it. `labels`: only these
  variants, the others kept from `previous` (a former result)."""
  n = teacher_ot.generated
  here = [p for p in points if p["teacher"] == TRAINED and p["temperature"] == temperature
          and p["task"] == teacher_ot.name]
  aup = frontier.aup_by_method(here)[teacher_ot.name][TRAINED][str(float(temperature))]
  name = max(distill.NAMES, key=lambda s: aup.get(s, -1.0))
  spec_of = lambda tau, kv, block: sampling.ConfidenceSpec(
      steps=n, threshold=tau, temperature=temperature, kv_cache=kv, block_length=block)
  candidates = [("none", name, "none", None)]
  if teacher_ot.prompt_length:  # the dual cache keeps the prompt's keys and values
    candidates.append(("dual", name, "dual", n))
  candidates.append(("teacher_threshold", "teacher", "none", None))
  if cdlm.NAME in students:
    block = students[cdlm.NAME].denoiser.block_size
    candidates.append(("exact", cdlm.NAME, "exact", block))
  base_spec = sampling.ConfidenceSpec(steps=n, score="prob", count_rule="even",
                                      temperature=temperature)
  base = measure(teacher_ot, Method("teacher", (("steps", n),), base_spec, False), canvas, seed,
                 temperature, TRAINED)
  out = dict(previous or {}, student=name, baseline=base, repeats=repeats,
             latency_rows=latency_rows, thresholds=list(thresholds))
  out["variants"] = dict(out.get("variants") or {})
  tried = [r for r in out.get("searched") or [] if labels is not None
           and r["variant"] not in labels]
  searched = {}
  for label, method, kv, block in candidates:
    if labels is not None and label not in labels:
      continue
    ot = teacher_ot if method == "teacher" else with_model(teacher_ot, students[method])
    knobs = (("block_length", block),) if block and block < n else ()
    for tau in thresholds:
      spec = spec_of(tau, kv, block)
      rec = measure(ot, Method(method, (("threshold", tau), ("kv_cache", kv)) + knobs, spec,
                               method != "teacher"), canvas, seed, temperature, TRAINED)
      tried.append(dict(rec, variant=label))
      if within(rec, base):
        searched[label] = (ot, spec, rec)
        break
  out["searched"] = tried
  key = jax.random.key(seed)

  def runner(ot, spec, rows):
    return lambda: np.asarray(sampling.sample(ot.denoiser, ot.denoiser_params, key, rows, spec,
                                              mask_id=ot.task.mask_id).tokens_BxL)

  latency_rows = min(latency_rows, len(canvas))

  def one_by_one(ot, spec):
    calls = [runner(ot, spec, canvas[i:i + 1]) for i in range(latency_rows)]
    return lambda: [c() for c in calls]

  def paired(slow_ot, slow_spec, ot, spec):
    seconds = {}
    for size, (slow, fast) in {
        "batch": (runner(slow_ot, slow_spec, canvas), runner(ot, spec, canvas)),
        "batch1": (one_by_one(slow_ot, slow_spec), one_by_one(ot, spec))}.items():
      slow(), fast()  # compiled and warm
      pairs = [(median_seconds(slow, 1), median_seconds(fast, 1)) for _ in range(repeats)]
      seconds[size] = {"baseline": float(np.median([a for a, _ in pairs])),
                       "combined": float(np.median([b for _, b in pairs]))}
    return seconds

  if cdlm.NAME in students and (labels is None or "exact" in labels):
    ot, tau = with_model(teacher_ot, students[cdlm.NAME]), cdlm.THRESHOLD
    bare, cached = (spec_of(tau, kv, block) for kv in ("none", "exact"))
    seconds = paired(ot, bare, ot, cached)
    out["exact_cache"] = {"threshold": tau, "block_length": block, "seconds": seconds,
                          "same_tokens": bool((runner(ot, bare, canvas)()
                                               == runner(ot, cached, canvas)()).all()),
                          **{f"wall_ratio_{k}": v["baseline"] / v["combined"]
                             for k, v in seconds.items()}}
  for label, (ot, spec, rec) in searched.items():
    seconds = paired(teacher_ot, base_spec, ot, spec)
    variant = {"model": rec["method"], "kv_cache": spec.kv_cache, "threshold": spec.threshold,
               "block_length": spec.block_length, "point": rec, "seconds": seconds,
               "calls_ratio": base["mean_forwards"] / rec["mean_forwards"],
               "wall_ratio_batch": seconds["batch"]["baseline"] / seconds["batch"]["combined"],
               "wall_ratio_batch1": (seconds["batch1"]["baseline"]
                                     / seconds["batch1"]["combined"])}
    out["variants"][label] = variant
    log(f"combined: {rec['method']} threshold {spec.threshold}, kv_cache {spec.kv_cache}, "
        f"block {spec.block_length}: accuracy {rec['accuracy']:.3f} ± {rec['accuracy_se']:.3f} "
        f"at {rec['mean_forwards']:.2f} calls; teacher one a step {base['accuracy']:.3f} ± "
        f"{base['accuracy_se']:.3f}: calls {variant['calls_ratio']:.2f}x, wall "
        f"{variant['wall_ratio_batch1']:.2f}x at batch 1, {variant['wall_ratio_batch']:.2f}x "
        f"at batch {len(canvas)}")
  if any(k != "teacher_threshold" for k in out["variants"]):
    label, best = max(((k, v) for k, v in out["variants"].items() if k != "teacher_threshold"),
                      key=lambda kv: kv[1]["wall_ratio_batch1"])
    out.update(best=best["kv_cache"], best_variant=label, calls_ratio=best["calls_ratio"],
               wall_ratio_batch1=best["wall_ratio_batch1"],
               wall_ratio_batch=best["wall_ratio_batch"])
  return out
