"""sample.py's library: its sampler flags, generated from the knob registry
(`mdjax.knob_registry.every_knob`), and the rules of its modes.

Every knob is a flag of its name, type, help and allowed values, default None (the sampler's
default; `DEFAULTS` for the knobs every run needs). A few flags are notations that build a
family's spec from text (`NOTATIONS`: field_order's write order, ordered's groups,
local_remask's two families). A family takes its spec's knobs (`sampling.knobs.family_knobs`),
a published checkpoint's reference sampler the knobs it names (`Sampler.knobs`); any other
sampler flag given is refused, in one line naming it. The functions read the flags as a dict
of values and the set of names given, so they run without absl (tests/test_sampling_cli.py).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Collection, Mapping

import numpy as np
from absl import flags

from mdjax import generation, sampling, tasks
from mdjax.errors import ArgumentError
from mdjax.knob_registry import every_knob
from mdjax.sampling import commit_filter, order_policy
from mdjax.sampling.knobs import Knob, all_knobs, family_knobs

# The flags define_flags makes belong to the module that calls it (sample.py's key flags).
flags.disclaim_key_flags()

DEFAULTS = {"steps": 8, "k": 4}  # required knobs: their flags' defaults
_FAMILIES = tuple(sorted(sampling.families()))
# Flags that build a family's spec from notation rather than set one field.
NOTATIONS = {knob.name: knob for knob in (
    Knob("order", str, None, optional=True, help="field_order: the write order over the task's "
         "fields, e.g. \"[VOA][v×9]o×10[ht1]\"."),
    Knob("groups", str, None, optional=True, help="ordered: the positions written per step, "
         "e.g. \"0,1;2-4;5\"."),
    Knob("base", str, "confidence", choices=_FAMILIES, help="local_remask: the family that "
         "fills."),
    Knob("refill", str, "ancestral", choices=_FAMILIES, help="local_remask: the family that "
         "refills."),
    Knob("refill_steps", int, 4, minimum=1, help="local_remask: the refill's steps."),
    Knob("filter_file", str, None, optional=True, help="learned_commit: the commit filter's "
         "JSON file (python -m mdjax.accelerators.learn2pd writes one)."),
    Knob("policy_file", str, None, optional=True, help="order_policy: the order policy's JSON "
         "file (python -m mdjax.accelerators.order_policy writes one)."),
)}
# The notations each family reads; local_remask's steps and value transform (DRAW) go to its
# base and refill.
FAMILY_NOTATIONS = {"field_order": ("order",), "ordered": ("groups",),
                    "learned_commit": ("filter_file",), "order_policy": ("policy_file",),
                    "local_remask": ("steps", "base", "refill", "refill_steps")}
DRAW = ("temperature", "top_k", "top_p", "min_p")
EOS_KNOBS = ("eos_penalty", "eos_never", "eos_rank_last")  # set by generation.with_eos


def sampler_flags() -> set[str]:
  """Every sampler flag: the knobs and the notations."""
  return set(every_knob()) | set(NOTATIONS)


def reference_only() -> list[str]:
  """The knobs only a published checkpoint's reference sampler takes (cfg_scale, ...)."""
  return sorted(set(every_knob()) - set(all_knobs()))


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> dict[str, flags.FlagHolder]:
  """An absl flag for every sampler knob and notation, in the calling module."""
  records = dict(NOTATIONS)
  for name, knob in every_knob().items():
    if name in NOTATIONS:  # a knob and a notation (order): a string each family reads
      helps = [f"{family}: {family_knobs(family)[name].help}" for family in _FAMILIES
               if name in family_knobs(family)]
      knob = dataclasses.replace(knob, choices=None,
                                 help=" ".join([NOTATIONS[name].help, *helps]))
    records[name] = knob
  holders = {}
  for name, knob in sorted(records.items()):
    default = DEFAULTS.get(name, NOTATIONS[name].default if name in NOTATIONS else None)
    common = dict(flag_values=flag_values)
    if knob.kind is bool:
      holders[name] = flags.DEFINE_bool(name, default, knob.help, **common)
    elif knob.choices is not None:
      holders[name] = flags.DEFINE_enum(name, default, list(knob.choices), knob.help, **common)
    elif knob.kind is str:
      holders[name] = flags.DEFINE_string(name, default, knob.help, **common)
    else:
      define = flags.DEFINE_integer if knob.kind is int else flags.DEFINE_float
      holders[name] = define(name, default, knob.help, lower_bound=knob.minimum,
                             upper_bound=knob.maximum, **common)
  return holders


