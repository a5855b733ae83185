"""The distillation objectives 'dparallel' and 'd3llm': a student trained on a teacher's own
rollouts to commit more positions a step (importing this module registers them; train.py
does).

The teacher (any `mdjax.load` path: a workdir, or a task's exact oracle, both through the
denoiser contract) decodes distill.num_prompts prompts drawn from the task's law (positions
[0, distill.prompt_length) of its rows; the rest masked) once, when the run starts, by default
with the references' setting: LLaDA's low-confidence remasking, one position a step, at
distill.temperature (0: greedy, the references' first attempt); distill.teacher_sampler
'ancestral' decodes it by the teacher's own law instead (MD4's ancestral sampler, as many
steps as generated positions). Its final tokens are the
student's targets and its write steps the trajectories, a fixed dataset as the references'
(dParallel's distillation set, d3LLM's trajectory files), read in a new random order each
epoch:

  'dparallel'  certainty-forcing distillation (`mdjax.accelerators.dparallel`);
  'd3llm'      pseudo-trajectory distillation with its noise and window curricula
               (`mdjax.accelerators.d3llm`).

The pool and its order are functions of the seed, so a resumed run sees the same rows as an
uninterrupted one (the task's own rows, which the trainer hands the loss, are not read). The
student starts from `train.init_from` (a workdir; its model fields are the start's: the
references distill a model into itself, with LoRA through `train.lora`) or fresh. The
held-out figure is the student's NELBO on the task's data.

config.distill (configs/distill_dparallel.py, configs/distill_d3llm.py):
  teacher          the teacher's path (required)
  prompt_length    positions of each row the teacher is given (sudoku4: 16)
  num_prompts      the pool's size (the teacher's decodings; an epoch)
  temperature      the teacher's sampling temperature
  teacher_sampler  the pool's sampler: 'confidence' (the references' low-confidence
                   remasking) or 'ancestral' (the teacher's own law; prompt-less text, where
                   low-confidence remasking writes spaces first)
  teacher_block_length  its semi-autoregressive blocks (None: one block)
  block_length     'dparallel': the block of its semi-AR mask (None: the whole generation)
  mask_ratio, eps  'dparallel': the block's mask probability (1 - eps) mask_ratio + eps
  block_lengths    'd3llm': the window curriculum "16,16,24,..." (None: the reference's,
                   scaled to end at the teacher's block)
  min_mask_ratio, max_mask_ratio, complementary  'd3llm': the noise curriculum, the
                   complementary copy
  entropy_temperature, entropy_weight  both: the certainty term
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from mdjax import loader, models, sampling
from mdjax.accelerators import d3llm, dparallel
from mdjax.train import objectives, sft, start_point
from mdjax.train.config_checks import ConfigError

NAMES = ("dparallel", "d3llm")
TEACHER_SAMPLERS = ("confidence", "ancestral")  # distill.teacher_sampler: default first
COMMON = dict(teacher=None, prompt_length=0, num_prompts=3200, temperature=0.0,
              teacher_sampler=TEACHER_SAMPLERS[0], teacher_block_length=None,
              entropy_temperature=0.5, entropy_weight=2.0)
DEFAULTS = {
    "dparallel": dict(COMMON, block_length=None, mask_ratio=dparallel.MASK_RATIO,
                      eps=dparallel.EPS),
    "d3llm": dict(COMMON, block_lengths=None, min_mask_ratio=d3llm.MIN_MASK_RATIO,
                  max_mask_ratio=d3llm.MAX_MASK_RATIO, complementary=True),
}


def is_integer(value, low: int) -> bool:
  """An integer (not a bool) >= low."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= low


def is_number(value) -> bool:
  """A finite real number (not a bool)."""
  return (isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
          and math.isfinite(value))


def refuse(opts: dict, name: str, allowed: str):
  """The ConfigError of knob distill.`name`: its value and what is `allowed`."""
  raise ConfigError(f"config field distill.{name}={opts[name]!r} {allowed}.")


