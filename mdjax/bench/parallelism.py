"""How parallel can decoding be: accuracy against tokens per forward on exact oracles.

`python -m mdjax.bench.parallelism` writes results/parallelism.json and
results/parallelism_*.png (schema and reading: docs/parallelism.md). For every sampler
family and its knobs (steps, thresholds, entropy bound, blocks, drafts) on every oracle task
(two_color, permutation, sudoku4, the list tasks copy / replace / shuffle, scan_and_add):

- accuracy (the task's valid fraction) with its binomial standard error, and the exact lower
  bound 1 - accuracy on the total variation to the law (the law puts no mass on invalid
  outputs; equality when the sampler's valid outputs are uniform on them);
- TPF, tokens per forward at batch size 1: generated positions over the denoiser calls a row
  alone needs (`rounds_B`; speculative adds its start-up call, test-and-defer makes two
  calls a step but one at the last), with its delta-method standard error;
- the closed forms (ancestral decoding of permutation, shuffle, replace and copy with K
  equal steps) beside the measured accuracy, in standard errors;
- AUP per family and task (d3LLM's accuracy under parallelism), and which family adapts
  best: mean accuracy over tasks at equal mean TPF;
- the bound: on a few rows per point, every step that wrote two or more positions, its
  exact conditional total correlation and the step's exact KL against the laws drawn from
  (`mdjax.parallelism`);
- the same sweep on a small model trained for a short time on permutation (its KL gap above
  TC is the model's error beside the decoder's).

Fixed seeds; one compiled program per (spec, shape): the list tasks share theirs (the kind
is the denoiser's traced parameter).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mdjax import parallelism, sampling
from mdjax.tasks import lists, permutation, scan_and_add, sudoku4, two_color

SEED = 0


@dataclasses.dataclass(frozen=True)
class OracleTask:
  """A task of the sweep: its Task, the prompt positions, the denoiser and its params (the
  list tasks share one denoiser), validity and the oracle's conditionals (numpy)."""

  name: str
  task: Any
  prompt_length: int
  denoiser: Callable
  denoiser_params: Any
  valid: Callable[[np.ndarray], np.ndarray]
  conditionals: parallelism.Conditionals
  closed_form: Callable[[int], float] | None = None  # ancestral, K equal steps

  @property
  def generated(self) -> int:
    return self.task.length - self.prompt_length


def _two_color_conditionals(tokens_NxL):
  x = np.asarray(tokens_NxL)
  probs = np.asarray(jax.nn.softmax(two_color.exact_denoiser(None, jnp.asarray(x), None)), np.float64)
  possible = ~((x != two_color.MASK_ID).all(-1) & (x[:, 0] != x[:, 1]))
  return probs, possible


def _scan_and_add_valid(tokens_BxL, params):
  checks = scan_and_add.checks(tokens_BxL, params)
  return checks["correct"] & checks["add_count_valid"]


def _module_conditionals(module, params):
  def conditionals(tokens_NxL):
    probs, possible = module.exact_probs(jnp.asarray(tokens_NxL), params)
    return np.asarray(probs, np.float64), np.asarray(possible)
  return conditionals


