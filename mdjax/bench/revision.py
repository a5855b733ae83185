"""Discard or reopen, answered exactly: validity at equal denoiser calls K on exact oracles.

`python -m mdjax.bench.revision` writes results/revision.json and results/revision.png.
On two_color and permutation (n = 3), with each task's exact denoiser under each process:

- absorbing noise: ancestral (reveal and keep), confidence (MaskGIT/LLaDA) and remasking
  (ReMDM, eta = 0.05: committed tokens may return to the mask);
- uniform noise: the exact ancestral reverse kernel (`uniform_ancestral`: every token may be
  rewritten at every step) and DiffusionGemma's rule (`diffusion_gemma`, the reference's
  defaults; `diffusion_gemma_t1`: temperature 1, the denoiser's own law);
- GIDD's hybrid noise (p_uniform = 0.1): `uniform_ancestral`.

Each row is one (task, process, sampler, K): `invalid` (the fraction of sampled rows the law
cannot produce), its binomial standard error, and `exact`: the exact invalid rate where it
is known, else null. The exact value is the closed form for two_color under uniform noise
(`two_color_uniform_invalid`, derived in docs/revision.md) and for absorbing ancestral on
two_color (1/(2K)); for the other samplers whose step draws positions independently given
the canvas (ancestral under any process, DiffusionGemma's rule) it is the law of the
sampler's Markov chain over every canvas, propagated exactly (`chain_invalid`). Fixed seed;
the JSON is written atomically.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

import mdjax
from mdjax import files, jsonl, noise, sampling, tasks
from mdjax.sampling.families import diffusion_gemma

SEED = 0
ALL_STEPS = tuple(range(1, 33))  # the closed form's sweep
STEPS = (1, 2, 4, 8, 16, 32)  # every other sampler's
HYBRID_P_UNIFORM = 0.1  # GIDD's default share of uniform noise
FLOOR = 1e-4  # where the log-scale plot draws an invalid rate of 0


# ----------------------------------------------------------------------------
# The closed form (docs/revision.md).
# ----------------------------------------------------------------------------


def two_color_uniform_invalid(steps: int) -> Fraction:
  """The exact invalid rate of two_color after K equal steps of the factorized uniform
  ancestral sampler with the exact denoiser, linear schedule, V = 2 colors.

  m = P(equal) - P(different) starts at 0 (two uniform colors) and each step t -> s, with
  keep-probabilities a = 1 - t, b = 1 - s and r = a / b, maps it to
      m' = (1 + m)/2 d_E^2 - (1 - m)/2 d_D^2,
      d_E = r (1 + b^2) / (1 + a^2),   d_D = r (1 - b^2) / (1 - a^2);
  the invalid rate is (1 - m_K) / 2. Exact rational arithmetic.
  """
  m = Fraction(0)
  for j in range(steps):
    a, b = Fraction(j, steps), Fraction(j + 1, steps)
    r = a / b
    d_equal = r * (1 + b * b) / (1 + a * a)
    d_different = r * (1 - b * b) / (1 - a * a) if a < 1 else Fraction(0)
    m = (1 + m) / 2 * d_equal**2 - (1 - m) / 2 * d_different**2
  return (1 - m) / 2


# ----------------------------------------------------------------------------
# The exact law of a factorized sampler: its Markov chain over every canvas.
# ----------------------------------------------------------------------------


def _states(num_states: int, length: int) -> np.ndarray:
  return np.array(list(itertools.product(range(num_states), repeat=length)), np.int32)


def chain_invalid(model, invalid_fn: Callable, step_law: Callable, steps: int,
                  start_law_S: np.ndarray) -> float:
  """The exact invalid rate after `steps` steps of a sampler whose step draws every position
  independently given the canvas: `step_law(model, tokens_NxL, j, steps)` -> the per-position
  laws N x L x S. The law over the S^L canvases is propagated through the product
  transition matrices, from the product start law `start_law_S` per position."""
  length, num_states = model.max_len, len(start_law_S)
  z_NxL = _states(num_states, length)
  law_N = np.prod(start_law_S[z_NxL], -1)
  for j in range(steps):
    laws_NxLxS = np.asarray(step_law(model, jnp.asarray(z_NxL), j, steps), np.float64)
    # A canvas the chain cannot reach (a visible token at t = 1 under absorbing noise) may
    # have no law (0/0); it carries no mass.
    laws_NxLxS = np.where(law_N[:, None, None] > 0, laws_NxLxS, 0.0)
    # T[z, z'] = prod_i laws[z, i, z'_i]
    transition_NxN = np.prod(laws_NxLxS[:, np.arange(length)[None, :], z_NxL], -1)
    law_N = law_N @ transition_NxN
  bad_N = np.asarray(invalid_fn(z_NxL), bool) | (z_NxL >= model.vocab_size).any(-1)
  return float(law_N[bad_N].sum() / law_N.sum())


def posterior(model, z_NxL, t: float):
  t_N = jnp.full((z_NxL.shape[0],), t, jnp.float32)
  return jax.nn.softmax(model.denoiser(model.params, z_NxL, t_N).astype(jnp.float32), -1)


def ancestral_law(process):
  """The exact reverse step of `process` (uniform_ancestral; under absorbing noise the
  ancestral sampler's law)."""

  def law(model, z_NxL, j, steps):
    t, s = 1.0 - j / steps, 1.0 - (j + 1) / steps
    n = z_NxL.shape[0]
    return process.reverse_step(posterior(model, z_NxL, t), z_NxL, jnp.full((n,), s),
                                jnp.full((n,), t))
  return law


def gemma_law(spec: sampling.DiffusionGemmaSpec):
  """DiffusionGemma's step (no early stop): kept positions drawn from the shaped posterior,
  the others uniform tokens; which are kept is a function of the canvas."""
  temperatures = diffusion_gemma.anneal(spec, 1.0 - np.arange(spec.steps) / spec.steps)

  def law(model, z_NxL, j, steps):
    shaped = jnp.log(posterior(model, z_NxL, 1.0 - j / steps)) / temperatures[j]
    probs_NxLxV = jax.nn.softmax(shaped, -1)
    if j == steps - 1 and not spec.final_renoise:
      return probs_NxLxV
    entropy = -jnp.sum(jnp.where(probs_NxLxV > 0, probs_NxLxV * jnp.log(probs_NxLxV), 0), -1)
    kept = diffusion_gemma.kept_within_bound(entropy, jnp.ones(z_NxL.shape, bool),
                                             spec.entropy_bound)
    return jnp.where(kept[..., None], probs_NxLxV, 1.0 / model.vocab_size)
  return law


# ----------------------------------------------------------------------------
# The sweep.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sampler:
  """One sampler of the table: its spec at K steps, its exact step law at K steps (None: no
  exact value), and the process its model is the oracle of."""

  name: str
  process: str
  spec: Callable[[int], sampling.SamplerSpec]
  law: Callable[[int], Callable] | None = None


def samplers(vocab_size: int) -> list[Sampler]:
  absorbing = noise.Absorbing(vocab_size=vocab_size)
  uniform = noise.Uniform(vocab_size=vocab_size)
  hybrid = noise.Hybrid(vocab_size=vocab_size, p_uniform=HYBRID_P_UNIFORM)
  gemma = lambda k: sampling.DiffusionGemmaSpec(steps=k)
  gemma_t1 = lambda k: sampling.DiffusionGemmaSpec(steps=k, max_temperature=1.0,
                                                   min_temperature=1.0)
  return [
      Sampler("ancestral", "absorbing", lambda k: sampling.AncestralSpec(steps=k),
              lambda k: ancestral_law(absorbing)),
      Sampler("confidence", "absorbing", lambda k: sampling.ConfidenceSpec(steps=k)),
      Sampler("remask", "absorbing", lambda k: sampling.RemaskSpec(steps=k)),
      Sampler("uniform_ancestral", "uniform", lambda k: sampling.UniformAncestralSpec(
          steps=k, noise=uniform), lambda k: ancestral_law(uniform)),
      Sampler("diffusion_gemma", "uniform", gemma, lambda k: gemma_law(gemma(k))),
      Sampler("diffusion_gemma_t1", "uniform", gemma_t1, lambda k: gemma_law(gemma_t1(k))),
      Sampler("uniform_ancestral", "hybrid", lambda k: sampling.UniformAncestralSpec(
          steps=k, noise=hybrid), lambda k: ancestral_law(hybrid)),
  ]


def invalid_fn(task) -> Callable:
  """Per row: the law cannot produce it (two_color: the colors differ)."""
  if task.name == "two_color":
    return lambda tokens: np.asarray(tokens)[:, 0] != np.asarray(tokens)[:, 1]
  return lambda tokens: np.asarray(task.is_impossible(jnp.asarray(tokens)))


def _model(task_name: str, task_kwargs: dict | None, process_name: str, vocab_size: int):
  process = (noise.Hybrid(vocab_size=vocab_size, p_uniform=HYBRID_P_UNIFORM)
             if process_name == "hybrid" else process_name)
  return mdjax.load(task_name, task_kwargs=task_kwargs, noise=process)


def exact_value(task, sampler: Sampler, model, steps: int) -> float | None:
  if task.name == "two_color" and sampler.name == "confidence":
    return 0.5 if steps == 1 else 0.0  # K >= 2 writes one position a step
  if sampler.law is None:
    return None
  if task.name == "two_color" and sampler.process == "uniform" and \
      sampler.name == "uniform_ancestral":
    return float(two_color_uniform_invalid(steps))
  if task.name == "two_color" and sampler.name == "ancestral":
    return 1.0 / (2 * steps)
  process = model.noise
  start = np.zeros(process.num_states)
  with jax.ensure_compile_time_eval():
    _, mask_1, uniform_1 = (float(x[0]) for x in process.coefficients(jnp.ones((1,))))
  start[:process.vocab_size] = uniform_1 / process.vocab_size
  if process.has_mask:
    start[process.mask_id] = mask_1
  return chain_invalid(model, invalid_fn(task), sampler.law(steps), steps, start)


def sweep(task_list: Sequence[tuple[str, dict | None]], rows: int, seed: int,
          all_steps: Sequence[int], steps: Sequence[int], log=print) -> list[dict]:
  """Every (task, process, sampler, K) row."""
  out = []
  for task_name, task_kwargs in task_list:
    task = tasks.get(task_name, task_kwargs)
    is_invalid = invalid_fn(task)
    canvas = np.full((rows, task.length), task.mask_id, np.int32)
    for sampler in samplers(task.vocab_size):
      model = _model(task_name, task_kwargs, sampler.process, task.vocab_size)
      ks = all_steps if (task_name == "two_color" and sampler.name == "uniform_ancestral"
                         and sampler.process == "uniform") else steps
      for k in ks:
        key = jax.random.fold_in(jax.random.key(seed), k)
        spec = sampling.with_noise(sampler.spec(k), model.noise)
        result = sampling.sample(model.denoiser, model.params, key, canvas, spec,
                                 mask_id=task.mask_id)
        bad = is_invalid(np.asarray(result.tokens_BxL))
        p = float(bad.mean())
        exact = exact_value(task, sampler, model, k)
        out.append({"task": task_name, "process": sampler.process, "sampler": sampler.name,
                    "steps": k, "invalid": p, "stderr": math.sqrt(p * (1 - p) / rows),
                    "exact": exact})
        log(f"{task_name:11s} {sampler.process:9s} {sampler.name:19s} K={k:2d} invalid "
            f"{p:.4f} ± {out[-1]['stderr']:.4f}" + ("" if exact is None else
                                                    f"  exact {exact:.4f}"))
  return out


def plot(rows: list[dict], path: str) -> str:
  """Invalid rate against K per task: every (process, sampler), exact values dashed."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  tasks = sorted({r["task"] for r in rows}, key=lambda t: t != "two_color")
  fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.2), squeeze=False)
  for ax, task in zip(axes.flat, tasks):
    curves = sorted({(r["process"], r["sampler"]) for r in rows if r["task"] == task})
    for i, (process, name) in enumerate(curves):
      pts = sorted((r for r in rows if r["task"] == task and r["process"] == process
                    and r["sampler"] == name), key=lambda r: r["steps"])
      color = plt.cm.tab10(i % 10)
      ks = [r["steps"] for r in pts]
      ax.errorbar(ks, [max(r["invalid"], FLOOR) for r in pts], yerr=[r["stderr"] for r in pts],
                  marker="o", ms=3, lw=1, capsize=2, color=color, label=f"{process}: {name}")
      exact = [(r["steps"], max(r["exact"], FLOOR)) for r in pts if r["exact"] is not None]
      if exact:
        ax.plot(*zip(*exact), ls="--", lw=1, color=color)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("denoiser calls K")
    ax.set_ylabel(f"invalid fraction (dashed: exact; 0 drawn at {FLOOR:g})")
    ax.set_title(task)
    ax.legend(fontsize=7)
  fig.tight_layout()
  with files.atomic_write(path) as f:
    fig.savefig(f, format="png", dpi=110)
  plt.close(fig)
  return path


SIZES = {"full": dict(tasks=(("two_color", None), ("permutation", {"n": 3})),
                      all_steps=ALL_STEPS, steps=STEPS),
         "tiny": dict(tasks=(("two_color", None),), all_steps=(1, 2, 4), steps=(1, 2))}


def run(*, sizes: str = "full", rows: int = 20_000, seed: int = SEED, log=print) -> dict:
  """The whole study as one dict (results/revision.json)."""
  started = time.perf_counter()
  size = SIZES[sizes]
  table = sweep(size["tasks"], rows, seed, size["all_steps"], size["steps"], log)
  return {"config": {"seed": seed, "rows": rows, "sizes": sizes,
                     "tasks": [{"task": t, "task_kwargs": kw} for t, kw in size["tasks"]],
                     "hybrid_p_uniform": HYBRID_P_UNIFORM, "schedule": "linear",
                     "jax": jax.__version__, "backend": jax.default_backend()},
          "rows": table, "seconds": time.perf_counter() - started}


def main(argv: Sequence[str] | None = None, log=print) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="results/revision.json")
  parser.add_argument("--plot", default=None, help="PNG path (default: next to --out)")
  parser.add_argument("--rows", type=int, default=20_000)
  parser.add_argument("--sizes", default="full", choices=tuple(SIZES))
  parser.add_argument("--seed", type=int, default=SEED)
  args = parser.parse_args(argv)
  if args.rows < 2:
    raise ValueError(f"--rows={args.rows} must be >= 2.")
  results = run(sizes=args.sizes, rows=args.rows, seed=args.seed, log=log)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with files.atomic_write(args.out, "w") as f:
    jsonl.dump(results, f, indent=1)
  path = plot(results["rows"], args.plot or os.path.splitext(args.out)[0] + ".png")
  log(f"wrote {args.out} and {path} ({results['seconds']:.0f} s)")
  return results


if __name__ == "__main__":
  main()