def known_knobs(config, objective: str, defaults: dict) -> dict:
  """config.distill's knobs over the objective's `defaults` (a knob left None keeps its
  default; `teacher` is taken as given); a ConfigError naming a field unknown to it."""
  given = config.get("distill", ml_collections.ConfigDict())
  given = given.to_dict() if hasattr(given, "to_dict") else dict(given or {})
  unknown = sorted(set(given) - set(defaults))
  if unknown:
    raise ConfigError(f"config field distill.{unknown[0]}: unknown to objective {objective!r} "
                      f"(its knobs: {', '.join(defaults)}).")
  return {**defaults, **{k: v for k, v in given.items() if v is not None or k == "teacher"}}


def given_knobs(config, objective: str, defaults: dict) -> dict:
  """`known_knobs`, the ones every distillation objective has checked (teacher,
  prompt_length, num_prompts); a ConfigError naming a field that is unknown to the objective
  or out of range."""
  opts = known_knobs(config, objective, defaults)
  if not isinstance(opts["teacher"], str) or not opts["teacher"]:
    refuse(opts, "teacher", "must name the teacher: a train.py workdir or a task's exact "
           "oracle (sudoku4, oracle:permutation)")
  if not is_integer(opts["prompt_length"], 0):
    refuse(opts, "prompt_length", "must be an integer >= 0")
  if not is_integer(opts["num_prompts"], 1):
    refuse(opts, "num_prompts", "must be an integer >= 1")
  return opts


def options(config) -> dict:
  """config.distill's knobs with the objective's defaults; a ConfigError naming a field that
  is unknown to the objective or out of range."""
  objective = config.objective
  opts = given_knobs(config, objective, DEFAULTS[objective])
  if not (is_number(opts["temperature"]) and opts["temperature"] >= 0):
    refuse(opts, "temperature", "must be a finite number >= 0")
  if opts["teacher_sampler"] not in TEACHER_SAMPLERS:
    refuse(opts, "teacher_sampler", f"must be one of {', '.join(map(repr, TEACHER_SAMPLERS))}")
  for name in ("teacher_block_length", "block_length"):
    if name in opts and opts[name] is not None and not is_integer(opts[name], 1):
      refuse(opts, name, "must be None or an integer >= 1")
  if not (is_number(opts["entropy_temperature"]) and opts["entropy_temperature"] > 0):
    refuse(opts, "entropy_temperature", "must be a finite number > 0")
  if not (is_number(opts["entropy_weight"]) and opts["entropy_weight"] >= 0):
    refuse(opts, "entropy_weight", "must be a finite number >= 0")
  if objective == "dparallel":
    for name in ("mask_ratio", "eps"):
      if not (is_number(opts[name]) and 0 <= opts[name] <= 1):
        refuse(opts, name, "must lie in [0, 1]")
  else:
    for name in ("min_mask_ratio", "max_mask_ratio"):
      if not (is_number(opts[name]) and 0 <= opts[name] <= 1):
        refuse(opts, name, "must lie in [0, 1]")
    if opts["min_mask_ratio"] > opts["max_mask_ratio"]:
      refuse(opts, "min_mask_ratio",
             f"must not exceed max_mask_ratio={opts['max_mask_ratio']!r}")
    if not isinstance(opts["complementary"], bool):
      refuse(opts, "complementary", "must be True or False")
    if opts["block_lengths"] is not None:
      try:
        opts["block_lengths"] = parse_block_lengths(opts["block_lengths"])
      except ValueError:
        refuse(opts, "block_lengths", "must be block lengths >= 1, e.g. '8,8,12,12,16,16'")
  return opts


def parse_block_lengths(value) -> tuple[int, ...]:
  """(8, 8, 12, ...) of "8,8,12,..." or a sequence of integers; ValueError otherwise."""
  parts = value.split(",") if isinstance(value, str) else list(value)
  sizes = tuple(int(p) for p in parts)
  if not sizes or any(s < 1 for s in sizes):
    raise ValueError(value)
  return sizes


