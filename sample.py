"""Samples from a trained workdir or a task's exact oracle; prints the task's metrics.

  python sample.py --workdir=/tmp/quickstart --sampler=confidence --steps=25
  python sample.py --task=two_color --oracle --sampler=ancestral --steps=8
  python sample.py --workdir=/tmp/shakespeare --prefix="ROMEO." --suffix="love." --steps=32

Text tasks take --prefix / --suffix (fixed left and right context: prefix-conditioned
generation or infilling) and --reference=CAUSAL_WORKDIR (generative bits per character of
the samples under a causal reference model).
"""

import json
import os
import time

from absl import app, flags, logging

import jax
import numpy as np

from mdjax import sampling, tasks

_TASK = flags.DEFINE_enum("task", "two_color", sorted(tasks.TASKS), "Task (with --oracle).")
_ORACLE = flags.DEFINE_bool("oracle", False, "Use the task's exact denoiser (no --workdir).")
_WORKDIR = flags.DEFINE_string("workdir", None, "A train.py workdir to sample from.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_BATCH = flags.DEFINE_integer("batch_size", 1000, "Rows per sampler call.")
_PROMPT = flags.DEFINE_string("prompt", None, "Comma-separated token ids fixed at the start.")
_PREFIX = flags.DEFINE_string("prefix", None, "Text fixed at the start (text tasks).")
_SUFFIX = flags.DEFINE_string("suffix", None, "Text fixed at the end (text tasks): infilling.")
_REFERENCE = flags.DEFINE_string("reference", None,
                                 "Causal reference workdir: adds gen_bits_per_char (text tasks).")
_NUM_SHOWN = flags.DEFINE_integer("show", 5, "Number of decoded samples printed.")
_SAMPLER = flags.DEFINE_string(
    "sampler", "ancestral",
    "ancestral | confidence | entropy_bounded | remask | random_order | left_to_right | "
    "speculative | defer | revision.")
_STEPS = flags.DEFINE_integer("steps", 8, "Number of steps (not for random_order/left_to_right/"
                              "speculative).")
_K = flags.DEFINE_integer("k", 4, "Drafts per round (speculative sampler).")
_TEMPERATURE = flags.DEFINE_float("temperature", None, "Softmax temperature; 0 = argmax.")
_TOP_K = flags.DEFINE_integer("top_k", None, "Keep the k most likely values.")
_TOP_P = flags.DEFINE_float("top_p", None, "Nucleus mass in (0, 1].")
_MIN_P = flags.DEFINE_float("min_p", None, "Keep values with p >= min_p * max p.")
_SCORE = flags.DEFINE_string("score", None, "Confidence score (confidence sampler).")
_ETA = flags.DEFINE_float("eta", None, "Remasking strength (remask sampler).")
_GAMMA = flags.DEFINE_float("gamma", None,
                            "Entropy bound in nats (entropy_bounded sampler).")
_THRESHOLD = flags.DEFINE_float("threshold", None,
                                "Confidence: commit scores >= it; defer: total variation bound.")
_SCORE_GROUPS = flags.DEFINE_integer("score_groups", None,
                                     "Revision: leave-group-out contexts for visible tokens.")
_BLOCK = flags.DEFINE_integer("block_length", None,
                              "Semi-autoregressive blocks (ancestral, confidence, entropy_bounded).")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 10_000, "Number of samples.")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed.")
_OUT = flags.DEFINE_string("out", None, "Directory for samples.jsonl and metrics.json.")


def fix_context(task: tasks.Task, canvas_BxL: np.ndarray, prefix: str | None,
                suffix: str | None) -> None:
  """Writes the encoded prefix at the start and suffix at the end of every row."""
  if not (prefix or suffix):
    return
  if task.encode is None:
    raise ValueError(f"--prefix/--suffix need a text task; {task!r} has no text encoding "
                     "(use --prompt=ids).")
  left, right = task.encode(prefix or ""), task.encode(suffix or "")
  if len(left) + len(right) >= task.length:
    raise ValueError(f"--prefix and --suffix hold {len(left)} + {len(right)} characters; "
                     f"the window is {task.length}, so at most {task.length - 1} in all.")
  canvas_BxL[:, :len(left)] = left
  canvas_BxL[:, task.length - len(right):] = right


