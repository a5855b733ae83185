"""Samples any model `mdjax.load` reads (a workdir, a task's exact oracle, a published
checkpoint) and prints metrics; completions go through `mdjax.generate`.

  python sample.py --workdir=/tmp/quickstart --sampler=confidence --steps=25
  python sample.py --task=two_color --oracle --sampler=ancestral --steps=8
  python sample.py --workdir=/tmp/shakespeare --prefix="ROMEO." --suffix="love." --steps=32
  python sample.py --pretrained=/data/LLaDA-8B-Instruct --prompts=prompts.jsonl --chat \
      --max_new_tokens=128 --steps=128 --block_length=32 --dtype=bfloat16
  python sample.py --pretrained=/data/mdlm-owt --num_samples=16

Every registered sampler family is a --sampler choice; a flag that does not apply to the
mode, the source or the family is a one-line error (exit status 2). The flags and modes:
docs/generation.md and docs/pretrained.md.
"""

import dataclasses
import json
import os
import time
import types

from absl import app, flags, logging

import jax
import numpy as np

import mdjax
from mdjax import cli, generation, jsonl, loader, sampling, tasks

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
_SAMPLER = flags.DEFINE_enum(
    "sampler", "ancestral", sorted(sampling.families()) + ["left_to_right"],
    "Sampler family (mdjax.sampling.families(), and left_to_right).")
_STEPS = flags.DEFINE_integer("steps", 8, "Number of steps (families with steps; local_remask: "
                              "the base sampler's).")
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
_KV_CACHE = flags.DEFINE_enum(
    "kv_cache", None, list(sampling.KV_CACHES) + ["prefix"],
    "KV-cached block decoding (with --block_length): 'dual' runs one full pass per block, "
    "then passes over the block only. Exact oracles run it through the recompute adapter.")
_REFRESH_EVERY = flags.DEFINE_integer(
    "refresh_every", None, "With --kv_cache: also refresh the cache every N steps of a block "
    "(1: every step, the uncached tokens).")
_ORDER = flags.DEFINE_string("order", None, "Write order notation (field_order), e.g. "
                             "\"[VOA][v×9]o×10[ht1]\" over the task's fields.")
_GROUPS = flags.DEFINE_string("groups", None, "Positions written per step (ordered), "
                              "e.g. \"0,1;2-4;5\".")
_BASE = flags.DEFINE_string("base", "confidence", "local_remask: the family that fills.")
_REFILL = flags.DEFINE_string("refill", "ancestral", "local_remask: the family that refills.")
_REFILL_STEPS = flags.DEFINE_integer("refill_steps", 4, "local_remask: the refill's steps.")
_ROUNDS = flags.DEFINE_integer("rounds", None, "local_remask: repair rounds.")
_SEEDS = flags.DEFINE_integer("seeds", None, "local_remask: worst positions per round.")
_WINDOW = flags.DEFINE_integer("window", None, "local_remask: positions remasked either side.")
_CONTEXT_FRACTION = flags.DEFINE_float("context_fraction", None,
                                       "local_remask: random extra fraction remasked.")
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
_PROMPTS = flags.DEFINE_string("prompts", None, "A JSONL file of {\"prompt\": TEXT} lines (text "
                               "tasks): --max_new_tokens after every prompt, any lengths in one "
                               "batch.")
_MAX_NEW_TOKENS = flags.DEFINE_integer(
    "max_new_tokens", None, "With --prompts: tokens generated after each prompt (fewer when a "
    "row ends at EOS), whatever the batch. Past the model's length a block-causal model "
    "generates block by block (--blocks_of, default its block size); others refuse.")
_PRETRAINED = flags.DEFINE_string(
    "pretrained", None, "A published checkpoint's Hugging Face folder (LLaDA, Dream): "
    "completes --prompts with its reference sampler, or with --sampler's family.")
_CHAT = flags.DEFINE_bool("chat", False, "With --pretrained: each prompt through the "
                          "checkpoint's chat template (a user turn; or {\"messages\": [...]}).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                           "With --pretrained: the weights' dtype (default: the checkpoint's).")
_CFG_SCALE = flags.DEFINE_float("cfg_scale", None, "LLaDA: classifier-free guidance scale.")
_REMASKING = flags.DEFINE_enum("remasking", None, ["low_confidence", "random"],
                               "LLaDA: the confidence that picks the committed positions.")