def oracle_tasks(sizes: str = "full", names: Sequence[str] | None = None) -> list[OracleTask]:
  """The sweep's tasks (those in `names`, default all); sizes="tiny" shrinks them."""
  tiny = sizes == "tiny"
  n_perm, n_list, m_list = (3, 2, 3) if tiny else (6, 4, 8)
  perm = permutation.Params(n=n_perm)
  out = [
      OracleTask("two_color", two_color.TASK, 0, two_color.exact_denoiser, None,
                 lambda x: (x[:, 0] == x[:, 1]) & (x != two_color.MASK_ID).all(-1),
                 _two_color_conditionals, lambda k: 1.0 - 1.0 / (2 * k)),
      OracleTask("permutation", permutation.make_task(perm), 0,
                 permutation.make_exact_denoiser(perm), None,
                 lambda x, p=perm: permutation.checks(x, p)["valid"],
                 _module_conditionals(permutation, perm),
                 lambda k, n=n_perm: float(permutation.ancestral_valid_probability(n, k))),
  ]
  if not tiny:
    sp = sudoku4.DEFAULT
    out.append(OracleTask("sudoku4", sudoku4.make_task(sp), sudoku4.CELLS,
                          sudoku4.make_exact_denoiser(sp), None,
                          lambda x, p=sp: sudoku4.checks(x, p)["solved"],
                          _module_conditionals(sudoku4, sp)))
  shared = lists.shared_denoiser(n_list, m_list)
  for kind in lists.KINDS:
    lp = lists.Params(kind=kind, n=n_list, m=m_list)
    out.append(OracleTask(
        f"list_{kind}", lists.make_task(lp), n_list, shared, jnp.int32(lp.kind_code),
        lambda x, p=lp: lists.checks(x, p)["valid"], _module_conditionals(lists, lp),
        lambda k, kind=kind, n=n_list: float(lists.ancestral_valid_probability(kind, n, k))))
  if not tiny:
    sa = scan_and_add.DEFAULT
    out.append(OracleTask(
        "scan_and_add", scan_and_add.make_task(sa), 0, scan_and_add.exact_denoiser, None,
        functools.partial(_scan_and_add_valid, params=sa),
        _module_conditionals(scan_and_add, sa)))
  if names is not None:
    unknown = sorted(set(names) - {t.name for t in out})
    if unknown or "permutation" not in names:
      raise ValueError(f"tasks={list(names)!r}: must name tasks among "
                       f"{[t.name for t in out]}, permutation among them.")
    out = [t for t in out if t.name in names]
  return out


@dataclasses.dataclass(frozen=True)
class Point:
  """One family at one knob setting."""

  family: str
  knobs: tuple  # (name, value) pairs, as reported
  spec: sampling.SamplerSpec
  product_steps: bool  # each step draws its group from per-position laws: the bound applies


def _steps_for(tpf: float, n: int, multiple: int = 1) -> int:
  steps = max(1, math.ceil(n / tpf))
  return max(multiple, math.ceil(steps / multiple) * multiple)


def grid(n: int, sizes: str = "full", offset: int = 0) -> list[Point]:
  """Every family's knob grid for `n` generated positions (from canvas position `offset`).
  Step counts are set by a target parallelism rho (steps = ceil(n / rho)), the same rho on
  every task; thresholds and the entropy bound are the same values on every task (they
  adapt the steps). sizes="tiny" (tests): ancestral at one and n steps, entropy-bounded,
  speculative."""
  if sizes == "tiny":
    return ([Point("ancestral", (("steps", k),), sampling.AncestralSpec(steps=k), True)
             for k in sorted({n, 1}, reverse=True)]
            + [Point("entropy_bounded", (("gamma", 0.5),),
                     sampling.EntropyBoundedSpec(steps=n, gamma=0.5), True),
               Point("speculative", (("k", 2),), sampling.SpeculativeSpec(k=2), False)])
  pts = []
  # A step family's setting is its target rho ("n": one step), the same label on every
  # task, so that settings can be averaged over tasks; two labels may give one spec.
  rhos = ((1, 1), (2, 2), (4, 4), ("n", n))
  for label, rho in rhos:
    steps = _steps_for(rho, n)
    knobs = (("rho", label), ("steps", steps))
    pts.append(Point("ancestral", knobs, sampling.AncestralSpec(steps=steps), True))
    pts.append(Point("confidence", knobs, sampling.ConfidenceSpec(steps=steps), True))
  for tau in (0.9, 0.7, 0.5, 0.3):
    pts.append(Point("confidence_threshold", (("threshold", tau),),
                     sampling.ConfidenceSpec(steps=n, threshold=tau), True))
  for gamma in (0.1, 0.5, 1.5, 4.0):
    pts.append(Point("entropy_bounded", (("gamma", gamma),),
                     sampling.EntropyBoundedSpec(steps=n, gamma=gamma), True))
  if n % 2 == 0:
    block = n // 2
    for label, rho in rhos[:3]:
      steps = _steps_for(rho, n, 2)
      pts.append(Point("blocks_confidence",
                       (("rho", label), ("block_length", block), ("steps", steps)),
                       sampling.ConfidenceSpec(steps=steps, block_length=block), True))
  for label, rho in rhos[:2]:
    steps = _steps_for(rho, n)
    pts.append(Point("remask", (("rho", label), ("steps", steps), ("eta", 0.05)),
                     sampling.RemaskSpec(steps=steps, eta=0.05), False))
  for threshold in (0.02, 0.2):
    pts.append(Point("defer", (("threshold", threshold),),
                     sampling.DeferSpec(steps=n, threshold=threshold), False))
  for label, rho in rhos[1:3]:
    steps = _steps_for(rho, n)
    pts.append(Point("dream_entropy", (("rho", label), ("steps", steps)),
                     sampling.DreamSpec(steps=steps, alg="entropy"), True))
  for chunk in (2, 4):
    if chunk <= n:
      groups = tuple(tuple(range(offset + i, offset + min(i + chunk, n)))
                     for i in range(0, n, chunk))
      pts.append(Point("left_to_right_chunks", (("chunk", chunk),),
                       sampling.OrderedSpec(groups=groups), True))
  pts.append(Point("random_order", (), sampling.RandomOrderSpec(), True))
  for k in (2, 4, 8):
    if k <= n:
      pts.append(Point("speculative", (("k", k),), sampling.SpeculativeSpec(k=k), False))
  return pts


