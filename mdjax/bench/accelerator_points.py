"""The points of `mdjax.bench.accelerators`: each method (a name, its knobs, a sampler spec;
trained or not) measured on a teacher in results/parallelism.json's record, with `method`,
`trained`, `teacher` and `temperature`; the calls of a spec decoding several blocks counted
as a batch of one makes them (`block_calls`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from mdjax import sampling
from mdjax.bench import parallelism as bench

ACCEPT_THRESHOLDS = (0.5, 0.9, 0.96, 0.99)
THRESHOLDS = (0.99, 0.9, 0.7, 0.6, 0.5, 0.3)
GAMMAS = (0.1, 0.5, 1.5)
RHOS = (1, 2, 4)
ORACLE, TRAINED = "oracle", "trained"  # the two teachers' labels


@dataclasses.dataclass(frozen=True)
class Method:
  """One point of the sweep: its method name, knobs and spec; trained or training-free."""

  method: str
  knobs: tuple
  spec: Any
  trained: bool


def free_methods(n: int, temperature: float, sizes: str) -> list[Method]:
  """The training-free families' points for `n` generated positions."""
  t = dict(temperature=temperature)
  if sizes == "tiny":
    return [Method("confidence_threshold", (("threshold", 0.9),),
                   sampling.ConfidenceSpec(steps=n, threshold=0.9, **t), False),
            Method("ancestral", (("steps", n),), sampling.AncestralSpec(steps=n, **t), False)]
  out = [Method("confidence_threshold", (("threshold", tau),),
                sampling.ConfidenceSpec(steps=n, threshold=tau, **t), False) for tau in THRESHOLDS]
  out += [Method("entropy_bounded", (("gamma", g),),
                 sampling.EntropyBoundedSpec(steps=n, gamma=g, **t), False) for g in GAMMAS]
  for rho in RHOS:
    steps = max(1, math.ceil(n / rho))
    out.append(Method("confidence", (("steps", steps),),
                      sampling.ConfidenceSpec(steps=steps, **t), False))
    out.append(Method("ancestral", (("steps", steps),), sampling.AncestralSpec(steps=steps, **t),
                      False))
  return out


def filter_methods(n: int, filt, temperature: float, sizes: str) -> list[Method]:
  """The learned_commit sampler at its accept thresholds."""
  accept = ACCEPT_THRESHOLDS[1:3] if sizes == "tiny" else ACCEPT_THRESHOLDS
  return [Method("learned_commit", (("accept_threshold", a),),
                 sampling.LearnedCommitSpec(steps=n, commit_filter=filt, accept_threshold=a,
                                            temperature=temperature), True) for a in accept]


def student_methods(name: str, n: int, temperature: float, sizes: str,
                    block_size: int | None = None) -> list[Method]:
  """A student decoded with the training-free thresholds (the references decode theirs with
  a threshold) and one position a step; a block-causal student (CDLM's) block by block
  with the exact cache of the finished blocks, its reference's rule."""
  thresholds = (0.9,) if sizes == "tiny" else THRESHOLDS
  t = dict(temperature=temperature)
  blocks = {} if block_size is None else dict(block_length=block_size, kv_cache="exact")
  more = tuple(blocks.items())
  return ([Method(name, (("threshold", tau),) + more,
                  sampling.ConfidenceSpec(steps=n, threshold=tau, **blocks, **t), True)
           for tau in thresholds]
          + [Method(name, (("steps", n),) + more, sampling.ConfidenceSpec(steps=n, **blocks, **t),
                    True)])


def block_calls(spec, write_step_BxL, prompt_length: int) -> np.ndarray | None:
  """The denoiser calls each row alone makes under a spec of several blocks (None for any
  other): its distinct write steps. A row's block finished early leaves it idle until the
  next block's first step, steps a batch of one skips and `rounds_B` still counts; each
  call of a row that never rewrites writes at least one position."""
  block = getattr(spec, "block_length", None)
  writes_BxG = np.asarray(write_step_BxL)[:, prompt_length:]
  if block is None or block >= writes_BxG.shape[1]:
    return None
  return np.array([len(set(row[row >= 0].tolist())) for row in writes_BxG], np.float64)


def measure(ot: bench.OracleTask, m: Method, canvas: np.ndarray, seed: int,
            temperature: float, teacher: str) -> dict:
  """One point: results/parallelism.json's record, with method, trained, teacher and
  temperature."""
  record, out = bench.run_point(ot, bench.Point(m.method, m.knobs, m.spec, False), canvas,
                                seed)
  calls = block_calls(m.spec, out.write_step_BxL, ot.prompt_length)
  if calls is not None:  # bench.run_point's delta method on the calls of a batch of one
    mean_calls, rows = float(calls.mean()), len(calls)
    record.update(mean_forwards=mean_calls, tpf=ot.generated / mean_calls,
                  tpf_se=ot.generated * float(calls.std(ddof=1)) / (math.sqrt(rows)
                                                                   * mean_calls**2))
  record.update(method=m.method, trained=m.trained, teacher=teacher, temperature=temperature)
  return record


def student_points(ot: bench.OracleTask, model, name: str, canvas: np.ndarray, seed: int,
                   sizes: str, temperature: float = 0.0) -> list[dict]:
  """A student's points on the trained teacher's prompts at `temperature` (a block-causal
  one in its own blocks, with the exact cache)."""
  return [measure(with_model(ot, model), m, canvas, seed, temperature, TRAINED)
          for m in student_methods(name, ot.generated, temperature, sizes,
                                   model.denoiser.block_size)]


def with_model(ot: bench.OracleTask, model) -> bench.OracleTask:
  """The task with a model in place of its exact denoiser."""
  return dataclasses.replace(ot, denoiser=model.denoiser, denoiser_params=model.params)