def resolve_student(config, who: str, free=sft.COMPUTE_FIELDS, check_start=None):
  """`config` with the student's model fields (a copy): the start's when it starts from a
  workdir (`check_start(init_from, fields)` may refuse them), the base model's defaults where
  a fresh student's config leaves them; `free` fields a run may change. `who` names the
  student in the error a published start gets."""
  init_from = config.get("train", {}).get("init_from")
  resolved = ml_collections.ConfigDict(config.to_dict())
  fields, defaults = {}, {}
  if init_from:
    where = start_point.workdir_of(init_from, "train.init_from",
                                   f"{who} starts from a train.py workdir (or fresh)")
    fields = dict(start_point.workdir_start(config, where).get("model") or {})
    if check_start is not None:
      check_start(init_from, fields)
  else:  # a fresh student: the base model's fields where the config leaves them
    defaults = {f.name: f.default for f in dataclasses.fields(models.TransformerConfig)
                if f.default is not dataclasses.MISSING}
  resolved.model = ml_collections.ConfigDict(
      start_point.merged_model(config.model, fields, defaults, free, init_from))
  return resolved


def resolve_config(config):
  """A distillation config checked, its model fields the start's (a copy) when it starts
  from a workdir; any other config unchanged."""
  if config.get("objective") not in NAMES:
    return config
  options(config)
  return resolve_student(config, "a distillation student")


def load_teacher(opts: dict, config, task):
  """The teacher as an `mdjax.Model`, checked against the run's task."""
  path = opts["teacher"]
  try:
    oracle = loader.kind_of(path) == "oracle"
    kwargs = {"task_kwargs": config.task_kwargs.to_dict()} if oracle else {}
    teacher = loader.load(path, **kwargs)
  except ValueError as error:
    raise ConfigError(f"config field distill.teacher={path!r}: {error}") from None
  if teacher.task is None or teacher.task.length != task.length or (
      teacher.vocab_size != task.vocab_size or teacher.mask_id != task.mask_id):
    raise ConfigError(f"config field distill.teacher={path!r}: its task ("
                      f"{getattr(teacher.task, 'name', None)}) is not the run's {task.name!r} "
                      f"of length {task.length} and {task.vocab_size} ids.")
  if not 0 <= opts["prompt_length"] < task.length:
    raise ConfigError(f"config field distill.prompt_length={opts['prompt_length']!r} must lie "
                      f"in [0, {task.length - 1}] (the task's length is {task.length}).")
  return teacher


def teacher_spec(generated: int, opts: dict) -> sampling.SamplerSpec:
  """The pool's sampler, `generated` steps at distill.temperature: the references' LLaDA
  low-confidence remasking (the drawn token's probability, one position a step, LLaDA's even
  counts), or with teacher_sampler 'ancestral' MD4's ancestral sampler (the teacher's law)."""
  # CDLM's knobs have no teacher_sampler: its pool is always the references'.
  if opts.get("teacher_sampler", TEACHER_SAMPLERS[0]) == "ancestral":
    return sampling.AncestralSpec(steps=generated, temperature=float(opts["temperature"]),
                                  block_length=opts["teacher_block_length"])
  return sampling.ConfidenceSpec(steps=generated, score="prob", count_rule="even",
                                 temperature=float(opts["temperature"]),
                                 block_length=opts["teacher_block_length"])


POOL_STREAMS = ("prompts", "teacher", "order")  # key(config.seed) split in this order


def pool_keys(seed: int) -> dict:
  """The teacher pool's random streams by name: split(key(seed), 3) in `POOL_STREAMS` order."""
  return dict(zip(POOL_STREAMS, jax.random.split(jax.random.key(seed), len(POOL_STREAMS))))


def teacher_pool(teacher, spec, task, num_prompts: int, prompt_length: int, seed: int,
                 chunk: int = 1024) -> tuple[np.ndarray, np.ndarray]:
  """The teacher's decodings of `num_prompts` prompts drawn from the task's law (positions
  [0, prompt_length) of its rows; the rest masked): (final tokens, write steps), N x L."""
  keys = pool_keys(seed)
  data = np.array(task.sample_data(keys["prompts"], num_prompts), np.int32)
  data[:, prompt_length:] = teacher.mask_id
  row_keys = jax.random.split(keys["teacher"], num_prompts)  # a row's draws: its own key
  tokens, writes = [], []
  for start in range(0, num_prompts, chunk):
    canvas = data[start:start + chunk]
    fixed = np.zeros(canvas.shape, bool)
    fixed[:, :prompt_length] = True
    out = sampling.sample(teacher.denoiser, teacher.params, row_keys[start:start + chunk],
                          canvas, spec, fixed, mask_id=teacher.mask_id)
    tokens.append(np.asarray(out.tokens_BxL))
    writes.append(np.asarray(out.write_step_BxL))
  return np.concatenate(tokens), np.concatenate(writes)


