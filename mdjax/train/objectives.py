"""The training objectives, one table: name -> `Objective` (`config.objective` looks it up).

An objective is its training loss and, where it has them, the rest of what a run of it does
differently: the config it completes before the checks, the model it starts from, the loss
its held-out evaluation reports, whether evaluation draws samples, and what a finished run
exports. The train state (`state.init_state`, `state.make_loss_fn`) and loop (`loop.train`)
ask the table and name no objective.

Built in here: 'nelbo' (MD4's NELBO; the block NELBO for `model.block_size` models; under
`config.noise` "uniform" or "hybrid" UDLM's / GIDD's NELBO, `mdjax.noise.gidd_loss`), 'mlm'
(BERT-style corruption) and 'causal' (next-token cross-entropy). An objective elsewhere
registers itself on import (`register`), as `mdjax.train.sft` does for 'sft' (and gives
'nelbo' its start points), `mdjax.train.a2d` for 'a2d' and `mdjax.rl` for 'grpo' and 'wd1';
importing `mdjax.train` imports the first two, like the sampler families of `mdjax.sampling`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable

import ml_collections

from mdjax import diffusion
from mdjax import noise as noise_lib


@dataclasses.dataclass(frozen=True)
class Objective:
  """A training objective.

  loss_fn(config, apply_fn, task) -> loss(params, key, x_BxL) -> (loss, aux): the training
  loss; aux["bits_per_token"] is what the held-out evaluation reports.
  held_out_loss_fn: the same signature, the loss whose bits per token the evaluation reports;
  None: the training loss itself.
  resolve_config(config) -> config: runs on every config before the checks (`resolve_config`
  below); an objective that owns config fields fills and checks them, any other config is
  returned unchanged. None: nothing to do.
  start_model(config, task) -> (graphdef, params, apply_fn), or None for a fresh model
  (`models.init`): the model a run starts from (SFT: its start point's). None: always fresh.
  export(config, state, workdir, log) -> path or None: what a finished run writes besides its
  checkpoints (process 0, at the final step); `workdir_folders` are the folders it writes
  there, allowed in a workdir by the entry check.
  samples: the evaluation draws unconditional samples (`num_eval_samples`): a diffusion model.
  run(config, workdir, log, interrupts) -> final state: a loop of its own (RL: rollouts,
  rewards, inner updates), run by `loop.train` in place of the supervised loop, after the
  config checks and under the workdir's lock and signal handlers. None: the supervised loop.
  teacher_copy: the train state keeps a copy of the student's trained parameters
  (`TrainState.teacher_params`, a LoRA run's adapters), set to the student's at every step
  that is a multiple of the loss's `teacher_every` attribute and passed to the loss as
  `teacher_params=` (DUO's teacher: the student of the round before); checkpointed with it.
  """

  name: str
  loss_fn: Callable[..., Callable]
  held_out_loss_fn: Callable[..., Callable] | None = None
  resolve_config: Callable[[Any], Any] | None = None
  start_model: Callable[..., Any] | None = None
  export: Callable[..., str | None] | None = None
  workdir_folders: tuple[str, ...] = ()
  samples: bool = True
  run: Callable[..., Any] | None = None
  teacher_copy: bool = False


OBJECTIVES: dict[str, Objective] = {}


def register(objective: Objective) -> Objective:
  """Makes an objective known to the config checks, the train state and the loop."""
  OBJECTIVES[objective.name] = objective
  return objective


# Objectives that modules outside mdjax.train register (train.py imports them), by the module
# that does: `ensure` imports it, so a saved run of one loads anywhere (`mdjax.load`) with
# the train state it was saved with (DUO's holds its teacher).
REGISTERED_BY = {"dparallel": "mdjax.accelerators.distill",
                 "d3llm": "mdjax.accelerators.distill", "cdlm": "mdjax.accelerators.cdlm",
                 "duo": "mdjax.accelerators.duo"}


def ensure(name) -> None:
  """Registers the objective `name` by importing its module (`REGISTERED_BY`) if it is not
  known yet; anything else is left to the checks."""
  if name not in OBJECTIVES and name in REGISTERED_BY:
    importlib.import_module(REGISTERED_BY[name])


def get(name: str) -> Objective:
  """The objective `name`; a ValueError naming it and the known ones otherwise."""
  if name not in OBJECTIVES:
    raise ValueError(f"objective={name!r} must be one of {tuple(OBJECTIVES)}.")
  return OBJECTIVES[name]


def resolve_config(config):
  """The config every objective's `resolve_config` hook leaves, in turn (each returns a config
  that is not its own unchanged): SFT fills the model fields a start point decides."""
  for objective in OBJECTIVES.values():
    if objective.resolve_config is not None:
      config = objective.resolve_config(config)
  return config


def start_model(config, task):
  """(graphdef, params, apply_fn) the configured objective starts from, or None for a fresh
  model (an objective without a start, or one the checks will refuse)."""
  objective = OBJECTIVES.get(config.get("objective"))
  hook = None if objective is None else objective.start_model
  return None if hook is None else hook(config, task)


def workdir_folders() -> tuple[str, ...]:
  """The folders the objectives' exports write in a workdir."""
  return tuple(folder for objective in OBJECTIVES.values()
               for folder in objective.workdir_folders)


# ----------------------------------------------------------------------------
# The losses' knobs.
# ----------------------------------------------------------------------------


def masking_schedule(config) -> diffusion.Schedule:
  """The configured masking schedule, e.g. schedule='polynomial', schedule_kwargs.power=3."""
  kwargs = config.get("schedule_kwargs", ml_collections.ConfigDict()).to_dict()
  return diffusion.get_schedule(config.schedule, **kwargs)


def noise_name(config) -> str:
  """The configured forward process's name; "absorbing" for a config written before `noise`."""
  return config.get("noise", "absorbing")


def _plain(value) -> dict:
  return value.to_dict() if hasattr(value, "to_dict") else dict(value or {})


def noise_process(config, vocab_size: int) -> noise_lib.NoiseProcess:
  """The configured forward process over `vocab_size` tokens: `noise` with the masking
  `schedule` and, for "hybrid", the `hybrid` fields (p_uniform, gamma)."""
  name = noise_name(config)
  fields = _plain(config.get("hybrid")) if name == "hybrid" else {}
  return noise_lib.get(name, vocab_size, schedule=masking_schedule(config), **fields)


def process_fields(config) -> dict:
  """What fixes the process a model was trained under (a config or a saved config's dict),
  compared on resume: the noise's name and, for uniform or hybrid noise, the schedule and
  the hybrid's fields (an absorbing run's schedule may change on resume, as before)."""
  name = noise_name(config)
  fields = {"noise": name}
  if name != "absorbing":
    fields.update(schedule=config.get("schedule"),
                  schedule_kwargs=_plain(config.get("schedule_kwargs")))
  if name == "hybrid":
    fields["hybrid"] = _plain(config.get("hybrid"))
  return fields


def block_nelbo_options(config) -> dict:
  """t_min, t_max and antithetic of the block NELBO (config.block_nelbo, defaults if absent)."""
  options = dict(t_min=1e-5, t_max=1.0, antithetic=True)
  options.update(config.get("block_nelbo", ml_collections.ConfigDict()).to_dict())
  return options


# ----------------------------------------------------------------------------
# The built-in objectives.
# ----------------------------------------------------------------------------


def _nelbo_fn(config, apply_fn, task, training: bool) -> Callable:
  if noise_name(config) != "absorbing":  # UDLM's / GIDD's; held out: the NELBO itself
    weighting = _plain(config.get("gidd")) if training else {}
    return functools.partial(noise_lib.gidd_loss, apply_fn,
                             process=noise_process(config, task.vocab_size), **weighting)
  schedule = masking_schedule(config)
  if config.model.get("block_size") is not None:
    options = block_nelbo_options(config) if training else {}
    return functools.partial(diffusion.block_nelbo_loss, apply_fn, schedule=schedule,
                             mask_id=task.mask_id, block_size=config.model.block_size, **options)
  return functools.partial(diffusion.nelbo_loss, apply_fn, schedule=schedule, mask_id=task.mask_id)


def nelbo_loss_fn(config, apply_fn, task) -> Callable:
  """MD4's NELBO; for a block_size model the block NELBO with `block_nelbo_options`; under
  uniform or hybrid `noise`, `noise.gidd_loss` with the `gidd` weighting."""
  return _nelbo_fn(config, apply_fn, task, training=True)


def held_out_nelbo_fn(config, apply_fn, task) -> Callable:
  """The held-out NELBO: for a block_size model the block NELBO over the full time range (a
  bound, whatever range training clips to); under uniform or hybrid noise the NELBO of that
  process (GIDD's weighting "elbo", whatever weighting training uses)."""
  return _nelbo_fn(config, apply_fn, task, training=False)


def mlm_loss_fn(config, apply_fn, task) -> Callable:
  """The BERT-style corruption loss with the `config.mlm` knobs."""
  corruption = diffusion.MlmCorruption(**config.get("mlm", ml_collections.ConfigDict()).to_dict())
  return functools.partial(diffusion.mlm_loss, apply_fn, vocab_size=task.vocab_size,
                           mask_id=task.mask_id, corruption=corruption)


def causal_loss_fn(config, apply_fn, task) -> Callable:
  """Next-token cross-entropy of a left-to-right model (the mask id is its start token)."""
  if not config.model.causal:
    raise ValueError("objective='causal' needs model.causal=True (a left-to-right model).")
  return functools.partial(diffusion.causal_lm_loss, apply_fn, start_id=task.mask_id)


register(Objective("nelbo", nelbo_loss_fn, held_out_loss_fn=held_out_nelbo_fn))
register(Objective("mlm", mlm_loss_fn, held_out_loss_fn=held_out_nelbo_fn))
register(Objective("causal", causal_loss_fn, samples=False))