def forwards_per_row(spec, rounds_B) -> np.ndarray:
  """Denoiser calls a row alone needs: its rounds; speculative verification adds its
  start-up call; test-and-defer calls twice a step but once at its last (commit-all) step."""
  rounds_B = np.asarray(rounds_B, np.float64)
  if isinstance(spec, sampling.SpeculativeSpec):
    return rounds_B + 1
  if isinstance(spec, sampling.DeferSpec):
    return 2 * rounds_B - 1
  return rounds_B


def canvas_of(ot: OracleTask, rows: int, seed: int) -> np.ndarray:
  """Prompts drawn from the law (fixed seed), generated positions masked."""
  data = np.array(ot.task.sample_data(jax.random.key(seed + 1), rows))
  data[:, ot.prompt_length:] = ot.task.mask_id
  return data.astype(np.int32)


def run_point(ot: OracleTask, point: Point, canvas: np.ndarray, seed: int, *,
              denoiser=None, denoiser_params=None) -> tuple[dict, Any]:
  """One (task, family, knobs) point: accuracy and TPF with standard errors."""
  denoiser = ot.denoiser if denoiser is None else denoiser
  params = ot.denoiser_params if denoiser is None or denoiser is ot.denoiser else denoiser_params
  started = time.perf_counter()
  out = sampling.sample(denoiser, params, jax.random.key(seed), canvas, point.spec,
                        mask_id=ot.task.mask_id)
  tokens = np.asarray(out.tokens_BxL)
  seconds = time.perf_counter() - started
  valid = ot.valid(tokens).astype(np.float64)
  rows = len(valid)
  acc = float(valid.mean())
  calls = forwards_per_row(point.spec, out.counters.rounds_B)
  mean_calls = float(calls.mean())
  tpf = ot.generated / mean_calls
  # Delta method for N / mean(calls): se = N sd(calls) / (sqrt(B) mean(calls)^2).
  tpf_se = ot.generated * float(calls.std(ddof=1)) / (math.sqrt(rows) * mean_calls**2) \
      if rows > 1 else 0.0
  record = {
      "task": ot.name, "family": point.family, "knobs": dict(point.knobs),
      "spec": repr(point.spec), "rows": rows, "generated": ot.generated,
      "accuracy": acc, "accuracy_se": math.sqrt(acc * (1 - acc) / rows),
      "tv_lower": 1.0 - acc,
      "tpf": tpf, "tpf_se": tpf_se, "mean_forwards": mean_calls, "nfe_batch": int(out.nfe),
      "seconds": seconds,
  }
  return record, out