def family_flags(family: str) -> set[str]:
  """The sampler flags a family (a `--sampler` choice) takes."""
  spec_family = "ordered" if family == "left_to_right" else family
  return set(family_knobs(spec_family)) | set(FAMILY_NOTATIONS.get(family, ()))


def _refuse_others(given: Collection[str], takes: Collection[str], sampler: str) -> None:
  wrong = sorted(n for n in given if n in sampler_flags() and n not in takes)
  if wrong:
    raise ValueError(f"--{wrong[0]} does not apply to {sampler}; its flags: "
                     + (", ".join(f"--{n}" for n in sorted(takes)) or "none") + ".")


def sampler_spec(family: str, values: Mapping[str, Any], given: Collection[str], *,
                 length: int, task: tasks.Task | None = None) -> sampling.SamplerSpec:
  """The spec of `family` from the flags (`values` every flag's, `given` the names on the
  command line) on a canvas of `length`; a flag it does not take is a ValueError naming it.
  The EOS knobs are `with_task_eos`'s. task: the task whose named fields field_order reads."""
  takes = family_flags(family)
  _refuse_others(given, takes, f"--sampler={family}")
  notations = FAMILY_NOTATIONS.get(family, ())
  knobs = {n: values[n] for n in sorted(takes) if n not in notations and n not in EOS_KNOBS
           and values.get(n) is not None}
  if family == "local_remask":
    draw = {n: knobs.pop(n) for n in DRAW if n in knobs}
    base = sampling.make_spec(values["base"], length=length, steps=values["steps"], **draw)
    refill = sampling.make_spec(values["refill"], length=length, steps=values["refill_steps"],
                                **draw)
    return sampling.LocalRemaskSpec(base=base, refill=refill, **knobs)
  if family == "field_order":
    fields_of = getattr(tasks.TASKS.get(task.name) if task else None, "write_order_fields", None)
    if fields_of is None or task.params is None:
      raise ValueError("--sampler=field_order needs a task with named fields (scan_and_add); "
                       + (f"--task={task.name}" if task else "a checkpoint") + " has none.")
    if not values["order"]:
      raise ValueError("--sampler=field_order needs --order=NOTATION, e.g. "
                       "\"[VOA][v×9]o×10[ht1]\".")
    return sampling.parse_write_order(values["order"], fields_of(task.params), **knobs)
  if family == "ordered":
    if not values["groups"]:
      raise ValueError("--sampler=ordered needs --groups, e.g. \"0,1;2-4;5\".")
    try:
      groups = sampling.parse_groups(values["groups"])
    except ValueError as error:
      raise ArgumentError("groups", str(error)) from None
    return sampling.OrderedSpec(groups=groups, **knobs)
  if family == "learned_commit":  # a file read here, never a request field of the server
    if not values["filter_file"]:
      raise ValueError("--sampler=learned_commit needs --filter_file=PATH (python -m "
                       "mdjax.accelerators.learn2pd writes one).")
    return sampling.LearnedCommitSpec(
        commit_filter=commit_filter.load_filter(values["filter_file"]), **knobs)
  if family == "order_policy":  # a file read here, never a request field of the server
    if not values["policy_file"]:
      raise ValueError("--sampler=order_policy needs --policy_file=PATH (python -m "
                       "mdjax.accelerators.order_policy writes one).")
    return sampling.OrderPolicySpec(
        policy=order_policy.load_policy(values["policy_file"]), **knobs)
  return sampling.make_spec(family, length=length, **knobs)


def with_task_eos(spec, task: tasks.Task, values: Mapping[str, Any], given: Collection[str]):
  """The spec with the task's end of sequence (--eos) and the EOS knobs."""
  knobs = dict(eos_penalty=values["eos_penalty"] or 0.0, eos_never=bool(values["eos_never"]),
               eos_rank_last=bool(values["eos_rank_last"]))
  if task.eos_id is None and "eos" in given:
    raise ValueError(f"--eos does not apply: task {task.name!r} has no end of sequence (text "
                     "of documents has one).")
  if task.eos_id is None or not values["eos"]:
    if any(knobs.values()):
      raise ValueError("--eos_penalty, --eos_never and --eos_rank_last need a task with an end "
                       "of sequence (text of documents) and --eos.")
    return spec
  return generation.with_eos(spec, task.eos_id, **knobs)