_LOGITS_EOS_INF = flags.DEFINE_bool("logits_eos_inf", False, "LLaDA: EOS is never proposed.")
_CONFIDENCE_EOS_EOT_INF = flags.DEFINE_bool("confidence_eos_eot_inf", False,
                                            "LLaDA: EoT proposals score 0 (LLaDA's knob).")
_FACTOR = flags.DEFINE_float("factor", None, "Confidence / LLaDA: Fast-dLLM's dynamic threshold.")
_ALG = flags.DEFINE_enum("alg", None, ["origin", "maskgit_plus", "topk_margin", "entropy"],
                         "Dream: the algorithm that picks the revealed positions.")
_ALG_TEMP = flags.DEFINE_float("alg_temp", None, "Dream: draw the revealed positions from "
                               "softmax(confidence / alg_temp).")
_EPS = flags.DEFINE_float("eps", None, "Dream: the time grid's last point, linspace(1, eps).")
_EOS = flags.DEFINE_bool("eos", True, "End rows at the task's EOS id (text tasks of documents).")
_EOS_PENALTY = flags.DEFINE_float("eos_penalty", None, "Subtracted from the EOS logit.")
_EOS_NEVER = flags.DEFINE_bool("eos_never", False, "Never propose EOS.")
_EOS_RANK_LAST = flags.DEFINE_bool("eos_rank_last", False, "Rank EOS proposals last.")
_LIVE = flags.DEFINE_string(
    "live", None, "A prompt: its completion (--max_new_tokens, --seed, --sampler and knobs as "
    "the server reads them) drawn step by step in the terminal through the serving engine.")


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
                                  start_id=reference.mask_id)
  return float(bits_N.mean() / task.length)


# Flags that are fields of a family's spec, passed through by name.
SPEC_FLAGS = {"steps": _STEPS, "k": _K, "temperature": _TEMPERATURE, "top_k": _TOP_K,
              "top_p": _TOP_P, "min_p": _MIN_P, "score": _SCORE, "eta": _ETA, "gamma": _GAMMA,
              "threshold": _THRESHOLD, "score_groups": _SCORE_GROUPS, "block_length": _BLOCK,
              "rounds": _ROUNDS, "seeds": _SEEDS, "window": _WINDOW,
              "context_fraction": _CONTEXT_FRACTION, "kv_cache": _KV_CACHE,
              "refresh_every": _REFRESH_EVERY, "factor": _FACTOR, "alg": _ALG,
              "alg_temp": _ALG_TEMP, "eps": _EPS}
DRAW_FLAGS = ("temperature", "top_k", "top_p", "min_p")  # local_remask: its base and refill's
LOCAL_REMASK_FLAGS = ("steps", "base", "refill", "refill_steps") + DRAW_FLAGS
SPECIAL_FLAGS = {"field_order": ("order",), "ordered": ("groups",),
                 "local_remask": LOCAL_REMASK_FLAGS}
ALL_SAMPLER_FLAGS = set(SPEC_FLAGS) | {f for names in SPECIAL_FLAGS.values() for f in names}


def _given(name: str) -> bool:
  return flags.FLAGS[name].present


def _spec_fields(family: str) -> set[str]:
  name = "ordered" if family == "left_to_right" else family
  return {f.name for f in dataclasses.fields(sampling.families()[name].spec_type)}


def applicable_flags(family: str) -> set[str]:
  """The sampler flags the family takes."""
  fields = _spec_fields(family) - {"groups", "fields", "counts", "notation", "base", "refill"}
  return (fields & set(SPEC_FLAGS)) | set(SPECIAL_FLAGS.get(family, ()))