def closed_form_check(ot: OracleTask, point: Point, record: dict) -> dict | None:
  """Ancestral decoding with K equal steps against the task's closed form."""
  if ot.closed_form is None or point.family != "ancestral":
    return None
  k = dict(point.knobs)["steps"]
  exact = ot.closed_form(k)
  se = math.sqrt(exact * (1 - exact) / record["rows"])  # the binomial SE at the exact value
  z = (record["accuracy"] - exact) / se if se > 0 else (0.0 if record["accuracy"] == exact
                                                          else math.inf)
  return {"task": ot.name, "steps": k, "closed_form": exact, "measured": record["accuracy"],
          "se": se, "z": z, "within_4_se": abs(z) <= 4.0}


def bound_check(ot: OracleTask, point: Point, out, canvas: np.ndarray, rows: int, *,
                sampler_laws=None, max_leaves: int = 1 << 13) -> dict | None:
  """KL >= TC on every step of the first `rows` rows that wrote two or more positions."""
  if not point.product_steps or rows <= 0:
    return None
  fixed = np.zeros(canvas.shape, bool)
  fixed[:, :ot.prompt_length] = True
  records = parallelism.step_bounds(
      ot.conditionals, np.asarray(out.tokens_BxL)[:rows], np.asarray(out.write_step_BxL)[:rows],
      mask_id=ot.task.mask_id, vocab_size=ot.task.vocab_size, sampler_laws=sampler_laws,
      fixed_BxL=fixed[:rows], max_leaves=max_leaves)
  return {"task": ot.name, "family": point.family, "knobs": dict(point.knobs),
          "rows": rows, **parallelism.summarize(records)}


def aup_table(points: list[dict]) -> dict:
  """AUP per task and family; y_max is the best accuracy on the task over every family."""
  table = {}
  for task in sorted({p["task"] for p in points}):
    on_task = [p for p in points if p["task"] == task]
    y_max = 100.0 * max(p["accuracy"] for p in on_task)
    table[task] = {}
    for family in sorted({p["family"] for p in on_task}):
      fam = [p for p in on_task if p["family"] == family]
      table[task][family] = (parallelism.aup([p["tpf"] for p in fam],
                                             [100.0 * p["accuracy"] for p in fam], y_max)
                             if y_max > 0 else 0.0)
  return table


TASK_SPECIFIC_KNOBS = ("steps", "block_length")  # follow from rho and the task's length


def adaptivity(points: list[dict], targets=(1.5, 2.0, 3.0, 4.0)) -> dict:
  """Per family, each setting present on every task with its mean TPF and mean accuracy over
  the tasks (and the standard error of the mean accuracy); at each target mean TPF, the
  family's best mean accuracy among its settings whose mean TPF reaches it (None if none
  does), and the family with the highest."""
  tasks = sorted({p["task"] for p in points})
  curves = {}
  for family in sorted({p["family"] for p in points}):
    settings = {}
    for p in points:
      if p["family"] == family:
        setting = {k: v for k, v in p["knobs"].items() if k not in TASK_SPECIFIC_KNOBS}
        settings.setdefault(json.dumps(setting, sort_keys=True), []).append(p)
    curve = []
    for knobs, pts in settings.items():
      if len({p["task"] for p in pts}) != len(tasks):
        continue  # a setting missing on some task (blocks need an even length, chunks n)
      pts = list({p["task"]: p for p in pts}.values())
      curve.append({"knobs": json.loads(knobs),
                    "mean_tpf": float(np.mean([p["tpf"] for p in pts])),
                    "mean_accuracy": float(np.mean([p["accuracy"] for p in pts])),
                    "mean_accuracy_se": float(np.sqrt(np.sum([p["accuracy_se"]**2 for p in pts]))
                                              / len(pts)),
                    "tpf_by_task": {p["task"]: p["tpf"] for p in pts}})
    curve.sort(key=lambda c: c["mean_tpf"])
    at = {}
    for target in targets:
      reach = [c["mean_accuracy"] for c in curve if c["mean_tpf"] >= target]
      at[str(target)] = max(reach) if reach else None
    curves[family] = {"curve": curve, "accuracy_at_mean_tpf": at}
  best = {}
  for target in targets:
    scored = {f: c["accuracy_at_mean_tpf"][str(target)] for f, c in curves.items()
              if c["accuracy_at_mean_tpf"][str(target)] is not None}
    top = max(scored.values()) if scored else None
    best[str(target)] = sorted(f for f, v in scored.items() if v == top) if scored else []
  return {"tasks": tasks, "families": curves, "best_at_mean_tpf": best}