def pretrained_sampler(model, values: Mapping[str, Any], given: Collection[str]) -> tuple:
  """(spec, knobs) of a published checkpoint: --sampler's spec, inheriting the reference
  sampler's defaults (greedy) for knobs not given, or without --sampler the checkpoint's
  reference sampler (spec None) and the knobs given of those it takes."""
  if "sampler" in given:
    spec = sampler_spec(values["sampler"], values, given, length=model.max_len)
    fields = {f.name for f in dataclasses.fields(spec)}
    inherited = {k: v for k, v in model.sampler.spec_defaults.items()
                 if k in fields and k not in given}
    return dataclasses.replace(spec, **inherited), {}
  takes = model.sampler.knobs
  _refuse_others(given, takes, f"the {model.family} reference sampler (or give --sampler)")
  return None, {name: values[name] for name in takes if name in given}


def typed_prompt(text: str) -> str | list[int]:
  """A prompt typed as one string (`--live`; the live page reads its box the same way): a JSON
  list of integers (`[10, 1, 2]`) is token ids, anything else text."""
  stripped = text.strip()
  if stripped.startswith("[") and stripped.endswith("]"):
    try:
      value = json.loads(stripped)
    except ValueError:
      return text
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
      return value
  return text


def task_prompt(task: tasks.Task, prompt: str | None, prefix: str | None) -> np.ndarray:
  """--prompt's comma-separated ids, or --prefix's text encoded (a text task), or none."""
  if prompt and prefix:
    raise ValueError("give --prompt (ids) or --prefix (text), not both: each fixes the start.")
  if prompt:
    try:
      ids = np.array([int(t) for t in prompt.split(",")], np.int32)
    except ValueError:
      raise ValueError(f"--prompt={prompt!r} must be comma-separated ids.") from None
    if ids.min() < 0 or ids.max() >= task.mask_id:
      raise ValueError(f"--prompt={prompt!r}: ids in [0, {task.mask_id - 1}].")
    return ids
  if prefix:
    if task.encode is None:
      raise ValueError(f"--prefix/--suffix need a text task; {task!r} has no text encoding "
                       "(use --prompt=ids).")
    return np.asarray(task.encode(prefix), np.int32)
  return np.zeros((0,), np.int32)


def task_canvas(task: tasks.Task, rows: int, prompt: str | None, prefix: str | None,
                suffix: str | None) -> np.ndarray:
  """The task's empty canvas of `rows` rows with --prompt's ids or --prefix's text fixed at the
  start of every row and --suffix's at the end (infilling)."""
  canvas = np.array(task.empty_canvas(rows))
  left = task_prompt(task, prompt, prefix)
  if suffix and task.encode is None:
    raise ValueError(f"--prefix/--suffix need a text task; {task!r} has no text encoding "
                     "(use --prompt=ids).")
  right = np.asarray(task.encode(suffix), np.int32) if suffix else left[:0]
  if prompt and len(left) > task.length:
    raise ValueError(f"--prompt={prompt!r}: at most {task.length} ids.")
  if (prefix or suffix) and len(left) + len(right) >= task.length:
    raise ValueError(f"--prefix and --suffix hold {len(left)} + {len(right)} characters; the "
                     f"window is {task.length}, so at most {task.length - 1} in all.")
  canvas[:, :len(left)] = left
  canvas[:, task.length - len(right):] = right
  return canvas


def flag_message(error: Exception, values: Mapping[str, Any],
                 rename: Mapping[str, str] | None = None) -> str:
  """A library error in the flags' words: an `ArgumentError` whose message starts with its
  param names the flag that gave it (`steps=0 is ...` -> `--steps=0 is ...`, `prompts line 2
  ...` -> `--prompts='p.jsonl' line 2 ...`); `rename` maps a param to its flag. Other errors
  as they are."""
  text, param = str(error), getattr(error, "param", None)
  if not param or not text.startswith(param):
    return text
  flag = (rename or {}).get(param, param.removeprefix("spec."))
  if flag not in values:
    return text
  rest = text[len(param):]
  return f"--{flag}" + (rest if rest.startswith("=") else f"={values[flag]!r}{rest}")


