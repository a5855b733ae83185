"""UPO's learned unmasking order against confidence ordering at equal calls, measured
exactly on sudoku4 (its exact oracle the frozen denoiser) with greedy values (UPO's argmax).

`python -m mdjax.bench.order_policy` trains the policy (`mdjax.accelerators.order_policy`,
fixed seed) and writes results/order_policy.json; `mdjax.bench.accelerators` adds the same
points to results/accelerators.json. For each K (denoiser calls; every fixed-count sampler
here makes exactly K): the trained policy (Plackett-Luce at its temperature 1, and its k best
scores at 0), the untrained policy (its random start: a control), confidence ordering at K
(the same even count of commits, the k most probable proposals), ancestral decoding at K
and the exact optimum of any order at K (`mdjax.accelerators.order_optimum`: a search, not
a sampler); the entropy bound as the best adaptive training-free sampler. Points in
results/parallelism.json's schema plus `method`, `trained` and `temperature`; `at_equal_calls`
compares each trained point with confidence at its K (difference and z).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Sequence

import jax
import numpy as np

from mdjax import report, sampling
from mdjax.accelerators import order_optimum
from mdjax.accelerators import order_policy as trainer
from mdjax.bench import parallelism as bench
from mdjax.sampling import order_policy

SEED = 0
STEPS = (2, 4, 8)
GAMMAS = (0.1, 0.5)


def _point(ot, method: str, knobs: tuple, spec, trained: bool, canvas, seed: int) -> dict:
  record, _ = bench.run_point(ot, bench.Point(method, knobs, spec, False), canvas, seed)
  record.update(method=method, trained=trained, temperature=0.0)
  return record


def points(ot, canvas: np.ndarray, policy: order_policy.OrderPolicy,
           untrained: order_policy.OrderPolicy, seed: int, steps: Sequence[int] = STEPS,
           log=print) -> list[dict]:
  """Every point at temperature 0 on the evaluation prompts."""
  t = dict(temperature=0.0)
  out = []
  for k in steps:
    for tau in (1.0, 0.0):
      out.append(_point(ot, "order_policy", (("steps", k), ("policy_temperature", tau)),
                        sampling.OrderPolicySpec(steps=k, policy=policy, policy_temperature=tau,
                                                 **t), True, canvas, seed))
    out.append(_point(ot, "order_policy_untrained", (("steps", k), ("policy_temperature", 1.0)),
                      sampling.OrderPolicySpec(steps=k, policy=untrained, **t), False, canvas,
                      seed))
    out.append(_point(ot, "confidence", (("steps", k),),
                      sampling.ConfidenceSpec(steps=k, count_rule="even", **t), False, canvas,
                      seed))
    out.append(_point(ot, "ancestral", (("steps", k),), sampling.AncestralSpec(steps=k, **t),
                      False, canvas, seed))
    best = order_optimum.optimum(canvas[:, :ot.prompt_length], k)
    out.append({"task": ot.name, "family": "exact_optimum", "method": "exact_optimum",
                "trained": False, "ceiling": True, "temperature": 0.0, "knobs": {"steps": k},
                "rows": best["rows"], "generated": ot.generated, "accuracy": best["accuracy"],
                "accuracy_se": best["accuracy_se"], "tpf": ot.generated / k, "tpf_se": 0.0,
                "mean_forwards": float(k), "undecided": best["undecided"]})
    log(f"K={k}: " + ", ".join(f"{p['method']}{p['knobs'].get('policy_temperature', '')} "
                               f"{p['accuracy']:.3f}" for p in out[-6:]))
  for g in GAMMAS:
    out.append(_point(ot, "entropy_bounded", (("gamma", g),),
                      sampling.EntropyBoundedSpec(steps=ot.generated, gamma=g, **t), False,
                      canvas, seed))
  return out


def at_equal_calls(pts: list[dict]) -> list[dict]:
  """Each trained point against confidence ordering at the same K (the same calls)."""
  rows = []
  for p in (p for p in pts if p["trained"]):
    k = p["knobs"]["steps"]
    ref = next(q for q in pts if q["method"] == "confidence" and q["knobs"]["steps"] == k)
    best = next(q for q in pts if q["method"] == "exact_optimum" and q["knobs"]["steps"] == k)
    se = math.hypot(p["accuracy_se"], ref["accuracy_se"])
    diff = p["accuracy"] - ref["accuracy"]
    rows.append({"steps": k, "policy_temperature": p["knobs"]["policy_temperature"],
                 "accuracy": p["accuracy"], "accuracy_se": p["accuracy_se"],
                 "confidence": ref["accuracy"], "confidence_se": ref["accuracy_se"],
                 "difference": diff, "z": diff / se if se > 0 else math.copysign(math.inf, diff),
                 "exact_optimum": best["accuracy"]})
  return rows


def run(*, rows: int = 1000, seed: int = SEED, cfg: trainer.PolicyConfig | None = None,
        policy_file: str | None = None, log=print) -> dict:
  """Trains (or loads) the policy and measures every point: results/order_policy.json."""
  started = time.perf_counter()
  ot = {t.name: t for t in bench.oracle_tasks("full")}["sudoku4"]
  canvas = bench.canvas_of(ot, rows, seed)  # results/parallelism.json's prompts
  cfg = cfg or trainer.PolicyConfig(seed=seed)
  if policy_file:
    policy, info = order_policy.load_policy(policy_file), order_policy.read_info(policy_file)
  else:
    policy, info = trainer.train_policy(ot.denoiser, ot.denoiser_params, ot.task, cfg,
                                        mask_id=ot.task.mask_id, vocab_size=ot.task.vocab_size,
                                        log=log)
  untrained = order_policy.OrderPolicy.from_arrays(
      {k: np.asarray(v) for k, v in order_policy.init_arrays(
          trainer.stream_keys(cfg.seed)["init"], ot.task.length, cfg.dim, cfg.hidden).items()})
  pts = points(ot, canvas, policy, untrained, seed, log=log)
  info = {k: v for k, v in info.items() if k != "history"} | {
      "reward_first": info["history"][0]["reward"] if info.get("history") else None,
      "reward_last_10": (float(np.mean([h["reward"] for h in info["history"][-10:]]))
                         if info.get("history") else None)}
  return {"config": {"seed": seed, "rows": rows, "task": "sudoku4", "temperature": 0.0,
                     "steps": list(STEPS), "jax": jax.__version__,
                     "backend": jax.default_backend()},
          "policy": {"policy": repr(policy), **info},
          "points": pts, "at_equal_calls": at_equal_calls(pts),
          "seconds": time.perf_counter() - started}


def main(argv: Sequence[str] | None = None, log=print) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="results/order_policy.json")
  parser.add_argument("--rows", type=int, default=1000)
  parser.add_argument("--batches", type=int, default=trainer.PolicyConfig().batches)
  parser.add_argument("--policy_file", default=None, help="measure this policy, no training")
  parser.add_argument("--seed", type=int, default=SEED)
  args = parser.parse_args(argv)
  results = run(rows=args.rows, seed=args.seed, policy_file=args.policy_file,
                cfg=trainer.PolicyConfig(seed=args.seed, batches=args.batches), log=log)
  for row in results["at_equal_calls"]:
    log(f"K={row['steps']} tau={row['policy_temperature']:g}: order_policy {row['accuracy']:.3f}"
        f" ± {row['accuracy_se']:.3f}, confidence {row['confidence']:.3f} ± "
        f"{row['confidence_se']:.3f} (z {row['z']:+.1f}); exact optimum {row['exact_optimum']:.3f}")
  report.write_json(args.out, results)
  log(f"wrote {args.out} ({results['seconds']:.0f} s)")
  return results


if __name__ == "__main__":
  main()


def accelerator_points(ot, canvas: np.ndarray, seed: int, sizes: str = "full",
                       log=print) -> list[dict]:
  """The rows `mdjax.bench.accelerators` adds on sudoku4 at temperature 0: the trained policy
  and its untrained start at each K (its own sweep measures the training-free families)."""
  tiny = sizes == "tiny"  # a test of the wiring: one K, trained on and measured
  steps = STEPS[:1] if tiny else STEPS
  cfg = trainer.PolicyConfig(seed=seed, steps=steps,
                             batches=2 if tiny else trainer.PolicyConfig().batches)
  policy, _ = trainer.train_policy(ot.denoiser, ot.denoiser_params, ot.task, cfg,
                                   mask_id=ot.task.mask_id, vocab_size=ot.task.vocab_size,
                                   log=log)
  untrained = order_policy.OrderPolicy.from_arrays(
      {k: np.asarray(v) for k, v in order_policy.init_arrays(
          trainer.stream_keys(cfg.seed)["init"], ot.task.length, cfg.dim, cfg.hidden).items()})
  out = []
  for k in steps:
    for method, pol, tau, trained in (("order_policy", policy, 1.0, True),
                                      ("order_policy", policy, 0.0, True),
                                      ("order_policy_untrained", untrained, 1.0, False)):
      out.append(_point(ot, method, (("steps", k), ("policy_temperature", tau)),
                        sampling.OrderPolicySpec(steps=k, policy=pol, policy_temperature=tau,
                                                 temperature=0.0), trained, canvas, seed))
  return out