def sampler_spec(task: tasks.Task) -> sampling.SamplerSpec:
  """The spec of --sampler and its flags; a flag that does not apply is a UsageError."""
  family = _SAMPLER.value
  allowed = applicable_flags(family)
  wrong = sorted(n for n in ALL_SAMPLER_FLAGS - allowed if _given(n))
  if wrong:
    raise app.UsageError(
        f"--{wrong[0]} does not apply to --sampler={family}; its flags: "
        + (", ".join(f"--{n}" for n in sorted(allowed)) or "none") + ".")
  knobs = {n: SPEC_FLAGS[n].value for n in allowed & set(SPEC_FLAGS)
           if _given(n) or n in ("steps", "k")}  # required fields: the flag defaults
  try:
    if family == "local_remask":
      draw = {n: knobs.pop(n) for n in DRAW_FLAGS if n in knobs}
      base = sampling.make_spec(_BASE.value, length=task.length, steps=knobs.pop("steps"),
                                **draw)
      refill = sampling.make_spec(_REFILL.value, length=task.length,
                                  steps=_REFILL_STEPS.value, **draw)
      return sampling.LocalRemaskSpec(base=base, refill=refill, **knobs)
    if family == "field_order":
      fields_of = getattr(tasks.TASKS.get(task.name), "write_order_fields", None)
      if fields_of is None or task.params is None:
        raise app.UsageError(f"--sampler=field_order needs a task with named fields "
                             f"(scan_and_add); --task={task.name} has none.")
      if not _ORDER.value:
        raise app.UsageError("--sampler=field_order needs --order=NOTATION, e.g. "
                             "\"[VOA][v×9]o×10[ht1]\".")
      return sampling.parse_write_order(_ORDER.value, fields_of(task.params), **knobs)
    if family == "ordered":
      if not _GROUPS.value:
        raise app.UsageError("--sampler=ordered needs --groups, e.g. \"0,1;2-4;5\".")
      try:
        groups = sampling.parse_groups(_GROUPS.value)
      except ValueError as error:
        raise app.UsageError(f"--{error}") from None
      return sampling.OrderedSpec(groups=groups, **knobs)
    return sampling.make_spec(family, length=task.length, **knobs)
  except (ValueError, TypeError) as error:
    raise app.UsageError(str(error)) from error


def eos_spec(task: tasks.Task, spec):
  """The spec with the task's end of sequence (--eos) and the EOS knobs."""
  knobs = dict(eos_penalty=_EOS_PENALTY.value or 0.0, eos_never=_EOS_NEVER.value,
               eos_rank_last=_EOS_RANK_LAST.value)
  if task.eos_id is None and _given("eos"):
    raise app.UsageError(f"--eos does not apply: task {task.name!r} has no end of sequence "
                         "(text of documents has one).")
  if task.eos_id is None or not _EOS.value:
    if any(knobs.values()):
      raise app.UsageError("--eos_penalty, --eos_never and --eos_rank_last need a task with an "
                           "end of sequence (text of documents) and --eos.")
    return spec
  try:
    return generation.with_eos(spec, task.eos_id, **knobs)
  except ValueError as error:
    raise app.UsageError(str(error)) from error


def _flag_names(error: Exception) -> str:
  """An error of the library with its argument names written as this script's flags."""
  text = str(error).replace("spec.block_length=", "--block_length=")
  for name in ("max_new_tokens", "blocks_of", "batch_size"):
    text = text.replace(f"{name}=", f"--{name}=")
  return text.replace("prompts line", f"--prompts={_PROMPTS.value!r} line")


def complete_prompts(model, spec, knobs: dict) -> None:
  """--prompts: `mdjax.generate` (--max_new_tokens after each prompt; `spec` None: the
  model's default sampler with `knobs`), completions.jsonl, output tokens per second."""
  try:
    prompts = generation.read_prompts(_PROMPTS.value, messages=True)
  except (ValueError, OSError) as error:
    raise app.UsageError(str(error)) from error
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
    raise app.UsageError(_flag_names(error)) from error
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


