"""Samples from a task's exact oracle denoiser and prints the task's metrics.

  python sample.py --task=two_color --oracle --sampler=ancestral --steps=8
"""

import json
import os
import time

from absl import app, flags

import jax
import numpy as np

from mdjax import sampling, tasks

_TASK = flags.DEFINE_enum("task", "two_color", sorted(tasks.TASKS), "Task to sample.")
_ORACLE = flags.DEFINE_bool("oracle", True, "Use the task's exact denoiser.")
_SAMPLER = flags.DEFINE_string(
    "sampler", "ancestral",
    "ancestral | confidence | remask | random_order | left_to_right.")
_STEPS = flags.DEFINE_integer("steps", 8, "Number of steps (not for random_order/left_to_right).")
_TEMPERATURE = flags.DEFINE_float("temperature", None, "Softmax temperature; 0 = argmax.")
_TOP_K = flags.DEFINE_integer("top_k", None, "Keep the k most likely values.")
_TOP_P = flags.DEFINE_float("top_p", None, "Nucleus mass in (0, 1].")
_SCORE = flags.DEFINE_string("score", None, "Confidence score (confidence sampler).")
_ETA = flags.DEFINE_float("eta", None, "Remasking strength (remask sampler).")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 10_000, "Number of samples.")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed.")
_OUT = flags.DEFINE_string("out", None, "Directory for samples.jsonl and metrics.json.")


def main(argv):
  del argv
  if not _ORACLE.value:
    raise app.UsageError("--nooracle needs a trained checkpoint; only --oracle is available.")
  task = tasks.TASKS[_TASK.value]
  knobs = dict(temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value)
  if _SAMPLER.value not in ("random_order", "left_to_right"):
    knobs["steps"] = _STEPS.value
  if _SCORE.value is not None:
    knobs["score"] = _SCORE.value
  if _ETA.value is not None:
    knobs["eta"] = _ETA.value
  try:
    spec = sampling.make_spec(_SAMPLER.value, length=task.LENGTH, **knobs)
  except (ValueError, TypeError) as error:
    raise app.UsageError(str(error)) from error
  if _NUM_SAMPLES.value < 1:
    raise app.UsageError(f"--num_samples={_NUM_SAMPLES.value} must be >= 1.")
  print(f"task={_TASK.value} sampler={spec}")
  start = time.perf_counter()
  result = sampling.sample(task.exact_denoiser, None, jax.random.key(_SEED.value),
                           task.empty_canvas(_NUM_SAMPLES.value), spec)
  tokens = np.asarray(result.tokens_BxL)
  elapsed = time.perf_counter() - start
  metrics = task.sample_metrics(tokens)
  metrics.update(nfe=int(result.nfe), seconds=round(elapsed, 3))
  for row in tokens[:5]:
    print("  ", task.decode(row))
  width = max(map(len, metrics))
  for name, value in metrics.items():
    print(f"{name:<{width}}  {value}")
  if _OUT.value:
    os.makedirs(_OUT.value, exist_ok=True)
    with open(os.path.join(_OUT.value, "samples.jsonl"), "w") as f:
      for row in tokens:
        f.write(json.dumps({"tokens": row.tolist(), "text": task.decode(row)}) + "\n")
    with open(os.path.join(_OUT.value, "metrics.json"), "w") as f:
      json.dump(metrics, f, indent=2)


if __name__ == "__main__":
  app.run(main)