def reference_bits_per_char(workdir: str, task: tasks.Task, tokens_NxL: np.ndarray) -> float:
  """Mean -log2 p(sample) per character under a causal reference model of the same corpus."""
  from mdjax import likelihood, train
  config, apply_fn, params, _ = train.load_for_sampling(workdir)
  if config.objective != "causal":
    raise app.UsageError(f"--reference={workdir!r} holds a {config.objective!r} model; "
                         "it must be a causal one (objective='causal').")
  reference_task = tasks.from_config(config)
  if reference_task.tokenizer != task.tokenizer:
    raise app.UsageError(f"--reference={workdir!r} uses another tokenizer than the samples.")
  if reference_task.length != task.length:
    raise app.UsageError(f"--reference={workdir!r} has windows of {reference_task.length} "
                         f"characters; the samples have {task.length}.")
  bits_N = likelihood.causal_bits(apply_fn, params, tokens_NxL, start_id=reference_task.mask_id)
  return float(bits_N.mean() / task.length)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it reads at INFO
  if bool(_WORKDIR.value) == _ORACLE.value:
    raise app.UsageError("give exactly one of --workdir=DIR and --oracle.")
  if _WORKDIR.value:
    from mdjax import train
    try:
      config, apply_fn, params, step = train.load_for_sampling(_WORKDIR.value, _STEP.value)
    except ValueError as error:
      raise app.UsageError(str(error)) from error
    task = tasks.from_config(config)
    print(f"workdir={_WORKDIR.value} step={step}")
  else:
    task = tasks.get(_TASK.value)
    if task.exact_denoiser is None:
      raise app.UsageError(f"--task={task.name} has no exact denoiser (its joint is unknown); "
                           "sample a trained model with --workdir=DIR.")
    apply_fn, params = task.exact_denoiser, None
  knobs = dict(temperature=_TEMPERATURE.value, top_k=_TOP_K.value, top_p=_TOP_P.value,
               min_p=_MIN_P.value)
  if _SAMPLER.value == "speculative":
    knobs["k"] = _K.value
  elif _SAMPLER.value not in ("random_order", "left_to_right"):
    knobs["steps"] = _STEPS.value
  if _SCORE.value is not None:
    knobs["score"] = _SCORE.value
  if _ETA.value is not None:
    knobs["eta"] = _ETA.value
  for name, flag in (("block_length", _BLOCK), ("threshold", _THRESHOLD), ("gamma", _GAMMA),
                     ("score_groups", _SCORE_GROUPS)):
    if flag.value is not None:
      knobs[name] = flag.value
  try:
    spec = sampling.make_spec(_SAMPLER.value, length=task.length, **knobs)
  except (ValueError, TypeError) as error:
    raise app.UsageError(str(error)) from error
  for name, value in (("num_samples", _NUM_SAMPLES.value), ("batch_size", _BATCH.value)):
    if value < 1:
      raise app.UsageError(f"--{name}={value} must be >= 1.")
  canvas = np.array(task.empty_canvas(_BATCH.value))
  if _PROMPT.value:
    try:
      prompt = [int(t) for t in _PROMPT.value.split(",")]
    except ValueError as error:
      raise app.UsageError(f"--prompt={_PROMPT.value!r} must be comma-separated ids.") from error
    if len(prompt) > task.length or min(prompt) < 0 or max(prompt) >= task.mask_id:
      raise app.UsageError(f"--prompt={_PROMPT.value!r}: at most {task.length} ids in "
                           f"[0, {task.mask_id - 1}].")
    canvas[:, :len(prompt)] = prompt
  try:
    fix_context(task, canvas, _PREFIX.value, _SUFFIX.value)
  except ValueError as error:
    raise app.UsageError(str(error)) from error
  print(f"task={task.name} sampler={spec}")
  start = time.perf_counter()
  batches, nfe = [], 0
  num_batches = -(-_NUM_SAMPLES.value // _BATCH.value)
  for i in range(num_batches):
    result = sampling.sample(apply_fn, params, jax.random.fold_in(jax.random.key(_SEED.value), i),
                             canvas, spec, mask_id=task.mask_id)
    batches.append(np.asarray(result.tokens_BxL))
    nfe += int(result.nfe)
    print(f"\rbatch {i + 1}/{num_batches} [{time.perf_counter() - start:.1f}s]", end="",
          flush=True)
  print()
  tokens = np.concatenate(batches)[:_NUM_SAMPLES.value]
  elapsed = time.perf_counter() - start
  metrics = task.sample_metrics(tokens)
  metrics.update(nfe_per_batch=nfe // num_batches, seconds=round(elapsed, 3))
  if _REFERENCE.value:
    metrics["gen_bits_per_char"] = reference_bits_per_char(_REFERENCE.value, task, tokens)
  for row in tokens[:_NUM_SHOWN.value]:
    print(f"   {task.decode(row)}" if task.encode is None else f"--- {task.decode(row)}")
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