def pretrained_sampler(model) -> tuple:
  """(spec, knobs) of a published checkpoint: --sampler's spec, inheriting the reference
  sampler's defaults (greedy) for flags not given, or without --sampler the checkpoint's
  reference sampler (spec None) and the knobs given for it."""
  if _given("sampler"):
    wrong = [n for n in PRETRAINED_FLAGS[2:] if _given(n)]
    if wrong:
      raise app.UsageError(f"--{wrong[0]} is a knob of LLaDA's reference sampler; it does "
                           f"not apply with --sampler={_SAMPLER.value}.")
    # sampler_spec reads a task's name and canvas length only.
    spec = sampler_spec(types.SimpleNamespace(name="pretrained", length=model.max_len,
                                              params=None))
    fields = {f.name for f in dataclasses.fields(spec)}
    inherited = {k: v for k, v in model.sampler.spec_defaults.items()
                 if k in fields and not _given(k)}
    return dataclasses.replace(spec, **inherited), {}
  values = {**SPEC_FLAGS, "cfg_scale": _CFG_SCALE, "remasking": _REMASKING,
            "logits_eos_inf": _LOGITS_EOS_INF, "confidence_eos_eot_inf": _CONFIDENCE_EOS_EOT_INF}
  allowed = [n for n in model.sampler.knobs if n in values]
  for name in sorted(set(values) | set(PRETRAINED_FLAGS[2:])):
    if _given(name) and name not in allowed:
      raise app.UsageError(f"--{name} does not apply to the {model.family} reference sampler "
                           f"(or give --sampler); its flags: "
                           + ", ".join(f"--{n}" for n in allowed) + ".")
  return None, {name: values[name].value for name in allowed if _given(name)}


def sample_pretrained(model) -> None:
  """--pretrained without --prompts: --num_samples rows of --length tokens (default the
  model's length) from nothing, by its reference sampler (MDLM, BD3-LM: unconditional
  generation); samples.jsonl and tokens per second."""
  spec, knobs = pretrained_sampler(model)
  length = _LENGTH.value or model.max_len
  print(f"{_source()} samples={_NUM_SAMPLES.value} length={length} "
        f"sampler={spec or 'default'}")
  start_time = time.perf_counter()
  try:
    out = mdjax.generate(model, [[]] * _NUM_SAMPLES.value, max_new_tokens=length, spec=spec,
                         key=jax.random.key(_SEED.value), batch_size=_BATCH.value,
                         stop_at_eos=False, **knobs)
  except ValueError as error:
    raise app.UsageError(_flag_names(error).replace("--max_new_tokens=", "--length=")
                         ) from error
  elapsed = time.perf_counter() - start_time
  report_completions([""] * len(out), out.texts, out.token_ids, elapsed,
                     f", {out.nfe} denoiser passes; {out.plan.describe()}")


