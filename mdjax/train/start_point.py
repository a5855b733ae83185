"""The model a fine-tuning run starts from (`train.init_from`): one check of a train.py workdir
as a start, one merge of the run's model fields with the start's. Used by the objectives that
resolve their own start (distillation, CDLM, RL)."""

from __future__ import annotations

from mdjax.tasks import sft as sft_data
from mdjax.train import state_io
from mdjax.train.config_checks import ConfigError


def workdir_of(start: str, field: str, only: str) -> str:
  """The workdir a start path (`train.init_from`, a teacher) names; a ConfigError naming
  `field` when it names none, or a published folder (`only` says what is allowed)."""
  try:
    kind, where = sft_data.split_start(start)
  except ValueError as error:
    raise ConfigError(f"config field {field}: {error}") from None
  if kind != "workdir":
    raise ConfigError(f"config field {field}: {only}")
  return where


def workdir_start(config, where: str) -> dict:
  """The saved config of the workdir `where` the run starts from: readable (its sizes checked
  against its arrays) and trained on the run's task; a ConfigError naming the field otherwise."""
  try:
    saved, _ = state_io.start_config(where)
  except ValueError as error:
    raise ConfigError(f"config field train.init_from: {error}") from None
  if saved.get("task") != config.task:
    raise ConfigError(f"config field task={config.task!r}: the start point {where!r} was "
                      f"trained on task {saved.get('task')!r}.")
  return saved


def merged_model(config_model, start_fields: dict, defaults: dict, free: tuple[str, ...],
                 init_from) -> dict:
  """The run's model fields: each the config's where it sets one, else the start's, else the
  default. A field the config sets to other than the start's is a ConfigError, except the
  `free` ones (compute knobs, a student's own attention), which a run may change."""
  model = {}
  for name in sorted(set(config_model.keys()) | set(start_fields)):
    value = config_model.get(name)
    if value is None:
      model[name] = start_fields.get(name, defaults.get(name))
    elif name in start_fields and name not in free and value != start_fields[name]:
      raise ConfigError(f"config field model.{name}={value!r} differs from the start point's "
                        f"{start_fields[name]!r} ({init_from}); leave it unset.")
    else:
      model[name] = value
  return model
