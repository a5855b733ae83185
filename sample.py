"""Samples any model `mdjax.load` reads (a workdir, a task's exact oracle, a published
checkpoint) and prints metrics; completions go through `mdjax.generate`.

  python sample.py --workdir=/tmp/mdjax_quickstart --sampler=confidence --steps=64
  python sample.py --task=two_color --oracle --sampler=ancestral --steps=8
  python sample.py --task=two_color --oracle --noise=uniform --sampler=uniform_ancestral --steps=8
  python sample.py --workdir=/tmp/shakespeare --prefix="ROMEO." --suffix="love." --steps=32
  python sample.py --pretrained=/data/LLaDA-8B-Instruct --prompts=prompts.jsonl --chat \
      --max_new_tokens=128 --steps=128 --block_length=32 --dtype=bfloat16
  python sample.py --pretrained=/data/mdlm-owt --num_samples=16

Every registered sampler family is a --sampler choice and every sampler knob a flag,
generated from the knob registry (`mdjax.sampling_cli`: its rules and the spec the flags
build); a flag that does not apply to the mode, the source or the family is a one-line error
(exit status 2). The flags and modes: docs/generation.md and docs/pretrained.md.
"""

import json
import os
import time

from absl import app, flags, logging

import jax
import numpy as np

import mdjax
from mdjax import cli, generation, jsonl, loader, sampling, sampling_cli, tasks
from mdjax import mesh as mesh_lib

_TASK = flags.DEFINE_enum("task", "two_color", sorted(tasks.TASKS), "Task (with --oracle).")
_ORACLE = flags.DEFINE_bool("oracle", False, "Use the task's exact denoiser (no --workdir).")
_NOISE = flags.DEFINE_enum("noise", None, ["absorbing", "uniform", "hybrid"],
                           "With --oracle: the task's exact denoiser under this noise process "
                           "(mdjax.load(task, noise=...)); default its own absorbing one.")
_WORKDIR = flags.DEFINE_string("workdir", None, "A train.py workdir to sample from.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_BATCH = flags.DEFINE_integer("batch_size", 1000, "Rows per sampler call.")
_PROMPT = flags.DEFINE_string("prompt", None, "Comma-separated token ids fixed at the start.")
_PREFIX = flags.DEFINE_string("prefix", None, "Text fixed at the start (text tasks).")
_SUFFIX = flags.DEFINE_string("suffix", None, "Text fixed at the end (text tasks): infilling.")
_REFERENCE = flags.DEFINE_string("reference", None,
                                 "Causal reference workdir: adds gen_bits_per_char (text tasks).")
_NUM_SHOWN = flags.DEFINE_integer("show", 5, "Number of decoded samples printed.")
_SAMPLER = flags.DEFINE_enum(
    "sampler", "ancestral", sorted(sampling.families()) + ["left_to_right"],
    "Sampler family (mdjax.sampling.families(), and left_to_right); a --workdir without it "
    "samples with its config's sampler (config.sampler), its knobs unless given.")
_BLOCKS_OF = flags.DEFINE_integer(
    "blocks_of", None, "Generate block by block, this many positions a block, after a sliding "
    "window (sampling.sample_blocks: any --sampler inside a block; exact KV cache on a "
    "block-causal model; any --length).")
_LENGTH = flags.DEFINE_integer("length", None, "With --blocks_of: positions to generate after "
                               "the prompt (default: the task's length).")
_CONTEXT = flags.DEFINE_integer("context", None, "With --blocks_of: window positions before "
                                "each block (default: the task's length minus the block).")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 10_000, "Number of samples.")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed.")
_OUT = flags.DEFINE_string("out", None, "Directory for samples.jsonl and metrics.json "
                           "(with --prompts: completions.jsonl).")
_PROMPTS = flags.DEFINE_string("prompts", None, "A JSONL file of {\"prompt\": TEXT} or "
                               "{\"prompt\": [ID, ...]} lines (ids: a model without text): "
                               "--max_new_tokens after every prompt, any lengths in one batch.")
_MAX_NEW_TOKENS = flags.DEFINE_integer(
    "max_new_tokens", None, "With --prompts: tokens generated after each prompt (fewer when a "
    "row ends at EOS), whatever the batch. Past the model's length a block-causal model "
    "generates block by block (--blocks_of, default its block size); others refuse.")
_PRETRAINED = flags.DEFINE_string(
    "pretrained", None, "A published checkpoint's Hugging Face folder (LLaDA, Dream, ...): "
    "completes --prompts with its reference sampler, or with --sampler's family.")