def sweep(tasks: list[OracleTask], rows: int, seed: int, sizes: str, bound_rows: int,
          log=print, denoiser=None, denoiser_params=None, sampler_laws=None) -> dict:
  points, closed, bounds = [], [], []
  for ot in tasks:
    canvas = canvas_of(ot, rows, seed)
    started = time.perf_counter()
    for point in grid(ot.generated, sizes, ot.prompt_length):
      record, out = run_point(ot, point, canvas, seed, denoiser=denoiser,
                              denoiser_params=denoiser_params)
      points.append(record)
      check = closed_form_check(ot, point, record)
      if check and not any(c["task"] == check["task"] and c["steps"] == check["steps"]
                           for c in closed):  # two rho labels may give one spec
        closed.append(check)
      bound = bound_check(ot, point, out, canvas, bound_rows, sampler_laws=sampler_laws)
      if bound:
        bounds.append(bound)
    log(f"{ot.name}: {len(grid(ot.generated, sizes, ot.prompt_length))} points in "
        f"{time.perf_counter() - started:.1f} s")
  return {"points": points, "closed_forms": closed, "bound": bounds}


def permutation_trajectory(n: int, steps: Sequence[int]) -> list[dict]:
  """Ancestral decoding of permutation: the output's exact KL from the law, -log P(valid)
  (its valid outputs are uniform by symmetry), beside the summed TC of the groups along the
  ideal trajectory, which bounds it from above (data processing on trajectories)."""
  out = []
  for k in steps:
    valid = float(permutation.ancestral_valid_probability(n, k))
    out.append({"n": n, "steps": k, "valid": valid, "output_kl": -math.log(valid),
                "expected_summed_tc": permutation.ancestral_expected_total_correlation(n, k)})
  return out


# ----------------------------------------------------------------------------
# The trained model.
# ----------------------------------------------------------------------------


def train_model(workdir: str, n: int, train_steps: int, seed: int, log=print):
  """A small denoiser trained on permutation (n items) in `workdir`; a finished run there
  is only loaded."""
  import mdjax
  from mdjax import train

  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if root not in sys.path:
    sys.path.insert(0, root)  # configs/ lives at the repository root
  from configs.base import base_config

  c = base_config()
  c.task = "permutation"
  c.task_kwargs = {"n": n}
  c.seed = seed
  c.batch_size = 128
  c.model.update(d_model=64, num_layers=2, num_heads=4, d_ff=128)
  c.train.update(num_steps=train_steps, lr=2e-3, warmup_steps=min(100, train_steps))
  c.checkpoint.update(every=train_steps, keep=1)
  c.eval_every = 0
  c.num_eval_samples = 0
  c.log_every = train_steps
  c.sampler = {"family": "ancestral", "steps": n}
  started = time.perf_counter()
  train.train(c, workdir, log=lambda *a: None)
  seconds = time.perf_counter() - started
  log(f"trained model: {workdir} ({train_steps} steps, {seconds:.1f} s)")
  return mdjax.load(workdir), {"task": "permutation", "n": n, "train_steps": train_steps,
                               "batch_size": c.batch_size, "d_model": 64, "num_layers": 2,
                               "seconds": seconds}


def model_laws(model):
  """The model's per-position laws (softmax of its logits) as numpy conditionals."""
  apply = jax.jit(lambda params, tokens: jax.nn.softmax(
      model.denoiser(params, tokens, jnp.ones(tokens.shape[:1]))))

  def laws(tokens_NxL):
    return np.asarray(apply(model.params, jnp.asarray(tokens_NxL)), np.float64), None
  return laws


# ----------------------------------------------------------------------------
# Plots.
# ----------------------------------------------------------------------------