# The modes: "samples" (--num_samples on the task's canvas), "blocks" (--blocks_of without
# --prompts), "prompts" and "pretrained"; the sources: --oracle, --workdir and --pretrained. A
# flag outside the modes or source it serves is refused (never ignored), with the reason.
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
                "noise": ("oracle", "a trained model's noise process is its own"),
                "step": ("workdir", "it picks a checkpoint of --workdir")}
# What --pretrained does not read: the task, its canvas and its EOS (the reference samplers
# have their own EOS knobs).
NOT_PRETRAINED = ("task", "noise", "step", "prompt", "prefix", "suffix", "reference", "blocks_of",
                  "context", "eos") + EOS_KNOBS
# What --live does not read: it completes one prompt through the serving engine.
NOT_LIVE = ("prompts", "num_samples", "prompt", "prefix", "suffix", "reference", "blocks_of",
            "length", "context", "out", "batch_size", "show", "groups", "base", "refill",
            "refill_steps", "eos") + EOS_KNOBS


def mode(values: Mapping[str, Any]) -> str:
  if values["pretrained"]:
    return "pretrained"
  return ("prompts" if values["prompts"] else "blocks" if values["blocks_of"] is not None
          else "samples")


def source(values: Mapping[str, Any]) -> str:
  return "pretrained" if values["pretrained"] else "workdir" if values["workdir"] else "oracle"


def check_modes(values: Mapping[str, Any], given: Collection[str]) -> None:
  """Refuses, in one line (a ValueError), a flag that the mode or the source does not read."""
  if bool(values["workdir"]) + values["oracle"] + bool(values["pretrained"]) != 1:
    raise ValueError("give exactly one of --workdir=DIR, --oracle and --pretrained=DIR.")
  where = source(values)
  if "quantize" in given and where == "oracle":
    raise ValueError("--quantize does not apply with --oracle: a task's exact denoiser has no "
                     "weight matrices (it applies with --workdir or --pretrained).")
  for name in ("devices", "parallel"):
    if name in given and where == "oracle":
      raise ValueError(f"--{name} does not apply with --oracle: a task's exact denoiser has no "
                       "weights to split (it applies with --workdir or --pretrained).")
  if values["live"] is not None:
    for name in NOT_LIVE:
      if name in given:
        raise ValueError(f"--{name} does not apply with --live: it completes one prompt.")
    if values["max_new_tokens"] is None:
      raise ValueError("--live needs --max_new_tokens=N: the tokens to generate.")
    for name, (wanted, _) in {**SOURCE_FLAGS, "dtype": ("pretrained", "")}.items():
      if name in given and where != wanted:
        raise ValueError(f"--{name} does not apply with --live and --{where}.")
    return
  if where == "pretrained":
    _check_pretrained(values, given)
    return
  for name in ("chat", "dtype", *reference_only()):
    if name in given:
      raise ValueError(f"--{name} applies only with --pretrained=DIR.")
  for name, (wanted, why) in SOURCE_FLAGS.items():
    if name in given and where != wanted:
      raise ValueError(f"--{name} does not apply with --{where}: {why}.")
  current = mode(values)
  for name, (modes, why) in MODE_FLAGS.items():
    if name in given and current not in modes:
      raise ValueError(f"--{name} does not apply {MODE_NAMES[current]}: {why}.")
  if current == "prompts" and values["max_new_tokens"] is None:
    raise ValueError("--prompts needs --max_new_tokens=N: the tokens to generate after each "
                     "prompt.")
  if current == "prompts" and "context" in given and values["blocks_of"] is None:
    raise ValueError("--context does not apply with --prompts alone: it is the window of "
                     "--blocks_of generation.")


def _check_pretrained(values: Mapping[str, Any], given: Collection[str]) -> None:
  for name in NOT_PRETRAINED:
    if name in given:
      raise ValueError(f"--{name} does not apply with --pretrained: it completes --prompts (or "
                       "samples from nothing) with the checkpoint's own ids and samplers.")
  if values["prompts"] and values["max_new_tokens"] is None:
    raise ValueError("--pretrained with --prompts needs --max_new_tokens=N.")
  for name in ("max_new_tokens", "chat"):
    if name in given and not values["prompts"]:
      raise ValueError(f"--{name} applies with --prompts; without it --pretrained samples "
                       "--num_samples rows of --length tokens.")
  for name in ("num_samples", "length"):
    if name in given and values["prompts"]:
      raise ValueError(f"--{name} does not apply with --prompts: each prompt gets one "
                       "completion of --max_new_tokens tokens.")