_CHAT = flags.DEFINE_bool("chat", False, "With --pretrained: each prompt through the "
                          "checkpoint's chat template (a user turn; or {\"messages\": [...]}).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                           "With --pretrained: the weights' dtype (default: the checkpoint's).")
_QUANTIZE = flags.DEFINE_enum(
    "quantize", None, ["int8", "int4"], "With --workdir or --pretrained: weight-only integer "
    "weights (mdjax.load(quantize=...)): the matrices stored as int8 (int4) with float "
    "scales, dequantized where each is used; default float.")
_DEVICES = flags.DEFINE_integer(
    "devices", None, "With --workdir or --pretrained: the weights on a mesh of this many "
    "devices, split as --parallel says (default: one device).")
_PARALLEL = flags.DEFINE_enum(
    "parallel", "fsdp", ["fsdp", "tensor", "expert"], "How --devices (default: every device) "
    "split the weights: the FSDP rule, or a published Transformer's heads and hidden columns "
    "(tensor) or LLaDA2's experts (expert); docs/devices.md.")
_EOS = flags.DEFINE_bool("eos", True, "End rows at the task's EOS id (text tasks of documents).")
_LIVE = flags.DEFINE_string(
    "live", None, "A prompt (a text, or token ids as a JSON list: --live='[10, 1, 2]'): its "
    "completion (--max_new_tokens, --seed, --sampler and knobs as the server reads them) drawn "
    "step by step in the terminal through the serving engine.")
# Every sampler knob (mdjax.knob_registry: each spec field declared with knob(...), each
# reference sampler's own) and the notations, default None: the sampler's default.
sampling_cli.define_flags()


def reference_bits_per_char(workdir: str, task: tasks.Task, tokens_NxL: np.ndarray) -> float:
  """Mean -log2 p(sample) per character under a causal reference model of the same corpus."""
  from mdjax.evaluate import elbo
  reference = mdjax.load(workdir)
  kind = reference.config.objective if reference.family == "mdjax" else reference.family
  if kind != "causal":
    raise app.UsageError(f"--reference={workdir!r} holds a {kind!r} model; it must be a "
                         "causal one (objective='causal').")
  if reference.tokenizer != task.tokenizer:
    raise app.UsageError(f"--reference={workdir!r} uses another tokenizer than the samples.")
  if reference.max_len != task.length:
    raise app.UsageError(f"--reference={workdir!r} has windows of {reference.max_len} "
                         f"characters; the samples have {task.length}.")
  bits_N = elbo.causal_bits(reference.denoiser, reference.params, tokens_NxL,
                            start_id=reference.task.mask_id)  # its windows' start id
  return float(bits_N.mean() / task.length)


def _flags() -> tuple[dict, set]:
  """(every flag's value, the names given on the command line)."""
  values = flags.FLAGS.flag_values_dict()
  return values, {name for name in values if flags.FLAGS[name].present}


def _usage(error: Exception, **rename) -> app.UsageError:
  """A library error as a usage error naming the flag that gave its argument."""
  return app.UsageError(sampling_cli.flag_message(error, _flags()[0], rename))


def complete_prompts(model, spec, knobs: dict) -> None:
  """--prompts: `mdjax.generate` (--max_new_tokens after each prompt; `spec` None: the
  model's default sampler with `knobs`), completions.jsonl, output tokens per second."""
  try:
    prompts = generation.read_prompts(_PROMPTS.value, messages=True)
  except ValueError as error:
    raise _usage(error) from error
  except FileNotFoundError:
    raise app.UsageError(f"--prompts={_PROMPTS.value!r}: no such file.") from None
  except OSError as error:
    raise app.UsageError(f"--prompts={_PROMPTS.value!r}: {error.strerror or error}.") from None
  print(f"{_source()} prompts={len(prompts)} sampler={spec or 'default'} "
        f"{' '.join(f'{k}={v}' for k, v in knobs.items())}".rstrip())
  start_time = time.perf_counter()
  try:
    out = mdjax.generate(model, prompts, max_new_tokens=_MAX_NEW_TOKENS.value, spec=spec,
                         key=jax.random.key(_SEED.value), batch_size=_BATCH.value,
                         chat=_CHAT.value, blocks_of=_BLOCKS_OF.value, window=_CONTEXT.value,
                         on_batch=lambda done, total: print(
                             f"\r[{'#' * (24 * done // total):<24}] {done}/{total} "
                             f"prompts [{time.perf_counter() - start_time:.1f}s]", end="",
                             flush=True), **knobs)
  except ValueError as error:
    raise _usage(error) from error
  print()
  elapsed = time.perf_counter() - start_time
  report_completions(prompts, out.texts, out.token_ids, elapsed,
                     f", {out.nfe} denoiser passes; {out.plan.describe()}")