def plot(results: dict, prefix: str) -> list[str]:
  """Accuracy against TPF per task (every family, error bars), and oracle against trained."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  paths = []
  points = results["oracle"]["points"]
  tasks = results["adaptivity"]["tasks"]
  families = sorted({p["family"] for p in points})
  colors = {f: plt.cm.tab20(i % 20) for i, f in enumerate(families)}
  markers = {f: "osD^v<>ph*X"[i % 11] for i, f in enumerate(families)}
  cols = 4
  fig, axes = plt.subplots(math.ceil(len(tasks) / cols), cols, figsize=(4 * cols, 3.2 * math.ceil(
      len(tasks) / cols)), squeeze=False)
  for ax, task in zip(axes.flat, tasks):
    for f in families:
      pts = sorted((p for p in points if p["task"] == task and p["family"] == f),
                   key=lambda p: p["tpf"])
      if pts:
        ax.errorbar([p["tpf"] for p in pts], [p["accuracy"] for p in pts],
                    xerr=[p["tpf_se"] for p in pts], yerr=[p["accuracy_se"] for p in pts],
                    marker=markers[f], ms=3, lw=1, capsize=2, color=colors[f], label=f)
    ax.set_title(task)
    ax.set_xlabel("tokens per forward (bs=1)")
    ax.set_ylabel("valid fraction")
    ax.set_ylim(-0.02, 1.02)
  for ax in list(axes.flat)[len(tasks):]:
    ax.axis("off")
  axes.flat[0].legend(fontsize=6)
  fig.tight_layout()
  path = f"{prefix}_accuracy.png"
  fig.savefig(path, dpi=110)
  plt.close(fig)
  paths.append(path)

  if results.get("trained"):
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    task = results["trained"]["task_name"]
    for i, (label, res) in enumerate((("exact oracle", results["oracle"]),
                                      ("trained model", results["trained"]))):
      for f in families:
        pts = sorted((p for p in res["points"] if p["task"] == task and p["family"] == f),
                     key=lambda p: p["tpf"])
        if pts:
          ax[i].errorbar([p["tpf"] for p in pts], [p["accuracy"] for p in pts],
                         yerr=[p["accuracy_se"] for p in pts], marker=markers[f], ms=3,
                         lw=1, capsize=2, color=colors[f], label=f)
      ax[i].set_title(f"{task}: {label}")
      ax[i].set_xlabel("tokens per forward (bs=1)")
      ax[i].set_ylabel("valid fraction")
      ax[i].set_ylim(-0.02, 1.02)
    ax[0].legend(fontsize=6)
    fig.tight_layout()
    path = f"{prefix}_trained.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
  return paths


def run(*, sizes: str = "full", rows: int = 1000, bound_rows: int = 8, seed: int = SEED,
        train_steps: int = 1500, workdir: str | None = None, tasks: Sequence[str] | None = None,
        log=print) -> dict:
  """The whole bench as one dict (results/parallelism.json)."""
  started = time.perf_counter()
  tasks = oracle_tasks(sizes, tasks)
  oracle = sweep(tasks, rows, seed, sizes, bound_rows, log)
  oracle_seconds = time.perf_counter() - started
  perm = next(t for t in tasks if t.name == "permutation")
  results = {
      "config": {"seed": seed, "rows": rows, "bound_rows": bound_rows, "sizes": sizes,
                 "tasks": {t.name: {"length": t.task.length, "generated": t.generated,
                                    "prompt_length": t.prompt_length,
                                    "vocab_size": t.task.vocab_size} for t in tasks},
                 "jax": jax.__version__, "backend": jax.default_backend()},
      "oracle": oracle,
      "oracle_seconds": oracle_seconds,
      "aup": aup_table(oracle["points"]),
      "adaptivity": adaptivity(oracle["points"]),
      "permutation_trajectory": permutation_trajectory(
          perm.generated, sorted({dict(p["knobs"])["steps"] for p in oracle["points"]
                                  if p["task"] == "permutation"
                                  and p["family"] == "ancestral"})),
      "trained": None,
  }
  if train_steps > 0:
    with tempfile.TemporaryDirectory() as tmp:
      model, info = train_model(workdir or os.path.join(tmp, "permutation"), perm.generated,
                                train_steps, seed, log)
      trained = sweep([perm], rows, seed, sizes, bound_rows, log, denoiser=model.denoiser,
                      denoiser_params=model.params, sampler_laws=model_laws(model))
    trained["model"] = info
    trained["task_name"] = perm.name
    trained["aup"] = aup_table(trained["points"])
    results["trained"] = trained
  results["seconds"] = time.perf_counter() - started
  return results


def report(results: dict, log=print) -> None:
  """The figures a reader checks first."""
  for c in results["oracle"]["closed_forms"]:
    log(f"closed form {c['task']:13s} K={c['steps']:2d}: exact {c['closed_form']:.4f}  "
        f"measured {c['measured']:.4f} ± {c['se']:.4f}  z {c['z']:+.2f}")
  for part in ("oracle", "trained"):
    if not results.get(part):
      continue
    for b in results[part]["bound"]:
      if b["steps_measured"]:
        log(f"bound [{part}] {b['task']:13s} {b['family']:20s} {json.dumps(b['knobs']):22s} "
            f"steps {b['steps_measured']:3d}  TC {b['tc_mean']:.3f}  KL {b['kl_mean']:.3f}  "
            f"violations {b['violations']}")
  for task, fams in results["aup"].items():
    log(f"AUP {task:13s} " + "  ".join(f"{f} {v:.0f}" for f, v in sorted(
        fams.items(), key=lambda kv: -kv[1])))
  log(f"best family at equal mean TPF: {results['adaptivity']['best_at_mean_tpf']}")
  if results.get("trained"):
    log(f"AUP trained {results['trained']['aup']}")
  log(f"oracle sweep {results['oracle_seconds']:.0f} s; total {results['seconds']:.0f} s")


def main(argv: Sequence[str] | None = None, log=print) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="results/parallelism.json")
  parser.add_argument("--plots", default=None, help="PNG prefix (default: next to --out)")
  parser.add_argument("--rows", type=int, default=1000)
  parser.add_argument("--bound_rows", type=int, default=8)
  parser.add_argument("--train_steps", type=int, default=1500, help="0: no trained model")
  parser.add_argument("--sizes", default="full", choices=("full", "tiny"))
  parser.add_argument("--seed", type=int, default=SEED)
  parser.add_argument("--tasks", default=None, help="comma-separated task names (default: all)")
  args = parser.parse_args(argv)
  for name in ("rows", "bound_rows", "train_steps"):
    value = getattr(args, name)
    if value < (1 if name == "rows" else 0):
      raise ValueError(f"--{name}={value} must be >= {1 if name == 'rows' else 0}.")
  results = run(sizes=args.sizes, rows=args.rows, bound_rows=args.bound_rows, seed=args.seed,
                train_steps=args.train_steps,
                tasks=args.tasks.split(",") if args.tasks else None, log=log)
  report(results, log)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(results, f, indent=1)
  prefix = args.plots or os.path.splitext(args.out)[0]
  results["plots"] = plot(results, prefix)
  log(f"wrote {args.out} and {', '.join(results['plots'])}")
  return results


def _fast_cpu_compile() -> None:
  """The sweep is compile-bound (hundreds of tiny programs, each run once), so on the CPU it
  compiles as the test suite does (tests/conftest.py): LLVM at -O0 and, on jaxlib 0.10,
  XLA:CPU's elemental emitters, which compile these programs 2 to 3x faster. Every point
  comes out the same (the accuracies and call counts are exact draws, not timings). Set
  before the backend starts; flags given in XLA_FLAGS stand."""
  import importlib.metadata
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_backend_optimization_level" not in flags:
    flags += " --xla_backend_optimization_level=0"
  if ("--xla_cpu_use_fusion_emitters" not in flags
      and importlib.metadata.version("jaxlib").startswith("0.10.")):
    flags += " --xla_cpu_use_fusion_emitters=false"  # a flag older and newer XLAs refuse
  os.environ["XLA_FLAGS"] = flags.strip()


if __name__ == "__main__":
  if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    _fast_cpu_compile()
  main()