def generate_in_blocks(task, apply_fn, params, spec) -> None:
  """--blocks_of: `sampling.sample_blocks` after --prompt / --prefix, any --length."""
  block = _BLOCKS_OF.value
  length = _LENGTH.value or task.length
  window = _CONTEXT.value if _CONTEXT.value is not None else task.length - block
  prompt = np.zeros((0,), np.int32)
  if _PROMPT.value:
    prompt = np.array([int(t) for t in _PROMPT.value.split(",")], np.int32)
  elif _PREFIX.value:
    try:
      prompt = np.asarray(task.encode(_PREFIX.value), np.int32)
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
      raise app.UsageError(str(error)) from error
    batches.append(np.asarray(out.tokens_BxT))
    nfe += int(out.nfe)
  tokens = np.concatenate(batches)
  elapsed = time.perf_counter() - start
  metrics = task.sample_metrics(tokens)
  metrics.update(nfe_per_batch=nfe // num_batches, seconds=round(elapsed, 3))
  report_samples(task, tokens, metrics)


def report_samples(task, tokens, metrics: dict) -> None:
  """Prints --show decoded samples and the metrics; writes them to --out."""
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


# The modes: "samples" (--num_samples on the task's canvas), "blocks" (--blocks_of without
# --prompts) and "prompts"; the sources: --oracle and --workdir. A flag outside the modes or
# source it serves is refused (never ignored), with the reason.
MODE_NAMES = {"samples": "without --blocks_of or --prompts", "blocks": "with --blocks_of",
              "prompts": "with --prompts"}
MODE_FLAGS = {
    "num_samples": ({"samples", "blocks"}, "with --prompts each prompt gets one completion"),
    "prompt": ({"samples", "blocks"}, "with --prompts the prompts come from the file"),
    "prefix": ({"samples", "blocks"}, "with --prompts the prompts come from the file"),
    "suffix": ({"samples"}, "blocks and completions are written left to right"),
    "reference": ({"samples"}, "it scores samples of the task's length"),
    "length": ({"blocks"}, "it is the length of --blocks_of generation (with --prompts: "
               "--max_new_tokens)"),
    "context": ({"blocks", "prompts"}, "it is the window of --blocks_of generation"),
    "max_new_tokens": ({"prompts"}, "it counts the tokens after each prompt of --prompts "
                       "(with --blocks_of alone: --length)"),
}
SOURCE_FLAGS = {"task": ("oracle", "the workdir's checkpoint fixes the task"),
                "step": ("workdir", "it picks a checkpoint of --workdir")}


# Flags only --pretrained reads, and the reference samplers' knobs.
PRETRAINED_FLAGS = ("chat", "dtype", "cfg_scale", "remasking", "logits_eos_inf",
                    "confidence_eos_eot_inf")
# What --pretrained does not read: the task, its canvas and its EOS (the reference samplers
# have their own EOS knobs).
NOT_PRETRAINED = ("task", "step", "prompt", "prefix", "suffix", "reference", "blocks_of",
                  "context", "eos", "eos_penalty", "eos_never", "eos_rank_last")


# What --live reads besides the source, --max_new_tokens, --seed, --chat, --sampler and its
# knobs (passed to the engine as a request's fields, which it checks).
LIVE_KNOBS = ("cfg_scale", "remasking", "logits_eos_inf", "confidence_eos_eot_inf")
NOT_LIVE = ("prompts", "num_samples", "prompt", "prefix", "suffix", "reference", "blocks_of",
            "length", "context", "out", "batch_size", "show", "order", "groups", "base",
            "refill", "refill_steps", "eos", "eos_penalty", "eos_never", "eos_rank_last")


def live_completion(model) -> None:
  """--live=TEXT: one completion through `mdjax.serve.terminal.live`, its canvas redrawn
  every step; the final text printed after it."""
  from mdjax.serve import terminal
  given = {**SPEC_FLAGS, **{n: flags.FLAGS[n] for n in LIVE_KNOBS}}
  knobs = {name: flag.value for name, flag in given.items() if _given(name)}
  try:
    completion = terminal.live(model, _LIVE.value, max_new_tokens=_MAX_NEW_TOKENS.value,
                               seed=_SEED.value, chat=_CHAT.value, knobs=knobs or None,
                               sampler=_SAMPLER.value if _given("sampler") else None)
  except ValueError as error:
    raise app.UsageError(_flag_names(ValueError(str(error).replace("prompts line 1", "--live")))
                         ) from error
  print(f"--- {_LIVE.value!r} -> {completion.text!r} (finish_reason={completion.finish_reason})")


def mode() -> str:
  if _PRETRAINED.value:
    return "pretrained"
  return "prompts" if _PROMPTS.value else "blocks" if _BLOCKS_OF.value is not None else "samples"


def check_mode_flags() -> None:
  """Refuses, in one line, a flag that the mode or the source does not use."""
  if bool(_WORKDIR.value) + _ORACLE.value + bool(_PRETRAINED.value) != 1:
    raise app.UsageError("give exactly one of --workdir=DIR, --oracle and --pretrained=DIR.")
  if _LIVE.value is not None:
    wrong = [name for name in NOT_LIVE if _given(name)]
    if wrong:
      raise app.UsageError(f"--{wrong[0]} does not apply with --live: it completes one prompt.")
    if _MAX_NEW_TOKENS.value is None:
      raise app.UsageError("--live needs --max_new_tokens=N: the tokens to generate.")
    source = "pretrained" if _PRETRAINED.value else "workdir" if _WORKDIR.value else "oracle"
    for name, (wanted, why) in {**SOURCE_FLAGS, "dtype": ("pretrained", "")}.items():
      if _given(name) and source != wanted:
        raise app.UsageError(f"--{name} does not apply with --live and --{source}.")
    return
  if _PRETRAINED.value:
    for name in NOT_PRETRAINED:
      if _given(name):
        raise app.UsageError(f"--{name} does not apply with --pretrained: it completes "
                             "--prompts (or samples from nothing) with the checkpoint's own "
                             "ids and samplers.")
    if _PROMPTS.value and _MAX_NEW_TOKENS.value is None:
      raise app.UsageError("--pretrained with --prompts needs --max_new_tokens=N.")
    for name, needs in (("max_new_tokens", "--prompts"), ("chat", "--prompts")):
      if _given(name) and not _PROMPTS.value:
        raise app.UsageError(f"--{name} applies with {needs}; without it --pretrained samples "
                             "--num_samples rows of --length tokens.")
    for name in ("num_samples", "length"):
      if _given(name) and _PROMPTS.value:
        raise app.UsageError(f"--{name} does not apply with --prompts: each prompt gets one "
                             "completion of --max_new_tokens tokens.")
    return
  for name in PRETRAINED_FLAGS:
    if _given(name):
      raise app.UsageError(f"--{name} applies only with --pretrained=DIR.")
  if _given("kv_cache") and _KV_CACHE.value == "prefix":
    raise app.UsageError("--kv_cache=prefix applies only with --pretrained=DIR (LLaDA's "
                         "reference sampler).")
  source = "workdir" if _WORKDIR.value else "oracle"
  for name, (wanted, why) in SOURCE_FLAGS.items():
    if _given(name) and source != wanted:
      raise app.UsageError(f"--{name} does not apply with --{source}: {why}.")
  current = mode()
  for name, (modes, why) in MODE_FLAGS.items():
    if _given(name) and current not in modes:
      raise app.UsageError(f"--{name} does not apply {MODE_NAMES[current]}: {why}.")
  if current == "prompts" and _MAX_NEW_TOKENS.value is None:
    raise app.UsageError("--prompts needs --max_new_tokens=N: the tokens to generate after "
                         "each prompt.")
  if current == "prompts" and _given("context") and _BLOCKS_OF.value is None:
    raise app.UsageError("--context does not apply with --prompts alone: it is the window of "
                         "--blocks_of generation.")


def _source() -> str:
  if _PRETRAINED.value:
    return f"pretrained={_PRETRAINED.value}"
  return f"workdir={_WORKDIR.value}" if _WORKDIR.value else f"task={_TASK.value} (oracle)"


def load_model():
  """The model of --workdir, --oracle (--task's exact denoiser) or --pretrained, by
  `mdjax.load`; a bad source is a usage error."""
  if _WORKDIR.value:
    path, kwargs = _WORKDIR.value, {"step": _STEP.value}
  elif _PRETRAINED.value:
    path, kwargs = _PRETRAINED.value, {"dtype": _DTYPE.value}
  else:
    path, kwargs = loader.ORACLE_PREFIX + _TASK.value, {}
  if not _PRETRAINED.value and not _WORKDIR.value and tasks.get(_TASK.value).exact_denoiser is None:
    raise app.UsageError(f"--task={_TASK.value} has no exact denoiser (its joint is unknown); "
                         "sample a trained model with --workdir=DIR.")
  try:
    model = mdjax.load(path, **{k: v for k, v in kwargs.items() if v is not None})
  except (ValueError, OSError) as error:
    raise app.UsageError(str(error)) from error
  if _WORKDIR.value:
    print(f"workdir={_WORKDIR.value} step={model.step}")
  elif _PRETRAINED.value:
    print(f"pretrained={_PRETRAINED.value} family={model.family} dtype={model.config.dtype}")
  return model


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it reads at INFO
  check_mode_flags()
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
      return complete_prompts(model, *pretrained_sampler(model))
    return sample_pretrained(model)
  task, apply_fn, params = model.task, model.denoiser, model.params
  spec = eos_spec(task, sampler_spec(task))
  if spec.kv_cache != "none" and not apply_fn.offers_cache:
    apply_fn = sampling.recompute_cache(apply_fn)  # an oracle: exact, by recomputation
  if _PROMPTS.value:
    if task.encode is None:
      raise app.UsageError(f"--prompts needs a text task; --task={task.name} has no text "
                           "encoding.")
    return complete_prompts(model.replace(denoiser=apply_fn), spec, {})
  for name, value in (("num_samples", _NUM_SAMPLES.value), ("batch_size", _BATCH.value)):
    if value < 1:
      raise app.UsageError(f"--{name}={value} must be >= 1.")
  if _BLOCKS_OF.value is not None:
    return generate_in_blocks(task, apply_fn, params, spec)
  batch_size = min(_BATCH.value, _NUM_SAMPLES.value)
  canvas = np.array(task.empty_canvas(batch_size))
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
      raise app.UsageError(str(error)) from error
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