def report_completions(prompts, texts, token_ids, elapsed: float, more: str = "") -> None:
  """Prints the first --show completions and the output tokens per second; writes
  completions.jsonl to --out."""
  rows = [{"prompt": prompt, "completion": text, "token_ids": ids.tolist(),
           "generated_length": len(ids)}
          for prompt, text, ids in zip(prompts, texts or [None] * len(prompts), token_ids)]
  for row in rows[:_NUM_SHOWN.value]:
    print(f"--- {row['prompt']!r} -> {row['completion']!r}")
  output_tokens = sum(row["generated_length"] for row in rows)
  print(f"{len(rows)} completions, {output_tokens} output tokens (up to EOS) in {elapsed:.2f}s: "
        f"{output_tokens / elapsed:.1f} output tokens/s{more}")
  if _OUT.value:
    with open(os.path.join(_OUT.value, "completions.jsonl"), "w") as f:
      for row in rows:
        f.write(jsonl.dumps(row) + "\n")


def _pretrained_sampler(model) -> tuple:
  """(spec, knobs) of --pretrained: --sampler's spec, or its reference sampler's knobs."""
  try:
    return sampling_cli.pretrained_sampler(model, *_flags())
  except (ValueError, TypeError) as error:
    raise _usage(error) from error


def sample_pretrained(model) -> None:
  """--pretrained without --prompts: --num_samples rows of --length tokens (default the
  model's length) from nothing, by its reference sampler (MDLM, BD3-LM: unconditional
  generation); samples.jsonl and tokens per second."""
  spec, knobs = _pretrained_sampler(model)
  length = _LENGTH.value or model.max_len
  print(f"{_source()} samples={_NUM_SAMPLES.value} length={length} "
        f"sampler={spec or 'default'}")
  start_time = time.perf_counter()
  try:
    out = mdjax.generate(model, [[]] * _NUM_SAMPLES.value, max_new_tokens=length, spec=spec,
                         key=jax.random.key(_SEED.value), batch_size=_BATCH.value,
                         stop_at_eos=False, **knobs)
  except ValueError as error:
    raise _usage(error, max_new_tokens="length") from error
  elapsed = time.perf_counter() - start_time
  report_completions([""] * len(out), out.texts, out.token_ids, elapsed,
                     f", {out.nfe} denoiser passes; {out.plan.describe()}")