def pool_rows(step, key, batch: int, num: int, order_key):
  """The pool rows of a training step: the batch's slice of the epochs' order (each epoch
  one permutation of the pool, from `order_key`), as a data loader shuffling a fixed
  dataset each epoch; without a step (evaluation) `batch` rows drawn from `key`."""
  if step is None:
    return jax.random.randint(key, (batch,), 0, num)
  index_B = jnp.asarray(step, jnp.int32) * batch + jnp.arange(batch)
  epoch_B = index_B // num
  first = epoch_B[0]
  orders = jnp.stack([jax.random.permutation(jax.random.fold_in(order_key, first + e), num)
                      for e in range(2)])  # a batch spans at most two epochs (batch <= num)
  return orders[epoch_B - first, index_B % num]


def _loss_fn(config, apply_fn, task):
  opts = options(config)
  teacher = load_teacher(opts, config, task)
  prompt = opts["prompt_length"]
  generated = task.length - prompt
  spec = teacher_spec(generated, opts)
  num_teacher_steps = sampling.num_steps(spec, task.length)
  num = opts["num_prompts"]
  if num < config.batch_size:
    raise ConfigError(f"config field distill.num_prompts={num!r} must be at least the batch "
                      f"({config.batch_size}).")
  targets_NxL, writes_NxL = map(jnp.asarray, teacher_pool(teacher, spec, task, num, prompt,
                                                          config.seed))
  order_key = pool_keys(config.seed)["order"]
  common = dict(prompt_length=prompt, mask_id=task.mask_id,
                temperature=float(opts["entropy_temperature"]),
                entropy_weight=float(opts["entropy_weight"]))
  sizes = None
  if config.objective == "d3llm":
    sizes = opts["block_lengths"] or d3llm.scaled_block_lengths(
        opts["teacher_block_length"] or generated)
  total = config.train.num_steps

  def loss(params, key, x_BxL, step=None):
    row_key, ratio_key, key = jax.random.split(key, 3)
    rows_B = pool_rows(step, row_key, x_BxL.shape[0], num, order_key)
    target_BxL, write_BxL = targets_NxL[rows_B], writes_NxL[rows_B]
    if config.objective == "dparallel":
      return dparallel.certainty_forcing_loss(
          apply_fn, params, key, target_BxL, block_length=opts["block_length"] or generated,
          mask_ratio=float(opts["mask_ratio"]), eps=float(opts["eps"]), **common)
    # d3LLM's global_step / max_steps (without a step: the end of training).
    progress = 1.0 if step is None else jnp.asarray(step, jnp.float32) / total
    block, low = d3llm.curriculum(progress, sizes, opts["min_mask_ratio"],
                                  opts["max_mask_ratio"])
    ratio = jax.random.uniform(ratio_key, (), minval=low, maxval=opts["max_mask_ratio"])
    return d3llm.pseudo_trajectory_loss(
        apply_fn, params, key, target_BxL, write_BxL, num_teacher_steps=num_teacher_steps,
        block_length=block, mask_ratio=ratio, complementary=opts["complementary"], **common)

  loss.takes_step = True  # the train step passes step=state.step (the pool's order, curricula)
  return loss


def start_model(config, task):
  """The student's start: `train.init_from`'s workdir (its newest checkpoint, float32), or
  None for a fresh model."""
  return sft.start_model(config, task)


for _name in NAMES:
  objectives.register(objectives.Objective(
      _name, _loss_fn, held_out_loss_fn=objectives.held_out_nelbo_fn,
      resolve_config=resolve_config, start_model=start_model))