def generate_in_blocks(task, apply_fn, params, spec) -> None:
  """--blocks_of: `sampling.sample_blocks` after --prompt / --prefix, any --length."""
  block = _BLOCKS_OF.value
  length = _LENGTH.value or task.length
  window = _CONTEXT.value if _CONTEXT.value is not None else task.length - block
  try:
    prompt = sampling_cli.task_prompt(task, _PROMPT.value, _PREFIX.value)
  except ValueError as error:
    raise app.UsageError(str(error)) from error
  batch_size = min(_BATCH.value, _NUM_SAMPLES.value)
  cached = apply_fn.block_size is not None
  print(f"task={task.name} sampler={spec} blocks of {block}, window {window}, length {length}, "
        f"cached={cached}")
  start, batches, nfe = time.perf_counter(), [], 0
  num_batches = -(-_NUM_SAMPLES.value // batch_size)
  for i in range(num_batches):
    rows = min(batch_size, _NUM_SAMPLES.value - i * batch_size)
    try:
      out = sampling.sample_blocks(
          apply_fn, params, jax.random.fold_in(jax.random.key(_SEED.value), i),
          np.tile(prompt, (rows, 1)), spec, length=length, blocks_of=block, window=window,
          mask_id=task.mask_id, cached=cached)
    except ValueError as error:
      raise _usage(error) from error
    batches.append(np.asarray(out.tokens_BxT))
    nfe += int(out.nfe)
  tokens = np.concatenate(batches)
  elapsed = time.perf_counter() - start
  metrics = task.sample_metrics(tokens)
  metrics.update(nfe_per_batch=nfe // num_batches, seconds=round(elapsed, 3))
  report_samples(task, tokens, metrics)


def draw_samples(task, apply_fn, params, spec) -> None:
  """--num_samples rows of the task's canvas (--prompt, --prefix and --suffix fixed) in
  batches of --batch_size; the metrics, with --reference gen_bits_per_char."""
  batch_size = min(_BATCH.value, _NUM_SAMPLES.value)
  try:
    canvas = sampling_cli.task_canvas(task, batch_size, _PROMPT.value, _PREFIX.value,
                                      _SUFFIX.value)
  except ValueError as error:
    raise app.UsageError(str(error)) from error
  print(f"task={task.name} sampler={spec}")
  start = time.perf_counter()
  batches, nfe = [], 0
  num_batches = -(-_NUM_SAMPLES.value // batch_size)
  for i in range(num_batches):
    rows = min(batch_size, _NUM_SAMPLES.value - i * batch_size)  # the last batch: the rest
    try:
      result = sampling.sample(apply_fn, params,
                               jax.random.fold_in(jax.random.key(_SEED.value), i),
                               canvas[:rows], spec, mask_id=task.mask_id)
    except (ValueError, TypeError) as error:  # the spec checked against the canvas
      if i:
        raise
      raise _usage(error) from error
    batches.append(np.asarray(result.tokens_BxL))
    nfe += int(result.nfe)
    print(f"\rbatch {i + 1}/{num_batches} [{time.perf_counter() - start:.1f}s]", end="",
          flush=True)
  print()
  tokens = np.concatenate(batches)
  elapsed = time.perf_counter() - start
  metrics = task.sample_metrics(tokens)
  metrics.update(nfe_per_batch=nfe // num_batches, seconds=round(elapsed, 3))
  if _REFERENCE.value:
    metrics["gen_bits_per_char"] = reference_bits_per_char(_REFERENCE.value, task, tokens)
  report_samples(task, tokens, metrics)


def report_samples(task, tokens, metrics: dict) -> None:
  """Prints --show decoded samples and the metrics; writes them to --out."""
  if "invalid_fraction" in metrics and "valid" not in metrics:  # two_color: its validity too
    metrics = {"valid": round(1.0 - metrics["invalid_fraction"], 6), **metrics}
  for row in tokens[:_NUM_SHOWN.value]:
    print(f"   {task.decode(row)}" if task.encode is None else f"--- {task.decode(row)}")
  width = max(map(len, metrics))
  for name, value in metrics.items():
    print(f"{name:<{width}}  {value}")
  if _OUT.value:
    with open(os.path.join(_OUT.value, "samples.jsonl"), "w") as f:
      for row in tokens:
        f.write(json.dumps({"tokens": row.tolist(), "text": task.decode(row)}) + "\n")
    with open(os.path.join(_OUT.value, "metrics.json"), "w") as f:
      jsonl.dump(metrics, f, indent=2)


def live_completion(model) -> None:
  """--live=TEXT (or ids, '[10, 1, 2]'): one completion through `mdjax.serve.terminal.live`,
  its canvas redrawn every step; the final text (an id-only model: ids) printed after it."""
  from mdjax.serve import terminal
  values, given = _flags()
  knobs = {name: values[name] for name in sampling_cli.sampler_flags() & given}
  prompt = sampling_cli.typed_prompt(_LIVE.value)
  try:
    completion = terminal.live(model, prompt, max_new_tokens=_MAX_NEW_TOKENS.value,
                               seed=_SEED.value, chat=_CHAT.value, knobs=knobs or None,
                               sampler=_SAMPLER.value if "sampler" in given else None)
  except ValueError as error:
    raise _usage(error, prompts="live", prompt="live") from error
  shown = completion.token_ids.tolist() if completion.text is None else completion.text
  print(f"--- {prompt!r} -> {shown!r} (finish_reason={completion.finish_reason})")


def _source() -> str:
  if _PRETRAINED.value:
    return f"pretrained={_PRETRAINED.value}"
  return f"workdir={_WORKDIR.value}" if _WORKDIR.value else f"task={_TASK.value} (oracle)"


def load_model():
  """The model of --workdir, --oracle (--task's exact denoiser) or --pretrained, by
  `mdjax.load`; a bad source is a usage error."""
  if _WORKDIR.value:
    path, kwargs = _WORKDIR.value, {"step": _STEP.value, "quantize": _QUANTIZE.value}
  elif _PRETRAINED.value:
    path, kwargs = _PRETRAINED.value, {"dtype": _DTYPE.value, "quantize": _QUANTIZE.value}
  else:
    path, kwargs = loader.ORACLE_PREFIX + _TASK.value, {"noise": _NOISE.value}
  if not _PRETRAINED.value and not _WORKDIR.value and tasks.get(_TASK.value).exact_denoiser is None:
    raise app.UsageError(f"--task={_TASK.value} has no exact denoiser (its joint is unknown); "
                         "sample a trained model with --workdir=DIR.")
  try:
    kwargs["mesh"] = _mesh()
    model = mdjax.load(path, **{k: v for k, v in kwargs.items() if v is not None})
    model.mask_id  # a causal LM is refused here, with its own message
  except (ValueError, OSError) as error:
    raise app.UsageError(str(error)) from error
  if _WORKDIR.value:
    print(f"workdir={_WORKDIR.value} step={model.step}{_quantized()}")
  elif _PRETRAINED.value:
    print(f"pretrained={_PRETRAINED.value} family={model.family} dtype={model.config.dtype}"
          f"{_quantized()}")
  return model


def _mesh():
  """The mesh of --devices and --parallel (None: neither given, one device)."""
  if _DEVICES.value is None and _PARALLEL.value == "fsdp":
    return None
  if _DEVICES.value is not None and not 1 <= _DEVICES.value <= jax.device_count():
    raise ValueError(f"--devices={_DEVICES.value} is invalid: it must be in [1, "
                     f"{jax.device_count()}] (the devices).")
  return mesh_lib.parallel_mesh(_DEVICES.value, _PARALLEL.value)


def _quantized() -> str:
  return f" quantize={_QUANTIZE.value}" if _QUANTIZE.value else ""


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it reads at INFO
  try:
    sampling_cli.check_modes(*_flags())
  except ValueError as error:
    raise app.UsageError(str(error)) from error
  if _OUT.value:
    try:
      cli.writable_dir(_OUT.value)
    except ValueError as error:
      raise app.UsageError(str(error)) from error
  model = load_model()
  if _LIVE.value is not None:
    return live_completion(model)
  if _PRETRAINED.value:
    if _PROMPTS.value:
      return complete_prompts(model, *_pretrained_sampler(model))
    return sample_pretrained(model)
  task, apply_fn = model.task, model.denoiser
  family, values = _configured_sampler(model, *_flags())
  given = _flags()[1]
  try:
    spec = sampling_cli.sampler_spec(family, values, given, length=task.length, task=task)
    spec = sampling_cli.with_task_eos(spec, task, values, given)
    spec = sampling.with_noise(spec, model.noise)  # the model's process, as generate does
  except (ValueError, TypeError) as error:
    raise _usage(error) from error
  if spec.kv_cache != "none" and not apply_fn.offers_cache:
    apply_fn = sampling.recompute_cache(apply_fn)  # an oracle: exact, by recomputation
  if _PROMPTS.value:  # ids or text: prompt_ids says which the model takes, naming the line
    return complete_prompts(model.replace(denoiser=apply_fn), spec, {})
  for name, value in (("num_samples", _NUM_SAMPLES.value), ("batch_size", _BATCH.value)):
    if value < 1:
      raise app.UsageError(f"--{name}={value} must be >= 1.")
  if _BLOCKS_OF.value is not None:
    return generate_in_blocks(task, apply_fn, model.params, spec)
  return draw_samples(task, apply_fn, model.params, spec)


def _configured_sampler(model, values: dict, given: set) -> tuple[str, dict]:
  """(family, flag values) to sample with: --sampler's, or a workdir's `config.sampler` (its
  family, and its knobs where no flag is given) when --sampler is not given."""
  if "sampler" in given or not _WORKDIR.value or model.sampler is None:
    return _SAMPLER.value, values
  configured = {k: v for k, v in model.sampler.settings if k not in given and k in values}
  return model.sampler.family, {**values, **configured}


def _usage_error(message: str) -> None:
  """One line on stderr and exit status 2 (absl would print every flag first)."""
  cli.fail("sample.py", (str(message).strip().splitlines() or [""])[0], cli.USAGE)


def parse_flags(argv):
  try:
    return flags.FLAGS(argv)
  except flags.Error as error:
    _usage_error(str(error))


def run(argv):
  try:
    main(argv)
  except app.UsageError as error:
    _usage_error(str(error))


if __name__ == "__main__":
  app.run(run, flags_parser=parse_flags)
